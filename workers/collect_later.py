"""A collect step's statistics, measured on the rank's outbox thread from a copy of the weights
(`RankWeights.collect_later`, workers/rank_weights.py, takes the copy on the training thread;
docs/architecture.md, "The rank's two threads")."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from mindpulse.wire.protocol import StepPacket

from .fingerprint import fingerprint_of, param_sums
from .host_copies import HostCopy

log = logging.getLogger(__name__)


def completion(copy: HostCopy, stats: Any, prev: Any, grads: Any, rank: int,
               step: int) -> Callable[[StepPacket], StepPacket]:
    """What completes the collect step's packet from `copy` (the weights in parameter order):
    its fingerprint, and rank 0's weight statistics (`stats`: its `WeightStats`, with `prev`
    and `grads`, the copy of the step before and the captured gradients handed over at that
    step). The copy goes back to its pool once measured."""

    def complete(pkt: StepPacket) -> StepPacket:
        try:
            fp = norm = sums = None
            try:
                sums = param_sums(copy.arrays, on_host=True, views=copy.arrays)
                fp, norm = fingerprint_of(sums)
            except Exception as exc:  # no fingerprint for this step: its packet goes out without one
                log.warning("[rank %d] fingerprint failed: %s", rank, exc)
            weights: dict[str, Any] = {}
            if stats is not None:
                try:
                    weights = stats.collect(sums, current=copy.arrays, prev=prev, grads=grads)
                except Exception as exc:  # statistics are optional: the packet goes out without them
                    log.warning("[rank %d] weight statistics failed at step %d: %s", rank, step, exc)
            return dataclasses.replace(pkt, fingerprint=fp, param_norm=norm, weights=weights)
        finally:
            copy.release()

    return complete
