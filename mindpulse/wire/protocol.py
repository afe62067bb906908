"""What the ranks and node agents report to the aggregator: the packets (step, event,
telemetry), their wire codec, and the enums packets and answers carry (`Action`,
`EventKind`, `CheckpointKind`, `RankState`). It imports nothing else of mindpulse but the
metric registry (mindpulse/registry/metrics.py) the step packet is built from.

Around it, one job each: the aggregator's answers, `Directive` and `Lease`
(mindpulse/wire/directives.py); the relay's frames (mindpulse/wire/frames.py); the launcher → rank
settings (mindpulse/config/rank_settings.py); fault specs (mindpulse/config/fault_specs.py).

No pickle: a packet is a msgpack map with a version `v` and a type `t`. Decoding is
bounded (explicit size limits handed to msgpack) and strict (every field is type-checked);
anything else raises `PacketError`, which the aggregator counts and drops.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack

from mindpulse.common.errors import MindpulseError
from mindpulse.registry.metrics import STEP_METRICS

SCHEMA_VERSION = 1
MAX_PACKET_BYTES = 1 << 20
"""Largest accepted packet (1 MiB): room for histograms, far below anything that hurts."""
_UNPACK_LIMITS = dict(
    max_str_len=64 * 1024,
    max_bin_len=512 * 1024,
    max_array_len=65536,
    max_map_len=4096,
    max_ext_len=0,
)


class PacketError(MindpulseError, ValueError):
    """A packet that cannot be accepted; `reason` is a short category for counters."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class PacketType(str, enum.Enum):
    STEP = "step"
    EVENT = "event"
    TELEMETRY = "telemetry"


class EventKind(str, enum.Enum):
    START = "start"
    """A rank started (pid and host)."""
    END = "end"
    ERROR = "error"
    CHECKPOINT = "checkpoint"
    """Rank 0 wrote a checkpoint; `message` is JSON of the manifest entries written."""
    HEARTBEAT = "heartbeat"
    """From a thread of its own: the rank is alive, at `step`."""
    STRUCTURE = "structure"
    """The model's structure as text (rank 0, once)."""
    MONITOR_ERROR = "monitor_error"
    """An error inside the rank's monitor (training went on); the first few per rank."""
    CARD_CHECK = "card_check"
    """The rank's pre-flight card check result: `message` is JSON (matmul GFLOP/s, all-reduce
    GB/s, errors), sent after the matmul and again after the all-reduce."""
    NO_MONITOR = "no_monitor"
    """The rank trains without mindpulse's Monitor (its steps will not be reported): `message`
    says how it was seen and what to add. Sent once, at its first training step or call."""
    ADVICE = "advice"
    """Something in the rank's own setup worth changing (e.g. two ranks' `ModelCheckpoint`
    writing one directory): `message` is JSON {"kind", "callback", "directory"[, "prefix"]}."""


class CheckpointKind(str, enum.Enum):
    """Why rank 0 writes a checkpoint (one file may serve several kinds)."""

    PERIODIC = "periodic"
    BEST = "best"
    LAST = "last"


class Action(str, enum.Enum):
    """The one action enum: what a rule asks for (warn, stop, save_and_stop, rollback) and
    what a directive tells every rank to do after a step (continue, stop)."""

    CONTINUE = "continue"
    WARN = "warn"
    STOP = "stop"
    SAVE_AND_STOP = "save_and_stop"
    ROLLBACK = "rollback"
    """Every rank stops after the same step; the launch resumes from the newest valid
    checkpoint before the anomaly (skipping its batches, the learning rate lowered)."""

    @property
    def stops(self) -> bool:
        return self in (Action.STOP, Action.SAVE_AND_STOP, Action.ROLLBACK)


RULE_ACTIONS = (Action.WARN, Action.STOP, Action.SAVE_AND_STOP, Action.ROLLBACK)
"""The actions a rule may take."""


@dataclass
class Packet:
    TYPE: ClassVar[PacketType]
    # field name → allowed python types (after msgpack decoding); None allowed if listed
    SCHEMA: ClassVar[dict[str, tuple[type, ...]]]
    REQUIRED: ClassVar[tuple[str, ...]]

    def to_wire(self) -> dict[str, Any]:
        # the fields as they are (every one a plain value, list or dict): `dataclasses.asdict`
        # deep-copies each of them, ~0.4 ms a step packet on the rank's hot path
        d = {"v": SCHEMA_VERSION, "t": self.TYPE.value}
        for name in _field_names(type(self)):
            d[name] = getattr(self, name)
        return d

    def encode(self) -> bytes:
        return msgpack.packb(self.to_wire(), use_bin_type=True)


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


_NUM = (int, float)
_OPT_NUM = (int, float, type(None))


def _step_packet_class() -> type[Packet]:
    """`StepPacket`, built from the metric registry (mindpulse/registry/metrics.py): one field per
    `StepMetric`, in its order, with its default; the wire schema from each metric's type."""
    fields: list[tuple[Any, ...]] = []
    schema: dict[str, tuple[type, ...]] = {}
    for m in STEP_METRICS:
        allowed: tuple[type, ...] = _NUM if m.type is float else (m.type,)
        if m.optional:
            allowed += (type(None),)
        schema[m.name] = allowed
        # annotations as strings, as in every other dataclass here (`from __future__ import annotations`)
        hint = m.type.__name__ + (" | None" if m.optional else "")
        if m.required:
            fields.append((m.name, hint))
        elif m.type is dict:
            fields.append((m.name, "dict[str, Any]", field(default_factory=dict)))
        else:
            fields.append((m.name, hint, m.default))
    doc = ("One rank's report of one finished optimizer step (steps count from 1). Its fields are "
           "the step metrics of mindpulse/registry/metrics.py: " + ", ".join(m.name for m in STEP_METRICS) + ".")
    return dataclasses.make_dataclass(
        "StepPacket", fields, bases=(Packet,),
        namespace={"TYPE": PacketType.STEP, "SCHEMA": schema, "__doc__": doc, "__module__": __name__,
                   "REQUIRED": tuple(m.name for m in STEP_METRICS if m.required)})


StepPacket = _step_packet_class()
_COUNTS = tuple(m.name for m in STEP_METRICS if m.type is int and not m.required)
"""A step packet's counts: never negative."""


@dataclass
class EventPacket(Packet):
    """Life-cycle events of a rank: start (with pid and host), end, error."""

    TYPE: ClassVar[PacketType] = PacketType.EVENT
    rank: int
    kind: str
    ts: float = 0.0
    step: int = 0
    pid: int = 0
    host: str = ""
    message: str = ""
    state: str = ""
    """A heartbeat's `RankState` value (empty: between steps, or not a heartbeat)."""
    state_step: int = 0
    """A heartbeat's step of `state`: the step the loop is inside, or the one it saves or
    evaluates after."""

    SCHEMA: ClassVar[dict[str, tuple[type, ...]]] = {
        "rank": (int,),
        "kind": (str,),
        "ts": _NUM,
        "step": (int,),
        "pid": (int,),
        "host": (str,),
        "message": (str,),
        "state": (str,),
        "state_step": (int,),
    }
    REQUIRED: ClassVar[tuple[str, ...]] = ("rank", "kind")

    @property
    def rank_state(self) -> RankState:
        """A heartbeat's state (an unknown value reads as between steps)."""
        try:
            return RankState(self.state)
        except ValueError:
            return RankState.IDLE


@dataclass
class TelemetryPacket(Packet):
    """One node's sample of its cards (and host): a list of card records."""

    TYPE: ClassVar[PacketType] = PacketType.TELEMETRY
    node: str
    ts: float = 0.0
    source: str = ""
    cards: list[dict[str, Any]] = field(default_factory=list)
    host: dict[str, Any] = field(default_factory=dict)

    SCHEMA: ClassVar[dict[str, tuple[type, ...]]] = {
        "node": (str,),
        "ts": _NUM,
        "source": (str,),
        "cards": (list,),
        "host": (dict,),
    }
    REQUIRED: ClassVar[tuple[str, ...]] = ("node",)


PACKET_CLASSES: dict[str, type[Packet]] = {
    PacketType.STEP.value: StepPacket,
    PacketType.EVENT.value: EventPacket,
    PacketType.TELEMETRY.value: TelemetryPacket,
}

_MAX_RANK = 1 << 20
_MAX_STEP = 1 << 40


_CARD_NUMBERS = frozenset({"util_pct", "memory_used_mb", "memory_total_mb", "power_w", "temp_c"})
_CARD_TEXTS = frozenset({"node", "name", "health", "source"})
_SCALARS = (type(None), bool, int, float, str)


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_card(card: Any) -> None:
    """A telemetry card record: the numbers are numbers, ids are ids, the rest is plain."""
    if not isinstance(card, dict):
        raise PacketError("malformed", "a telemetry card is not a map")
    for k, v in card.items():
        if not isinstance(k, str):
            raise PacketError("malformed", "a telemetry card key is not a string")
        if k in _CARD_NUMBERS:
            ok = v is None or _is_num(v)
        elif k in ("card", "chip"):
            ok = v is None or (isinstance(v, (int, str)) and not isinstance(v, bool))
        elif k == "ranks":
            ok = isinstance(v, list) and all(isinstance(r, int) and not isinstance(r, bool) for r in v)
        elif k in _CARD_TEXTS:
            ok = v is None or isinstance(v, str)
        else:
            ok = isinstance(v, _SCALARS)
        if not ok:
            raise PacketError("malformed", f"telemetry card field {k!r} has bad type {type(v).__name__}")


_CARD_SHAPES: set[tuple[Any, ...]] = set()
"""Card record shapes (field names in order, their value types) that passed `_check_card`: a
node's sampler makes the same shape sample after sample, so a card whose shape passed before
needs only its rank list looked at (the one field whose type does not say it all). Bounded as
`_SHAPES`."""
_PROCESS_SHAPES: set[tuple[Any, ...]] = set()
"""The same for the host's process entries."""


def _check_cards(cards: list[Any]) -> None:
    """Every card record of a sample: a shape seen before costs one lookup, not a check per
    field (docs/architecture.md, "Where the aggregator's time goes at 32,768 ranks")."""
    for card in cards:
        if type(card) is dict:
            shape = (tuple(card), tuple(map(type, card.values())))
            if shape in _CARD_SHAPES:
                ranks = card.get("ranks")
                if ranks is None or all(type(r) is int for r in ranks):
                    continue
            else:
                _check_card(card)
                if len(_CARD_SHAPES) < _MAX_SHAPES:
                    _CARD_SHAPES.add(shape)
                continue
        _check_card(card)


def _check_host(host: Any) -> None:
    for k, v in host.items():
        if k == "processes":
            if not isinstance(v, list):
                raise PacketError("malformed", "telemetry host processes are not a list of plain maps")
            for p in v:
                if type(p) is dict:
                    shape = tuple(map(type, p.values()))
                    if shape in _PROCESS_SHAPES:
                        continue
                    if all(isinstance(x, _SCALARS) for x in p.values()):
                        if len(_PROCESS_SHAPES) < _MAX_SHAPES:
                            _PROCESS_SHAPES.add(shape)
                        continue
                raise PacketError("malformed", "telemetry host processes are not a list of plain maps")
        elif not isinstance(k, str) or not (isinstance(v, _SCALARS) or (
                isinstance(v, list) and all(isinstance(x, _SCALARS) for x in v))):
            raise PacketError("malformed", f"telemetry host field {k!r} is not a plain value or list")


@functools.cache
def _exact_types(cls: type[Packet]) -> dict[str, frozenset[type]]:
    """Field → the exact types a decoded value may have (bool only where listed)."""
    return {k: frozenset(allowed) for k, allowed in cls.SCHEMA.items()}


def _field_error(cls: type[Packet], t: Any, key: Any, value: Any) -> None:
    """Why a field fails its schema (raises PacketError; returns when it is in fact allowed)."""
    allowed = cls.SCHEMA.get(key) if isinstance(key, str) else None
    if allowed is None:
        raise PacketError("malformed", f"unknown field {key!r} in a {t} packet")
    if isinstance(value, bool) and bool not in allowed:
        raise PacketError("malformed", f"field {key!r} has bad type bool")
    if not isinstance(value, allowed):
        raise PacketError("malformed", f"field {key!r} has bad type {type(value).__name__}")


_SHAPES: dict[tuple[Any, ...], bool] = {}
"""Packet shapes whose fields passed the schema: (type, field names in order, their value
types) -> whether the packet has every field of its class. Whether a field's type is
allowed, and whether the required fields are there, follow from the shape alone, and a
rank sends the same shape step after step: checking the shape once and looking it up
after that costs one hash instead of a Python loop over ~28 fields, for every packet of
every rank, on the node."""
_MAX_SHAPES = 256
"""Shapes kept; past that, new shapes are checked field by field every time (bounded:
a broken or hostile sender cannot grow the node's memory)."""


def from_wire(obj: Any) -> Packet:
    """Validate a decoded msgpack object and build its packet; raises PacketError."""
    if not isinstance(obj, dict):
        raise PacketError("malformed", f"expected a map, got {type(obj).__name__}")
    v = obj.get("v")
    if v != SCHEMA_VERSION:
        raise PacketError("version", f"unsupported schema version {v!r} (this aggregator reads {SCHEMA_VERSION})")
    t = obj.get("t")
    cls = PACKET_CLASSES.get(t) if isinstance(t, str) else None
    if cls is None:
        raise PacketError("type", f"unknown packet type {t!r}")
    shape = (t, tuple(obj), tuple(map(type, obj.values())))
    complete = _SHAPES.get(shape)
    if complete is None:
        complete = _check_fields(cls, t, obj)
        if len(_SHAPES) < _MAX_SHAPES:
            _SHAPES[shape] = complete
    kwargs = obj.copy()
    del kwargs["v"], kwargs["t"]
    if "rank" in kwargs and not (0 <= kwargs["rank"] < _MAX_RANK):
        raise PacketError("malformed", f"rank {kwargs['rank']} out of range")
    if "step" in kwargs and not (0 <= kwargs["step"] < _MAX_STEP):
        raise PacketError("malformed", f"step {kwargs['step']} out of range")
    if cls is TelemetryPacket:
        _check_cards(kwargs.get("cards", []))
        _check_host(kwargs.get("host", {}))
    if cls is StepPacket:
        extra = kwargs.get("extra", {})
        if extra and (len(extra) > 64 or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(x, _NUM) and not isinstance(x, bool)
            for k, x in extra.items()
        )):
            raise PacketError("malformed", "field 'extra' must map up to 64 short names to numbers")
        for key in _COUNTS:
            if kwargs.get(key, 0) < 0:
                raise PacketError("malformed", f"field {key!r} is negative")
    if complete:
        # every field is there and of its type: set them as `__init__` would, without its
        # keyword matching (~2 us a packet); a dataclass's __init__ does nothing more here
        pkt = cls.__new__(cls)
        pkt.__dict__.update(kwargs)
        return pkt
    return cls(**kwargs)


def _check_fields(cls: type[Packet], t: str, obj: dict[Any, Any]) -> bool:
    """The schema's type check of every field and the required ones' presence (raises
    PacketError); True when the packet has every field of `cls`."""
    exact = _exact_types(cls)
    seen = 0
    for key, value in obj.items():
        # msgpack gives exact built-in types: one set lookup per field; anything else
        # takes the slow, explaining path
        if type(value) not in exact.get(key, ()):  # type: ignore[call-overload]
            if key in ("v", "t"):
                continue
            _field_error(cls, t, key, value)
        seen += 1
    for key in cls.REQUIRED:
        if key not in obj:
            raise PacketError("malformed", f"{t} packet misses field {key!r}")
    return seen == len(cls.SCHEMA)  # unknown fields raised above: these are all of them


def decode(data: bytes) -> Packet:
    """bytes → Packet; raises PacketError for anything that is not a valid packet."""
    return decode_wire(data)[0]


def decode_wire(data: bytes) -> tuple[Packet, dict[str, Any]]:
    """bytes → (Packet, its validated wire map): a node agent keeps the map to pass on."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise PacketError("malformed", f"expected bytes, got {type(data).__name__}")
    if len(data) > MAX_PACKET_BYTES:
        raise PacketError("too_large", f"{len(data)} bytes > {MAX_PACKET_BYTES}")
    try:
        obj = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True, **_UNPACK_LIMITS)
    except Exception as exc:  # msgpack raises many types (ValueError, ExtraData, UnicodeDecodeError...)
        raise PacketError("malformed", f"not msgpack ({type(exc).__name__}: {exc})") from None
    return from_wire(obj), obj


class RankState(str, enum.Enum):
    """What a rank's loop is doing, as its heartbeat says (with the step it is about)."""

    IDLE = ""
    """Between steps (or before the first)."""
    IN_STEP = "in_step"
    """Inside a step (it began, its faults let it start, it has not ended): a rank blocked
    before the step the others are in is told from those waiting inside its collective."""
    SAVING = "saving"
    """Writing a checkpoint after a step: time the hang clock does not count."""
    EVALUATING = "evaluating"
    """Evaluating after a step: time the hang clock does not count."""

    @property
    def busy(self) -> bool:
        return self in (RankState.SAVING, RankState.EVALUATING)


# ---- a node's heartbeats, one record per node --------------------------------------------------
HeartbeatRow = tuple[int, int, RankState, int, int]
"""(rank, step, state, state_step, pid): one rank's heartbeat as a node agent sends it up, a
row of its node's record (`NodeBatch["beats"]`, node/relay.py) instead of a packet of its own:
the aggregator takes a node's beats in one pass, with no packet to decode per rank."""

_STATES = {s.value: s for s in RankState}


def heartbeat_row(pkt: EventPacket) -> list[Any]:
    """A validated heartbeat packet as its node record's row (the fields the aggregator reads)."""
    return [pkt.rank, pkt.step, pkt.state, pkt.state_step, pkt.pid]


def heartbeat_rows(rows: Any, world_size: int) -> tuple[list[HeartbeatRow], int]:
    """A node record's rows checked, as a heartbeat packet is (ranks in the world, steps and
    pids counts, a known state): (the good ones, how many were not)."""
    if not isinstance(rows, list):
        return [], 1
    good: list[HeartbeatRow] = []
    for row in rows:
        if type(row) is list and len(row) == 5:
            rank, step, state, state_step, pid = row
            if (type(rank) is int and 0 <= rank < world_size and type(step) is int and 0 <= step < _MAX_STEP
                    and type(state_step) is int and type(pid) is int and type(state) is str):
                good.append((rank, step, _STATES.get(state, RankState.IDLE), state_step, pid))
                continue
    return good, len(rows) - len(good)


__all__ = [
    "HeartbeatRow",
    "heartbeat_row",
    "heartbeat_rows",
    "SCHEMA_VERSION",
    "MAX_PACKET_BYTES",
    "PacketError",
    "PacketType",
    "EventKind",
    "CheckpointKind",
    "Action",
    "RULE_ACTIONS",
    "RankState",
    "Packet",
    "StepPacket",
    "EventPacket",
    "TelemetryPacket",
    "PACKET_CLASSES",
    "from_wire",
    "decode",
    "decode_wire",
]
