"""The PickCube and PullCube scripted experts: their decisions on positions alone, then their solve
rates and episode lengths in the real simulator (CPU physics, state observations: no rendering)."""

import numpy as np
import pytest

from asyncvla.actors.experts import expert_for, pick_cube_action, pull_cube_action

CUBE, GOAL = np.array([0.0, 0.05, 0.02]), np.array([0.05, -0.05, 0.2])


def test_the_pick_cube_expert_goes_over_down_closes_then_carries_to_the_goal():
    far = pick_cube_action([0.1, -0.1, 0.18], CUBE, GOAL, grasped=False, finger_gap=0.08)
    assert far.dtype == np.float32 and far.shape == (4,) and far[3] == 1.0             # open on the way
    assert far[0] < 0 and far[1] > 0 and far[2] < 0 and np.abs(far).max() <= 1.0
    above = pick_cube_action([0.0, 0.05, 0.07], CUBE, GOAL, grasped=False, finger_gap=0.08)
    assert np.allclose(above[:2], 0.0) and above[2] == pytest.approx(-0.5) and above[3] == 1.0   # straight down
    at = pick_cube_action([0.0, 0.052, 0.021], CUBE, GOAL, grasped=False, finger_gap=0.08)
    assert np.abs(at[:3]).max() < 0.05 and at[3] == -1.0                               # close where it is
    carry = pick_cube_action([0.0, 0.05, 0.03], CUBE, GOAL, grasped=True, finger_gap=0.04)
    assert carry[3] == -1.0 and carry[0] > 0 and carry[1] < 0 and carry[2] == 1.0       # to the goal, closed
    missed = pick_cube_action([0.0, 0.05, 0.02], CUBE, GOAL, grasped=False, finger_gap=0.002)
    assert missed[3] == 1.0 and missed[2] > 0                                          # closed on nothing: open


def test_the_pull_cube_expert_goes_round_to_the_far_side_down_then_draws_the_cube_back():
    cube, goal = np.array([0.05, 0.0, 0.02]), np.array([-0.15, 0.0, 0.0])
    far = pull_cube_action([-0.1, 0.1, 0.1], cube, goal)
    assert far[0] > 0 and far[1] < 0 and far[2] < 0 and far[3] == -1.0          # over, high, closed
    above = pull_cube_action([0.12, 0.0, 0.06], cube, goal)
    assert np.allclose(above[:2], 0.0) and above[2] < 0                         # down in front of it
    pull = pull_cube_action([0.12, 0.0, 0.02], cube, goal)
    assert pull[0] == -1.0 and abs(pull[1]) < 1e-6 and abs(pull[2]) < 1e-6       # back, level


@pytest.mark.parametrize("task, most_steps", [("PickCube-v1", 30), ("PullCube-v1", 30)])
def test_the_expert_solves_its_task_in_a_few_dozen_steps(task, most_steps):
    import gymnasium as gym
    import mani_skill.envs  # noqa: F401  (registers the tasks)

    env = gym.make(task, obs_mode="state_dict", control_mode="pd_ee_delta_pos", num_envs=1,
                   sim_backend="physx_cpu")
    expert = expert_for(task, "pd_ee_delta_pos")
    steps = []
    try:
        for seed in range(12):
            env.reset(seed=seed)
            for t in range(50):
                _, _, _, _, info = env.step(expert.act(env.unwrapped))
                if bool(info["success"]):
                    steps.append(t + 1)
                    break
    finally:
        env.close()
    print(f"{task} expert: {len(steps)}/12 solved, {np.mean(steps):.1f} steps on average")
    assert len(steps) >= 11 and np.mean(steps) < most_steps
