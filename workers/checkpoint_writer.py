"""Rank 0's side of a save directive: write the checkpoint the aggregator asked for and
tell it what was written (a `checkpoint` event) or why nothing was (an `error` event).

A failed save is reported, never fatal: the previous best and the manifest stay valid
(`CheckpointManager` writes atomically), and training goes on; the aggregator decides
what a failure means (`checkpoint.on_save_error`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mindpulse.config.rank_settings import RankSettings
from mindpulse.wire.directives import Directive
from mindpulse.wire.protocol import EventKind

from .checkpoint import CheckpointManager

log = logging.getLogger(__name__)

Report = Callable[[EventKind, str], None]
"""Sends an event of the rank (kind, message) to the aggregator."""


class CheckpointWriter:
    def __init__(self, manager: CheckpointManager, report: Report,
                 before_write: Callable[[int], None] | None = None):
        """`before_write(step)`: called inside each write, before the file (fault injection)."""
        self.manager = manager
        self.report = report
        self.before_write = before_write
        self.failures = 0

    @staticmethod
    def for_run(settings: RankSettings, report: Report,
                before_write: Callable[[int], None] | None = None) -> CheckpointWriter:
        """Writes into `RUN_DIR/checkpoints` with the run's retention, format and file mode
        (`output.mode`: private 0600 files in a 0700 folder unless it says `shared`)."""
        ck = settings.checkpoint
        output = (settings.config or {}).get("output") or {}
        mode = output.get("mode", "private") if isinstance(output, dict) else "private"
        manager = CheckpointManager(Path(settings.run_dir) / "checkpoints", keep_periodic=ck.keep_periodic,
                                    keep_best=ck.keep_best, fmt=ck.format, mode=mode)
        return CheckpointWriter(manager, report, before_write)

    def write(self, directive: Directive, step: int, epoch: int, train_cell: Any) -> None:
        """Save `train_cell` (weights and optimizer state) as the directive's kinds; never raises."""
        try:
            entries = self.manager.save(train_cell, step, epoch, directive.save_kinds, metric=directive.metric,
                                        metric_name=directive.metric_name, before_write=self.before_write)
            msg = json.dumps([dict(e.__dict__, path=str(self.manager.dir / e.path)) for e in entries])
            self.report(EventKind.CHECKPOINT, msg)
        except Exception as exc:  # a failed save must not stop training: counted, logged and reported
            self.failures += 1
            log.error("[rank 0] checkpoint save at step %d failed: %s", step, exc)
            self.report(EventKind.ERROR, f"checkpoint save at step {step} failed: {exc}")
