"""What SummaryCollector collected for the weights, computed in the rank and shipped in
the step packet every `collect_freq` steps (kept small: the packet limit is 1 MiB):

- per-layer weight norms (from the same on-device reductions as the fingerprint);
- per-layer update ratios: norm of the step's change over the norm of the weights
  (the weights of the step before are kept on the device for that one step only);
- weight histograms (64 bins) of the layers chosen by `monitor.histogram_regex`, and
  gradient histograms of the same layers where the mode shows the gradients (PYNATIVE:
  read by the gradient reducer's pre-hook; GRAPH compiles them away);
- the model's structure (layers, shapes, parameter counts) as text, once.
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

DEFAULT_HIST_REGEX = (r"(?:^|\.)(?:tok_embeddings\.embedding_weight|tok_embeddings\.weight|lm_head\.weight"
                      r"|layers\.0\.attention\.wq\.weight)$")
"""Histograms for a few layers when `monitor.histogram_regex` is empty: the embedding, the
output head, the first query projection."""
BINS = 64
MAX_LAYERS = 2000
"""Per-layer norms beyond this many parameters are not shipped (packet size)."""


def histogram(values: np.ndarray, bins: int = BINS) -> dict[str, list[float]]:
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    v = v[np.isfinite(v)]
    if v.size == 0:
        return {"edges": [], "counts": [], "min": 0.0, "max": 0.0, "num": 0, "sum": 0.0, "sum_squares": 0.0}
    lo, hi = float(v.min()), float(v.max())
    if lo == hi:
        hi = lo + 1e-12
    counts, edges = np.histogram(v, bins=bins, range=(lo, hi))
    return {"edges": [float(e) for e in edges[1:]], "counts": [float(c) for c in counts], "min": lo, "max": hi,
            "num": int(v.size), "sum": float(v.sum()), "sum_squares": float((v * v).sum())}


def structure_text(params) -> str:
    """Layers, shapes and parameter counts, in place of MindInsight's graph view."""
    rows = []
    total = trainable = 0
    for p in params:
        n = int(np.prod(p.shape)) if len(p.shape) else 1
        total += n
        trainable += n if p.requires_grad else 0
        rows.append(f"| {p.name} | {tuple(p.shape)} | {n:,} | {p.dtype} | {'yes' if p.requires_grad else 'no'} |")
    head = [f"**{len(rows)} parameter tensors, {total:,} values ({trainable:,} trainable)**", "",
            "| layer | shape | count | dtype | trainable |", "|---|---|---|---|---|"]
    return "\n".join(head + rows)


class WeightStats:
    """Collects the statistics around collect steps; call `before(step)` at the end of the
    step before a collect step and `collect(step, sums)` at the collect step."""

    def __init__(self, params, histogram_regex: str = "", grads_source: Any = None):
        self.params = list(params)
        self.names = [p.name for p in self.params]
        self.pattern = re.compile(histogram_regex) if histogram_regex else None
        self.hist_idx = [i for i, n in enumerate(self.names) if self.pattern and self.pattern.search(n)][:8]
        self.prev: dict[int, Any] | None = None
        self.grads_source = grads_source  # a MonitoredTrainOneStepCell with captured grads (PYNATIVE)

    def keep_previous(self) -> None:
        """Copy the weights (on the device) so the next step's change can be measured."""
        from mindspore import ops

        self.prev = {i: ops.stop_gradient(p.value()).copy() for i, p in enumerate(self.params)}
        if self.grads_source is not None and self.hist_idx:
            self.grads_source.capture_grads = {self.names[i] for i in self.hist_idx}

    def collect(self, sums: np.ndarray | None) -> dict[str, Any]:
        """`sums`: the fingerprint's vector [sum, sum of squares] per parameter."""
        from mindspore import ops

        out: dict[str, Any] = {}
        if sums is not None and len(sums) == 2 * len(self.params):
            sq = np.asarray(sums[1::2], dtype=np.float64)
            norms = np.sqrt(np.maximum(sq, 0.0))
            out["norms"] = {n: float(v) for n, v in list(zip(self.names, norms))[:MAX_LAYERS]}
            if self.prev is not None:
                ratios = {}
                for i, p in list(enumerate(self.params))[:MAX_LAYERS]:
                    if i not in self.prev:
                        continue
                    d = ops.sqrt(ops.reduce_sum(ops.square(ops.cast(p.value() - self.prev[i], p.dtype))))
                    dn = float(d.asnumpy())
                    ratios[self.names[i]] = dn / norms[i] if norms[i] > 0 and math.isfinite(dn) else 0.0
                out["update_ratio"] = ratios
        self.prev = None
        hists = {}
        for i in self.hist_idx:
            hists[self.names[i]] = histogram(self.params[i].value().asnumpy())
        if hists:
            out["hist"] = hists
        grads = getattr(self.grads_source, "captured_grads", None) if self.grads_source is not None else None
        if grads:
            out["grad_hist"] = {n: histogram(g) for n, g in grads.items()}
            self.grads_source.captured_grads = None
        return out
