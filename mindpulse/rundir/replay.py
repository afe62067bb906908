"""The one replay of `metrics.msgpack`: its records told apart, in file order, each with the
launcher attempt it belongs to, and a thinned step taken from its reduced record.

Two readers rebuild reduced steps from the metrics: a restarted aggregator (its own
attempt's records, once, before it takes new packets: `replay_attempt`) and the offline
views (every attempt, incrementally: views/run_reader.py). Both read the records through
`RecordReplay` and complete a thinned step through `step_from_record`, so a marker, a
reduced record or a damaged packet means the same to both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mindpulse.reduction.reducer import ReducedStep
from mindpulse.rundir.metrics_store import (
    ATTEMPT,
    META_TYPES,
    REDUCED,
    ReadStats,
    attempt_of,
    drop_pending,
    read_records,
    reduced_from_record,
)
from mindpulse.wire.protocol import Packet, PacketError, from_wire


@dataclass
class Replayed:
    """One usable record: exactly one of `packet`, `reduced`, `marker` is set (a thinning
    marker sets none)."""

    attempt: int
    """The attempt of the marker before it (0 before any); a marker's own attempt."""
    packet: Packet | None = None
    reduced: ReducedStep | None = None
    marker: dict[str, Any] | None = None


class RecordReplay:
    """Tells the records of a run's metrics for what they are, in file order; fed once or
    poll by poll (it keeps the current attempt between calls)."""

    def __init__(self) -> None:
        self.attempt = 0
        """The attempt of the newest marker read."""
        self.rejected = 0
        """Records that are neither a valid packet nor a valid record of the aggregator's."""
        self.meta_records = 0
        """The aggregator's own records read (attempt markers, reduced steps, thinning markers)."""
        self.thinned_segments = 0

    def read(self, records: Iterable[dict[str, Any]]) -> Iterator[Replayed]:
        for obj in records:
            t = obj.get("t")
            if t == ATTEMPT:
                a = attempt_of(obj)
                if a is None:
                    self.rejected += 1
                    continue
                self.attempt = a
                self.meta_records += 1
                yield Replayed(a, marker=obj)
            elif t == REDUCED:
                red = reduced_from_record(obj)
                if red is None:
                    self.rejected += 1
                    continue
                self.meta_records += 1
                yield Replayed(self.attempt, reduced=red)
            elif t in META_TYPES:
                self.thinned_segments += 1
                self.meta_records += 1
                yield Replayed(self.attempt)
            else:
                try:
                    yield Replayed(self.attempt, packet=from_wire(obj))
                except PacketError:
                    self.rejected += 1


def step_from_record(reducer: Any, red: ReducedStep, completed: set[int] | Any) -> dict[int, Any] | None:
    """A reduced record stands for its step when the packets read could not complete it
    (their per-rank detail was thinned): None when `completed` (the steps the packets
    completed) holds it; else the step's incomplete bucket is dropped from `reducer` and the
    packets it held (the ones thinning kept) are returned."""
    if red.step in completed:
        return None
    return drop_pending(reducer, red.step) if reducer is not None else {}


@dataclass
class ReplayStats:
    read: ReadStats
    packets: int = 0
    """Packets of the attempt replayed."""
    steps_from_records: int = 0
    """Steps taken from their reduced records (thinned)."""

    def as_dict(self) -> dict[str, int]:
        return dict(self.read.as_dict(), packets=self.packets, steps_from_records=self.steps_from_records)


def replay_attempt(path: Path | str, attempt: int, reducer: Any,
                   on_packet: Callable[[Packet], Iterable[ReducedStep]],
                   on_record: Callable[[ReducedStep], None]) -> ReplayStats:
    """Replay one attempt's records of the metrics at `path` (every segment; the other
    attempts' steps are another reducer's): each packet goes to `on_packet` (which returns the
    steps it completed), each reduced record of a step the packets did not complete to
    `on_record`, after its bucket is dropped from `reducer`."""
    stats = ReplayStats(ReadStats())
    completed: set[int] = set()  # steps this replay completed from their packets
    for item in RecordReplay().read(read_records(path, stats.read)):
        if item.attempt != attempt:
            continue
        if item.packet is not None:
            stats.packets += 1
            completed.update(r.step for r in on_packet(item.packet))
        elif item.reduced is not None:
            if step_from_record(reducer, item.reduced, completed) is None:
                continue
            stats.steps_from_records += 1
            on_record(item.reduced)
    return stats


__all__ = ["RecordReplay", "ReplayStats", "Replayed", "replay_attempt", "step_from_record"]
