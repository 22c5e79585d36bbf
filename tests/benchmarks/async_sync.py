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

A GPU node: `--config configs/maniskill_gpu.yaml --device cuda --time-s 140` runs that config as
committed (plus actor.device, no evaluator, no checkpoints) in each mode for a fixed learner time,
and samples GPU memory and utilisation (nvidia-smi) during each arm. tests/benchmarks/gpu_node.sh
is that call prepared for a machine without internet (docs/benchmarks.md). `--dry-run` checks the
config and prints each arm's command without running anything.
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
# What each arm and the comparison report (the JSON's "sync"/"async" and "overlap"; the dry run lists them)
ARM_FIELDS = ("cpu", "gpu", "startup_s", "shutdown_s", "updates", "window_s", "samples_per_s", "updates_per_s",
              "env_steps_per_s", "step_s_mean", "idle_s_mean", "publish_s_mean", "policy_lag", "dropped_stale")
OVERLAP_FIELDS = ("t_rollout_s", "t_train_s", "bound", "speedup", "ceiling", "env_steps_speedup",
                  "fraction_of_bound")


def add_arguments(parser) -> list[str]:
    parser.add_argument("--config", default=None,
                        help="run this config (e.g. configs/maniskill_gpu.yaml) instead of the CPU workload")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="the actors' policy device (actor.device); cuda also samples GPU memory and "
                             "utilisation. The learner takes the GPU whenever there is one")
    parser.add_argument("--time-s", type=float, default=None,
                        help="each arm's training time (learner.max_time_s) with --config (default 140 s: "
                             "both arms and start-up fit one 8-minute call)")
    parser.add_argument("--dry-run", action="store_true",
                        help="check the config with each arm's overrides, print the commands, run nothing")
    return ["config", "device", "time_s", "dry_run"]


def run(quick: bool = False, config: str | None = None, device: str = "cpu", time_s: float | None = None,
        dry_run: bool = False) -> dict:
    arms = {mode: arm_command(mode == "sync", quick, config, device, time_s) for mode in ("sync", "async")}
    cfg = check_config(config, arms["sync"])
    results = {"config": config or workload.CONFIG, "device": device, "overrides": arms,
               "learner_threads": workload.LEARNER_THREADS, "warmup_updates": WARMUP,
               "samples_per_update": workload.samples_per_update(cfg)}
    if dry_run:
        for mode, overrides in arms.items():
            print(f"{mode}: asyncvla train {results['config']} {' '.join(overrides)}")
        return {**results, "dry_run": True, "schema": {"arm": list(ARM_FIELDS), "overlap": list(OVERLAP_FIELDS)}}
    results["two_busy_cores"] = two_busy_cores(4.0 if quick else 8.0)
    with tempfile.TemporaryDirectory(prefix="asyncvla-bench-") as tmp:
        for mode, overrides in arms.items():
            results[mode] = train_run(mode, results["config"], overrides, Path(tmp), results["samples_per_update"],
                                      gpu=device == "cuda")
    results["overlap"] = overlap(results["sync"], results["async"], results["two_busy_cores"])
    return results


def arm_command(sync: bool, quick: bool, config: str | None, device: str, time_s: float | None) -> list[str]:
    """The overrides of one arm: the CPU workload's for a number of updates, or a given config's for
    a fixed learner time (a GPU node's update takes seconds, a count of them would not fit a call)."""
    mode = [f"launch.sync={str(sync).lower()}", f"actor.device={device}"]
    if config is None:
        return [*workload.OVERRIDES, *mode, f"learner.max_steps={12 if quick else 30}"]
    return [*mode, "eval.eval_interval=0", "learner.max_steps=1000000",
            f"learner.max_time_s={time_s or (60 if quick else 140)}"]


def check_config(config: str | None, overrides: list[str]):
    """The arm's Config, or SystemExit naming what the config or an override gets wrong."""
    from asyncvla.common.config import load_config
    try:
        return load_config(config or workload.CONFIG, overrides)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"async_sync: {config or workload.CONFIG}: {e}")


def overlap(sync: dict, asyn: dict, two_busy_cores: float) -> dict:
    """The comparison: sync's phase times, the speed-up a perfect overlap of them would give (the
    bound), async's measured speed-up and its share of the bound."""
    t_r, t_t = sync["idle_s_mean"], sync["step_s_mean"]
    bound = (t_r + t_t) / max(t_r, t_t)
    speedup = asyn["samples_per_s"] / sync["samples_per_s"]
    return {"t_rollout_s": t_r, "t_train_s": t_t, "bound": bound, "speedup": speedup,
            "ceiling": bound * two_busy_cores, "env_steps_speedup": asyn["env_steps_per_s"] / sync["env_steps_per_s"],
            "fraction_of_bound": speedup / bound}


def train_run(name: str, config: str, overrides: list[str], tmp: Path, samples_per_update: int,
              gpu: bool = False) -> dict:
    """One `asyncvla train` run; returns its steady-state figures (see the module docstring)."""
    cmd = [sys.executable, "-m", "asyncvla.launch.cli", "train", config, *overrides,
           f"logging.output_dir={tmp}", f"logging.experiment_name={name}", "logging.progress=false",
           "checkpoint.save_interval=0", *run_port_overrides()]
    env = dict(os.environ, OMP_NUM_THREADS=str(workload.LEARNER_THREADS))
    log_path = tmp / f"{name}.log"
    started = time.time()
    with open(log_path, "w") as log, CpuMeter() as cpu, GpuMeter(enabled=gpu) as gpu_meter:
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
    return {"cpu": cpu.result, "gpu": gpu_meter.result, "startup_s": walls[0] - started,
            "shutdown_s": started + cpu.result["wall_s"] - walls[-1], **steady_state(scalars, samples_per_update)}


class GpuMeter:
    """GPU memory in use and utilisation, sampled with nvidia-smi every `period` s during a block
    (the whole machine's GPUs: the run's processes are its only GPU users). `.result` after the
    block: peak memory (MiB), mean and max utilisation (%), or None when disabled or unavailable."""

    QUERY = ["nvidia-smi", "--query-gpu=memory.used,utilization.gpu", "--format=csv,noheader,nounits"]

    def __init__(self, enabled: bool = True, period: float = 2.0):
        self.enabled, self.period, self.samples, self.result = enabled, period, [], None

    def __enter__(self):
        import threading
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True) if self.enabled else None
        if self.thread is not None:
            self.thread.start()
        return self

    def _sample(self):
        while not self.stop.wait(self.period):
            try:
                out = subprocess.run(self.QUERY, capture_output=True, text=True, timeout=10).stdout
                self.samples += [tuple(float(x) for x in line.split(",")) for line in out.strip().splitlines()]
            except (OSError, ValueError, subprocess.TimeoutExpired):
                return                                   # no nvidia-smi, or output it cannot read

    def __exit__(self, *exc):
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=15)
        if self.samples:
            mem, util = zip(*self.samples)
            self.result = {"memory_peak_mib": max(mem), "utilisation_mean_pct": float(np.mean(util)),
                           "utilisation_max_pct": max(util), "samples": len(self.samples)}
        return False


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
            "samples_per_s": (last - first) * samples_per_update / elapsed, "updates_per_s": (last - first) / elapsed,
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
    if r.get("dry_run"):
        return []
    s, a, o = r["sync"], r["async"], r["overlap"]
    lag = a["policy_lag"]
    phases = lambda run: (f"train {run['step_s_mean']:.2f} s + idle {run['idle_s_mean']:.2f} s per update, "  # noqa: E731
                          f"{run['updates_per_s'] * 60:.1f} updates/min")
    return gpu_figures(r) + [
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


def gpu_figures(r: dict) -> list[Figure]:
    """Each arm's GPU memory and utilisation, where they were sampled."""
    out = []
    for mode in ("sync", "async"):
        g = r[mode].get("gpu")
        if g:
            out.append(Figure("async vs sync", f"{mode}: GPU utilisation (mean)", g["utilisation_mean_pct"] / 100,
                              "%", note=f"max {g['utilisation_max_pct']:.0f} %, memory peak "
                                        f"{g['memory_peak_mib'] / 1024:.1f} GiB, {g['samples']} samples"))
    return out


if __name__ == "__main__":
    main(sys.modules[__name__])
