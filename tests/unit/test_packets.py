"""Packet codec: typed, versioned, bounded; bad input is rejected with a reason, never a crash."""

from __future__ import annotations

import io
import math

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mindpulse.wire.directives import Directive
from mindpulse.wire.packet_stream import iter_stream
from mindpulse.wire.protocol import (
    MAX_PACKET_BYTES,
    SCHEMA_VERSION,
    Action,
    EventPacket,
    PacketError,
    StepPacket,
    TelemetryPacket,
    decode,
)


def test_step_round_trip_keeps_every_field():
    p = StepPacket(rank=3, step=17, epoch=2, loss=1.25, lr=1e-3, grad_norm=0.5, grad_norm_local=0.7,
                   nan_count=1, inf_count=2, step_time_s=0.11, samples=8, ts=123.5, fingerprint="abcd",
                   param_norm=9.5, decision=True, extra={"acc": 0.5})
    q = decode(p.encode())
    assert q == p


def test_nan_survives_the_wire():
    q = decode(StepPacket(rank=0, step=1, loss=float("nan"), grad_norm=float("inf")).encode())
    assert math.isnan(q.loss) and math.isinf(q.grad_norm)


def test_event_and_telemetry_round_trip():
    e = EventPacket(rank=1, kind="start", ts=1.0, pid=42, host="h")
    assert decode(e.encode()) == e
    t = TelemetryPacket(node="n0", ts=2.0, source="psutil", cards=[{"card": 0, "util": 5.0}], host={"mem": 1})
    assert decode(t.encode()) == t


@pytest.mark.parametrize(
    "obj, reason",
    [
        ({"v": 99, "t": "step", "rank": 0, "step": 1}, "version"),
        ({"t": "step", "rank": 0, "step": 1}, "version"),
        ({"v": SCHEMA_VERSION, "t": "bogus", "rank": 0}, "type"),
        ({"v": SCHEMA_VERSION, "t": "step", "rank": 0}, "malformed"),  # no step
        ({"v": SCHEMA_VERSION, "t": "step", "rank": "0", "step": 1}, "malformed"),
        ({"v": SCHEMA_VERSION, "t": "step", "rank": True, "step": 1}, "malformed"),
        ({"v": SCHEMA_VERSION, "t": "step", "rank": -1, "step": 1}, "malformed"),
        ({"v": SCHEMA_VERSION, "t": "step", "rank": 0, "step": 1, "evil": 1}, "malformed"),
        ({"v": SCHEMA_VERSION, "t": "step", "rank": 0, "step": 1, "nan_count": -5}, "malformed"),
        ({"v": SCHEMA_VERSION, "t": "step", "rank": 0, "step": 1, "extra": {"a": "x"}}, "malformed"),
        ([1, 2, 3], "malformed"),
    ],
)
def test_bad_packets_are_rejected_with_a_reason(obj, reason):
    with pytest.raises(PacketError) as err:
        decode(msgpack.packb(obj))
    assert err.value.reason == reason


def test_size_limits():
    with pytest.raises(PacketError) as err:
        decode(b"\x00" * (MAX_PACKET_BYTES + 1))
    assert err.value.reason == "too_large"
    huge_str = msgpack.packb({"v": 1, "t": "event", "rank": 0, "kind": "x" * 100_000})
    with pytest.raises(PacketError):
        decode(huge_str)
    with pytest.raises(PacketError):
        decode(b"\xc1")  # reserved byte: not msgpack
    with pytest.raises(PacketError):
        decode("a string")  # type: ignore[arg-type]


def test_no_pickle_or_ext_types():
    ext = msgpack.packb(msgpack.ExtType(5, b"\x80\x04payload"))
    with pytest.raises(PacketError):
        decode(ext)


def test_directive_round_trip_and_garbage():
    d = Directive(step=5, action=Action.STOP, reason="nan", save="best")
    assert Directive.decode(d.encode()) == d
    with pytest.raises(PacketError):
        Directive.decode(b"junk")


def test_stream_reader_stops_quietly_at_a_torn_record():
    blob = b"".join(StepPacket(rank=0, step=i).encode() for i in range(5))
    torn = blob + StepPacket(rank=0, step=5, loss=1.0).encode()[:-3]
    assert [o["step"] for o in iter_stream(io.BytesIO(torn))] == [0, 1, 2, 3, 4]


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2048))
def test_random_bytes_never_raise_anything_but_packet_error(data):
    try:
        decode(data)
    except PacketError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_mutated_packets_never_crash(data):
    raw = bytearray(StepPacket(rank=1, step=2, loss=0.5, fingerprint="ff", extra={"a": 1.0}).encode())
    for _ in range(data.draw(st.integers(1, 8))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    try:
        decode(bytes(raw))
    except PacketError:
        pass


def test_a_known_packet_shape_still_has_its_values_checked_and_builds_the_same_packet():
    """The field types of a packet shape are checked once (then looked up): a later packet
    of that shape is still refused for its values, a packet of another shape is checked
    whole, and a complete packet built without `__init__` equals one built with it."""
    from mindpulse.wire.protocol import _MAX_SHAPES, _SHAPES, from_wire

    good = StepPacket(rank=3, step=17, loss=1.25, samples=8, extra={"acc": 0.5})
    wire = msgpack.unpackb(good.encode())
    for _ in range(2):  # the second time through the known shape
        q = from_wire(dict(wire))
        assert q == good and type(q) is StepPacket and q.extra == {"acc": 0.5}
    for field, bad in (("rank", -1), ("step", 1 << 41), ("samples", -2), ("nan_count", -1)):
        with pytest.raises(PacketError, match=field if field != "step" else "out of range"):
            from_wire(dict(wire, **{field: bad}))
    with pytest.raises(PacketError, match="extra"):
        from_wire(dict(wire, extra={"acc": "x"}))
    with pytest.raises(PacketError, match="bad type str"):
        from_wire(dict(wire, loss="1.0"))  # a new shape: every field's type is checked
    with pytest.raises(PacketError, match="bad type bool"):
        from_wire(dict(wire, samples=True))
    # a packet without every field (an older rank) still gets the defaults of the rest
    short = from_wire({"v": SCHEMA_VERSION, "t": "step", "rank": 1, "step": 2})
    assert short == StepPacket(rank=1, step=2) and short.extra == {} and short.extra is not StepPacket(1, 2).extra
    # a sender making up new shapes cannot grow the cache past its bound
    for i in range(_MAX_SHAPES + 10):
        from_wire({"v": SCHEMA_VERSION, "t": "step", "rank": 1, "step": 2, **{f: 0 for f in
                   ("samples", "tokens", "nan_count", "inf_count", "monitor_errors", "epoch")[: i % 6]},
                   "extra": {f"k{i}": 1.0}, "ts": float(i) if i % 2 else i})
    assert len(_SHAPES) <= _MAX_SHAPES
