"""What the experiment trackers (SwanLab, MLflow) are given, the same for both: the scalars of
a reduced step under the names TensorBoard writes them (a card sample's: card_series.py), the resolved
config as flat parameters, an anomaly as text, and `RUN_DIR/trackers.json`, where each
tracker's run id waits for a resumed attempt to continue the same tracker run.

The scalars are TensorBoard's own (`tb_sink.py`'s `step_items`), so a tag in TensorBoard, SwanLab and
MLflow is one name; per rank, the ranks TensorBoard writes (the ranks that matter, every rank
on a collect step) and no other, so a step costs the same whatever the world size.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from mindpulse.common.errors import MindpulseError
from mindpulse.common.formatting import finite_float
from mindpulse.config import RunConfig
from mindpulse.reduction.reducer import ReducedStep
from mindpulse.rundir.tracker_runs import TRACKERS_FILE, TrackerFailed, TrackerIds

from .tb_sink import step_items

_UNSAFE_KEY_CHARS = re.compile(r"[^A-Za-z0-9_.\-/]+")


class TrackerMissing(MindpulseError, ImportError):
    """A tracker's package is not installed where the aggregator runs; says the extra to install."""

    def __init__(self, section: str, package: str, install: str):
        super().__init__(f"{section} is on but the {package} package is not installed here: pip install {install}")


def step_scalars(red: ReducedStep, also: Sequence[tuple[str, Any]] | None, *, collect_freq: int,
                 straggler_threshold: float) -> list[tuple[str, float]]:
    """The finite scalars TensorBoard writes for one reduced step (`TensorBoardSink._write_reduced`):
    the cluster's, `extra/<name>`, the per-rank ones of the ranks it shows, and `also`. Empty for
    the step-0 report (fingerprints only)."""
    if int(red.step) == 0 and red.loss_mean is None:
        return []
    items, _ = step_items(red, collect_freq, straggler_threshold)
    return _finite(items + list(also or []))


def _finite(items: list[tuple[str, Any]]) -> list[tuple[str, float]]:
    # as TensorBoard: a NaN or Inf is no point of a series (the anomaly and `loss/nonfinite` say it)
    return [(tag, v) for tag, v in ((t, finite_float(x)) for t, x in items) if v is not None]


def flat_params(config: RunConfig) -> dict[str, str]:
    """The resolved config as `{dotted.key: text}` (lists of sections by index: `anomalies.0.rule`;
    lists of values as JSON), keys safe for any tracker."""
    out: dict[str, str] = {}

    def walk(value: Any, key: str) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                walk(v, f"{key}.{k}" if key else str(k))
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            for i, v in enumerate(value):
                walk(v, f"{key}.{i}")
        else:
            text = value if isinstance(value, str) else json.dumps(value, default=str)
            out[_UNSAFE_KEY_CHARS.sub("_", key)] = text

    walk(config.to_dict(), "")
    return out


def anomaly_text(record: dict) -> str:
    """One anomaly record as one JSON line (rule, step, rank, value, threshold, action, message, ...)."""
    rec = record if isinstance(record, dict) else {"message": str(record)}
    return json.dumps(rec, default=str, sort_keys=True)


def anomaly_step(record: dict) -> int:
    step = record.get("step") if isinstance(record, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else 0


__all__ = ["TRACKERS_FILE", "TrackerFailed", "TrackerIds", "TrackerMissing", "anomaly_step", "anomaly_text",
           "flat_params", "step_scalars"]
