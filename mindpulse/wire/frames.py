"""The relay's frames: how a rank and its node agent's relay (and a node agent and the
aggregator, over the uplink) delimit the messages on one stream. A frame is a 4-byte
big-endian length, then a msgpack map (no pickle); what the maps say (packets, a
directive, a lease) is `mindpulse.wire.protocol`'s and `mindpulse.wire.directives`'.

Reading is bounded: a body longer than its limit, or one that is not a map, raises
ValueError, and the receiver closes the connection (the sender is broken or hostile).
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack

MAX_FRAME = 8 << 20
"""Largest relay frame (a batch of packets)."""
_LEN = struct.Struct(">I")
FRAME_HEADER_BYTES = _LEN.size


def encode_frame(obj: dict[str, Any]) -> bytes:
    """A 4-byte big-endian length, then a msgpack map (no pickle)."""
    body = msgpack.packb(obj, use_bin_type=True)
    return _LEN.pack(len(body)) + body


def frame_length(header: bytes) -> int:
    return _LEN.unpack(header)[0]


class FrameReader:
    """Splits a byte stream into frame bodies as the bytes come (a socket read, an asyncio
    protocol's `data_received`): no coroutine or wait per frame. `limit` bounds a body's
    size; a longer one raises ValueError (the sender is broken or hostile: close it)."""

    __slots__ = ("buf", "limit")

    def __init__(self, limit: int = MAX_FRAME):
        self.buf = bytearray()
        self.limit = limit

    def feed(self, data: bytes, max_frames: int | None = None) -> list[bytes]:
        """The frames completed by `data` (at most `max_frames`: the rest stays buffered, to
        be read with another limit, e.g. once a hello is accepted)."""
        buf = self.buf
        buf += data
        out: list[bytes] = []
        pos, size = 0, len(buf)
        while size - pos >= FRAME_HEADER_BYTES and (max_frames is None or len(out) < max_frames):
            n = _LEN.unpack_from(buf, pos)[0]
            if n > self.limit:
                raise ValueError(f"a {n}-byte frame (the limit is {self.limit})")
            end = pos + FRAME_HEADER_BYTES + n
            if end > size:
                break
            out.append(bytes(buf[pos + FRAME_HEADER_BYTES:end]))
            pos = end
        if pos:
            del buf[:pos]
        return out


def frame_int(x: Any, default: int) -> int:
    """An integer field of a frame (a bool or anything else: `default`)."""
    return x if isinstance(x, int) and not isinstance(x, bool) else default


def frame_timeout(x: Any) -> float:
    """A wait a frame asks for, bounded: a frame cannot hold its receiver's tasks forever
    (NaN or anything not a number: 60 s)."""
    return min(max(float(x), 0.0), 3600.0) if isinstance(x, (int, float)) and x == x else 60.0


def decode_frame_body(body: bytes) -> dict[str, Any]:
    obj = msgpack.unpackb(body, raw=False, max_bin_len=MAX_FRAME, max_array_len=1 << 16, max_map_len=64,
                          max_str_len=1 << 16)
    if not isinstance(obj, dict):
        raise ValueError("frame is not a map")
    return obj
