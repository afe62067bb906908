"""What TensorBoard and the experiment trackers write of the nodes' card samples, at a grain
that follows the job's size: every card's scalars in a small job, each node sample's extremes
above MAX_CARD_TAGS cards, and the job's extremes once a step above JOB_EXTREMES_CARDS cards,
so that what a tracker writes for cards follows steps, not nodes, where nodes are many.

The Prometheus endpoint keeps the cards that matter by name at every size (docs/dashboards.md)."""

from __future__ import annotations

import enum
import re
import time
from typing import Any

from mindpulse.common.formatting import finite_float
from mindpulse.reporting.tables import CARD_EXTREMES

CARD_SCALARS: tuple[tuple[str, str], ...] = (
    ("util", "util_pct"),
    ("memory_used_mb", "memory_used_mb"),
    ("power_w", "power_w"),
    ("temp_c", "temp_c"),
)
"""(tag suffix, card sample field) of each card scalar."""
MAX_CARD_TAGS = 256
"""Above this many cards in the job a node's sample is written as its cards' extremes (the
hottest, most power-hungry, fullest card's value, the idlest card's utilisation) under
`cards_<node>/`, not a tag set per card: at 32,768 cards the per-card scalars were an
eighth of the aggregator's time, and TensorBoard cannot show 131,072 tags anyway."""
JOB_EXTREMES_CARDS = 1024
"""Above this many cards (64 nodes of 16) the job's extremes over every node's latest sample are
written once a step under `cards/` (`CardSeries`): at 32,768 cards an event a node sample was 7%
of the aggregator's time (4,096 node groups a telemetry period), and no one reads 4,096 node
groups in TensorBoard."""
JOB_POINT_S = 10.0
"""At the job grain, a point is written at least this often while the step stands still."""
STALE_S = 60.0
"""At the job grain, a node whose last sample is older than this leaves the job's extremes."""

_BIGGEST = dict(CARD_EXTREMES)
"""Per card field: whether its extreme worth a look is the largest (temperature, power,
memory) or the smallest (utilisation: an idle card)."""
_UNSAFE_TAG_CHARS = re.compile(r"[^A-Za-z0-9_.\-]+")


class CardGrain(enum.Enum):
    """How finely a job's card samples are written."""

    CARD = "card"  # card_<node>_<card>/<scalar>, every sample
    NODE = "node"  # cards_<node>/<scalar>_<min|max>, every sample
    JOB = "job"  # cards/<scalar>_<min|max>, once a step


def card_grain(cards: int) -> CardGrain:
    """The grain of a job of `cards` cards (its world size: one card a rank)."""
    if cards <= MAX_CARD_TAGS:
        return CardGrain.CARD
    return CardGrain.NODE if cards <= JOB_EXTREMES_CARDS else CardGrain.JOB


def tag_part(x: Any) -> str:
    """A name safe inside one tag component (no `/`, no spaces)."""
    s = _UNSAFE_TAG_CHARS.sub("_", str(x)).strip("_")
    return s or "unknown"


def _pick(key: str, vals: list[float]) -> float:
    """The extreme worth a look among `vals` of card field `key`."""
    return max(vals) if _BIGGEST[key] else min(vals)


def _extremes(cards: list[dict]) -> dict[str, float]:
    """Per card field, the extreme worth a look over `cards` (finite values only)."""
    out: dict[str, float] = {}
    for _, key in CARD_SCALARS:
        vals = [v for c in cards or [] if isinstance(c, dict) and (v := finite_float(c.get(key))) is not None]
        if vals:
            out[key] = _pick(key, vals)
    return out


def _extreme_items(prefix: str, ext: dict[str, float]) -> list[tuple[str, float]]:
    return [(f"{prefix}/{suffix}_{'max' if _BIGGEST[key] else 'min'}", ext[key])
            for suffix, key in CARD_SCALARS if key in ext]


def node_extremes(node: str, cards: list[dict]) -> list[tuple[str, float]]:
    """A node sample as its cards' extremes: the idlest card's utilisation, the largest memory,
    power and temperature (`cards_<node>/util_min`, ...)."""
    return _extreme_items(f"cards_{tag_part(node)}", _extremes(cards))


def per_card(node: str, cards: list[dict]) -> list[tuple[str, float]]:
    """Every card's finite scalars of a node sample (`card_<node>_<card>/util`, ...)."""
    items: list[tuple[str, float]] = []
    for i, card in enumerate(cards or []):
        if not isinstance(card, dict):
            continue
        cid = card.get("card")
        prefix = f"card_{tag_part(node)}_{tag_part(i if cid is None else cid)}"
        items += [(f"{prefix}/{suffix}", v) for suffix, key in CARD_SCALARS
                  if (v := finite_float(card.get(key))) is not None]
    return items


class CardSeries:
    """One writer's card scalars: `sample` takes a node's sample and returns the points to write
    now, each `(step, [(tag, value), ...])`; `drain` the point not yet written (at close).

    At the job grain each node's latest sample is kept (its extremes, four numbers) and a point
    is the extremes over every node's latest sample: written when a sample of a later step
    arrives, or once `JOB_POINT_S` has passed at the same step (a hang, a long compile: the
    cards matter most then), so a tracker writes about one point a step for cards, whatever the
    nodes. Nodes report every `monitor.telemetry_interval_s`, not every step: a point over only
    the samples of its step would hold a fifth of the nodes at 1 step/s and 5 s telemetry, and a
    hot node would show in one point in five. A node silent for `STALE_S` leaves the point (a node
    gone from the job keeps no value in it)."""

    def __init__(self, cards: int):
        self.grain = card_grain(cards)
        self._latest: dict[str, tuple[float, dict[str, float]]] = {}
        """Per node: (its last sample's arrival, monotonic seconds; that sample's extremes)."""
        self._high: int | None = None
        """The highest step a sample came at: the step of the point that waits."""
        self._waiting = False
        """Whether a sample came since the last point was written."""
        self._written_at: float | None = None
        """When the last point was written (or the first sample came)."""

    def sample(self, node: str, cards: list[dict], step: int,
               now: float | None = None) -> list[tuple[int, list[tuple[str, float]]]]:
        if self.grain is CardGrain.CARD:
            return [(step, per_card(node, cards))]
        if self.grain is CardGrain.NODE:
            return [(step, node_extremes(node, cards))]
        now = time.monotonic() if now is None else now
        if self._written_at is None:
            self._written_at = now
        out: list[tuple[int, list[tuple[str, float]]]] = []
        if self._waiting and self._high is not None and (step > self._high or now - self._written_at >= JOB_POINT_S):
            out = self.drain(now)
        self._latest[str(node)] = (now, _extremes(cards))
        # a late sample of an earlier step counts towards the point waiting: its cards are the job's now
        self._high = step if self._high is None else max(self._high, step)
        self._waiting = True
        return out

    def drain(self, now: float | None = None) -> list[tuple[int, list[tuple[str, float]]]]:
        """The waiting point (empty where none waits or no node has a value)."""
        if not self._waiting or self._high is None:
            return []
        now = time.monotonic() if now is None else now
        step, self._waiting, self._written_at = self._high, False, now
        for node in [n for n, (at, _) in self._latest.items() if now - at > STALE_S]:
            del self._latest[node]
        job = {key: _pick(key, vals) for _, key in CARD_SCALARS
               if (vals := [ext[key] for _, ext in self._latest.values() if key in ext])}
        return [(step, _extreme_items("cards", job))] if job else []


__all__ = ["CARD_SCALARS", "JOB_EXTREMES_CARDS", "JOB_POINT_S", "MAX_CARD_TAGS", "STALE_S", "CardGrain",
           "CardSeries", "card_grain", "node_extremes", "per_card", "tag_part"]
