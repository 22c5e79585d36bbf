"""Control channel: actors join learner rank 0, which tells them everything they need.

    actor  -> hello {actor_id, host, pid, num_envs}   learner -> welcome {...welcome_fn(hello)...,
                                                                heartbeat_interval_s, heartbeat_timeout_s}
    actor  -> heartbeat {actor_id}  (every interval) learner -> heartbeat  (or "rejoin" if it does
                                                                not know the actor, e.g. after a restart)
    actor  -> get_policy_files                        learner -> policy_files (one frame per file)
    actor  -> bye                                     learner -> shutdown (at the end of training;
                                                                the actor answers bye)

The learner's ControlServer keeps a `Registry` of live actors (joins, leaves, time-outs). The
actor's LearnerClient re-sends hello with back-off when the learner goes silent for
heartbeat_timeout_s and rejoins when it is back (a restarted learner has new ROUTER identities
and an empty registry; its "rejoin" answer to a heartbeat makes the actor say hello again).
"""

from __future__ import annotations

import copy
import logging
import math
import os
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import zmq

from asyncvla.common.protocol import (REQUEST_MAX_BYTES, Limits, Message, ValidationError, decode_control,
                                      encode_control, files_of, MAX_NAME_LEN)
from asyncvla.common.sockets import (DropLog, Node, ServiceThread, TransportError, advertised, bind_endpoint,
                                     bound_endpoint)

log = logging.getLogger("asyncvla.transport")

BACKOFF_MIN_S = 0.1
POLL_MS = 50
WELCOME_KEYS = {"config": dict, "trajectory_endpoints": list, "weights_endpoint": str,
                "weight_version": int, "policy": dict, "rollout": dict}


# ----------------------------------------------------------------------------------- registry
@dataclass
class ActorInfo:
    actor_id: str
    host: str
    pid: int
    identity: bytes
    joined_at: float
    last_seen: float


class Registry:
    """Live actors by id, and the totals the learner logs. Invariant:
    joined_total == alive + left_total + timed_out_total + replaced_total."""

    def __init__(self):
        self.actors: dict[str, ActorInfo] = {}
        self.joined_total = self.left_total = self.timed_out_total = self.replaced_total = 0

    def hello(self, actor_id: str, host: str, pid: int, identity: bytes, now: float) -> str:
        """'joined', 'refreshed' (the same process said hello again) or 'replaced' (a new process
        took over a live id, e.g. a restarted actor before its predecessor timed out)."""
        old = self.actors.get(actor_id)
        if old is not None and (old.host, old.pid) == (host, pid):
            old.identity, old.last_seen = identity, now
            return "refreshed"
        self.actors[actor_id] = ActorInfo(actor_id, host, pid, identity, now, now)
        self.joined_total += 1
        if old is not None:
            self.replaced_total += 1
            return "replaced"
        return "joined"

    def heartbeat(self, actor_id: str, identity: bytes, now: float) -> bool:
        info = self.actors.get(actor_id)
        if info is None:
            return False
        info.identity, info.last_seen = identity, now
        return True

    def bye(self, actor_id: str) -> bool:
        if self.actors.pop(actor_id, None) is None:
            return False
        self.left_total += 1
        return True

    def expire(self, now: float, timeout_s: float) -> list[ActorInfo]:
        gone = [a for a in self.actors.values() if now - a.last_seen > timeout_s]
        for a in gone:
            del self.actors[a.actor_id]
        self.timed_out_total += len(gone)
        return gone

    def counts(self) -> dict[str, int]:
        return {"alive": len(self.actors), "joined_total": self.joined_total, "left_total": self.left_total,
                "timed_out_total": self.timed_out_total, "replaced_total": self.replaced_total}


# ------------------------------------------------------------------------------- learner side
class ControlServer:
    """ROUTER on control_port (or `endpoint`), served by a background thread.

    welcome_fn(hello: dict) -> dict builds the welcome (config dict, trajectory_endpoints,
    weights_endpoint, weight_version, policy {path, optional files {relpath: bytes}}). With
    `policy_dir`, actors that cannot read policy.path fetch that directory's files once.
    `check()` raises ThreadDied if the serving thread died (the learner polls it).
    """

    def __init__(self, tcfg, welcome_fn: Callable[[dict], dict], policy_dir: str | None = None,
                 endpoint: str | None = None):
        self.tcfg = tcfg
        self.welcome_fn = welcome_fn
        self.policy_dir = policy_dir
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
        self.registry = Registry()
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

    def close(self, notify: bool = True) -> None:
        """Stop serving; with `notify`, tell every live actor that training is over."""
        self._stop.set()
        self._thread.join()
        if notify:
            waiting = set(self.registry.actors)
            for a in list(self.registry.actors.values()):
                self._send(a.identity, encode_control("shutdown"))
            self._drain_until_bye(waiting, timeout_s=max(self.tcfg.linger_ms / 1000, 2.0))
            self._node.close(linger_ms=max(self.tcfg.linger_ms, 2000))
            return
        self._node.close()

    def _drain_until_bye(self, actor_ids: set, timeout_s: float) -> None:
        """Read (and drop) what actors still send until each notified one has said bye. Closing
        with unread data makes the kernel reset the connection, and a reset throws away what the
        actor had not read yet: the shutdown notice itself."""
        deadline = time.monotonic() + timeout_s
        while actor_ids and time.monotonic() < deadline:
            if not self._router.poll(50):
                continue
            frames = self._router.recv_multipart(copy=False)
            try:
                msg = decode_control(frames[1:], self._limits, "hello", "heartbeat", "bye", "get_policy_files")
            except ValidationError:
                continue
            if msg.kind == "bye":
                actor_ids.discard(msg.meta.get("actor_id"))
                with self._lock:
                    self.registry.bye(msg.meta.get("actor_id"))

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
                log.warning("actor %s (%s pid %d) timed out: no heartbeat for %.1f s", a.actor_id, a.host,
                            a.pid, self.tcfg.heartbeat_timeout_s)

    def _on_message(self, peer: bytes, frames: list) -> None:
        try:
            msg = decode_control(frames, self._limits, "hello", "heartbeat", "bye", "get_policy_files")
            actor_id = msg.meta.get("actor_id")
            if not isinstance(actor_id, str) or not 0 < len(actor_id) <= MAX_NAME_LEN:
                raise ValidationError("bad_meta", "actor_id must be a string of 1..256 characters")
        except ValidationError as e:
            self.stats["invalid"][e.reason] += 1
            self._drop_log(e.reason, str(e))
            return
        self.stats["messages"] += 1
        now = time.monotonic()
        if msg.kind == "hello":
            self._on_hello(peer, msg.meta, now)
        elif msg.kind == "heartbeat":
            with self._lock:
                known = self.registry.heartbeat(actor_id, peer, now)
            self._send(peer, encode_control("heartbeat" if known else "rejoin"))
        elif msg.kind == "bye":
            with self._lock:
                left = self.registry.bye(actor_id)
            if left:
                log.info("actor %s left", actor_id)
        else:
            self._send(peer, self._policy_reply())

    def _on_hello(self, peer: bytes, hello: dict, now: float) -> None:
        try:
            body = dict(self.welcome_fn(dict(hello)))
            policy = dict(body.get("policy") or {})
            files = policy.pop("files", None)
            body["policy"] = policy
            body.update(heartbeat_interval_s=self.tcfg.heartbeat_interval_s,
                        heartbeat_timeout_s=self.tcfg.heartbeat_timeout_s)
            reply = encode_control("welcome", body, files=files)
        except Exception as e:       # a bug in welcome_fn: tell the actor instead of leaving it waiting
            log.exception("building the welcome for actor %s failed", hello["actor_id"])
            message = f"learner could not build the welcome: {e}"[:250]
            self._send(peer, encode_control("error", {"message": message}))
            return
        with self._lock:
            what = self.registry.hello(hello["actor_id"], hello["host"], hello["pid"], peer, now)
        if what != "refreshed":
            log.info("actor %s %s (%s pid %d)", hello["actor_id"], what, hello["host"], hello["pid"])
        self._send(peer, reply)

    def _policy_reply(self) -> list:
        if self.policy_dir is None:
            return encode_control("error", {"message": "this learner ships no policy files "
                                                       "(policy_dir unset)"})
        if self._policy_files is None:          # read once; the directory does not change in a run
            root = Path(self.policy_dir)
            self._policy_files = {p.relative_to(root).as_posix(): p.read_bytes()
                                  for p in sorted(root.rglob("*")) if p.is_file()}
        size = sum(len(b) for b in self._policy_files.values())
        if size > self._node.max_bytes:
            return encode_control("error", {"message": f"policy directory is {size >> 20} MiB > "
                                                       f"transport.max_message_mb; make policy.path "
                                                       "readable on the actor node"[:250]})
        return encode_control("policy_files", files=self._policy_files)

    def _send(self, peer: bytes, frames: list) -> None:
        try:
            self._router.send_multipart([peer, *frames], flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError:
            pass                       # the actor is gone; its time-out will clean up


# --------------------------------------------------------------------------------- actor side
class LearnerClient:
    """An actor's link to the learner: join, heartbeats, rejoin after a learner restart.

    join(timeout, stop) -> the welcome dict (None on time-out / stop / shutdown), retrying with
    back-off. After it, a background thread heartbeats; `learner_alive` turns False when the
    learner is silent for heartbeat_timeout_s and the client says hello again with back-off
    until it answers (`rejoins` counts the successes, `welcome` holds the latest). `finished`
    turns True when the learner announces the end of training.
    """

    def __init__(self, control_endpoint: str, actor_id: str, tcfg, host: str | None = None,
                 pid: int | None = None, num_envs: int = 0):
        if not 0 < len(actor_id) <= MAX_NAME_LEN:
            raise ValueError(f"actor_id {actor_id!r} must be 1..{MAX_NAME_LEN} characters")
        self.endpoint, self.actor_id, self.tcfg = control_endpoint, actor_id, tcfg
        self.hello = {"actor_id": actor_id, "host": host or socket.gethostname(),
                      "pid": os.getpid() if pid is None else pid, "num_envs": int(num_envs)}
        self._node = Node(tcfg, server=False)
        self._sock: zmq.Socket | None = None
        self._limits = Limits.for_kind("control", tcfg.max_message_mb)
        self._lock = threading.Lock()
        self._joined = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.interval_s, self.timeout_s = tcfg.heartbeat_interval_s, tcfg.heartbeat_timeout_s
        self.welcome: dict | None = None
        self.learner_alive = False
        self.finished = False
        self.joins = self.rejoins = 0
        self.error: str | None = None
        self._request: dict | None = None      # the one outstanding get_policy_files
        self.stats = {"invalid": Counter()}
        self._drop_log = DropLog(f"learner client ({control_endpoint})")

    def join(self, timeout: float | None = None, stop: threading.Event | None = None) -> dict | None:
        if self._thread is None:
            self._thread = ServiceThread("learner-client", self._run)
            self._thread.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._joined.wait(0.05):
            self._thread.check()
            if self.error:
                raise TransportError(f"learner at {self.endpoint}: {self.error}")
            if self.finished or (stop is not None and stop.is_set()) or \
                    (deadline is not None and time.monotonic() >= deadline):
                return None
        with self._lock:
            return copy.deepcopy(self.welcome)

    def fetch_policy_files(self, timeout: float = 300.0) -> dict[str, bytes]:
        """The learner's policy directory, relative path -> bytes (call after join)."""
        done = threading.Event()
        with self._lock:
            self._request = {"done": done, "sent": False, "result": None, "error": None}
        deadline = time.monotonic() + timeout
        while not done.wait(0.05):
            if self._thread is not None:
                self._thread.check()
            if time.monotonic() >= deadline:
                raise TransportError(f"learner at {self.endpoint} sent no policy files within {timeout} s")
        request, self._request = self._request, None
        if request["error"]:
            raise TransportError(f"learner at {self.endpoint}: {request['error']}")
        return request["result"]

    def close(self) -> None:
        """Say bye (if joined) and stop."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._node.close()

    # -------------------------------------------------------------- client thread
    def _run(self) -> None:
        self._sock = self._connect()
        joined = False
        next_hello, backoff, next_beat, last_heard = 0.0, BACKOFF_MIN_S, 0.0, 0.0
        while not self._stop.is_set() and not self.finished:
            now = time.monotonic()
            if not joined and now >= next_hello:
                self._send("hello", self.hello)
                next_hello = now + backoff
                backoff = min(backoff * 2, self.tcfg.reconnect_max_s)
            if joined:
                if now >= next_beat:
                    self._send("heartbeat", {"actor_id": self.actor_id})
                    next_beat = now + self.interval_s
                if now - last_heard > self.timeout_s:
                    log.warning("learner at %s silent for %.1f s; trying to rejoin", self.endpoint,
                                now - last_heard)
                    self._reconnect()       # nothing queued for the old learner reaches a new one
                    self.learner_alive, joined = False, False
                    next_hello, backoff = now, BACKOFF_MIN_S
                self._send_request()
            if not self._sock.poll(POLL_MS):
                continue
            msg = self._receive()
            if msg is None:
                continue
            last_heard = time.monotonic()
            if msg.kind == "welcome":
                joined = self._on_welcome(msg)
                if joined:
                    backoff, next_beat = BACKOFF_MIN_S, last_heard + self.interval_s
            elif msg.kind == "heartbeat":
                self.learner_alive = True
            elif msg.kind == "rejoin":      # the learner does not know us (restarted, or timed us out)
                if joined:                  # (further "rejoin"s answer heartbeats sent before it)
                    joined, next_hello = False, last_heard
                if self._request is not None:
                    self._request["sent"] = False
            elif msg.kind == "shutdown":
                log.info("learner at %s finished training", self.endpoint)
                self._send("bye", {"actor_id": self.actor_id})      # the learner waits for it
                self.finished = True
            elif msg.kind in ("policy_files", "error"):
                self._on_reply(msg)
        if joined and not self.finished:
            self._send("bye", {"actor_id": self.actor_id})

    def _receive(self) -> Message | None:
        frames = self._sock.recv_multipart(copy=False)
        try:
            msg = decode_control(frames, self._limits, "welcome", "heartbeat", "rejoin", "shutdown",
                                 "policy_files", "error")
            if msg.kind == "welcome":
                _check_welcome(msg.meta)
            return msg
        except ValidationError as e:
            self.stats["invalid"][e.reason] += 1
            self._drop_log(e.reason, str(e))
            return None

    def _on_welcome(self, msg: Message) -> bool:
        welcome = dict(msg.meta)
        if msg.arrays:
            welcome["policy"] = dict(welcome["policy"], files=files_of(msg))
        self.interval_s = float(welcome.get("heartbeat_interval_s", self.interval_s))
        self.timeout_s = float(welcome.get("heartbeat_timeout_s", self.timeout_s))
        with self._lock:
            first = self.joins == 0
            self.welcome = welcome
            self.joins += 1
            self.rejoins += 0 if first else 1
        if not first:
            log.info("rejoined the learner at %s", self.endpoint)
        self.learner_alive = True
        self._joined.set()
        if self._request is not None:
            self._request["sent"] = False
        return True

    def _on_reply(self, msg: Message) -> None:
        request = self._request
        if msg.kind == "error" and request is None:
            self.error = msg.meta["message"]            # e.g. the welcome could not be built
            return
        if request is None:
            return
        if msg.kind == "error":
            request["error"] = msg.meta["message"]
        else:
            request["result"] = files_of(msg)
        request["done"].set()

    def _send_request(self) -> None:
        request = self._request
        if request is not None and not request["sent"]:
            self._send("get_policy_files", {"actor_id": self.actor_id})
            request["sent"] = True

    def _send(self, kind: str, meta: dict) -> None:
        try:
            self._sock.send_multipart(encode_control(kind, meta), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass                          # the queue to an absent learner is full; retried later

    def _reconnect(self) -> None:
        self._node.close_socket(self._sock, 0)
        self._sock = self._connect()

    def _connect(self) -> zmq.Socket:
        # IMMEDIATE: queue nothing while the learner is unreachable (a send then fails and is
        # retried), so a returning learner is not flooded with stale heartbeats and hellos.
        return self._node.socket(zmq.DEALER, connect=self.endpoint, IMMEDIATE=1, SNDHWM=16)


def _check_welcome(meta: dict) -> None:
    for key, typ in WELCOME_KEYS.items():
        if not isinstance(meta.get(key), typ) or isinstance(meta.get(key), bool):
            raise ValidationError("bad_welcome", f"welcome '{key}' must be a {typ.__name__}")
    if not all(isinstance(e, str) for e in meta["trajectory_endpoints"]) or not meta["trajectory_endpoints"]:
        raise ValidationError("bad_welcome", "welcome 'trajectory_endpoints' must be a non-empty list "
                                             "of strings")
    for key in ("heartbeat_interval_s", "heartbeat_timeout_s"):      # the client thread times with them
        value = meta.get(key, 1.0)
        if type(value) not in (int, float) or not 0 < value < math.inf:
            raise ValidationError("bad_welcome", f"welcome '{key}' must be a positive number")
