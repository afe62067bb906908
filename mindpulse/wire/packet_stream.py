"""Reading an append-only stream of mindpulse's msgpack records (`metrics.msgpack` and its
segments, a file still being written) record by record, past damaged bytes.

The aggregator's metrics store and the offline views read run directories through it; the
records themselves (their schema, their checks) are `mindpulse.wire.protocol`'s.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgpack

# the decoding limits every packet is read with (one definition, in the protocol)
from mindpulse.wire.protocol import _UNPACK_LIMITS, MAX_PACKET_BYTES, PACKET_CLASSES, SCHEMA_VERSION


def iter_stream(data_or_file: Any, stats: dict[str, int] | None = None, final: bool = True) -> Iterator[dict[Any, Any]]:
    """Yield decoded wire objects of an append-only stream (e.g. metrics.msgpack), resynchronising
    past damaged bytes instead of stopping at them.

    msgpack has no framing, so damage (a flipped byte, a record torn by a crash that a restarted
    writer appended after, a stretch of zeros) is recognised by what follows it: every record
    mindpulse writes is a map whose first keys are `v` (the schema version) and `t` (its type).
    After bytes that do not decode, or decode to something that is not a whole record, or hide a
    record start inside them (a torn record swallowing the next one), decoding goes on at the
    next position where such a map decodes; the bytes in between are skipped and counted. A map
    that is not a valid record but hides no record start (an unknown field, another schema
    version) is yielded as it is, for the caller to reject and count.

    `stats`, updated in place when given: `skipped_bytes` and `skipped_stretches` (damaged bytes
    passed over), `torn_bytes` (an incomplete record at the very end: a crash mid-write; counted
    only with `final`), `consumed` (bytes of this input accounted for, once iterated to the end).
    With `final=False` the input is a file still being written: an incomplete record at its end
    is left unconsumed (`consumed` stops before it) for the caller to feed again with the bytes
    that follow.
    """
    st = stats if stats is not None else {}
    for key in ("skipped_bytes", "skipped_stretches", "torn_bytes"):
        st.setdefault(key, 0)
    st["consumed"] = 0
    sync = b"\xa1v" + msgpack.packb(SCHEMA_VERSION) + b"\xa1t"  # the first two keys of every record
    too_big = 2 * MAX_PACKET_BYTES  # no record is longer: an object still open past this is damage
    chunk_size = 1 << 16
    read = getattr(data_or_file, "read", None)
    if read is None:
        whole_input = memoryview(data_or_file)
        chunks = (whole_input[i:i + chunk_size] for i in range(0, len(whole_input), chunk_size))
    else:
        chunks = iter(lambda: read(chunk_size), b"")

    def unpacker() -> msgpack.Unpacker:
        return msgpack.Unpacker(raw=False, strict_map_key=True, max_buffer_size=4 * too_big, **_UNPACK_LIMITS)

    def is_record(obj: Any) -> bool:
        """A record as mindpulse writes it: this schema version, a type, a packet's known fields."""
        if not isinstance(obj, dict) or obj.get("v") != SCHEMA_VERSION or not isinstance(obj.get("t"), str):
            return False
        cls = PACKET_CLASSES.get(obj["t"])
        if cls is None:
            return True  # mindpulse's other records (attempt markers, reduced steps, ...)
        return all(k in cls.SCHEMA or k in ("v", "t") for k in obj) and all(k in obj for k in cls.REQUIRED)

    buf = bytearray()  # the bytes from `base` on (everything at and after `pos` that was read)
    base = 0
    pos = 0  # stream offset of the next record
    eof = False
    u = unpacker()
    ustart = 0  # stream offset where `u`'s input starts
    last_skip_end = -1

    def skip(a: int, b: int) -> None:
        nonlocal last_skip_end
        if b > a:
            st["skipped_bytes"] += b - a
            if a != last_skip_end:
                st["skipped_stretches"] += 1
            last_skip_end = b

    def probe(h: int) -> str | None:
        """'ok': a whole record starts at buf[h]; 'wait': one may, its end not read yet."""
        piece = buf[h:h + too_big]
        pu = unpacker()
        pu.feed(piece)
        try:
            obj = next(pu)
        except StopIteration:
            return "wait" if len(piece) < too_big else None
        except Exception:  # any undecodable bytes here only mean no record starts at h
            return None
        return "ok" if is_record(obj) else None

    def find(frm: int, to: int | None = None) -> tuple[int, str] | None:
        """The first record start at a stream offset in [frm, to)."""
        lo = frm - base
        hi = len(buf) if to is None else min(len(buf), to - base)
        i = lo
        while True:
            j = buf.find(sync, i, min(len(buf), hi + 5 + len(sync)))
            if j < 0:
                return None
            for h, width in ((j - 1, 1), (j - 3, 3), (j - 5, 5)):  # fixmap, map16, map32 header
                if lo <= h < hi:
                    b = buf[h]
                    if (width == 1 and 0x80 <= b <= 0x8F) or (width == 3 and b == 0xDE) or (width == 5 and b == 0xDF):
                        state = probe(h)
                        if state is not None:
                            return base + h, state
            i = j + 1

    def restart_at(off: int) -> None:
        nonlocal u, ustart, pos
        pos = ustart = off
        u = unpacker()
        if off - base < len(buf):
            u.feed(buf[off - base:])

    while True:
        try:
            obj = next(u)
        except StopIteration:
            end = base + len(buf)
            if not eof and end - pos <= too_big:
                chunk = next(chunks, None)
                if not chunk:
                    eof = True
                    continue
                if pos - base > (1 << 20):  # forget what is behind
                    del buf[:pos - base]
                    base = pos
                buf += chunk
                u.feed(chunk)
                continue
            if pos >= end:
                break  # everything read
            # an object starts at pos and does not end within the bytes there are
            found = find(pos + 1)
            if found is not None:  # a record starts after it: it was torn
                skip(pos, found[0])
                restart_at(found[0])
                continue
            if end - pos > too_big:  # longer than any record: damage
                cut = end if eof else end - 10
                skip(pos, cut)
                restart_at(cut)
                continue
            if final:
                st["torn_bytes"] += end - pos
                pos = end
            break
        except Exception:  # bytes that are no msgpack (msgpack raises several types)
            frm = pos + 1
            while True:
                found = find(frm)
                if found is not None or eof:
                    break
                chunk = next(chunks, None)
                if not chunk:
                    eof = True
                    continue
                # what was searched holds no record start: drop it but a start's first bytes
                keep = max(frm, base + len(buf) - 10)
                del buf[:keep - base]
                base = frm = keep
                buf += chunk
            if found is not None:
                skip(pos, found[0])
                restart_at(found[0])
                continue
            end = base + len(buf)
            cut = end if final else max(pos + 1, end - 10)
            skip(pos, cut)
            if cut < end:
                restart_at(cut)
                continue
            pos = end
            break
        else:
            start, end = pos, ustart + u.tell()
            at = start - base
            head = buf[at]  # past this record's own first keys, does another record start inside it?
            own = 2 if 0x80 <= head <= 0x8F else 4 if head == 0xDE else 6 if head == 0xDF else 1
            if buf.find(sync, at + own, end - base + 10) >= 0:
                found = find(start + 1, end)
                if found is not None:  # it is the remains of a torn record that swallowed the next
                    skip(start, found[0])
                    restart_at(found[0])
                    continue
            pos = end
            # a map right after damage is a piece of it (a record's nested map); elsewhere it is
            # a record of its own, valid or for the caller to reject
            if type(obj) is dict and (last_skip_end != start or is_record(obj)):
                yield obj
            else:
                skip(start, end)
    st["consumed"] = pos
