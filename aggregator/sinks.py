"""Where the aggregator's findings go besides the lease and the directives: the console
lines the driver prints, TensorBoard, `anomalies.jsonl`, and the views of a reduced step that
wait until its lease and directive are out.

While the aggregator replays `metrics.msgpack` after a restart (`replaying`), what was
written before the restart is not written again.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mindpulse.config import RunConfig

from .anomaly_log import AnomalyLog

log = logging.getLogger(__name__)

CONSOLE_LINES = 1000
"""Console lines kept until the driver polls them."""


class Sinks:
    def __init__(self, run_dir: Path, *, tensorboard: bool, collect_freq: int, straggler_threshold: float,
                 world_size: int = 0):
        self.run_dir = Path(run_dir)
        self.console: deque[str] = deque(maxlen=CONSOLE_LINES)
        self.anomalies = AnomalyLog(run_dir)  # a restarted attempt (or aggregator) continues it
        self.replaying = False
        self.defer = False
        """Set (the actor): the views of a reduced step (its TensorBoard event, the console
        table) wait in the queue until `run()`, so the lease and the directive the step
        decided leave first (see `AggregatorActor._moved`); unset: they run as it is reduced."""
        self._views: deque[Callable[[], None]] = deque()
        self.outputs: list[Any] = []
        """The trackers besides TensorBoard (`open_outputs`): each may have `on_reduced(red, also)`,
        `on_telemetry(node, cards, ts, step)`, `on_anomaly(record)`, `on_checkpoint(step)`,
        `on_rank_error(rank, step, message)`, `close()`."""
        self.output_errors: Counter[str] = Counter()
        self.tb: Any = None
        if tensorboard:
            from .tb_sink import TensorBoardSink

            self.tb = TensorBoardSink(run_dir, collect_freq=collect_freq, straggler_threshold=straggler_threshold,
                                      cards=world_size)

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

    def each(self, method: str, *args: Any) -> None:
        """Call `method` of every tracker that has it; a failure is counted, said once per
        tracker and method, and never raised (a full disk or a gone server costs no step)."""
        for out in self.outputs:
            fn = getattr(out, method, None)
            if fn is None:
                continue
            try:
                fn(*args)
            except Exception as exc:  # a tracker never stops the training it watches: counted, said once
                key = f"{type(out).__name__}.{method}"
                self.output_errors[key] += 1
                if self.output_errors[key] == 1:
                    self.say(f"{type(out).__name__} failed in {method} ({type(exc).__name__}: {exc}); counted, "
                             "training goes on")
                log.debug("%s failed", key, exc_info=True)

    def close_outputs(self) -> None:
        self.each("close")
        self.outputs.clear()

    def say(self, text: str) -> None:
        self.console.append(text)

    def milestone(self, text: str, step: int) -> None:
        if self.tb is not None and not self.replaying:
            self.tb.on_text("milestones", f"{time.strftime('%Y-%m-%d %H:%M:%S')} step {step}: {text}", step)

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
        out = list(self.console)
        self.console.clear()
        return out


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
