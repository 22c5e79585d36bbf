"""The tasks a run trains one policy on, and which env runs which.

    tasks = tasks_of(cfg.env)                       # [Task]: env.tasks, or env.id alone
    index = deal(tasks, first_env=8, num_envs=4)    # the task of each of envs 8..11 of the fleet
    texts = instructions_in(tasks, "eval")          # what an evaluation tells each task's envs
    env_cfg = one_task(cfg.env, tasks[1], texts[1]) # one task alone, to evaluate it

A task is a ManiSkill env id with the instruction its envs give the policy; its index in
`tasks_of` is what segments carry (ep_task) and the learner counts success by. Each task has a
second phrasing (`eval_instruction`), given only when an evaluation asks for the "eval"
instruction set, so that success on words never trained on shows the policy reads the language;
the "swapped" set gives each task another's sentence, where a policy that reads it should fail.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from asyncvla.actors.envs import pixel_task
from asyncvla.actors.envs.instructions import eval_instruction_for, instruction_for

INSTRUCTION_SETS = ("train", "eval", "swapped")
DEAL_PERIOD = 4096


@dataclass(frozen=True)
class Task:
    id: str                              # the ManiSkill env id; also the task's name in metrics
    instruction: Optional[str]           # None: the env phrases its own (the pixel task)
    eval_instruction: Optional[str]
    share: float = 1.0
    max_episode_steps: Optional[int] = None
    reward_mode: Optional[str] = None



def tasks_of(env_cfg) -> list[Task]:
    """The run's tasks: env.tasks, each with env's settings where it has none of its own; or the one
    task env.id (env.instruction)."""
    if not env_cfg.tasks:
        if env_cfg.id == pixel_task.ENV_ID:       # (its instruction names a colour drawn per episode)
            return [Task(env_cfg.id, env_cfg.instruction, env_cfg.instruction,
                         max_episode_steps=env_cfg.max_episode_steps, reward_mode=env_cfg.reward_mode)]
        text = instruction_for(env_cfg.id, env_cfg.instruction)
        return [Task(env_cfg.id, text, eval_instruction_for(env_cfg.id) if env_cfg.instruction is None else text,
                     max_episode_steps=env_cfg.max_episode_steps, reward_mode=env_cfg.reward_mode)]
    return [Task(t.id, instruction_for(t.id, t.instruction),
                 t.eval_instruction if t.eval_instruction is not None else eval_instruction_for(t.id),
                 t.share, t.max_episode_steps or env_cfg.max_episode_steps, t.reward_mode or env_cfg.reward_mode)
            for t in env_cfg.tasks]


def deal(tasks: Sequence[Task], first_env: int, num_envs: int) -> np.ndarray:
    """int64 [num_envs]: the task index of the fleet's envs first_env .. first_env + num_envs - 1.

    The fleet's envs are dealt out by smooth weighted round robin: each env goes to the task
    furthest behind its share, so that any run of consecutive envs (one actor's, or the first n of
    the fleet) holds each task within one env of its share. The deal starts over every DEAL_PERIOD
    envs (a standalone actor's index is a hash of its id)."""
    first_env %= DEAL_PERIOD
    shares = np.array([t.share for t in tasks], np.float64)
    credit, total = np.zeros(len(tasks)), shares.sum()
    out = np.zeros(first_env + num_envs, np.int64)
    for g in range(first_env + num_envs):
        credit += shares
        out[g] = int(np.argmax(credit))
        credit[out[g]] -= total
    return out[first_env:]


def instructions_in(tasks: Sequence[Task], instruction_set: str) -> list[Optional[str]]:
    """What each task's envs tell the policy in `instruction_set`: train (its sentence), eval (its
    held-out phrasing) or swapped (the next task's training sentence: the control that shows
    whether a policy reads the instruction at all)."""
    if instruction_set not in INSTRUCTION_SETS:
        raise ValueError(f"instruction set {instruction_set!r}: one of {list(INSTRUCTION_SETS)}")
    if instruction_set == "eval":
        return [t.eval_instruction for t in tasks]
    if instruction_set == "swapped":
        if len(tasks) < 2 or any(t.instruction is None for t in tasks):
            raise ValueError("the swapped instruction set gives each task another task's sentence: it needs "
                             "two tasks or more (env.tasks)")
        return [tasks[(i + 1) % len(tasks)].instruction for i in range(len(tasks))]
    return [t.instruction for t in tasks]


def one_task(env_cfg, task: Task, instruction: Optional[str]):
    """The env config of `task` alone, telling the policy `instruction` (an evaluation per task)."""
    return dataclasses.replace(env_cfg, id=task.id, tasks=[], instruction=instruction,
                               max_episode_steps=task.max_episode_steps,
                               reward_mode=task.reward_mode or env_cfg.reward_mode)
