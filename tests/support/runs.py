"""Small runs of the real commands on the pixel task, and what their run directories hold:

    SMALL_BACKBONE    overrides for a backbone small enough that a CPU update takes moments
    SMALL             overrides for a small pixel-task training run (a file adds its launch settings)
    small_run         overrides for a small run into tmp_path/name on free ports, without a progress bar
    train_pixel_task  `asyncvla train configs/pixel_task.yaml` into out_dir/name on free ports, to its end
    start             a child in its own session (kill -9 reaches its whole tree), output to a log file
    stop              SIGTERM, then SIGKILL, to the process groups a test leaves running
    wait_for          poll a predicate; fail when a watched process ends or the time is up
    complete          whether a run's checkpoint of a given step is complete
    latest_complete   the step of a run's newest complete checkpoint (0: none)
    scalars           a run's tensorboard values of one tag, by step
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.support.paths import PIXEL
from tests.support.ports import run_port_overrides

SMALL_BACKBONE = ["policy.backbone.text_layers=1", "policy.backbone.text_hidden_size=64",
                  "policy.backbone.intermediate_size=128", "policy.backbone.vision_hidden_size=32",
                  "policy.backbone.vision_layers=1", "policy.lora_rank=8", "policy.value_head_hidden=32"]
SMALL = ["learner.batch_trajectories=4", "learner.micro_batch_size=16", "actor.num_envs=4", "actor.rollout_length=4",
         "algorithm.num_minibatches=1", "algorithm.update_epochs=1"]


def small_run(tmp_path, name: str, *extra: str) -> list[str]:
    return [f"logging.output_dir={tmp_path}", f"logging.experiment_name={name}", "logging.progress=false",
            "learner.batch_trajectories=4", "learner.micro_batch_size=16", "actor.num_envs=4",
            "actor.rollout_length=4", "algorithm.num_minibatches=1", "eval.eval_interval=0", *SMALL_BACKBONE,
            *run_port_overrides(), *extra]


def train_pixel_task(out_dir: Path, name: str, overrides: list[str], timeout: float):
    """`asyncvla train configs/pixel_task.yaml` into out_dir/name on free ports, without a progress bar."""
    return subprocess.run([sys.executable, "-m", "asyncvla.launch.cli", "train", str(PIXEL),
                           f"logging.output_dir={out_dir}", f"logging.experiment_name={name}",
                           "logging.progress=false", *run_port_overrides(), *overrides],
                          capture_output=True, text=True, timeout=timeout)


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    """A child in its own session (so kill -9 reaches its whole tree), output to a log file."""
    return subprocess.Popen(cmd, start_new_session=True, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))


def stop(*procs) -> None:
    """Stop what a failed test leaves running: SIGTERM first (`asyncvla train` then stops its
    children, which live in their own sessions), SIGKILL for anything still there."""
    for p in procs:
        if p is not None and p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        if p is not None:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


def wait_for(predicate, timeout: float, what: str, procs=()):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        for p in procs:
            assert p.poll() is None, f"a process ended (code {p.returncode}) while waiting for {what}"
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def complete(run: Path, step: int) -> bool:
    return (run / "checkpoints" / f"step_{step:08d}" / "COMPLETE.json").exists()


def latest_complete(run: Path) -> int:
    done = [int(p.name.split("_")[1]) for p in (run / "checkpoints").glob("step_*") if (p / "COMPLETE.json").exists()]
    return max(done, default=0)


def scalars(run: Path, tag: str) -> dict[int, float]:
    acc = EventAccumulator(str(run / "tb"), purge_orphaned_data=False)
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(tag)} if tag in acc.Tags()["scalars"] else {}
