"""Editing messages as they travel (common/transport/protocol.py's format), for tests that build bad ones."""

from __future__ import annotations

import msgpack


def header_of(frame) -> dict:
    """A message's header, its layout unpacked into a list of [name, dtype, shape]."""
    header = msgpack.unpackb(bytes(memoryview(frame).cast("B")) if not isinstance(frame, bytes) else frame)
    header["layout"] = msgpack.unpackb(header["layout"])
    return header


def pack_header(header: dict) -> bytes:
    """Header bytes from a header whose layout is a list, packed the way the codec packs it."""
    return msgpack.packb({**header, "layout": msgpack.packb(header["layout"])})
