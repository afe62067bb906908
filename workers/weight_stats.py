"""What SummaryCollector collected for the weights, computed in the rank and shipped in
the step packet every `collect_freq` steps (kept small: the packet limit is 1 MiB):

- per-layer weight norms (from the same reductions as the fingerprint);
- per-layer update ratios: norm of the step's change over the norm of the weights
  (the weights of the step before are kept where the weights live, host memory on a CPU
  target and the device otherwise, for that one step only);
- weight histograms (64 bins) of the layers chosen by `monitor.histogram_regex`, and
  gradient histograms of the same layers where the mode shows the gradients (PYNATIVE:
  read by the gradient reducer's pre-hook; GRAPH compiles them away);
- the model's structure (layers, shapes, parameter counts) as text, once.
"""

from __future__ import annotations

import math
import re
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import ops

DEFAULT_HIST_REGEX = (r"(?:^|\.)(?:tok_embeddings\.embedding_weight|tok_embeddings\.weight|lm_head\.weight"
                      r"|layers\.0\.attention\.wq\.weight)$")
"""Histograms for a few layers when `monitor.histogram_regex` is empty: the embedding, the
output head, the first query projection."""
BINS = 64
MAX_LAYERS = 2000
"""Per-layer norms beyond this many parameters are not shipped (packet size)."""
_KEPT = object()
"""`collect`'s default: what this object kept itself (an inline collect at the collect step)."""


def histogram(values: np.ndarray, bins: int = BINS) -> dict[str, list[float]]:
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    lo, hi = (float(v.min()), float(v.max())) if v.size else (math.nan, math.nan)
    if not (math.isfinite(lo) and math.isfinite(hi)):
        # a NaN or an infinity among them (their min or max says so): the finite values only;
        # otherwise no mask and no second copy (a collect step's histograms are its largest part)
        v = v[np.isfinite(v)]
        if v.size == 0:
            return {"edges": [], "counts": [], "min": 0.0, "max": 0.0, "num": 0, "sum": 0.0, "sum_squares": 0.0}
        lo, hi = float(v.min()), float(v.max())
    if lo == hi:
        hi = lo + 1e-12
    counts, edges = np.histogram(v, bins=bins, range=(lo, hi))
    return {"edges": edges[1:].tolist(), "counts": counts.astype(np.float64).tolist(), "min": lo, "max": hi,
            "num": int(v.size), "sum": float(v.sum()), "sum_squares": float(np.dot(v, v))}


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


@ms.jit
def _change_squares(params, prev):
    """Sum of squares of each parameter's change (float32), in one compiled graph."""
    parts = []
    for p, q in zip(params, prev):
        d = ops.cast(p - q, ms.float32)
        parts.append(ops.reduce_sum(d * d))
    return ops.stack(parts)


class WeightStats:
    """Collects the statistics around collect steps; call `keep_previous()` at the end of
    the step before a collect step and `collect(sums)` at the collect step.

    On a CPU target the weights are read on the host where they live (numpy views of
    their storage: the copy kept for the update ratio is one memcpy into a reused block,
    the change's norm a pass of numpy); on a device the copy stays on the device and the
    change's norms are one compiled graph, whose small result alone comes to the host.

    On a CPU target `collect` may also run later, on another thread, from a copy of the
    collect step's weights (`current`, workers/host_copies.py) and the previous step's copy
    handed over by `take_previous()` (the session's outbox does so)."""

    def __init__(self, params, histogram_regex: str = "", grads_source: Any = None, on_host: bool | None = None,
                 views: Any = None):
        """`views`: host views of these same parameters (`fingerprint.HostViews`) kept by the
        caller too; made here when not given."""
        from .fingerprint import HostViews, weights_on_host
        from .host_copies import SHARED_BLOCKS

        self.params = list(params)
        self.names = [p.name for p in self.params]
        self.pattern = re.compile(histogram_regex) if histogram_regex else None
        self.hist_idx = [i for i, n in enumerate(self.names) if self.pattern and self.pattern.search(n)][:8]
        self.prev: Any = None
        """The weights of the step before a collect step: a `HostCopy` on the host, else
        {index: device tensor}; None when none is kept."""
        self.grads_source = grads_source  # a MonitoredTrainOneStepCell with captured grads (PYNATIVE)
        self.on_host = weights_on_host(self.params) if on_host is None else on_host
        """Read the weights on the host (a CPU target) rather than reduce them on the device."""
        self.views = (views if views is not None else HostViews(self.params)) if self.on_host else None
        self.blocks = SHARED_BLOCKS if self.on_host else None
        """Reused host blocks for the copies (the update ratio's, the session's collect-step copy)."""

    def keep_previous(self) -> None:
        """Copy the weights (on the host for a CPU target, else on the device) so the next
        step's change can be measured."""
        from mindspore import ops

        limit = self.params[:MAX_LAYERS]
        self._release(self.prev)
        if self.on_host:
            self.prev = self.blocks.copy([self.views[i] for i in range(len(limit))])
        else:
            self.prev = {i: ops.stop_gradient(p.value()).copy() for i, p in enumerate(limit)}
        if self.grads_source is not None and self.hist_idx:
            self.grads_source.capture_grads = {self.names[i] for i in self.hist_idx}

    def take_previous(self) -> Any:
        """The kept copy of the step before, for a `collect` that runs later (the caller
        hands it to `collect(prev=...)`); None when none is kept."""
        prev, self.prev = self.prev, None
        return prev

    def take_grads(self) -> dict[str, Any] | None:
        """The gradients the train cell captured at this step (PYNATIVE), for a later `collect`."""
        grads = getattr(self.grads_source, "captured_grads", None) if self.grads_source is not None else None
        if grads:
            self.grads_source.captured_grads = None
        # copies (a few layers): the arrays may share the gradients' storage, which MindSpore may
        # reuse once the next step runs, while the statistics are computed later
        return {n: np.array(g, copy=True) for n, g in grads.items()} if grads else None

    @staticmethod
    def _release(prev: Any) -> None:
        if prev is not None and hasattr(prev, "release"):
            prev.release()

    def _change_norms(self, prev: Any, current: list[np.ndarray] | None) -> list[float]:
        """Norm of each kept parameter's change since `keep_previous` (in parameter order);
        `current`: the weights now, as host arrays (None: read where they live)."""
        if self.on_host:
            from .fingerprint import square_sum

            out = []
            for i, before in enumerate(prev.arrays):
                now = current[i] if current is not None else self.views[i]
                if now.dtype != np.float32:
                    now, before = now.astype(np.float32), before.astype(np.float32)
                out.append(math.sqrt(square_sum(now, minus=before)))
            return out
        idx = sorted(prev)
        sq = _change_squares(ms.mutable(tuple(self.params[i].value() for i in idx)),
                             ms.mutable(tuple(prev[i] for i in idx))).asnumpy()
        return [math.sqrt(float(x)) if x >= 0 else float("nan") for x in sq]

    def collect(self, sums: np.ndarray | None, current: list[np.ndarray] | None = None, prev: Any = _KEPT,
                grads: Any = _KEPT) -> dict[str, Any]:
        """`sums`: the fingerprint's vector [sum, sum of squares] per parameter. Later, from
        copies (a CPU target): `current`, the collect step's weights as host arrays in
        parameter order; `prev` and `grads`, what `take_previous` and `take_grads` handed over
        at that step (the previous copy's block goes back to the pool here)."""
        if prev is _KEPT:
            prev = self.take_previous()
        if grads is _KEPT:
            grads = self.take_grads()
        out: dict[str, Any] = {}
        try:
            if sums is not None and len(sums) == 2 * len(self.params):
                sq = np.asarray(sums[1::2], dtype=np.float64)
                norms = np.sqrt(np.maximum(sq, 0.0))
                out["norms"] = {n: float(v) for n, v in list(zip(self.names, norms))[:MAX_LAYERS]}
                if prev is not None:
                    ratios = {}
                    for i, dn in enumerate(self._change_norms(prev, current)):
                        ratios[self.names[i]] = dn / norms[i] if norms[i] > 0 and math.isfinite(dn) else 0.0
                    out["update_ratio"] = ratios
        finally:
            self._release(prev)
        hists = {}
        for i in self.hist_idx:
            p = self.params[i]
            values = current[i] if current is not None else self.views[i] if self.on_host else p.value().asnumpy()
            hists[self.names[i]] = histogram(values)
        if hists:
            out["hist"] = hists
        if grads:
            out["grad_hist"] = {n: histogram(g) for n, g in grads.items()}
        return out
