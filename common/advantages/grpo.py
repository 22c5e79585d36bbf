"""GRPO: critic-free, group-relative advantages, scored on the actors.

An actor numbers the episodes its envs start in the order they start them: the slot s. Slots
gG .. gG + G - 1 form group g (G = algorithm.group_size), and the env wrapper starts every
episode of a group from the same initial state (actors/envs/starts.py `StartSchedule`). Once every
episode of a group has ended, each gets

    A_i = (R_i - mean_g R) / (std_g R + eps)        R_i: the sum of episode i's rewards

(std unbiased, as torch.std in RLinf's GRPO), and every policy step of episode i trains with A_i.
A group whose returns are all equal (all solved, or none) carries no signal and trains nothing.

The actors score the steps (an actor's GroupOutbox holds each segment until every episode it has a
step of belongs to a group whose episodes have all ended) and send each step's advantage and
whether it trains (`advantage_mask`: 0 for a group whose returns are all equal). A held segment
keeps the policy version that made it, so the learner's lag rule (learner.max_policy_lag) bounds
how stale a group's steps may be when they train. The learner runs no critic for it: no value
targets, no truncation bootstraps, no value loss, and the loss does not normalise the advantages
again (they come normalised within their groups).
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from asyncvla.common.transport.protocol.segments import Field

from . import Estimator, Outbox, TargetInputs, Targets, register, step_log_ratio

# Each step's group-relative advantage, and whether it trains (0: its group's returns were all equal).
GROUP_FIELDS = {"advantage": Field("float32", ("T", "B"), "step", "advantage"),
                "advantage_mask": Field("uint8", ("T", "B"), "step")}


@register
class GRPO(Estimator):
    """Group-relative advantages of algorithm.group_size episodes from one initial state."""
    name = "grpo"
    critic = False
    renormalize = False

    def config_problems(self, config) -> list[str]:
        env = config.env
        if env.use_fixed_reset_state_ids:
            return ["algorithm.adv_type=grpo draws one initial state per group of episodes; "
                    "env.use_fixed_reset_state_ids=true would repeat the same ones: set it to false"]
        if env.sim_backend == "physx_cuda":
            return ["algorithm.adv_type=grpo needs each group's episodes to start from one initial state, which "
                    "the batched GPU simulator's partial resets cannot restore: set env.sim_backend=physx_cpu"]
        if env.retry_failed_starts:
            return [f"env.retry_failed_starts={env.retry_failed_starts} cannot be used with "
                    "algorithm.adv_type=grpo: its groups already repeat each start; set it to 0"]
        return []

    @property
    def episodes_per_start(self) -> int:
        return self.alg.group_size

    def make_outbox(self) -> Outbox:
        return GroupOutbox(self.alg.group_size)

    def segment_fields(self) -> dict:
        return dict(GROUP_FIELDS)

    def segment_bounds(self) -> dict:
        # |A| < sqrt(G): one return apart from G - 1 equal ones gives (G - 1) / sqrt(G)
        g = math.sqrt(self.alg.group_size)
        return {"advantage": (-g, g, "out_of_range")}

    def targets(self, x: TargetInputs) -> Targets:
        import torch
        device = x.behavior_logp.device
        mask = torch.from_numpy(x.arrays["advantage_mask"]).to(device).float()
        return Targets(advantages=torch.from_numpy(x.arrays["advantage"]).to(device).float(), value_targets=None,
                       rhos=step_log_ratio(x.behavior_logp, x.target_logp).exp(), mask=mask,
                       stats={"rollout/group_steps_kept": float(mask.mean())})


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


class GroupOutbox(Outbox):
    """Segments held until their groups are complete. `info["slots"]` [T, B]: the slot of the
    episode each step belongs to; `info["ended"]`: (slot, return) of each episode that ended in
    the segment; `info["running"]` [B]: the slots of the episodes still running after it."""
    needs_slots = True

    def __init__(self, group_size: int):
        self.group_size = group_size
        self._held: deque = deque()                 # (meta, arrays, slots [T, B])
        self._returns: dict[int, float] = {}        # slot -> return, of the episodes that ended

    def add(self, meta: dict, arrays: dict, info: dict) -> list[tuple[dict, dict]]:
        self._held.append((meta, arrays, np.asarray(info["slots"], np.int64)))
        self._returns.update(info["ended"])
        out = []
        while self._held and self._complete(self._held[0][2]):       # (in order: the oldest first)
            meta, arrays, slots = self._held.popleft()
            out.append((meta, self._scored(arrays, slots)))
        self._forget(int(np.min(info["running"])))
        return out

    @property
    def held(self) -> int:
        return len(self._held)

    def _complete(self, slots: np.ndarray) -> bool:
        """Every group of these slots has all its episodes ended."""
        G = self.group_size
        return all(all(s in self._returns for s in range(g * G, (g + 1) * G)) for g in np.unique(slots // G))

    def _scored(self, arrays: dict, slots: np.ndarray) -> dict:
        G = self.group_size
        members = np.array([s for g in np.unique(slots // G) for s in range(g * G, (g + 1) * G)], np.int64)
        adv, scored = group_advantages(members, np.array([self._returns[s] for s in members]), G)
        where = np.searchsorted(members, slots)
        return {**arrays, "advantage": adv[where].astype(np.float32), "advantage_mask": scored[where].astype(np.uint8)}

    def _forget(self, running: int) -> None:
        """Drop the returns of groups no segment needs any more: older than every held segment's
        and every running episode's (later segments hold only slots from those on)."""
        oldest = min([running] + [int(slots.min()) for _, _, slots in self._held]) // self.group_size
        for s in [s for s in self._returns if s // self.group_size < oldest]:
            del self._returns[s]
