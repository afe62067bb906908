"""The aggregator's stop of every rank, and the rollback it may ask for: decided in the
aggregator (aggregator/decisions.py), read by the driver (launcher/controller.py rolls back,
summary.json records it). They cross between the two as `to_dict`'s map (the aggregator's
snapshot) and are read back with `from_dict`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RollbackDecision:
    """What the launcher needs to roll back after an anomaly (`stop.rollback` in summary.json)."""

    rule: str
    anomaly_step: int
    skip_batches: bool
    lr_factor: float
    lr_steps: int

    def to_dict(self) -> dict[str, Any]:
        return {"rule": self.rule, "anomaly_step": self.anomaly_step, "skip_batches": self.skip_batches,
                "lr_factor": self.lr_factor, "lr_steps": self.lr_steps}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> RollbackDecision:
        return RollbackDecision(rule=str(d["rule"]), anomaly_step=int(d["anomaly_step"]),
                                skip_batches=bool(d["skip_batches"]), lr_factor=float(d["lr_factor"]),
                                lr_steps=int(d["lr_steps"]))


@dataclass(frozen=True)
class StopDecision:
    """A stop of every rank: requested (`step` None), then decided at a reduced step."""

    rule: str
    message: str
    rank: int | None = None
    value: float | None = None
    threshold: float | None = None
    save: bool = False
    """Asked with a `last` checkpoint (interrupts, save_and_stop rules)."""
    rollback: RollbackDecision | None = None
    step: int | None = None
    """Every rank stops after this step (None: not decided yet)."""
    decided_at: int | None = None
    """The reduced step it was decided at."""
    save_last: bool = False
    """Rank 0 writes a `last` checkpoint after `step` (asked, and checkpoint.save_last)."""

    def to_dict(self) -> dict[str, Any]:
        """summary.json's `stop`."""
        out: dict[str, Any] = {"rule": self.rule, "rank": self.rank, "value": self.value,
                               "threshold": self.threshold, "message": self.message}
        if self.rollback is not None:
            out["rollback"] = self.rollback.to_dict()
        if self.step is not None:
            out.update(step=self.step, decided_at=self.decided_at, save_last=self.save_last)
        return out

    @staticmethod
    def from_dict(d: dict[str, Any]) -> StopDecision:
        """A stop as `to_dict` wrote it (the aggregator's snapshot, summary.json)."""
        rb = d.get("rollback")
        return StopDecision(rule=str(d["rule"]), message=str(d.get("message", "")), rank=d.get("rank"),
                            value=d.get("value"), threshold=d.get("threshold"),
                            rollback=RollbackDecision.from_dict(rb) if rb else None, step=d.get("step"),
                            decided_at=d.get("decided_at"), save_last=bool(d.get("save_last", False)))
