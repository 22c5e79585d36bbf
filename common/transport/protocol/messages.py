"""The small messages: weights (learner -> actor: a version and named tensors) and the control
messages of CONTROL_META (join, heartbeats, policy files, the end of training), each in the wire
codec of wire.py with its meta checked against its kind's keys and types.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from .wire import WEIGHTS, Limits, Message, ValidationError, all_finite, check_meta, decode, encode, expect_kind, total

# Control messages: required meta keys and their types (extra keys are refused).
CONTROL_META: dict[str, dict[str, type]] = {
    "hello": {"actor_id": str, "host": str, "pid": int, "num_envs": int},   # actor -> learner
                                                                # (num_envs 0: the learner's config)
    "welcome": {},                                              # learner -> actor (free-form dict)
    "heartbeat": {},                                            # both ways (actor adds actor_id, token)
    "rejoin": {},                                               # learner: "unknown actor, say hello"
    "bye": {"actor_id": str, "token": str},                     # actor leaves
    "shutdown": {"version": int},                               # learner finished: actors stop
                                                                # (version: the last one published)
    "get_policy_files": {"actor_id": str, "token": str},
    "policy_files": {},                                         # one uint8 array per file
    "error": {"message": str},
    "get_weights": {"newer_than": int, "wait_ms": int,          # actor -> weight server
                    "actor_id": str, "token": str},
    "no_weights": {"version": int},                             # nothing newer within wait_ms
}
# Keys a message of a kind may carry besides its required ones, and their types.
CONTROL_META_OPTIONAL: dict[str, dict[str, type]] = {
    "hello": {"join_secret": str},      # the run's join secret (common/transport/auth.py), without CURVE keys
    "error": {"reason": str},           # what a refusal was, as the server counts it (e.g. "id_taken")
}
FREE_META = ("welcome", "heartbeat")      # kinds whose meta may carry other keys
# "token": the one the welcome gave the actor (common/transport/auth.py); without it, or with another, a
# server refuses the request or segment.


# ---------------------------------------------------------------------------------- weights
def encode_weights(version: int, tensors: Mapping[str, Any], step: int | None = None) -> list:
    """Frames of a weights message; numpy arrays or torch tensors (bf16 travels as uint16 bits).
    `step`: the learner update that produced this version (for evaluators), when known."""
    for name, value in (("version", version), ("step", step)):
        if value is not None and (type(value) is not int or value < 0):
            raise ValueError(f"weights {name} must be an int >= 0, got {value!r}")
    meta = {"version": version} if step is None else {"version": version, "step": step}
    return encode(WEIGHTS, meta, tensors)


@total
def decode_weights(frames: Sequence[Any], limits: Limits) -> tuple[int, dict[str, np.ndarray]]:
    """(version, tensors). Arrays view the frames, except bf16 ones, which become float32
    (exact; numpy has no bf16, and the receiving model casts to its own dtype anyway)."""
    return weights_of(decode(frames, limits))


@total
def weights_of(msg: Message) -> tuple[int, dict[str, np.ndarray]]:
    """Check a decoded "weights" message and return (version, tensors); its optional meta
    "step" (the learner update behind the version) stays in msg.meta."""
    expect_kind(msg, WEIGHTS)
    if not {"version"} <= set(msg.meta) <= {"version", "step"}:
        raise ValidationError("bad_meta", "weights meta must be {version} or {version, step}")
    check_meta(msg.meta, {k: int for k in msg.meta})
    for key, value in msg.meta.items():
        if value < 0:
            raise ValidationError("bad_meta", f"weights {key} {value} < 0")
    out = {}
    for name, arr in msg.arrays.items():
        if msg.tags[name] == "bfloat16":
            arr = bf16_bits_to_float32(arr)
        if not all_finite(arr):
            raise ValidationError("not_finite", f"weight '{name}' holds NaN or inf")
        out[name] = arr
    return msg.meta["version"], out


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


# ---------------------------------------------------------------------------------- control
def encode_control(kind: str, meta: Mapping[str, Any] | None = None,
                   files: Mapping[str, bytes] | None = None) -> list:
    """A control message; `files` (relative path -> bytes) travel as raw uint8 frames."""
    if kind not in CONTROL_META:
        raise ValueError(f"unknown control message {kind!r}; known: {list(CONTROL_META)}")
    arrays = {name: np.frombuffer(data, np.uint8) for name, data in (files or {}).items()}
    return encode(kind, meta, arrays)


@total
def decode_control(frames: Sequence[Any], limits: Limits, *kinds: str) -> Message:
    """A control message of one of `kinds`, its meta checked against `CONTROL_META`."""
    return control_of(decode(frames, limits), *kinds)


@total
def control_of(msg: Message, *kinds: str) -> Message:
    expect_kind(msg, *kinds)
    required, optional = CONTROL_META[msg.kind], CONTROL_META_OPTIONAL.get(msg.kind, {})
    extra = set(msg.meta) - set(required) - set(optional)
    if extra and msg.kind not in FREE_META:
        raise ValidationError("bad_meta", f"'{msg.kind}' has unknown meta keys {sorted(map(str, extra))[:5]}")
    check_meta(msg.meta, required)
    check_meta(msg.meta, {k: t for k, t in optional.items() if k in msg.meta})
    for name, arr in msg.arrays.items():
        if msg.tags[name] != "uint8" or arr.ndim != 1:
            raise ValidationError("bad_dtype", f"file frame '{name}' must be a 1-D uint8 array")
    return msg


def files_of(msg: Message) -> dict[str, bytes]:
    return {name: arr.tobytes() for name, arr in msg.arrays.items()}
