"""What a view of the aggregator is: one `Sink` with a named hook for each thing the aggregator
tells its views, every hook a no-op here. A sink overrides the hooks it draws and nothing else.

The sinks today: the console (`console_sink.py`), TensorBoard (`tb_sink.py`), the Prometheus
endpoint (`prometheus_exporter.py`), MLflow (`mlflow_sink.py`) and SwanLab (`swanlab_sink.py`).
`Sinks` (`sinks.py`) holds them and calls every hook of every sink in that order; a hook that
raises is counted and said once (a view never costs the training a step).

A new sink: subclass `Sink`, override its hooks, and start it in `Sinks.open_outputs` (from its
config section).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mindpulse.reduction.reducer import ReducedStep
from mindpulse.wire.directives import Directive


class Sink:
    """A view of the aggregator: every hook does nothing until a sink overrides it."""

    def watch_progress(self, clocks: Any) -> None:
        """The aggregator's hang clocks (`hang_clocks.py`), given once at the start: when each rank
        and node last finished a step, for a view that reads them itself (the endpoint's scrape)."""

    def on_text(self, tag: str, text: str, step: int = 0) -> None:
        """A text of the run: `config` (the resolved YAML, at the start), `model/structure`."""

    def on_milestone(self, text: str, step: int) -> None:
        """A moment of the run (start, first step, a checkpoint, an anomaly, a rule change, the end)."""

    def on_reduced(self, red: ReducedStep, also: Sequence[tuple[str, Any]] = (),
                   directive: Directive | None = None) -> None:
        """A reduced step, drawn after its lease went out: `also`, the scalars only the aggregator
        knows for it (`goodput/ettr`); `directive`, what was decided at it (None: not given)."""

    def on_anomaly(self, record: dict[str, Any]) -> None:
        """A rule fired (anomalies.jsonl's record: rule, step, rank, value, threshold, action, message)."""

    def on_note(self, text: str) -> None:
        """A line for the person watching (a stop decided, a rule that failed, a checkpoint written)."""

    def on_telemetry(self, node: str, cards: list[dict[str, Any]], ts: float, step: int) -> None:
        """One node's card sample (each card's record carries `node` and `ts`); `step`: the newest reduced."""

    def on_checkpoint(self, step: int, entries: Sequence[dict[str, Any]] = ()) -> None:
        """Rank 0 wrote checkpoints after `step` (`entries`: each one's kind, path, step, metric)."""

    def on_rank_error(self, rank: int, step: int = 0, message: str = "") -> None:
        """A rank reported an error (training may go on)."""

    def close(self) -> None:
        """The run's end: flush and let go of what the sink holds."""


__all__ = ["Sink"]
