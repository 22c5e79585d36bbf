"""The learner process (one per rank, started by the deepspeed launcher).

    deepspeed --num_gpus R -m asyncvla.learner.main CONFIG [key=value ...]   (or: asyncvla train)

Each rank pulls its own segments; rank 0 also runs the control server (actor registry) and the
weight server (learner/link.py). `run` is the loop, once per update:
    fill       wait for this rank's share of columns (the lag rule drops stale ones)
    take       a batch of exactly that many columns
    update     V-trace targets + PPO epochs on the ZeRO-3 engine (learner/update.py)
    publish    every publish_interval: gather the trainable weights (all ranks), EMA, serve (rank 0)
    report     every rank's figures combined (one collective), logged by rank 0
    checkpoint every save_interval, with the segment accounting (RUN/accounting/)
    stop       at the budget: updates, env steps, time or target success (learner/run_state.py)
At the end — by the budget, or by SIGTERM/SIGINT (`asyncvla train` forwards Ctrl-C as SIGTERM),
which every rank notices at the same update boundary — a final checkpoint, the end record the
launcher reads (RUN/learner_end.json), then a "shutdown" to the actors.

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

from asyncvla.common import placement
from asyncvla.common.config import Config, ConfigError, load_config, parse_overrides
from asyncvla.common.policy import build_policy, load_policy
from asyncvla.common.rundir import CHECKPOINTS, run_dir as run_dir_of_config
from asyncvla.common.signals import stop_on_signals
from asyncvla.learner import checkpoint, engine as ds_engine
from asyncvla.learner.collectives import any_rank, gather
from asyncvla.learner.link import ActorLink
from asyncvla.learner.metrics import group
from asyncvla.learner.publish import Publisher, trainable_finite
from asyncvla.learner.run_state import Budget, Checkpointer, TrainState
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
    device, cols = _device(), _check_geometry(cfg, dist.get_world_size())   # cols: columns per rank
    run_dir, resume_from = run_dir_of_config(cfg), _resume_point(cfg)
    _check_writable(run_dir / CHECKPOINTS)
    engine, policy_dir = _build_engine(cfg, run_dir, cols, device)
    publisher = Publisher(cfg.learner.rollout_ema_decay, rank0=dist.get_rank() == 0)
    state = _restore(engine, resume_from, cfg, run_dir, publisher)
    link = ActorLink(cfg, run_dir, policy_dir, engine, lambda: state.version, state, device)
    saves = Checkpointer(engine, run_dir, cfg, resume_from, state.step, link)
    budget, guard = Budget(cfg, stop, device), FiniteGuard(cfg.learner.max_nonfinite_steps)
    times = publisher.start(engine, state.version, state.step, link.weights, resume_from is not None, device)
    link.wait_for_fleet(stop)
    budget.start(state)
    ended, failure, batch = budget.spent(state), None, None
    while ended is None:
        t0 = time.perf_counter()
        link.inbox.fill(cols, state.version, stop)               # this rank's columns, the lag rule applied
        if budget.stopped():                                     # one rank's signal stops all at this boundary
            ended = "stopped"
            break
        t1 = time.perf_counter()
        batch = link.inbox.take(cols)
        try:
            stats = update(engine, batch, cfg, device, state.step, guard, state.value_norm)
            state.step += 1
            publish, save = state.step % cfg.learner.publish_interval == 0, saves.due(state.step)
            if (publish or save) and not _fit(engine, batch, cfg, device, guard, state.step):
                publish = save = False                           # (never served nor saved)
        except NonFiniteError as e:                              # (every rank: the verdicts are collective)
            failure, ended = str(e), "failed"
            break
        t2 = time.perf_counter()
        if publish:
            state.version += 1
            times = publisher.publish(engine, state.version, state.step)
        report = link.report(state.step, _scalars(stats, engine, state, guard, saves, t1 - t0, t2 - t1, times),
                             stats["poisoned_by"], budget.time_up())
        state.env_steps, state.time_s = link.metrics.env_steps, budget.elapsed()
        if save:
            saves.save(state, publisher.ema_state(), guard.skipped)
        ended = budget.spent(state, report)
    if failure is None:
        failure = _final_save(engine, batch, cfg, device, state, saves, publisher)
    saves.finish("failed" if failure else ended, state, guard.skipped, stop.signum)
    _say_end(ended, failure, state)
    link.close(final_version=state.version)
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
    torch.manual_seed(cfg.learner.seed)
    policy_dir = run_dir / "policy_init"
    if dist.get_rank() == 0 and not (policy_dir / "policy.json").exists():
        build_policy(cfg.policy).save_pretrained(policy_dir)
    dist.barrier()
    policy = load_policy(policy_dir, device=device)
    engine = ds_engine.build_engine(policy, ds_engine.EngineSpec.rl(cfg),
                                    gradient_accumulation_steps=_micro_per_minibatch(cfg, cols_per_rank))
    return engine, policy_dir


def _restore(engine, resume_from, cfg: Config, run_dir: Path, publisher: Publisher) -> TrainState:
    """The state of a fresh run, or of the checkpoint resumed from (its EMA weights into the
    publisher). A checkpoint refused as it loads (damaged, non-finite) ends the run in one line,
    with an end record naming the checkpoint to resume from instead, which the launcher repeats."""
    state = TrainState(value_norm=ValueNorm(cfg.algorithm.value_norm_decay) if cfg.algorithm.value_norm else None)
    if resume_from is None:
        return state
    try:
        saved = checkpoint.load(engine, resume_from, config=cfg)
    except checkpoint.CheckpointError as e:
        tag = e.instead if e.refused is not None else resume_from
        Checkpointer(engine, run_dir, cfg, tag, tag and checkpoint.read_marker(tag)["step"]).record_end("failed", 0, None)
        raise SystemExit(f"asyncvla learner: {e}")
    publisher.restore(saved["ema"])
    state.load(saved)
    log.info("resumed from %s at step %d, version %d", resume_from, state.step, state.version)
    if dist.get_rank() == 0:               # (this run is the resumed checkpoint's branch from now on)
        for moved in checkpoint.adopt(resume_from):
            log.info("checkpoint %s was saved after the one resumed from: moved to %s", moved.name, moved.parent)
    return state


# --------------------------------------------------------------------------------- helpers
def _scalars(stats: dict, engine, state: TrainState, guard, saves: Checkpointer, idle_s: float, step_s: float,
             publish: dict) -> dict:
    """This update's figures on this rank (the same keys on every rank: they are combined)."""
    return {**group({k: v for k, v in stats.items() if k != "poisoned_by"}), "time/learner_idle_s": idle_s,
            "time/learner_step_s": step_s, "time/publish_s": sum(publish.values()),
            **{f"time/publish_{k}": v for k, v in publish.items()}, "train/actor/lr": engine.get_lr()[0],
            "rollout/version": state.version, "system/nonfinite_steps": guard.skipped,
            "system/checkpoint_failures": saves.failures}


def _fit(engine, batch, cfg, device, guard: FiniteGuard, step: int) -> bool:
    """Whether the weights the update left may be served and saved; if not, that step counts as a
    non-finite one (collectives: every rank calls it)."""
    unfit = _unfit(engine, batch, cfg, device)
    if unfit is not None:
        guard.after_step(step, False, f"{unfit}; neither published nor saved")
    return unfit is None


def _final_save(engine, batch, cfg, device, state: TrainState, saves: Checkpointer, publisher) -> str | None:
    """Save the last update's state (`batch`: its data); why the run must end non-zero, or None. A
    run stopped before its first update has nothing new (re-saving the step it resumed from would
    replace the very checkpoint it stands on); a periodic save of the last step that failed is
    tried once more."""
    if state.step == saves.saved_at:
        return None
    unfit = _unfit(engine, batch, cfg, device)
    if unfit is not None:
        saves.failures += 1
        return f"update {state.step}: {unfit}; not saved"
    if not saves.save(state, publisher.ema_state(), final=True):
        return f"the final checkpoint (update {state.step}) could not be written (see the error above)"
    return None


def _say_end(ended: str, failure: str | None, state: TrainState) -> None:
    if failure is not None:
        if dist.get_rank() == 0:
            log.error("stopped: %s", failure)
        return
    if ended == "stopped":
        log.info("stop requested: ending at step %d", state.step)
    log.info("%s at step %d (version %d)", "stopped" if ended == "stopped" else "finished", state.step, state.version)


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
    return not any_rank(not trainable_finite(engine), device)


def _check_writable(root: Path) -> None:
    """Stop at start-up, with the system's own reason, where this run could never save: every rank
    writes its shard of each checkpoint (all ranks agree, so none is left waiting)."""
    problems = gather(checkpoint.probe_writable(root))
    bad = next(((r, p) for r, p in enumerate(problems) if p), None)
    if bad is not None:
        raise SystemExit(f"asyncvla learner: checkpoints cannot be written in {root} (rank {bad[0]}): {bad[1]}; "
                         "they go to RUN/checkpoints, RUN = logging.output_dir/logging.experiment_name (or "
                         "checkpoint.resume's run): set logging.output_dir to a writable place")


def _check_geometry(cfg: Config, world: int) -> int:
    """Columns per rank; the batch must split evenly into ranks and minibatches."""
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


def _device() -> torch.device:
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")



if __name__ == "__main__":
    raise SystemExit(main())
