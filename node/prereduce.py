"""Pre-reduction on the node: the agent validates its ranks' packets once and reduces each
step into one node partial, so the aggregator's work per step follows nodes, not ranks.

What goes up in one call (`NodeBatch`): the raw bytes of the step packets (appended to
`metrics.msgpack` as they are: validated here, never decoded again), the other packets
(events: the aggregator handles them one by one), the partials of the steps every rank of
this node has reported, and counts of what was refused here.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Any

from mindpulse.aggregator.partial import NodeStragglers, partial_of, to_wire
from mindpulse.protocol import PacketError, StepPacket, decode_wire

NodeBatch = dict[str, Any]
"""{"steps": [bytes], "other": [bytes], "partials": [wire partial], "rejected": {reason: n}}"""

MAX_PENDING_STEPS = 256
"""Incomplete steps held per node; older ones are dropped (a rank that never reports)."""


def empty_batch() -> NodeBatch:
    return {"steps": [], "other": [], "partials": [], "rejected": {}}


class NodePreReducer:
    """One node's steps: `add(raw)` files a packet; complete steps come out as partials."""

    def __init__(self, node: int, ranks: range, straggler_window: int = 10, collect_freq: int = 10):
        self.node = node
        self.ranks = ranks
        self.collect_freq = max(1, collect_freq)
        self.stragglers = NodeStragglers(straggler_window)
        self._pending: OrderedDict[int, dict[int, StepPacket]] = OrderedDict()
        self._wires: dict[int, dict[int, dict[str, Any]]] = {}
        self._done_through = -1
        self.batch = empty_batch()
        self.rejected: Counter[str] = Counter()
        self.evicted = 0

    def add(self, raw: bytes) -> bool:
        """File one encoded packet; True when it completed a step (a partial is ready)."""
        try:
            pkt, wire = decode_wire(raw)
        except PacketError as exc:
            self._reject(exc.reason)
            return False
        if not isinstance(pkt, StepPacket):
            self.batch["other"].append(bytes(raw))
            return False
        if pkt.rank not in self.ranks:
            self._reject("rank_not_on_node")
            return False
        bucket = self._pending.get(pkt.step)
        if bucket is None:
            if pkt.step <= self._done_through and pkt.step not in self._pending:
                self._reject("late_or_duplicate")
                return False
            bucket = self._pending[pkt.step] = {}
        if pkt.rank in bucket:
            self._reject("duplicate")
            return False
        bucket[pkt.rank] = pkt
        self._wires.setdefault(pkt.step, {})[pkt.rank] = wire
        self.batch["steps"].append(bytes(raw))
        if len(bucket) < len(self.ranks):
            while len(self._pending) > MAX_PENDING_STEPS:
                old, _ = self._pending.popitem(last=False)
                self._wires.pop(old, None)
                self.evicted += 1
            return False
        del self._pending[pkt.step]
        wires = self._wires.pop(pkt.step, {})
        self._done_through = max(self._done_through, pkt.step)
        self.batch["partials"].append(self._partial(pkt.step, bucket, wires))
        return True

    def _partial(self, step: int, packets: dict[int, StepPacket], wires: dict[int, dict]) -> dict[str, Any]:
        # every collect step keeps each rank's packet whole (per-rank TensorBoard detail);
        # other steps only the extremes, the non-finite ranks and the weight statistics
        part = partial_of(step, packets, keep_all=step % self.collect_freq == 0, wires=wires)
        part["strag"] = [x] if (x := self.stragglers.update(step, packets)) else []
        return to_wire(part)

    def _reject(self, reason: str) -> None:
        self.rejected[reason] += 1
        self.batch["rejected"][reason] = self.batch["rejected"].get(reason, 0) + 1

    def take(self) -> NodeBatch:
        """What is ready to go up (and a fresh batch for what comes next)."""
        batch, self.batch = self.batch, empty_batch()
        return batch

    def has_data(self) -> bool:
        return any(self.batch[k] for k in ("steps", "other", "partials", "rejected"))


def batch_size(batch: NodeBatch) -> int:
    return len(batch["steps"]) + len(batch["other"])
