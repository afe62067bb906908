"""TensorBoard event files for a run: one writer under `RUN_DIR/tb/`, owned by the aggregator.

Every public method is safe to call from the aggregator's hot path: a failure is logged
(once per kind, then only counted) and never raised, so monitoring can not stop training.
Events are written as they are made (no queue, no pickling); the file is flushed every
`flush_secs` when something was written, at `flush()` and at close.

Tags written:

* cluster scalars: the metric registry's tags (mindpulse/registry/metrics.py, `Reduction.tb`: `loss/mean`,
  `grad_norm/global`, `lr`, `throughput/samples_per_s`, `step_time/max`, `monitor/self_s/max`, ...),
  `compute/mfu/*`, and `extra/<name>` (the ranks' mean);
* per-rank scalars of the ranks that matter: the registry's `rank_scalars` (`StepMetric.rank_tb`:
  `rank_<r>/loss`, `rank_<r>/grad_norm_local`, `rank_<r>/step_time`, `rank_<r>/tflops`,
  `rank_<r>/monitor_self_s`; and `rank_<r>/mfu`), and `straggler_score` (`step_items`, which the
  trackers write too);
* the histogram `grad_norm_local/ranks` of the ranks' local grad norms;
* card scalars at the job's grain (card_series.py): `card_<node>_<card>/util`, `/memory_used_mb`,
  `/power_w`, `/temp_c` up to 256 cards; each node sample's extremes `cards_<node>/util_min`,
  `/memory_used_mb_max`, `/power_w_max`, `/temp_c_max` up to 1,024; the job's extremes
  `cards/util_min`, ... over every node's latest sample, once a step, above;
* text: `anomalies`, `loss/nonfinite` (a marker for each step with a NaN/Inf loss), and
  whatever `on_text` is given (`config`, `milestones`).
"""

from __future__ import annotations

import atexit
import itertools
import json
import logging
import math
import os
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mindpulse.common.formatting import cell, finite_float
from mindpulse.config import MonitorConfig
from mindpulse.reduction.partial import collect_ranks
from mindpulse.reduction.reducer import ReducedStep
from mindpulse.registry.metrics import rank_scalars, tb_scalars
from mindpulse.wire.directives import Directive

from .card_series import CardSeries
from .card_series import tag_part as _tag_part
from .sink import Sink

log = logging.getLogger(__name__)

_CLUSTER_SCALARS: tuple[tuple[str, str, str | None], ...] = (
    *tb_scalars(),
    ("compute/mfu/mean", "mfu_mean", None),
    ("compute/mfu/min", "mfu_min", None),
    ("compute/mfu/max", "mfu_max", None),
)
"""(tag, ReducedStep field, written only when this field is not None): the metric registry's
(mindpulse/registry/metrics.py: `Reduction.tb`), and the MFU against the card's peak."""
_MAX_TEXT_CHARS = 256 * 1024
_WRITER_SEQ = itertools.count()


_number = finite_float


def _text(x: Any) -> str:
    """A value in a TensorBoard text: floats to six significant digits, the rest as it is."""
    return cell(x, ".6g", scientific=False)


def _md_escape(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def summary_writer(logdir: Path, flush_secs: float, suffix: str,
                   on_error: Callable[[BaseException], None] = lambda exc: None) -> Any:
    """tensorboardX's `SummaryWriter` with its event file written in the caller's thread.

    Its own `EventFileWriter` hands every event through a `multiprocessing.Queue` to a
    writer thread: each one is pickled, sent down a pipe and unpickled, in the same
    process; that was 0.2-0.3 ms of the aggregator's CPU per event. Here an event is
    appended (buffered) as it is made; the file is flushed every `flush_secs` when
    something was written, at `flush()`, at `close()` and when the interpreter exits. A
    failed periodic flush goes to `on_error` (and is tried again next time). (Relies on
    `SummaryWriter._get_file_writer`, tensorboardX 2.6.)"""
    from tensorboardX import FileWriter, SummaryWriter
    from tensorboardX.event_file_writer import EventsWriter

    class Events:
        def __init__(self) -> None:
            self._out = EventsWriter(os.path.join(str(logdir), "events"), suffix)
            self._written = False
            self._closed = False
            self._lock = threading.Lock()
            self._wake = threading.Event()
            # what was written reaches the file within flush_secs even when events stop
            # coming (a hung run): a thread that wakes every flush_secs, nothing per event
            threading.Thread(target=self._flusher, name="mindpulse-tb-flush", daemon=True).start()
            atexit.register(self.close)

        def get_logdir(self) -> str:
            return str(logdir)

        def add_event(self, event: Any) -> None:
            self._out.write_event(event)  # under the EventsWriter's lock, as its flush is
            self._written = True

        def _flusher(self) -> None:
            while not self._wake.wait(flush_secs):
                if self._written:
                    try:
                        self.flush()
                    except Exception as exc:  # disk full, a lost mount: counted, tried again
                        on_error(exc)

        def flush(self) -> None:
            with self._lock:
                if not self._closed:
                    self._written = False
                    self._out.flush()

        def close(self) -> None:
            with self._lock:
                if self._closed:
                    return
                self._closed = True
                self._wake.set()
                try:
                    self._out.flush()
                finally:
                    self._out.close()
                    atexit.unregister(self.close)

    class Files(FileWriter):
        def __init__(self) -> None:  # FileWriter's add_* methods, this event file
            self.event_writer = Events()
            self._default_metadata: dict[str, Any] = {}

    class Writer(SummaryWriter):
        def _get_file_writer(self) -> Any:
            if self.all_writers is None or self.file_writer is None:
                self.file_writer = Files()
                self.all_writers = {self.file_writer.get_logdir(): self.file_writer}
            return self.file_writer

    return Writer(logdir=str(logdir), flush_secs=flush_secs, filename_suffix=suffix)


class TensorBoardSink(Sink):
    """Writes the aggregator's view of a run as TensorBoard events under `run_dir/tb`."""

    def __init__(self, run_dir: Path, flush_secs: float = 10.0, collect_freq: int = MonitorConfig.collect_freq,
                 straggler_threshold: float = MonitorConfig.straggler_threshold, cards: int = 0):
        """`collect_freq`: every rank's scalars every N steps; the steps between carry the
        ranks that matter (extremes, non-finite ranks, stragglers), so the work per step
        does not grow with the ranks. `cards`: the job's cards (its world size), which sets
        the grain its card samples are written at (card_series.py)."""
        self.cards = CardSeries(cards)
        self.run_dir = Path(run_dir)
        self.collect_freq = max(1, collect_freq)
        self.straggler_threshold = straggler_threshold
        self.logdir = self.run_dir / "tb"
        self.flush_secs = flush_secs
        self.errors: Counter[str] = Counter()
        """Failures by kind (`open`, `reduced`, `telemetry`, `anomaly`, `text`, `flush`, `close`)."""
        self.closed = False
        self._lock = threading.Lock()
        self._text_steps: dict[str, int] = {}
        self._writer: Any = None
        try:
            self.logdir.mkdir(parents=True, exist_ok=True)
            # the pid in the name: a restarted aggregator never truncates an earlier file
            # (tensorboardX names files by the second and opens them with "wb")
            self._writer = summary_writer(self.logdir, flush_secs, f".{os.getpid()}.{next(_WRITER_SEQ)}",
                                          on_error=lambda exc: self._error("flush", exc))
        except Exception as exc:  # a sink's failure must not stop the aggregator: counted, logged
            self._error("open", exc)

    # ---- bookkeeping -------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self._writer is not None and not self.closed

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    def _error(self, kind: str, exc: BaseException) -> None:
        self.errors[kind] += 1
        if self.errors[kind] == 1:
            log.warning("TensorBoard sink: %s failed (%s: %s); further %s failures are only counted",
                        kind, type(exc).__name__, exc, kind)
        else:
            log.debug("TensorBoard sink: %s failed again: %s", kind, exc)

    def _scalars(self, items: list[tuple[str, Any]], step: int, walltime: float | None,
                 more: list[Any] | None = None) -> int:
        """Every numeric `(tag, value)` of `items` (and `more`, ready summary values such as
        histograms) as one event: one summary holding many values costs ~3 µs a value
        against ~70-280 µs for one event per scalar (`add_scalar`: each event crosses
        tensorboardX's writer queue), and TensorBoard reads each value under its own tag
        all the same."""
        from tensorboardX.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=tag, simple_value=v) for tag, v in
                  ((t, _number(x)) for t, x in items) if v is not None] + list(more or [])
        if values:
            self._writer.file_writer.add_summary(Summary(value=values), step, walltime)
        return len(values)

    def _add_text(self, tag: str, text: str, step: int, walltime: float | None = None) -> None:
        # TensorBoard hides earlier events of a tag when a smaller step follows (it takes
        # that for a restart), so text steps never go back; the text carries the true step.
        step = max(int(step), self._text_steps.get(tag, 0))
        self._text_steps[tag] = step
        if len(text) > _MAX_TEXT_CHARS:
            text = text[:_MAX_TEXT_CHARS] + "\n\n... (truncated)"
        self._writer.add_text(tag, text, global_step=step, walltime=walltime)

    # ---- inputs ------------------------------------------------------------------------
    def on_reduced(self, red: ReducedStep, also: Sequence[tuple[str, Any]] | None = (),
                   directive: Directive | None = None) -> None:
        """Cluster, per-rank, histogram and extra scalars of one reduced step (and `also`,
        more scalars of that step), as one event; then the weight statistics a rank sent with it."""
        if not self.enabled:
            return
        try:
            with self._lock:
                self._write_reduced(red, list(also or ()))
            weights = next((p.weights for p in (red.per_rank or {}).values() if getattr(p, "weights", None)), None)
        except Exception as exc:  # a sink's failure must not stop the aggregator: counted, logged
            self._error("reduced", exc)
            return
        if weights:
            self.on_weights(red.step, weights)

    def _write_reduced(self, red: ReducedStep, also: list[tuple[str, Any]]) -> None:
        step = int(red.step)
        if step == 0 and red.loss_mean is None:
            return  # the step-0 report only carries fingerprints
        wt = red.ts if _number(red.ts) and red.ts > 0 else None
        scalars, shown = step_items(red, self.collect_freq, self.straggler_threshold)
        every_rank = bool(collect_ranks(step, red.world_size, self.collect_freq))
        local_norms = [g for r in shown if (g := _number(getattr(red.per_rank[r], "grad_norm_local", None)))
                       is not None]
        from tensorboardX.summary import histogram_raw

        # the histograms over every rank (every step) travel in the same event as the scalars
        histos = [v for name, h in (red.histograms or {}).items()
                  for v in histogram_raw(f"ranks/{name}", **h).value]
        self._scalars(scalars + also, step, wt, histos)
        if local_norms and every_rank:
            import numpy as np

            self._writer.add_histogram("grad_norm_local/ranks", np.asarray(local_norms, dtype=np.float64),
                                       global_step=step, walltime=wt)
        loss = red.loss_mean
        if loss is not None and isinstance(loss, (int, float)) and not math.isfinite(loss):
            bad = {r: p.loss for r, p in (red.per_rank or {}).items()
                   if p.loss is not None and not math.isfinite(p.loss)}
            ranks = sorted(set(red.nonfinite_ranks or []) | set(bad))
            lines = [f"**non-finite loss** at step {step}: loss/mean = {_text(loss)}",
                     f"ranks with non-finite values: {ranks}"]
            lines += [f"- rank {r}: loss {_text(v)}" for r, v in sorted(bad.items())]
            self._add_text("loss/nonfinite", "\n\n".join(lines), step, wt)

    def on_scalars(self, items: list[tuple[str, Any]], step: int, ts: float | None = None) -> None:
        """Named scalars of one step (e.g. `goodput/ettr`) as one event."""
        if not self.enabled:
            return
        try:
            with self._lock:
                self._scalars(items, int(step), ts if _number(ts) and ts > 0 else None)
        except Exception as exc:  # a sink's failure must not stop the aggregator: counted, logged
            self._error("scalars", exc)

    def on_weights(self, step: int, weights: dict) -> None:
        """Per-layer norms and update ratios as scalars; weight and gradient histograms."""
        if not self.enabled:
            return
        try:
            with self._lock:
                norms = [(f"weights/{_tag_part(name)}/norm", v) for name, v in (weights.get("norms") or {}).items()]
                ratios = [(f"weights/{_tag_part(name)}/update_ratio", v)
                          for name, v in (weights.get("update_ratio") or {}).items()]
                self._scalars(norms + ratios, int(step), None)
                for group, prefix in (("hist", "weights"), ("grad_hist", "grads")):
                    for name, h in (weights.get(group) or {}).items():
                        if not h.get("counts"):
                            continue
                        self._writer.add_histogram_raw(
                            f"{prefix}/{_tag_part(name)}", min=h["min"], max=h["max"], num=h["num"], sum=h["sum"],
                            sum_squares=h["sum_squares"], bucket_limits=h["edges"], bucket_counts=h["counts"],
                            global_step=int(step))
        except Exception as exc:  # a sink's failure must not stop the aggregator: counted, logged
            self._error("weights", exc)

    def on_telemetry(self, node: str, cards: list[dict], ts: float, step: int) -> None:
        """A node's card sample (util / memory / power / temperature) at the job's grain."""
        if not self.enabled:
            return
        try:
            with self._lock:
                points = self.cards.sample(node, cards, int(step))
                wt = ts if _number(ts) and ts > 0 else None
                for at, items in points:
                    self._scalars(items, at, wt)
        except Exception as exc:  # a sink's failure must not stop the aggregator: counted, logged
            self._error("telemetry", exc)

    def on_anomaly(self, record: dict) -> None:
        """One anomaly record (rule, step, rank, value, threshold, action, message) as text."""
        if not self.enabled:
            return
        try:
            with self._lock:
                rec = record if isinstance(record, dict) else {"message": str(record)}
                step = rec.get("step")
                step = int(step) if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else 0
                rows = ["| field | value |", "|---|---|"]
                for key in ("rule", "step", "rank", "value", "threshold", "action", "message"):
                    rows.append(f"| {key} | {_md_escape(_text(rec.get(key)))} |")
                others = {k: v for k, v in rec.items()
                          if k not in ("rule", "step", "rank", "value", "threshold", "action", "message")}
                if others:
                    rows.append(f"| other | {_md_escape(json.dumps(others, default=str))} |")
                head = (f"**{_md_escape(_text(rec.get('rule')))}** at step {_text(rec.get('step'))}"
                        f" (rank {_text(rec.get('rank'))}): {_md_escape(_text(rec.get('action')))}")
                self._add_text("anomalies", head + "\n\n" + "\n".join(rows), step)
        except Exception as exc:  # a sink's failure must not stop the aggregator: counted, logged
            self._error("anomaly", exc)

    def on_milestone(self, text: str, step: int) -> None:
        self.on_text("milestones", text, step)

    def on_text(self, tag: str, text: str, step: int = 0) -> None:
        """A free text event (`config` is the resolved config YAML, `milestones` run events)."""
        if not self.enabled:
            return
        try:
            with self._lock:
                body = str(text)
                if tag == "config":
                    # markdown would reflow YAML: indent it as a code block
                    body = "\n".join("    " + line for line in body.splitlines())
                self._add_text(str(tag), body, int(step))
        except Exception as exc:  # a sink's failure must not stop the aggregator: counted, logged
            self._error("text", exc)

    # ---- lifetime ----------------------------------------------------------------------
    def flush(self) -> None:
        """Flush the event file (every record handed to the writer is in it)."""
        if not self.enabled:
            return
        try:
            with self._lock:
                self._writer.flush()
        except Exception as exc:  # a sink's failure must not stop the aggregator: counted, logged
            self._error("flush", exc)

    def close(self) -> None:
        """Flush and close the event file; later calls do nothing."""
        if self._writer is None or self.closed:
            return
        try:
            with self._lock:
                for at, items in self.cards.drain():  # the job's last step of card extremes
                    self._scalars(items, at, None)
                self.closed = True
                self._writer.flush()
                self._writer.close()
        except Exception as exc:  # a sink's failure must not stop the aggregator: counted, logged
            self._error("close", exc)

    def __enter__(self) -> TensorBoardSink:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()



def step_items(red: ReducedStep, collect_freq: int, straggler_threshold: float
               ) -> tuple[list[tuple[str, Any]], list[int]]:
    """The scalars of one reduced step, by their TensorBoard tags (TensorBoard and the trackers
    write these): the cluster's, `extra/<name>`, and each shown rank's (the ranks that matter,
    every rank on a collect step: `rank_scalars`, its straggler score); with the shown ranks."""
    items: list[tuple[str, Any]] = [(tag, getattr(red, attr, None)) for tag, attr, when in _CLUSTER_SCALARS
                                    if when is None or getattr(red, when, None) is not None]
    items += [(f"extra/{_tag_part(name)}", value) for name, value in (red.extra or {}).items()]
    matter = red.ranks_that_matter(straggler_threshold) | set(collect_ranks(int(red.step), red.world_size,
                                                                            collect_freq))
    per_rank = red.per_rank or {}
    peak = _number(getattr(red, "peak_tflops", None))
    shown = [r for r in sorted(matter) if r in per_rank]
    for rank in shown:
        items += [(f"rank_{rank}/{tb}", v) for tb, _, v in rank_scalars(per_rank[rank], peak) if tb]
    items += [(f"rank_{rank}/straggler_score", score)
              for rank, score in (getattr(red, "straggler_scores", None) or {}).items() if rank in matter]
    return items, shown


__all__ = ["TensorBoardSink"]
