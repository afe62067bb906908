"""The run's anomaly record: `anomalies.jsonl`, one JSON object per line, appended as rules
fire (constant work per firing, nothing dropped), and `anomalies.json`, the same records as
one JSON list, written when the aggregator closes (what reports and scripts read after a
run). A restarted aggregator or a later attempt continues the same record.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mindpulse.rundir.rundir_io import json_safe, write_atomic

JSONL = "anomalies.jsonl"
JSON = "anomalies.json"


def read_records(run_dir: Path) -> Iterator[dict[str, Any]]:
    """Every record of a run: the JSON Lines file (a torn last line skipped), else the list."""
    path = Path(run_dir) / JSONL
    if path.exists():
        with open(path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a line torn by a crash mid-write
                if isinstance(rec, dict):
                    yield rec
        return
    legacy = Path(run_dir) / JSON
    if legacy.exists():
        try:
            recs = json.loads(legacy.read_text())
        except (OSError, ValueError):
            return
        yield from (r for r in recs if isinstance(r, dict)) if isinstance(recs, list) else ()


class AnomalyLog:
    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / JSONL
        self.count = sum(1 for _ in read_records(self.run_dir))
        self._fh = None

    def append(self, rec: dict[str, Any]) -> None:
        if self._fh is None:
            self._fh = open(self.path, "a", encoding="utf-8")
        self._fh.write(json.dumps(json_safe(rec), allow_nan=False, default=str) + "\n")
        self._fh.flush()  # a reader (top, a script) sees it now; fsync at close
        self.count += 1

    def close(self) -> None:
        if self._fh is not None:
            os.fsync(self._fh.fileno())
            self._fh.close()
            self._fh = None
        if self.count or (self.run_dir / JSON).exists():
            text = json.dumps(list(read_records(self.run_dir)), indent=2, allow_nan=False, default=str) + "\n"
            write_atomic(self.run_dir / JSON, text.encode())
