"""The aggregator's answers to the ranks: the `Directive` at a decision point (continue or
stop, and which checkpoints rank 0 writes after the step) and the `Lease` every rank takes
before a step (how far the aggregator has reduced, and the step every rank stops after).

Both are msgpack maps of the packets' schema version, decoded as strictly as packets:
anything else raises `PacketError`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import msgpack

from mindpulse.wire.protocol import _UNPACK_LIMITS, SCHEMA_VERSION, Action, CheckpointKind, PacketError

SAVE_ORDER = (CheckpointKind.PERIODIC, CheckpointKind.BEST, CheckpointKind.LAST)
"""The order a directive's checkpoint kinds are listed in."""
_CKPT_KINDS = frozenset(k.value for k in CheckpointKind)


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
        except Exception as exc:  # msgpack, a missing key or a bad value: one PacketError for the caller
            raise PacketError("malformed", f"bad directive ({exc})") from None


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
        except Exception as exc:  # msgpack, a missing key or a bad value: one PacketError for the caller
            raise PacketError("malformed", f"bad lease ({exc})") from None

