"""Who may use the channels: actors the learner welcomed, each under the CURVE key it joined with.

A hello answered with a welcome registers an actor. The welcome carries the actor's token,

    token = HMAC-SHA256(learner key, [actor_id, peer key])

which the actor presents with every later request: heartbeat, bye and get_policy_files (control),
get_weights (weights), and in each segment's meta (trajectories). A server checks a token by
computing it again, so the channels (and the learner's ranks) share no registration state. The
peer key is the client's CURVE public key (z85: the ZAP "User-Id" of every frame it sends), ""
without CURVE: a token is worthless from any other key. The control server's registry also binds
each live actor_id to the key that registered it (a hello, heartbeat or bye for it from another
key is refused).

The learner key: with CURVE keys, derived from the learner's secret key, so every rank (and a
restarted learner) computes the same one; without, random per process, so only the servers of
the process that issued a token can check it: rank 0's control and weight servers and inbox (the
inbox of ranks > 0 then checks nothing unless given `auth_key`). A token proves the learner
welcomed that actor_id from that key; it is not revoked when the actor leaves (liveness is the
control channel's business).

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


def actor_token(key: bytes, actor_id: str, peer: str) -> str:
    return hmac.new(key, msgpack.packb([actor_id, peer]), hashlib.sha256).hexdigest()


def valid_token(key: bytes, actor_id, peer: str, token) -> bool:
    """True when `token` is the one the learner gave `actor_id` joining from `peer`."""
    # (compare_digest raises TypeError on a str with non-ASCII characters: a peer's token may hold any)
    if type(token) is not str or type(actor_id) is not str or not token.isascii():
        return False
    return hmac.compare_digest(token, actor_token(key, actor_id, peer))


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
