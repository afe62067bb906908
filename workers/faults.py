"""Fault injection inside the real rank, so users can rehearse their rules.

`KIND@RANK:STEP` (e.g. `nan_grad@1:5`) corrupts the real computation of that rank at that
step: the loss or the local gradients through the train cell's fault scalars, or the
process itself (crash, hang, slow, desync), or rank 0's checkpoint write (slow_save).
`slow_card@RANK` (no step) slows the rank's pre-flight card check instead
(workers/card_check.py). Given with `--inject` or `faults:`.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from mindpulse.config.fault_specs import Fault, FaultKind, parse_fault

from .model_params import model_parameters
from .settings import load_settings

log = logging.getLogger(__name__)

# kinds that corrupt one step through the train cell's scalars
_CELL_KINDS = {FaultKind.NAN_LOSS, FaultKind.NAN_GRAD, FaultKind.INF_GRAD, FaultKind.LOSS_SPIKE,
               FaultKind.GRAD_SPIKE}
LOSS_SPIKE_FACTOR = 5.0
"""The loss (and so its gradients) of the step are multiplied by this."""
GRAD_SPIKE_FACTOR = 1000.0
"""The rank's local gradients of the step are multiplied by this before the all-reduce."""
SLOW_DELAY_S = 1.5
"""Delay added to every step's data path from the fault's step on."""
THROTTLE_S = 2.0
"""throttle@R:S: delay added inside every step's forward pass of rank R from step S on, so
its compute (up to its gradients) takes this much longer: its achieved TFLOPS fall, and so
its straggler score, while its data wait does not move."""
DESYNC_DELTA = 1e-3
"""Added to one weight tensor of the rank: small, but every fingerprint sees it."""
SLOW_SAVE_S = 8.0
"""slow_save@0:S: rank 0's checkpoint write of step S waits this long before writing (its
save-in-progress marker already written), as a large checkpoint on slow storage would."""
SLOW_CARD_FACTOR = 4
"""slow_card@R: rank R's card-check matmul does each product's work this many times over
(the product is counted once), so its GFLOP/s drop to about 1/this."""


def faults_for(rank: int, specs: tuple[str, ...] | list[str] | None = None) -> list[Fault]:
    """This rank's faults: from `specs`, or from the run's settings (none outside a launch)."""
    if specs is None:
        settings = load_settings()
        specs = settings.faults if settings is not None else ()
    return [f for f in map(parse_fault, specs) if f.rank == rank]


def cell_faults_armed(rank: int) -> bool:
    """True when this rank will need the train cell's fault scalars (decided at build time:
    in GRAPH mode they must be in the compiled graph from the start)."""
    return any(f.kind in _CELL_KINDS for f in faults_for(rank))


def card_check_repeats(rank: int, faults: list[Fault] | None = None) -> int:
    """How many times the pre-flight card check's matmul repeats each product on this rank
    (SLOW_CARD_FACTOR under slow_card@RANK, else 1)."""
    for f in faults if faults is not None else faults_for(rank):
        if f.kind is FaultKind.SLOW_CARD:
            print(f"[rank {rank}] injecting fault {f}: each matmul's work x{SLOW_CARD_FACTOR}", flush=True)
            return SLOW_CARD_FACTOR
    return 1


def _fault_param(train_cell: Any, name: str) -> Any:
    """A fault scalar: on a `MonitoredTrainOneStepCell`, or, where mindpulse attached to a
    cell it did not build (workers/grad_probe.py), on its gradient reducer (`fault_grad_scale`)
    or its loss network (`fault_loss_scale`); searched through the cells inside `train_cell`."""
    if train_cell is None:
        return None
    param = getattr(train_cell, name, None)
    if param is not None:
        return param
    cells = getattr(train_cell, "cells_and_names", None)
    for _, cell in (cells() if callable(cells) else ()):
        param = getattr(cell, name, None)
        if param is not None:
            return param
    return None


class FaultInjector:
    """Applies this rank's faults around each step (`before_step` / `after_step`)."""

    def __init__(self, rank: int, faults: list[Fault] | None = None):
        self.rank = rank
        self.faults = faults if faults is not None else faults_for(rank)
        self.train_cell: Any = None
        self.network: Any = None
        self._armed_scale = False
        self._throttle_due = False
        self._throttle_hooked = False
        self.fired: list[str] = []

    def bind(self, train_cell: Any, network: Any) -> None:
        self.train_cell = train_cell if train_cell is not None else self.train_cell
        self.network = network if network is not None else self.network
        if any(f.kind is FaultKind.THROTTLE for f in self.faults):
            self._hook_throttle()

    def _hook_throttle(self) -> None:
        """A forward pre-hook on the network: the delay lands inside the step's computation
        (after the step's start, before the gradients are ready), not in its data path."""
        if self._throttle_hooked or self.network is None:
            return
        import mindspore as ms

        if ms.get_context("mode") != ms.PYNATIVE_MODE:
            log.warning("[rank %d] cannot inject throttle: GRAPH mode compiles the step (no Python hook runs "
                        "inside it); use train.mode: pynative", self.rank)
            return

        def _delay(cell: Any, inputs: Any) -> None:
            if self._throttle_due:  # once a step: the gradient pass runs the forward again
                self._throttle_due = False
                time.sleep(THROTTLE_S)

        try:
            self.network.register_forward_pre_hook(_delay)
        except Exception as exc:  # a network without hooks: the fault cannot act, said in the log
            log.warning("[rank %d] cannot inject throttle: %s", self.rank, exc)
            return
        self._throttle_hooked = True

    def _set(self, name: str, value: float) -> None:
        import mindspore as ms

        param = _fault_param(self.train_cell, name)
        if param is None:
            log.warning("[rank %d] cannot inject: the train cell has no %s (neither a MonitoredTrainOneStepCell "
                        "nor a cell mindpulse attached its statistics to)", self.rank, name)
            return
        param.set_data(ms.Tensor(value, ms.float32))

    def before_step(self, step: int) -> None:
        for f in self.faults:
            if f.kind is FaultKind.SLOW and step >= f.step:
                time.sleep(SLOW_DELAY_S)
                if step == f.step:
                    self._note(f)
            if f.kind is FaultKind.THROTTLE and step >= f.step:
                self._throttle_due = True
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
                # before the step's computation, the heartbeat alive: the other ranks wait for
                # this one inside the step (its all-reduce) until the launcher stops the job
                while True:
                    time.sleep(3600)
            elif f.kind is FaultKind.DESYNC:
                self._desync()
                self._note(f)

    def before_save(self, step: int) -> None:
        """Inside rank 0's checkpoint write of `step`, before the file is written."""
        for f in self.faults:
            if f.kind is FaultKind.SLOW_SAVE and f.step == step:
                self._note(f)
                time.sleep(SLOW_SAVE_S)

    def after_step(self, step: int) -> None:
        if self._armed_scale:
            self._set("fault_loss_scale", 1.0)
            self._set("fault_grad_scale", 1.0)
            self._armed_scale = False

    def _desync(self) -> None:
        import mindspore as ms
        from mindspore import ops

        if self.network is None:
            log.warning("[rank %d] cannot inject desync: no network", self.rank)
            return
        p = model_parameters(self.network)[0]
        p.set_data(ops.add(p.value(), ms.Tensor(DESYNC_DELTA, p.dtype)))

    def _note(self, f: Fault) -> None:
        self.fired.append(str(f))
        print(f"[rank {self.rank}] injecting fault {f}", flush=True)
