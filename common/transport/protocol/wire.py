"""The wire codec of every message: one msgpack header frame, then the arrays' raw bytes.

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

Message kinds: "segment" (actor -> learner rank: segments.py), "weights" (learner -> actor:
version + named tensors) and the small control messages (messages.py). No sockets here:
common/transport/__init__.py moves the frames.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

import msgpack
import numpy as np

SCHEMA_VERSION = 3      # 3: segments carry ep_task
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

SEGMENT, WEIGHTS = "segment", "weights"


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
    layout: "Layout | None" = None                          # where each array lies (decode's)
    buffers: list = field(default_factory=list)              # the frames, as memoryviews


# ------------------------------------------------------------------------------ generic codec
def total(decoder):
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


@total
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


class Layout(NamedTuple):
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
_LAYOUTS: dict[bytes, Layout] = {}
_MAX_CACHED_LAYOUTS, _MAX_CACHED_KEY = 256, 8192


def _layout(raw, limits: Limits) -> Layout:
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


def _parse_layout(raw: bytes, limits: Limits) -> Layout:
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
    return Layout(tuple(entries[c[0]] for c in checked), tuple(frame_bytes), tuple(frame_names), tags, None)


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


def expect_kind(msg: Message, *kinds: str) -> None:
    if msg.kind not in kinds:
        raise ValidationError("wrong_type", f"message type {msg.kind[:40]!r}, expected one of {list(kinds)}")


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


def all_finite(a: np.ndarray) -> bool:
    """True when a float array has no NaN/inf. A float64 sum is inf/NaN iff some element is
    (float32/16 maxima cannot overflow it), and needs no temporary array."""
    if a.dtype.kind != "f" or not a.size:
        return True
    if a.size <= 1 << 16:                                    # small: the direct test is quicker
        return bool(np.isfinite(a).all())
    with np.errstate(invalid="ignore", over="ignore"):
        return bool(np.isfinite(np.add.reduce(a, axis=None, dtype=np.float64)))
