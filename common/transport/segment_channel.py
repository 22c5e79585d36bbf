"""Trajectories from actors to learner ranks: each rank's ROUTER inbox and each actor's DEALER
outbox, with acks so an actor knows how many of its segments no rank has taken yet.

    actor SegmentSender (a DEALER per rank)
        -> learner rank r SegmentReceiver (ROUTER on segment_port + r)
        <- an ack: the count of the actor's segments the rank just took

Queues are bounded: a slow learner pushes back on its actors, which block or drop their oldest
unsent segment (counted). ZeroMQ and kernel buffers still hold several segments per actor, and
every queued segment is one more version of policy lag; so a rank acks each segment it takes,
and an actor that has `in_flight` segments not yet taken waits (`wait_for_room`) before
collecting another.

Segments go to the ranks in turn (so that in --sync mode each rank gets its exact share of a
version's segments), except that a rank already holding its share of the actor's allowance
(`wait_for_room`'s limit / ranks) untaken is passed over for one that holds none. The ranks train
in lock-step: a rank that has its batch reads nothing until every rank has one. Strictly in turn,
an actor's segments could pile up untaken at such a rank (its turns there come round whatever the
rank took from others, e.g. from an actor that then left) until they filled the whole allowance,
and a rank waiting for data got nothing from anyone: the run stalled.

A segment's meta carries the actor's token (common/transport/auth.py): a rank drops one from an actor the
learner did not welcome, counted as stats["invalid"]["unregistered"], and one whose token's
registration has ended (the actor left, timed out or was replaced), as ["stale_token"].
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from typing import Sequence

import zmq

from asyncvla.common.transport.auth import TokenLedger, peer_key
from asyncvla.common.transport.protocol import (REQUEST_MAX_BYTES, SEGMENT, Limits, Segment, SegmentSpec, ValidationError,
                                      decode_segment, encode_segment)
from asyncvla.common.transport.sockets import DropLog, Node, advertised, bind_endpoint, bound_endpoint

log = logging.getLogger("asyncvla.transport")

BACKPRESSURE = ("block", "drop_oldest")


class SegmentReceiver:
    """One learner rank's inbox: ROUTER bound on segment_port + rank (or `endpoint`).
    `recv` returns validated segments whose arrays view the received frames, and acks each
    message it takes (valid or not) to its sender. Invalid messages, whatever they hold, are
    dropped and counted by reason in `stats["invalid"]`. ZeroMQ caps each frame at
    max_message_mb, and `decode` the frame count and total bytes; ZeroMQ still buffers a whole
    multipart message before handing it over, so one message may briefly hold frames x cap.

    Segments must carry a token that `tokens` accepts: rank 0 shares the control server's
    TokenLedger; by default a ledger of its own over `auth_key`, else this node's key (which
    without CURVE only rank 0 shares with the control server that issues the tokens: other ranks
    then check none), told of ended registrations through `tokens.end`. The token is taken out of
    the returned segment's meta."""

    def __init__(self, tcfg, rank: int, spec: SegmentSpec, endpoint: str | None = None,
                 auth_key: bytes | None = None, tokens: TokenLedger | None = None):
        self.spec = spec
        self._node = Node(tcfg, server=True)
        try:
            self._router = self._node.socket(zmq.ROUTER, bind=endpoint or bind_endpoint(
                tcfg, tcfg.segment_port + rank), RCVHWM=tcfg.recv_hwm)
        except BaseException:
            self._node.close(0)
            raise
        self.endpoint = advertised(tcfg, bound_endpoint(self._router))
        key = auth_key or (self._node.token_key if self._node.curve is not None or rank == 0 else None)
        self.tokens = tokens or (TokenLedger(key) if key is not None else None)
        if self.tokens is None:
            log.info("segment receiver (rank %d): without CURVE keys this rank cannot check the tokens "
                     "rank 0 gives actors; it takes any valid segment", rank)
        self._limits = Limits.for_kind(SEGMENT, tcfg.max_message_mb)
        self.stats = {"received": 0, "bytes": 0, "invalid": Counter()}
        self._drop_log = DropLog(f"segment receiver (rank {rank})")

    def recv(self, timeout_ms: int | None = None) -> Segment | None:
        """The next valid segment, or None after `timeout_ms` (None: wait forever)."""
        got = self.recv_many(1, timeout_ms)
        return got[0] if got else None

    def recv_many(self, n: int, timeout_ms: int | None = None) -> list[Segment]:
        """Up to `n` valid segments: waits up to `timeout_ms` (None: for ever) for the first, then
        takes only what has already arrived. Everything taken is acked before the receiver waits
        or returns, one ack per sender for what it took from it."""
        deadline = None if timeout_ms is None else time.monotonic() + timeout_ms / 1000
        out: list[Segment] = []
        taken: Counter = Counter()                 # sender -> messages taken, not yet acked
        try:
            while len(out) < n:
                wait = 0 if out else None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
                if wait != 0 and taken:
                    self._ack(taken)
                if not self._router.poll(wait):
                    break
                sender, *frames = self._router.recv_multipart(copy=False)
                taken[sender.bytes] += 1
                segment = self._check(frames)
                if segment is not None:
                    out.append(segment)
                elif deadline is not None and time.monotonic() >= deadline:
                    break
        finally:
            self._ack(taken)
        return out

    def _check(self, frames) -> Segment | None:
        """The segment the frames hold, or None (counted by reason) when they hold no valid one."""
        try:
            segment = decode_segment(frames, self.spec, self._limits)
            token = segment.meta.pop("token", None)
            refused = self._refusal(segment.meta["actor_id"], frames[0], token)
            if refused:
                raise ValidationError(refused, f"segment from actor {segment.meta['actor_id'][:40]!r} "
                                               "without a live token of its welcome")
        except ValidationError as e:
            self.stats["invalid"][e.reason] += 1
            self._drop_log(e.reason, str(e))
            return None
        self.stats["received"] += 1
        self.stats["bytes"] += sum(len(f) for f in frames)
        return segment

    def close(self) -> None:
        self._node.close(0)

    def _refusal(self, actor_id, frame, token) -> str | None:
        """Why the token does not let this segment in (common/transport/auth.py), or None (also when this
        rank checks no tokens)."""
        if self.tokens is None:
            return None
        peer = peer_key(frame) if self._node.curve is not None else ""
        return self.tokens.check(actor_id, peer, token)

    def _ack(self, taken: Counter) -> None:
        for sender, count in taken.items():
            try:
                self._router.send_multipart([sender, ack_frame(count)], flags=zmq.NOBLOCK)
            except zmq.ZMQError:      # the actor left, or its inbox is full: it re-syncs on rejoin
                pass
        taken.clear()


def ack_frame(count: int) -> bytes:
    """An ack: how many of the sender's messages a rank just took (4 bytes, little-endian)."""
    return count.to_bytes(4, "little")


def ack_count(frame) -> int:
    """The count an ack frame carries; 0 for anything that is not one."""
    data = frame.bytes if hasattr(frame, "bytes") else bytes(frame)
    return int.from_bytes(data, "little") if len(data) == 4 else 0


class SegmentSender:
    """An actor's outbox: a DEALER connected to each learner rank; segments go to the ranks whose
    queues have room, in turn (a rank holding its share of the allowance untaken is passed over
    for one holding none: see the module docstring), and each rank acks the segments it takes
    (`in_flight` counts those not yet acked; `wait_for_room` bounds it).

    backpressure="block": `send` waits until some rank has room (optionally bounded by
    `timeout`/`stop`, then returns False and the caller keeps the segment).
    backpressure="drop_oldest": `send` never waits; segments ZeroMQ cannot take yet wait in a
    deque of send_hwm entries, and when it overflows the oldest is dropped and counted.
    Invariant: submitted == sent + dropped + pending. Arrays are sent without copying: do not
    modify them after `send`.
    """

    def __init__(self, endpoints: Sequence[str] | str, tcfg, backpressure: str = "block"):
        if backpressure not in BACKPRESSURE:
            raise ValueError(f"backpressure={backpressure!r} is not allowed; "
                             f"choose one of {list(BACKPRESSURE)}")
        endpoints = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        if not endpoints:
            raise ValueError("SegmentSender needs at least one learner endpoint")
        self.backpressure = backpressure
        self._linger_s = tcfg.linger_ms / 1000
        self._node = Node(tcfg, server=False)
        # What comes back is only empty acks: a small cap on incoming frames.
        self._dealers = [self._node.socket(zmq.DEALER, connect=ep, SNDHWM=tcfg.send_hwm, MAXMSGSIZE=REQUEST_MAX_BYTES)
                         for ep in endpoints]
        self._acks, self._room = zmq.Poller(), zmq.Poller()
        for d in self._dealers:
            self._acks.register(d, zmq.POLLIN)
            self._room.register(d, zmq.POLLOUT)
        self._held = [0] * len(endpoints)         # per rank: segments sent, not yet acked
        self._turn = 0                            # the rank whose turn it is
        self._share = 0                           # allowance per rank (0: none, strictly in turn)
        self._pending: deque[list] = deque()
        self._max_pending = tcfg.send_hwm
        self.sent = 0
        self.dropped = 0
        self.acked = 0

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def stats(self) -> dict:
        return {"sent": self.sent, "dropped": self.dropped, "pending": self.pending, "acked": self.acked}

    @property
    def in_flight(self) -> int:
        """Segments sent that no learner rank has taken yet (as far as the acks so far tell)."""
        self._read_acks()
        return self.sent - self.acked

    def wait_for_room(self, limit: int, timeout: float | None = None, stop=None) -> bool:
        """Wait until fewer than `limit` segments are in flight. False when `timeout` passed or
        `stop` was set first. `limit` is the allowance `send` spreads over the ranks."""
        self._share = -(-limit // len(self._dealers))
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.in_flight >= limit:
            if (stop is not None and stop.is_set()) or (deadline is not None and time.monotonic() >= deadline):
                return False
            self._acks.poll(_wait_slice_ms(deadline, stop))
        return True

    def forget_in_flight(self) -> None:
        """The learner restarted: acks for what the old one held will never come."""
        self._read_acks()
        self.acked = self.sent
        self._held = [0] * len(self._dealers)

    def send(self, segment: Segment, timeout: float | None = None, stop=None) -> bool:
        """Hand a segment to the transport. Returns False only in block mode when `timeout`
        passed or `stop` (a threading.Event) was set before any rank had room."""
        frames = encode_segment(segment)
        if self.backpressure == "drop_oldest":
            self._pending.append(frames)
            if len(self._pending) > self._max_pending:
                self._pending.popleft()
                self.dropped += 1
            self._flush_nowait()
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._try_send(frames, _wait_slice_ms(deadline, stop)):
                return True
            if stop is not None and stop.is_set():
                return False
            if deadline is not None and time.monotonic() >= deadline:
                return False

    def flush(self, timeout: float | None = None) -> bool:
        """Drop-oldest mode: keep handing queued segments over until none is left (True) or
        `timeout` passes (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._flush_nowait():
            if deadline is not None and time.monotonic() >= deadline:
                return False
            self._room.poll(50)
        return True

    def close(self) -> None:
        """Give queued segments up to linger_ms to leave and be taken: a rank discards what it still
        queues from an actor that has gone. What never left is counted dropped."""
        deadline = time.monotonic() + self._linger_s
        self.flush(self._linger_s)
        self.dropped += len(self._pending)
        self._pending.clear()
        self.wait_for_room(1, timeout=max(0.0, deadline - time.monotonic()))
        self._node.close()

    def _read_acks(self) -> None:
        for r, dealer in enumerate(self._dealers):
            while dealer.poll(0, zmq.POLLIN):
                # (bounded by what was sent: a count from a peer that is no learner changes nothing else)
                n = min(ack_count(dealer.recv(copy=False)), self.sent - self.acked)
                self.acked += n
                self._held[r] = max(0, self._held[r] - n)

    def _flush_nowait(self) -> int:
        while self._pending and self._try_send(self._pending[0]):
            self._pending.popleft()
        return len(self._pending)

    def _try_send(self, frames: list, wait_ms: int = 0) -> bool:
        """Send within wait_ms (0: only if there is room now; -1: as long as it takes) to the rank
        whose turn it is, or past it (see the module docstring)."""
        self._read_acks()
        deadline = None if wait_ms < 0 else time.monotonic() + wait_ms / 1000
        n = len(self._dealers)
        while True:
            order = [(self._turn + i) % n for i in range(n)]
            if self._share and self._held[order[0]] >= self._share and 0 in self._held:
                order.sort(key=lambda r: self._held[r] != 0)      # those holding none first, in turn
            for r in order:
                try:
                    self._dealers[r].send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    continue
                self.sent += 1
                self._held[r] += 1
                self._turn = (r + 1) % n
                return True
            left = -1 if deadline is None else int((deadline - time.monotonic()) * 1000)
            if deadline is not None and left <= 0:
                return False
            self._room.poll(left)


def _wait_slice_ms(deadline: float | None, stop) -> int:
    """How long one blocking send may wait inside libzmq: for ever (-1) unless a stop event or
    a deadline must be checked, then in slices of at most 100 ms."""
    if stop is None and deadline is None:
        return -1
    if deadline is None:
        return 100
    return max(0, min(100, int((deadline - time.monotonic()) * 1000)))
