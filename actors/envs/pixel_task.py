"""PixelReach-v0: a point agent must reach a target, seen only through a small RGB image.

The arena is the unit square. A white dot (the agent) and a coloured square (the target, one of
four colours drawn per episode) are rendered on a dark background; the instruction names the
target's colour ("move the white dot to the red square"). Action dims 0 and 1 are the dot's
velocity in x (image columns) and y (image rows); further dims are ignored, so a 7-D policy works
too. Success (the dot's centre within SUCCESS_RADIUS of the target's) terminates the episode; the
time limit truncates it. Reward: progress toward the target plus a bonus on success (dense), or
the bonus alone (sparse). Everything is numpy, vectorised over the envs of one process, and the
image is drawn only when an observation is needed (once per chunk), so it is fast.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from asyncvla.actors.envs.base import (ChunkStep, EpisodeTracker, check_actions,
                                       check_reward_type, reduce_reward, run_chunk)
from asyncvla.actors.envs.starts import StartSchedule

ENV_ID = "PixelReach-v0"
DEFAULT_MAX_EPISODE_STEPS = 50
SPEED = 0.06               # arena units per step at |action| = 1: a side is ~17 steps
# Shapes span more than one 8 px patch of a 64 px ViT: with a 6 px dot and an 8 px square a tiny
# random-init VLM cloning the oracle reached 5-33 % greedy success in 900 steps; at these sizes
# 67 % in 600.
AGENT_RADIUS = 0.08        # a 10 px disc at 64 px
TARGET_HALF_SIZE = 0.12    # a 15 px square at 64 px
SUCCESS_RADIUS = 0.08
MARGIN = 0.13              # initial positions keep the shapes inside the image
MIN_START_DISTANCE = 0.3   # so that random behaviour rarely succeeds
PROGRESS_SCALE = 2.0       # dense reward per arena unit of approach
SUCCESS_BONUS = 1.0
BACKGROUND = np.array([40, 40, 40], np.uint8)
AGENT_COLOUR = np.array([240, 240, 240], np.uint8)
TARGET_COLOURS = {"red": (230, 50, 50), "green": (50, 200, 70), "blue": (60, 110, 240),
                  "yellow": (230, 200, 40)}
_COLOUR_NAMES = list(TARGET_COLOURS)
_COLOUR_TABLE = np.array(list(TARGET_COLOURS.values()), np.uint8)
VIDEO_SIZE = 128


class PixelReachEnv:
    """B PixelReach envs stepped one action chunk at a time (the interface of `make_env`)."""

    def __init__(self, num_envs: int, image_size: int, num_action_chunks: int, reward_type: str,
                 seed: int = 0, *, action_dim: int = 2, max_episode_steps: Optional[int] = None,
                 reward_mode: str = "dense", ignore_terminations: bool = False, auto_reset: bool = True,
                 instruction: Optional[str] = None, use_proprio: bool = False,
                 starts: Optional[StartSchedule] = None):
        check_reward_type(reward_type)
        if action_dim < 2:
            raise ValueError(f"{ENV_ID} needs action_dim >= 2 (x and y velocity), got {action_dim}")
        if reward_mode not in ("sparse", "dense", "normalized_dense"):
            raise ValueError(f"env.reward_mode={reward_mode!r} is not allowed for {ENV_ID}; choose one "
                             "of ['sparse', 'dense', 'normalized_dense']")
        self.num_envs, self.image_size, self.num_action_chunks = num_envs, image_size, num_action_chunks
        self.action_dim, self.reward_type, self.reward_mode = action_dim, reward_type, reward_mode
        self.state_dim = 2 if use_proprio else 0
        self.max_episode_steps = max_episode_steps or DEFAULT_MAX_EPISODE_STEPS
        self.ignore_terminations, self.auto_reset = ignore_terminations, auto_reset
        self._instruction = instruction
        self._seeds = starts or StartSchedule(seed, num_envs)      # (make_env builds it for its purpose)
        B = num_envs
        self._agent = np.zeros((B, 2))
        self._target = np.zeros((B, 2))
        self._colour = np.zeros(B, np.int64)
        self._t = np.zeros(B, np.int64)
        self._dist = np.zeros(B)
        self._ended = np.zeros(B, bool)       # only without auto-reset: waits for reset()
        self._tracker = EpisodeTracker(B)
        self._started = False
        self.env_tasks = np.zeros(B, np.int64)          # (one task)

    @property
    def instructions(self) -> list[str]:
        if self._instruction is not None:
            return [self._instruction] * self.num_envs
        return [f"move the white dot to the {_COLOUR_NAMES[c]} square" for c in self._colour]

    @property
    def episode_slots(self) -> np.ndarray:
        """int64 [B]: the slot of each env's current episode (starts.py)."""
        return self._seeds.slot.copy()

    def reset(self, seed: Optional[int] = None) -> dict:
        """Start a new episode in every env (`seed` re-seeds as at construction)."""
        self._seeds.restart(seed)
        self._tracker = EpisodeTracker(self.num_envs)
        self._ended[:] = False
        self._reset_envs(np.arange(self.num_envs))
        self._started = True
        return self._observe()

    def step_chunk(self, actions) -> ChunkStep:
        if not self._started:
            raise RuntimeError("call reset() before step_chunk()")
        a = check_actions(actions, self.num_envs, self.num_action_chunks, 2, min_dim=True)[:, :, :2]
        out = run_chunk(self._step, a, active=~self._ended, ignore_terminations=self.ignore_terminations)
        self._tracker.add(out)
        done = np.flatnonzero(out.done)
        final_obs = self._observe(done)
        episodes = self._tracker.finish(done)
        if self.auto_reset:
            for e in episodes:
                e["retried"] = self._seeds.ended(e["env"], e["success"])
            self._reset_envs(done)
        else:
            self._ended[done] = True
        return ChunkStep(obs=self._observe(), reward=reduce_reward(out.rewards, self.reward_type),
                         terminated=out.terminated, truncated=out.truncated, success=out.success,
                         final_obs=final_obs, done_index=done.astype(np.int64), episodes=episodes,
                         env_steps=int(out.steps.sum()))

    def render_frames(self) -> np.ndarray:
        """The current scenes at VIDEO_SIZE px (or the policy's size if larger), for videos."""
        return render(self._agent, self._target, self._colour, max(VIDEO_SIZE, self.image_size))

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------------------ internals
    def _step(self, action: np.ndarray, active: np.ndarray):
        moved = np.minimum(np.maximum(self._agent + SPEED * action, AGENT_RADIUS), 1.0 - AGENT_RADIUS)
        self._agent = np.where(active[:, None], moved, self._agent)
        self._t += active
        dist = np.linalg.norm(self._agent - self._target, axis=1)
        success = dist < SUCCESS_RADIUS
        reward = SUCCESS_BONUS * success
        if self.reward_mode != "sparse":
            reward = reward + PROGRESS_SCALE * (self._dist - dist)
        self._dist = np.where(active, dist, self._dist)
        return reward.astype(np.float32), success, self._t >= self.max_episode_steps, success

    def _reset_envs(self, index: np.ndarray) -> None:
        for i in index:
            rng = np.random.default_rng(self._seeds.take(int(i)))
            self._target[i] = rng.uniform(MARGIN, 1.0 - MARGIN, 2)
            while True:   # rejection sampling: start far enough from the target
                self._agent[i] = rng.uniform(MARGIN, 1.0 - MARGIN, 2)
                if np.linalg.norm(self._agent[i] - self._target[i]) >= MIN_START_DISTANCE:
                    break
            self._colour[i] = rng.integers(len(_COLOUR_NAMES))
        self._t[index] = 0
        self._dist[index] = np.linalg.norm(self._agent[index] - self._target[index], axis=1)

    def _observe(self, index=slice(None)) -> dict:
        if isinstance(index, np.ndarray) and not len(index):
            S = self.image_size
            return {"image": np.zeros((0, S, S, 3), np.uint8),
                    **({"state": np.zeros((0, 2), np.float32)} if self.state_dim else {})}
        obs = {"image": render(self._agent[index], self._target[index], self._colour[index],
                               self.image_size)}
        if self.state_dim:
            obs["state"] = (2.0 * self._agent[index] - 1.0).astype(np.float32)
        return obs

    # for scripted policies and tests: positions in arena units
    @property
    def agent_position(self) -> np.ndarray:
        return self._agent.copy()

    @property
    def target_position(self) -> np.ndarray:
        return self._target.copy()


def render(agent: np.ndarray, target: np.ndarray, colour: np.ndarray, size: int) -> np.ndarray:
    """uint8 [B,size,size,3]: the target square, then the agent dot on top, on the background.
    A pixel belongs to a shape when its centre does; each shape is drawn inside its bounding box
    only (a per-env loop of a few slices is faster here than full-image masks)."""
    B = len(agent)
    image = np.empty((B, size, size, 3), np.uint8)
    image[:] = _background(size)
    t_lo, t_hi = _pixel_span(target, TARGET_HALF_SIZE, size)
    a_lo, a_hi = _pixel_span(agent, AGENT_RADIUS, size)
    colours = _COLOUR_TABLE[colour]
    for b in range(B):
        image[b, t_lo[b, 1]:t_hi[b, 1], t_lo[b, 0]:t_hi[b, 0]] = colours[b]
        dy = (np.arange(a_lo[b, 1], a_hi[b, 1]) + 0.5) / size - agent[b, 1]
        dx = (np.arange(a_lo[b, 0], a_hi[b, 0]) + 0.5) / size - agent[b, 0]
        disc = dy[:, None] ** 2 + dx[None, :] ** 2 <= AGENT_RADIUS ** 2
        image[b, a_lo[b, 1]:a_hi[b, 1], a_lo[b, 0]:a_hi[b, 0]][disc] = AGENT_COLOUR
    return image


def _pixel_span(centre: np.ndarray, half: float, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Pixel index ranges [lo, hi) whose centres (j + 0.5) / size lie within centre +- half."""
    lo = np.ceil((centre - half) * size - 0.5).astype(np.int64)
    hi = np.floor((centre + half) * size + 0.5).astype(np.int64)
    return np.maximum(lo, 0), np.minimum(hi, size)   # (ufuncs: np.clip costs more at this size)


_BACKGROUNDS: dict[int, np.ndarray] = {}


def _background(size: int) -> np.ndarray:
    # copying a ready image is ~20x faster than broadcasting a colour into it
    if size not in _BACKGROUNDS:
        _BACKGROUNDS[size] = np.broadcast_to(BACKGROUND, (size, size, 3)).copy()
    return _BACKGROUNDS[size]


def scripted_actions(env: PixelReachEnv, num_action_chunks: int, action_dim: int) -> np.ndarray:
    """Oracle: every step of the chunk heads straight for the target (as if re-planned per step)."""
    out = np.zeros((env.num_envs, num_action_chunks, action_dim), np.float32)
    pos = env.agent_position
    for k in range(num_action_chunks):
        step = np.clip((env.target_position - pos) / SPEED, -1.0, 1.0)
        out[:, k, :2] = step
        pos = np.clip(pos + SPEED * step, AGENT_RADIUS, 1.0 - AGENT_RADIUS)
    return out
