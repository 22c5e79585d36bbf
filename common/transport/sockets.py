"""ZeroMQ plumbing shared by the channels of common/transport/__init__.py: endpoints, the public-bind
rule, CURVE keys, configured sockets, serving threads that report their death, and bounded-rate
drop logging.

CURVE key layout (written by `asyncvla keygen DIR`):

    DIR/server.key, DIR/server.key_secret        the learner's key pair (learner: keys_dir=DIR)
    DIR/authorized_clients/<name>.key            public keys the learner accepts
    DIR/clients/<name>/client.key, client.key_secret, server.key
                                                 one actor's bundle (actor: keys_dir=DIR/clients/<name>;
                                                 keys_dir=DIR picks the first bundle, for local actors)
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time
from pathlib import Path

import zmq
import zmq.auth

from asyncvla.common.transport.auth import learner_key

log = logging.getLogger("asyncvla.transport")

SERVER_KEY, SERVER_SECRET = "server.key", "server.key_secret"
CLIENT_KEY, CLIENT_SECRET = "client.key", "client.key_secret"
AUTHORIZED_DIR, CLIENTS_DIR = "authorized_clients", "clients"
WILDCARD_HOSTS = ("0.0.0.0", "*", "::", "")
# Frames sent with copy=False below this size are copied all the same: handing a buffer to libzmq
# without a copy costs more than copying it up to about here, since its release wakes pyzmq's
# garbage-collector thread (pyzmq's own default is 64 KB; docs/benchmarks.md).
COPY_BELOW = 128 << 10


class TransportError(RuntimeError):
    """A transport set-up problem, phrased for the user (which key or endpoint, what to do)."""


class ThreadDied(RuntimeError):
    """A channel's background thread ended with an exception (`check()` raises it, naming it)."""


# ---------------------------------------------------------------------------------- endpoints
def tcp_endpoint(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def bind_endpoint(tcfg, port: int) -> str:
    return tcp_endpoint(tcfg.bind_host, port)


def endpoint_host(endpoint: str) -> str | None:
    """The host of a tcp:// endpoint (None for ipc:// and inproc://)."""
    if not endpoint.startswith("tcp://"):
        return None
    rest = endpoint[len("tcp://"):]
    if rest.startswith("["):
        return rest[1:rest.index("]")]
    return rest.rsplit(":", 1)[0]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False        # a name or interface: it may be reachable from outside


def check_bind_allowed(tcfg, endpoint: str) -> None:
    """A learner without CURVE keys binds loopback (or ipc) only, unless explicitly allowed."""
    host = endpoint_host(endpoint)
    if host is None or is_loopback(host) or tcfg.keys_dir:
        return
    if not tcfg.allow_insecure_public_bind:
        raise TransportError(
            f"refusing to bind {endpoint}: transport.bind_host={tcfg.bind_host!r} is not a loopback "
            "address and transport.keys_dir is not set, so anyone who reaches this port could feed "
            "the learner or read its weights. Run `asyncvla keygen DIR` and set transport.keys_dir=DIR "
            "(CURVE encryption + authentication), or set transport.allow_insecure_public_bind=true "
            "on a trusted network.")
    log.warning("binding %s without CURVE (transport.allow_insecure_public_bind=true): traffic is "
                "unencrypted and unauthenticated", endpoint)


def advertised(tcfg, bound: str) -> str:
    """The endpoint actors should connect to, given the one actually bound."""
    host = endpoint_host(bound)
    if host is None:
        return bound
    port = bound.rsplit(":", 1)[1]
    if tcfg.advertise_host:
        return tcp_endpoint(tcfg.advertise_host, int(port))
    if host in WILDCARD_HOSTS:
        return tcp_endpoint(socket.gethostname(), int(port))
    return bound


# ---------------------------------------------------------------------------------- CURVE keys
def server_keys(keys_dir: str) -> tuple[bytes, bytes, Path]:
    """(public, secret, authorized-clients dir) of the learner."""
    root = Path(keys_dir)
    secret_file, authorized = root / SERVER_SECRET, root / AUTHORIZED_DIR
    if not secret_file.is_file() or not authorized.is_dir():
        raise TransportError(f"transport.keys_dir={keys_dir!r} has no {SERVER_SECRET} and "
                             f"{AUTHORIZED_DIR}/ (the learner's side of `asyncvla keygen {keys_dir}`)")
    public, secret = zmq.auth.load_certificate(secret_file)
    return public, secret, authorized


def client_keys(keys_dir: str) -> tuple[bytes, bytes, bytes]:
    """(public, secret, server public) of an actor: keys_dir is one client bundle, or a keygen
    directory whose first bundle is used."""
    root = Path(keys_dir)
    if not (root / CLIENT_SECRET).is_file() and (root / CLIENTS_DIR).is_dir():
        bundles = sorted(p for p in (root / CLIENTS_DIR).iterdir() if (p / CLIENT_SECRET).is_file())
        root = bundles[0] if bundles else root
    if not (root / CLIENT_SECRET).is_file() or not (root / SERVER_KEY).is_file():
        raise TransportError(f"transport.keys_dir={keys_dir!r} has no {CLIENT_SECRET} and {SERVER_KEY} "
                             f"(copy a bundle DIR/{CLIENTS_DIR}/<name> made by `asyncvla keygen DIR`)")
    public, secret = zmq.auth.load_certificate(root / CLIENT_SECRET)
    server_public, _ = zmq.auth.load_certificate(root / SERVER_KEY)
    return public, secret, server_public


# --------------------------------------------------------------------------------------- node
class Node:
    """One zmq context with its sockets (and, for a CURVE server, its authenticator thread).
    Each channel object owns one, so closing it can never hang on another's sockets."""

    def __init__(self, tcfg, server: bool):
        self.tcfg = tcfg
        self.max_bytes = int(tcfg.max_message_mb) << 20
        self.ctx = zmq.Context(io_threads=1)
        self.auth = None
        self.server = server
        self.curve: tuple | None = None
        self.sockets: list[zmq.Socket] = []
        if tcfg.keys_dir:
            try:
                if server:
                    public, secret, authorized = server_keys(tcfg.keys_dir)
                    from zmq.auth.thread import ThreadAuthenticator
                    self.auth = ThreadAuthenticator(self.ctx, log=log.getChild("auth"))
                    self.auth.start()
                    self.auth.configure_curve(domain="*", location=str(authorized))
                    self.curve = (public, secret, None)
                else:
                    self.curve = client_keys(tcfg.keys_dir)
            except BaseException:
                self.close()
                raise

    @property
    def token_key(self) -> bytes:
        """The key actor tokens are signed with (common/transport/auth.py): from the CURVE secret key, if any."""
        return learner_key(self.curve[1] if self.curve is not None else None)

    def socket(self, kind: int, *, bind: str | None = None, connect=(), secure: bool = True,
               **options) -> zmq.Socket:
        """A socket with bounded linger, a per-frame size cap, back-off on reconnect and CURVE
        when keys are configured; bound (after the public-bind check) or connected."""
        s = self.ctx.socket(kind)
        self.sockets.append(s)
        s.linger = self.tcfg.linger_ms
        s.copy_threshold = COPY_BELOW
        s.setsockopt(zmq.MAXMSGSIZE, self.max_bytes)      # ZMQ applies it to each frame
        s.setsockopt(zmq.RECONNECT_IVL_MAX, int(self.tcfg.reconnect_max_s * 1000))
        for name, value in options.items():
            s.setsockopt(getattr(zmq, name), value)
        if secure and self.curve is not None:
            public, secret, server_public = self.curve
            s.curve_publickey, s.curve_secretkey = public, secret
            if self.server:
                s.curve_server = True
            else:
                s.curve_serverkey = server_public
        if bind is not None:
            if secure:
                check_bind_allowed(self.tcfg, bind)
            try:
                s.bind(bind)
            except zmq.ZMQError as e:
                raise TransportError(f"cannot bind {bind}: {e.strerror} (is another learner running, "
                                     "or the port taken? see transport.*_port)") from None
        for endpoint in ([connect] if isinstance(connect, str) else connect):
            s.connect(endpoint)
        return s

    def close_socket(self, s: zmq.Socket, linger_ms: int | None = None) -> None:
        s.close(linger=self.tcfg.linger_ms if linger_ms is None else linger_ms)
        if s in self.sockets:
            self.sockets.remove(s)

    def close(self, linger_ms: int | None = None) -> None:
        for s in list(self.sockets):
            self.close_socket(s, linger_ms)
        if self.auth is not None:
            self.auth.stop()
            self.auth = None
        self.ctx.term()


def bound_endpoint(s: zmq.Socket) -> str:
    """The endpoint a socket really bound (resolves tcp://host:* to the chosen port)."""
    ep = s.getsockopt(zmq.LAST_ENDPOINT)
    return ep.decode() if isinstance(ep, bytes) else ep


# ------------------------------------------------------------------------------------ threads
class ServiceThread(threading.Thread):
    """A channel's daemon thread that keeps the exception it died of. Peer input cannot kill it
    (the decoders are total), so a death is a bug of ours; the owner polls `check()` so that the
    process stops and says which thread died, instead of leaving actors unanswered.
    `on_exit()` runs when the thread ends, its error already recorded (to wake waiters)."""

    def __init__(self, name: str, target, on_exit=None):
        super().__init__(name=name, daemon=True)
        self._serve, self._on_exit = target, on_exit
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._serve()
        except BaseException as e:
            self.error = e
            log.error("thread %s died", self.name, exc_info=True)
        finally:
            if self._on_exit is not None:
                self._on_exit()

    def check(self) -> None:
        """Raise ThreadDied if the thread ended with an exception."""
        if self.error is not None:
            raise ThreadDied(f"the {self.name} thread died: {type(self.error).__name__}: "
                             f"{self.error}") from self.error


# ------------------------------------------------------------------------------------ logging
def printable(text, limit: int = 200) -> str:
    """`text` (from a peer) fit for one log line: control characters and newlines escaped (a
    peer cannot forge or split lines), at most `limit` characters kept."""
    text = str(text)
    out = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text[:limit])
    return out if len(text) <= limit else f"{out}...(+{len(text) - limit} chars)"


class DropLog:
    """Logs a dropped message's reason the first time, then at most once per `interval_s` per
    reason with the count since the last line, so a flood cannot flood the log."""

    def __init__(self, what: str, interval_s: float = 10.0, noun: str = "invalid message(s) dropped"):
        self.what, self.interval_s, self.noun = what, interval_s, noun
        self._last: dict[str, float] = {}
        self._since: dict[str, int] = {}

    def __call__(self, reason: str, detail: str) -> None:
        now = time.monotonic()
        self._since[reason] = self._since.get(reason, 0) + 1
        if now - self._last.get(reason, -1e9) >= self.interval_s:
            log.warning("%s: %d %s (%s), e.g. %s", self.what, self._since[reason], self.noun, reason,
                        printable(detail))
            self._last[reason], self._since[reason] = now, 0
