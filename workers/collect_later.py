"""A collect step's statistics, measured on the rank's outbox thread from a copy of the weights
(`RankWeights.collect_later`, workers/rank_weights.py, takes the copy on the training thread;
docs/architecture.md, "The rank's two threads")."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from mindpulse.wire.protocol import StepPacket

from .fingerprint import fingerprint_of, param_sums
from .host_copies import HostCopy

log = logging.getLogger(__name__)


class Completion:
    """What completes the collect step's packet from `copy` (the weights in parameter order):
    its fingerprint, and rank 0's weight statistics (`stats`: its `WeightStats`, with `prev`
    and `grads`, the copy of the step before and the captured gradients handed over at that
    step). Called once, on the outbox thread; the copies go back to their pool once measured,
    or by `release` when the packet is not sent after all."""

    def __init__(self, copy: HostCopy, stats: Any, prev: Any, grads: Any, rank: int, step: int):
        self.copy, self.stats, self.prev, self.grads = copy, stats, prev, grads
        self.rank, self.step = rank, step

    def __call__(self, pkt: StepPacket) -> StepPacket:
        copy, stats = self.copy, self.stats
        try:
            fp = norm = sums = None
            try:
                sums = param_sums(copy.arrays, on_host=True, views=copy.arrays)
                fp, norm = fingerprint_of(sums)
            except Exception as exc:  # no fingerprint for this step: its packet goes out without one
                log.warning("[rank %d] fingerprint failed: %s", self.rank, exc)
            weights: dict[str, Any] = {}
            if stats is not None:
                try:
                    weights = stats.collect(sums, current=copy.arrays, prev=self.prev, grads=self.grads)
                except Exception as exc:  # statistics are optional: the packet goes out without them
                    log.warning("[rank %d] weight statistics failed at step %d: %s", self.rank, self.step, exc)
            return dataclasses.replace(pkt, fingerprint=fp, param_norm=norm, weights=weights)
        finally:
            copy.release()

    def release(self) -> None:
        """The packet is not sent after all (the step's record failed): hand the copies back."""
        self.copy.release()
        if self.prev is not None and hasattr(self.prev, "release"):
            self.prev.release()
