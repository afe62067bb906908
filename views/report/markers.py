"""The run's events as markers on the plots — an anomaly (A1, A2, ...), a checkpoint, the step
where a restarted attempt resumed — and where each marker lies in the saved image, so the
page can make it a link to its row of the anomaly, checkpoint or attempt table (and back).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .data import RunData, as_int

MAX_MARKERS = 200
"""At most this many vertical markers of one kind per plot."""
MAX_MARKER_LABELS = 40
"""Anomaly markers carry their label (A1, A2, ...) on the plot up to this many."""
ANOMALY_COLOR = "#c62828"
CHECKPOINT_COLOR = "#2e7d32"
ATTEMPT_COLOR = "purple"
BEST_COLOR = "gold"


@dataclass
class AnomalyGroup:
    """The anomalies of one step: one marker on the plots, one anchor in the timeline."""

    step: int
    label: str
    records: list[dict[str, Any]]

    @property
    def anchor(self) -> str:
        return f"anomaly-{self.step}"

    def title(self) -> str:
        parts = []
        for a in self.records[:3]:
            rank = a.get("rank")
            parts.append(f"{a.get('rule')}" + (f" rank {rank}" if rank is not None else "")
                         + f" ({a.get('action')})")
        more = f" +{len(self.records) - 3}" if len(self.records) > 3 else ""
        return f"{self.label} · step {self.step}: " + "; ".join(parts) + more


def anomaly_groups(data: RunData) -> list[AnomalyGroup]:
    """The run's anomalies by step, labelled A1, A2, ... in step order."""
    by_step: dict[int, list[dict[str, Any]]] = {}
    for a in data.anomalies:
        s = as_int(a.get("step"))
        if s is not None:
            by_step.setdefault(s, []).append(a)
    return [AnomalyGroup(step, f"A{i + 1}", recs) for i, (step, recs) in enumerate(sorted(by_step.items()))]


@dataclass
class PlotLink:
    """A clickable strip over a marker line of a plot, in percent of the image."""

    left: float
    top: float
    height: float
    kind: str
    href: str
    title: str


@dataclass
class _Mark:
    """One marker drawn: its axis, its x and what it links to."""

    ax: Any
    x: float
    kind: str
    href: str
    title: str


class Markers:
    """Draws the anomaly, checkpoint and restart markers of the run on an axis, and remembers
    where they are so the page can link them."""

    def __init__(self, data: RunData):
        self.groups = anomaly_groups(data)
        self.checkpoints: dict[int, list[str]] = {}
        for c in data.checkpoints:
            s = as_int(c.get("step"))
            if s is not None:
                self.checkpoints.setdefault(s, []).append(str(c.get("kind") or "checkpoint"))
        self.attempts = data.attempt_starts
        self.marks: list[_Mark] = []

    def draw(self, ax, to_x: Callable[[int], float | None] | None = None) -> None:
        conv = to_x or float
        label_them = len(self.groups) <= MAX_MARKER_LABELS
        first = True
        for g in self.groups[:MAX_MARKERS]:
            x = conv(g.step)
            if x is None:
                continue
            ax.axvline(x, color=ANOMALY_COLOR, linestyle="--", linewidth=1.0, alpha=0.75,
                       label="anomaly" if first else None)
            first = False
            if label_them:
                ax.text(x, 0.985, g.label, transform=ax.get_xaxis_transform(), color=ANOMALY_COLOR, fontsize=7,
                        ha="center", va="top", fontweight="bold",
                        bbox={"boxstyle": "round,pad=0.15", "facecolor": "white", "edgecolor": "none", "alpha": 0.8})
            self.marks.append(_Mark(ax, x, "anomaly", "#" + g.anchor, g.title()))
        first = True
        for step, kinds in sorted(self.checkpoints.items())[:MAX_MARKERS]:
            x = conv(step)
            if x is None:
                continue
            ax.axvline(x, color=CHECKPOINT_COLOR, linestyle="--", linewidth=0.9, alpha=0.6,
                       label="checkpoint" if first else None)
            first = False
            self.marks.append(_Mark(ax, x, "checkpoint", f"#ckpt-{step}",
                                    f"checkpoint at step {step} ({', '.join(kinds)})"))
        for step, attempt in self.attempts[:MAX_MARKERS]:  # where a restarted attempt resumed
            x = conv(step)
            if x is None:
                continue
            ax.axvline(x, color=ATTEMPT_COLOR, linestyle=":", linewidth=1.3, alpha=0.9, label=f"attempt {attempt}")
            self.marks.append(_Mark(ax, x, "attempt", f"#attempt-{attempt}",
                                    f"attempt {attempt} resumed at step {step}"))

    def links(self, fig) -> list[PlotLink]:
        """Where each marker drawn on `fig` lies in the saved image, in percent."""
        width, height = fig.bbox.width, fig.bbox.height
        out = []
        for m in self.marks:
            if m.ax.figure is not fig:
                continue
            bb = m.ax.bbox
            px = float(m.ax.get_xaxis_transform().transform((m.x, 0.0))[0])
            if not (bb.x0 - 0.5 <= px <= bb.x1 + 0.5) or not math.isfinite(px):
                continue
            out.append(PlotLink(left=100.0 * px / width, top=100.0 * (height - bb.y1) / height,
                                height=100.0 * bb.height / height, kind=m.kind, href=m.href, title=m.title))
        return out


def plot_for_rule(rule: str) -> str:
    """The plot an anomaly's marker is best seen on."""
    r = rule.lower()
    if "grad" in r:
        return "grad_norm"
    if "straggler" in r or "step_time" in r:
        return "straggler" if "straggler" in r else "step_time"
    if "card" in r or "overload" in r or "temp" in r or "power" in r:
        return "telemetry"
    if "throughput" in r or "samples" in r:
        return "throughput"
    if "compute" in r or "mfu" in r or "tflops" in r:
        return "mfu"
    return "loss"
