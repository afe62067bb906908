"""The job as one SwanLab run (`sinks.swanlab`, `pip install 'mindpulse[swanlab]'`).

One run per job, named after the run directory: the resolved config (flat dotted keys) as its
config, the scalars TensorBoard writes under the same names at the training step, each anomaly
as text under `anomalies/<rule>`, checkpoints as `checkpoint/step`.

Where: `sinks.swanlab.mode` `offline` (the default: files under `sinks.swanlab.logdir`, by
default `RUN_DIR/swanlab`; nothing leaves the machine; `swanlab sync DIR` uploads them when
someone chooses to), `local` (the same files plus the ones `swanlab watch LOGDIR` shows; needs
SwanLab's dashboard, `pip install 'swanlab[dashboard]'`) or `cloud` (SwanLab's server: an
explicit choice). SwanLab's own probes (hardware, pip freeze, git, its system monitor) and its
capture of the process's terminal stay off: the aggregator's process is no training process,
and the cards are the job's telemetry below.

A resumed attempt continues the same run: its id is kept in `RUN_DIR/trackers.json` and given
back to SwanLab (`id=`, `resume="allow"`). Offline and local, SwanLab writes each attempt to a
new folder under the log directory with that same run id (after `mindpulse launch --resume`,
under the new run directory's log directory); `swanlab sync` of the folders puts them into one
cloud run.

SwanLab writes from its own threads and keeps its write errors to its log (`Run.log` never
raises); what this sink sees — a run SwanLab ended (at exit, on a crash) — it raises, so
`Sinks` counts it. SwanLab keeps one value per key and step: of several card samples
within one training step, the first.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mindpulse.config import RunConfig, SwanLabConfig, SwanLabMode
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

_MODES = {SwanLabMode.OFFLINE: "offline", SwanLabMode.LOCAL: "local", SwanLabMode.CLOUD: "online"}
"""mindpulse's mode -> SwanLab's."""


def default_logdir(run_dir: Path) -> Path:
    return Path(run_dir) / "swanlab"


class SwanLabSink(Sink):
    """`on_reduced`, `on_telemetry`, `on_anomaly`, `on_checkpoint`, `close` of one SwanLab run."""

    def __init__(self, cfg: SwanLabConfig, *, run_dir: Path, config: RunConfig, attempt: int):
        try:
            import swanlab
        except ImportError:
            raise TrackerMissing("sinks.swanlab.enabled", "swanlab", "'mindpulse[swanlab]'") from None
        if cfg.mode is SwanLabMode.LOCAL:
            try:
                import swanboard  # noqa: F401  (SwanLab's local mode refuses to start without it)
            except ImportError:
                raise TrackerMissing("sinks.swanlab.mode local", "swanboard", "'swanlab[dashboard]'") from None
        self.run_dir = Path(run_dir)
        self.collect_freq = config.monitor.collect_freq
        self.straggler_threshold = config.monitor.straggler_threshold
        self.cards = CardSeries(config.world.world_size)  # TensorBoard's grain: the same tags
        self.logdir = Path(cfg.logdir) if cfg.logdir else default_logdir(self.run_dir)
        self.mode = _MODES[cfg.mode]
        self.notes: list[str] = []
        ids = TrackerIds(self.run_dir)
        before = ids.get("swanlab")
        if before and before.get("mode") != self.mode:
            self.notes.append(f"sinks.swanlab.mode changed since the earlier attempt ({before.get('mode')} -> "
                              f"{self.mode}): a new SwanLab run is started")
            before = None
        if before and before.get("project", cfg.project) != cfg.project:
            self.notes.append(f"sinks.swanlab.project changed since the earlier attempt ({before.get('project')} -> "
                              f"{cfg.project}): a new SwanLab run is started")
            before = None
        self.resumed = before is not None
        settings = swanlab.Settings(
            interactive=False,  # never a login prompt in the aggregator
            terminal={"proxy_type": "none"},
            probe={"hardware": False, "requirements": False, "conda": False, "git": False, "monitor": False})
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.run = swanlab.init(
            project=cfg.project, workspace=(cfg.workspace or None) if self.mode == "online" else None,
            name=self.run_dir.name, mode=self.mode, log_dir=str(self.logdir), config=flat_params(config),
            id=before["run_id"] if before else None, resume="allow" if before else None, settings=settings)
        self.run_id = str(self.run.id)
        if not self.resumed:
            ids.put("swanlab", {"run_id": self.run_id, "mode": self.mode, "logdir": str(self.logdir),
                                "project": cfg.project})
        self.attempt = attempt
        self.closed = False

    @property
    def where(self) -> str:
        return f"SwanLab run {self.run_id} ({'continued' if self.resumed else 'new'}, {self.mode}) in {self.logdir}"

    def _alive(self) -> bool:
        if self.closed:
            return False
        if not self.run.alive:
            raise TrackerFailed(f"the SwanLab run {self.run_id} ended before the job (SwanLab's log: {self.logdir})")
        return True

    # ---- inputs ------------------------------------------------------------------------------
    def on_reduced(self, red: ReducedStep, also: Sequence[tuple[str, Any]] | None = (),
                   directive: Directive | None = None) -> None:
        items = step_scalars(red, also, collect_freq=self.collect_freq, straggler_threshold=self.straggler_threshold)
        if items and self._alive():
            self.run.log(dict(items), step=int(red.step))

    def on_telemetry(self, node: str, cards: list[dict], ts: float, step: int) -> None:
        for at, items in self.cards.sample(node, cards, int(step)):
            if items and self._alive():
                self.run.log(dict(items), step=at)

    def on_anomaly(self, record: dict) -> None:
        if self._alive():
            rule = str(record.get("rule", "anomaly")) if isinstance(record, dict) else "anomaly"
            key = "anomalies/" + ("".join(c if c.isalnum() or c in "-_" else "_" for c in rule) or "anomaly")
            self.run.log_text(key=key, data=anomaly_text(record), step=anomaly_step(record))

    def on_checkpoint(self, step: int, entries: Sequence[dict[str, Any]] = ()) -> None:
        if self._alive():
            self.run.log({"checkpoint/step": int(step)}, step=int(step))

    # ---- lifetime ----------------------------------------------------------------------------
    def close(self) -> None:
        if self.closed:
            return
        failure: Exception | None = None
        try:
            for at, items in self.cards.drain():  # the job's last point of card extremes
                if items and self._alive():
                    self.run.log(dict(items), step=at)
        except Exception as exc:  # the run is finished all the same; the failure is raised after
            failure = exc
        self.closed = True
        if self.run.alive:
            self.run.finish()
        if failure is not None:
            raise failure


__all__ = ["SwanLabSink", "default_logdir"]
