"""What a fault is, as written in a run's config (`faults:`) and on the command line: a
rehearsal of a failure (`nan_grad@1:5`: the kind, the rank, the step it acts at). The
config checks the specs with `parse_fault`; the launcher arms them per attempt in
`RankSettings.faults`, and each rank injects its own (`workers/faults.py`).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass


class FaultKind(str, enum.Enum):
    NAN_LOSS = "nan_loss"
    NAN_GRAD = "nan_grad"
    INF_GRAD = "inf_grad"
    LOSS_SPIKE = "loss_spike"
    GRAD_SPIKE = "grad_spike"
    CRASH = "crash"
    HANG = "hang"
    SLOW = "slow"
    THROTTLE = "throttle"
    """From the step on, the rank's own computation takes longer (a sleep inside its forward
    pass, before its gradients are ready): a throttled or failing card, where `slow` delays
    the data path instead. PYNATIVE only (a compiled graph runs no Python hook)."""
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
