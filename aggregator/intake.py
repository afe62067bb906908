"""The aggregator's intake: packets and node partials in, checked once, stored in
`metrics.msgpack` as they came, and reduced.

A node agent's batch (node/relay.py) carries its ranks' step packets (validated there,
stored here without decoding), its other packets, and one partial per step its ranks
completed; a rank outside a launch sends encoded packets. Each complete step is yielded as
it completes (the actor's loop, aggregator/core.py, decides on it before the intake takes the
next packet or partial); events and telemetry go to their handlers. One bad packet never
costs the batch: it is counted in `rejected` by reason.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from mindpulse.reduction.partial import from_wire as partial_from_wire
from mindpulse.reduction.reducer import ReducedStep, StepReducer
from mindpulse.rundir.metrics_store import MetricsWriter
from mindpulse.wire.protocol import (
    EventPacket,
    HeartbeatRow,
    Packet,
    PacketError,
    StepPacket,
    TelemetryPacket,
    decode,
    heartbeat_rows,
)

from .hang_clocks import HangClocks

log = logging.getLogger(__name__)

STEP_WINDOW = 256
"""How far beyond the newest reduced step (or the start step) a packet's step may be."""


class Intake:
    def __init__(self, reducer: StepReducer, metrics: MetricsWriter, clocks: HangClocks, *, world_size: int,
                 start_step: int, on_event: Callable[[EventPacket], None],
                 on_telemetry: Callable[[TelemetryPacket], None],
                 on_beats: Callable[[list[HeartbeatRow]], None] | None = None):
        self.reducer = reducer
        self.metrics = metrics
        self.clocks = clocks
        self.world_size = world_size
        self.start_step = start_step
        self.on_event = on_event
        self.on_telemetry = on_telemetry
        self.on_beats = on_beats
        """A node's heartbeat record (its rows checked), in one call."""
        self.accepted = 0
        self.rejected: Counter[str] = Counter()
        self.group_partials = 0
        """Step partials that came merged over several nodes by a group leader."""

    def ingest(self, batch: list[bytes]) -> Iterator[ReducedStep]:
        """Accept a batch of encoded packets; yields each step it completes, as it completes."""
        good_raw: list[bytes] = []
        packets: list[Packet] = []
        for raw in batch if isinstance(batch, (list, tuple)) else [batch]:
            try:
                pkt = decode(raw)
            except PacketError as exc:
                self.rejected[exc.reason] += 1
                continue
            why = self._out_of_bounds(pkt)
            if why:  # before any bookkeeping: a forged rank or step must not move the clocks
                self.rejected[why] += 1
                continue
            good_raw.append(bytes(raw))
            packets.append(pkt)
        self.metrics.append(good_raw)
        self.accepted += len(packets)
        for pkt in packets:
            yield from self.accept_one(pkt)

    def _beyond_window(self, step: int) -> bool:
        return step > max(self.reducer.reduced_through, self.start_step) + STEP_WINDOW

    def _out_of_bounds(self, pkt: Packet) -> str:
        rank = getattr(pkt, "rank", None)
        if rank is not None and rank >= self.world_size:
            return "rank_out_of_world"
        step = getattr(pkt, "step", None)
        if step is not None and self._beyond_window(step):
            return "step_out_of_window"
        return ""

    def accept_one(self, pkt: Packet) -> list[ReducedStep]:
        """One packet in isolation: whatever it holds, the batch goes on (counted)."""
        try:
            return self._accept(pkt)
        except Exception as exc:  # one bad packet must not stop the aggregator: counted, logged
            self.count_error(f"a {type(pkt).__name__} packet could not be applied", exc)
            return []

    def count_error(self, what: str, exc: Exception) -> None:
        self.rejected["apply_error"] += 1
        if self.rejected["apply_error"] <= 5:
            log.error("%s: %s", what, exc, exc_info=exc)

    def ingest_nodes(self, batches: list[tuple[Any, dict[str, Any]]]) -> Iterator[ReducedStep]:
        """Several nodes' batches in one call (a group leader's), each `(node or nodes, batch)`."""
        with self.metrics.held():  # one write to metrics.msgpack per call
            for nodes, batch in batches:
                yield from self.ingest_node(nodes, batch)

    def ingest_node(self, node: int | list[int], batch: dict[str, Any]) -> Iterator[ReducedStep]:
        """A node agent's batch (node/relay.py): its step packets validated there (stored
        as they are, never decoded here), its other packets, and one partial per step its
        ranks completed; the work per step follows nodes, not ranks."""
        steps = batch.get("steps") or []
        if not isinstance(steps, list):
            steps = []
        n = batch.get("steps_n")  # a group leader's: its packets back to back in one bytes
        count = n if type(n) is int and n >= len(steps) else len(steps)
        try:  # the common case costs one join (a group's: one bytes, written as it came)
            self.metrics.append(steps, count)
        except TypeError:  # something else among them: store the bytes, drop the rest
            steps = [bytes(b) for b in steps if isinstance(b, (bytes, bytearray))]
            count = len(steps)
            self.metrics.append(steps)
        self.accepted += count
        beats = batch.get("beats")
        if beats:
            self._beats(beats)
        for reason, n in (batch.get("rejected") or {}).items():
            if isinstance(n, int) and not isinstance(n, bool) and n > 0:
                self.rejected[f"node:{reason}"[:64]] += n
        yield from self.ingest(list(batch.get("other") or []))
        for wire in batch.get("partials") or []:
            try:
                part = partial_from_wire(wire)
            except Exception:  # a malformed partial is counted and dropped; the batch goes on
                self.rejected["malformed_partial"] += 1
                continue
            if self._beyond_window(part.step):
                self.rejected["step_out_of_window"] += 1
                continue
            self.clocks.on_node_step([node] if isinstance(node, int) else list(node), part.step)
            if not isinstance(node, int) and len(node) > 1:
                self.group_partials += 1  # a group leader's merge of several nodes (node/group.py)
            yield from self.reducer.add_partial(node, part)

    def _beats(self, rows: Any) -> None:
        """A node's (or group's) heartbeat record: its rows checked as the packets were, in
        one pass; a step beyond the window is refused as a packet's would be."""
        good, bad = heartbeat_rows(rows, self.world_size)
        if bad:
            self.rejected["malformed"] += bad
        limit = max(self.reducer.reduced_through, self.start_step) + STEP_WINDOW
        if any(r[1] > limit for r in good):
            kept = [r for r in good if r[1] <= limit]
            self.rejected["step_out_of_window"] += len(good) - len(kept)
            good = kept
        if not good:
            return
        self.accepted += len(good)
        if self.on_beats is None:
            return
        try:
            self.on_beats(good)
        except Exception as exc:  # one bad record must not stop the aggregator: counted, logged
            self.count_error("a node's heartbeat record could not be applied", exc)

    def _accept(self, pkt: Packet) -> list[ReducedStep]:
        if isinstance(pkt, StepPacket):
            self.clocks.on_step_packet(pkt.rank, pkt.step, pkt.step > self.reducer.last_step_of_rank.get(pkt.rank, -1))
            return self.reducer.add(pkt)
        if isinstance(pkt, EventPacket):
            self.on_event(pkt)
        elif isinstance(pkt, TelemetryPacket):
            self.on_telemetry(pkt)
        return []


__all__ = ["STEP_WINDOW", "Intake"]
