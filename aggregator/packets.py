"""The wire schema shared by ranks and the aggregator: typed, versioned msgpack packets.

No pickle: a packet is a msgpack map with a version `v` and a type `t`. Decoding is
bounded (explicit size limits handed to msgpack) and strict (every field is type-checked);
anything else raises `PacketError`, which the aggregator counts and drops.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack

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


class PacketError(ValueError):
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
    END = "end"
    ERROR = "error"
    CHECKPOINT = "checkpoint"
    """Rank 0 wrote a checkpoint; `message` is JSON of the manifest entries written."""


def _f(x: Any) -> float | None:
    return None if x is None else float(x)


@dataclass
class Packet:
    TYPE: ClassVar[PacketType]
    # field name → allowed python types (after msgpack decoding); None allowed if listed
    SCHEMA: ClassVar[dict[str, tuple[type, ...]]]
    REQUIRED: ClassVar[tuple[str, ...]]

    def to_wire(self) -> dict[str, Any]:
        d = {"v": SCHEMA_VERSION, "t": self.TYPE.value}
        d.update(dataclasses.asdict(self))
        return d

    def encode(self) -> bytes:
        return msgpack.packb(self.to_wire(), use_bin_type=True)


_NUM = (int, float)
_OPT_NUM = (int, float, type(None))


@dataclass
class StepPacket(Packet):
    """One rank's report of one finished optimizer step (steps count from 1)."""

    TYPE: ClassVar[PacketType] = PacketType.STEP
    rank: int
    step: int
    epoch: int = 0
    loss: float | None = None
    lr: float | None = None
    grad_norm: float | None = None
    """Global grad norm, after the data-parallel reduction (equal on all ranks)."""
    grad_norm_local: float | None = None
    """This rank's grad norm before the reduction: tells which rank produced a NaN."""
    nan_count: int = 0
    inf_count: int = 0
    step_time_s: float | None = None
    data_wait_s: float | None = None
    """Time from the end of the previous step to the start of this one (fetching the
    batch, host work): before the collective, so it tells stragglers apart."""
    compute_s: float | None = None
    """PYNATIVE: time from the step's start until the local gradients were ready (before
    the all-reduce); None where the mode does not allow measuring it."""
    samples: int = 0
    ts: float = 0.0
    fingerprint: str | None = None
    """Hash of the parameters, every `collect_freq` steps (and step 0)."""
    param_norm: float | None = None
    decision: bool = False
    """True when the rank waits for a directive for this step."""
    extra: dict[str, float] = field(default_factory=dict)
    """Additional named scalars (user metrics); reduced like the loss."""
    weights: dict[str, Any] = field(default_factory=dict)
    """Every collect_freq steps: per-layer `norms`, `update_ratio`, and `hist` / `grad_hist`
    (histograms of the layers matching monitor.histogram_regex)."""

    SCHEMA: ClassVar[dict[str, tuple[type, ...]]] = {
        "rank": (int,),
        "step": (int,),
        "epoch": (int,),
        "loss": _OPT_NUM,
        "lr": _OPT_NUM,
        "grad_norm": _OPT_NUM,
        "grad_norm_local": _OPT_NUM,
        "nan_count": (int,),
        "inf_count": (int,),
        "step_time_s": _OPT_NUM,
        "data_wait_s": _OPT_NUM,
        "compute_s": _OPT_NUM,
        "samples": (int,),
        "ts": _NUM,
        "fingerprint": (str, type(None)),
        "param_norm": _OPT_NUM,
        "decision": (bool,),
        "extra": (dict,),
        "weights": (dict,),
    }
    REQUIRED: ClassVar[tuple[str, ...]] = ("rank", "step")


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

    SCHEMA: ClassVar[dict[str, tuple[type, ...]]] = {
        "rank": (int,),
        "kind": (str,),
        "ts": _NUM,
        "step": (int,),
        "pid": (int,),
        "host": (str,),
        "message": (str,),
    }
    REQUIRED: ClassVar[tuple[str, ...]] = ("rank", "kind")


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
    kwargs: dict[str, Any] = {}
    for key, value in obj.items():
        if key in ("v", "t"):
            continue
        allowed = cls.SCHEMA.get(key) if isinstance(key, str) else None
        if allowed is None:
            raise PacketError("malformed", f"unknown field {key!r} in a {t} packet")
        if isinstance(value, bool) and bool not in allowed:
            raise PacketError("malformed", f"field {key!r} has bad type bool")
        if not isinstance(value, allowed):
            raise PacketError("malformed", f"field {key!r} has bad type {type(value).__name__}")
        kwargs[key] = value
    for key in cls.REQUIRED:
        if key not in kwargs:
            raise PacketError("malformed", f"{t} packet misses field {key!r}")
    if "rank" in kwargs and not (0 <= kwargs["rank"] < _MAX_RANK):
        raise PacketError("malformed", f"rank {kwargs['rank']} out of range")
    if "step" in kwargs and not (0 <= kwargs["step"] < _MAX_STEP):
        raise PacketError("malformed", f"step {kwargs['step']} out of range")
    if cls is StepPacket:
        extra = kwargs.get("extra", {})
        if len(extra) > 64 or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(x, _NUM) and not isinstance(x, bool)
            for k, x in extra.items()
        ):
            raise PacketError("malformed", "field 'extra' must map up to 64 short names to numbers")
        for key in ("nan_count", "inf_count", "samples"):
            if key in kwargs and kwargs[key] < 0:
                raise PacketError("malformed", f"field {key!r} is negative")
    return cls(**kwargs)


def decode(data: bytes) -> Packet:
    """bytes → Packet; raises PacketError for anything that is not a valid packet."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise PacketError("malformed", f"expected bytes, got {type(data).__name__}")
    if len(data) > MAX_PACKET_BYTES:
        raise PacketError("too_large", f"{len(data)} bytes > {MAX_PACKET_BYTES}")
    try:
        obj = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True, **_UNPACK_LIMITS)
    except Exception as exc:  # msgpack raises many types (ValueError, ExtraData, UnicodeDecodeError...)
        raise PacketError("malformed", f"not msgpack ({type(exc).__name__}: {exc})") from None
    return from_wire(obj)


def iter_stream(data_or_file: Any):
    """Yield decoded wire objects of an append-only stream (e.g. metrics.msgpack).

    A torn record at the end (a crash mid-write) ends the iteration quietly.
    """
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=True, max_buffer_size=MAX_PACKET_BYTES * 4,
                                **_UNPACK_LIMITS)
    read = getattr(data_or_file, "read", None)
    if read is None:
        unpacker.feed(data_or_file)
        chunks = [b""]
    else:
        chunks = iter(lambda: read(1 << 16), b"")
    for chunk in chunks:
        if chunk:
            unpacker.feed(chunk)
        while True:
            try:
                obj = next(unpacker)
            except StopIteration:
                break
            except Exception:
                return
            yield obj


class Action(str, enum.Enum):
    """What every rank does after a decision step (the same for all ranks)."""

    CONTINUE = "continue"
    STOP = "stop"


@dataclass
class Directive:
    """The aggregator's answer at a decision point."""

    step: int
    action: Action = Action.CONTINUE
    reason: str = ""
    save: str = ""
    """Non-empty: rank 0 saves a checkpoint after the step; comma-separated kinds
    (`periodic`, `best`, `last`)."""
    metric: float | None = None
    """The reduced metric of the step (recorded with a `best` checkpoint)."""
    metric_name: str = ""

    @property
    def save_kinds(self) -> list[str]:
        return [k for k in self.save.split(",") if k]

    def encode(self) -> bytes:
        return msgpack.packb(
            {"v": SCHEMA_VERSION, "t": "directive", "step": self.step, "action": self.action.value,
             "reason": self.reason, "save": self.save, "metric": self.metric, "metric_name": self.metric_name},
            use_bin_type=True,
        )

    @staticmethod
    def decode(data: bytes) -> "Directive":
        try:
            obj = msgpack.unpackb(bytes(data), raw=False, **_UNPACK_LIMITS)
            if obj.get("v") != SCHEMA_VERSION or obj.get("t") != "directive":
                raise PacketError("version", f"not a directive of schema {SCHEMA_VERSION}")
            m = obj.get("metric")
            return Directive(step=int(obj["step"]), action=Action(obj["action"]),
                             reason=str(obj.get("reason", "")), save=str(obj.get("save", "")),
                             metric=float(m) if isinstance(m, (int, float)) else None,
                             metric_name=str(obj.get("metric_name", "")))
        except PacketError:
            raise
        except Exception as exc:
            raise PacketError("malformed", f"bad directive ({exc})") from None


def is_finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


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
    "Action",
    "Directive",
    "from_wire",
    "iter_stream",
    "is_finite",
]
