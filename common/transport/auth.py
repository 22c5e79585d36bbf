"""Who may use the channels: actors the learner welcomed, each under the CURVE key it joined with,
for as long as that registration lasts.

A hello answered with a welcome registers an actor: the control server draws a registration id
(random) and the welcome carries the actor's token,

    token = "<registration>.<HMAC-SHA256(learner key, [actor_id, peer key, registration])>"

which the actor presents with every later request: heartbeat, bye and get_policy_files (control),
get_weights (weights), and in each segment's meta (trajectories). A server checks a token by
computing the HMAC again, and then asks its `TokenLedger` whether the registration has ended: a
bye, a heartbeat time-out, a replacement by a new connection or a ban ends it, and from then on
its token is refused on every channel ("stale_token"), even though its HMAC still checks out. So
a process that once held the join secret, joined under an id and left cannot go on fetching
weights or pushing segments under that id with its old token.

Rank 0's control server ends registrations in its ledger, which rank 0's weight server and inbox
share, so there a token dies the moment its registration does. The inboxes of ranks > 0 hold a
ledger of their own, told of the ended registrations at every update (`learner/link.py`): for at
most one update they may still take a segment under a token that has just ended.

The peer key is the client's CURVE public key (z85: the ZAP "User-Id" of every frame it sends), ""
without CURVE: a token is worthless from any other key. The control server's registry also binds
each live actor_id to the key that registered it (a hello, heartbeat or bye for it from another
key is refused).

The learner key: with CURVE keys, derived from the learner's secret key, so every rank (and a
restarted learner) computes the same one; without, random per process, so only the servers of
the process that issued a token can check it: rank 0's control and weight servers and inbox (the
inbox of ranks > 0 then checks nothing unless given `auth_key`).

Without CURVE keys, who may say hello at all: whoever holds the run's join secret. The launcher
(or the learner, started by hand) draws it once per run directory into RUN/join_secret, readable
by its owner only (0600), and hands it to the processes it starts in their environment
(JOIN_SECRET_ENV; never on a command line, which `ps` shows to every user); `asyncvla actor
--run-dir RUN` reads the file. A hello without it is refused. It keeps out other users and any
process that cannot read the run directory; not root, nor anyone who can read RUN.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import threading
from pathlib import Path

import msgpack
import zmq

_PROCESS_KEY = os.urandom(32)
JOIN_SECRET_FILE = "join_secret"
JOIN_SECRET_ENV = "ASYNCVLA_JOIN_SECRET"


def learner_key(curve_secret: bytes | None) -> bytes:
    """The key tokens are signed with: derived from the learner's CURVE secret key, else random
    for this process."""
    if curve_secret is None:
        return _PROCESS_KEY
    return hashlib.sha256(b"asyncvla actor tokens\0" + curve_secret).digest()


UNREGISTERED, STALE_TOKEN = "unregistered", "stale_token"
MAX_ENDED_REMEMBERED = 1 << 16       # ended registrations a ledger keeps (16 bytes each)


def new_registration() -> str:
    return secrets.token_hex(8)


def actor_token(key: bytes, actor_id: str, peer: str, registration: str) -> str:
    mac = hmac.new(key, msgpack.packb([actor_id, peer, registration]), hashlib.sha256).hexdigest()
    return f"{registration}.{mac}"


def token_registration(token: str) -> str:
    """The registration a well-formed token names (check it with `TokenLedger.check` first)."""
    return token.partition(".")[0]


def valid_token(key: bytes, actor_id, peer: str, token) -> bool:
    """True when `token` is one the learner gave `actor_id` joining from `peer` (for some
    registration, live or ended: `TokenLedger.check` also asks that)."""
    # (compare_digest raises TypeError on a str with non-ASCII characters: a peer's token may hold any)
    if type(token) is not str or type(actor_id) is not str or not token.isascii() or "." not in token:
        return False
    return hmac.compare_digest(token, actor_token(key, actor_id, peer, token_registration(token)))


class TokenLedger:
    """Signs tokens with the learner key and remembers which registrations have ended, so that a
    channel refuses their tokens. Thread-safe: rank 0's control server ends registrations from its
    thread while the weight server's thread and the learner's inbox check tokens.

    It remembers the newest MAX_ENDED_REMEMBERED ended registrations: a token older than that
    many departures would check out again (a run sees a few per actor restart)."""

    def __init__(self, key: bytes):
        self.key = key
        self._ended: dict[str, int] = {}       # registration -> its number in the order they ended
        self._count = 0
        self._lock = threading.Lock()

    def issue(self, actor_id: str, peer: str, registration: str) -> str:
        return actor_token(self.key, actor_id, peer, registration)

    def check(self, actor_id, peer: str, token) -> str | None:
        """None when the token may be used; else why not: UNREGISTERED (not a token the learner
        gave this actor_id from this key) or STALE_TOKEN (its registration has ended)."""
        if not valid_token(self.key, actor_id, peer, token):
            return UNREGISTERED
        with self._lock:
            return STALE_TOKEN if token_registration(token) in self._ended else None

    def end(self, *registrations: str) -> None:
        """These registrations are over: their tokens are refused from now on."""
        with self._lock:
            for registration in registrations:
                if registration in self._ended:
                    continue
                self._count += 1
                self._ended[registration] = self._count
                if len(self._ended) > MAX_ENDED_REMEMBERED:
                    del self._ended[next(iter(self._ended))]

    def ended_after(self, mark: int) -> tuple[list[str], int]:
        """The registrations ended since `mark` (0: since the start, as far as remembered), and the
        mark to ask with next time: what another rank's ledger is told at each update."""
        with self._lock:
            new = []
            for registration in reversed(self._ended):
                if self._ended[registration] <= mark:
                    break
                new.append(registration)
            return new[::-1], self._count


def peer_key(frame) -> str:
    """The CURVE public key (z85) a received frame's sender authenticated with; "" without CURVE.
    Needs a zmq.Frame (recv with copy=False)."""
    try:
        return frame.get("User-Id")
    except zmq.ZMQError:          # no ZAP handler ran: the socket does not use CURVE
        return ""


def ensure_join_secret(run_dir) -> str:
    """RUN/join_secret, drawn now (64 hex digits, the file 0600) when the run has none yet."""
    path = Path(run_dir) / JOIN_SECRET_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return read_join_secret(run_dir)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return read_join_secret(run_dir)


def read_join_secret(run_dir) -> str:
    """The secret in RUN/join_secret; ValueError naming the file when it is missing or malformed."""
    path = Path(run_dir) / JOIN_SECRET_FILE
    try:
        secret = path.read_text().strip()
    except OSError as e:
        raise ValueError(f"cannot read the run's join secret {path}: {e.strerror or e}") from None
    if not (16 <= len(secret) <= 256 and secret.isascii() and secret.isalnum()):
        raise ValueError(f"{path} does not hold a join secret (16-256 letters and digits)")
    return secret


def join_secret_from_env() -> str | None:
    """The join secret the launcher handed this process (JOIN_SECRET_ENV), or None."""
    return os.environ.get(JOIN_SECRET_ENV) or None


def valid_join_secret(expected: str, given) -> bool:
    """True when a hello's join secret is the run's (constant-time)."""
    return type(given) is str and given.isascii() and hmac.compare_digest(given, expected)
