"""From received segments to fixed-size training batches.

A segment from an actor with B envs holds B independent trajectories ("columns") of T steps.
Every learner rank must run the same number of forward/backward passes per update (ZeRO-3
gathers parameters collectively), so a rank's batch is a fixed number of columns, whatever the
actors' num_envs: columns are buffered, a batch takes exactly `n`, and a partly used segment
keeps its remaining columns for the next batch. Stale columns (older than `max_policy_lag`
versions) are dropped when they would be used, and counted.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np

# Arrays indexed [time, column, ...] in a segment; everything else is per truncated step or per episode.
TIME_MAJOR = ("image", "instruction", "instruction_mask", "state", "action_tokens", "behavior_logp",
              "rewards", "terminated", "truncated")
FINAL = ("final_image", "final_instruction", "final_instruction_mask", "final_state")


@dataclass
class Batch:
    """Columns of trajectories, time-major numpy arrays ([T+1, N, ...] observations, [T, N, ...] the rest)."""
    arrays: dict
    versions: np.ndarray           # [N] policy version that produced each column
    final_index: np.ndarray        # [n, 2] (t, column) of truncated steps
    finals: dict                   # final_* arrays, [n, ...]

    @property
    def num_columns(self) -> int:
        return int(self.versions.shape[0])


@dataclass
class ColumnBuffer:
    """FIFO of segment columns; `take(n)` assembles a Batch of exactly n columns."""
    max_policy_lag: int
    dropped: Counter = field(default_factory=Counter)
    _queue: deque = field(default_factory=deque)   # (segment arrays, version, first unused column)
    _columns: int = 0

    def add(self, arrays: dict, version: int) -> None:
        self._queue.append([arrays, version, 0])
        self._columns += arrays["action_tokens"].shape[1]

    def drop_stale(self, current_version: int) -> None:
        while self._queue and current_version - self._queue[0][1] > self.max_policy_lag:
            arrays, _, start = self._queue.popleft()
            n = arrays["action_tokens"].shape[1] - start
            self._columns -= n
            self.dropped["stale"] += 1

    @property
    def columns(self) -> int:
        return self._columns

    def take(self, n: int) -> Batch:
        assert n <= self._columns, "take() called before enough columns arrived"
        parts = []
        while n > 0:
            entry = self._queue[0]
            arrays, version, start = entry
            avail = arrays["action_tokens"].shape[1] - start
            k = min(n, avail)
            parts.append((arrays, version, start, start + k))
            if k == avail:
                self._queue.popleft()
            else:
                entry[2] = start + k
            self._columns -= k
            n -= k
        return concat_columns(parts)


def concat_columns(parts) -> Batch:
    """Concatenate column ranges [lo, hi) of several segments along the column axis."""
    keys = [k for k in TIME_MAJOR if k in parts[0][0]]
    arrays = {k: np.concatenate([a[k][:, lo:hi] for a, _, lo, hi in parts], axis=1) for k in keys}
    versions = np.concatenate([np.full(hi - lo, v, np.int64) for _, v, lo, hi in parts])
    final_index, finals, offset = [], {k: [] for k in FINAL}, 0
    for a, _, lo, hi in parts:
        idx = a["final_index"]
        keep = (idx[:, 1] >= lo) & (idx[:, 1] < hi) if len(idx) else np.zeros(0, bool)
        if keep.any():
            moved = idx[keep].copy()
            moved[:, 1] += offset - lo
            final_index.append(moved)
            for k in FINAL:
                if k in a:
                    finals[k].append(a[k][keep])
        offset += hi - lo
    finals = {k: np.concatenate(v) for k, v in finals.items() if v}
    fi = np.concatenate(final_index) if final_index else np.zeros((0, 2), np.int64)
    return Batch(arrays=arrays, versions=versions, final_index=fi, finals=finals)
