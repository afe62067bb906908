"""The job as one MLflow run (`sinks.mlflow`, `pip install 'mindpulse[mlflow]'`).

One run per job, named after the run directory: the resolved config as its parameters (and
whole as the `config.yaml` artifact), the scalars TensorBoard writes under the same names
(`loss/mean`, `rank_3/loss`, `card_node0_1/util`, ...; MLflow keys keep the `/`) at the
training step, each anomaly as a JSON artifact under `anomalies/` plus the `mindpulse.last_anomaly`
tag, the last checkpoint's step as a tag. A resumed attempt continues the same run (its id is
kept in `RUN_DIR/trackers.json`).

Where: `sinks.mlflow.tracking_uri`, by default a file store in `<output.root>/mlruns` on this
machine (nothing leaves it unless the config names a server). MLflow 3 keeps its file store
only behind `MLFLOW_ALLOW_FILE_STORE=true` (it recommends a database, which needs SQLAlchemy and
migrations at each start); the aggregator sets it for a file store it writes to.

Cost: the aggregator's thread only builds the step's metric list (`log_batch` of a file store
took ~3 ms for 40 metrics, a server's a round trip): one writer thread sends them in order. A
write that fails (disk full, a server gone) is raised on the sink's next call, so
`Sinks` counts and says it; the training never waits for MLflow.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

from mindpulse.config import MlflowConfig, RunConfig
from mindpulse.reduction.reducer import ReducedStep
from mindpulse.wire.directives import Directive

from .card_series import CardSeries
from .sink import Sink
from .tracker_scalars import (
    TrackerFailed,
    TrackerIds,
    TrackerMissing,
    anomaly_step,
    anomaly_text,
    flat_params,
    step_scalars,
)

log = logging.getLogger(__name__)

MAX_PENDING = 4096
"""Writes waiting for the writer thread; beyond, new ones are dropped and counted (a slow server
must not grow the aggregator's memory without end)."""
CLOSE_WAIT_S = 30.0
"""How long closing waits for the writes still queued."""


def default_tracking_uri(run_dir: Path) -> str:
    """A file store in `<output.root>/mlruns`: the run directory's parent is `output.root`."""
    return (Path(run_dir).resolve().parent / "mlruns").as_uri()


class _Writer:
    """One daemon thread running queued writes in order; failures kept for the next `check`."""

    def __init__(self) -> None:
        self._queue: queue.Queue[Callable[[], Any] | None] = queue.Queue(maxsize=MAX_PENDING)
        self._lock = threading.Lock()
        self._failed: list[str] = []
        self.failures = 0
        self.dropped = 0
        self._thread = threading.Thread(target=self._loop, name="mindpulse-mlflow", daemon=True)
        self._thread.start()

    def put(self, write: Callable[[], Any]) -> None:
        try:
            self._queue.put_nowait(write)
        except queue.Full:
            with self._lock:
                self.dropped += 1
                self._failed.append(f"{MAX_PENDING} writes were waiting; this one was dropped")

    def _loop(self) -> None:
        while True:
            write = self._queue.get()
            if write is None:
                return
            try:
                write()
            except Exception as exc:  # a tracker never stops the training: kept, raised on the next call
                with self._lock:
                    self.failures += 1
                    self._failed.append(f"{type(exc).__name__}: {exc}")

    def check(self) -> None:
        """Raise the failures since the last check (one error naming how many and the first)."""
        with self._lock:
            failed, self._failed = self._failed, []
        if failed:
            more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
            raise TrackerFailed(f"MLflow write failed: {failed[0]}{more}")

    def close(self, wait_s: float) -> bool:
        """Let the queued writes finish (up to `wait_s`); False if some were still waiting."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                self._queue.put(None, timeout=max(0.01, deadline - time.monotonic()))
                break
            except queue.Full:
                if time.monotonic() >= deadline:
                    return False
        self._thread.join(max(0.0, deadline - time.monotonic()))
        return not self._thread.is_alive()


class MlflowSink(Sink):
    """`on_reduced`, `on_telemetry`, `on_anomaly`, `on_checkpoint`, `close` of one MLflow run."""

    def __init__(self, cfg: MlflowConfig, *, run_dir: Path, config: RunConfig, attempt: int):
        try:
            import mlflow  # noqa: F401  (the package first: its parts may be loaded while it is not usable)
            from mlflow.entities import Metric, Param, RunStatus, RunTag
            from mlflow.exceptions import MlflowException
            from mlflow.tracking import MlflowClient
            from mlflow.utils.validation import MAX_METRICS_PER_BATCH, MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH
        except ImportError:
            raise TrackerMissing("sinks.mlflow.enabled", "mlflow-skinny", "'mindpulse[mlflow]'") from None
        self._Metric, self._Param, self._RunTag = Metric, Param, RunTag
        self._batch = MAX_METRICS_PER_BATCH
        self.run_dir = Path(run_dir)
        self.collect_freq = config.monitor.collect_freq
        self.straggler_threshold = config.monitor.straggler_threshold
        self.cards = CardSeries(config.world.world_size)  # TensorBoard's grain: the same tags
        self.tracking_uri = cfg.tracking_uri or default_tracking_uri(self.run_dir)
        if self.tracking_uri.startswith("file:") or "://" not in self.tracking_uri:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3: the file store is opt-in
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        self.notes: list[str] = []
        """What the aggregator says when the sink opened (a resumed run, a run that could not be)."""
        ids = TrackerIds(self.run_dir)
        before = ids.get("mlflow")
        self.run_id = ""
        self.resumed = False
        if before and before.get("experiment", cfg.experiment) != cfg.experiment:
            self.notes.append(f"sinks.mlflow.experiment changed since the earlier attempt ({before.get('experiment')} "
                              f"-> {cfg.experiment}): a new MLflow run is started")
            before = None
        if before and before.get("tracking_uri") == self.tracking_uri:
            try:
                self.client.update_run(before["run_id"], status=RunStatus.to_string(RunStatus.RUNNING))
                self.run_id, self.resumed = str(before["run_id"]), True
            except MlflowException as exc:
                self.notes.append(f"MLflow run {before['run_id']} of the earlier attempt cannot be continued "
                                  f"({exc.message}); a new run is started")
        elif before:
            self.notes.append(f"sinks.mlflow.tracking_uri changed since the earlier attempt "
                              f"({before.get('tracking_uri')} -> {self.tracking_uri}): a new MLflow run is started")
        if not self.run_id:
            experiment_id = self._experiment(cfg.experiment, MlflowException)
            run = self.client.create_run(experiment_id, run_name=self.run_dir.name, tags={
                "mindpulse.run_dir": str(self.run_dir.resolve()), "mindpulse.attempt": str(attempt)})
            self.run_id = run.info.run_id
            ids.put("mlflow", {"run_id": self.run_id, "tracking_uri": self.tracking_uri,
                               "experiment_id": experiment_id, "experiment": cfg.experiment})
        self._log_config(config, attempt, MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH)
        self._anomalies = 0
        self._writer = _Writer()
        self.closed = False

    # ---- opening -----------------------------------------------------------------------------
    def _experiment(self, name: str, error: type[Exception]) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        try:
            return self.client.create_experiment(name)
        except error:  # another job created it between the look-up and now: use theirs
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            return found.experiment_id

    def _log_config(self, config: RunConfig, attempt: int, max_len: int, per_batch: int) -> None:
        """The flat config as parameters (a value longer than MLflow takes is cut, saying so; the
        `config.yaml` artifact holds it whole). A resumed run logs only new keys: MLflow refuses
        to change a parameter, so a value changed since is a `config_changed.<key>` tag."""
        params = {}
        for key, value in flat_params(config).items():
            if len(value) > max_len:
                note = f" ... (truncated from {len(value)} characters; whole in the config.yaml artifact)"
                value = value[:max_len - len(note)] + note
            params[key] = value
        tags = [self._RunTag("mindpulse.attempt", str(attempt))]
        if self.resumed:
            had = self.client.get_run(self.run_id).data.params
            tags += [self._RunTag(f"config_changed.{k}", f"attempt {attempt}: {v}"[:max_len])
                     for k, v in params.items() if k in had and had[k] != v]
            params = {k: v for k, v in params.items() if k not in had}
        items = [self._Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), per_batch):
            self.client.log_batch(self.run_id, params=items[i:i + per_batch])
        for i in range(0, len(tags), per_batch):
            self.client.log_batch(self.run_id, tags=tags[i:i + per_batch])
        self.client.log_text(self.run_id, yaml.safe_dump(config.to_dict(), sort_keys=False),
                             f"config.attempt_{attempt}.yaml" if self.resumed else "config.yaml")

    @property
    def where(self) -> str:
        return f"MLflow run {self.run_id} ({'continued' if self.resumed else 'new'}) in {self.tracking_uri}"

    # ---- inputs ------------------------------------------------------------------------------
    def _metrics(self, items: list[tuple[str, float]], step: int, ts: float | None) -> None:
        if not self.closed:
            self._queue_metrics(items, step, ts)
        self._writer.check()

    def _queue_metrics(self, items: list[tuple[str, float]], step: int, ts: float | None) -> None:
        ms = int((ts if ts and ts > 0 else time.time()) * 1000)
        metrics = [self._Metric(key, value, ms, step) for key, value in items]
        for i in range(0, len(metrics), self._batch):
            chunk = metrics[i:i + self._batch]
            self._writer.put(lambda chunk=chunk: self.client.log_batch(self.run_id, metrics=chunk))

    def on_reduced(self, red: ReducedStep, also: Sequence[tuple[str, Any]] | None = (),
                   directive: Directive | None = None) -> None:
        self._metrics(step_scalars(red, also, collect_freq=self.collect_freq,
                                   straggler_threshold=self.straggler_threshold), int(red.step), red.ts)

    def on_telemetry(self, node: str, cards: list[dict], ts: float, step: int) -> None:
        for at, items in self.cards.sample(node, cards, int(step)):
            self._metrics(items, at, ts)

    def on_anomaly(self, record: dict) -> None:
        if self.closed:
            return
        self._anomalies += 1
        step, text = anomaly_step(record), anomaly_text(record)
        rule = str(record.get("rule", "anomaly")) if isinstance(record, dict) else "anomaly"
        name = f"anomalies/step_{step:09d}_{self._anomalies:05d}_{_file_part(rule)}.json"
        short = text if len(text) <= 500 else text[:497] + "..."
        self._writer.put(lambda: self.client.log_text(self.run_id, text + "\n", name))
        self._writer.put(lambda: self.client.set_tag(self.run_id, "mindpulse.last_anomaly", short))
        self._writer.check()

    def on_checkpoint(self, step: int, entries: Sequence[dict[str, Any]] = ()) -> None:
        if self.closed:
            return
        self._writer.put(lambda: self.client.set_tag(self.run_id, "mindpulse.last_checkpoint_step", str(step)))
        self._writer.check()

    # ---- lifetime ----------------------------------------------------------------------------
    def close(self) -> None:
        """Finish the queued writes (up to `CLOSE_WAIT_S`), end the run, raise what failed."""
        if self.closed:
            return
        for at, items in self.cards.drain():  # the job's last point of card extremes (queued: no raise here)
            self._queue_metrics(items, at, None)
        self.closed = True
        drained = self._writer.close(CLOSE_WAIT_S)
        self.client.set_terminated(self.run_id, "FINISHED")
        self._writer.check()
        if not drained:
            raise TrackerFailed(f"MLflow writes still waiting after {CLOSE_WAIT_S:g} s at the end were left out")


def _file_part(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in text)[:60] or "anomaly"


__all__ = ["MlflowSink", "default_tracking_uri"]
