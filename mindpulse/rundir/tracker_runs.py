"""`RUN_DIR/trackers.json`: each experiment tracker's run id (MLflow, SwanLab), written by the
aggregator's sinks and read by a restarted aggregator or a resumed attempt to continue the same
tracker run; the driver copies it into a resumed launch's new run directory
(launcher/resume.py `carry_tracker_runs`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mindpulse.common.errors import MindpulseError
from mindpulse.rundir.rundir_io import write_json_atomic

TRACKERS_FILE = "trackers.json"


class TrackerFailed(MindpulseError, RuntimeError):
    """A tracker's write failed (raised on the aggregator's next call to it, so it is counted)."""


class TrackerIds:
    """`RUN_DIR/trackers.json`: `{tracker: {run_id, ...}}`, read by a resumed attempt (or a
    restarted aggregator) to continue the same tracker run; `mindpulse launch --resume RUN_DIR`
    copies it into its new run directory first (launcher/resume.py `carry_tracker_runs`)."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / TRACKERS_FILE

    def read(self) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            raise TrackerFailed(f"{self.path} cannot be read ({exc}); move it away to start new tracker runs") from None
        return data if isinstance(data, dict) else {}

    def get(self, tracker: str) -> dict[str, Any] | None:
        entry = self.read().get(tracker)
        return entry if isinstance(entry, dict) and entry.get("run_id") else None

    def put(self, tracker: str, entry: dict[str, Any]) -> None:
        data = self.read()
        data[tracker] = entry
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.path, data)
