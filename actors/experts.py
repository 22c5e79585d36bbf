"""Scripted experts of ManiSkill tasks, for demonstrations (`collect.method: scripted`).

    expert = expert_for("PushCube-v1", "pd_ee_delta_pos")
    action = expert.act(env.unwrapped)          # float32 [D] in [-1, 1]

An expert reads the simulator's privileged state (object and goal poses, which the policy never
sees) and acts in the control mode RL acts in, so its demos are short and need no conversion.
Each decides from the current state alone (no memory), so a step perturbed by noise is
corrected at the next. The decision itself is a pure function of positions, tested without a
simulator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

EE_STEP_M = 0.1              # pd_ee_delta_pos: an action of 1 moves the TCP 0.1 m (pos_lower/upper)
GRIPPER_CLOSED = -1.0        # the normalised gripper action of a closed Panda hand
GRIPPER_OPEN = 1.0


@dataclass(frozen=True)
class Expert:
    control_mode: str                      # the only mode its actions mean anything in
    act: Callable[[object], np.ndarray]    # ManiSkill's unwrapped env -> float32 [D]


def shove_cube_action(tcp, cube, goal, direction: int, half: float = 0.02) -> np.ndarray:
    """Push (direction +1, along +x) or pull (-1, along -x) a cube in pd_ee_delta_pos: over to a spot
    5 cm on the cube's near side for that direction at 6 cm height, down to the cube's mid-height,
    then move the cube along x past the goal while holding y on the cube's y. The hand stays
    closed, as ManiSkill's own solutions keep it. Positions in metres, world frame."""
    tcp, cube, goal = (np.asarray(v, np.float64).reshape(3) for v in (tcp, cube, goal))
    d = float(direction)
    spot = np.array([cube[0] - d * (half + 0.05), cube[1], half])
    low = tcp[2] < half + 0.015
    on_its_side = abs(tcp[1] - cube[1]) < 0.015 and d * (tcp[0] - (cube[0] - d * (half + 0.005))) < 0
    if low and on_its_side:                                      # push or pull
        target = np.array([goal[0] + d * 0.02, cube[1], half])
    elif np.linalg.norm(tcp[:2] - spot[:2]) < 0.015:            # above the spot: go down
        target = spot
    else:                                                        # over to the spot, high
        target = np.array([spot[0], spot[1], 0.06])
    move = np.clip((target - tcp) / EE_STEP_M, -1.0, 1.0)
    return np.append(move, GRIPPER_CLOSED).astype(np.float32)


def push_cube_action(tcp, cube, goal, half: float = 0.02) -> np.ndarray:
    """PushCube: from 5 cm behind the cube (-x side), push it +x past the goal."""
    return shove_cube_action(tcp, cube, goal, +1, half)


def pull_cube_action(tcp, cube, goal, half: float = 0.02) -> np.ndarray:
    """PullCube: from 5 cm in front of the cube (+x side, away from the robot), draw it back (-x)."""
    return shove_cube_action(tcp, cube, goal, -1, half)


def pick_cube_action(tcp, cube, goal, grasped: bool, finger_gap: float, half: float = 0.02) -> np.ndarray:
    """PickCube in pd_ee_delta_pos: hand open, over the cube at 5 cm above it, down to its centre,
    close; once it holds the cube, carry it to the goal (the gripper stays closed). A hand that
    closed on nothing (`finger_gap`, the summed finger opening in metres, nearly 0 and no grasp)
    opens again and the approach restarts. Positions in metres, world frame."""
    tcp, cube, goal = (np.asarray(v, np.float64).reshape(3) for v in (tcp, cube, goal))
    grip = GRIPPER_OPEN
    if grasped:                                                  # carry
        target, grip = goal, GRIPPER_CLOSED
    elif finger_gap < 0.01:                                      # closed on nothing: open, rise a little
        target = np.array([tcp[0], tcp[1], max(tcp[2], cube[2] + 0.03)])
    elif np.linalg.norm(tcp - cube) < 0.01:                      # at the cube's centre: close
        target, grip = tcp, GRIPPER_CLOSED
    elif np.linalg.norm(tcp[:2] - cube[:2]) < 0.01:              # above it: straight down
        target = cube
    else:                                                        # over to it, 5 cm above
        target = np.array([cube[0], cube[1], max(cube[2] + 0.05, min(tcp[2], cube[2] + 0.08))])
    move = np.clip((target - tcp) / EE_STEP_M, -1.0, 1.0)
    return np.append(move, grip).astype(np.float32)


def _pick_cube(base) -> np.ndarray:
    def p(actor):
        return actor.pose.p[0].detach().cpu().numpy()
    fingers = base.agent.robot.get_qpos()[0, -2:].detach().cpu().numpy()
    return pick_cube_action(p(base.agent.tcp), p(base.cube), p(base.goal_site),
                            bool(base.agent.is_grasping(base.cube)[0]), float(fingers.sum()),
                            float(base.cube_half_size))


def _push_cube(base) -> np.ndarray:
    def p(actor):
        return actor.pose.p[0].detach().cpu().numpy()
    return push_cube_action(p(base.agent.tcp), p(base.obj), p(base.goal_region), float(base.cube_half_size))


def _pull_cube(base) -> np.ndarray:
    def p(actor):
        return actor.pose.p[0].detach().cpu().numpy()
    return pull_cube_action(p(base.agent.tcp), p(base.obj), p(base.goal_region), float(base.cube_half_size))


EXPERTS: dict[str, Expert] = {
    "PushCube-v1": Expert("pd_ee_delta_pos", _push_cube),
    "PullCube-v1": Expert("pd_ee_delta_pos", _pull_cube),
    "PickCube-v1": Expert("pd_ee_delta_pos", _pick_cube),
}


def expert_for(env_id: str, control_mode: str) -> Expert:
    """The task's expert, or a ValueError naming the keys and what is allowed."""
    if env_id not in EXPERTS:
        raise ValueError(f"collect.method=scripted: env.id={env_id!r} has no scripted expert (there is one for "
                         f"{', '.join(sorted(EXPERTS))}); collect.method=motion_planning uses ManiSkill's planner")
    expert = EXPERTS[env_id]
    if control_mode != expert.control_mode:
        raise ValueError(f"collect.method=scripted: the {env_id} expert acts in env.control_mode="
                         f"{expert.control_mode!r}, not {control_mode!r}")
    return expert
