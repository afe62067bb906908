"""The per-rank monitor: a MindSpore `Callback` for `Model.train`, and `step()` for
hand-written loops. One line in a user's script:

    model.train(epochs, dataset, callbacks=[Monitor()])

Per step it builds a `StepPacket` (loss, the learning rate of the step just done, grad
norms, NaN/Inf counts, step time, samples/s, and every `collect_freq` steps a parameter
fingerprint) and ships it to the run's aggregator; at decision points it waits for the
directive so that every rank stops after the same step. Launched outside mindpulse it
still works: it logs the packets and never blocks.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from mindspore import Tensor, nn
from mindspore.train.callback import Callback

from mindpulse.aggregator.packets import Action, Directive, EventPacket, StepPacket

from .errors import StopTraining
from .faults import FaultInjector
from .fingerprint import fingerprint_of, model_parameters, param_sums
from .shipping import AggregatorClient, RankEnv
from .train_cell import split_outputs

log = logging.getLogger(__name__)


DEFAULT_HIST_REGEX = r"(?:^|\.)(?:tok_embeddings\.embedding_weight|tok_embeddings\.weight|lm_head\.weight|layers\.0\.attention\.wq\.weight)$"
"""Histograms for a few layers by default: the embedding, the output head, the first query projection."""


def lr_of_step(optimizer: Any, step_index: int) -> float | None:
    """Learning rate used by step `step_index` (0-based).

    `optimizer.get_lr()` inside a callback already points at the next step, so the rate
    is read from the schedule at the step just done instead.
    """
    if optimizer is None:
        return None
    try:
        lr = optimizer.learning_rate
        if isinstance(lr, nn.learning_rate_schedule.LearningRateSchedule):
            from mindspore import Tensor as T
            import mindspore as ms

            return float(lr(T(step_index, ms.int32)).asnumpy())
        if isinstance(lr, Tensor):
            arr = lr.asnumpy().reshape(-1)
            return float(arr[min(step_index, arr.size - 1)]) if arr.size else None
        if hasattr(lr, "asnumpy"):
            return float(lr.asnumpy().reshape(-1)[0])
        return float(lr)
    except Exception:  # a group learning rate or an exotic schedule: report none
        return None


@dataclass
class StepOutcome:
    """What `Monitor.step` tells a hand-written loop."""

    step: int
    stop: bool
    reason: str = ""


class Monitor(Callback):
    """Ships each step to the mindpulse aggregator; stops when every rank must stop.

    Args:
        network: the model whose parameters are fingerprinted; found automatically in
            `Model.train` (the train cell's `network`).
        batch_size: samples per step on this rank; found from the dataset in `Model.train`.
        collect_freq / decision_every: override the run's `monitor.*` settings.
        total_steps: request a stop after this many steps (the run's `train.steps`).
        evaluate: a callable returning validation metrics (e.g. `{"eval_loss": 2.1}`) for
            this rank's shard; run every `eval_every` steps (and every `epoch_steps`
            steps when `eval_per_epoch`), shipped with the step and reduced over ranks.
        step_offset: the global step this run starts after (a resumed run).
        train_cell: what rank 0 checkpoints (found automatically in `Model.train`).
    """

    def __init__(
        self,
        network: nn.Cell | None = None,
        batch_size: int | None = None,
        collect_freq: int | None = None,
        decision_every: int | None = None,
        total_steps: int | None = None,
        client: AggregatorClient | None = None,
        rank: int | None = None,
        evaluate: Callable[[], dict[str, float]] | None = None,
        eval_every: int | None = None,
        eval_per_epoch: bool | None = None,
        epoch_steps: int | None = None,
        step_offset: int | None = None,
        train_cell: nn.Cell | None = None,
    ):
        super().__init__()
        self.renv = RankEnv.from_environ()
        renv = self.renv
        env = os.environ
        self.evaluate = evaluate
        self.eval_every = eval_every if eval_every is not None else int(env.get("MINDPULSE_EVAL_EVERY", "0"))
        self.eval_per_epoch = (eval_per_epoch if eval_per_epoch is not None
                               else env.get("MINDPULSE_EVAL_PER_EPOCH", "0") == "1")
        self.epoch_steps = epoch_steps
        self.save_steps = int(env.get("MINDPULSE_SAVE_STEPS", "0"))
        self.step_offset = step_offset if step_offset is not None else int(env.get("MINDPULSE_RESUME_STEP", "0"))
        self.train_cell = train_cell
        self.ckpt = None
        self.rank = rank if rank is not None else (renv.rank if renv else int(os.environ.get("RANK_ID", "0")))
        self.collect_freq = collect_freq or (renv.collect_freq if renv else 10)
        self.decision_every = decision_every or (renv.decision_every if renv else 1)
        self.total_steps = total_steps if total_steps is not None else (renv.total_steps if renv else 0)
        self.batch_size = batch_size or (renv.batch_size if renv and renv.batch_size else None)
        self.network = network
        self.client = client
        if self.client is None and renv is not None:
            self.client = AggregatorClient.connect(renv)
        self.step_num = self.step_offset
        self.injector = FaultInjector(self.rank)
        if self.rank == 0 and env.get("MINDPULSE_RUN_DIR"):
            from .checkpoint import CheckpointManager

            self.ckpt = CheckpointManager(
                __import__("pathlib").Path(env["MINDPULSE_RUN_DIR"]) / "checkpoints",
                keep_periodic=int(env.get("MINDPULSE_KEEP_CKPT", "5")),
                keep_best=int(env.get("MINDPULSE_KEEP_BEST", "1")),
                fmt=env.get("MINDPULSE_CKPT_FORMAT", "ckpt"),
            )
        self.ckpt_failures = 0
        prof = [int(x) for x in env.get("MINDPULSE_PROFILE_STEPS", "").split(",") if x]
        prof_ranks = {int(x) for x in env.get("MINDPULSE_PROFILE_RANKS", "0").split(",") if x}
        self.profile_window = tuple(prof) if len(prof) == 2 and self.rank in prof_ranks else None
        self._profiler = None
        self._hb_thread: threading.Thread | None = None
        self._hb_stop = threading.Event()
        self.stopped: Directive | None = None
        self._t0: float | None = None
        self._last_end: float | None = None
        self._started = False
        self.on_directive: Callable[[Directive], None] | None = None

    # ---- shared by both entry points ------------------------------------------------
    def _send_event(self, kind: str, message: str = "") -> None:
        pkt = EventPacket(rank=self.rank, kind=kind, ts=time.time(), step=self.step_num, pid=os.getpid(),
                          host=socket.gethostname(), message=message[:4000])
        if self.client:
            self.client.send(pkt.encode())
            self.client.flush()

    def start(self, network: nn.Cell | None = None, train_cell: nn.Cell | None = None, arm_next: bool = True) -> None:
        """Start of training: announce the rank and send the step-0 fingerprint.

        In a hand-written loop call it before the first step (faults for step 1 and the
        fingerprint of the weights before any update need it); `step()` calls it otherwise.
        """
        if train_cell is not None:
            self.train_cell = train_cell
        if self._started:
            return
        self._started = True
        if network is not None and self.network is None:
            self.network = network
        self.injector.bind(self.train_cell, self.network)
        self._send_event("start")
        self._weight_stats_setup()
        self._start_heartbeat()
        if self.step_offset == 0:
            self.injector.before_step(0)  # desync@R:0 perturbs the weights before step 0's fingerprint
        fp, norm = self._fingerprint()
        pkt = StepPacket(rank=self.rank, step=self.step_offset, ts=time.time(), fingerprint=fp, param_norm=norm,
                         decision=True)
        self._ship(pkt)
        if arm_next:
            self.injector.before_step(self.step_offset + 1)

    def _start_heartbeat(self) -> None:
        """A thread independent of the training loop says "alive, at step N" every few
        seconds: a rank whose heartbeat stops (SIGSTOP, a dead host) is told apart from
        ranks that are alive but blocked in a collective. SIGUSR1 dumps every thread's
        Python stack into the rank's log (the launcher uses it on a hang)."""
        if self.renv is None or self._hb_thread is not None:
            return
        try:
            faulthandler.register(signal.SIGUSR1, all_threads=True)
        except (ValueError, AttributeError, RuntimeError):
            pass  # not the main thread, or no such signal: stacks then come from py-spy only
        interval = max(0.5, min(5.0, float(os.environ.get("MINDPULSE_HANG_TIMEOUT_S", "300")) / 4))
        renv = self.renv

        def beat() -> None:
            client = None
            try:
                client = AggregatorClient.connect(renv)
            except Exception as exc:
                log.warning("[rank %d] heartbeat has no connection: %s", self.rank, exc)
                return
            while not self._hb_stop.wait(interval):
                pkt = EventPacket(rank=self.rank, kind="heartbeat", ts=time.time(), step=self.step_num,
                                  pid=os.getpid())
                try:
                    client.send(pkt.encode())
                    client.flush()
                except Exception:
                    pass

        self._hb_thread = threading.Thread(target=beat, name="mindpulse-heartbeat", daemon=True)
        self._hb_thread.start()

    def _fingerprint(self) -> tuple[str | None, float | None]:
        if self.network is None:
            return None, None
        try:
            self._last_sums = param_sums(model_parameters(self.network))
            return fingerprint_of(self._last_sums)
        except Exception as exc:
            log.warning("[rank %d] fingerprint failed: %s", self.rank, exc)
            self._last_sums = None
            return None, None

    def _weight_stats_setup(self) -> None:
        """Per-layer statistics every collect_freq steps (rank 0 ships them: data-parallel
        weights are identical), and the model's structure once."""
        self.weight_stats = None
        if self.rank != 0 or self.network is None or os.environ.get("MINDPULSE_WEIGHT_STATS", "1") != "1":
            return
        try:
            from .weight_stats import WeightStats, structure_text

            params = model_parameters(self.network)
            self.weight_stats = WeightStats(params, os.environ.get("MINDPULSE_HIST_REGEX", DEFAULT_HIST_REGEX),
                                            self.train_cell)
            text = structure_text(params)
            if self.client:
                pkt = EventPacket(rank=self.rank, kind="structure", ts=time.time(), message=text[:60000])
                self.client.send(pkt.encode())
        except Exception as exc:
            log.warning("[rank %d] weight statistics are off: %s", self.rank, exc)
            self.weight_stats = None

    def _ship(self, pkt: StepPacket) -> Directive | None:
        if self.client is None:
            log.info("[rank %d] step %d loss %s", self.rank, pkt.step, pkt.loss)
            return None
        if pkt.decision:
            d = self.client.decide(pkt.encode(), pkt.step)
            if d.save_kinds and self.rank == 0:
                self._save(d, pkt)
            if d.action is Action.STOP:
                self.stopped = d
            if self.on_directive:
                self.on_directive(d)
            return d
        self.client.send(pkt.encode())
        return None

    def _save(self, d: Directive, pkt: StepPacket) -> None:
        """Rank 0 writes the checkpoint the aggregator asked for; a failed save is
        reported, never fatal: the previous best and the manifest stay valid."""
        import json

        if self.ckpt is None or self.train_cell is None:
            log.warning("[rank 0] asked to save %s at step %d but no checkpoint folder or train cell is known",
                        d.save, pkt.step)
            return
        try:
            entries = self.ckpt.save(self.train_cell, pkt.step, pkt.epoch, d.save_kinds, metric=d.metric,
                                     metric_name=d.metric_name)
            msg = json.dumps([dict(e.__dict__, path=str(self.ckpt.dir / e.path)) for e in entries])
            self._send_event("checkpoint", msg)
        except Exception as exc:
            self.ckpt_failures += 1
            log.error("[rank 0] checkpoint save at step %d failed: %s", pkt.step, exc)
            self._send_event("error", f"checkpoint save at step {pkt.step} failed: {exc}")

    def _profile_begin(self, step: int) -> None:
        """MindSpore's Profiler for the configured window, into RUN_DIR/profile/rank_<r>/."""
        if self.profile_window is None or step != self.profile_window[0] or self._profiler is not None:
            return
        try:
            from mindspore import Profiler

            out = os.path.join(os.environ.get("MINDPULSE_RUN_DIR", "."), "profile", f"rank_{self.rank}")
            os.makedirs(out, exist_ok=True)
            self._profiler = Profiler(output_path=out, start_profile=False)
            self._profiler.start()
            log.info("[rank %d] profiling steps %d..%d into %s", self.rank, *self.profile_window, out)
        except Exception as exc:
            log.error("[rank %d] the profiler did not start: %s", self.rank, exc)
            self.profile_window = None

    def _profile_end(self, step: int, force: bool = False) -> None:
        if self._profiler is None or not (force or step >= self.profile_window[1]):
            return
        prof, self._profiler, self.profile_window = self._profiler, None, None
        try:
            prof.stop()
            prof.analyse()
        except Exception as exc:
            log.error("[rank %d] the profiler did not finish: %s", self.rank, exc)

    def _eval_due(self, s: int) -> bool:
        if self.evaluate is None:
            return False
        if self.eval_every and s % self.eval_every == 0:
            return True
        return bool(self.eval_per_epoch and self.epoch_steps and s % self.epoch_steps == 0)

    def _is_decision(self, s: int) -> bool:
        return bool(
            s % self.decision_every == 0
            or (self.total_steps and s >= self.total_steps)
            or (self.save_steps and s % self.save_steps == 0)
            or self._eval_due(s)
        )

    def record(
        self,
        loss: float | None,
        *,
        step: int | None = None,
        epoch: int = 0,
        lr: float | None = None,
        grad_norm: float | None = None,
        grad_norm_local: float | None = None,
        nan_count: int = 0,
        inf_count: int = 0,
        step_time_s: float | None = None,
        samples: int | None = None,
        extra: dict[str, float] | None = None,
        data_wait_s: float | None = None,
        compute_s: float | None = None,
    ) -> StepOutcome:
        self.step_num = step if step is not None else self.step_num + 1
        s = self.step_num
        fp = norm = None
        weights: dict[str, Any] = {}
        if s % self.collect_freq == 0:
            fp, norm = self._fingerprint()
            ws = getattr(self, "weight_stats", None)
            if ws is not None:
                try:
                    weights = ws.collect(getattr(self, "_last_sums", None))
                except Exception as exc:
                    log.warning("[rank %d] weight statistics failed at step %d: %s", self.rank, s, exc)
        decision = self._is_decision(s)
        if self._eval_due(s):
            try:
                extra = dict(extra or {}, **{k: float(v) for k, v in self.evaluate().items()})
            except Exception as exc:
                log.error("[rank %d] evaluation at step %d failed: %s", self.rank, s, exc)
        pkt = StepPacket(
            rank=self.rank,
            step=s,
            epoch=epoch,
            loss=loss,
            lr=lr,
            grad_norm=grad_norm,
            grad_norm_local=grad_norm_local,
            nan_count=int(nan_count),
            inf_count=int(inf_count),
            step_time_s=step_time_s,
            data_wait_s=data_wait_s,
            compute_s=compute_s,
            samples=int(samples or self.batch_size or 0),
            ts=time.time(),
            fingerprint=fp,
            param_norm=norm,
            decision=bool(decision),
            extra={k: float(v) for k, v in (extra or {}).items()},
            weights=weights,
        )
        self._ship(pkt)
        ws = getattr(self, "weight_stats", None)
        if ws is not None and (s + 1) % self.collect_freq == 0:
            try:
                ws.keep_previous()  # the next step is a collect step: measure its change
            except Exception as exc:
                log.warning("[rank %d] cannot keep the weights for the update ratio: %s", self.rank, exc)
        stop = self.stopped is not None
        reason = self.stopped.reason if self.stopped else ""
        if not stop and self.total_steps and s >= self.total_steps:
            stop, reason = True, f"reached train.steps={self.total_steps}"
        return StepOutcome(step=s, stop=stop, reason=reason)

    def finish(self, message: str = "") -> None:
        self._hb_stop.set()
        self._profile_end(self.step_num, force=True)
        if self.client:
            self.client.flush()
        self._send_event("end", message)

    # ---- hand-written loops -------------------------------------------------------------
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
        **stats: Any,
    ) -> StepOutcome:
        """Report one finished step of a hand-written loop; returns whether to stop.

        `outputs` may be what a `MonitoredTrainOneStepCell` returned (loss and grad
        statistics are then read from it) or a loss tensor/number.
        """
        now = time.perf_counter()
        if train_cell is not None:
            self.train_cell = train_cell
        if not self._started:
            self.start(network)
        elif network is not None and self.network is None:
            self.network = network
        if outputs is not None:
            out_loss, out_stats = split_outputs(outputs)
            loss = out_loss if loss is None else loss
            for k, v in out_stats.items():
                stats.setdefault(k, v)
        step_time = now - self._last_end if self._last_end is not None else None
        outcome = self.record(
            loss,
            epoch=epoch,
            lr=lr_of_step(optimizer, self.step_num) if optimizer is not None else stats.pop("lr", None),
            step_time_s=step_time,
            samples=samples,
            extra=extra,
            **{k: stats[k] for k in ("grad_norm", "grad_norm_local", "nan_count", "inf_count") if k in stats},
        )
        self.injector.after_step(self.step_num)
        self._profile_end(self.step_num)
        self.injector.before_step(self.step_num + 1)  # faults for the next step of the loop
        self._profile_begin(self.step_num + 1)
        self._last_end = time.perf_counter()
        return outcome

    # ---- MindSpore callback ------------------------------------------------------------
    def on_train_begin(self, run_context):
        cb = run_context.original_args()
        net = getattr(cb, "train_network", None)
        inner = getattr(net, "network", net)
        if self.train_cell is None:
            self.train_cell = net
        if hasattr(self.train_cell, "enable_pre_reduce_timing"):
            self.train_cell.enable_pre_reduce_timing()
        if self.batch_size is None:
            ds = getattr(cb, "train_dataset", None)
            try:
                self.batch_size = int(ds.get_batch_size()) if ds is not None else None
            except Exception:
                self.batch_size = None
        self.start(inner, arm_next=False)
        self._last_end = time.perf_counter()

    def on_train_step_begin(self, run_context):
        if self.stopped is not None:  # stopped at the start (e.g. desync at step 0): no step may run
            self.finish("stopped: " + self.stopped.reason)
            raise StopTraining(self.stopped.reason)
        # an injected `slow` delay belongs to the data path: it happens before t0
        self.injector.before_step(self.step_num + 1)
        self._profile_begin(self.step_num + 1)
        self._t0 = time.perf_counter()
        self._data_wait = self._t0 - self._last_end if self._last_end is not None else None

    def on_train_step_end(self, run_context):
        cb = run_context.original_args()
        now = time.perf_counter()
        loss, stats = split_outputs(cb.net_outputs)
        step = self.step_offset + int(cb.cur_step_num)
        self.injector.after_step(step)
        self._profile_end(step)
        # with dataset sinking one callback covers `sink` steps: report the mean step time
        prev = self.step_num
        nsteps = max(1, step - prev)
        start = self._t0 if self._t0 is not None else self._last_end
        step_time = (now - start) / nsteps if start is not None else None
        optimizer = getattr(cb, "optimizer", None) or getattr(cb.train_network, "optimizer", None)
        outcome = self.record(
            loss,
            step=step,
            epoch=(step - 1) // self.epoch_steps + 1 if self.epoch_steps else int(getattr(cb, "cur_epoch_num", 1)),
            lr=lr_of_step(optimizer, step - 1),
            step_time_s=step_time,
            samples=(self.batch_size or 0) * nsteps,
            data_wait_s=getattr(self, "_data_wait", None),
            compute_s=self._compute_time(),
            **stats,
        )
        self._last_end = time.perf_counter()
        if outcome.stop:
            run_context.request_stop()
            log.info("[rank %d] stopping after step %d: %s", self.rank, step, outcome.reason)

    def _compute_time(self) -> float | None:
        ts = getattr(self.train_cell, "pre_reduce_ts", None)
        if ts is None or self._t0 is None or ts < self._t0:
            return None
        return ts - self._t0

    def on_train_end(self, run_context):
        self.finish("stopped: " + self.stopped.reason if self.stopped else "")

