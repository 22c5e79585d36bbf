"""Learning, end to end: demonstrations, SFT, then asynchronous RL with the full system (2 actor
processes over ZeroMQ, the ZeRO-3 learner, EMA publishing) must make the policy measurably better
than its warm start: the lower end of RL's 95 % interval above the upper end of SFT's, on the same
fixed episodes, sampled as the actors sample. And `asyncvla pipeline` caches every stage.

Not part of `make test`: in 5 runs it passed 4 times and failed once (300 s of RL: 30.1 % -> 33.2 %),
so short RL runs on 2 cores vary too much for CI. Run it alone:
    .venv/bin/python -m pytest -s tests/benchmarks/learning_check.py"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmarks.workload import free_ports

REPO = Path(__file__).resolve().parents[2]

# Budgets chosen from measurements (2 cores). SFT of 150-300 steps gives 28-36 % sampled success.
# Asynchronous RL starts slowly (the critic first adapts from the demonstrator's returns to the
# policy's): +10 points in 100 s, +14 in 170 s (which passed by only 2 points), +20 in 240 s (by
# 7.5). It gets 300 s so that the test passes with a margin; 256 evaluation episodes keep each
# interval within about +-6 points.
SFT_STEPS = 200
RL_SECONDS = 300
EVAL_EPISODES = 256


def pipeline(out: Path, timeout: float):
    control, weights, trajectories, master = free_ports(4)
    return subprocess.run(
        [sys.executable, "-m", "asyncvla.launch.cli", "pipeline", str(REPO / "configs/pixel_task.yaml"),
         f"logging.output_dir={out}", "logging.experiment_name=learn", "logging.progress=false",
         f"sft.steps={SFT_STEPS}", "sft.eval_interval=0", f"sft.eval_episodes={EVAL_EPISODES}",
         f"learner.max_time_s={RL_SECONDS}", "learner.max_steps=100000", "checkpoint.save_interval=1000",
         f"transport.control_port={control}", f"transport.weights_port={weights}",
         f"transport.trajectory_port={trajectories}", f"launch.master_port={master}"],
        capture_output=True, text=True, timeout=timeout,
        env=dict(os.environ, OMP_NUM_THREADS="2"))   # the learner's threads; actors take one each


@pytest.mark.timeout(1200)
def test_sft_then_asynchronous_rl_beats_the_warm_start(tmp_path):
    r = pipeline(tmp_path, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((tmp_path / "learn" / "summary.json").read_text())
    sft, rl = summary["sft"], summary["rl"]
    print(f"SFT {sft['success_rate']:.3f} {sft['ci95']}  RL {rl['success_rate']:.3f} {rl['ci95']} "
          f"after {rl['updates']} updates")
    assert summary["episodes"] == EVAL_EPISODES and rl["updates"] > 20
    assert rl["ci95"][0] > sft["ci95"][1], summary

    # A second call resumes rather than repeats: every stage is cached.
    again = pipeline(tmp_path, timeout=120)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    for stage in ("1/3 demonstrations: cached", "2/3 SFT: cached", "3/3 RL: done"):
        assert stage in again.stdout, again.stdout[-3000:]
