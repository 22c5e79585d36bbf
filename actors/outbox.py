"""What an actor sends of the segments it collects, as the learner's advantage needs them.

    outbox = make_outbox(cfg)
    for meta, arrays in outbox.add(meta, arrays, info):   # each segment, now or once it can be scored
        send(meta, arrays)

With V-trace (algorithm.adv_type vtrace) every segment goes at once: the learner scores it with
its critic. With GRPO each segment waits until every episode it holds a step of belongs to a group
whose episodes have all ended (common/groups.py); it then goes with each step's group-relative
advantage (`advantage`) and whether that step trains (`advantage_mask`: 0 for a group whose
returns are all equal). A held segment keeps the policy version that made it, so the learner's
lag rule (learner.max_policy_lag) bounds how stale a group's steps may be when they train.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from asyncvla.common.groups import group_advantages


def make_outbox(cfg):
    return GroupOutbox(cfg.algorithm.group_size) if cfg.algorithm.adv_type == "grpo" else Outbox()


class Outbox:
    """Every segment as it comes."""
    needs_slots = False          # (collect_segment's `slots`: what GroupOutbox reads from info)

    def add(self, meta: dict, arrays: dict, info: dict) -> list[tuple[dict, dict]]:
        return [(meta, arrays)]

    @property
    def held(self) -> int:
        return 0


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
