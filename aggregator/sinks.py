"""Where the aggregator's findings go besides the lease and the directives: the console
lines the driver prints, TensorBoard, `anomalies.jsonl`, and the views of a reduced step that
wait until its lease and directive are out.

While the aggregator replays `metrics.msgpack` after a restart (`replaying`), what was
written before the restart is not written again.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .anomaly_log import AnomalyLog

CONSOLE_LINES = 1000
"""Console lines kept until the driver polls them."""


class Sinks:
    def __init__(self, run_dir: Path, *, tensorboard: bool, collect_freq: int, straggler_threshold: float):
        self.console: deque[str] = deque(maxlen=CONSOLE_LINES)
        self.anomalies = AnomalyLog(run_dir)  # a restarted attempt (or aggregator) continues it
        self.replaying = False
        self.defer = False
        """Set (the actor): the views of a reduced step (its TensorBoard event, the console
        table) wait in the queue until `run()`, so the lease and the directive the step
        decided leave first (see `AggregatorActor._moved`); unset: they run as it is reduced."""
        self._views: deque[Callable[[], None]] = deque()
        self.tb: Any = None
        if tensorboard:
            from .tb_sink import TensorBoardSink

            self.tb = TensorBoardSink(run_dir, collect_freq=collect_freq, straggler_threshold=straggler_threshold)

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


__all__ = ["CONSOLE_LINES", "Sinks"]
