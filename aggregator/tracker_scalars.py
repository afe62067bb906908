"""What the experiment trackers (SwanLab, MLflow) are given, the same for both: the scalars of
a reduced step and of a card sample under the names TensorBoard writes them, the resolved
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

from .tb_sink import _CARD_SCALARS, MAX_CARD_TAGS, _node_extremes, _tag_part, step_items

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


def card_scalars(node: str, cards: list[dict], *, per_card: bool = True) -> list[tuple[str, float]]:
    """The finite scalars TensorBoard writes for one node's card sample: `card_<node>_<card>/util`,
    ...; with `per_card` False (a job above MAX_CARD_TAGS cards, `per_card_scalars`) the node's
    extremes, `cards_<node>/util_min`, ..., a few scalars a node whatever its cards."""
    if not per_card:
        return _finite(_node_extremes(node, [c for c in cards or [] if isinstance(c, dict)]))
    items: list[tuple[str, Any]] = []
    for i, card in enumerate(cards or []):
        if not isinstance(card, dict):
            continue
        cid = card.get("card")
        prefix = f"card_{_tag_part(node)}_{_tag_part(i if cid is None else cid)}"
        items += [(f"{prefix}/{suffix}", card.get(key)) for suffix, key in _CARD_SCALARS]
    return _finite(items)


def per_card_scalars(config: RunConfig) -> bool:
    """Whether a job's card samples are written card by card (TensorBoard's rule: its cards, one
    a rank, at most MAX_CARD_TAGS)."""
    return config.world.world_size <= MAX_CARD_TAGS


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
           "card_scalars", "flat_params", "per_card_scalars", "step_scalars"]
