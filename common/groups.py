"""Groups of episodes from one initial state, for critic-free, group-relative advantages (GRPO).

An actor numbers the episodes its envs start in the order they start them: the slot s. Slots
gG .. gG + G - 1 form group g (G = algorithm.group_size), and the env wrapper starts every
episode of a group from the same initial state (actors/envs/base.py `ResetSeeds`). Once every
episode of a group has ended, each gets

    A_i = (R_i - mean_g R) / (std_g R + eps)        R_i: the sum of episode i's rewards

(std unbiased, as torch.std in RLinf's GRPO), and every policy step of episode i trains with A_i.
A group whose returns are all equal (all solved, or none) carries no signal and trains nothing.
"""

from __future__ import annotations

import numpy as np

GROUP_EPS = 1e-6


def group_advantages(slots: np.ndarray, returns: np.ndarray, group_size: int,
                     eps: float = GROUP_EPS) -> tuple[np.ndarray, np.ndarray]:
    """Advantages of the episodes `slots` [n] (int, distinct) with `returns` [n], their groups
    being slot // group_size: (advantages float32 [n], scored bool [n]). An episode is scored when
    all of its group's episodes are among the n and their returns are not all equal; the others
    get advantage 0 (a group still running, or one with nothing to learn from)."""
    if group_size < 2:
        raise ValueError(f"algorithm.group_size={group_size}: a group needs at least 2 episodes (its own "
                         "baseline is the group's mean return)")
    slots, returns = np.asarray(slots, np.int64), np.asarray(returns, np.float64)
    if slots.shape != returns.shape or slots.ndim != 1:
        raise ValueError(f"slots {slots.shape} and returns {returns.shape} must be [n] alike")
    groups, index, counts = np.unique(slots // group_size, return_inverse=True, return_counts=True)
    sums = np.bincount(index, returns, minlength=len(groups))
    mean = sums / counts
    var = np.bincount(index, (returns - mean[index]) ** 2, minlength=len(groups)) / np.maximum(counts - 1, 1)
    std = np.sqrt(var)
    scored = (counts[index] == group_size) & (std[index] > 0)
    adv = np.where(scored, (returns - mean[index]) / (std[index] + eps), 0.0)
    return adv.astype(np.float32), scored
