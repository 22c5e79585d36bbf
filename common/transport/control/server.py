"""The learner's side of the control channel (rank 0): the ControlServer, which welcomes actors,
hears their heartbeats, ships the policy files and says "shutdown"; the Registry of live actors it
keeps, each held by the connection it joined on; and the EventLog that keeps its log short."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import zmq

from asyncvla.common.transport.auth import TokenLedger, new_registration, peer_key, valid_join_secret
from asyncvla.common.transport.protocol import (MAX_NAME_LEN, REQUEST_MAX_BYTES, Limits, ValidationError, decode_control,
                                      encode_control)
from asyncvla.common.transport.sockets import DropLog, Node, ServiceThread, advertised, bind_endpoint, bound_endpoint, printable

from .contract import BYE_HOLD_BEAT_S, BYE_WAIT_MAX_S, POLL_MS

log = logging.getLogger("asyncvla.transport")


@dataclass
class ActorInfo:
    actor_id: str
    host: str
    pid: int
    identity: bytes
    joined_at: float
    last_seen: float
    key: str = ""             # the CURVE public key it joined with ("" without CURVE)
    registration: str = ""    # named in its token; ends when it leaves (common/transport/auth.py)


class Registry:
    """Live actors by id, and the totals the learner logs. Invariant:
    joined_total == alive + left_total + timed_out_total + replaced_total.

    A live id is held by one connection (its ZeroMQ peer identity): only that connection speaks
    for it (hello, heartbeat, bye), or another once `connected(holder)` says the holder's is gone
    (the server probes its socket). Host and pid are what a sender claims: kept for the logs,
    they never decide. With CURVE the id also stays with the key that registered it.

    Each registration (a join or a replacement) has its own id, which the actor's token names;
    `ended(registration)` is called when it ends (bye, time-out, replacement, `remove`), so that
    its token is refused from then on."""

    def __init__(self, connected: Callable[[bytes], bool], ended: Callable[[str], None] = lambda registration: None):
        self.connected, self.ended = connected, ended
        self.actors: dict[str, ActorInfo] = {}
        self.joined_total = self.left_total = self.timed_out_total = self.replaced_total = 0

    def hello(self, actor_id: str, host: str, pid: int, identity: bytes, now: float, key: str = "",
              registration: str = "") -> str:
        """'joined' (under `registration`); 'refreshed' (the holding connection said hello again: its
        registration goes on); 'replaced' (a new
        connection took over a live id whose holder is gone, e.g. an actor restarted before its
        predecessor timed out, or one that reconnected); or, changing nothing, 'taken' (the id is
        live under another CURVE key) or 'held' (by another connection, still connected)."""
        old = self.actors.get(actor_id)
        if old is not None and old.key != key:
            return "taken"
        if old is not None and old.identity == identity:
            old.last_seen = now
            return "refreshed"
        if old is not None and self.connected(old.identity):
            return "held"
        self.actors[actor_id] = ActorInfo(actor_id, host, pid, identity, now, now, key, registration)
        self.joined_total += 1
        if old is not None:
            self.replaced_total += 1
            self.ended(old.registration)
            return "replaced"
        return "joined"

    def heartbeat(self, actor_id: str, identity: bytes, now: float) -> bool:
        """Whether `identity` speaks for the live id (it holds it, or takes it over from a holder
        that is gone: ZeroMQ reconnected the actor's socket); False for an unknown id too."""
        info = self.actors.get(actor_id)
        if info is None or not self._may_speak(info, identity):
            return False
        info.identity, info.last_seen = identity, now
        return True

    def bye(self, actor_id: str, identity: bytes) -> bool:
        """Whether the id left: only a connection that may speak for it takes it away."""
        info = self.actors.get(actor_id)
        if info is None or not self._may_speak(info, identity):
            return False
        self.remove(actor_id)
        return True

    def remove(self, actor_id: str) -> bool:
        """Take a live id away (counted as left); False if it is not live."""
        info = self.actors.pop(actor_id, None)
        if info is None:
            return False
        self.left_total += 1
        self.ended(info.registration)
        return True

    def _may_speak(self, info: ActorInfo, identity: bytes) -> bool:
        return info.identity == identity or not self.connected(info.identity)

    def expire(self, now: float, timeout_s: float) -> list[ActorInfo]:
        gone = [a for a in self.actors.values() if now - a.last_seen > timeout_s]
        for a in gone:
            del self.actors[a.actor_id]
            self.ended(a.registration)
        self.timed_out_total += len(gone)
        return gone

    def counts(self) -> dict[str, int]:
        return {"alive": len(self.actors), "joined_total": self.joined_total, "left_total": self.left_total,
                "timed_out_total": self.timed_out_total, "replaced_total": self.replaced_total}


class EventLog:
    """Logs each actor event of a kind (joined, replaced, timed out) up to `burst` times per
    `interval_s`, then folds the rest into one line per interval: a flood of hellos from a buggy
    or hostile script cannot flood the learner's log. The registry's counts stay exact."""

    def __init__(self, burst: int = 20, interval_s: float = 10.0):
        self.burst, self.interval_s = burst, interval_s
        self._start: dict[str, float] = {}      # kind -> when its window began
        self._seen: dict[str, int] = {}         # events of the kind in the window

    def __call__(self, kind: str, level: int, fmt: str, *args) -> None:
        self.flush()
        self._start.setdefault(kind, time.monotonic())
        self._seen[kind] = self._seen.get(kind, 0) + 1
        if self._seen[kind] <= self.burst:
            log.log(level, fmt, *args)

    def flush(self) -> None:
        """End the windows older than interval_s, with one line for what they did not log."""
        now = time.monotonic()
        for kind, start in list(self._start.items()):
            if now - start >= self.interval_s:
                folded = self._seen.pop(kind) - self.burst
                del self._start[kind]
                if folded > 0:
                    log.warning("%d more actor(s) %s in the last %.0f s (after %d logged one by one)",
                                folded, kind, now - start, self.burst)


# ------------------------------------------------------------------------------- learner side
class ControlServer:
    """ROUTER on control_port (or `endpoint`), served by a background thread.

    welcome_fn(hello: dict) -> dict builds the welcome (config dict, segment_endpoints,
    weights_endpoint, weight_version, policy {path, optional files {relpath: bytes}}); the server
    adds the heartbeat settings, its `learner_id` (drawn per server: a client tells a restarted
    learner from the same one) and the actor's token, from `tokens` (a TokenLedger, which the
    weight server and inbox share to refuse tokens whose registration ended; default: one of its
    own over `auth_key`, else this node's key: common/transport/auth.py). With `join_secret` (the run's,
    without CURVE keys) a hello must carry it: one without it, or with another, is refused
    ("no_join_secret", "wrong_join_secret"). With `policy_dir`, registered actors that cannot read
    policy.path fetch that directory's files once. Requests that fail the token check are refused
    and counted in stats["invalid"] ("unregistered"; "stale_token": its registration ended, by a
    bye, a time-out, a replacement or a ban); a hello, heartbeat or bye for a live id from a
    connection other than the one holding it, while that one is connected, too ("id_taken": see
    `Registry`), and a hello for an id live under another CURVE key ("wrong_key").
    `check()` raises ThreadDied if the serving thread died (the learner polls it).
    """

    def __init__(self, tcfg, welcome_fn: Callable[[dict], dict], policy_dir: str | None = None,
                 endpoint: str | None = None, auth_key: bytes | None = None, join_secret: str | None = None,
                 tokens: TokenLedger | None = None):
        self.tcfg = tcfg
        self.welcome_fn = welcome_fn
        self.policy_dir = policy_dir
        self.join_secret = join_secret
        self.learner_id = os.urandom(8).hex()
        self.banned: set[str] = set()          # ids refused from now on (`ban`)
        self._node = Node(tcfg, server=True)
        try:
            # Requests are tiny: a small per-frame cap makes ZeroMQ drop a connection that sends
            # a big frame before it is held here (the frame count is bounded by `decode`).
            self._router = self._node.socket(
                zmq.ROUTER, bind=endpoint or bind_endpoint(tcfg, tcfg.control_port), ROUTER_MANDATORY=1,
                MAXMSGSIZE=REQUEST_MAX_BYTES)
        except BaseException:
            self._node.close(0)
            raise
        self.endpoint = advertised(tcfg, bound_endpoint(self._router))
        self.tokens = tokens or TokenLedger(auth_key or self._node.token_key)
        self.registry = Registry(self._connected, ended=self.tokens.end)
        self._events = EventLog()
        self._lock = threading.Lock()
        self._limits = Limits.for_kind("request", tcfg.max_message_mb)
        self._policy_files: dict[str, bytes] | None = None
        self.stats = {"messages": 0, "invalid": Counter()}
        self._drop_log = DropLog("control server")
        self._stop = threading.Event()
        self._thread = ServiceThread("control-server", self._serve)
        self._thread.start()

    def check(self) -> None:
        self._thread.check()

    def counts(self) -> dict[str, int]:
        with self._lock:
            return self.registry.counts()

    def ban(self, actor_id: str) -> None:
        """Refuse everything from this actor id from now on: it leaves the registry (counted as
        left), and its requests are answered with an error saying why ("banned")."""
        with self._lock:
            self.banned.add(actor_id)
            self.registry.remove(actor_id)

    def actor_ids(self) -> list[str]:
        """The ids registered now."""
        with self._lock:
            return sorted(self.registry.actors)

    def close(self, notify: bool = True, final_version: int = -1) -> None:
        """Stop serving; with `notify`, tell every live actor that training is over, and which
        version was the last published (an evaluator waits for its weights)."""
        self._stop.set()
        self._thread.join()
        if notify:
            waiting = set(self.registry.actors)
            for a in list(self.registry.actors.values()):
                self._send(a.identity, encode_control("shutdown", {"version": int(final_version)}))
            self._drain_until_bye(waiting, timeout_s=max(self.tcfg.linger_ms / 1000, 2.0))
            self._node.close(linger_ms=max(self.tcfg.linger_ms, 2000))
            return
        self._node.close()

    def _drain_until_bye(self, actor_ids: set, timeout_s: float) -> None:
        """Read (and drop) what actors still send until each notified one has said bye, waiting
        `timeout_s`, or up to BYE_WAIT_MAX_S while one that has not heartbeats (an evaluator
        fetching the last weights: the caller closes the weight server only after this). Closing
        with unread data makes the kernel reset the connection, and a reset throws away what the
        actor had not read yet: the shutdown notice itself."""
        started, busy = time.monotonic(), set()      # busy: heartbeat after the notice
        while actor_ids:
            waited = time.monotonic() - started
            if waited >= BYE_WAIT_MAX_S or (waited >= timeout_s and not actor_ids & busy):
                break
            if not self._router.poll(50):
                continue
            frames = self._router.recv_multipart(copy=False)
            try:
                msg = decode_control(frames[1:], self._limits, "hello", "heartbeat", "bye", "get_policy_files")
            except ValidationError:
                continue
            if msg.kind not in ("bye", "heartbeat") or self._refusal(msg.meta, peer_key(frames[1])) is not None:
                continue
            if msg.kind == "heartbeat":
                if waited >= BYE_HOLD_BEAT_S:         # (not one queued before the notice)
                    busy.add(msg.meta["actor_id"])
                continue
            with self._lock:
                left = self.registry.bye(msg.meta["actor_id"], frames[0].bytes)
            if left:
                actor_ids.discard(msg.meta["actor_id"])

    # ------------------------------------------------------------------ server thread
    def _serve(self) -> None:
        while not self._stop.is_set():
            if self._router.poll(POLL_MS):
                for _ in range(256):
                    try:
                        frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._on_message(frames[0].bytes, frames[1:])
            with self._lock:
                gone = self.registry.expire(time.monotonic(), self.tcfg.heartbeat_timeout_s)
            for a in gone:
                self._events("timed out", logging.WARNING, "actor %s (%s pid %d) timed out: no heartbeat for %.1f s",
                             printable(a.actor_id), printable(a.host), a.pid, self.tcfg.heartbeat_timeout_s)
            self._events.flush()

    def _on_message(self, peer: bytes, frames: list) -> None:
        try:
            msg = decode_control(frames, self._limits, "hello", "heartbeat", "bye", "get_policy_files")
            actor_id = msg.meta.get("actor_id")
            if not isinstance(actor_id, str) or not 0 < len(actor_id) <= MAX_NAME_LEN:
                raise ValidationError("bad_meta", "actor_id must be a string of 1..256 characters")
        except ValidationError as e:
            self._count(e.reason, str(e))
            return
        self.stats["messages"] += 1
        now, user = time.monotonic(), peer_key(frames[0])
        if actor_id in self.banned:
            self._count("banned", f"{msg.kind} from actor {actor_id[:40]!r}, banned for poisoning updates")
            self._send(peer, encode_control("error", {"reason": "banned", "message": (
                f"actor_id {actor_id[:100]!r} is banned by this learner: its segments kept making updates "
                "non-finite (learner.max_poisoned_columns)")}))
            return
        if msg.kind == "hello":
            self._on_hello(peer, user, msg.meta, now)
            return
        with self._lock:
            known = actor_id in self.registry.actors
        if msg.kind == "heartbeat" and not known:     # e.g. after a restart, or timed out
            self._send(peer, encode_control("rejoin"))
            return
        refused = self._refusal(msg.meta, user)
        if refused:
            self._count(refused, f"{msg.kind} for actor {actor_id[:40]!r}")
            if msg.kind == "get_policy_files":
                self._send(peer, encode_control("error", {"message": f"refused ({refused}): say hello "
                                                          "first and present the welcome's token"}))
        elif msg.kind == "heartbeat":
            with self._lock:
                holds = self.registry.heartbeat(actor_id, peer, now)
            if holds:
                self._send(peer, encode_control("heartbeat"))
            else:
                self._count("id_taken", f"heartbeat for actor {actor_id[:40]!r} from a connection that "
                                        "does not hold it, while the holder is connected")
        elif msg.kind == "bye":
            with self._lock:
                left = self.registry.bye(actor_id, peer)
            if left:
                log.info("actor %s left", printable(actor_id))
            elif known:
                self._count("id_taken", f"bye for actor {actor_id[:40]!r} from a connection that does "
                                        "not hold it, while the holder is connected")
        else:
            self._send(peer, self._policy_reply())

    def _refusal(self, meta: dict, user: str) -> str | None:
        """Why a request after the welcome must be refused: "unregistered" (no token, or not one
        this actor_id got from this key) or "stale_token" (its registration has ended: e.g. the
        actor left and the id is live again under a new registration, perhaps another key's);
        None when it may go on."""
        return self.tokens.check(meta["actor_id"], user, meta.get("token"))

    def _on_hello(self, peer: bytes, user: str, hello: dict, now: float) -> None:
        actor_id = hello["actor_id"]
        if self.join_secret is not None and not valid_join_secret(self.join_secret, hello.get("join_secret")):
            reason = "wrong_join_secret" if "join_secret" in hello else "no_join_secret"
            self._count(reason, f"hello for actor {actor_id[:40]!r} ({hello['host'][:40]} pid {hello['pid']}) "
                                "without the run's join secret")
            self._send(peer, encode_control("error", {"reason": reason, "message": (
                "join refused: this learner admits only holders of its run's join secret (RUN/join_secret): "
                "start the actor with --run-dir RUN, or use CURVE keys (transport.keys_dir)")}))
            return
        try:
            body = dict(self.welcome_fn(dict(hello)))
        except Exception as e:       # a bug in welcome_fn: tell the actor instead of leaving it waiting
            self._welcome_failed(peer, actor_id, e)
            return
        with self._lock:
            what = self.registry.hello(actor_id, hello["host"], hello["pid"], peer, now, key=user,
                                       registration=new_registration())
            registration = self.registry.actors[actor_id].registration
        if what in ("taken", "held"):
            # Without keys anyone on the network may claim any id, host and pid included: a live id
            # stays with the connection that holds it. A restarted actor's predecessor is gone (its
            # connection closed when it died), so the restart takes the id at once.
            reason, holder = ("wrong_key", "registered by another CURVE key") if what == "taken" else \
                ("id_taken", "live in another process")
            self._count(reason, f"hello for actor {actor_id[:40]!r} ({holder}), claiming "
                                f"{hello['host'][:40]} pid {hello['pid']}")
            message = (f"actor_id {actor_id[:100]!r} is {holder}; choose another --actor-id, or wait "
                       "until that actor leaves")
            self._send(peer, encode_control("error", {"message": message, "reason": reason}))
            return
        try:
            policy = dict(body.get("policy") or {})
            files = policy.pop("files", None)
            body["policy"] = policy
            body.update(heartbeat_interval_s=self.tcfg.heartbeat_interval_s,
                        heartbeat_timeout_s=self.tcfg.heartbeat_timeout_s, learner_id=self.learner_id,
                        token=self.tokens.issue(actor_id, user, registration))
            reply = encode_control("welcome", body, files=files)
        except Exception as e:       # (the actor stays registered without a token: it times out)
            self._welcome_failed(peer, actor_id, e)
            return
        if what != "refreshed":
            self._events(what, logging.INFO, "actor %s %s (%s pid %d)", printable(actor_id), what,
                         printable(hello["host"]), hello["pid"])
        self._send(peer, reply)

    def _welcome_failed(self, peer: bytes, actor_id: str, e: Exception) -> None:
        log.exception("building the welcome for actor %s failed", printable(actor_id))
        message = f"learner could not build the welcome: {e}"[:250]
        self._send(peer, encode_control("error", {"message": message}))

    def _count(self, reason: str, detail: str) -> None:
        self.stats["invalid"][reason] += 1
        self._drop_log(reason, detail)

    def _policy_reply(self) -> list:
        if self.policy_dir is None:
            return encode_control("error", {"message": "this learner ships no policy files "
                                                       "(policy_dir unset)"})
        if self._policy_files is None:          # read once; the directory does not change in a run
            root = Path(self.policy_dir)
            paths = [p for p in sorted(root.rglob("*")) if p.is_file()]
            size = sum(p.stat().st_size for p in paths)     # before reading: it may be far too big
            if size > self._node.max_bytes:
                message = (f"policy directory is {size >> 20} MiB > transport.max_message_mb; make "
                           "policy.path readable on the actor node")
                return encode_control("error", {"message": message})
            self._policy_files = {p.relative_to(root).as_posix(): p.read_bytes() for p in paths}
        return encode_control("policy_files", files=self._policy_files)

    def _send(self, peer: bytes, frames: list) -> None:
        try:
            self._router.send_multipart([peer, *frames], flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError:
            pass                       # the actor is gone; its time-out will clean up

    def _connected(self, identity: bytes) -> bool:
        """Whether a peer is still connected: with ROUTER_MANDATORY a send to an identity whose
        connection has closed fails with EHOSTUNREACH (a heartbeat is harmless to a live actor)."""
        try:
            self._router.send_multipart([identity, *encode_control("heartbeat")], flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:
            return e.errno != zmq.EHOSTUNREACH      # EAGAIN: connected, its queue full
        return True

