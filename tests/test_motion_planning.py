"""ManiSkill demonstrations from ManiSkill's motion-planning solutions (actors/motion_planning.py),
on the real simulator: plan 2 PushCube-v1 episodes, convert them to pd_ee_delta_pose with RGB
using ManiSkill's replay tool, then replay the converted actions in a fresh env and check that
they still solve the task from the recorded seed, and that the recorded frames are what the
policy sees there."""

import subprocess
import sys

import numpy as np
import pytest

from asyncvla.actors.envs.base import resize_images
from asyncvla.actors.envs.maniskill import flat_state
from asyncvla.actors.motion_planning import check_task, collect_motion_planning
from asyncvla.common.data.demos import flat_states
from asyncvla.common.config import load_config
from tests.support.paths import QUICKSTART



def test_two_pushcube_demos_convert_and_replay_to_success(tmp_path):
    import gymnasium as gym
    import mani_skill.envs  # noqa: F401
    from mani_skill.utils import common

    cfg = load_config(None, ["env.id=PushCube-v1", "policy.image_size=64", "policy.action_dim=7"])
    episodes, stats = collect_motion_planning(cfg, 2, tmp_path / "raw", seed=0, num_procs=1)
    assert stats["kept"] == 2 and stats["solved"] >= 2 and stats["converted"] >= 2, stats
    env = gym.make("PushCube-v1", obs_mode="rgb", control_mode="pd_ee_delta_pose", sim_backend="physx_cpu",
                   reward_mode=cfg.env.reward_mode)
    try:
        for ep in episodes:
            assert ep.images.shape == (ep.num_steps + 1, 64, 64, 3) and ep.actions.shape == (ep.num_steps, 7)
            assert ep.success[-1] and ep.instruction.startswith("push the blue cube")
            obs, _ = env.reset(seed=ep.seed)
            first = resize_images(obs["sensor_data"]["base_camera"]["rgb"].numpy(), 64)[0]
            assert np.abs(first.astype(int) - ep.images[0].astype(int)).mean() < 2.0
            state = flat_state({"agent": common.to_numpy(obs["agent"]), "extra": common.to_numpy(obs["extra"])})
            recorded = flat_states(ep.states)        # what the policy reads with env.use_proprio
            assert recorded.shape == (ep.num_steps + 1, 25) and np.allclose(recorded[0], state, atol=1e-5)
            solved = False
            for a in ep.actions:
                _, _, _, _, info = env.step(a)
                solved |= bool(info["success"])
            assert solved, f"episode with seed {ep.seed} did not replay to success"
    finally:
        env.close()


def test_a_task_without_a_solution_names_those_that_have_one(tmp_path):
    with pytest.raises(ValueError, match="PushCube-v1"):
        check_task("PushT-v1")
    r = subprocess.run([sys.executable, "-m", "asyncvla.launch.cli", "collect", str(QUICKSTART),
                        "env.id=PushT-v1", "--episodes", "1", "--out", str(tmp_path / "d")],
                       capture_output=True, text=True, timeout=300)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "has no motion-planning solution" in err[-1] and "PickCube-v1" in err[-1]
    # ManiSkill's replay tool renders the task's own camera: camera keys are refused before anything runs
    r = subprocess.run([sys.executable, "-m", "asyncvla.launch.cli", "collect", str(QUICKSTART),
                        "collect.method=motion_planning", "env.render_size=64", "--episodes", "1",
                        "--out", str(tmp_path / "e")], capture_output=True, text=True, timeout=300)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert err[-1].startswith("asyncvla collect: env.render_size=64: collect.method=motion_planning"), err
    # ... and it draws the robot's visual meshes: the hulls are refused too
    r = subprocess.run([sys.executable, "-m", "asyncvla.launch.cli", "collect", str(QUICKSTART),
                        "collect.method=motion_planning", "env.robot_visual=hull", "--episodes", "1",
                        "--out", str(tmp_path / "f")], capture_output=True, text=True, timeout=300)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert err[-1].startswith("asyncvla collect: env.robot_visual='hull': collect.method=motion_planning"), \
        err
