"""Messages between actors and learner: one msgpack header frame, then the arrays' raw bytes.

On the wire a message is a list of frames:

    frame 0    msgpack map {"type": kind, "v": SCHEMA_VERSION, "meta": {...}, "layout": bytes}
               where layout is itself msgpack: [[name, dtype, [dim, ...]], ...]
    frame 1    the arrays smaller than PACK_BELOW bytes, packed in layout order, each at the next
               multiple of 8 bytes, zeros between (the frame is absent when no array is that small)
    frame 2..  each larger array, in layout order, one frame each

Each array holds exactly prod(shape) * itemsize C-order bytes. Which arrays are packed follows
from the layout alone, so a receiver knows every frame's size before it looks at one.

Why packed: a frame costs a few microseconds on each end (pyzmq even copies frames under 64 KiB
when asked not to), and a segment has ~15 arrays of which only the images are large. The layout
travels as one opaque bin, so a receiver checks each distinct layout once and then finds it by
its bytes.

`decode` returns numpy arrays that view the received frames (no copy). Nothing is ever
pickled; dtypes come from an allow-list. Every check failure raises `ValidationError` whose
`reason` names the kind of problem (receivers count drops per reason). The decoders are total:
whatever bytes a peer sends, they return or raise `ValidationError` (an exception no check
foresaw becomes reason "decode_error"), so a receiving thread never dies of its input.

Message kinds: "segment" (actor -> learner rank, schema in `SEGMENT_FIELDS`), "weights"
(learner -> actor: version + named tensors), and the small control messages of `CONTROL_META`.
This module has no sockets; common/transport.py moves the frames.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

import msgpack
import numpy as np

SCHEMA_VERSION = 2
PACK_BELOW = 1 << 16      # arrays under this many bytes share frame 1
ALIGN = 8                # packed arrays start at multiples of this

# bfloat16 has no numpy dtype: it travels as its raw uint16 bits with the tag "bfloat16".
DTYPES = {name: np.dtype(dt) for name, dt in [
    ("uint8", np.uint8), ("bool", np.bool_), ("int32", np.int32), ("int64", np.int64),
    ("float16", np.float16), ("float32", np.float32), ("bfloat16", np.uint16)]}
_TAG_OF = {np.dtype(np.uint8): "uint8", np.dtype(np.bool_): "bool", np.dtype(np.int32): "int32",
           np.dtype(np.int64): "int64", np.dtype(np.float16): "float16", np.dtype(np.float32): "float32"}

MAX_NAME_LEN = 256
MAX_NDIM = 8
INT64_MAX = (1 << 63) - 1
# Our headers nest at most ~6 deep (a welcome's config); a deeper one is hostile, and walking it
# (repr, str, deepcopy) would raise RecursionError.
MAX_DEPTH = 16
# Elements of one array counting only its non-zero dims: numpy refuses to shape even an empty
# array whose other dims overflow its index type ([2**62, 2**62, 0]).
MAX_ELEMENTS = 1 << 40
REQUEST_MAX_BYTES = 64 << 10        # a request to a server (hello, heartbeat, get_weights, ...)
# The longest episode (env steps) a segment may report when the receiver does not know the env's
# time limit (SegmentSpec.max_episode_steps unset): far beyond any task's, yet a length that keeps
# the episode metrics readable.
MAX_EPISODE_STEPS = 1 << 24
# The ranges of a segment's float fields beyond finiteness (Field.bound; SegmentSpec.bounds), far
# outside what an honest actor sends, so that a buggy or hostile one cannot put a huge but finite
# value into a batch (a flow chain times 2e30 passes a finite check, and overflows the loss):
MAX_ABS_STATE = 1e4           # robot state: joint positions and velocities, poses
MAX_ABS_LOGP = 1e4            # a log-prob (token) or a log-density (flow; positive where narrow)
MAX_ABS_CHAIN = 1e2           # a flow chain lives in the unit action space, from N(0, 1) noise at t = 1
MAX_SEGMENT_SECONDS = 1e5     # meta act_s / env_s: an actor's time acting or stepping in one segment

SEGMENT, WEIGHTS = "segment", "weights"
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
    "hello": {"join_secret": str},      # the run's join secret (common/auth.py), without CURVE keys
    "error": {"reason": str},           # what a refusal was, as the server counts it (e.g. "id_taken")
}
FREE_META = ("welcome", "heartbeat")      # kinds whose meta may carry other keys
# "token": the one the welcome gave the actor (common/auth.py); without it, or with another, a
# server refuses the request or segment.


class ValidationError(ValueError):
    """A message that must be dropped; `reason` is a short, countable category."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Limits:
    """Bounds applied before and while parsing: all frames together, header bytes, array count."""
    max_bytes: int
    max_arrays: int = 64
    max_header_bytes: int = 1 << 20

    @classmethod
    def for_kind(cls, kind: str, max_message_mb: int) -> "Limits":
        # Weights may hold thousands of tensors (a full fine-tune); a segment has < 32 fields;
        # requests to the servers are tiny.
        total = int(max_message_mb) << 20
        if kind == WEIGHTS:
            return cls(total, max_arrays=16384, max_header_bytes=4 << 20)
        if kind == SEGMENT:
            return cls(total, max_arrays=32, max_header_bytes=64 << 10)
        if kind == "request":
            return cls(REQUEST_MAX_BYTES, max_arrays=0, max_header_bytes=REQUEST_MAX_BYTES)
        return cls(total, max_arrays=4096, max_header_bytes=1 << 20)


@dataclass
class Message:
    kind: str
    meta: dict
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)      # array name -> dtype tag (shared: read only)
    layout: "_Layout | None" = None                          # where each array lies (decode's)
    buffers: list = field(default_factory=list)              # the frames, as memoryviews


# ------------------------------------------------------------------------------ generic codec
def _total(decoder):
    """Make a decoder total on peer input: any exception other than ValidationError (a check we
    lack, e.g. an odd shape numpy refuses) is turned into one, so the receiver drops and counts
    the message instead of dying."""
    @functools.wraps(decoder)
    def wrapped(*args, **kwargs):
        try:
            return decoder(*args, **kwargs)
        except ValidationError:
            raise
        except Exception as e:
            raise ValidationError("decode_error", f"{type(e).__name__}: {str(e)[:200]}") from e
    return wrapped


def encode(kind: str, meta: Mapping[str, Any] | None = None,
           arrays: Mapping[str, Any] | None = None) -> list:
    """Frames of a message: the header, the packed small arrays, then each large array (a
    C-contiguous numpy array, whose buffer the socket sends without copying). Torch tensors are
    accepted (bf16 as its bits)."""
    layout, packed, large, offset = [], [], [], 0
    for name, value in (arrays or {}).items():
        tag, arr = _as_wire_array(name, value)
        layout.append([name, tag, list(arr.shape)])
        if arr.nbytes >= PACK_BELOW:
            large.append(arr)
            continue
        pad = -offset % ALIGN
        if pad:
            packed.append(bytes(pad))
        packed.append(arr)
        offset += pad + arr.nbytes
    header = {"type": kind, "v": SCHEMA_VERSION, "meta": dict(meta or {}),
              "layout": msgpack.packb(layout, use_bin_type=True)}
    small = [b"".join(packed)] if len(large) < len(layout) else []
    return [msgpack.packb(header, use_bin_type=True), *small, *large]


@_total
def decode(frames: Sequence[Any], limits: Limits) -> Message:
    """Parse and check a received message; arrays view the frames (zmq.Frame, bytes or buffers)."""
    if not frames:
        raise ValidationError("frame_count", "empty message")
    if len(frames) > limits.max_arrays + 2:
        raise ValidationError("frame_count", f"{len(frames)} frames for at most {limits.max_arrays} arrays")
    buffers = [_buffer(f) for f in frames]
    total = sum(b.nbytes for b in buffers)
    if total > limits.max_bytes:
        raise ValidationError("too_large", f"{total} bytes > {limits.max_bytes}")
    header = _unpack_header(buffers[0], limits)
    layout = _layout(header["layout"], limits)
    if len(buffers) != len(layout.frame_bytes):
        raise ValidationError("frame_count", f"layout declares {len(layout.entries)} arrays in "
                                             f"{len(layout.frame_bytes) - 1} array frames, message has "
                                             f"{len(buffers) - 1}")
    for i, (want, what) in enumerate(zip(layout.frame_bytes, layout.frame_names)):
        if i and buffers[i].nbytes != want:
            raise ValidationError("frame_size", f"{what} needs {want} bytes, frame {i} has {buffers[i].nbytes}")
    arrays = {}
    for name, tag, dtype, shape, nbytes, frame, offset in layout.entries:
        arr = np.ndarray(shape, dtype, buffers[frame], offset)
        if tag == "bool" and nbytes and arr.view(np.uint8).max() > 1:
            raise ValidationError("bad_values", f"array '{name}' (bool) holds bytes other than 0/1")
        arrays[name] = arr
    return Message(header["type"], header["meta"], arrays, layout.tags, layout, buffers)


class _Layout(NamedTuple):
    """A checked layout: entries (name, tag, dtype, shape, nbytes, frame, offset), each frame's
    size in bytes (frame 0, the header, is not checked) and what it holds, the dtype tag per name,
    and the cache key (the layout's bytes, or None when not cached)."""
    entries: tuple
    frame_bytes: tuple
    frame_names: tuple
    tags: dict
    key: bytes | None


# A stream of messages repeats a few layouts; checking one once and finding it again by its exact
# bytes keeps the per-message cost low.
_LAYOUTS: dict[bytes, _Layout] = {}
_MAX_CACHED_LAYOUTS, _MAX_CACHED_KEY = 256, 8192


def _layout(raw, limits: Limits) -> _Layout:
    if type(raw) is not bytes:
        raise ValidationError("bad_header", "header 'layout' must be msgpack bytes")
    hit = _LAYOUTS.get(raw)
    if hit is None:
        hit = _parse_layout(raw, limits)
        if len(raw) <= _MAX_CACHED_KEY:
            if len(_LAYOUTS) >= _MAX_CACHED_LAYOUTS:
                _LAYOUTS.clear()
            _LAYOUTS[raw] = hit = hit._replace(key=raw)
    if len(hit.entries) > limits.max_arrays:      # a cached layout may come from a roomier channel
        raise ValidationError("frame_count", f"{len(hit.entries)} arrays > {limits.max_arrays}")
    return hit


def _parse_layout(raw: bytes, limits: Limits) -> _Layout:
    specs = _unpack(raw, limits, "layout")
    if type(specs) is not list:        # (msgpack bounds its length: max_array_len)
        raise ValidationError("bad_header", "the layout must be a list")
    tags: dict[str, str] = {}
    checked = []
    for spec in specs:
        name, tag, dtype, shape, count = _check_array_spec(spec, tags)
        tags[name] = tag
        checked.append((name, tag, dtype, shape, count * dtype.itemsize))
    small = [c for c in checked if c[4] < PACK_BELOW]
    frame_bytes, frame_names, entries, offset = [0], ["the header"], {}, 0
    for name, tag, dtype, shape, nbytes in small:              # frame 1, when any is small
        offset += -offset % ALIGN
        entries[name] = (name, tag, dtype, shape, nbytes, 1, offset)
        offset += nbytes
    if small:
        frame_bytes.append(offset)
        frame_names.append(f"the {len(small)} packed arrays")
    for name, tag, dtype, shape, nbytes in checked:             # then one frame per large array
        if nbytes >= PACK_BELOW:
            entries[name] = (name, tag, dtype, shape, nbytes, len(frame_bytes), 0)
            frame_bytes.append(nbytes)
            frame_names.append(f"array '{name}' {tag}{list(shape)}")
    return _Layout(tuple(entries[c[0]] for c in checked), tuple(frame_bytes), tuple(frame_names), tags, None)


def _buffer(frame) -> memoryview:
    buf = getattr(frame, "buffer", None)      # zmq.Frame received with copy=False
    mv = memoryview(buf if buf is not None else frame)
    if mv.format == "B" and mv.ndim == 1:
        return mv
    return mv.cast("B") if mv.nbytes else memoryview(b"")   # cast() refuses zero-size shapes


def _unpack(buf, limits: Limits, what: str):
    n = limits.max_header_bytes
    try:
        obj = msgpack.unpackb(buf, raw=False, strict_map_key=True, use_list=True,
                              max_str_len=n, max_bin_len=n, max_array_len=max(limits.max_arrays, 4096),
                              max_map_len=4096, max_ext_len=0)
    except Exception as e:    # msgpack raises several types (ValueError, FormatError, StackError, ...)
        raise ValidationError("bad_header", f"not a valid msgpack {what} ({type(e).__name__})") from None
    if not _nests_within(obj, MAX_DEPTH):
        raise ValidationError("too_deep", f"{what} nests deeper than {MAX_DEPTH} levels")
    return obj


def _unpack_header(buf: memoryview, limits: Limits) -> dict:
    if buf.nbytes > limits.max_header_bytes:
        raise ValidationError("header_too_large", f"{buf.nbytes} bytes > {limits.max_header_bytes}")
    header = _unpack(buf, limits, "header")
    if not isinstance(header, dict) or set(header) != {"type", "v", "meta", "layout"}:
        keys = sorted(map(str, header)) if isinstance(header, dict) else type(header).__name__
        raise ValidationError("bad_header", f"header must be a map of type, v, meta, layout; got {keys}")
    if header["v"] != SCHEMA_VERSION or isinstance(header["v"], bool):
        raise ValidationError("schema_version", f"schema version {header['v']!r}, expected {SCHEMA_VERSION}")
    if not isinstance(header["type"], str) or not isinstance(header["meta"], dict):
        raise ValidationError("bad_header", "type must be a string, meta a map")
    return header


def _nests_within(obj, limit: int) -> bool:
    """True when no list/map in obj lies more than `limit` levels deep (iterative: a hostile
    depth cannot exhaust the stack here)."""
    todo = [(obj, 1)]
    while todo:
        o, depth = todo.pop()
        if depth > limit:
            return False
        for v in (o.values() if type(o) is dict else o):
            if type(v) is list or type(v) is dict:
                todo.append((v, depth + 1))
    return True


def _check_array_spec(spec, seen: dict) -> tuple[str, str, np.dtype, tuple, int]:
    """(name, tag, dtype, shape, element count) of one header entry [name, dtype, shape]."""
    if type(spec) is not list or len(spec) != 3:
        raise ValidationError("bad_header", "an array entry must be [name, dtype, shape]")
    name, tag, shape = spec
    if type(name) is not str or not 0 < len(name) <= MAX_NAME_LEN or name in seen:
        raise ValidationError("bad_header", f"array name {str(name)[:40]!r} is empty, too long, "
                                            "repeated or not a string")
    dtype = DTYPES.get(tag) if type(tag) is str else None
    if dtype is None:
        raise ValidationError("bad_dtype", f"array '{name}' dtype {str(tag)[:20]!r} not in {list(DTYPES)}")
    if type(shape) is not list or len(shape) > MAX_NDIM:
        raise ValidationError("bad_shape", f"array '{name}' shape must be a list of <= {MAX_NDIM} ints")
    count = nonzero = 1
    for d in shape:
        if type(d) is not int or not 0 <= d <= INT64_MAX:
            raise ValidationError("bad_shape", f"array '{name}' shape must hold non-negative int64s")
        count *= d
        nonzero *= d or 1
    if nonzero > MAX_ELEMENTS:
        raise ValidationError("bad_shape", f"array '{name}' shape {shape} is absurd (non-zero dims hold "
                                           f"more than {MAX_ELEMENTS} elements)")
    return name, tag, dtype, tuple(shape), count


def _as_wire_array(name: str, value) -> tuple[str, np.ndarray]:
    if type(value) is np.ndarray and value.flags.c_contiguous and value.dtype in _TAG_OF:
        return _TAG_OF[value.dtype], value                # the common case, quickly
    if hasattr(value, "detach"):                         # a torch tensor
        t = value.detach().cpu().contiguous()
        if str(t.dtype) == "torch.bfloat16":
            import torch
            return "bfloat16", t.view(torch.int16).numpy().view(np.uint16)
        value = t.numpy()
    arr = np.asarray(value)
    if not arr.flags.c_contiguous:
        arr = arr.copy(order="C")
    tag = _TAG_OF.get(arr.dtype)
    if tag is None:
        raise TypeError(f"array '{name}' has dtype {arr.dtype}; allowed: {list(DTYPES)}")
    return tag, arr


# --------------------------------------------------------------------------------- segments
@dataclass
class Segment:
    """One trajectory segment: meta (actor_id, seq, policy_version, num_steps T, num_envs B,
    env_steps, optional act_s/env_s, the actor's incarnation and token) and time-major arrays named
    as in `SEGMENT_FIELDS`."""
    meta: dict
    arrays: dict[str, np.ndarray]


class Field(NamedTuple):
    """One segment array: its dtype tag, its dims, its role and, for a float field, the name of the
    range its values must lie in (`SegmentSpec.bounds`; None: finite is enough, or a check of its
    own: rewards and episode returns are bounded by learner.max_abs_reward).

    dims: ints are fixed; letters are sizes: T steps, "T1" = T+1, B envs, H/W image, L instruction,
    S state, N action tokens (K*D), R the K axis of action-level rewards, n truncations, E episodes,
    F a flow head's denoising steps ("F1" = F+1), K x D its chunk.
    role: "obs" [T+1, B, ...] (the last one bootstraps V), "step" [T, B, ...], "final" [n, ...]
    (the final observation of each truncated episode, named final_<obs>), "index" (final_index
    [n, 2]: the (t, b) of each truncation), "episode" [E] (stats of episodes that ended).
    """
    dtype: str
    dims: tuple
    role: str
    bound: str | None = None


# The observation, per env: name -> (dtype, dims after [T+1, B], range). Each also has a final_<name>.
_OBSERVATION = {"image": ("uint8", ("H", "W", 3), None), "instruction": ("int64", ("L",), None),
                "instruction_mask": ("uint8", ("L",), None), "state": ("float32", ("S",), "state")}
FINAL_PREFIX = "final_"

# The segment schema: the one definition that actors (actors/rollout.py), the receiver (below)
# and the learner (learner/ingest.py, learner/update.py) iterate over.
SEGMENT_FIELDS: dict[str, Field] = {
    **{k: Field(dt, ("T1", "B", *d), "obs", r) for k, (dt, d, r) in _OBSERVATION.items()},
    "action_tokens": Field("int64", ("T", "B", "N"), "step"),
    "behavior_logp": Field("float32", ("T", "B", "N"), "step", "logp"),
    # A flow head sends its chains instead of action tokens (the learner recomputes their log-probs).
    "flow_chain": Field("float32", ("T", "B", "F1", "K", "D"), "step", "chain"),
    "flow_stochastic": Field("uint8", ("T", "B", "F"), "step"),
    "rewards": Field("float32", ("T", "B", "R"), "step"),
    "terminated": Field("uint8", ("T", "B"), "step"),
    "truncated": Field("uint8", ("T", "B"), "step"),
    "final_index": Field("int64", ("n", 2), "index"),
    **{FINAL_PREFIX + k: Field(dt, ("n", *d), "final", r) for k, (dt, d, r) in _OBSERVATION.items()},
    "ep_return": Field("float32", ("E",), "episode"),
    "ep_length": Field("int64", ("E",), "episode"),
    "ep_success": Field("uint8", ("E",), "episode"),
}
OBS_FIELDS = tuple(k for k, f in SEGMENT_FIELDS.items() if f.role == "obs")
TIME_MAJOR_FIELDS = tuple(k for k, f in SEGMENT_FIELDS.items() if f.role in ("obs", "step"))
FINAL_FIELDS = tuple(k for k, f in SEGMENT_FIELDS.items() if f.role == "final")
STATE_FIELDS = tuple(k for k, f in SEGMENT_FIELDS.items() if "S" in f.dims)   # present only when S > 0
FLOW_FIELDS = ("flow_chain", "flow_stochastic")      # present instead of action_tokens when F > 0
# Value checks on receipt: floats finite, flags and masks 0/1, token ids below the vocabulary
# (action tokens within the action ids), rewards bounded.
FINITE_FIELDS = tuple(k for k, f in SEGMENT_FIELDS.items() if f.dtype == "float32")
BINARY_FIELDS = tuple(k for k, f in SEGMENT_FIELDS.items() if f.dtype == "uint8" and "H" not in f.dims)
TEXT_FIELDS = tuple(k for k, f in SEGMENT_FIELDS.items() if f.dtype == "int64" and "L" in f.dims)
# The order actors send fields in: the images (large: frames of their own), then the fields of
# each group of `_group_checks` side by side, then the rest.
WIRE_ORDER = (tuple(k for k, f in SEGMENT_FIELDS.items() if "H" in f.dims) + FINITE_FIELDS + BINARY_FIELDS
              + TEXT_FIELDS)
WIRE_ORDER += tuple(k for k in SEGMENT_FIELDS if k not in WIRE_ORDER)
SEGMENT_META = {"actor_id": str, "seq": int, "policy_version": int, "num_steps": int,
                "num_envs": int, "env_steps": int}
# incarnation: drawn by an actor process at start; with actor_id it names the stream whose seqs a
# learner rank checks for repeats (a restarted actor keeps its id and starts again at seq 0).
SEGMENT_META_OPTIONAL = {"act_s": float, "env_s": float, "token": str, "incarnation": int}
SEGMENT_SECONDS = ("act_s", "env_s")       # timings: in [0, MAX_SEGMENT_SECONDS]


def final_field(obs_name: str) -> str:
    """The name of an observation field's final-observation counterpart."""
    return FINAL_PREFIX + obs_name


@dataclass(frozen=True)
class SegmentSpec:
    """The dims a receiver expects (H = W = image_size, L, N = K*D, K, S), and optional bounds:
    num_steps (exact T), max_steps, max_envs, vocab_size (token ids must be below it),
    first_action_id (action tokens must be at least it: the action ids are the vocabulary's last
    ones), max_abs_reward (|reward| must not exceed it), max_episode_steps (the env's episode
    limit: a reported episode length must lie in [1, it]; unset: MAX_EPISODE_STEPS). A flow head's
    segments (flow_steps F > 0, action_dim D) carry flow_chain and flow_stochastic instead of
    action_tokens, and their behaviour log-probs are Gaussian densities, which may be positive."""
    image_size: int
    instruction_len: int
    num_tokens: int
    num_action_chunks: int
    state_dim: int = 0
    action_level_rewards: bool = False
    num_steps: int | None = None
    max_steps: int | None = None
    max_envs: int | None = None
    vocab_size: int | None = None
    first_action_id: int | None = None
    max_abs_reward: float | None = None
    max_episode_steps: int | None = None
    flow_steps: int = 0
    action_dim: int = 0

    def bounds(self) -> dict[str, tuple[float, float]]:
        """The range of each Field.bound: [low, high] every value of such a field must lie in. A
        token head's log-probs are <= 0 (a hair above, for rounding); a flow head's are Gaussian
        log-densities, positive where a step is narrow."""
        logp_high = MAX_ABS_LOGP if self.flow_steps else 1e-3
        return {"state": (-MAX_ABS_STATE, MAX_ABS_STATE), "logp": (-MAX_ABS_LOGP, logp_high),
                "chain": (-MAX_ABS_CHAIN, MAX_ABS_CHAIN)}

    def fields(self) -> dict[str, Field]:
        """The expected arrays: name -> Field."""
        absent = (() if self.state_dim > 0 else STATE_FIELDS) + \
            (("action_tokens",) if self.flow_steps > 0 else FLOW_FIELDS)
        fields = {k: v for k, v in SEGMENT_FIELDS.items() if k not in absent}
        if not self.action_level_rewards:
            fields["rewards"] = Field("float32", ("T", "B"), "step")
        return fields


def encode_segment(segment: Segment) -> list:
    unknown = set(segment.arrays) - set(SEGMENT_FIELDS)
    if unknown:
        raise KeyError(f"segment arrays {sorted(unknown)} are not in the schema {list(SEGMENT_FIELDS)}")
    check_segment_meta(segment.meta)        # the sender finds a bad meta, not the receiver
    arrays = segment.arrays
    return encode(SEGMENT, segment.meta, {k: arrays[k] for k in WIRE_ORDER if k in arrays})


@_total
def decode_segment(frames: Sequence[Any], spec: SegmentSpec, limits: Limits) -> Segment:
    msg = decode(frames, limits)
    expect_kind(msg, SEGMENT)
    return Segment(meta=check_segment_meta(msg.meta), arrays=check_segment_arrays(msg, spec))


def expect_kind(msg: Message, *kinds: str) -> None:
    if msg.kind not in kinds:
        raise ValidationError("wrong_type", f"message type {msg.kind[:40]!r}, expected one of {list(kinds)}")


def check_segment_meta(meta: dict) -> dict:
    extra = set(meta) - set(SEGMENT_META) - set(SEGMENT_META_OPTIONAL)
    if extra:
        raise ValidationError("bad_meta", f"unknown meta keys {sorted(map(str, extra))[:5]}")
    check_meta(meta, SEGMENT_META)
    check_meta(meta, {k: t for k, t in SEGMENT_META_OPTIONAL.items() if k in meta})
    for key in ("seq", "policy_version", "env_steps", "num_steps", "num_envs", "incarnation"):
        if key in meta and meta[key] < (1 if key in ("num_steps", "num_envs") else 0):
            raise ValidationError("bad_meta", f"meta '{key}'={meta[key]} is out of range")
    for key in SEGMENT_SECONDS:
        if key in meta and not 0 <= meta[key] <= MAX_SEGMENT_SECONDS:
            raise ValidationError("bad_meta", f"meta '{key}'={meta[key]:.3g} is out of range [0, "
                                              f"{MAX_SEGMENT_SECONDS:g}] (seconds)")
    if not 0 < len(meta["actor_id"]) <= MAX_NAME_LEN:
        raise ValidationError("bad_meta", "meta 'actor_id' must be 1..256 characters")
    return meta


def check_segment_arrays(msg: Message, spec: SegmentSpec) -> dict[str, np.ndarray]:
    layout_key = msg.layout.key if msg.layout is not None else None
    key = None if layout_key is None else (layout_key, spec, msg.meta["num_steps"], msg.meta["num_envs"])
    checked = _SEGMENT_LAYOUTS.get(key) if key is not None else None
    if checked is None:
        dims = _check_segment_layout(msg, spec)
        checked = dims, _group_checks(msg.layout, spec)
        if key is not None:
            if len(_SEGMENT_LAYOUTS) >= _MAX_CACHED_LAYOUTS:
                _SEGMENT_LAYOUTS.clear()
            _SEGMENT_LAYOUTS[key] = checked
    _check_segment_values(msg, spec, *checked)
    return msg.arrays


_SEGMENT_LAYOUTS: dict[tuple, tuple] = {}


def _check_segment_layout(msg: Message, spec: SegmentSpec) -> dict[str, int]:
    """Field names, dtypes and shapes against the spec and meta; returns the dims."""
    arrays, fields = msg.arrays, _fields_of(spec)
    if arrays.keys() != fields.keys():
        missing, extra = sorted(set(fields) - set(arrays)), sorted(set(arrays) - set(fields))
        raise ValidationError("bad_fields", f"missing {missing}, unexpected {extra}")
    dims = _segment_dims(arrays, spec, msg.meta)
    for name, (tag, shape, *_) in fields.items():
        if msg.tags[name] != tag:
            raise ValidationError("bad_dtype", f"'{name}' is {msg.tags[name]}, expected {tag}")
        want = tuple(dims[d] if type(d) is str else d for d in shape)
        if arrays[name].shape != want:
            raise ValidationError("bad_shape", f"'{name}' has shape {arrays[name].shape}, expected {want}")
    return dims


@functools.lru_cache(maxsize=64)
def _fields_of(spec: SegmentSpec) -> dict[str, Field]:
    return spec.fields()


@functools.lru_cache(maxsize=64)
def _ranged(spec: SegmentSpec) -> tuple:
    """(name, (low, high)) of each field of the spec's that declares a range."""
    bounds = spec.bounds()
    return tuple((name, bounds[f.bound]) for name, f in _fields_of(spec).items() if f.bound is not None)


def _segment_dims(arrays: dict, spec: SegmentSpec, meta: dict) -> dict[str, int]:
    steps = arrays["terminated"]
    if steps.ndim != 2:
        raise ValidationError("bad_shape", f"'terminated' must be [T, B], got {steps.shape}")
    T, B = steps.shape
    if (T, B) != (meta["num_steps"], meta["num_envs"]):
        raise ValidationError("bad_shape", f"arrays have T={T}, B={B}; meta says num_steps="
                                           f"{meta['num_steps']}, num_envs={meta['num_envs']}")
    if spec.num_steps is not None and T != spec.num_steps:
        raise ValidationError("bad_shape", f"T={T}, expected {spec.num_steps}")
    if spec.max_steps is not None and T > spec.max_steps:
        raise ValidationError("bad_shape", f"T={T} > max_steps {spec.max_steps}")
    if spec.max_envs is not None and B > spec.max_envs:
        raise ValidationError("bad_shape", f"B={B} > max_envs {spec.max_envs}")
    first = lambda name: arrays[name].shape[0] if arrays[name].ndim else -1
    return {"T": T, "T1": T + 1, "B": B, "H": spec.image_size, "W": spec.image_size,
            "L": spec.instruction_len, "S": spec.state_dim, "N": spec.num_tokens,
            "R": spec.num_action_chunks, "n": first("final_index"), "E": first("ep_return"),
            "F": spec.flow_steps, "F1": spec.flow_steps + 1, "K": spec.num_action_chunks, "D": spec.action_dim}


class _Run(NamedTuple):
    """Fields whose bytes lie side by side in one frame (zero padding between), seen as one
    1-D array: `count` elements of `dtype` from `offset`."""
    names: tuple
    frame: int
    offset: int
    count: int
    dtype: np.dtype


def _runs(layout: _Layout, names) -> list[_Run]:
    """The fields `names` of a message as runs: those packed one after another form one run; a
    field in a frame of its own is a run by itself."""
    runs: list[_Run] = []
    growing = None                       # index of the run the next packed field may extend
    for name, _, dtype, _, nbytes, frame, offset in layout.entries:
        if frame != 1:
            if name in names:
                runs.append(_Run((name,), frame, offset, nbytes // dtype.itemsize, dtype))
            continue
        if name not in names:
            growing = None               # a packed field of another kind lies between
            continue
        run = runs[growing] if growing is not None else None
        if run is not None and run.dtype == dtype:
            runs[growing] = run._replace(names=run.names + (name,),
                                         count=(offset + nbytes - run.offset) // dtype.itemsize)
        else:
            growing = len(runs)
            runs.append(_Run((name,), 1, offset, nbytes // dtype.itemsize, dtype))
    return runs


def _group_checks(layout: _Layout, spec: SegmentSpec) -> list[tuple]:
    """(reason, what is wrong, test of a 1-D array, runs) for the checks that hold alike for a
    group of fields: floats finite, flags and masks 0/1, text ids in the vocabulary. An actor
    sends each group's fields side by side (`WIRE_ORDER`), so each test runs once per group."""
    vocab = spec.vocab_size
    checks = [("not_finite", "holds NaN or inf", all_finite, FINITE_FIELDS),
              ("bad_values", "must hold only 0/1", lambda a: not a.size or a.max() <= 1, BINARY_FIELDS)]
    if vocab is not None:
        # seen as uint64, a negative id is huge: one max() checks both ends
        checks.append(("bad_token", f"has ids outside [0, {vocab})",
                       lambda a: not a.size or a.view(np.uint64).max() < vocab, TEXT_FIELDS))
    return [(reason, what, test, _runs(layout, set(names))) for reason, what, test, names in checks]


def _check_segment_values(msg: Message, spec: SegmentSpec, dims: dict, group_checks: list) -> None:
    arrays = msg.arrays
    _check_counters(msg.meta, dims, spec)
    for reason, what, test, runs in group_checks:
        for run in runs:
            if not test(np.ndarray((run.count,), run.dtype, msg.buffers[run.frame], run.offset)):
                bad = next((n for n in run.names if not test(arrays[n].reshape(-1))), "padding")
                raise ValidationError(reason, f"'{bad}' {what}")
    for name, (low, high) in _ranged(spec):
        a = arrays[name]
        if a.size and (a.min() < low or a.max() > high):
            bad = float(a.min() if a.min() < low else a.max())
            raise ValidationError("out_of_range", f"'{name}' holds {bad:.3g}, outside [{low:g}, {high:g}]"
                                  + (" (a positive log-probability)" if name == "behavior_logp" and bad > 0 else ""))
    if spec.flow_steps and arrays["flow_stochastic"].size and not arrays["flow_stochastic"].any(-1).all():
        raise ValidationError("bad_values", "'flow_stochastic' has a chunk with no Gaussian step: its "
                                            "log-prob cannot be recomputed")
    if spec.vocab_size is not None and "action_tokens" in arrays and arrays["action_tokens"].size:
        low = spec.first_action_id or 0
        # shifted and seen as uint64, an id below `low` is huge: one max() checks both ends
        shifted = arrays["action_tokens"] - low if low else arrays["action_tokens"]
        if shifted.view(np.uint64).max() >= spec.vocab_size - low:
            raise ValidationError("bad_token", f"'action_tokens' has ids outside [{low}, {spec.vocab_size})")
    _check_episodes(arrays, spec)
    rewards = arrays["rewards"]
    if spec.max_abs_reward is not None and rewards.size:
        largest = max(float(rewards.max()), -float(rewards.min()))
        if largest > spec.max_abs_reward:
            raise ValidationError("bad_reward", f"'rewards' holds |r| = {largest:.3g} > {spec.max_abs_reward} "
                                                "(learner.max_abs_reward)")
    # final_index lists exactly the steps that were truncated without terminating: the learner
    # bootstraps V(final obs) there and nowhere else.
    idx, T, B = arrays["final_index"], dims["T"], dims["B"]
    if idx.size and (idx.min() < 0 or idx[:, 0].max() >= T or idx[:, 1].max() >= B):
        raise ValidationError("bad_values", f"'final_index' rows outside [0, {T}) x [0, {B})")
    cut = arrays["truncated"] > arrays["terminated"]          # truncated=1, terminated=0 (both 0/1)
    marked = np.bincount(idx[:, 0] * B + idx[:, 1], minlength=T * B) if idx.size else None
    if (marked is None and cut.any()) or (marked is not None and not np.array_equal(marked, cut.ravel())):
        raise ValidationError("bad_values", "'final_index' must list each truncated, non-terminated "
                                            "(t, b) exactly once")


def _check_counters(meta: dict, dims: dict, spec: SegmentSpec) -> None:
    """Counters a sender reports, against what its arrays can hold: T policy steps of K env steps
    in each of B envs, and at most one episode end per env and policy step (an env resets after
    the chunk it ended in). A learner sums env_steps into its budget (learner.max_env_steps): one
    absurd count would end the run."""
    T, B = dims["T"], dims["B"]
    most = T * spec.num_action_chunks * B
    if meta["env_steps"] > most:
        raise ValidationError("bad_counter", f"meta 'env_steps'={meta['env_steps']} > {most}, what T={T} "
                                             f"policy steps x K={spec.num_action_chunks} x B={B} envs hold")
    if dims["E"] > T * B:
        raise ValidationError("bad_counter", f"{dims['E']} episodes ended in T={T} steps of B={B} envs "
                                             f"(at most {T * B})")


def _check_episodes(arrays: dict, spec: SegmentSpec) -> None:
    """Stats of the episodes that ended, which the learner averages into env/*: each length in
    [1, the env's episode limit], each |return| within length x max_abs_reward (no step's reward
    exceeds it, and an episode has at most one reward per env step). One absurd episode would
    otherwise own the metric for an update."""
    lengths, returns = arrays["ep_length"], arrays["ep_return"]
    if not lengths.size:
        return
    limit = spec.max_episode_steps or MAX_EPISODE_STEPS
    if lengths.min() < 1 or lengths.max() > limit:
        bad = int(lengths.min() if lengths.min() < 1 else lengths.max())
        source = "env.max_episode_steps" if spec.max_episode_steps else "MAX_EPISODE_STEPS"
        raise ValidationError("bad_counter", f"'ep_length' holds {bad}, outside [1, {limit}] ({source})")
    if spec.max_abs_reward is not None:
        # (float32 rounds a return that sits on the bound: a hair of slack)
        most = lengths.astype(np.float64) * spec.max_abs_reward * (1 + 1e-6)
        over = np.flatnonzero(np.abs(returns.astype(np.float64)) > most)
        if over.size:
            i = over[0]
            raise ValidationError("bad_reward", f"'ep_return' holds {float(returns[i]):.3g} for an episode of "
                                                f"{int(lengths[i])} steps; at most {int(lengths[i])} x "
                                                f"{spec.max_abs_reward} (learner.max_abs_reward)")


def all_finite(a: np.ndarray) -> bool:
    """True when a float array has no NaN/inf. A float64 sum is inf/NaN iff some element is
    (float32/16 maxima cannot overflow it), and needs no temporary array."""
    if a.dtype.kind != "f" or not a.size:
        return True
    if a.size <= 1 << 16:                                    # small: the direct test is quicker
        return bool(np.isfinite(a).all())
    with np.errstate(invalid="ignore", over="ignore"):
        return bool(np.isfinite(np.add.reduce(a, axis=None, dtype=np.float64)))


# ---------------------------------------------------------------------------------- weights
def encode_weights(version: int, tensors: Mapping[str, Any], step: int | None = None) -> list:
    """Frames of a weights message; numpy arrays or torch tensors (bf16 travels as uint16 bits).
    `step`: the learner update that produced this version (for evaluators), when known."""
    for name, value in (("version", version), ("step", step)):
        if value is not None and (type(value) is not int or value < 0):
            raise ValueError(f"weights {name} must be an int >= 0, got {value!r}")
    meta = {"version": version} if step is None else {"version": version, "step": step}
    return encode(WEIGHTS, meta, tensors)


@_total
def decode_weights(frames: Sequence[Any], limits: Limits) -> tuple[int, dict[str, np.ndarray]]:
    """(version, tensors). Arrays view the frames, except bf16 ones, which become float32
    (exact; numpy has no bf16, and the receiving model casts to its own dtype anyway)."""
    return weights_of(decode(frames, limits))


@_total
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


@_total
def decode_control(frames: Sequence[Any], limits: Limits, *kinds: str) -> Message:
    """A control message of one of `kinds`, its meta checked against `CONTROL_META`."""
    return control_of(decode(frames, limits), *kinds)


@_total
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


def check_meta(meta: dict, required: Mapping[str, type]) -> None:
    """Each required key present with its type (ints: no bools, within int64; strings bounded)."""
    for key, typ in required.items():
        if key not in meta:
            raise ValidationError("bad_meta", f"meta '{key}' is missing")
        value = meta[key]
        ok = (type(value) is int and abs(value) <= INT64_MAX) if typ is int else \
            (isinstance(value, str) and len(value) <= MAX_NAME_LEN) if typ is str else \
            _is_number(value) if typ is float else isinstance(value, typ)
        if not ok:
            want = "a finite number" if typ is float else f"a {typ.__name__}"
            got = repr(value) if type(value) in (int, float) else type(value).__name__
            raise ValidationError("bad_meta", f"meta '{key}' must be {want}, got {got[:40]}")


def _is_number(v) -> bool:
    return type(v) in (int, float) and math.isfinite(v)


def total_bytes(frames: Iterable[Any]) -> int:
    return sum(_buffer(f).nbytes for f in frames)


__all__ = ["SCHEMA_VERSION", "DTYPES", "ValidationError", "Limits", "Message", "Segment", "SegmentSpec",
           "SEGMENT_FIELDS", "Field", "OBS_FIELDS", "TIME_MAJOR_FIELDS", "FINAL_FIELDS", "final_field",
           "encode", "decode", "encode_segment", "decode_segment", "encode_weights",
           "decode_weights", "weights_of", "encode_control", "decode_control", "control_of", "files_of",
           "all_finite",
           "bf16_bits_to_float32", "total_bytes"]
