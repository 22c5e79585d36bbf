"""Weights from learner rank 0 to actors: only the newest version matters.

WeightServer (ROUTER) answers "weights newer than v?" with the newest version at once, or holds
the request until one is published (a long poll of up to `wait_ms`, then "no_weights"). A late
joiner asks with v = -1 and gets the current version first; a slow actor never sees a queue of
stale versions, because nothing is pushed: each reply is the newest at that moment. Each version
is encoded once; every reply sends the same zmq frames (shared by reference count), so a large
payload is never copied per request.

WeightSubscriber keeps one request in flight from a background thread and holds the newest
version received; the actor takes it between segments with `poll_newest` (non-blocking) or
`wait_newer` (blocking, for the synchronous mode).

Only registered actors get weights: each request carries the actor_id and the token of its
welcome (common/transport/auth.py); the server answers any other with an "error" and counts it
(stats["invalid"]["unregistered"], or ["stale_token"] when the token's registration has ended).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict

import zmq

from asyncvla.common.transport.auth import TokenLedger, peer_key
from asyncvla.common.transport.protocol import (REQUEST_MAX_BYTES, WEIGHTS, Limits, ValidationError, control_of, decode,
                                      decode_control, encode_control, encode_weights, weights_of)
from asyncvla.common.transport.sockets import DropLog, Node, ServiceThread, advertised, bind_endpoint, bound_endpoint

log = logging.getLogger("asyncvla.transport")

MAX_WAIT_MS = 60_000
REPLY_GRACE_S = 2.0          # re-ask when a reply is this late (the server may have restarted)
MAX_PEERS_REMEMBERED = 4096


class WeightServer:
    """Serves the newest published (version, tensors) on weights_port (or `endpoint`) to actors
    whose token `tokens` accepts (the control server's TokenLedger, so that a token whose
    registration ended is refused; default: a ledger of its own over `auth_key`, else this node's
    key, which checks only the signature).
    `check()` raises ThreadDied if the serving thread died (the learner polls it)."""

    def __init__(self, tcfg, endpoint: str | None = None, auth_key: bytes | None = None,
                 tokens: TokenLedger | None = None):
        self._node = Node(tcfg, server=True)
        try:
            # Requests are tiny (MAXMSGSIZE caps what comes in, not the weights going out).
            self._router = self._node.socket(
                zmq.ROUTER, bind=endpoint or bind_endpoint(tcfg, tcfg.weights_port), ROUTER_MANDATORY=1,
                MAXMSGSIZE=REQUEST_MAX_BYTES)
            wake = f"inproc://weights-wake-{id(self)}"
            self._wake_rx = self._node.socket(zmq.PAIR, bind=wake, secure=False)
            self._wake_tx = self._node.socket(zmq.PAIR, connect=wake, secure=False)
        except BaseException:
            self._node.close(0)
            raise
        self.endpoint = advertised(tcfg, bound_endpoint(self._router))
        self.tokens = tokens or TokenLedger(auth_key or self._node.token_key)
        self._request_limits = Limits.for_kind("request", tcfg.max_message_mb)
        self._lock = threading.Lock()
        self._current: tuple[int, list[zmq.Frame]] | None = None
        self._waiting: dict[bytes, tuple[int, float]] = {}        # peer -> (newer_than, deadline)
        self._last_sent: OrderedDict[bytes, int] = OrderedDict()   # peer -> version sent
        self.stats = {"requests": 0, "replies": 0, "unroutable": 0, "invalid": Counter()}
        self._drop_log = DropLog("weight server")
        self._stop = threading.Event()
        self._thread = ServiceThread("weight-server", self._serve)
        self._thread.start()

    def check(self) -> None:
        self._thread.check()

    @property
    def version(self) -> int:
        current = self._current
        return -1 if current is None else current[0]

    def publish(self, version: int, tensors: dict, step: int | None = None) -> None:
        """Make (version, tensors) the newest (`step`: the learner update behind it, which
        subscribers read as `.step`). Encoded once here; the arrays are sent without a copy, so
        the caller must not modify them afterwards (hand over fresh tensors)."""
        frames = [zmq.Frame(f, copy=False) for f in encode_weights(version, tensors, step)]
        with self._lock:
            if version <= self.version:
                raise ValueError(f"weights version {version} must be newer than the published {self.version}")
            self._current = (version, frames)
            self._wake_tx.send(b"")

    def close(self) -> None:
        if self._stop.is_set():
            return                                # (closed already)
        self._stop.set()
        with self._lock:
            self._wake_tx.send(b"")
        self._thread.join()
        self._node.close(0)

    # ------------------------------------------------------------------ server thread
    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        while not self._stop.is_set():
            events = dict(poller.poll(self._poll_ms()))
            if self._wake_rx in events:
                while self._wake_rx.poll(0):
                    self._wake_rx.recv()
            if self._router in events:
                for _ in range(256):              # drain, but keep answering waiting peers
                    try:
                        frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._on_request(frames)
            self._answer_waiting(time.monotonic())

    def _poll_ms(self) -> int:
        if not self._waiting:
            return 500
        soonest = min(deadline for _, deadline in self._waiting.values())
        return max(0, min(500, int((soonest - time.monotonic()) * 1000) + 1))

    def _on_request(self, frames: list) -> None:
        peer = frames[0].bytes
        try:
            msg = decode_control(frames[1:], self._request_limits, "get_weights")
        except ValidationError as e:
            self.stats["invalid"][e.reason] += 1
            self._drop_log(e.reason, str(e))
            return
        refused = self.tokens.check(msg.meta["actor_id"], peer_key(frames[1]), msg.meta["token"])
        if refused:
            self.stats["invalid"][refused] += 1
            self._drop_log(refused, f"get_weights for actor {msg.meta['actor_id'][:40]!r}")
            self._send(peer, encode_control("error", {"message": f"refused ({refused}): join the learner "
                                                      "first and present the welcome's token"}))
            return
        self.stats["requests"] += 1
        # A peer re-asking while a large reply is still on its way (the same connection keeps
        # its identity) waits for the next version instead of getting the same payload again.
        newer_than = max(msg.meta["newer_than"], self._last_sent.get(peer, -1))
        wait_s = min(max(msg.meta["wait_ms"], 0), MAX_WAIT_MS) / 1000
        self._waiting[peer] = (newer_than, time.monotonic() + wait_s)

    def _answer_waiting(self, now: float) -> None:
        current = self._current
        for peer, (newer_than, deadline) in list(self._waiting.items()):
            if current is not None and current[0] > newer_than:
                if self._send(peer, current[1]):
                    self._remember(peer, current[0])
                    self.stats["replies"] += 1
            elif now >= deadline:
                self._send(peer, encode_control("no_weights", {"version": self.version}))
            else:
                continue
            del self._waiting[peer]

    def _send(self, peer: bytes, frames: list) -> bool:
        try:
            self._router.send_multipart([peer, *frames], flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.ZMQError:          # the peer left (EHOSTUNREACH) or its queue is full (EAGAIN)
            self.stats["unroutable"] += 1
            return False

    def _remember(self, peer: bytes, version: int) -> None:
        self._last_sent[peer] = version
        self._last_sent.move_to_end(peer)
        while len(self._last_sent) > MAX_PEERS_REMEMBERED:
            self._last_sent.popitem(last=False)


class WeightSubscriber:
    """An actor's view of the newest weights, fetched in a background thread.

    Requests carry `actor_id` and `token` (the welcome's; a function returning the current one
    follows rejoins, and while it returns None nothing is asked). A refusal is counted in
    stats["refused"] and logged at a bounded rate.
    Each version is handed out once (then forgotten here, so its memory goes with the caller):
    `poll_newest(newer_than=v)` returns (version, tensors) or None at once; `wait_newer(v,
    timeout)` waits for one; `reset()` starts over after a learner restart. Tensors are numpy
    arrays viewing the received frames (bf16 arrives as float32). After a version is handed out,
    `step` is the learner update that produced it (None if the server did not say). If the
    fetch thread dies (a bug: invalid replies are dropped and counted), the waits raise ThreadDied.
    """

    def __init__(self, endpoint: str, tcfg, *, actor_id: str, token, wait_s: float = 1.0):
        self.endpoint = endpoint
        self.actor_id, self._token = actor_id, token if callable(token) else (lambda: token)
        self.wait_s = wait_s
        self._node = Node(tcfg, server=False)
        # IMMEDIATE: requests are not queued for an absent server (the send fails; asked again).
        self._dealer = self._node.socket(zmq.DEALER, connect=endpoint, SNDHWM=4, IMMEDIATE=1)
        self._limits = Limits.for_kind(WEIGHTS, tcfg.max_message_mb)
        self._cond = threading.Condition()
        self._newest: tuple[int, dict, int | None] | None = None
        self.version = -1                     # newest version received
        self.step: int | None = None          # learner step of the version last handed out
        self.stats = {"received": 0, "superseded": 0, "refused": 0, "invalid": Counter()}
        self._drop_log = DropLog(f"weight subscriber ({endpoint})")
        self._refusal_log = DropLog(f"weight subscriber ({endpoint})", noun="weight request(s) refused")
        self._closed = False
        self._thread = ServiceThread("weight-subscriber", self._fetch, on_exit=self._wake_waiters)
        self._thread.start()

    def poll_newest(self, newer_than: int = -1):
        self._thread.check()
        with self._cond:
            return self._take(newer_than)

    def wait_newer(self, version: int, timeout: float | None = None):
        with self._cond:
            self._cond.wait_for(lambda: self._closed or self._thread.error is not None or
                                (self._newest is not None and self._newest[0] > version), timeout)
            self._thread.check()
            return self._take(version)

    def reset(self) -> None:
        """Forget the versions seen: after a learner restart its versions may start lower again."""
        with self._cond:
            self._newest, self.version = None, -1

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()
        self._node.close(0)

    def _take(self, newer_than: int):
        newest = self._newest
        if newest is None or newest[0] <= newer_than:
            return None
        self._newest = None
        version, tensors, self.step = newest
        return version, tensors

    # -------------------------------------------------------------- fetch thread
    def _wake_waiters(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _fetch(self) -> None:
        asked_at, sent, refused = None, None, None     # refused: the token last refused
        while not self._closed:
            now, token = time.monotonic(), self._token()
            # after a refusal, wait before asking again, unless a rejoin brought a new token
            due = asked_at is None or now - asked_at > self.wait_s + REPLY_GRACE_S or \
                (refused is not None and token != refused)
            if token is not None and due:
                request = encode_control("get_weights", {"newer_than": self.version, "wait_ms": int(self.wait_s * 1000),
                                                         "actor_id": self.actor_id, "token": token})
                try:
                    self._dealer.send_multipart(request, flags=zmq.NOBLOCK)
                    asked_at, sent, refused = now, token, None
                except zmq.Again:
                    pass                      # not connected (yet): ask again after the poll
            if not self._dealer.poll(100):
                continue
            frames = self._dealer.recv_multipart(copy=False)
            asked_at = None                   # answered (even if invalid): ask again
            try:
                msg = decode(frames, self._limits)
                if msg.kind == "no_weights":
                    control_of(msg, "no_weights")
                elif msg.kind == "error":
                    message = control_of(msg, "error").meta["message"]
                    self.stats["refused"] += 1
                    self._refusal_log("error reply", message)
                    asked_at, refused = time.monotonic(), sent
                else:
                    self._store(*weights_of(msg), msg.meta.get("step"))
            except ValidationError as e:
                self.stats["invalid"][e.reason] += 1
                self._drop_log(e.reason, str(e))

    def _store(self, version: int, tensors: dict, step: int | None) -> None:
        with self._cond:
            if version <= self.version:
                return
            if self._newest is not None:
                self.stats["superseded"] += 1
            self._newest, self.version = (version, tensors, step), version
            self.stats["received"] += 1
            self._cond.notify_all()
