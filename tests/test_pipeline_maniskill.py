"""The ManiSkill path of `asyncvla pipeline` end to end, at a small scale, on the real simulator:
PushCube's scripted expert in pd_ee_delta_pos, through a camera framed on the workspace and rendered
at the policy's 64 px (env.camera_pose / camera_fov / render_size) -> demos with the robot's state
-> SFT -> asynchronous RL with 2 actor processes, the ZeRO-3 learner and the periodic evaluator
(all with that camera) -> the final summary. Interrupted during
RL with Ctrl-C (SIGINT to the process group, as a terminal sends it), it exits 130 saying where it
stopped, the next call continues from the newest checkpoint, and a third call only reprints the
summary.

This checks the mechanics, not learning: at this scale (2 demos, 12 SFT steps, a few updates)
no success rate means anything. Learning on ManiSkill is measured by `make train` itself (the
README's Results, docs/history.md)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import pytest

from tests.support.paths import MANISKILL
from tests.support.ports import run_port_overrides

SMALL = ["collect.method=scripted", "env.control_mode=pd_ee_delta_pos", "policy.action_dim=4",
         "env.camera_pose=[0.5,0,0.35,0.05,0,0.02]", "env.camera_fov=0.8", "env.render_size=64",
         "collect.action_noise=0.1", "collect.num_episodes=2", "collect.num_procs=1", "sft.steps=12", "sft.eval_episodes=2",
         "sft.save_interval=6", "env.max_episode_steps=24", "learner.max_steps=8", "learner.batch_trajectories=4", "learner.max_time_s=null",
         "checkpoint.save_interval=2", "eval.eval_interval=4", "eval.num_episodes=2", "eval.save_video=false",
         "logging.progress=false", "logging.experiment_name=ms"]


def command(out: Path) -> list[str]:
    return [sys.executable, "-m", "asyncvla.launch.cli", "pipeline", str(MANISKILL),
            *SMALL, f"logging.output_dir={out}", *run_port_overrides()]


def run(out: Path, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(command(out), capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(900)
def test_maniskill_pipeline_runs_every_stage_resumes_after_ctrl_c_and_caches(tmp_path):
    run_dir = tmp_path / "ms"
    # 1. Start, and interrupt once RL has written its first checkpoint.
    p = subprocess.Popen(command(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    deadline = time.monotonic() + 600
    while not list((run_dir / "checkpoints").glob("step_*/")) and p.poll() is None:
        assert time.monotonic() < deadline, "RL wrote no checkpoint within 600 s"
        time.sleep(0.5)
    os.killpg(p.pid, signal.SIGINT)
    first = p.communicate(timeout=120)[0]
    # A stop is not a finish: the pipeline says where it stopped and exits 130, with no traceback
    # from any process of the run (the evaluator's env workers included).
    assert p.returncode == 130 and "3/3 RL: up to 8 updates" in first, first[-3000:]
    assert "asyncvla pipeline: interrupted during RL at update" in first, first[-3000:]
    assert "Traceback" not in first and "after RL" not in first, first[-3000:]
    assert not (run_dir / "summary.json").exists()

    # The scripted expert's demos: in the RL control mode (4-D actions), one frame and one robot
    # state per step plus the last; SFT read the state (policy.state_dim=25).
    with h5py.File(run_dir / "demos" / "trajectory.h5") as f:
        g = f["traj_0"]
        assert g["actions"].shape[1] == 4
        assert g["obs/agent/state"].shape == (len(g["actions"]) + 1, 25)
        assert len(g["obs/sensor_data/base_camera/rgb"]) == len(g["actions"]) + 1
    assert "2 kept" in first, first[-3000:]
    meta = json.loads((run_dir / "demos" / "trajectory.json").read_text())
    settings = meta["env_info"]["env_kwargs"]["camera_settings"]           # SFT checked them
    assert settings["render_size"] == 64 and settings["robot_visual"] == "hull"
    policy = json.loads((run_dir / "sft" / "policy" / "policy.json").read_text())
    assert policy["policy"]["state_dim"] == 25

    # 2. Again: demos and SFT cached, RL continues from its newest checkpoint to the budget.
    second = run(tmp_path, timeout=600)
    out = second.stdout
    assert second.returncode == 0, out[-3000:] + second.stderr[-3000:]
    assert "1/3 demonstrations: cached" in out and "2/3 SFT: cached" in out, out[-3000:]
    assert "resuming at update" in out, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["env_id"] == "PushCube-v1" and summary["episodes"] == 2 and summary["rl"]["updates"] == 8
    for stage in ("sft", "rl"):
        lo, hi = summary[stage]["ci95"]
        assert 0.0 <= lo <= summary[stage]["success_rate"] <= hi <= 1.0
    assert "after SFT (12 steps):" in out and "after RL (8 updates):" in out and "tensorboard --logdir" in out
    evals = sorted(p.parent.name for p in (run_dir / "eval").glob("step_*/summary.json"))
    assert "step_00000008" in evals, evals          # the evaluator's last figure is of the last weights

    # 3. A third call repeats nothing and prints the same summary.
    third = run(tmp_path, timeout=300)
    assert third.returncode == 0 and "3/3 RL: done (8 updates" in third.stdout, third.stdout[-2000:]
    assert f"{100 * summary['rl']['success_rate']:5.1f}%" in third.stdout
