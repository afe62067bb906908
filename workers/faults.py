"""Fault injection inside the real rank, so users can rehearse their rules.

`KIND@RANK:STEP` (e.g. `nan_grad@1:5`) corrupts the real computation of that rank at that
step: the loss or the local gradients through the train cell's fault scalars, or the
process itself (crash, hang, slow, desync). Given with `--inject` or `faults:`.
"""

from __future__ import annotations

import enum
import logging
import os
import re
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

ENV_FAULTS = "MINDPULSE_FAULTS"


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


# kinds that corrupt one step through the train cell's scalars
_CELL_KINDS = {FaultKind.NAN_LOSS, FaultKind.NAN_GRAD, FaultKind.INF_GRAD, FaultKind.LOSS_SPIKE,
               FaultKind.GRAD_SPIKE}
LOSS_SPIKE_FACTOR = 5.0
"""The loss (and so its gradients) of the step are multiplied by this."""
GRAD_SPIKE_FACTOR = 1000.0
"""The rank's local gradients of the step are multiplied by this before the all-reduce."""
SLOW_DELAY_S = 1.5
"""Delay added to every step's data path from the fault's step on."""
DESYNC_DELTA = 1e-3
"""Added to one weight tensor of the rank: small, but every fingerprint sees it."""

_SPEC = re.compile(r"^\s*([a-z_]+)@(\d+):(\d+)\s*$")


@dataclass(frozen=True)
class Fault:
    kind: FaultKind
    rank: int
    step: int

    def __str__(self) -> str:
        return f"{self.kind.value}@{self.rank}:{self.step}"


def parse_fault(spec: str, world_size: int | None = None) -> Fault:
    """`nan_grad@1:5` → Fault; ValueError saying what is allowed otherwise."""
    m = _SPEC.match(spec or "")
    if not m:
        raise ValueError(f"{spec!r} is not a fault; use KIND@RANK:STEP, e.g. nan_grad@1:5")
    kind, rank, step = m.group(1), int(m.group(2)), int(m.group(3))
    try:
        fk = FaultKind(kind)
    except ValueError:
        raise ValueError(f"{spec!r}: unknown kind {kind!r}; use one of "
                         + ", ".join(k.value for k in FaultKind)) from None
    if world_size is not None and rank >= world_size:
        raise ValueError(f"{spec!r}: rank {rank} does not exist in a world of {world_size} ranks")
    return Fault(fk, rank, step)


def faults_from_env(rank: int, env: dict[str, str] | None = None) -> list[Fault]:
    env = os.environ if env is None else env
    out = []
    for spec in filter(None, (env.get(ENV_FAULTS) or "").split(",")):
        f = parse_fault(spec)
        if f.rank == rank:
            out.append(f)
    return out


def cell_faults_armed(rank: int) -> bool:
    """True when this rank will need the train cell's fault scalars (decided at build time:
    in GRAPH mode they must be in the compiled graph from the start)."""
    return any(f.kind in _CELL_KINDS for f in faults_from_env(rank))


class FaultInjector:
    """Applies this rank's faults around each step (`before_step` / `after_step`)."""

    def __init__(self, rank: int, faults: list[Fault] | None = None):
        self.rank = rank
        self.faults = faults if faults is not None else faults_from_env(rank)
        self.train_cell: Any = None
        self.network: Any = None
        self._armed_scale = False
        self.fired: list[str] = []

    def bind(self, train_cell: Any, network: Any) -> None:
        self.train_cell = train_cell if train_cell is not None else self.train_cell
        self.network = network if network is not None else self.network

    def _set(self, name: str, value: float) -> None:
        import mindspore as ms

        param = getattr(self.train_cell, name, None)
        if param is None:
            log.warning("[rank %d] cannot inject: the train cell is not a MonitoredTrainOneStepCell", self.rank)
            return
        param.set_data(ms.Tensor(value, ms.float32))

    def before_step(self, step: int) -> None:
        for f in self.faults:
            if f.kind is FaultKind.SLOW and step >= f.step:
                time.sleep(SLOW_DELAY_S)
                if step == f.step:
                    self._note(f)
            if f.step != step:
                continue
            if f.kind in _CELL_KINDS:
                value = {
                    FaultKind.NAN_LOSS: ("fault_loss_scale", float("nan")),
                    FaultKind.LOSS_SPIKE: ("fault_loss_scale", LOSS_SPIKE_FACTOR),
                    FaultKind.NAN_GRAD: ("fault_grad_scale", float("nan")),
                    FaultKind.INF_GRAD: ("fault_grad_scale", float("inf")),
                    FaultKind.GRAD_SPIKE: ("fault_grad_scale", GRAD_SPIKE_FACTOR),
                }[f.kind]
                self._set(*value)
                self._armed_scale = True
                self._note(f)
            elif f.kind is FaultKind.CRASH:
                self._note(f)
                raise RuntimeError(f"injected crash ({f}) in rank {self.rank} at step {step}")
            elif f.kind is FaultKind.HANG:
                self._note(f)
                while True:  # until the launcher stops the job
                    time.sleep(3600)
            elif f.kind is FaultKind.DESYNC:
                self._desync()
                self._note(f)

    def after_step(self, step: int) -> None:
        if self._armed_scale:
            self._set("fault_loss_scale", 1.0)
            self._set("fault_grad_scale", 1.0)
            self._armed_scale = False

    def _desync(self) -> None:
        import mindspore as ms
        from mindspore import ops

        from .fingerprint import model_parameters

        if self.network is None:
            log.warning("[rank %d] cannot inject desync: no network", self.rank)
            return
        p = model_parameters(self.network)[0]
        p.set_data(ops.add(p.value(), ms.Tensor(DESYNC_DELTA, p.dtype)))

    def _note(self, f: Fault) -> None:
        self.fired.append(str(f))
        print(f"[rank {self.rank}] injecting fault {f}", flush=True)
