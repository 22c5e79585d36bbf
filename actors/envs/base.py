"""What every env of the project shares: the result of one chunk step, the chunk loop that stops
an env at the end of its episode, episode statistics and image resizing (where episodes start: starts.py).

An env here is vectorised over B envs and stepped one action chunk (K env steps) at a time: the
`ChunkEnv` protocol, whose step returns a `ChunkStep`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol, runtime_checkable

import numpy as np

REWARD_TYPES = ("chunk_level", "action_level")


@dataclass
class ChunkStep:
    """The outcome of `env.step_chunk(actions [B,K,D])`.

    obs         next observation; for an env whose episode ended inside the chunk (and auto-reset
                is on) the first observation of its new episode
    reward      float32 [B] (chunk_level: sum over executed steps) or [B,K] (action_level: 0 after
                the end of the episode)
    terminated  bool [B] (success/failure; kept apart from) truncated bool [B] (time limit)
    success     bool [B]: success at the last executed step of the chunk
    final_obs   dict like obs, only for the envs in done_index (int64 [n]): their last observation
                of the episode that ended (bootstraps V at a truncation)
    episodes    one dict(return, length, success, env, task) per episode that ended; success =
                the task was solved at any step of the episode; task = its index in the run's
                tasks (actors/envs/tasks.py)
    env_steps   env steps actually executed (sum over envs)
    """
    obs: dict
    reward: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    success: np.ndarray
    final_obs: dict
    done_index: np.ndarray
    episodes: list = field(default_factory=list)
    env_steps: int = 0


@runtime_checkable
class ChunkEnv(Protocol):
    """What actors, the evaluator and the demo collector use of an env (PixelReachEnv,
    ManiSkillCPUEnv, ManiSkillBatchedEnv; built by `make_env`).

    reset(seed=None) -> {"image": uint8 [B,H,W,3], "state": float32 [B,S] if S > 0}
    step_chunk(actions float32 [B,K,D] in [-1, 1]) -> ChunkStep
    render_frames() -> uint8 [B,h,w,3], each env's camera image at its own resolution
    instructions: the language instruction of each env's current episode
    env_tasks: int64 [B], the task each env runs (its index in tasks.tasks_of(env config))
    """
    num_envs: int
    num_action_chunks: int
    action_dim: int
    state_dim: int
    instructions: list
    env_tasks: np.ndarray

    def reset(self, seed: Optional[int] = None) -> dict: ...

    def step_chunk(self, actions) -> ChunkStep: ...

    def render_frames(self) -> np.ndarray: ...

    def close(self) -> None: ...


@dataclass
class ChunkOutcome:
    """Per-env results of running one chunk (before auto-reset)."""
    rewards: np.ndarray      # float32 [B,K], 0 for steps not executed
    terminated: np.ndarray   # bool [B]
    truncated: np.ndarray    # bool [B]
    success: np.ndarray      # bool [B] at the last executed step
    success_any: np.ndarray  # bool [B] at any executed step
    steps: np.ndarray        # int64 [B] env steps executed

    @property
    def done(self) -> np.ndarray:
        return self.terminated | self.truncated


StepFn = Callable[[np.ndarray, np.ndarray], tuple]


def run_chunk(step_fn: StepFn, actions: np.ndarray, active: Optional[np.ndarray] = None,
              ignore_terminations: bool = False,
              on_end: Optional[Callable[[np.ndarray], None]] = None) -> ChunkOutcome:
    """Step B envs through a chunk of K actions, each env until its episode ends.

    step_fn(action [B,D], active bool [B]) -> (reward, terminated, truncated, success), each [B];
    it must advance the active envs and may advance or skip the others (their results are ignored).
    on_end(index) is called right after the step at which those envs ended (to capture a final
    observation when the simulator keeps stepping them). `active` marks envs allowed to step at all.
    """
    B, K = actions.shape[:2]
    active = np.ones(B, bool) if active is None else active.copy()
    out = ChunkOutcome(np.zeros((B, K), np.float32), np.zeros(B, bool), np.zeros(B, bool),
                       np.zeros(B, bool), np.zeros(B, bool), np.zeros(B, np.int64))
    for k in range(K):
        if not active.any():
            break
        reward, terminated, truncated, success = (np.asarray(x) for x in step_fn(actions[:, k], active))
        if ignore_terminations:
            terminated = np.zeros(B, bool)
        out.rewards[active, k] = reward[active]
        out.success[active] = success[active]
        out.success_any[active] |= success[active]
        out.terminated[active] = terminated[active]
        out.truncated[active] = truncated[active]
        out.steps[active] += 1
        ended = active & (terminated | truncated)
        active &= ~ended
        if on_end is not None and ended.any():
            on_end(np.flatnonzero(ended))
    return out


def reduce_reward(rewards: np.ndarray, reward_type: str) -> np.ndarray:
    """[B,K] per-step rewards -> [B] (chunk_level) or [B,K] (action_level)."""
    check_reward_type(reward_type)
    return rewards.sum(axis=1, dtype=np.float32) if reward_type == "chunk_level" else rewards


def check_reward_type(reward_type: str) -> None:
    if reward_type not in REWARD_TYPES:
        raise ValueError(f"reward_type={reward_type!r} is not allowed; choose one of {list(REWARD_TYPES)}")


def check_actions(actions, num_envs: int, num_chunks: int, action_dim: int,
                  min_dim: bool = False) -> np.ndarray:
    """float32 [B,K,D] clipped to [-1,1]; a wrong shape raises naming the expected one.
    min_dim: accept D >= action_dim (an env that reads only the first dims)."""
    a = np.asarray(actions, dtype=np.float32)
    ok = a.ndim == 3 and a.shape[:2] == (num_envs, num_chunks) and (
        a.shape[2] >= action_dim if min_dim else a.shape[2] == action_dim)
    if not ok:
        want = f"[{num_envs}, {num_chunks}, {'>=' if min_dim else ''}{action_dim}]"
        raise ValueError(f"actions have shape {list(a.shape)}; expected [B, K, D] = {want}")
    return np.clip(a, -1.0, 1.0)


def task_per_env(env_tasks, num_envs: int) -> np.ndarray:
    """int64 [num_envs]: each env's index in the run's tasks (actors/envs/tasks.py); None: one task."""
    index = np.zeros(num_envs, np.int64) if env_tasks is None else np.asarray(env_tasks, np.int64)
    if index.shape != (num_envs,):
        raise ValueError(f"env_tasks has shape {index.shape}; expected one task per env: ({num_envs},)")
    return index


class EpisodeTracker:
    """Running return, length and success of the current episode of each env (and its task)."""

    def __init__(self, num_envs: int, env_tasks=None):
        self.tasks = task_per_env(env_tasks, num_envs)
        self.ret = np.zeros(num_envs, np.float64)
        self.length = np.zeros(num_envs, np.int64)
        self.success = np.zeros(num_envs, bool)

    def add(self, out: ChunkOutcome) -> None:
        self.ret += out.rewards.sum(axis=1)
        self.length += out.steps
        self.success |= out.success_any

    def finish(self, index: np.ndarray, env_offset: int = 0) -> list[dict]:
        """Stats of the episodes of envs `index` (which just ended); their counters restart."""
        episodes = [{"return": float(self.ret[i]), "length": int(self.length[i]),
                     "success": bool(self.success[i]), "env": int(i) + env_offset,
                     "task": int(self.tasks[i])} for i in index]
        self.ret[index], self.length[index], self.success[index] = 0.0, 0, False
        return episodes


def resize_images(images: np.ndarray, size: int) -> np.ndarray:
    """uint8 [N,h,w,3] -> uint8 [N,size,size,3]. Integer downscales average pixel blocks (cheap
    and alias-free); other sizes use antialiased bilinear interpolation."""
    n, h, w, c = images.shape
    if (h, w) == (size, size):
        return images
    if h % size == 0 and w % size == 0:
        blocks = images.reshape(n, size, h // size, size, w // size, c)
        return (blocks.mean(axis=(2, 4), dtype=np.float32) + 0.5).astype(np.uint8)
    import torch
    import torch.nn.functional as F
    x = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).float()
    y = F.interpolate(x, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    return y.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous().numpy()


def select(obs: dict, index) -> dict:
    """Rows `index` of every array in an observation dict."""
    return {k: v[index] for k, v in obs.items()}
