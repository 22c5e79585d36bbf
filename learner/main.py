"""The learner process (one per rank, started by the deepspeed launcher).

    deepspeed --num_gpus R -m asyncvla.learner.main CONFIG [key=value ...]   (or: asyncvla train)

Each rank pulls its own segments; rank 0 also runs the control server (actor registry) and the
weight server. The loop, once per update:
    wait for this rank's share of trajectory columns (dropping stale ones)
    V-trace targets + PPO epochs on the ZeRO-3 engine
    every publish_interval: gather trainable weights (all ranks), EMA + publish version v+1 (rank 0)
    log metrics (rank 0), checkpoint every save_interval
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

from asyncvla.common import transport
from asyncvla.common.signals import stop_on_signals
from asyncvla.common.config import Config, ConfigError, load_config, parse_overrides, to_dict, to_yaml
from asyncvla.common.policy import VLAPolicy
from asyncvla.common.protocol import SegmentSpec
from asyncvla.learner import checkpoint, engine as ds_engine
from asyncvla.learner.ingest import ColumnBuffer
from asyncvla.learner.metrics import Metrics, group
from asyncvla.learner.publish import EmaPublisher, gather_trainable
from asyncvla.learner.update import update

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
    return run(cfg)


def run(cfg: Config) -> int:
    ds_engine.init_distributed(cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = _device()
    stop = stop_on_signals()
    try:
        resume_from = checkpoint.resolve(cfg.checkpoint.resume) if cfg.checkpoint.resume else None
    except checkpoint.CheckpointError as e:
        raise SystemExit(f"asyncvla learner: checkpoint.resume: {e}")
    run_dir = _run_dir(cfg, resume_from)
    cols_per_rank = _check_geometry(cfg, world)

    # The same seed on every rank gives the same initial weights before ZeRO-3 partitions them.
    torch.manual_seed(cfg.actor.seed)
    policy_dir = run_dir / "policy_init"
    if rank == 0 and not (policy_dir / "policy.json").exists():
        VLAPolicy.build(cfg.policy).save_pretrained(policy_dir)
    dist.barrier()
    policy = VLAPolicy.from_pretrained(policy_dir, device=device)
    engine = ds_engine.build_engine(policy, cfg, gradient_accumulation_steps=_micro_per_minibatch(cfg, cols_per_rank))

    step, version, env_steps = 0, 0, 0
    ema = EmaPublisher(cfg.learner.rollout_ema_decay) if rank == 0 else None
    if resume_from is not None:
        try:
            state = checkpoint.load(engine, resume_from)
        except checkpoint.CheckpointError as e:
            raise SystemExit(f"asyncvla learner: {e}")
        step, version, env_steps = state["step"], state["version"], state["env_steps"]
        checkpoint.set_rng_state(state["rng"])
        if ema is not None:
            ema.load_state_dict(state["ema"])
        log.info("resumed from %s at step %d, version %d", resume_from, step, version)

    spec = _segment_spec(cfg, policy)
    receiver = transport.TrajectoryReceiver(cfg.transport, rank, spec)
    endpoints = _all_gather(receiver.endpoint)
    control = weights = None
    metrics = Metrics(str(run_dir / "tb") if rank == 0 else None, cfg.learner.max_steps,
                      cfg.logging.progress, start_step=step)
    if rank == 0:
        (run_dir / "config.yaml").write_text(to_yaml(cfg))
        metrics.text("config", "```\n" + to_yaml(cfg) + "\n```")
        weights = transport.WeightServer(cfg.transport)
        control = transport.ControlServer(cfg.transport, welcome_fn=lambda hello: {
            "config": to_dict(cfg), "trajectory_endpoints": endpoints,
            "weights_endpoint": weights.endpoint, "weight_version": version,
            "policy": {"path": str(policy_dir.resolve())}}, policy_dir=str(policy_dir))
        log.info("run dir %s; actors join at %s", run_dir, control.endpoint)
    if resume_from is None:
        publish_s = _publish(engine, ema, weights, version)     # version 0: the initial weights
    else:
        publish_s = 0.0
        if ema is not None:   # rank 0 re-publishes the checkpoint's EMA weights exactly as saved
            weights.publish(version, {k: v.numpy() for k, v in ema.published().items()})

    buffer = ColumnBuffer(cfg.learner.max_policy_lag)
    drops = Counter()
    contributors: set[str] = set()        # actors whose segments were used since the last log
    started = time.perf_counter()
    while step < cfg.learner.max_steps and not stop.is_set():
        # ---- wait for this rank's share of the batch
        t0 = time.perf_counter()
        while buffer.columns < cols_per_rank and not stop.is_set():
            seg = receiver.recv(timeout_ms=200)
            if seg is None:
                continue
            lag = version - int(seg.meta["policy_version"])
            if lag > cfg.learner.max_policy_lag:
                drops["stale"] += 1
                continue
            if lag < 0:   # made before a restart by weights this learner never had
                drops["future_version"] += 1
                continue
            buffer.add(seg.arrays, int(seg.meta["policy_version"]))
            contributors.add(seg.meta["actor_id"])
            metrics.add_segment(seg.arrays, lag)
            env_steps += int(seg.meta["env_steps"])
        if _any_rank(stop.is_set(), device):
            break
        t_idle = time.perf_counter() - t0

        # ---- learn
        t1 = time.perf_counter()
        batch = buffer.take(cols_per_rank)
        stats = update(engine, batch, cfg, device)
        step += 1
        t_train = time.perf_counter() - t1

        # ---- publish
        if step % cfg.learner.publish_interval == 0:
            version += 1
            publish_s = _publish(engine, ema, weights, version)

        # ---- log, checkpoint, budget
        total_env_steps = int(_sum_over_ranks(env_steps, device))
        scalars = group(stats)
        scalars.update({"time/learner_step_s": t_train, "time/learner_idle_s": t_idle,
                        "time/publish_s": publish_s, "train/actor/lr": engine.get_lr()[0],
                        "rollout/version": version})
        drops.update(buffer.dropped)
        buffer.dropped.clear()
        scalars.update(_gather_drop_counts(drops, receiver.stats, device))
        scalars["system/actors_contributing"] = float(len(set().union(*_all_gather(contributors))))
        contributors.clear()
        if control is not None:
            scalars.update({f"system/actors_{k}": v for k, v in control.counts().items()})
        metrics.log(step, scalars, total_env_steps, samples=batch.num_columns * cfg.actor.rollout_length * world)
        if cfg.checkpoint.save_interval and step % cfg.checkpoint.save_interval == 0:
            _save(engine, run_dir, step, version, total_env_steps, ema, cfg)
        if cfg.learner.max_env_steps and total_env_steps >= cfg.learner.max_env_steps:
            break
        if cfg.learner.max_time_s and _any_rank(time.perf_counter() - started >= cfg.learner.max_time_s,
                                                device):
            break

    if step and (not cfg.checkpoint.save_interval or step % cfg.checkpoint.save_interval):
        _save(engine, run_dir, step, version, int(_sum_over_ranks(env_steps, device)), ema, cfg)
    log.info("finished at step %d (version %d)", step, version)
    metrics.close()
    for closable in (control, weights, receiver):
        if closable is not None:
            closable.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


# --------------------------------------------------------------------------------- helpers
def _publish(engine, ema, weights, version: int) -> float:
    """Gather the trainable tensors (a collective: every rank), EMA + publish on rank 0."""
    t0 = time.perf_counter()
    tensors = gather_trainable(engine)
    if ema is not None:
        published = ema.update(tensors)
        weights.publish(version, {k: v.numpy() for k, v in published.items()})
    return time.perf_counter() - t0


def _save(engine, run_dir, step, version, env_steps, ema, cfg) -> None:
    state = {"step": step, "version": version, "env_steps": env_steps, "rng": checkpoint.rng_state(),
             "config": to_dict(cfg), "ema": ema.state_dict() if ema is not None else None}
    checkpoint.save(engine, run_dir, step, state, keep_last=cfg.checkpoint.keep_last)


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


def _segment_spec(cfg: Config, policy) -> SegmentSpec:
    p = cfg.policy
    return SegmentSpec(image_size=p.image_size, instruction_len=p.max_instruction_tokens,
                       num_tokens=p.num_action_chunks * p.action_dim, num_action_chunks=p.num_action_chunks,
                       state_dim=cfg.policy.state_dim,
                       action_level_rewards=cfg.algorithm.reward_type == "action_level",
                       num_steps=cfg.actor.rollout_length,
                       vocab_size=policy.action_tokenizer.vocab_size)


def _run_dir(cfg: Config, resume_from) -> Path:
    if resume_from is not None:
        return Path(resume_from).resolve().parents[1]        # <run>/checkpoints/<tag>
    return Path(cfg.logging.output_dir) / cfg.logging.experiment_name


def _device() -> torch.device:
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")



def _all_gather(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _any_rank(flag: bool, device) -> bool:
    return bool(_sum_over_ranks(int(flag), device))


def _sum_over_ranks(x: float, device) -> float:
    t = torch.tensor([float(x)], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t.item())


def _gather_drop_counts(drops: Counter, receiver_stats: dict, device) -> dict:
    """Dropped segments by reason, summed over ranks (stale here, invalid from the receiver)."""
    local = dict(drops)
    local.update({f"invalid_{k}": v for k, v in receiver_stats.get("invalid", {}).items()})
    everyone = _all_gather(local)
    total = Counter()
    for d in everyone:
        total.update(d)
    return {f"system/dropped_{k}": float(v) for k, v in total.items()}


if __name__ == "__main__":
    raise SystemExit(main())
