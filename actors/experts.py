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


def push_cube_action(tcp, cube, goal, half: float = 0.02) -> np.ndarray:
    """PushCube in pd_ee_delta_pos: over to a spot 5 cm behind the cube (-x side) at 6 cm height,
    down to the cube's mid-height, then push +x past the goal while holding y on the cube's y.
    The hand stays closed, as ManiSkill's own solution keeps it. Positions in metres, world frame."""
    tcp, cube, goal = (np.asarray(v, np.float64).reshape(3) for v in (tcp, cube, goal))
    behind = np.array([cube[0] - half - 0.05, cube[1], half])
    low = tcp[2] < half + 0.015
    behind_cube = abs(tcp[1] - cube[1]) < 0.015 and tcp[0] < cube[0] - half - 0.005
    if low and behind_cube:                                      # push
        target = np.array([goal[0] + 0.02, cube[1], half])
    elif np.linalg.norm(tcp[:2] - behind[:2]) < 0.015:          # above the spot: go down
        target = behind
    else:                                                        # over to the spot, high
        target = np.array([behind[0], behind[1], 0.06])
    move = np.clip((target - tcp) / EE_STEP_M, -1.0, 1.0)
    return np.append(move, GRIPPER_CLOSED).astype(np.float32)


def pull_cube_action(tcp, cube, goal, half: float = 0.02) -> np.ndarray:
    """PullCube in pd_ee_delta_pos: push_cube_action mirrored. Over to a spot 5 cm in front of the
    cube (+x side, away from the robot) at 6 cm height, down to the cube's mid-height, then draw
    it back (-x) past the goal while holding y on the cube's y; the hand stays closed."""
    tcp, cube, goal = (np.asarray(v, np.float64).reshape(3) for v in (tcp, cube, goal))
    front = np.array([cube[0] + half + 0.05, cube[1], half])
    low = tcp[2] < half + 0.015
    before_cube = abs(tcp[1] - cube[1]) < 0.015 and tcp[0] > cube[0] + half + 0.005
    if low and before_cube:                                      # pull
        target = np.array([goal[0] - 0.02, cube[1], half])
    elif np.linalg.norm(tcp[:2] - front[:2]) < 0.015:           # above the spot: go down
        target = front
    else:                                                        # over to the spot, high
        target = np.array([front[0], front[1], 0.06])
    move = np.clip((target - tcp) / EE_STEP_M, -1.0, 1.0)
    return np.append(move, GRIPPER_CLOSED).astype(np.float32)


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
