"""The per-rank monitor: a MindSpore `Callback` for `Model.train`, and `step()` for
hand-written loops. One line in a user's script:

    model.train(epochs, dataset, callbacks=[Monitor()])

This module only reads MindSpore's side of a step (outputs, timing, the optimizer's
learning rate, the dataset's batch size); the rank session (`session.py`) builds the
packets, ships them, and follows the aggregator's directives. Launched outside mindpulse
it still works: it logs the packets and never blocks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from mindspore import Tensor, nn
from mindspore.train.callback import Callback

from mindpulse.config.rank_settings import RankSettings
from mindpulse.registry.metrics import cell_stats
from mindpulse.wire.directives import Directive

from .channel import Channel
from .errors import StopTraining
from .grad_probe import probe_of, read_stats
from .session import UNLAUNCHED_SCHEDULE, RankSession, StepOutcome, schedule_with
from .settings import load_settings
from .train_cell import split_outputs

log = logging.getLogger(__name__)

__all__ = ["Monitor", "StepOutcome", "lr_of_step"]

STEP_STATS = cell_stats()
"""What a step's outputs (or the statistics wrapper) may add to its packet: the registry's CELL
metrics (mindpulse/registry/metrics.py)."""


def lr_of_step(optimizer: Any, step_index: int) -> float | None:
    """Learning rate used by step `step_index` (0-based).

    `optimizer.get_lr()` inside a callback already points at the next step, so the rate
    is read from the schedule at the step just done instead.
    """
    if optimizer is None:
        return None
    try:
        lr = optimizer.learning_rate
        table = _lr_table(lr)
        if table is not None:
            # a Tensor of rates (MindSpore wraps it in a schedule that gathers entry
            # `step`): read the entry on the host instead of running the schedule's graph
            # (~0.4 ms a step on CPU); an index outside the table has no rate, as the
            # gather raises there
            return float(table[step_index]) if 0 <= step_index < table.size else None
        if isinstance(lr, nn.learning_rate_schedule.LearningRateSchedule):
            import mindspore as ms

            return float(lr(Tensor(step_index, ms.int32)).asnumpy())
        if isinstance(lr, Tensor):
            arr = lr.asnumpy().reshape(-1)
            return float(arr[min(step_index, arr.size - 1)]) if arr.size else None
        if hasattr(lr, "asnumpy"):
            return float(lr.asnumpy().reshape(-1)[0])
        return float(lr)
    except Exception:  # a group learning rate or an exotic schedule: report none
        return None


_TABLE_VIEWS: dict[int, tuple[Any, int, Any]] = {}
"""{id(table): (table, its storage address, a numpy view of that storage)}: see `_lr_table`."""


def _lr_table(lr: Any) -> Any:
    """The rates of a learning rate given as a Tensor of one rate per step, as a numpy
    vector (as they are now: a script may change them); None for any other kind.

    Where `asnumpy()` is a view of the table's own storage (a CPU target) the view is kept
    while that storage is the table's: a rate written in place shows through it, and a
    table given new storage (`set_data`) is read again. In place a fresh `asnumpy()` cost
    ~0.1 ms of the rank's step here. Elsewhere (a device) it is a copy: read every time."""
    if type(lr).__name__ != "_IteratorLearningRate":  # MindSpore's wrapper of a Tensor of rates
        return None
    table = getattr(lr, "learning_rate", None)
    if not isinstance(table, Tensor) or len(table.shape) != 1:
        return None
    kept = _TABLE_VIEWS.get(id(table))
    try:
        addr = table.data_ptr()
    except Exception:  # no device pointer for this table: read it through MindSpore
        return table.asnumpy()
    if kept is not None and kept[0] is table and kept[1] == addr:
        return kept[2]
    view = table.asnumpy()
    if view.ctypes.data == addr:  # the table's own storage, not a copy
        if len(_TABLE_VIEWS) >= 8:
            _TABLE_VIEWS.clear()
        _TABLE_VIEWS[id(table)] = (table, addr, view)
    return view


def _tokens_per_batch(ds: Any) -> int | None:
    """Batch size x sequence length of a dataset's first column (None when it has no such
    2-D column): the tokens of one step, for a dataset whose first column is token ids."""
    try:
        shape = ds.output_shapes()[0] if ds is not None else None
        return int(shape[0]) * int(shape[1]) if shape is not None and len(shape) >= 2 else None
    except Exception:  # a dataset that does not say its shape: tokens per step unknown
        return None


class Monitor(Callback):
    """Ships each step to the mindpulse aggregator; stops when every rank must stop.

    Every argument is optional: launched by mindpulse the monitor takes the run's
    settings; explicit values override them (for scripts that know better).

    Args:
        network: the model whose parameters are fingerprinted; found automatically in
            `Model.train` (the train cell's `network`).
        batch_size: samples per step on this rank; found from the dataset in `Model.train`.
        collect_freq / max_lag_steps: override the run's `monitor.*` settings.
        total_steps: request a stop after this many steps (the run's `train.steps`).
        client: the channel packets go through (default: the run's relay or aggregator).
        rank: this rank (default: MindSpore's RANK_ID).
        evaluate: a callable returning validation metrics (e.g. `{"eval_loss": 2.1}`) for
            this rank's shard; run every `eval_every` steps (and every `epoch_steps`
            steps when `eval_per_epoch`), shipped with the step and reduced over ranks.
        step_offset: the global step this run starts after (default: the run's resume point).
        train_cell: what rank 0 checkpoints (found automatically in `Model.train`).
        settings: the run's settings (default: those the launcher handed this process).
        metrics: the names `evaluate` (or `extra`) reports, e.g. `["eval_acc"]`; list them in
            the config's `eval.metrics` too, so rules and `checkpoint.best_metric` may use them
            (checked at launch). An evaluation reporting another name is a monitor error.
        tokens_per_step: tokens this rank trains on per step (padding excluded), for tokens/s,
            achieved TFLOPS and MFU; in `Model.train` found from the dataset where it can be
            (batch size x sequence length of the batch's first column); `step(tokens=...)`
            gives a hand loop's per step.
        flops_per_token: model FLOPs per token (training: forward and backward); default
            6 x the network's trainable parameters ("6N"; `mindpulse.workers.flops` has the
            decoder estimate with the attention term).
    """

    def __init__(
        self,
        network: nn.Cell | None = None,
        batch_size: int | None = None,
        collect_freq: int | None = None,
        max_lag_steps: int | None = None,
        total_steps: int | None = None,
        client: Channel | None = None,
        rank: int | None = None,
        evaluate: Callable[[], dict[str, float]] | None = None,
        eval_every: int | None = None,
        eval_per_epoch: bool | None = None,
        epoch_steps: int | None = None,
        step_offset: int | None = None,
        train_cell: nn.Cell | None = None,
        settings: RankSettings | None = None,
        metrics: list[str] | None = None,
        tokens_per_step: int | None = None,
        flops_per_token: float | None = None,
    ):
        super().__init__()
        settings = settings if settings is not None else load_settings()
        schedule = schedule_with(settings.schedule if settings is not None else UNLAUNCHED_SCHEDULE,
                                 collect_freq=collect_freq, max_lag_steps=max_lag_steps, total_steps=total_steps,
                                 eval_every=eval_every, eval_per_epoch=eval_per_epoch)
        self.session = RankSession(
            settings,
            rank=rank,
            channel=client,
            schedule=schedule,
            batch_size=batch_size,
            step_offset=step_offset,
            evaluate=evaluate,
            epoch_steps=epoch_steps,
            network=network,
            train_cell=train_cell,
            metrics=metrics,
            tokens_per_step=tokens_per_step,
            flops_per_token=flops_per_token,
        )
        self._t0: float | None = None
        self._last_end: float | None = None
        self._data_wait: float | None = None
        self._probe: Any = None
        """The statistics wrapper mindpulse attached to a train cell it did not build
        (workers/grad_probe.py), read after each step; None for our own cell or none."""
        self._probe_of: Any = None
        """The train cell `_probe` was looked up in (a hand loop's may come with any step)."""
        self._step_base = 0
        """Steps before this `Model.train` call's own count (MindSpore's `cur_step_num` starts
        again at each call): a Monitor that watches several calls numbers them on."""
        self._optimizer: Any = None
        """This `Model.train` call's optimizer, looked up once at its start (a Cell's attribute
        lookup runs MindSpore's Python `__getattr__`: microseconds every step otherwise)."""
        self._timed_cell: Any = None
        """The train cell that stamps when its local gradients were ready (`pre_reduce_ts`), if it does."""
        self.finish_at_train_end = True
        """False: the Monitor outlives `Model.train` (auto-attach's, finished at the script's end)."""

    # ---- what scripts may read -----------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.session.rank

    @property
    def step_num(self) -> int:
        """The last step reported."""
        return self.session.step

    @property
    def stopped(self) -> Directive | None:
        """The directive that stops every rank, once one came."""
        return self.session.stopped

    @property
    def on_directive(self) -> Callable[[Directive], None] | None:
        """Called with every directive this rank receives."""
        return self.session.on_directive

    @on_directive.setter
    def on_directive(self, fn: Callable[[Directive], None] | None) -> None:
        self.session.on_directive = fn

    # ---- hand-written loops ------------------------------------------------------------------
    def start(self, network: nn.Cell | None = None, train_cell: nn.Cell | None = None, arm_next: bool = True) -> None:
        """Start of training: announce the rank and send the step-0 fingerprint.

        In a hand-written loop call it before the first step (faults for step 1 and the
        fingerprint of the weights before any update need it); `step()` calls it otherwise.
        """
        self.session.start(network, train_cell, arm_next)

    def record(self, loss: Any, **fields: Any) -> StepOutcome:
        """Report one step's numbers directly (the next step unless `step=` is given): the
        fields of `RankSession.record` (`step`, and the registry's metrics a rank reports:
        `mindpulse.registry.metrics.reported()`: epoch, lr, grad_norm, grad_norm_local, nan_count, inf_count,
        step_time_s, data_wait_s, compute_s, samples, tokens, loss_scale, overflow, extra); numbers
        may be Python numbers, numpy scalars or MindSpore tensors."""
        return self.session.record(loss, **fields)

    def finish(self, message: str = "") -> None:
        """End of training: flush and announce the end (stops the heartbeat)."""
        self.session.finish(message)

    def step(
        self,
        outputs: Any = None,
        *,
        loss: float | None = None,
        network: nn.Cell | None = None,
        train_cell: nn.Cell | None = None,
        optimizer: Any = None,
        epoch: int = 0,
        samples: int | None = None,
        extra: dict[str, float] | None = None,
        tokens: int | None = None,
        **stats: Any,
    ) -> StepOutcome:
        """Report one finished step of a hand-written loop; returns whether to stop.

        `outputs` may be what a `MonitoredTrainOneStepCell` returned (loss and grad
        statistics are then read from it) or a loss tensor/number.
        """
        now = time.perf_counter()
        s = self.session
        if train_cell is not None:
            s.train_cell = train_cell
        if not s.started:
            s.start(network)
        elif network is not None and s.network is None:
            s.network = network
        if outputs is not None:
            out_loss, out_stats = self._split(outputs)
            loss = out_loss if loss is None else loss
            for k, v in out_stats.items():
                stats.setdefault(k, v)
        if "grad_norm_local" not in stats and s.train_cell is not None:
            if self._probe_of is not s.train_cell:  # a cell of the script's own that mindpulse attached to
                self._probe_of, self._probe = s.train_cell, probe_of(s.train_cell)
            for k, v in self._probe_stats().items():
                stats.setdefault(k, v)
        step_time = now - self._last_end if self._last_end is not None else None
        outcome = s.record(
            loss,
            since=now,
            epoch=epoch,
            lr=lr_of_step(optimizer, s.step) if optimizer is not None else stats.pop("lr", None),
            step_time_s=step_time,
            samples=samples,
            tokens=tokens,
            extra=extra,
            **{k: stats[k] for k in STEP_STATS if k in stats},
        )
        s.after_step(s.step)
        s.before_step(s.step + 1)  # faults (and the profiler) of the loop's next step
        self._last_end = time.perf_counter()
        return outcome

    # ---- MindSpore callback ------------------------------------------------------------------
    def on_train_begin(self, run_context):
        s = self.session
        cb = run_context.original_args()
        net = getattr(cb, "train_network", None)
        inner = getattr(net, "network", net)
        if s.train_cell is None:
            s.train_cell = net
        self._probe_of, self._probe = s.train_cell, probe_of(s.train_cell)
        if s.started:  # a later Model.train call watched by the same Monitor: its steps come after
            self._step_base = s.step - s.step_offset - int(getattr(cb, "cur_step_num", 0) or 0)
        self._timed_cell = None
        if hasattr(s.train_cell, "enable_pre_reduce_timing") and s.train_cell.enable_pre_reduce_timing():
            self._timed_cell = s.train_cell  # PYNATIVE: the cell stamps its gradients' moment
        self._optimizer = getattr(cb, "optimizer", None) or getattr(net, "optimizer", None)
        if s.batch_size is None:
            ds = getattr(cb, "train_dataset", None)
            try:
                s.batch_size = int(ds.get_batch_size()) if ds is not None else None
            except Exception:  # a dataset that does not say its batch size: unknown, not an error
                s.batch_size = None
        if s.tokens_per_step is None:
            s.tokens_per_step = _tokens_per_batch(getattr(cb, "train_dataset", None))
        s.start(inner, arm_next=False)
        self._last_end = time.perf_counter()

    def on_train_step_begin(self, run_context):
        s = self.session
        if s.stopped is not None:  # stopped at the start (e.g. desync at step 0): no step may run
            s.finish("stopped: " + s.stopped.reason)
            raise StopTraining(s.stopped.reason)
        # an injected `slow` delay belongs to the data path: it happens before t0
        profiled = s.before_step(s.step + 1)
        self._t0 = time.perf_counter()
        # the profiler's start is its own badput (the packet's profile_s), not a data wait
        self._data_wait = max(0.0, self._t0 - self._last_end - profiled) if self._last_end is not None else None

    def on_train_step_end(self, run_context):
        s = self.session
        cb = run_context.original_args()
        now = time.perf_counter()
        loss, stats = self._split(cb.net_outputs)
        stats.update(self._probe_stats())
        step = s.step_offset + self._step_base + int(cb.cur_step_num)
        s.after_step(step)
        # with dataset sinking one callback covers `sink` steps: report the mean step time
        nsteps = max(1, step - s.step)
        start = self._t0 if self._t0 is not None else self._last_end
        step_time = (now - start) / nsteps if start is not None else None
        lr = lr_of_step(self._optimizer, step - 1)
        out_lr = stats.pop("lr", None)  # a MindFormers cell's own rate of the step
        outcome = s.record(
            loss,
            since=now,
            step=step,
            epoch=(step - 1) // s.epoch_steps + 1 if s.epoch_steps else int(getattr(cb, "cur_epoch_num", 1)),
            lr=lr if lr is not None else out_lr,
            step_time_s=step_time,
            samples=(s.batch_size or 0) * nsteps,
            data_wait_s=self._data_wait,
            compute_s=self._compute_time(),
            **stats,
        )
        self._last_end = time.perf_counter()
        if outcome.stop:
            run_context.request_stop()
            log.info("[rank %d] stopping after step %d: %s", s.rank, step, outcome.reason)

    def _probe_stats(self) -> dict[str, Any]:
        """The last step's statistics from the wrapper mindpulse attached (none without one); an
        error reading them is a monitor error (counted, logged), never the training loop's."""
        if self._probe is None:
            return {}
        try:
            return read_stats(self._probe)
        except Exception as exc:  # the monitor never kills the training it watches: logged and counted
            self.session.monitor_error("reading the gradient statistics", exc)
            return {}

    def _split(self, outputs: Any) -> tuple[Any, dict[str, Any]]:
        """The loss and grad statistics of a step's outputs; an unexpected shape is a monitor
        error (counted, logged), never an exception in the training loop."""
        try:
            return split_outputs(outputs)
        except Exception as exc:  # the monitor never kills the training it watches: logged and counted
            self.session.monitor_error("reading the step's outputs", exc)
            return None, {}

    def _compute_time(self) -> float | None:
        """PYNATIVE: from the step's start until the local gradients were ready."""
        cell = self._timed_cell
        if cell is None or cell is not self.session.train_cell:
            return None
        ts = getattr(cell, "pre_reduce_ts", None)
        if ts is None or self._t0 is None or ts < self._t0:
            return None
        return ts - self._t0

    def on_train_end(self, run_context):
        s = self.session
        if self.finish_at_train_end:
            s.finish("stopped: " + s.stopped.reason if s.stopped else "")
        else:
            s.flush()
