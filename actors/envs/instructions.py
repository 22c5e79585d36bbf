"""Language instructions for ManiSkill tasks, which carry none of their own.

Each names what the camera shows (object colours are the tasks' own); `env.instruction` in the
config replaces the table's entry or supplies one for a task not listed here. EVAL_INSTRUCTIONS:
a second phrasing of some, never trained on, given only by evaluations that ask for it
(actors/envs/tasks.py).
"""

from __future__ import annotations

from typing import Optional

INSTRUCTIONS = {
    "PushCube-v1": "push the blue cube to the red and white target",
    "PullCube-v1": "pull the blue cube back to the red and white target",
    "PickCube-v1": "pick up the red cube and move it to the goal position",
    "StackCube-v1": "stack the red cube on top of the green cube",
    "LiftPegUpright-v1": "lift the peg and stand it upright",
    "PokeCube-v1": "use the peg to push the red cube to the goal",
    "PushT-v1": "push the T-shaped block onto the target",
    "PlaceSphere-v1": "place the blue sphere into the bin",
    "RollBall-v1": "roll the ball to the goal region",
    "PegInsertionSide-v1": "insert the peg into the hole on the side of the box",
    "PlugCharger-v1": "plug the charger into the receptacle",
}

EVAL_INSTRUCTIONS = {
    "PushCube-v1": "slide the blue block onto the red and white goal",
    "PullCube-v1": "drag the blue block backwards onto the red and white goal",
    "PickCube-v1": "grasp the red block and carry it to the target",
    "StackCube-v1": "put the red block onto the green block",
}


def instruction_for(env_id: str, override: Optional[str] = None) -> str:
    """The configured instruction if given, else the table's; an unknown task without one is an error."""
    if override is not None:
        if not override.strip():
            raise ValueError("env.instruction is empty; give a sentence or null for the built-in one")
        return override
    if env_id not in INSTRUCTIONS:
        raise ValueError(f"env.id={env_id!r} has no built-in instruction; set env.instruction "
                         f"(tasks with one: {', '.join(sorted(INSTRUCTIONS))})")
    return INSTRUCTIONS[env_id]


def eval_instruction_for(env_id: str, override: Optional[str] = None) -> str:
    """The held-out phrasing: the configured one, else the table's, else the training sentence."""
    if override is not None:
        return instruction_for(env_id, override)
    return EVAL_INSTRUCTIONS.get(env_id) or instruction_for(env_id)
