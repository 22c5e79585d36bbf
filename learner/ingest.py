"""From received segments to fixed-size training batches.

A segment from an actor with B envs holds B independent trajectories ("columns") of T steps.
Every learner rank must run the same number of forward/backward passes per update (ZeRO-3
gathers parameters collectively), so a rank's batch is a fixed number of columns, whatever the
actors' num_envs: columns are buffered, a batch takes exactly `n`, and a partly used segment
keeps its remaining columns for the next batch.

The lag rule: a column made by policy version v is used by an update at version V only if
0 <= V - v <= max_policy_lag. `Inbox` applies it when a segment arrives and again, through
`ColumnBuffer.drop_stale`, to columns left over in the buffer while the learner moved on; every
dropped segment is counted by reason.

Duplicates: a segment whose (actor, seq) this rank already took (a repeat) is dropped and
counted as "duplicate" (`SeenSegments`: bounded memory per actor). One whose seq runs more than
MAX_SEQ_JUMP past its stream's highest is a lying counter: dropped as invalid "bad_counter",
and the stream keeps its place (else every later segment would look like a repeat).

Accounting (`Inbox.accounting`): each segment a rank acked ends in exactly one place, so that
    acked = trained + dropped (invalid by reason, stale, future_version, duplicate, banned) + buffered
holds at every moment (invalid: the receiver's refusals and the inbox's bad counters). A segment
counts as trained once its last column went into a batch; one partly trained when the lag rule
drops its remaining columns counts as dropped "stale" (its trained columns are in the column
figures, which balance too: added = trained + dropped + buffered).
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np

from asyncvla.common.transport.protocol import FINAL_FIELDS, time_major
from asyncvla.common.transport.sockets import DropLog

# How far a stream's seq may run past its highest in one segment. An actor counts up by one per
# segment, and those lost on the way are few; a seq of 2**63 - 1 would end the stream (every later
# one below it, a "repeat") and count 9e18 gaps.
MAX_SEQ_JUMP = 1 << 20


@dataclass
class Batch:
    """Columns of trajectories, time-major numpy arrays ([T+1, N, ...] observations, [T, N, ...] the rest)."""
    arrays: dict
    versions: np.ndarray           # [N] policy version that produced each column
    final_index: np.ndarray        # [n, 2] (t, column) of truncated steps
    finals: dict                   # final_* arrays, [n, ...]
    actors: list = field(default_factory=list)     # [N] the actor id that sent each column

    @property
    def num_columns(self) -> int:
        return int(self.versions.shape[0])


@dataclass
class ColumnBuffer:
    """FIFO of segment columns; `take(n)` assembles a Batch of exactly n columns.

    `dropped` counts segments dropped by reason; `trained` segments whose last column was taken;
    `column_counts` columns added, trained (taken) and dropped."""
    max_policy_lag: int
    dropped: Counter = field(default_factory=Counter)
    trained: int = 0
    column_counts: Counter = field(default_factory=Counter)
    _queue: deque = field(default_factory=deque)   # (segment arrays, version, first unused column, actor)
    _columns: int = 0

    def add(self, arrays: dict, version: int, actor: str = "") -> None:
        self._queue.append([arrays, version, 0, actor])
        self._columns += arrays["terminated"].shape[1]
        self.column_counts["added"] += arrays["terminated"].shape[1]

    def drop_stale(self, current_version: int) -> None:
        """Forget every column older than max_policy_lag versions (actors run different versions,
        so a stale segment may sit behind a fresh one: the whole queue is checked)."""
        keep = deque()
        for entry in self._queue:
            arrays, version, start, _ = entry
            if current_version - version > self.max_policy_lag:
                self._columns -= arrays["terminated"].shape[1] - start
                self.column_counts["dropped"] += arrays["terminated"].shape[1] - start
                self.dropped["stale"] += 1
            else:
                keep.append(entry)
        self._queue = keep

    @property
    def columns(self) -> int:
        return self._columns

    @property
    def segments(self) -> int:
        """Segments with columns still buffered (a partly taken one included)."""
        return len(self._queue)

    def take(self, n: int) -> Batch:
        assert n <= self._columns, "take() called before enough columns arrived"
        parts = []
        while n > 0:
            entry = self._queue[0]
            arrays, version, start, actor = entry
            avail = arrays["terminated"].shape[1] - start
            k = min(n, avail)
            parts.append((arrays, version, start, start + k, actor))
            if k == avail:
                self._queue.popleft()
                self.trained += 1
            else:
                entry[2] = start + k
            self._columns -= k
            self.column_counts["trained"] += k
            n -= k
        return concat_columns(parts)


def concat_columns(parts) -> Batch:
    """Concatenate column ranges [lo, hi) of several segments along the column axis; parts are
    (arrays, version, lo, hi, actor id)."""
    keys = time_major(parts[0][0])
    arrays = {k: np.concatenate([a[k][:, lo:hi] for a, _, lo, hi, _ in parts], axis=1) for k in keys}
    versions = np.concatenate([np.full(hi - lo, v, np.int64) for _, v, lo, hi, _ in parts])
    actors = [actor for _, _, lo, hi, actor in parts for _ in range(hi - lo)]
    final_index, finals, offset = [], {k: [] for k in FINAL_FIELDS}, 0
    for a, _, lo, hi, _ in parts:
        idx = a["final_index"]
        keep = (idx[:, 1] >= lo) & (idx[:, 1] < hi) if len(idx) else np.zeros(0, bool)
        if keep.any():
            moved = idx[keep].copy()
            moved[:, 1] += offset - lo
            final_index.append(moved)
            for k in FINAL_FIELDS:
                if k in a:
                    finals[k].append(a[k][keep])
        offset += hi - lo
    finals = {k: np.concatenate(v) for k, v in finals.items() if v}
    fi = np.concatenate(final_index) if final_index else np.zeros((0, 2), np.int64)
    return Batch(arrays=arrays, versions=versions, final_index=fi, finals=finals, actors=actors)


class SeenSegments:
    """The segments one rank took, per stream (an actor process: its id and the incarnation it
    drew at start, so that a restarted actor's seqs start afresh), in bounded memory: the highest
    seq and those taken within `window` below it, for at most `max_streams` streams (the one
    heard from least recently is forgotten first).

    An actor's segments reach a rank in order over one connection, so one that comes `window` or
    more below the highest is a repeat too; one more than `max_jump` above it is a
    lying counter. A stream's first segment sets its place at any seq (a learner that restarted
    joins mid-stream). `gaps` counts seqs skipped in a stream and not filled later (segments lost
    on the way, or dropped by the actor's backpressure); it means that only when one rank takes
    all of each actor's segments (`count_gaps`)."""

    def __init__(self, window: int = 64, max_streams: int = 1024, count_gaps: bool = True,
                 max_jump: int = MAX_SEQ_JUMP):
        self.window, self.max_streams, self.count_gaps, self.max_jump = window, max_streams, count_gaps, max_jump
        self._streams: OrderedDict = OrderedDict()      # stream -> [highest seq, seqs taken near it, first]
        self.gaps = 0

    @property
    def held(self) -> int:
        """Seqs remembered, over all streams (at most max_streams x 2 window)."""
        return sum(len(entry[1]) for entry in self._streams.values())

    def admit(self, stream, seq: int) -> str | None:
        """Record (stream, seq) and return None, or return why it must be dropped without
        recording it: "duplicate" (taken before, or too old to tell) or "bad_counter" (more than
        max_jump past the stream's highest)."""
        entry = self._streams.get(stream)
        if entry is None:
            if len(self._streams) >= self.max_streams:
                self._streams.popitem(last=False)
            self._streams[stream] = [seq, {seq}, seq]
            return None
        self._streams.move_to_end(stream)
        highest, recent, first = entry
        if seq > highest + self.max_jump:
            return "bad_counter"
        if seq > highest:
            self.gaps += (seq - highest - 1) * self.count_gaps
            entry[0] = seq
            recent.add(seq)
            if len(recent) > 2 * self.window:           # (pruned in bulk: O(1) per segment)
                entry[1] = {s for s in recent if s > seq - self.window}
            return None
        if seq <= highest - self.window or seq in recent:
            return "duplicate"
        recent.add(seq)
        if seq > first:
            self.gaps -= self.count_gaps               # a late one fills a gap counted before
        return None


def stream_of(meta: dict) -> tuple:
    return meta["actor_id"], meta.get("incarnation", 0)


class Inbox:
    """One learner rank's trajectories: receive segments, apply the lag rule, buffer columns.

    `fill(n, version, stop)` receives until n columns no older than max_policy_lag versions are
    buffered (False if `stop` was set first); `take(n)` then returns them as a Batch. Each
    received segment goes to `on_segment(segment, lag)` (metrics). `drops` counts dropped
    segments by reason: stale, future_version (made by a learner run this one never was, e.g.
    before a restart), duplicate (taken before: `SeenSegments`), invalid (refused by the
    receiver's checks, or a seq beyond MAX_SEQ_JUMP: `bad_counter`) and banned (from an actor
    `ban` names). `seq_gaps`: segments
    missing from the actors' sequences (see `SeenSegments`; counted only with `count_gaps`, i.e.
    when this is the only rank).

    `watchdog()` (optional) is called on entry and at least every 200 ms while waiting: it raises
    when something the learner needs has died (rank 0's server threads), so a learner whose
    actors can no longer join or get weights stops with that error instead of waiting for ever.
    """

    def __init__(self, receiver, max_policy_lag: int, on_segment=None, watchdog=None, count_gaps: bool = True):
        self.receiver = receiver
        self.max_policy_lag = max_policy_lag
        self.buffer = ColumnBuffer(max_policy_lag)
        self.on_segment = on_segment
        self.watchdog = watchdog
        self.seen = SeenSegments(count_gaps=count_gaps)
        self._drop_log = DropLog("learner inbox", noun="segment(s) dropped")
        self._stale = self._future = self._duplicate = self._banned = 0
        self.banned: set[str] = set()          # actors whose segments are refused (`ban`)
        self._invalid: Counter = Counter()     # refused here (the receiver counts its own)
        self._width = 1                  # columns (envs) per segment, as the last one had

    def fill(self, n: int, version: int, stop) -> bool:
        self.buffer.drop_stale(version)
        while True:
            if self.watchdog is not None:
                self.watchdog()
            if self.buffer.columns >= n:
                return True
            if stop.is_set():
                return False
            # as many segments as the columns still missing take, at the last segment's width
            need = -(-(n - self.buffer.columns) // self._width)
            for seg in self.receiver.recv_many(need, timeout_ms=200):
                self._width = seg.meta["num_envs"]
                if seg.meta["actor_id"] in self.banned:
                    self._banned += 1
                    self._drop_log("banned", f"segment of actor {seg.meta['actor_id'][:40]!r}, banned for "
                                             "poisoning updates")
                    continue
                why = self.seen.admit(stream_of(seg.meta), seg.meta["seq"])
                if why is not None:
                    self._count(why, seg.meta)
                    continue
                made_by = int(seg.meta["policy_version"])
                lag = version - made_by
                if lag > self.max_policy_lag:
                    self._stale += 1
                elif lag < 0:
                    self._future += 1
                else:
                    self.buffer.add(seg.arrays, made_by, seg.meta["actor_id"])
                    if self.on_segment is not None:
                        self.on_segment(seg, lag)

    def _count(self, why: str, meta: dict) -> None:
        seq, actor = meta["seq"], f"{meta['actor_id'][:40]!r}"
        if why == "duplicate":
            self._duplicate += 1
            self._drop_log(why, f"segment seq {seq} of actor {actor} was taken before")
        else:
            self._invalid[why] += 1
            self._drop_log(why, f"segment seq {seq} of actor {actor} runs more than {self.seen.max_jump} "
                                "past the highest seq of its stream")

    def take(self, n: int) -> Batch:
        return self.buffer.take(n)

    def ban(self, actor_id: str) -> None:
        """Refuse this actor's segments from now on (counted as dropped "banned"): its columns kept
        making updates non-finite (learner.max_poisoned_columns)."""
        self.banned.add(actor_id)

    @property
    def drops(self) -> dict[str, int]:
        """Dropped segments so far, by reason (running totals)."""
        invalid = sum(self.receiver.stats.get("invalid", {}).values()) + sum(self._invalid.values())
        return {"stale": self._stale + self.buffer.dropped["stale"], "future_version": self._future,
                "duplicate": self._duplicate, "invalid": invalid, "banned": self._banned}

    @property
    def seq_gaps(self) -> int:
        return self.seen.gaps

    def accounting(self) -> dict:
        """Where every segment this rank acked went (see the module docstring): acked (valid or
        not: the receiver acks each message it takes), trained, dropped by reason (invalid ones
        by the receiver's reasons), still buffered; the columns of the buffered segments; and
        seq_gaps (segments that never came: outside the balance)."""
        stats = self.receiver.stats
        refused = {str(k): int(v) for k, v in stats.get("invalid", {}).items()}     # never "received"
        invalid = dict(Counter(refused) + self._invalid)
        dropped = {**self.drops, "invalid": sum(invalid.values())}
        acked = int(stats.get("received", 0)) + sum(refused.values())
        buf = self.buffer
        out = {"acked": acked, "trained": buf.trained, "dropped": dropped, "invalid": invalid,
               "buffered": buf.segments, "seq_gaps": self.seq_gaps,
               "columns": {"added": buf.column_counts["added"], "trained": buf.column_counts["trained"],
                           "dropped": buf.column_counts["dropped"], "buffered": buf.columns}}
        out["balanced"] = acked == buf.trained + sum(dropped.values()) + buf.segments
        return out


class PoisonCounts:
    """Columns dropped at update time as non-finite (learner/update.py), per actor: one that reaches
    `limit` (learner.max_poisoned_columns; 0: never) is to be banned, once."""

    def __init__(self, limit: int):
        self.limit, self.counts, self.banned = limit, Counter(), set()

    def add(self, actors) -> list[str]:
        """Count these columns' actors; the ones that reach the limit now."""
        self.counts.update(actors)
        new = sorted(a for a, n in self.counts.items() if self.limit and n >= self.limit and a not in self.banned)
        self.banned.update(new)
        return new


def rollout_plan(cfg, num_ranks: int, actor_envs: int) -> dict[str, int]:
    """What the learner tells an actor with `actor_envs` envs in its welcome:

    segments_per_version: the actor's share of one update, in segments — what it sends per
        weight version in --sync mode. Segments go round-robin to the ranks, so k per rank from
        each actor; k is the least that fills a rank's share of the batch when the expected
        actors (launch.num_local_actors, at least 1) all send. An actor alone gets a whole batch.
    max_segments_in_flight: segments sent but not yet taken by a rank before the actor waits
        (actor.max_segments_in_flight, else one update's share; 0 = never wait, as drop_oldest).
    """
    producers = max(1, cfg.launch.num_local_actors) * actor_envs
    per_rank = -(-cfg.learner.batch_trajectories // num_ranks)
    per_version = num_ranks * max(1, -(-per_rank // producers))
    in_flight = cfg.actor.max_segments_in_flight
    in_flight = per_version if in_flight is None else in_flight
    if cfg.actor.backpressure != "block":
        in_flight = 0
    return {"segments_per_version": per_version, "max_segments_in_flight": in_flight}
