"""Compute on every card: which peak MFU is measured against, MFU on each reduced step, the
compute-drop flags of the flat path, and summary.json's `compute`.

The ranks measure their own achieved TFLOPS (workers/session.py); the reduction sums and
ranks them exactly (reducer.py); this module divides by the peak (card_peaks.py). Its work
per step is constant plus the ranks a step keeps whole (extremes, flagged ranks, the collect
window), never the world.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from mindpulse.config.settings import COMPUTE_DROP_WINDOW
from mindpulse.reduction.baselines import NodeComputeDrops
from mindpulse.reduction.reducer import ReducedStep
from mindpulse.reporting.card_peaks import resolve_peak

log = logging.getLogger(__name__)

SUMMARY_STEPS = 4096
"""summary.json's `compute` figures are medians over at most this many of the newest steps."""


class ComputeWatch:
    def __init__(self, run_dir: Path | str | None, peak_tflops: float = 0.0, dtype: str = "float16",
                 window: int = COMPUTE_DROP_WINDOW, say: Callable[[str], None] | None = None):
        self.run_dir = run_dir
        self.configured = float(peak_tflops or 0.0)
        self.dtype = dtype
        self.say = say or (lambda _text: None)
        self.drops = NodeComputeDrops(window)
        """Each rank's TFLOPS median on the flat path (no relays, a replay): the nodes' own otherwise."""
        self.peak: float | None = None
        self.source = ""
        self._card_names: tuple[str, ...] = ()
        self._told = False
        self.rank_tflops: dict[int, float] = {}
        """Each rank's newest achieved TFLOPS that reached the aggregator (kept packets)."""
        self.rank_cards: dict[int, str] = {}
        self._steps: dict[str, deque[float]] = {k: deque(maxlen=SUMMARY_STEPS)
                                               for k in ("tokens_per_s", "tflops", "mfu")}
        self.peak, self.source = resolve_peak(self.configured, run_dir, [], dtype)

    def on_cards(self, cards: Iterable[dict[str, Any]]) -> None:
        """The newest telemetry: card names (the table's peak) and which ranks each card holds."""
        names = []
        for c in cards:
            name = c.get("name")
            if name:
                names.append(str(name))
            node = c.get("node")
            node = f"node {node}" if isinstance(node, int) else str(node)  # the agent's name: node0-host
            label = f"{node} card {c.get('card')}" + (f" ({name})" if name else "")
            if c.get("card") == -1:
                label = f"{node} host {name or 'cpu'}"
            for r in c.get("ranks") or ():
                if isinstance(r, int):
                    self.rank_cards[r] = label
        names_t = tuple(sorted(set(names)))
        if self.peak is None and names_t != self._card_names:
            self._card_names = names_t
            self.peak, self.source = resolve_peak(self.configured, self.run_dir, list(names_t), self.dtype)
            if self.peak is not None and self._told:
                self.say(f"MFU: peak {self.peak:.4g} TFLOPS per card from the {self.source}")

    def on_step(self, red: ReducedStep) -> None:
        """MFU on the step, the flat path's compute-drop flags, the flagged ranks' cards."""
        if red.compute_flags is None:  # no node judged this step: the aggregator has every packet
            red.compute_flags = self.drops.update(red.step, red.per_rank)
        for r, p in red.per_rank.items():
            v = getattr(p, "tflops", None)
            if v is not None and math.isfinite(v):
                self.rank_tflops[r] = v
        red.rank_cards = {int(x[0]): self.rank_cards[int(x[0])] for x in red.compute_flags
                          if int(x[0]) in self.rank_cards}
        red.set_peak(self.peak)
        if red.tflops_mean is not None and not self._told:
            self._told = True
            if self.peak is None:
                self.say(f"MFU: - ({self.source})")
                log.info("MFU not shown: %s", self.source)
            else:
                self.say(f"MFU: peak {self.peak:.4g} TFLOPS per card from the {self.source}")
        if red.step > 0:
            for key, value in (("tokens_per_s", red.tokens_per_s), ("tflops", red.tflops_mean),
                               ("mfu", red.mfu_mean)):
                if value is not None and math.isfinite(value):
                    self._steps[key].append(value)

    def card_tflops(self, card: dict[str, Any]) -> float | None:
        """Achieved TFLOPS on one card: the sum over its ranks' newest figures."""
        vals = [self.rank_tflops[r] for r in card.get("ranks") or () if r in self.rank_tflops]
        return sum(vals) if vals else None

    def summary(self) -> dict[str, Any]:
        """summary.json's `compute`: medians over the steps (step time of the slowest rank)."""
        def med(key: str) -> float | None:
            vals = self._steps[key]
            return statistics.median(vals) if vals else None

        return {"tokens_per_s": med("tokens_per_s"), "tflops_per_card": med("tflops"), "mfu": med("mfu"),
                "peak_tflops": self.peak, "peak_source": self.source, "steps": len(self._steps["tflops"])}
