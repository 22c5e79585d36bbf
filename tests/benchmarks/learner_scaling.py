"""Learner samples/s at world size 1 and 2: DeepSpeed ZeRO-3 on CPU (gloo), one process per rank.

Why: adding learner ranks is how the learner keeps up with more actors; on CPU the ranks share
the machine's cores, so each layout gets all of them (threads per rank = cores / ranks), plus the
1-rank, 1-thread learner of the async-vs-sync runs. Each rank builds the benchmark policy, makes
its share of a real batch (a pixel-env segment through the ColumnBuffer) and runs the learner's
own `update` (V-trace targets + PPO) on a ZeRO-3 engine: one warm-up update, then the median of
the timed ones. Samples/s = the global batch (64 samples at every world size) / seconds per update.
Ranks are spawned the way tests/ds_worker.py is run: RANK, WORLD_SIZE, ... set per process.

    python -m tests.benchmarks.learner_scaling [--quick] [--out bench_results/learner_scaling.json]
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
import traceback

import numpy as np

from tests.benchmarks import workload
from tests.benchmarks.report import Figure, main
from tests.support.ports import free_ports

RANK_TIMEOUT_S = 300
# The workload's batch (3 trajectories) does not split over 2 ranks: 8 trajectories x 8 steps do.
OVERRIDES = ["learner.batch_trajectories=8"]


def run(quick: bool = False) -> dict:
    cores = os.cpu_count() or 1
    updates = 2 if quick else 4
    layouts = [(1, 1), (1, cores), (2, max(1, cores // 2))]          # (ranks, threads per rank)
    cfg = workload.config(OVERRIDES)
    results = {"overrides": workload.OVERRIDES + OVERRIDES, "samples_per_update": workload.samples_per_update(cfg), "timed_updates": updates,
               "layouts": []}
    for world, threads in dict.fromkeys(layouts):                    # (1, 1) once on a 1-core machine
        ranks = run_ranks(world, threads, updates)
        step_s = float(np.median(ranks[0]["step_s"]))
        results["layouts"].append({"world": world, "threads_per_rank": threads, "step_s": step_s,
                                   "samples_per_s": results["samples_per_update"] / step_s,
                                   "ranks": ranks})
    return results


def run_ranks(world: int, threads: int, updates: int) -> list[dict]:
    """Spawn `world` ranks of `_rank_main`; returns each rank's record (rank order)."""
    ctx = mp.get_context("spawn")
    port = free_ports(1)[0]
    pipes = [ctx.Pipe() for _ in range(world)]
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, threads, updates, child))
             for r, (_, child) in enumerate(pipes)]
    for p in procs:
        p.start()
    try:
        return workload.collect(procs, pipes, RANK_TIMEOUT_S, f"learner rank (of {world})")
    finally:
        workload.stop(procs)


def build_learner(cfg, world: int, rank: int):
    """(engine, batch, device) of one rank, as the learner builds them (same seed on every rank).
    Joins the process group (RANK, ... from the environment, or a lone rank without them) after
    the policy is built: once a group exists, transformers writes the tiny backbone on rank 0 only."""
    import torch

    from asyncvla.common.policy import VLAPolicy
    from asyncvla.learner import engine as ds_engine

    torch.manual_seed(cfg.learner.seed)
    policy = VLAPolicy.build(cfg.policy)
    batch = workload.make_batch(cfg, policy, cfg.learner.batch_trajectories // world, seed=rank)
    ds_engine.init_distributed(cfg)
    engine = ds_engine.build_engine(policy, ds_engine.EngineSpec.rl(cfg), workload.micro_batches(cfg, world))
    return engine, batch, engine.device          # cuda where DeepSpeed found a GPU


def timed_updates(engine, batch, cfg, device, n: int) -> list[float]:
    """Seconds of each of n learner updates, after one warm-up update."""
    from asyncvla.learner.update import update

    update(engine, batch, cfg, device)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        update(engine, batch, cfg, device)
        times.append(time.perf_counter() - t0)
    return times


def _rank_main(rank: int, world: int, port: int, threads: int, updates: int, conn) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS=str(threads))
    try:
        import torch
        torch.set_num_threads(threads)
        from asyncvla.learner import engine as ds_engine
        cfg = workload.config(OVERRIDES)
        engine, batch, device = build_learner(cfg, world, rank)
        conn.send({"rank": rank, "step_s": timed_updates(engine, batch, cfg, device, updates)})
        ds_engine.close_distributed()
    except BaseException:
        conn.send({"rank": rank, "error": traceback.format_exc()})
    sys.stdout.flush()
    os._exit(0)              # as tests/ds_worker.py: no interpreter teardown once results are out


def figures(r: dict) -> list[Figure]:
    out = []
    for lay in r["layouts"]:
        out.append(Figure("learner (ZeRO-3)", f"samples/s, {lay['world']} rank(s) x {lay['threads_per_rank']} "
                          f"thread(s)", lay["samples_per_s"], "/s",
                          note=f"{lay['step_s']:.2f} s per update of {r['samples_per_update']} samples"))
    return out


if __name__ == "__main__":
    main(sys.modules[__name__])
