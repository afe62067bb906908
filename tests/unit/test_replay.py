"""The one replay of metrics.msgpack (mindpulse/rundir/replay.py), as the restarted aggregator and
the offline views read it."""

from __future__ import annotations

from mindpulse.reduction.reducer import StepReducer, reduce_step
from mindpulse.rundir.metrics_store import ATTEMPT, REDUCED, THINNED, reduced_record
from mindpulse.rundir.replay import RecordReplay, replay_attempt, step_from_record
from mindpulse.wire.protocol import StepPacket


def test_records_are_told_apart_with_their_attempt():
    red = reduce_step(3, {0: StepPacket(rank=0, step=3, loss=1.0)}, 1)
    records = [StepPacket(rank=0, step=1).to_wire(),
               {"v": 1, "t": ATTEMPT, "attempt": 2, "reason": "start", "ts": 1.0},
               {"v": 1, "t": REDUCED, **reduced_record(red)},
               {"v": 1, "t": THINNED},
               {"v": 1, "t": "step", "rank": "x"},
               {"v": 1, "t": ATTEMPT, "attempt": -1},
               StepPacket(rank=0, step=4).to_wire()]
    replay = RecordReplay()
    got = list(replay.read(records))
    assert [(r.attempt, r.packet is not None, r.reduced is not None, r.marker is not None) for r in got] == [
        (0, True, False, False), (2, False, False, True), (2, False, True, False), (2, False, False, False),
        (2, True, False, False)]
    assert got[2].reduced.step == 3 and got[4].packet.step == 4
    assert (replay.rejected, replay.meta_records, replay.thinned_segments) == (2, 3, 1)


def test_a_reduced_record_stands_only_for_a_step_the_packets_did_not_complete():
    reducer = StepReducer(2)
    reducer.add(StepPacket(rank=0, step=5))
    red = reduce_step(5, {0: StepPacket(rank=0, step=5)}, 2)
    assert step_from_record(reducer, red, {5}) is None
    kept = step_from_record(reducer, red, set())
    assert list(kept) == [0] and reducer.pending_steps() == []


def test_replay_attempt_reads_one_attempts_records(tmp_path):
    from mindpulse.rundir.metrics_store import MetricsWriter

    w = MetricsWriter(tmp_path / "metrics.msgpack", attempt=0)
    w.append([StepPacket(rank=0, step=1).encode()])
    w.close()
    w = MetricsWriter(tmp_path / "metrics.msgpack", attempt=1)
    w.append([StepPacket(rank=0, step=7).encode(), StepPacket(rank=0, step=8).encode()])
    w.append_reduced(reduce_step(6, {0: StepPacket(rank=0, step=6)}, 1))
    w.close()
    seen, records = [], []
    stats = replay_attempt(tmp_path / "metrics.msgpack", 1, StepReducer(1),
                           lambda p: seen.append(p.step) or [], records.append)
    assert seen == [7, 8] and [r.step for r in records] == [6]
    assert (stats.packets, stats.steps_from_records, stats.read.segments) == (2, 1, 1)
