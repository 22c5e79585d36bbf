"""The actor's side of the control channel: the LearnerClient, whose thread joins the learner,
heartbeats, rejoins it after a restart and answers its "shutdown" with bye. Its state is explicit:

    JOINING   --welcome-->                       JOINED
    JOINED    --silent for timeout_s, "rejoin"-->  JOINING   (hello again, with back-off)
    either    --"shutdown"-->                    FINISHED  (bye: at once, or with defer_bye once
                                                            say_bye() is called; the thread ends)
"""

from __future__ import annotations

import copy
import enum
import logging
import os
import socket
import threading
import time
from collections import Counter

import zmq

from asyncvla.common.transport.protocol import MAX_NAME_LEN, Limits, Message, ValidationError, decode_control, encode_control, files_of
from asyncvla.common.signals import LAUNCHER_PID_ENV
from asyncvla.common.transport.sockets import DropLog, Node, ServiceThread, TransportError, printable

from .contract import (BACKOFF_MIN_S, BYE_HOLD_BEAT_S, BYE_HOLD_MAX_S, ID_WAIT_S, LAUNCHED_WARN_S, NO_ANSWER_REPEAT_S,
                       NO_ANSWER_WARN_S, POLL_MS, check_welcome, policy_file_parts)

log = logging.getLogger("asyncvla.transport")


class ClientState(enum.Enum):
    JOINING = "joining"      # hello, with back-off, until a welcome
    JOINED = "joined"        # heartbeats
    FINISHED = "finished"    # the learner said "shutdown"


class LearnerClient:
    """An actor's link to the learner: join, heartbeats, rejoin after a learner restart.

    join(timeout, stop) -> the welcome dict (None on time-out / stop / shutdown), retrying with
    back-off, and warning after NO_ANSWER_WARN_S (LAUNCHED_WARN_S in a process `asyncvla train`
    started; then every NO_ANSWER_REPEAT_S) what may keep the learner silent. After it, a background thread heartbeats; `learner_alive` turns False
    when the learner is silent for heartbeat_timeout_s and the client says hello again with
    back-off until it answers (`rejoins` counts the successes, `restarts` those that found a new
    learner rather than the same one, which had only lost this client, e.g. one paused past the
    time-out; `welcome` holds the latest, `token` the latest welcome's token, which the actor's
    other requests carry). `join_secret` (the run's, without CURVE keys) goes with every hello. A
    first hello refused because the id is live in another connection (a restarted actor's
    predecessor the learner has not yet seen go, or another process holding the id) is said again
    with back-off for up to `id_wait_s` seconds before join() fails. `state` is a
    ClientState; `finished` turns True when the learner announces the end of training
    (`final_version`: the last version it published), and the client answers bye: at once, or,
    with `defer_bye`, once `say_bye()` is called or after BYE_HOLD_MAX_S, heartbeating meanwhile
    (an evaluator: once its weights hold the last version, which travel on their own channel).
    """

    def __init__(self, control_endpoint: str, actor_id: str, tcfg, host: str | None = None,
                 pid: int | None = None, num_envs: int = 0, join_secret: str | None = None,
                 id_wait_s: float = ID_WAIT_S, defer_bye: bool = False):
        if not 0 < len(actor_id) <= MAX_NAME_LEN:
            raise ValueError(f"actor_id {actor_id!r} must be 1..{MAX_NAME_LEN} characters")
        self.endpoint, self.actor_id, self.tcfg = control_endpoint, actor_id, tcfg
        self.hello = {"actor_id": actor_id, "host": host or socket.gethostname(),
                      "pid": os.getpid() if pid is None else pid, "num_envs": int(num_envs)}
        if join_secret:
            self.hello["join_secret"] = join_secret
        self.id_wait_s = id_wait_s
        self._id_refused_at: float | None = None     # when a first hello was first refused as id_taken
        self._node = Node(tcfg, server=False)
        self._sock: zmq.Socket | None = None
        self._limits = Limits.for_kind("control", tcfg.max_message_mb)
        self._lock = threading.Lock()
        self._joined = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.interval_s, self.timeout_s = tcfg.heartbeat_interval_s, tcfg.heartbeat_timeout_s
        self.welcome: dict | None = None
        self.token: str | None = None
        self.state = ClientState.JOINING
        self.learner_alive = False
        self.final_version = -1                 # the last version the learner published ("shutdown")
        self.defer_bye, self._bye_now = defer_bye, threading.Event()
        self.joins = self.rejoins = self.restarts = 0
        self.learner_id: str | None = None      # the welcoming learner's (a new one: it restarted)
        self.error: str | None = None
        self._request: dict | None = None      # the one outstanding get_policy_files
        self.stats = {"invalid": Counter()}
        self._drop_log = DropLog(f"learner client ({control_endpoint})")

    def join(self, timeout: float | None = None, stop: threading.Event | None = None) -> dict | None:
        if self._thread is None:
            self._thread = ServiceThread("learner-client", self._run)
            self._thread.start()
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout
        warn_at = started + (LAUNCHED_WARN_S if os.environ.get(LAUNCHER_PID_ENV) else NO_ANSWER_WARN_S)
        while not self._joined.wait(0.05):
            self._thread.check()
            if self.error:
                raise TransportError(f"learner at {self.endpoint}: {printable(self.error)}")
            now = time.monotonic()
            if self.finished or (stop is not None and stop.is_set()) or (deadline is not None and now >= deadline):
                return None
            if now >= warn_at:
                log.warning("%s; still trying", self.no_answer(now - started))
                warn_at = now + NO_ANSWER_REPEAT_S
        with self._lock:
            return copy.deepcopy(self.welcome)

    def no_answer(self, waited_s: float) -> str:
        """What to check when the learner has not answered for `waited_s` seconds."""
        what = f"no answer from the learner at {self.endpoint} after {waited_s:.0f} s"
        if self._node.curve is None:
            return (f"{what}: is it running and reachable there? If the learner uses CURVE keys "
                    "(transport.keys_dir), pass --keys-dir DIR (a client bundle made by `asyncvla keygen`)")
        return (f"{what}: is it running and reachable there, with CURVE keys (transport.keys_dir) whose "
                f"server.key is this bundle's and whose authorized_clients/ holds this actor's "
                f"client.key ({self.tcfg.keys_dir})?")

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
            raise TransportError(f"learner at {self.endpoint}: {printable(request['error'])}")
        for name in request["result"]:
            try:
                policy_file_parts(name)
            except ValueError as e:
                raise TransportError(f"learner at {self.endpoint} sent a policy file named "
                                     f"'{printable(name, 80)}': {e}; refusing its files") from None
        return request["result"]

    @property
    def finished(self) -> bool:
        return self.state is ClientState.FINISHED

    def say_bye(self) -> None:
        """With defer_bye: answer the learner's "shutdown" now."""
        self._bye_now.set()

    def close(self) -> None:
        """Say bye (if joined) and stop."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._node.close()

    # -------------------------------------------------------------- client thread
    def _run(self) -> None:
        self._sock = self._connect()
        hello_at, backoff, beat_at, heard_at = 0.0, BACKOFF_MIN_S, 0.0, 0.0
        while not self._stop.is_set() and self.state is not ClientState.FINISHED:
            now = time.monotonic()
            if self.state is ClientState.JOINING and now >= hello_at:
                self._send("hello", self.hello)
                hello_at, backoff = now + backoff, min(backoff * 2, self.tcfg.reconnect_max_s)
            elif self.state is ClientState.JOINED:
                if now >= beat_at:
                    self._send("heartbeat", self._credentials())
                    beat_at = now + self.interval_s
                if now - heard_at > self.timeout_s:
                    log.warning("learner at %s silent for %.1f s; trying to rejoin", self.endpoint, now - heard_at)
                    self._reconnect()       # nothing queued for the old learner reaches a new one
                    self.learner_alive, self.state = False, ClientState.JOINING
                    hello_at, backoff = now, BACKOFF_MIN_S
                self._send_request()
            if not self._sock.poll(POLL_MS):
                continue
            msg = self._receive()
            if msg is None:
                continue
            heard_at = time.monotonic()
            if msg.kind == "welcome":
                self._on_welcome(msg)
                self.state, backoff, beat_at = ClientState.JOINED, BACKOFF_MIN_S, heard_at + self.interval_s
            elif msg.kind == "heartbeat":
                self.learner_alive = True
            elif msg.kind == "rejoin":      # the learner does not know us (restarted, or timed us out)
                if self.state is ClientState.JOINED:   # (further "rejoin"s answer heartbeats sent before it)
                    self.state, hello_at = ClientState.JOINING, heard_at
                if self._request is not None:
                    self._request["sent"] = False
            elif msg.kind == "shutdown":
                log.info("learner at %s finished training", self.endpoint)
                self.final_version = msg.meta["version"]
                self.state = ClientState.FINISHED
            elif msg.kind == "error" and self.state is ClientState.JOINING and self._say_hello_again(msg.meta):
                pass
            elif msg.kind in ("policy_files", "error"):
                self._on_reply(msg)
        if self.state is ClientState.FINISHED and self.defer_bye:
            self._hold_bye()
        if self.state is not ClientState.JOINING:
            self._send("bye", self._credentials())      # the learner waits for it

    def _say_hello_again(self, refusal: dict) -> bool:
        """Whether a refused hello is said again (the back-off goes on) rather than failing the join:
        on rejoining, a learner that has not yet seen our previous connection close still holds our
        id for it; on a first join, the id may be live in another connection (our predecessor's,
        the learner not having probed it yet, or a process that took it), for up to id_wait_s."""
        message = printable(refusal["message"])
        if refusal.get("reason") == "banned":       # final: join() (or the actor's loop) fails with it
            return False
        if self.joins:
            log.warning("learner at %s refused to take us back (%s); saying hello again", self.endpoint, message)
            return True
        if refusal.get("reason") != "id_taken":
            return False
        now = time.monotonic()
        if self._id_refused_at is None:
            self._id_refused_at = now
            log.warning("learner at %s: actor_id %r is live in another connection; saying hello again for up "
                        "to %.0f s, until that connection is gone", self.endpoint, self.actor_id, self.id_wait_s)
        return now - self._id_refused_at < self.id_wait_s

    def _hold_bye(self) -> None:
        """Heartbeat until say_bye(), BYE_HOLD_MAX_S or close()."""
        deadline = time.monotonic() + BYE_HOLD_MAX_S
        while not self._bye_now.is_set():
            if self._stop.is_set():
                return
            if time.monotonic() >= deadline:
                log.warning("version %d has not arrived after %.0f s; saying bye to the learner without it",
                            self.final_version, BYE_HOLD_MAX_S)
                return
            self._send("heartbeat", self._credentials())
            self._stop.wait(BYE_HOLD_BEAT_S)

    def _receive(self) -> Message | None:
        frames = self._sock.recv_multipart(copy=False)
        try:
            msg = decode_control(frames, self._limits, "welcome", "heartbeat", "rejoin", "shutdown",
                                 "policy_files", "error")
            if msg.kind == "welcome":
                check_welcome(msg.meta)
            return msg
        except ValidationError as e:
            self.stats["invalid"][e.reason] += 1
            self._drop_log(e.reason, str(e))
            return None

    def _on_welcome(self, msg: Message) -> None:
        welcome = dict(msg.meta)
        if msg.arrays:
            welcome["policy"] = dict(welcome["policy"], files=files_of(msg))
        self.interval_s = float(welcome.get("heartbeat_interval_s", self.interval_s))
        self.timeout_s = float(welcome.get("heartbeat_timeout_s", self.timeout_s))
        learner_id = welcome.get("learner_id")
        with self._lock:
            first = self.joins == 0
            restarted = not first and learner_id != self.learner_id
            self.welcome, self.token, self.learner_id = welcome, welcome["token"], learner_id
            self.joins += 1
            self.rejoins += 0 if first else 1
            self.restarts += restarted
        if restarted:
            log.info("the learner at %s restarted; rejoined it", self.endpoint)
        elif not first:
            log.info("rejoined the learner at %s: the same learner, which had lost this actor (silent for "
                     "heartbeat_timeout_s, e.g. paused) and knows it again", self.endpoint)
        self.learner_alive = True
        self._joined.set()
        if self._request is not None:
            self._request["sent"] = False

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
            self._send("get_policy_files", self._credentials())
            request["sent"] = True

    def _credentials(self) -> dict:
        return {"actor_id": self.actor_id, "token": self.token}

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

