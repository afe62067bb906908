"""After an attempt: run again, or stop? (after torch elastic's restart policy)

A failed attempt is followed by a relaunch of every rank, from the newest valid checkpoint
of this run, while `max_restarts` allows and no interrupt came; anything else ends the run.
Injected faults are not re-armed on a restart (the settings of attempt k > 0 carry none),
so a rehearsal of recovery can succeed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mindpulse.frameworks.framework_support import FrameworkVersionError

from .spec import RunResult, RunStatus


class Decision(str, enum.Enum):
    RESTART = "restart"
    STOP = "stop"


@dataclass(frozen=True)
class FailureDecision:
    decision: Decision
    resume: dict[str, Any] | None
    """The checkpoint the next attempt starts from ({path, step, epoch, kind}); when no
    valid checkpoint exists, the one this attempt started from (None: the start)."""
    notes: list[str] = field(default_factory=list)
    """Checkpoints refused on the way (bad sha256 or size), one line each, to be shown."""


class FailurePolicy:
    def __init__(self, max_restarts: int, checkpoints_dir: Path):
        self.max_restarts = max_restarts
        self.checkpoints_dir = checkpoints_dir

    def decide(self, result: RunResult, attempt: int, interrupted: bool,
               resume: dict[str, Any] | None) -> FailureDecision:
        if result.status is not RunStatus.FAILED or attempt >= self.max_restarts or interrupted:
            return FailureDecision(Decision.STOP, resume)
        from .failures import FailureKind, failure_kind

        # a rank refused the MindSpore or MindFormers of its node, or a file missing on a node:
        # a restart would find the same
        if failure_kind(result) is FailureKind.INPUT or any(
                o.error.startswith(FrameworkVersionError.__name__) for o in result.failures.values()):
            return FailureDecision(Decision.STOP, resume)
        entry, refused = self._newest_valid()
        if entry is not None:
            resume = {"path": str(self.checkpoints_dir / entry.path), "step": entry.step, "epoch": entry.epoch,
                      "kind": entry.kind}
        return FailureDecision(Decision.RESTART, resume, list(refused))

    def _newest_valid(self) -> tuple[Any, list[str]]:
        """A malformed manifest is refused (a note) like a bad file: the restart then starts
        from the point this attempt started from."""
        from mindpulse.rundir.checkpoint_manifest import ManifestError, choose_resume

        if not (self.checkpoints_dir / "manifest.json").exists():
            return None, []
        try:
            return choose_resume(self.checkpoints_dir, "latest")
        except ManifestError as exc:
            return None, [f"refused the checkpoint manifest: {exc}"]
