"""Node partials: merging one partial per node gives exactly the flat reduction."""

from __future__ import annotations

import dataclasses
import math
import random

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mindpulse.reduction.baselines import NodeStragglers
from mindpulse.reduction.partial import exact, exact_sum, from_wire, partial_of, to_wire
from mindpulse.reduction.reducer import StepReducer, StragglerTracker, reduce_step, straggler_scores
from mindpulse.wire.protocol import StepPacket

values = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True, width=64),
                   st.floats(min_value=-1e6, max_value=1e6))
finite_or_not = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=64),
                          st.floats(min_value=-1e6, max_value=1e6))
tflops = st.one_of(st.none(), st.floats(min_value=0.0, max_value=1e3), st.sampled_from([math.nan, -1.0, math.inf]))
positive = st.one_of(st.none(), st.floats(min_value=0.0, max_value=1e3), st.just(math.nan))


@given(st.lists(st.floats(allow_nan=False, allow_infinity=False, width=64), max_size=12))
@settings(max_examples=400, deadline=None)
def test_exact_sums_are_the_sums_of_the_exact_values(xs):
    """The shifted small-integer sums are the very integers of one exact value per float
    (subnormals, +-0.0, huge and tiny values mixed), and so are their squares."""
    assert exact_sum(xs) == sum(map(exact, xs)), xs
    assert exact_sum(xs, squares=True) == sum(exact(x) ** 2 for x in xs), xs
    assert exact_sum([5e-324, 1e308, -0.0, 3]) == exact(5e-324) + exact(1e308) + exact(3.0)


@st.composite
def a_step(draw):
    world = draw(st.integers(1, 24))
    rpn = draw(st.integers(1, 8))
    step = draw(st.integers(0, 50))
    packets = {}
    for r in range(world):
        packets[r] = StepPacket(
            rank=r, step=step, epoch=draw(st.integers(0, 3)), loss=draw(values), lr=draw(values),
            grad_norm=draw(values), grad_norm_local=draw(values), nan_count=draw(st.integers(0, 2)),
            inf_count=draw(st.integers(0, 2)), step_time_s=draw(positive), samples=draw(st.integers(0, 64)),
            ts=draw(st.floats(0, 1e9)), fingerprint=draw(st.sampled_from([None, "aa", "bb"])),
            param_norm=draw(st.one_of(st.none(), st.floats(0, 10))),
            monitor_wait_s=draw(st.floats(0, 5)),
            tokens=draw(st.integers(0, 4096)), tflops=draw(tflops),
            extra=draw(st.dictionaries(st.sampled_from(["acc", "eval_loss"]), finite_or_not, max_size=2)))
    return world, rpn, step, packets


def _plain(red) -> dict:
    d = dataclasses.asdict(red)
    d.pop("per_rank")
    d.pop("straggler_scores")
    return {k: (repr(v) if isinstance(v, float) else v) for k, v in _nan_safe(d).items()}


def _nan_safe(x):
    if isinstance(x, float) and math.isnan(x):
        return "nan"
    if isinstance(x, dict):
        return {k: _nan_safe(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_nan_safe(v) for v in x]
    return x


@pytest.mark.slow  # a long property search: the full suite only
@settings(max_examples=150, deadline=None)
@given(a_step(), st.randoms(use_true_random=False))
def test_merged_node_partials_are_exactly_the_flat_reduction(case, rnd):
    world, rpn, step, packets = case
    flat = reduce_step(step, packets, world)
    nodes = {}
    for r, p in packets.items():
        nodes.setdefault(r // rpn, {})[r] = p
    red = StepReducer(world, ranks_per_node=rpn)
    order = list(nodes)
    rnd.shuffle(order)
    out = []
    for i, n in enumerate(order):
        wire = msgpack.unpackb(msgpack.packb(to_wire(partial_of(step, nodes[n])), use_bin_type=True), raw=False,
                               strict_map_key=False)
        out += red.add_partial(n, from_wire(wire))
        if i == 0 and len(order) > 1:
            assert red.missing_ranks(step) == sorted(r for m in order[1:] for r in nodes[m])
            assert red.add_partial(n, from_wire(wire)) == [] and red.duplicates == 1, "a node's partial twice"
    (merged,) = out
    assert _plain(merged) == _plain(flat)
    # what the merged step keeps whole: the extremes, the non-finite ranks
    for rank in (flat.loss_min_rank, flat.loss_max_rank, flat.step_time_max_rank, *flat.nonfinite_ranks):
        if rank is not None:
            assert merged.per_rank[rank].encode() == packets[rank].encode()


def test_a_missing_rank_holds_the_step_and_a_late_partial_is_counted():
    pk = {r: StepPacket(rank=r, step=3, loss=1.0 + r) for r in range(4)}
    red = StepReducer(4, ranks_per_node=2)
    assert red.add_partial(0, partial_of(3, {0: pk[0], 1: pk[1]})) == []
    assert red.add_partial(1, partial_of(3, {2: pk[2]})) == [], "a node partial must hold all its ranks"
    assert red.out_of_range == 1 and red.missing_ranks(3) == [2, 3]
    (done,) = red.add_partial(1, partial_of(3, {2: pk[2], 3: pk[3]}))
    assert done.loss_mean == 2.5 and done.ranks_reported == 4
    assert red.add_partial(1, partial_of(3, {2: pk[2], 3: pk[3]})) == [] and red.duplicates == 1
    assert dict(red.last_step_of_rank) == {0: 3, 1: 3, 2: 3, 3: 3}


def test_node_straggler_scores_match_the_flat_tracker_when_compute_is_measured():
    rng = random.Random(5)
    flat, nodes = StragglerTracker(window=4), {n: NodeStragglers(window=4) for n in range(3)}
    for s in range(1, 14):  # 5 warm-up steps, then a window of 4
        pk = {r: StepPacket(rank=r, step=s, step_time_s=0.5, data_wait_s=0.01 + (0.3 if r == 4 else 0.0),
                            compute_s=0.1 + rng.random() * 0.01) for r in range(6)}
        want = flat.update(reduce_step(s, pk, 6))
        got_inputs = [nodes[n].update(s, {r: p for r, p in pk.items() if r // 2 == n}) for n in range(3)]
        got = straggler_scores(got_inputs, threshold=0.7)
        if want:
            assert got == {r: sc for r, sc in want.items() if sc < 0.7}
            assert straggler_scores(got_inputs, 0.7, every_rank=True) == want
    assert 4 in got, "the slow rank stands out"



async def no_decisions(batch, step, timeout):
    return b""

def test_a_nodes_relay_pre_reduces_and_the_aggregator_merges_one_partial_per_node(tmp_path):
    """Two nodes of two ranks, through the real relay (pre-reducing) into the real core."""
    import time

    from mindpulse.aggregator.core import AggregatorCore
    from mindpulse.node.relay import NodePreReducer, RelayServer
    from mindpulse.wire.protocol import EventPacket
    from mindpulse.workers.channel import RelayChannel

    core = AggregatorCore(tmp_path, world_size=4, settings={"tensorboard": False,
                                                             "world": {"nodes": 2, "ranks_per_node": 2}})
    got: list[tuple[int, dict]] = []
    servers, channels = [], {}
    for node in (0, 1):
        srv = RelayServer(lambda b, n=node: got.append((n, b)), no_decisions, local_ranks=2,
                          prereduce=NodePreReducer(node, range(2 * node, 2 * node + 2)))
        port = srv.start()
        servers.append(srv)
        for r in (2 * node, 2 * node + 1):
            channels[r] = RelayChannel("127.0.0.1", port)
    packets = {r: StepPacket(rank=r, step=1, loss=1.0 + r, step_time_s=0.1 * (r + 1), samples=4) for r in range(4)}
    for r, ch in channels.items():
        ch.send(EventPacket(rank=r, kind="start", pid=100 + r).encode())
        ch.send_step(packets[r].encode(), 1)
    channels[3].send_step(b"\x00not msgpack", 1)
    deadline = time.time() + 5
    while sum(len(b["partials"]) for _, b in got) < 2 and time.time() < deadline:
        time.sleep(0.01)
    for srv in servers:
        srv.stop()
    for node, batch in got:
        core.ingest_node(node, batch)
    red = core.last_reduced
    assert red is not None and red.step == 1 and red.ranks_reported == 4
    flat = reduce_step(1, packets, 4)
    assert (red.loss_mean, red.loss_max_rank, red.step_time_max_rank, red.samples_per_s) == (
        flat.loss_mean, flat.loss_max_rank, flat.step_time_max_rank, flat.samples_per_s)
    assert {r: i["pid"] for r, i in core.rank_info.items()} == {r: 100 + r for r in range(4)}, "events pass through"
    assert core.rejected == {"node:malformed": 1}, core.rejected
    core.close()
    stored = [o for o in __import__("mindpulse.rundir.metrics_store", fromlist=["x"]).read_wire(
        tmp_path / "metrics.msgpack") if o.get("t") == "step"]
    assert sorted(o["rank"] for o in stored) == [0, 1, 2, 3], "raw step packets are stored as the nodes sent them"


def test_node_partials_drive_the_hang_clock(tmp_path):
    """Ranks behind a relay send no packet the aggregator decodes: their node's partials
    are their progress (a hang is then told from a slow start)."""
    import time

    from mindpulse.aggregator.core import AggregatorCore
    from mindpulse.reduction.partial import to_wire

    core = AggregatorCore(tmp_path, world_size=2, settings={"tensorboard": False,
                                                             "world": {"nodes": 1, "ranks_per_node": 2},
                                                             "monitor": {"startup_timeout_s": 3600}})
    for s in (0, 1, 2):
        pk = {r: StepPacket(rank=r, step=s, loss=1.0) for r in (0, 1)}
        core.ingest_node(0, {"steps": [], "other": [], "partials": [to_wire(partial_of(s, pk))], "rejected": {}})
    assert core.hang_check(timeout_s=5, heartbeat_stale_s=60) is None
    time.sleep(0.15)
    info = core.hang_check(timeout_s=0.1, heartbeat_stale_s=60)
    assert info is not None and info["phase"] == "running" and info["steps"] == {0: 2, 1: 2}, info
    core.close()


@given(st.lists(st.tuples(st.integers(0, 20), values), max_size=10, unique_by=lambda x: x[0]), st.booleans())
@settings(max_examples=500, deadline=None)
def test_extremes_name_the_first_rank_and_put_nan_and_inf_first(items, biggest):
    """The extreme over ranks is the smallest (biggest) value, ties to the lowest rank, and
    any NaN/Inf wins (lowest such rank): checked against a plain sort of the definition,
    for the all-finite shortcut and the general loop alike."""
    from mindpulse.reduction.partial import argext

    vals = [(r, v) for r, v in items if v is not None]
    got = argext(items, biggest)
    if not vals:
        assert got is None
        return
    bad = sorted(r for r, v in vals if not math.isfinite(v))
    if bad:
        want_rank = bad[0]
    else:
        want_rank = sorted(vals, key=lambda x: ((-x[1] if biggest else x[1]), x[0]))[0][0]
    want = dict(vals)[want_rank]
    assert got[1] == want_rank, f"{items} biggest={biggest}: got rank {got[1]}, want {want_rank}"
    assert got[0] is want or got[0] == want or (math.isnan(got[0]) and math.isnan(want))


@given(st.lists(st.floats(allow_nan=False, allow_infinity=False, width=64), max_size=12))
@settings(max_examples=300, deadline=None)
def test_a_sum_and_its_sum_of_squares_from_one_pass_are_the_exact_ones(xs):
    from mindpulse.reduction.partial import exact_sums

    assert exact_sums(xs) == (sum(exact(x) for x in xs), sum(exact(x) ** 2 for x in xs))
    assert exact_sums(xs, squares=False) == (sum(exact(x) for x in xs), 0)


def test_a_rank_reporting_a_non_finite_wait_does_not_break_its_nodes_partial():
    """Seconds a broken rank reports as NaN or Inf count nowhere, as for the data wait: the
    node's partial and its merge still come out."""
    pk = {r: StepPacket(rank=r, step=3, loss=1.0, monitor_wait_s=w, data_wait_s=w)
          for r, w in enumerate((0.5, math.inf, math.nan, 0.25))}
    part = partial_of(3, pk)
    assert part.values["monitor_wait_sum"] == exact(0.5) + exact(0.25)
    assert part.values["monitor_wait_max"] == 0.5 and part.values["data_wait_max"] == 0.5
    back = from_wire(msgpack.unpackb(msgpack.packb(to_wire(part)), strict_map_key=False))
    assert back.values["monitor_wait_sum"] == part.values["monitor_wait_sum"]
