"""What the four places code runs say to each other, in one module that imports nothing
else of mindpulse: packets (rank/node → aggregator), directives (aggregator → rank), the
relay's frames (rank ↔ node agent), the settings a rank receives from the launcher, and
the enums all of them share (`Action`, `EventKind`, `CheckpointKind`).

No pickle: a packet is a msgpack map with a version `v` and a type `t`. Decoding is
bounded (explicit size limits handed to msgpack) and strict (every field is type-checked);
anything else raises `PacketError`, which the aggregator counts and drops.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack

from mindpulse.errors import MindpulseError
from mindpulse.metrics import STEP_METRICS

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


def _f(x: Any) -> float | None:
    return None if x is None else float(x)


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
    """`StepPacket`, built from the metric registry (mindpulse/metrics.py): one field per
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
           "the step metrics of mindpulse/metrics.py: " + ", ".join(m.name for m in STEP_METRICS) + ".")
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


def _check_host(host: Any) -> None:
    for k, v in host.items():
        if k == "processes":
            if not (isinstance(v, list) and all(isinstance(p, dict) and all(isinstance(x, _SCALARS)
                                                                             for x in p.values()) for p in v)):
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
        for card in kwargs.get("cards", []):
            _check_card(card)
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


SAVE_ORDER = (CheckpointKind.PERIODIC, CheckpointKind.BEST, CheckpointKind.LAST)
"""The order a directive's checkpoint kinds are listed in."""


@dataclass(frozen=True, init=False)
class Directive:
    """The aggregator's answer at a decision point (built once, never changed)."""

    step: int
    action: Action = Action.CONTINUE
    reason: str = ""
    saves: frozenset[CheckpointKind] = frozenset()
    """Non-empty: rank 0 saves a checkpoint after the step, for each of these reasons (one
    file may serve several). On the wire: a list of `CheckpointKind` values."""
    metric: float | None = None
    """The reduced metric of the step (recorded with a `best` checkpoint)."""
    metric_name: str = ""

    def __init__(self, step: int, action: Action = Action.CONTINUE, reason: str = "",
                 saves: Iterable[CheckpointKind | str] = (), metric: float | None = None, metric_name: str = "",
                 *, save: str = ""):
        """`save`: the kinds as text (`periodic,best`), the form `save` reads back; joined to `saves`."""
        kinds = {CheckpointKind(k) for k in saves} | {CheckpointKind(k) for k in save.split(",") if k}
        for name, value in (("step", step), ("action", action), ("reason", reason), ("saves", frozenset(kinds)),
                            ("metric", metric), ("metric_name", metric_name)):
            object.__setattr__(self, name, value)

    @property
    def save_kinds(self) -> list[CheckpointKind]:
        """`saves` in their fixed order (periodic, best, last)."""
        return [k for k in SAVE_ORDER if k in self.saves]

    @property
    def save(self) -> str:
        """`save_kinds` as text (`periodic,best`), for messages."""
        return ",".join(k.value for k in self.save_kinds)

    @staticmethod
    def no_directive(step: int, why: str) -> Directive:
        """What a rank goes on with when no directive came (it continues and says why)."""
        return Directive(step=step, action=Action.CONTINUE, reason=f"no directive: {why}")

    def encode(self) -> bytes:
        return msgpack.packb(
            {"v": SCHEMA_VERSION, "t": "directive", "step": self.step, "action": self.action.value,
             "reason": self.reason, "save": [k.value for k in self.save_kinds], "metric": self.metric,
             "metric_name": self.metric_name},
            use_bin_type=True,
        )

    @staticmethod
    def decode(data: bytes) -> Directive:
        try:
            obj = msgpack.unpackb(bytes(data), raw=False, **_UNPACK_LIMITS)
            if obj.get("v") != SCHEMA_VERSION or obj.get("t") != "directive":
                raise PacketError("version", f"not a directive of schema {SCHEMA_VERSION}")
            m = obj.get("metric")
            save = obj.get("save") or []
            if not isinstance(save, list):
                raise PacketError("malformed", f"bad directive (save {save!r} is not a list of checkpoint kinds)")
            return Directive(step=int(obj["step"]), action=Action(obj["action"]),
                             reason=str(obj.get("reason", "")),
                             saves=frozenset(CheckpointKind(k) for k in save if k in _CKPT_KINDS),
                             metric=float(m) if isinstance(m, (int, float)) else None,
                             metric_name=str(obj.get("metric_name", "")))
        except PacketError:
            raise
        except Exception as exc:
            raise PacketError("malformed", f"bad directive ({exc})") from None


__all__ = [
    "SCHEMA_VERSION",
    "MAX_PACKET_BYTES",
    "PacketError",
    "PacketType",
    "EventKind",
    "Packet",
    "StepPacket",
    "EventPacket",
    "TelemetryPacket",
    "decode",
    "decode_wire",
    "Action",
    "RULE_ACTIONS",
    "Directive",
    "RankState",
    "Lease",
    "from_wire",
    "CheckpointKind",
    "encode_frame",
    "decode_frame_body",
    "frame_int",
    "frame_timeout",
    "RankSettings",
    "Schedule",
]


@dataclass
class Lease:
    """The aggregator's progress as every rank sees it, pushed asynchronously: a rank starts
    step k only once `reduced_through` >= k - 1 - monitor.max_lag_steps, and stops after
    `stop_after` (the same step on every rank: the stop is decided when a step is reduced,
    `max_lag_steps` steps before it takes effect)."""

    reduced_through: int = -1
    stop_after: int = -1
    """-1: no stop decided."""
    reason: str = ""
    save_last: bool = False
    """Rank 0 writes a `last` checkpoint after `stop_after` (interrupts, save_and_stop rules)."""

    def allows(self, step: int, lag: int) -> bool:
        """Whether a rank may start `step` (steps count from 1)."""
        return self.reduced_through >= step - 1 - lag or self.stopping

    def covers(self, need: int) -> bool:
        """Step `need` is reduced, or a stop is decided (a waiting rank goes on)."""
        return self.reduced_through >= need or self.stopping

    @property
    def stopping(self) -> bool:
        return self.stop_after >= 0

    def encode(self) -> bytes:
        return msgpack.packb({"v": SCHEMA_VERSION, "t": "lease", "reduced_through": self.reduced_through,
                              "stop_after": self.stop_after, "reason": self.reason, "save_last": self.save_last},
                             use_bin_type=True)

    @staticmethod
    def decode(data: bytes) -> Lease:
        try:
            obj = msgpack.unpackb(bytes(data), raw=False, **_UNPACK_LIMITS)
            if not isinstance(obj, dict) or obj.get("v") != SCHEMA_VERSION or obj.get("t") != "lease":
                raise PacketError("version", f"not a lease of schema {SCHEMA_VERSION}")
            return Lease(reduced_through=int(obj["reduced_through"]), stop_after=int(obj["stop_after"]),
                         reason=str(obj.get("reason", "")), save_last=bool(obj.get("save_last", False)))
        except PacketError:
            raise
        except Exception as exc:
            raise PacketError("malformed", f"bad lease ({exc})") from None


_CKPT_KINDS = frozenset(k.value for k in CheckpointKind)


# ---- relay frames (rank ↔ its node agent) ------------------------------------------------
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


# ---- the launcher → rank contract ----------------------------------------------------------
SETTINGS_ENV = "MINDPULSE_SETTINGS"
"""The one variable a rank reads: the path of the run's `job.json` (a `RankSettings`)."""
NODE_RANK_ENV = "MINDPULSE_NODE_RANK"
"""msrun backend only: which node's msrun started this process (its scheduler runs on node 0)."""


@dataclass(frozen=True)
class Schedule:
    """The run's special steps, computed once by the launcher from the config. The rank
    asks it which steps are decision points; the aggregator which are best candidates."""

    total_steps: int
    """train.steps (0: the recipe's epochs decide)."""
    collect_freq: int
    """Fingerprint and weight statistics every N steps (and step 0)."""
    max_lag_steps: int
    """A rank starts step k once step k-1-max_lag_steps is reduced (the lease)."""
    save_every: int
    """Periodic checkpoint every N steps (0: none)."""
    best_every: int
    """A new best is considered every N steps."""
    save_best: bool
    """Whether a best checkpoint is kept at all (checkpoint.save_best_ckpt)."""
    eval_every: int
    """Evaluation every N steps (0: off)."""
    eval_per_epoch: bool
    """Evaluation at the end of every epoch too."""

    def is_collect(self, step: int) -> bool:
        return step % self.collect_freq == 0

    def eval_due(self, step: int, epoch_steps: int | None = None) -> bool:
        if self.eval_every and step % self.eval_every == 0:
            return True
        return bool(self.eval_per_epoch and epoch_steps and step % epoch_steps == 0)

    def is_candidate(self, step: int, evaluates: bool = False, epoch_steps: int | None = None) -> bool:
        """Whether rank 0 waits for the directive of `step` before the next one: a checkpoint
        may be asked for (periodic, best candidate, evaluation, the last step), and it must
        hold exactly that step's weights. No other rank ever waits for a directive."""
        return bool(step > 0 and (
            self.is_save_step(step)
            or (self.save_best and step % self.best_every == 0)
            or (evaluates and self.eval_due(step, epoch_steps))
            or (self.total_steps and step >= self.total_steps)
        ))

    def lease_need(self, step: int) -> int:
        """The step that must be reduced before a rank starts `step` + 1."""
        return step - self.max_lag_steps

    def is_save_step(self, step: int) -> bool:
        return periodic_due(step, self.save_every)


def periodic_due(step: int, every: int) -> bool:
    """Whether `step` is a periodic checkpoint step for `save_checkpoint_steps` = `every`
    (0: none): the one rule for the rank (its `Schedule`: rank 0 waits for the verdict)
    and the aggregator (its config: it asks for the save)."""
    return bool(every and step > 0 and step % every == 0)



@dataclass(frozen=True)
class MonitorSettings:
    decision_timeout_s: float
    """How long a rank waits for a directive before it goes on without one."""
    heartbeat_s: float
    """Interval of the rank's heartbeat thread."""
    weight_stats: bool
    histogram_regex: str
    """Empty: the monitor's default layers."""


@dataclass(frozen=True)
class CheckpointSettings:
    keep_periodic: int
    keep_best: int
    format: str


@dataclass(frozen=True)
class ProfileSettings:
    steps: tuple[int, ...]
    """(START, END) or empty (off)."""
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class ResumePoint:
    path: str
    """The checkpoint to load ("" after a rollback to the start: fresh weights)."""
    step: int
    epoch: int = 0
    kind: str = ""
    skip_batches: int = 0
    """Batches the data stream skips past (rollbacks with `skip_batches`): step k trains on
    the batch of step k + skip_batches."""
    lr_factor: float = 1.0
    """The learning rate is multiplied by this for steps step+1 .. lr_until_step (a rollback)."""
    lr_until_step: int = 0

    def scaled_lrs(self, lrs: list[float]) -> list[float]:
        """A per-step learning-rate list (entry i for step i+1) with the rollback's factor
        applied to steps step+1 .. lr_until_step. The recipe builds its optimizer from it; a
        script with its own schedule can do the same (`load_settings().resume`)."""
        out = list(lrs)
        for i in range(max(0, self.step), min(len(out), self.lr_until_step)):
            out[i] *= self.lr_factor
        return out


@dataclass(frozen=True)
class RankSettings:
    """Everything a rank needs from the launcher, written once per attempt into
    `RUN_DIR/job.json` and handed over by one path (`MINDPULSE_SETTINGS`); ranks read
    nothing else of mindpulse's (MindSpore's own cluster variables aside)."""

    run_id: str
    run_dir: str
    attempt: int
    namespace: str
    aggregator: str
    """The aggregator actor's name (ranks talk to it through their node's relay)."""
    ray_address: str
    world_size: int
    ranks_per_node: int
    device_target: str
    """MindSpore's device_target: CPU, Ascend or GPU."""
    relays: dict[int, str]
    """Node → host:port of its agent's packet relay (empty: ranks call the aggregator)."""
    batch_size: int
    schedule: Schedule
    monitor: MonitorSettings
    checkpoint: CheckpointSettings
    profile: ProfileSettings
    faults: tuple[str, ...]
    """KIND@RANK:STEP specs armed in this attempt."""
    resume: ResumePoint | None
    config: dict[str, Any]
    """The resolved run config (plain data: the recipe reads it with `mindpulse.config`)."""
    relay_token: str = ""
    """This attempt's secret: a rank's first frame to its relay carries it, and the relay
    drops connections without it (job.json is private to the run's user)."""
    task: str = "train"
    """What the ranks run: `train` (the recipe or the job's script) or `card_check` (the
    pre-flight card check only, then exit)."""

    def node_of(self, rank: int) -> int:
        return rank // max(1, self.ranks_per_node)

    def relay_of(self, rank: int) -> str:
        return self.relays.get(self.node_of(rank), "")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["relays"] = {str(k): v for k, v in self.relays.items()}
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=_json_enum) + "\n"

    @staticmethod
    def from_dict(d: dict[str, Any]) -> RankSettings:
        try:
            return RankSettings(
                **{k: v for k, v in d.items() if k not in _NESTED},
                relays={int(k): str(v) for k, v in (d.get("relays") or {}).items()},
                schedule=Schedule(**d["schedule"]),
                monitor=MonitorSettings(**d["monitor"]),
                checkpoint=CheckpointSettings(**d["checkpoint"]),
                profile=ProfileSettings(steps=tuple(d["profile"]["steps"]), ranks=tuple(d["profile"]["ranks"])),
                faults=tuple(d.get("faults") or ()),
                resume=ResumePoint(**d["resume"]) if d.get("resume") else None,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a mindpulse job.json of this version ({type(exc).__name__}: {exc})") from None

    @staticmethod
    def from_json(text: str) -> RankSettings:
        return RankSettings.from_dict(json.loads(text))


_NESTED = frozenset({"relays", "schedule", "monitor", "checkpoint", "profile", "faults", "resume"})


def _json_enum(x: Any) -> Any:
    if isinstance(x, enum.Enum):
        return x.value
    raise TypeError(f"{type(x).__name__} is not JSON")


# ---- faults (a rehearsal, parsed by the config and armed in the rank) ---------------------
class FaultKind(str, enum.Enum):
    NAN_LOSS = "nan_loss"
    NAN_GRAD = "nan_grad"
    INF_GRAD = "inf_grad"
    LOSS_SPIKE = "loss_spike"
    GRAD_SPIKE = "grad_spike"
    CRASH = "crash"
    HANG = "hang"
    SLOW = "slow"
    DESYNC = "desync"
    SLOW_SAVE = "slow_save"
    """Rank 0's checkpoint write at the step takes longer (`slow_save@0:STEP`): rehearses
    `checkpoint.save_grace_s`, a rank failing while rank 0 writes."""
    SLOW_CARD = "slow_card"
    """The pre-flight card check's matmul of the rank repeats its work (`slow_card@RANK`:
    no step, the check runs before training)."""


CHECK_FAULTS = frozenset({FaultKind.SLOW_CARD})
"""Faults of the pre-flight card check: written `KIND@RANK`, without a step."""
_FAULT_SPEC = re.compile(r"^\s*([a-z_]+)@(\d+)(?::(\d+))?\s*$")


@dataclass(frozen=True)
class Fault:
    kind: FaultKind
    rank: int
    step: int

    def __str__(self) -> str:
        if self.kind in CHECK_FAULTS:
            return f"{self.kind.value}@{self.rank}"
        return f"{self.kind.value}@{self.rank}:{self.step}"


def parse_fault(spec: str, world_size: int | None = None) -> Fault:
    """`nan_grad@1:5` (or `slow_card@1`: the card check's faults have no step) → Fault;
    ValueError saying what is allowed otherwise."""
    m = _FAULT_SPEC.match(spec or "")
    if not m:
        raise ValueError(f"{spec!r} is not a fault; use KIND@RANK:STEP, e.g. nan_grad@1:5 (slow_card@RANK)")
    kind, rank, step = m.group(1), int(m.group(2)), m.group(3)
    try:
        fk = FaultKind(kind)
    except ValueError:
        raise ValueError(f"{spec!r}: unknown kind {kind!r}; use one of "
                         + ", ".join(k.value for k in FaultKind)) from None
    if fk in CHECK_FAULTS and step is not None:
        raise ValueError(f"{spec!r}: {kind} acts in the pre-flight card check, before any step; "
                         f"write {kind}@{rank}")
    if fk not in CHECK_FAULTS and step is None:
        raise ValueError(f"{spec!r}: {kind} needs the step it acts at; use {kind}@{rank}:STEP")
    step = int(step or 0)
    if fk is FaultKind.SLOW_SAVE and rank != 0:
        raise ValueError(f"{spec!r}: only rank 0 writes checkpoints; use slow_save@0:{step}")
    if world_size is not None and rank >= world_size:
        raise ValueError(f"{spec!r}: rank {rank} does not exist in a world of {world_size} ranks")
    return Fault(fk, rank, step)
