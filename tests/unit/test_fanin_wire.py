"""The fan-in's cheaper wire: a node's heartbeats as one record, a group's step packets as one
bytes stored undecoded, a telemetry card's shape checked once. Each is checked against the
path it replaces (packet by packet): the same clocks, the same stored bytes, the same refusals."""

from __future__ import annotations

import pytest

import mindpulse.aggregator.hang_clocks as clocks_mod
from mindpulse.aggregator.core import AggregatorCore
from mindpulse.node.group import GroupLeader
from mindpulse.node.relay import NodePreReducer
from mindpulse.rundir.metrics_store import read_wire
from mindpulse.wire.protocol import (
    EventKind,
    EventPacket,
    PacketError,
    StepPacket,
    decode,
    heartbeat_row,
    heartbeat_rows,
)
from mindpulse.workers.heartbeat import Heartbeat

RPN, NODES = 2, 3


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def time(self) -> float:
        return self.now

    def strftime(self, *a):
        return ""


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(clocks_mod, "time", c)
    return c


def core_of(tmp_path, name: str, world: int = NODES * RPN) -> AggregatorCore:
    return AggregatorCore(tmp_path / name, world, settings={"tensorboard": False,
                                                             "world": {"nodes": world // RPN, "ranks_per_node": RPN}})


def packet(r: int, s: int) -> StepPacket:
    return StepPacket(rank=r, step=s, loss=1.0 + 0.1 * r + 0.01 * s, grad_norm=1.0, grad_norm_local=0.5 + r,
                      step_time_s=0.1, data_wait_s=0.001, samples=4, ts=float(s), decision=False,
                      fingerprint="ab" * 6 if s % 10 == 0 else None)


def beat(rank: int, step: int, inside: int | None = None) -> EventPacket:
    return Heartbeat(None, rank, lambda: step, lambda: inside).packet()  # type: ignore[arg-type]


# ---- heartbeats: one record per node ------------------------------------------------------------
def test_the_relay_puts_its_own_ranks_beats_in_one_record_and_passes_others_on():
    pre = NodePreReducer(1, range(2, 4), world_size=6)
    pre.add(beat(2, 7, inside=8).encode())
    pre.add(beat(3, 7).encode())
    pre.add(beat(5, 7).encode())  # not this node's rank: passed on as a packet, the aggregator judges it
    pre.add(EventPacket(rank=2, kind=EventKind.START.value, pid=9).encode())
    batch = pre.take()
    assert batch["beats"] == [[2, 7, "in_step", 8, beat(2, 7).pid], [3, 7, "", 0, beat(3, 7).pid]]
    kinds = [decode(raw).kind for raw in batch["other"]]
    assert kinds == ["heartbeat", "start"], f"only this node's beats become rows, got {kinds} passed on"


def test_a_nodes_beat_record_moves_the_hang_clocks_as_the_packets_did(tmp_path, clock):
    by_packet, by_record = core_of(tmp_path, "packets"), core_of(tmp_path, "record")
    for core in (by_packet, by_record):
        for r in range(NODES * RPN):
            core.ingest([packet(r, s).encode() for s in range(5)])
    clock.now += 100.0
    beats = [beat(0, 4, inside=5), beat(1, 4), beat(2, 4, inside=5), beat(3, 4, inside=5)]
    by_packet.ingest([b.encode() for b in beats])
    by_record.ingest_node(0, {"beats": [heartbeat_row(b) for b in beats[:2]]})
    by_record.ingest_node(1, {"beats": [heartbeat_row(b) for b in beats[2:]]})
    one, other = by_packet.hang_check(60.0, 15.0), by_record.hang_check(60.0, 15.0)
    assert one is not None and one == other, f"packets: {one}; record: {other}"
    assert one["silent"] == [4, 5] and one["inside"] == [0, 2, 3]
    assert {r: i.get("pid") for r, i in by_record.rank_info.items() if r < 4} == \
        {r: i.get("pid") for r, i in by_packet.rank_info.items() if r < 4}
    for core in (by_packet, by_record):
        core.close()


def test_bad_beat_rows_are_counted_and_the_good_ones_kept(tmp_path, clock):
    core = core_of(tmp_path, "run")
    rows = [[0, 3, "", 0, 11], [99, 3, "", 0, 12], [1, "3", "", 0, 13], [1, 3, "saving"], "x",
            [1, 10_000, "", 0, 14]]
    core.ingest_node(0, {"beats": rows})
    snap = core.snapshot()["packets"]
    assert snap["accepted"] == 1
    assert snap["rejected_by_reason"] == {"malformed": 4, "step_out_of_window": 1}
    assert core.clocks.heartbeat[0][1] == 3 and 1 not in core.clocks.heartbeat
    core.close()


def test_heartbeat_rows_read_an_unknown_state_as_between_steps():
    good, bad = heartbeat_rows([[0, 1, "dreaming", 0, 5], [1, 1, "saving", 1, 6]], world_size=2)
    assert bad == 0 and [g[2].value for g in good] == ["", "saving"]
    assert heartbeat_rows({"not": "a list"}, 2) == ([], 1)


# ---- raw step packets: one bytes per group, stored as it came -----------------------------------
def test_a_groups_joined_step_packets_are_stored_as_the_packets_were(tmp_path):
    """metrics.msgpack written from a group leader's one bytes reads back identical, packet for
    packet, to the one written from the packets one by one (read_wire), and counts them."""
    joined, flat = core_of(tmp_path, "joined"), core_of(tmp_path, "flat")
    calls: list = []

    def send(entries, on_acked):
        calls.append(entries)
        joined.ingest_nodes(entries)
        on_acked()

    leader = GroupLeader(0, list(range(NODES)), send)
    pre = [NodePreReducer(n, range(n * RPN, (n + 1) * RPN), world_size=NODES * RPN) for n in range(NODES)]
    try:
        for s in range(1, 12):
            for n in range(NODES):
                for r in pre[n].ranks:
                    pre[n].add(packet(r, s).encode())
                pre[n].add(beat(n * RPN, s).encode())
                leader.add(n, pre[n].take())
            flat.ingest([packet(r, s).encode() for r in range(NODES * RPN)])
    finally:
        leader.close()
    raw = [b for c in calls for _, b in c if b.get("steps")]
    assert raw and all(len(b["steps"]) == 1 and b["steps_n"] >= 1 for b in raw), "a group's steps go up as one bytes"
    assert sum(b["steps_n"] for b in raw) == 11 * NODES * RPN
    assert joined.last_reduced.step == 11 and joined.last_reduced.loss_mean == flat.last_reduced.loss_mean
    assert joined.snapshot()["packets"]["accepted"] == flat.snapshot()["packets"]["accepted"] + 11 * NODES, \
        "every step packet counted (and each node's beat row)"
    joined.close()
    flat.close()
    steps_of = lambda d: [o for o in read_wire(d / "metrics.msgpack") if o.get("t") == "step"]  # noqa: E731
    key = lambda o: (o["step"], o["rank"])  # noqa: E731
    assert sorted(steps_of(tmp_path / "joined"), key=key) == sorted(steps_of(tmp_path / "flat"), key=key)
    assert not [o for o in read_wire(tmp_path / "joined" / "metrics.msgpack") if o.get("kind") == "heartbeat"], \
        "beat rows are liveness only: not stored"


def test_a_joined_batch_rolls_the_segment_before_or_after_it_never_inside(tmp_path):
    from mindpulse.rundir.metrics_store import MetricsWriter, segment_paths

    w = MetricsWriter(tmp_path / "metrics.msgpack", max_file_size=16384)  # three segments: none old enough to thin
    packets = [packet(r, s).encode() for s in range(1, 30) for r in range(4)]
    for i in range(0, len(packets), 20):
        group = packets[i:i + 20]
        w.append([b"".join(group)], len(group))
    w.close()
    assert w.records == len(packets)
    assert len(segment_paths(tmp_path / "metrics.msgpack")) > 1, "the cap closed a segment"
    back = [o for o in read_wire(tmp_path / "metrics.msgpack") if o.get("t") == "step"]
    assert [(o["step"], o["rank"]) for o in back] == [(s, r) for s in range(1, 30) for r in range(4)]


# ---- telemetry: a card's shape checked once --------------------------------------------------------
def card(**kw):
    base = {"node": "n0", "card": 0, "chip": 0, "name": "910B3", "health": "OK", "util_pct": 40.0,
            "memory_used_mb": 1.0, "memory_total_mb": 2.0, "power_w": 100.0, "temp_c": 45.0, "ranks": [0],
            "source": "npu-smi"}
    return dict(base, **kw)


def telemetry(cards, processes=None):
    from mindpulse.wire.protocol import TelemetryPacket

    host = {"cpu_pct": 1.0, "processes": processes or [{"rank": 0, "pid": 1, "cpu_pct": 2.0}]}
    return TelemetryPacket(node="n0", ts=1.0, cards=cards, host=host).encode()


def test_a_card_of_a_shape_seen_before_is_still_refused_for_a_bad_rank_list():
    decode(telemetry([card(), card(card=1, ranks=[1])]))  # the shape is now known
    with pytest.raises(PacketError, match="ranks"):
        decode(telemetry([card(ranks=["0"])]))
    with pytest.raises(PacketError, match="ranks"):
        decode(telemetry([card(ranks=[True])]))
    with pytest.raises(PacketError, match="util_pct"):
        decode(telemetry([card(util_pct="hot")]))
    with pytest.raises(PacketError, match="not a map"):
        decode(telemetry([card(), ["not", "a", "card"]]))


def test_host_processes_of_a_known_shape_pass_and_nested_values_are_refused():
    decode(telemetry([card()], [{"rank": 0, "pid": 1, "cpu_pct": 2.0}, {"rank": 1, "pid": 2, "cpu_pct": 3.0}]))
    with pytest.raises(PacketError, match="processes"):
        decode(telemetry([card()], [{"rank": 0, "pid": 1, "cpu_pct": [2.0]}]))
    with pytest.raises(PacketError, match="processes"):
        decode(telemetry([card()], ["not a map"]))


def test_the_aggregator_process_freezes_its_state_out_of_the_collectors_passes():
    import gc

    from mindpulse.aggregator.core import GC_GEN0_THRESHOLD, quiet_gc

    before, frozen = gc.get_threshold(), gc.get_freeze_count()
    try:
        quiet_gc()
        assert gc.get_threshold()[0] == GC_GEN0_THRESHOLD > before[0]
        assert gc.get_threshold()[1:] == before[1:], "only the youngest generation's threshold moves"
        assert gc.get_freeze_count() > frozen
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
