"""The tree's second level: a group leader merges its members' node partials per step
into one aggregator call and lets a late member's step go up on its own; the aggregator
cannot tell the result from the flat reduction. (The lease it passes down: test_uplink.py.)"""

from __future__ import annotations

import time

from mindpulse.aggregator.core import AggregatorCore
from mindpulse.node import group as group_mod
from mindpulse.node.group import GroupLeader
from mindpulse.node.relay import NodePreReducer
from mindpulse.reduction.reducer import reduce_step
from mindpulse.rundir.metrics_store import read_wire
from mindpulse.wire.protocol import EventPacket, StepPacket

NODES, RPN = 3, 2


def packet(r: int, s: int) -> StepPacket:
    return StepPacket(rank=r, step=s, loss=1.0 + 0.1 * r + 0.01 * s, grad_norm=1.0, grad_norm_local=0.5 + r,
                      step_time_s=0.1 * (r + 1), data_wait_s=0.001, samples=4, ts=float(s),
                      fingerprint="ab" * 6 if s % 10 == 0 else None)


def test_a_group_leader_merges_its_members_into_one_call_per_step(tmp_path, monkeypatch):
    monkeypatch.setattr(group_mod, "STRAGGLE_S", 0.2)
    core = AggregatorCore(tmp_path, world_size=NODES * RPN,
                          settings={"tensorboard": False, "world": {"nodes": NODES, "ranks_per_node": RPN}})
    calls: list[list] = []

    def send(entries, on_acked):
        calls.append(entries)
        core.ingest_nodes(entries)
        on_acked()

    leader = GroupLeader(0, list(range(NODES)), send)
    pre = [NodePreReducer(n, range(n * RPN, (n + 1) * RPN), world_size=NODES * RPN) for n in range(NODES)]
    try:
        for s in range(1, 6):
            for n in range(NODES):
                for r in pre[n].ranks:
                    pre[n].add(packet(r, s).encode())
                if s == 1:
                    pre[n].add(EventPacket(rank=n * RPN, kind="start", pid=100 + n).encode())
                leader.add(n, pre[n].take())
            red = core.last_reduced
            assert red is not None and red.step == s, f"step {s} was not reduced once every member sent it"
            flat = reduce_step(s, {r: packet(r, s) for r in range(NODES * RPN)}, NODES * RPN)
            assert (red.loss_mean, red.loss_max_rank, red.grad_norm_local_max_rank, red.samples_per_s,
                    red.ranks_reported) == (flat.loss_mean, flat.loss_max_rank, flat.grad_norm_local_max_rank,
                                            flat.samples_per_s, flat.ranks_reported), f"step {s}"
        merged = [e for c in calls for e in c if isinstance(e[0], list)]
        assert [e[0] for e in merged] == [[0, 1, 2]] * 5, f"one merged entry per step: {[e[0] for e in merged]}"
        assert len(calls) == 5, f"one aggregator call per step, got {len(calls)}"

        # node 2 is late with step 6: the others go up on their own, and node 2's part after them
        for n in (0, 1):
            for r in pre[n].ranks:
                pre[n].add(packet(r, 6).encode())
            leader.add(n, pre[n].take())
        deadline = time.time() + 5
        while core.reducer.missing_ranks(6) != [4, 5] and time.time() < deadline:
            time.sleep(0.02)
        assert core.reducer.missing_ranks(6) == [4, 5], "the punctual members' step 6 did not go up alone"
        for r in pre[2].ranks:
            pre[2].add(packet(r, 6).encode())
        leader.add(2, pre[2].take())
        deadline = time.time() + 5
        while (core.last_reduced.step != 6) and time.time() < deadline:
            time.sleep(0.02)
        assert core.last_reduced.step == 6 and core.last_reduced.ranks_reported == 6
    finally:
        leader.close()
    assert {r: i["pid"] for r, i in core.rank_info.items()} == {0: 100, 2: 101, 4: 102}, "events pass through"
    core.close()
    stored = sorted((o["rank"], o["step"]) for o in read_wire(tmp_path / "metrics.msgpack") if o.get("t") == "step")
    assert stored == sorted((r, s) for r in range(NODES * RPN) for s in range(1, 7)), "every raw packet is stored"


def test_a_batch_from_a_node_outside_the_group_is_refused_and_counted(tmp_path):
    core = AggregatorCore(tmp_path, world_size=4, settings={"tensorboard": False,
                                                             "world": {"nodes": 2, "ranks_per_node": 2}})
    leader = GroupLeader(0, [0], lambda entries, on_acked: (core.ingest_nodes(entries), on_acked()))
    try:
        leader.add(1, {"steps": [packet(2, 1).encode()], "other": [], "partials": [], "rejected": {}})
        leader.flush(force=True)
    finally:
        leader.close()
    assert core.rejected == {"node:node_not_in_group": 1}, core.rejected
    assert core.accepted == 0
    core.close()


def test_a_members_frame_is_done_only_once_its_step_went_up_and_a_frame_sent_again_waits_with_it(tmp_path):
    """The receipts of member frames (mindpulse/uplink.Receipt: the leader's server
    acknowledges a frame once its receipt is done): a partial held for the rest of the group
    keeps its frame's receipt; a frame sent again (a reconnect) while that partial is held
    waits with it, rather than being acknowledged as a duplicate."""
    from mindpulse.wire.uplink import Receipt

    core = AggregatorCore(tmp_path, world_size=2 * RPN, settings={"tensorboard": False,
                                                                   "world": {"nodes": 2, "ranks_per_node": RPN}})
    sent: list = []

    def send(entries, on_acked):
        core.ingest_nodes(entries)
        sent.append(on_acked)  # acknowledged later, when the test says so

    leader = GroupLeader(0, [0, 1], send)
    done: list[str] = []
    pre = [NodePreReducer(n, range(n * RPN, (n + 1) * RPN), world_size=2 * RPN) for n in range(2)]
    try:
        for r in pre[1].ranks:
            pre[1].add(packet(r, 1).encode())
        batch = pre[1].take()
        for name in ("first", "again"):
            receipt = Receipt(lambda name=name: done.append(name))
            leader.add(1, batch, receipt)
            receipt.release()  # the server's own hold, once the frame is filed
        leader.flush()  # the raw packets go up; the partial waits for node 0
        acked_through = len(sent)
        for acked in sent[:acked_through]:
            acked()
        assert done == [], "a frame was acknowledged while its step is held for the group"
        for r in pre[0].ranks:
            pre[0].add(packet(r, 1).encode())
        leader.add(0, pre[0].take())
        assert core.last_reduced is not None and core.last_reduced.step == 1
        assert done == [], "acknowledged before the call up was"
        for acked in sent[acked_through:]:
            acked()
        assert sorted(done) == ["again", "first"], done
    finally:
        leader.close()
    core.close()


def test_rank_0s_decision_reaches_the_aggregator_when_its_packet_is_no_extreme(tmp_path):
    """A best checkpoint off a collect step: rank 0's packet asks for the verdict, and a node
    partial keeps it whole although rank 0 is at no end of any metric (it was dropped, so the
    aggregator never judged that step and no best checkpoint was saved)."""
    from mindpulse.wire.protocol import CheckpointKind

    world = 2 * 4
    core = AggregatorCore(tmp_path, world_size=world, settings={
        "tensorboard": False, "world": {"nodes": 2, "ranks_per_node": 4},
        "checkpoint": {"best_every_steps": 5}})
    leader = GroupLeader(0, [0, 1], lambda entries, on_acked: (core.ingest_nodes(entries), on_acked()))
    pre = [NodePreReducer(n, range(4 * n, 4 * n + 4), world_size=world) for n in (0, 1)]

    def middling(r: int, s: int) -> StepPacket:
        # rank 0 sits in the middle of every metric: ranks 1 and 2 (node 0) and 5 and 6 (node 1) hold the ends
        at = {0: 2.0, 1: 1.0, 2: 3.0, 3: 2.5, 4: 2.2, 5: 0.5, 6: 4.0, 7: 2.4}[r]
        return StepPacket(rank=r, step=s, loss=at, grad_norm=1.0, grad_norm_local=at, step_time_s=0.1 * at,
                          data_wait_s=0.001 * at, samples=4, ts=float(s), decision=r == 0 and s == 5)

    try:
        for s in range(1, 7):
            for n in (0, 1):
                for r in pre[n].ranks:
                    pre[n].add(middling(r, s).encode())
                leader.add(n, pre[n].take())
            assert core.last_reduced is not None and core.last_reduced.step == s
        d = core.directive_for(5)
        assert d is not None and CheckpointKind.BEST in d.save_kinds, f"no best checkpoint asked at step 5: {d}"
    finally:
        leader.close()
        core.close()
