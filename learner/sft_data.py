"""Supervised samples from demonstrations: what the policy sees, the action tokens it should emit,
and the discounted return the critic should predict.

A sample is one demo step t: the image at t (and the robot's state at t where the demos record it
and the policy reads one), the episode's instruction, and the chunk of the next
K labelled actions a_t .. a_{t+K-1} (an episode's last steps repeat its final action), tokenized
exactly as RL actions are (`ActionTokenizer.encode`). Every step starts a sample, so a demo of T
steps gives T samples. The critic's target is the Monte-Carlo return in RL's own units:

    chunk_level:   G_t = sum_j  gamma^j  * (r_{t+jK} + ... + r_{t+jK+K-1})
    action_level:  G_t = sum_i  gamma^i  * r_{t+i}

(`returns_to_go`; an episode that ends in success adds nothing after its end, as a terminal state.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np

from asyncvla.common.data.demos import DemoEpisode, DemoError, flat_states


@dataclass
class SFTSamples:
    images: np.ndarray         # uint8 [m, H, W, 3]: the frames (in memory or mapped from disk)
    instructions: list         # str per sample
    actions: np.ndarray        # float32 [n, K, D]
    returns: np.ndarray        # float32 [n]
    episode: np.ndarray        # int64 [n]: index of the demo episode it came from
    states: np.ndarray | None = None   # float32 [n, S]: the robot's state (env.use_proprio)
    rows: np.ndarray | None = None     # int64 [n]: sample i's frame is images[rows[i]] (None: images[i])

    def __len__(self) -> int:
        return len(self.actions)

    @property
    def num_episodes(self) -> int:
        return int(self.episode.max()) + 1 if len(self.episode) else 0

    def frames(self, index: np.ndarray) -> np.ndarray:
        """The images of samples `index`, read from wherever the frames live."""
        return self.images[index if self.rows is None else self.rows[index]]

    def subset(self, index: np.ndarray) -> "SFTSamples":
        """Samples `index`; the frames are shared, not copied (they may be larger than memory)."""
        return SFTSamples(self.images, [self.instructions[i] for i in index], self.actions[index],
                          self.returns[index], self.episode[index],
                          None if self.states is None else self.states[index],
                          index if self.rows is None else self.rows[index])


def action_range_q99(actions: np.ndarray, min_width: float = 1e-3) -> tuple[list[float], list[float]]:
    """Per dimension, the 1st and 99th percentiles of the demos' actions [n, D] (OpenVLA's
    BOUNDS_Q99), within the env's [-1, 1]. A dimension the demos hold (nearly) constant, such as a
    gripper kept closed, keeps [-1, 1]: a range of width ~0 cannot be binned."""
    low = np.clip(np.percentile(actions, 1, axis=0), -1.0, 1.0)
    high = np.clip(np.percentile(actions, 99, axis=0), -1.0, 1.0)
    flat = high - low < min_width
    low[flat], high[flat] = -1.0, 1.0
    return [round(float(v), 6) for v in low], [round(float(v), 6) for v in high]


def action_chunks(actions: np.ndarray, K: int) -> np.ndarray:
    """[T, D] -> [T, K, D]: chunk t holds actions t .. t+K-1, the last action repeated past the end."""
    T = len(actions)
    idx = np.minimum(np.arange(T)[:, None] + np.arange(K)[None, :], T - 1)
    return actions[idx]


def returns_to_go(rewards: np.ndarray, gamma: float, K: int, reward_type: str) -> np.ndarray:
    """Discounted return from every step t of one episode (see the module docstring)."""
    T = len(rewards)
    out = np.zeros(T, np.float64)
    if reward_type == "action_level":
        acc = 0.0
        for t in range(T - 1, -1, -1):
            acc = rewards[t] + gamma * acc
            out[t] = acc
        return out.astype(np.float32)
    # chunk_level: G_t = R_t^chunk + gamma * G_{t+K}, with R_t^chunk the sum of the next K rewards
    csum = np.concatenate([[0.0], np.cumsum(rewards, dtype=np.float64)])
    chunk = csum[np.minimum(np.arange(T) + K, T)] - csum[:T]
    for t in range(T - 1, -1, -1):
        out[t] = chunk[t] + (gamma * out[t + K] if t + K < T else 0.0)
    return out.astype(np.float32)


def build_samples(episodes: Iterable[DemoEpisode], K: int, gamma: float, reward_type: str,
                  default_instruction: str | None, frames: np.ndarray | None = None) -> SFTSamples:
    """Every step of every episode as a sample. Episodes without rewards get return 0 (the critic
    warm-up then has nothing to learn from them: set sft.value_loss_coef=0).

    frames: where the images go, uint8 [>= total steps, H, W, 3] (e.g. a file mapped into memory:
    episodes then stream through, one at a time, and only the small columns stay in memory);
    None: the episodes' images are concatenated in memory."""
    images, instr, chunks, rets, ep_index, states = [], [], [], [], [], []
    filled = 0
    for i, ep in enumerate(episodes):
        text = ep.instruction or default_instruction
        if not text:
            raise DemoError(f"demo episode {ep.episode_id} has no instruction and the env has none "
                            "(set env.instruction)")
        T = ep.num_steps
        if frames is None:
            images.append(ep.images[:T])
        elif filled + T > len(frames):
            raise DemoError(f"demo episode {ep.episode_id} does not fit: {filled + T} steps, "
                            f"room for {len(frames)}")
        else:
            frames[filled:filled + T] = ep.images[:T]
        filled += T
        instr += [text] * T
        chunks.append(action_chunks(ep.actions, K))
        rets.append(returns_to_go(ep.rewards, gamma, K, reward_type) if ep.rewards is not None
                    else np.zeros(T, np.float32))
        ep_index.append(np.full(T, i, np.int64))
        if ep.states:
            states.append(flat_states(ep.states)[:T])
    if states and len(states) != len(chunks):
        raise DemoError("some demo episodes carry a state (obs/agent, obs/extra) and others do not")
    if not chunks:
        raise DemoError("no demo episode to learn from")
    return SFTSamples(np.concatenate(images) if frames is None else frames[:filled], instr,
                      np.concatenate(chunks).astype(np.float32),
                      np.concatenate(rets), np.concatenate(ep_index),
                      np.concatenate(states) if states else None)


def random_shift(images: np.ndarray, pad: int, rng: np.random.Generator) -> np.ndarray:
    """DrQ's augmentation: each image [n, H, W, C] padded by `pad` edge pixels on every side and
    cropped back to H x W at an offset drawn uniformly from [0, 2 * pad] per image and axis. The
    gathers index the padded batch directly (one copy, no loop over images)."""
    if pad == 0:
        return images
    n, h, w, _ = images.shape
    padded = np.pad(images, ((0, 0), (pad, pad), (pad, pad), (0, 0)), mode="edge")
    dy, dx = rng.integers(0, 2 * pad + 1, size=(2, n))
    rows = (dy[:, None] + np.arange(h))[:, :, None]            # [n, H, 1]
    cols = (dx[:, None] + np.arange(w))[:, None, :]            # [n, 1, W]
    return padded[np.arange(n)[:, None, None], rows, cols]


def split_by_episode(samples: SFTSamples, num_episodes: int, val_fraction: float,
                     seed: int) -> tuple[SFTSamples, SFTSamples | None]:
    """Hold out whole episodes (steps of one episode are near-duplicates: splitting steps would leak)."""
    n_val = int(round(val_fraction * num_episodes))
    if val_fraction > 0 and num_episodes >= 2:
        n_val = min(max(n_val, 1), num_episodes - 1)
    else:
        n_val = 0
    held = np.random.default_rng(seed).permutation(num_episodes)[:n_val]
    is_val = np.isin(samples.episode, held)
    train = samples.subset(np.flatnonzero(~is_val))
    return train, (samples.subset(np.flatnonzero(is_val)) if n_val else None)
