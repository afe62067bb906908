"""The views of the aggregator, besides the lease and the directives: every `Sink` (sink.py),
called hook by hook in one order, the queue of a reduced step's views that wait until its lease
and directive are out, and `anomalies.jsonl` (appended as a rule fires, before any view).

While the aggregator replays `metrics.msgpack` after a restart (`replaying`), what was
written before the restart is not written again.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mindpulse.config import MonitorConfig, RunConfig
from mindpulse.reduction.reducer import ReducedStep

from .anomaly_log import AnomalyLog
from .console_sink import CONSOLE_LINES, ConsoleSink
from .decisions import Verdict
from .sink import Sink

log = logging.getLogger(__name__)

class Sinks:
    """Every sink of the aggregator, in the order their hooks are called: TensorBoard, the
    trackers (`open_outputs`), the console. A hook that raises is counted (`output_errors`),
    said once per sink and hook, and never raised: a full disk or a gone server costs no step."""

    def __init__(self, run_dir: Path, *, tensorboard: bool, collect_freq: int, straggler_threshold: float,
                 world_size: int = 0, per_print_step: int = MonitorConfig.per_print_step,
                 total_steps: int | None = None, card_tflops: Callable[[dict[str, Any]], float | None] | None = None,
                 errors: Counter[str] | None = None):
        """`card_tflops`, `errors`: the console's (`ConsoleSink`)."""
        self.run_dir = Path(run_dir)
        self.console_sink = ConsoleSink(per_print_step=per_print_step, total_steps=total_steps,
                                        straggler_threshold=straggler_threshold, card_tflops=card_tflops,
                                        errors=errors)
        self.anomalies = AnomalyLog(run_dir)  # a restarted attempt (or aggregator) continues it
        self.replaying = False
        self.defer = False
        """Set (the actor): the views of a reduced step wait in the queue until `run()`, so the
        lease and the directive the step decided leave first (see `AggregatorActor._moved`);
        unset: they are drawn as the step is settled."""
        self._views: deque[Callable[[], None]] = deque()
        self.outputs: list[Sink] = []
        """The trackers besides TensorBoard (`open_outputs`): the Prometheus endpoint, MLflow, SwanLab."""
        self.output_errors: Counter[str] = Counter()
        self.tb: Any = None
        if tensorboard:
            from .tb_sink import TensorBoardSink

            self.tb = TensorBoardSink(run_dir, collect_freq=collect_freq, straggler_threshold=straggler_threshold,
                                      cards=world_size)

    @property
    def console(self) -> deque[str]:
        """The console lines waiting for the driver."""
        return self.console_sink.lines

    @property
    def all(self) -> list[Sink]:
        """Every sink, in the order their hooks are called."""
        return [*([self.tb] if self.tb is not None else []), *self.outputs, self.console_sink]

    # ---- the trackers besides TensorBoard: the Prometheus endpoint, SwanLab, MLflow -------------
    def open_outputs(self, config: RunConfig, *, run: str, attempt: int) -> None:
        """Start the exporters and trackers the config turns on. One that cannot start (a port
        taken since the launch checked it) is reported and left out: the job trains on."""
        prom = config.exporters.prometheus
        if prom.port:
            try:
                from .prometheus_exporter import PrometheusExporter

                exporter = PrometheusExporter(prom, run=run, world_size=config.world.world_size,
                                              ranks_per_node=config.world.ranks_per_node, restarts=attempt,
                                              info=_run_info(config),
                                              straggler_threshold=config.monitor.straggler_threshold)
            except Exception as exc:  # a tracker never stops the training it watches: said, left out
                self.say(f"prometheus endpoint {prom.address}:{prom.port} did not start ({exc}); the run goes on "
                         "without it")
            else:
                self.outputs.append(exporter)
                self.say(f"metrics for Prometheus: {exporter.url}")
        trackers = ((config.sinks.mlflow, "MLflow", "mlflow_sink", "MlflowSink"),
                    (config.sinks.swanlab, "SwanLab", "swanlab_sink", "SwanLabSink"))
        for section, name, module, cls in trackers:
            if not section.enabled:
                continue
            try:  # imported only when turned on: the trackers' packages are optional extras
                sink_type = getattr(importlib.import_module(f".{module}", __package__), cls)
                sink = sink_type(section, run_dir=self.run_dir, config=config, attempt=attempt)
            except Exception as exc:  # a tracker never stops the training it watches: said, left out
                self.say(f"{name} tracker did not start ({exc}); the run goes on without it")
                log.warning("%s tracker did not start", name, exc_info=True)
            else:
                self.outputs.append(sink)
                for note in sink.notes:
                    self.say(note)
                self.say(sink.where)

    def _each(self, hook: str, call: Callable[[Sink], None], sinks: list[Sink] | None = None) -> None:
        """`call(sink)` for every sink (or `sinks`); `hook` names a failure."""
        for out in self.all if sinks is None else sinks:
            try:
                call(out)
            except Exception as exc:  # a view never stops the training it watches: counted, said once
                key = f"{type(out).__name__}.{hook}"
                self.output_errors[key] += 1
                if self.output_errors[key] == 1:
                    self.say(f"{type(out).__name__} failed in {hook} ({type(exc).__name__}: {exc}); counted, "
                             "training goes on")
                log.debug("%s failed", key, exc_info=True)

    # ---- what the aggregator tells its views ---------------------------------------------------
    def say(self, text: str) -> None:
        self.console_sink.say(text)

    def watch_progress(self, clocks: Any) -> None:
        self._each("watch_progress", lambda s: s.watch_progress(clocks))

    def text(self, tag: str, text: str, step: int = 0) -> None:
        if not self.replaying:
            self._each("on_text", lambda s: s.on_text(tag, text, step))

    def milestone(self, text: str, step: int) -> None:
        if not self.replaying:
            stamped = f"{time.strftime('%Y-%m-%d %H:%M:%S')} step {step}: {text}"
            self._each("on_milestone", lambda s: s.on_milestone(stamped, step))

    def reduced(self, red: ReducedStep, also: list[tuple[str, Any]], verdict: Verdict) -> None:
        """A settled step's views, drawn now or once `run()` is called (`defer`): its anomalies
        and notes, then the step itself, sink by sink."""
        if not self.replaying:
            self.view(functools.partial(self._draw_step, red, also, verdict))

    def _draw_step(self, red: ReducedStep, also: list[tuple[str, Any]], verdict: Verdict) -> None:
        self._draw_verdict(verdict)
        self._each("on_reduced", lambda s: s.on_reduced(red, also, verdict.directive))

    def decided(self, verdict: Verdict) -> None:
        """Findings outside a step (rules over a card sample): drawn at once."""
        if not self.replaying:
            self._draw_verdict(verdict)

    def _draw_verdict(self, verdict: Verdict) -> None:
        for rec in verdict.anomalies:
            self._each("on_anomaly", lambda s, rec=rec: s.on_anomaly(rec))
            self.milestone(f"anomaly {rec.get('rule')}: {rec.get('message')}", rec.get("step") or 0)
        for note in verdict.notes:
            self._each("on_note", lambda s, note=note: s.on_note(note))

    def telemetry(self, node: str, cards: list[dict[str, Any]], ts: float, step: int) -> None:
        if not self.replaying:
            self._each("on_telemetry", lambda s: s.on_telemetry(node, cards, ts, step))

    def checkpoint(self, step: int, entries: list[dict[str, Any]]) -> None:
        if self.replaying:
            return
        self._each("on_checkpoint", lambda s: s.on_checkpoint(step, entries))
        for e in entries:
            self.milestone(f"checkpoint {e.get('kind')} {e.get('path')}", e["step"])

    def rank_error(self, rank: int, step: int, message: str) -> None:
        """Every sink but the console while replaying: the endpoint rebuilds a failed rank's series."""
        sinks = [s for s in self.all if s is not self.console_sink] if self.replaying else None
        self._each("on_rank_error", lambda s: s.on_rank_error(rank, step, message), sinks)

    def close(self, end: str, step: int) -> None:
        """The run's end: its milestone, then every sink closes."""
        self.run()
        self.milestone(end, step)
        self._each("close", lambda s: s.close())
        self.outputs.clear()

    # ---- the queue of views waiting for their step's lease -------------------------------------
    def view(self, draw: Callable[[], None]) -> None:
        """A view of a reduced step: drawn now, or once `run()` is called (`defer`)."""
        self._views.append(draw)
        if not self.defer:
            self.run()

    def run(self) -> None:
        """Draw the views the reduced steps left waiting, oldest first."""
        while self._views:
            self._views.popleft()()

    def drain(self) -> list[str]:
        self.run()  # the tables of the steps reduced so far
        return self.console_sink.drain()


def _run_info(config: RunConfig) -> dict[str, str]:
    """The run's metadata for `mindpulse_run_info`: versions read from the installed packages'
    metadata (the aggregator never imports MindSpore)."""
    def version(pkg: str) -> str:
        try:
            return importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            return ""

    return {"mindspore_version": version("mindspore"), "mindformers_version": version("mindformers"),
            "backend": config.backend.value, "world_size": str(config.world.world_size)}


__all__ = ["CONSOLE_LINES", "Sinks"]
