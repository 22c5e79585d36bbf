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


def _push_cube(base) -> np.ndarray:
    def p(actor):
        return actor.pose.p[0].detach().cpu().numpy()
    return push_cube_action(p(base.agent.tcp), p(base.obj), p(base.goal_region), float(base.cube_half_size))


EXPERTS: dict[str, Expert] = {
    "PushCube-v1": Expert("pd_ee_delta_pos", _push_cube),
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
