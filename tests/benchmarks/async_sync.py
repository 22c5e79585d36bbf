"""Async vs sync: the real system, `asyncvla train`, run once in each mode on the same config.

Why: overlapping rollout and training is the product's main speed claim. Both runs use the
benchmark workload (workload.py: the pixel task, one actor, one learner rank, one core each) on
free ports in a temporary run directory, and are read back from their tensorboard files:

  env steps/s, learner samples/s   over the steady-state window (updates after the first WARMUP),
                                   from the event wall times: no start-up or shut-down inside
  t_train = time/learner_step_s    the sync run's own phase timings, means over the window
  t_rollout = time/learner_idle_s  (in sync mode the learner is idle exactly while the actor acts)
  overlap bound = (t_rollout + t_train) / max(t_rollout, t_train): the speed-up a perfect overlap
                  of the two phases gives; reported with the fraction of it the async run reaches.
  policy lag (async run)          rollout/policy_lag_mean / _max per update over the window.
  two busy cores                  a 1-thread matmul loop's rate with a second copy on the other core,
                                  over its rate alone: what running actor and learner at once costs
                                  each of them on this machine (shared caches, memory, the VM), so
                                  ceiling = bound x that is the most the async run can reach here.

Goals (issue #9): speed-up >= 1.9x and >= 90 % of the bound; policy lag mean <= 1.5 versions.

    python -m tests.benchmarks.async_sync [--quick] [--out bench_results/async_sync.json]
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from tests.benchmarks import workload
from tests.benchmarks.report import CpuMeter, Figure, at_least, at_most, main
from tests.support.ports import run_port_overrides

WARMUP = 3                 # updates left out of the steady-state window (start-up, queues filling)
RUN_TIMEOUT_S = 420


def run(quick: bool = False) -> dict:
    steps = 12 if quick else 30
    cfg = workload.config()
    results = {"config": workload.CONFIG, "overrides": workload.OVERRIDES + [f"learner.max_steps={steps}"],
               "learner_threads": workload.LEARNER_THREADS, "warmup_updates": WARMUP,
               "samples_per_update": workload.samples_per_update(cfg),
               "two_busy_cores": two_busy_cores(4.0 if quick else 8.0)}
    with tempfile.TemporaryDirectory(prefix="asyncvla-bench-") as tmp:
        for mode in ("sync", "async"):
            results[mode] = train_run(mode == "sync", steps, Path(tmp), results["samples_per_update"])
    sync, asyn = results["sync"], results["async"]
    t_r, t_t = sync["idle_s_mean"], sync["step_s_mean"]
    bound = (t_r + t_t) / max(t_r, t_t)
    speedup = asyn["samples_per_s"] / sync["samples_per_s"]
    results["overlap"] = {"t_rollout_s": t_r, "t_train_s": t_t, "bound": bound, "speedup": speedup,
                          "ceiling": bound * results["two_busy_cores"],
                          "env_steps_speedup": asyn["env_steps_per_s"] / sync["env_steps_per_s"],
                          "fraction_of_bound": speedup / bound}
    return results


def train_run(sync: bool, steps: int, tmp: Path, samples_per_update: int) -> dict:
    """One `asyncvla train` run; returns its steady-state figures (see the module docstring)."""
    name = "sync" if sync else "async"
    cmd = [sys.executable, "-m", "asyncvla.launch.cli", "train", workload.CONFIG, *workload.OVERRIDES,
           f"launch.sync={str(sync).lower()}", f"learner.max_steps={steps}",
           f"logging.output_dir={tmp}", f"logging.experiment_name={name}", "logging.progress=false",
           "checkpoint.save_interval=0", *run_port_overrides()]
    env = dict(os.environ, OMP_NUM_THREADS=str(workload.LEARNER_THREADS))
    log_path = tmp / f"{name}.log"
    started = time.time()
    with open(log_path, "w") as log, CpuMeter() as cpu:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            code = proc.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)        # the launcher stops its children, then exits
            code = proc.wait(timeout=60)
    if code != 0:
        tail = "".join(open(log_path).readlines()[-15:])
        raise RuntimeError(f"asyncvla train ({name}) exited with {code}; its log ends:\n{tail}")
    scalars = read_scalars(tmp / name / "tb")
    walls = [t for _, t, _ in scalars["time/learner_step_s"]]
    return {"cpu": cpu.result, "startup_s": walls[0] - started,
            "shutdown_s": started + cpu.result["wall_s"] - walls[-1], **steady_state(scalars, samples_per_update)}


MATMUL_LOOP = """
import sys, time, torch
torch.set_num_threads(1)
a = torch.randn(256, 256)
n, t0 = 0, time.perf_counter()
while time.perf_counter() - t0 < float(sys.argv[1]):
    a @ a
    n += 1
print(n / (time.perf_counter() - t0))
"""


def two_busy_cores(seconds: float) -> float:
    """Rate of a 1-thread matmul loop beside a second copy (on the other core), over its rate
    alone; the mean of both copies, best of two tries."""
    def rates(copies: int) -> list[float]:
        procs = [subprocess.Popen([sys.executable, "-c", MATMUL_LOOP, str(seconds)], stdout=subprocess.PIPE,
                                  text=True) for _ in range(copies)]
        return [float(p.communicate(timeout=seconds + 60)[0]) for p in procs]
    alone = max(rates(1)[0] for _ in range(2))
    paired = max(float(np.mean(rates(2))) for _ in range(2))
    return paired / alone


def read_scalars(tb_dir: Path) -> dict[str, list[tuple[int, float, float]]]:
    """Every scalar of a run: tag -> [(step, wall_time, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.wall_time, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def steady_state(scalars: dict, samples_per_update: int) -> dict:
    """Rates between the end of update WARMUP and the last update; phase means over the same updates."""
    def window(tag):
        return [v for step, _, v in scalars.get(tag, []) if step > WARMUP]

    wall = {step: t for step, t, _ in scalars["time/learner_step_s"]}
    first, last = WARMUP, max(wall)
    if last - first < 2:
        raise RuntimeError(f"only {last} updates logged: too few for a steady-state window")
    elapsed = wall[last] - wall[first]
    env_steps = {step: v for step, _, v in scalars["rollout/env_steps"]}
    lag_mean, lag_max = window("rollout/policy_lag_mean"), window("rollout/policy_lag_max")
    dropped = scalars.get("system/dropped_stale", [])
    return {"updates": last - first, "window_s": elapsed,
            "samples_per_s": (last - first) * samples_per_update / elapsed,
            "env_steps_per_s": (env_steps[last] - env_steps[first]) / elapsed,
            "step_s_mean": float(np.mean(window("time/learner_step_s"))),
            "idle_s_mean": float(np.mean(window("time/learner_idle_s"))),
            "publish_s_mean": float(np.mean(window("time/publish_s"))),
            "policy_lag": {"mean": float(np.mean(lag_mean)), "max": float(np.max(lag_max)),
                           "p50_of_update_means": float(np.percentile(lag_mean, 50)),
                           "p90_of_update_means": float(np.percentile(lag_mean, 90)),
                           "update_means": lag_mean},
            "dropped_stale": dropped[-1][2] if dropped else 0.0}


def _others(run: dict) -> str:
    c = run["cpu"]["other_cores"]
    return "?" if c is None else f"{c:.1f}"


def figures(r: dict) -> list[Figure]:
    s, a, o = r["sync"], r["async"], r["overlap"]
    lag = a["policy_lag"]
    phases = lambda run: f"train {run['step_s_mean']:.2f} s + idle {run['idle_s_mean']:.2f} s per update"  # noqa: E731
    return [
        Figure("async vs sync", "sync learner samples/s", s["samples_per_s"], "/s", note=phases(s)),
        Figure("async vs sync", "async learner samples/s", a["samples_per_s"], "/s", note=phases(a)),
        Figure("async vs sync", "sync env steps/s", s["env_steps_per_s"], "/s"),
        Figure("async vs sync", "async env steps/s", a["env_steps_per_s"], "/s"),
        Figure("async vs sync", "overlap bound (t_r+t_t)/max", o["bound"], "x",
               note="from the sync run: t_r = idle, t_t = train"),
        Figure("async vs sync", "async speed-up (samples/s)", o["speedup"], "x", ">= 1.9x",
               at_least(o["speedup"], 1.9), note=f"other work took {_others(s)} / {_others(a)} cores "
                                                 "during the sync / async run"),
        Figure("async vs sync", "speed-up / overlap bound", o["fraction_of_bound"], "%", ">= 90 %",
               at_least(o["fraction_of_bound"], 0.9)),
        Figure("async vs sync", "two busy cores: each one's speed", r["two_busy_cores"], "%",
               note=f"of one core busy alone; ceiling = bound x this = {o['ceiling']:.2f}x"),
        Figure("policy lag", "async: mean lag (versions)", lag["mean"], "", "<= 1.5",
               at_most(lag["mean"], 1.5),
               note=f"max {lag['max']:.0f}, p90 of per-update means {lag['p90_of_update_means']:.1f}, "
                    f"{a['dropped_stale']:.0f} stale segments dropped; bench workload"),
    ]


if __name__ == "__main__":
    main(sys.modules[__name__])
