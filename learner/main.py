"""The learner process (one per rank, started by the deepspeed launcher).

    deepspeed --num_gpus R -m asyncvla.learner.main CONFIG [key=value ...]   (or: asyncvla train)

Each rank pulls its own segments; rank 0 also runs the control server (actor registry) and the
weight server. The loop, once per update:
    inbox      wait for this rank's share of trajectory columns (the lag rule drops stale ones)
    update     V-trace targets + PPO epochs on the ZeRO-3 engine
    publish    every publish_interval: gather the trainable weights (all ranks), EMA, serve (rank 0)
    report     every rank's figures combined (one collective), logged by rank 0
    checkpoint every save_interval (with the segment accounting: RUN/accounting/); stop at the budget
               (updates, env steps or time)
At the end — by the budget, or by SIGTERM/SIGINT (`asyncvla train` forwards Ctrl-C as SIGTERM),
which every rank notices at the same update boundary — a final checkpoint, then a "shutdown"
to the actors.

Finite or stop: an optimizer step with a non-finite loss or gradient norm is skipped and counted
(update.FiniteGuard); learner.max_nonfinite_steps of them in a row end the run. Before every
publish and every save the trainable weights, and the policy's outputs on the batch just trained
on, are checked: non-finite ones are never served nor saved, and count as a non-finite step (the
step that made them). Such an end (without a final save: the newest complete checkpoint stays the
one to resume from), or a final checkpoint that could not be written, exits non-zero after one line
saying why. Checkpoints must be writable from the start: every rank tries before anything is built.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from asyncvla.common import placement, transport
from asyncvla.common.allocator import keep_freed_buffers
from asyncvla.common.auth import ensure_join_secret
from asyncvla.common.config import Config, ConfigError, load_config, parse_overrides, to_dict, to_yaml
from asyncvla.common.policy import VLAPolicy
from asyncvla.common.protocol import SegmentSpec
from asyncvla.common.rundir import CHECKPOINTS, LEARNER_END, run_dir as run_dir_of_config, write_end
from asyncvla.common.signals import stop_on_signals
from asyncvla.common.sockets import printable
from asyncvla.common.trackers import open_trackers
from asyncvla.learner import checkpoint, engine as ds_engine
from asyncvla.learner.ingest import Inbox, PoisonCounts, rollout_plan
from asyncvla.learner.metrics import Metrics, TargetWatch, group, write_accounting
from asyncvla.learner.publish import EmaPublisher, Publisher, trainable_finite
from asyncvla.learner.starvation import Roster, StarvationWatch, wait_for_actors
from asyncvla.learner.update import FiniteGuard, NonFiniteError, outputs_finite, update
from asyncvla.learner.value_norm import ValueNorm

log = logging.getLogger("asyncvla.learner")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="asyncvla.learner.main", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # set by the launcher
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config, parse_overrides(args.overrides))
    except ConfigError as e:
        raise SystemExit(f"asyncvla learner: config error: {e}")
    logging.basicConfig(level=cfg.logging.level, format="%(asctime)s learner %(levelname)s %(message)s")
    _pin_to_cores(cfg)
    return run(cfg)


def run(cfg: Config) -> int:
    stop = stop_on_signals()           # before the rendezvous, so a stop during start-up is kept
    ds_engine.init_distributed(cfg)
    rank, world, device = dist.get_rank(), dist.get_world_size(), _device()
    cols = _check_geometry(cfg, world)                 # trajectory columns per rank and update
    run_dir, resume_from = run_dir_of_config(cfg), _resume_point(cfg)
    _check_writable(run_dir / CHECKPOINTS)
    engine, policy_dir = _build_engine(cfg, run_dir, cols, device)
    try:
        step, version, env_steps, ema, value_norm = _restore(engine, resume_from, cfg, rank)
    except checkpoint.CheckpointError as e:
        if rank == 0:     # what to resume from instead, for the launcher's last words
            tag = e.instead if e.refused is not None else resume_from
            _write_end(run_dir, "failed", 0, tag, None if tag is None else checkpoint.read_marker(tag)["step"])
        raise SystemExit(f"asyncvla learner: {e}")
    start_step = step
    metrics = Metrics(open_trackers(cfg, run_dir, "learner") if rank == 0 else None, cfg.learner.max_steps,
                      cfg.logging.progress, start_step=step, env_steps=env_steps, eval_dir=run_dir / "eval",
                      success_window=cfg.learner.target_success_episodes)
    auth_key = _token_key(cfg)
    if cfg.transport.reuse_receive_buffers:
        keep_freed_buffers()           # before the first segment: see common/allocator.py
    spec = SegmentSpec.for_policy(cfg, engine.module.head, engine.module.action_tokenizer)
    receiver = transport.TrajectoryReceiver(cfg.transport, rank, spec, auth_key=auth_key)
    endpoints = _all_gather(receiver.endpoint)
    servers = _serve(cfg, run_dir, policy_dir, endpoints, world, lambda: version, metrics, auth_key) \
        if rank == 0 else ()
    hunger = StarvationWatch(cfg.learner.starvation_timeout_s, rank, registry=servers[0].counts if servers else None)
    roster = Roster(run_dir, servers[0].actor_ids) if servers else None

    def on_segment(segment, lag: int) -> None:
        metrics.add_segment(segment, lag)
        hunger.fed(segment.meta["actor_id"])
    inbox = Inbox(receiver, cfg.learner.max_policy_lag, on_segment=on_segment,
                  watchdog=lambda: (_check_alive(servers), hunger.check(), roster and roster.update()),
                  count_gaps=world == 1)
    publisher = Publisher(ema, servers[1] if servers else None)
    if not _weights_finite(engine, device):
        raise SystemExit("asyncvla learner: the initial trainable weights are non-finite (policy.pretrained_path "
                         "or the checkpoint resumed from holds NaN or inf)")
    # version 0 is the initial weights; a resumed run serves its checkpoint's EMA weights as saved
    publish_s = publisher.publish(engine, version, step) if resume_from is None else publisher.republish(version, step)

    guard, save_failures = FiniteGuard(cfg.learner.max_nonfinite_steps), 0
    poison = PoisonCounts(cfg.learner.max_poisoned_columns)
    failure, stopped = None, False    # why the run ends non-zero; whether a signal ended it
    saved_at = start_step             # the step of the newest checkpoint of this run's branch ...
    saved_tag = resume_from           # ... and that checkpoint (None: nothing saved yet)
    target = TargetWatch(cfg.learner.target_success, cfg.learner.target_success_episodes)
    if servers and cfg.learner.min_actors:       # (the other ranks wait at the first update's collectives)
        wait_for_actors(cfg.learner.min_actors, servers[0].actor_ids, stop)
        hunger.restart()
    started = time.perf_counter()
    while step < cfg.learner.max_steps:
        t0 = time.perf_counter()
        inbox.fill(cols, version, stop)
        if _any_rank(stop.is_set(), device):     # one rank's signal stops all at this boundary
            log.info("stop requested: ending at step %d", step)
            stopped = True
            break
        t1 = time.perf_counter()
        batch = inbox.take(cols)
        try:
            stats = update(engine, batch, cfg, device, step, guard, value_norm)
            poisoned_by = stats.pop("poisoned_by")
            step += 1
            publish_now = step % cfg.learner.publish_interval == 0
            save_now = bool(cfg.checkpoint.save_interval) and step % cfg.checkpoint.save_interval == 0
            unfit = _unfit(engine, batch, cfg, device) if publish_now or save_now else None
            if unfit is not None:                # (the step made them so: it counts as non-finite)
                publish_now = save_now = False
                guard.after_step(step, False, f"{unfit}; neither published nor saved")
        except NonFiniteError as e:              # (every rank: the verdicts are collective)
            failure = str(e)
            break
        t2 = time.perf_counter()
        if publish_now:
            version += 1
            publish_s = publisher.publish(engine, version, step)
        scalars = {**group(stats), "time/learner_idle_s": t1 - t0, "time/learner_step_s": t2 - t1,
                   "time/publish_s": publish_s, "train/actor/lr": engine.get_lr()[0], "rollout/version": version,
                   "system/nonfinite_steps": guard.skipped, "system/checkpoint_failures": save_failures,
                   "system/seq_gaps": inbox.seq_gaps}
        report = metrics.report(step, scalars, inbox.drops, samples=cols * cfg.actor.rollout_length * world,
                                device=device, time_up=_time_up(cfg, started), rank0_only=_server_figures(servers))
        if report["system/poisoned_columns"]:         # (every rank sees the sum: all gather who sent them)
            _ban_poisoners(poison.add(a for ids in _all_gather(poisoned_by) for a in ids), step, inbox, servers,
                           cfg.learner.max_poisoned_columns)
        if save_now:
            tag = _save(engine, run_dir, step, version, metrics.env_steps, ema, value_norm, cfg)
            if tag is None:
                save_failures += 1
            else:
                saved_at, saved_tag = step, tag
            write_accounting(run_dir, step, inbox, servers,     # acked = trained + dropped + buffered
                             nonfinite_steps=guard.skipped, checkpoint_failures=save_failures)
        if report["time_up"] or (cfg.learner.max_env_steps and metrics.env_steps >= cfg.learner.max_env_steps):
            break
        if target.update(report.get("env/episode_success_window"), int(report["env/episodes"])):  # (all ranks)
            log.info("target reached: success held at or above learner.target_success=%s over two windows of "
                     "%d+ episodes in a row (the newest: %.0f %%)", cfg.learner.target_success,
                     cfg.learner.target_success_episodes, 100 * report["env/episode_success_window"])
            break

    # (a run stopped before its first update has nothing new; re-saving the step it resumed from
    # would replace the very checkpoint it stands on. A periodic save of the last step that failed
    # is tried once more.)
    if failure is None and step != saved_at:
        failure, tag = _final_save(engine, batch, run_dir, step, version, metrics.env_steps, ema, value_norm, cfg,
                                   device)
        save_failures += failure is not None
        saved_at, saved_tag = (saved_at, saved_tag) if tag is None else (step, tag)
    write_accounting(run_dir, step, inbox, servers, nonfinite_steps=guard.skipped, checkpoint_failures=save_failures)
    ended = "failed" if failure is not None else "stopped" if stopped else "budget"
    if rank == 0:
        _write_end(run_dir, ended, step, saved_tag, None if saved_tag is None else saved_at, stop.signum)
    if failure is not None and rank == 0:
        log.error("stopped: %s", failure)
    elif failure is None:
        log.info("%s at step %d (version %d)", "stopped" if ended == "stopped" else "finished", step, version)
    metrics.close()
    if servers:
        control, weight_server = servers
        control.close(final_version=version)     # "shutdown" names the last version published
        weight_server.close()
    inbox.receiver.close()
    ds_engine.close_distributed()
    return 0 if failure is None else 1


# ----------------------------------------------------------------------------------- set-up
def _pin_to_cores(cfg: Config) -> None:
    """Pin this rank to its slice of launch.placement.learner (nothing with `all`). The deepspeed
    launcher tells a rank its place among the ranks of its machine: LOCAL_RANK of LOCAL_SIZE."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_ranks = int(os.environ.get("LOCAL_SIZE", cfg.launch.num_learner_ranks))
    plan = placement.plan(cfg.launch.placement, local_ranks, cfg.launch.num_local_actors,
                          placement.available_cores())
    if plan.pin_learner:
        placement.apply(plan.learner[local_rank])
        log.info("local rank %d pinned to cores %s", local_rank, placement.compact(plan.learner[local_rank]))


def _resume_point(cfg: Config):
    """The checkpoint to resume from (checkpoint.resume names a run, its checkpoints or one), or None."""
    if not cfg.checkpoint.resume:
        return None
    try:
        return checkpoint.resolve(cfg.checkpoint.resume)
    except checkpoint.CheckpointError as e:
        raise SystemExit(f"asyncvla learner: checkpoint.resume: {e}")


def _build_engine(cfg: Config, run_dir: Path, cols_per_rank: int, device):
    """The policy (built once by rank 0 into RUN/policy_init, loaded by every rank) in its engine."""
    # The same seed on every rank gives the same initial weights before ZeRO-3 partitions them.
    torch.manual_seed(cfg.actor.seed)
    policy_dir = run_dir / "policy_init"
    if dist.get_rank() == 0 and not (policy_dir / "policy.json").exists():
        VLAPolicy.build(cfg.policy).save_pretrained(policy_dir)
    dist.barrier()
    policy = VLAPolicy.from_pretrained(policy_dir, device=device)
    engine = ds_engine.build_engine(policy, cfg, gradient_accumulation_steps=_micro_per_minibatch(cfg, cols_per_rank))
    return engine, policy_dir


def _restore(engine, resume_from, cfg: Config, rank: int):
    """(step, version, env_steps, EMA publisher on rank 0 / None, ValueNorm / None) of a fresh or
    resumed run."""
    ema = EmaPublisher(cfg.learner.rollout_ema_decay) if rank == 0 else None
    value_norm = ValueNorm(cfg.algorithm.value_norm_decay) if cfg.algorithm.value_norm else None
    if resume_from is None:
        return 0, 0, 0, ema, value_norm
    state = checkpoint.load(engine, resume_from, config=cfg)      # (CheckpointError: the caller's)
    if ema is not None:
        ema.load_state_dict(state["ema"])
    if value_norm is not None and state.get("value_norm"):   # (none in a run saved without it: start anew)
        value_norm.load_state_dict(state["value_norm"])
    log.info("resumed from %s at step %d, version %d", resume_from, state["step"], state["version"])
    if rank == 0:               # (this run is the resumed checkpoint's branch from now on)
        for moved in checkpoint.adopt(resume_from):
            log.info("checkpoint %s was saved after the one resumed from: moved to %s", moved.name, moved.parent)
    return state["step"], state["version"], state["env_steps"], ema, value_norm


def _serve(cfg: Config, run_dir: Path, policy_dir: Path, endpoints: list, world: int, version_fn, metrics,
           auth_key: bytes | None):
    """Rank 0's servers: (control server, weight server). A joining actor's welcome carries the
    config, the endpoints, the policy and its rollout plan (`ingest.rollout_plan`)."""
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    metrics.text("config", "```\n" + to_yaml(cfg) + "\n```")
    weights = transport.WeightServer(cfg.transport, auth_key=auth_key)

    def welcome(hello: dict) -> dict:
        return {"config": to_dict(cfg), "trajectory_endpoints": endpoints, "weights_endpoint": weights.endpoint,
                "weight_version": version_fn(), "policy": {"path": str(policy_dir.resolve())},
                "rollout": rollout_plan(cfg, world, hello["num_envs"] or cfg.actor.num_envs)}
    # Without CURVE keys only holders of the run's join secret may say hello (common/auth.py).
    secret = None if cfg.transport.keys_dir else ensure_join_secret(run_dir)
    control = transport.ControlServer(cfg.transport, welcome_fn=welcome, policy_dir=str(policy_dir),
                                      auth_key=auth_key, join_secret=secret)
    log.info("run dir %s; actors join at %s", run_dir, control.endpoint)
    return control, weights


# --------------------------------------------------------------------------------- helpers
def _save(engine, run_dir, step, version, env_steps, ema, value_norm, cfg, final: bool = False) -> Path | None:
    """The checkpoint's tag dir, or None when it failed (logged by save(), the same on every rank)."""
    # save() adds every rank's RNG state
    state = {"step": step, "version": version, "env_steps": env_steps,
             "config": to_dict(cfg), "ema": ema.state_dict() if ema is not None else None,
             "value_norm": value_norm.state_dict() if value_norm is not None else None}
    return checkpoint.save(engine, run_dir, step, state, keep_last=cfg.checkpoint.keep_last, final=final)


def _write_end(run_dir, *record) -> None:
    try:
        write_end(run_dir, *record)
    except OSError as e:                 # (the launcher then cannot call it a finish: it says so)
        log.error("the run's end record %s was not written: %s", run_dir / LEARNER_END, e)


def _final_save(engine, batch, run_dir, step, version, env_steps, ema, value_norm, cfg, device):
    """Save the last update's state (`batch`: its data): (None, the tag dir), or (why the run must
    end non-zero, None)."""
    unfit = _unfit(engine, batch, cfg, device)
    if unfit is not None:
        return f"update {step}: {unfit}; not saved", None
    tag = _save(engine, run_dir, step, version, env_steps, ema, value_norm, cfg, final=True)
    if tag is None:
        return f"the final checkpoint (update {step}) could not be written (see the error above)", None
    return None, tag


def _unfit(engine, batch, cfg, device) -> str | None:
    """None when the weights may be served and saved, else what is wrong with them (collectives:
    every rank calls it)."""
    if not _weights_finite(engine, device):
        return "the trainable weights are non-finite"
    if not outputs_finite(engine, batch, cfg, device):
        return "the policy's outputs on its last batch are non-finite (its weights are finite)"
    return None


def _weights_finite(engine, device) -> bool:
    """Every rank's part of the trainable weights is finite (a collective: all ranks call it)."""
    return not _any_rank(not trainable_finite(engine), device)


def _check_writable(root: Path) -> None:
    """Stop at start-up, with the system's own reason, where this run could never save: every rank
    writes its shard of each checkpoint (all ranks agree, so none is left waiting)."""
    problems = _all_gather(checkpoint.probe_writable(root))
    bad = next(((r, p) for r, p in enumerate(problems) if p), None)
    if bad is not None:
        raise SystemExit(f"asyncvla learner: checkpoints cannot be written in {root} (rank {bad[0]}): {bad[1]}; "
                         "they go to RUN/checkpoints, RUN = logging.output_dir/logging.experiment_name (or "
                         "checkpoint.resume's run): set logging.output_dir to a writable place")


def _check_geometry(cfg: Config, world: int) -> int:
    """Trajectory columns per rank; the batch must split evenly into ranks and minibatches."""
    total = cfg.learner.batch_trajectories
    if total % world:
        raise SystemExit(f"asyncvla learner: learner.batch_trajectories={total} must be a multiple of "
                         f"the number of learner ranks ({world})")
    per_rank = total // world
    if (per_rank * cfg.actor.rollout_length) % cfg.algorithm.num_minibatches:
        raise SystemExit(f"asyncvla learner: algorithm.num_minibatches={cfg.algorithm.num_minibatches} "
                         f"must divide the samples per rank ({per_rank} columns x "
                         f"{cfg.actor.rollout_length} steps)")
    return per_rank


def _micro_per_minibatch(cfg: Config, cols_per_rank: int) -> int:
    per_minibatch = cols_per_rank * cfg.actor.rollout_length // cfg.algorithm.num_minibatches
    return -(-per_minibatch // cfg.learner.micro_batch_size)


def _ban_poisoners(actors: list[str], step: int, inbox: Inbox, servers, limit: int) -> None:
    """Refuse from now on the segments (every rank) and requests (rank 0) of these actors: their
    columns kept coming out non-finite (learner.max_poisoned_columns)."""
    for actor in actors:
        inbox.ban(actor)
        if servers:
            servers[0].ban(actor)
            log.warning("update %d: actor %s banned: its columns came out non-finite in updates %d times "
                        "(learner.max_poisoned_columns); its segments and requests are refused from now on",
                        step, printable(actor), limit)


def _check_alive(servers) -> None:
    """Raise ThreadDied, naming the thread, if a server thread of rank 0 died: without it actors
    could no longer join or get weights, and training would stall without a word."""
    for server in servers:
        server.check()


def _server_figures(servers) -> dict:
    """Rank 0's figures: the actor registry and the requests each server dropped as invalid."""
    if not servers:
        return {}
    control, weights = servers
    return {**{f"system/actors_{k}": v for k, v in control.counts().items()},
            "system/dropped_control_invalid": sum(control.stats["invalid"].values()),
            "system/dropped_weights_invalid": sum(weights.stats["invalid"].values())}


def _device() -> torch.device:
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")



def _token_key(cfg: Config) -> bytes | None:
    """The key actor tokens are signed with (common/auth.py). With CURVE keys every rank derives
    the same one from the learner's secret key (None: the channels' default); without, rank 0
    draws one and shares it, so that every rank's inbox checks the tokens rank 0's control server
    issued (a per-process key would leave ranks > 0 checking nothing)."""
    if cfg.transport.keys_dir:
        return None
    return _all_gather(os.urandom(32) if dist.get_rank() == 0 else None)[0]


def _all_gather(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _any_rank(flag: bool, device) -> bool:
    t = torch.tensor([int(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _time_up(cfg: Config, started: float) -> bool:
    return bool(cfg.learner.max_time_s) and time.perf_counter() - started >= cfg.learner.max_time_s


if __name__ == "__main__":
    raise SystemExit(main())
