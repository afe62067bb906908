"""A loss-scale cell's scale and overflow flag as step metrics: reduced exactly through node
partials, an overflow step's non-finite gradients not an anomaly, rules on them."""

from __future__ import annotations

import math

import msgpack
import pytest

from mindpulse.aggregator.policies import NonFiniteRule, ThresholdRule
from mindpulse.reduction.partial import from_wire, merge, partial_of, to_wire
from mindpulse.reduction.reducer import RunTotals, finalize, reduce_step
from mindpulse.wire.protocol import StepPacket
from mindpulse.wire.protocol import from_wire as packet_from_wire


def pk(rank, step, scale=1024.0, overflow=False, skipped=0, **kw):
    base = dict(rank=rank, step=step, loss=1.0, grad_norm=2.0, grad_norm_local=1.5, step_time_s=0.1,
                loss_scale=scale, overflow=overflow, overflow_steps=skipped)
    if overflow:
        base.update(grad_norm=math.inf, grad_norm_local=math.inf, inf_count=12)
    return StepPacket(**dict(base, **kw))


def test_the_fields_travel_and_are_checked():
    p = pk(3, 7, overflow=True, skipped=2)
    back = packet_from_wire(msgpack.unpackb(p.encode(), raw=False))
    assert (back.loss_scale, back.overflow, back.overflow_steps) == (1024.0, True, 2)
    with pytest.raises(ValueError, match="overflow"):
        packet_from_wire(dict(p.to_wire(), overflow="yes"))


def test_node_partials_merge_to_the_flat_reduction():
    packets = {r: pk(r, 5, scale=2.0 ** (10 + r % 3), skipped=1 + r % 2) for r in range(6)}
    flat = reduce_step(5, packets, 6)
    nodes = [partial_of(5, {r: packets[r] for r in rs}) for rs in ((0, 1), (2, 3), (4, 5))]
    merged = finalize(from_wire(msgpack.unpackb(msgpack.packb(to_wire(merge(merge(nodes[0], nodes[1]), nodes[2]))),
                                                raw=False)), 6)
    for red in (flat, merged):
        assert (red.loss_scale_min, red.loss_scale_min_rank) == (1024.0, 0)
        assert (red.loss_scale_max, red.loss_scale_max_rank) == (4096.0, 2)
        assert red.overflow_ranks == 0 and red.overflow_steps == 2
        assert red.metric("loss_scale") == 1024.0 and red.metric("overflow") == 0


def test_an_overflow_step_is_skipped_not_an_anomaly_but_a_nan_loss_still_is():
    red = reduce_step(4, {r: pk(r, 4, overflow=True, skipped=1) for r in range(2)}, 2)
    assert red.overflow_ranks == 2 and red.nonfinite_ranks == [] and red.grad_norm is None
    assert NonFiniteRule({}).check(red) is None
    red = reduce_step(4, {0: pk(0, 4, overflow=True), 1: pk(1, 4, overflow=True, loss=math.nan)}, 2)
    assert red.nonfinite_ranks == [1] and NonFiniteRule({}).check(red) is not None
    # at a scale of 1 no scale overflowed them: the gradients themselves are non-finite
    red = reduce_step(4, {0: pk(0, 4, scale=1.0, overflow=True), 1: pk(1, 4, scale=1.0, overflow=True)}, 2)
    assert red.nonfinite_ranks == [0, 1] and NonFiniteRule({}).check(red) is not None
    # without a loss-scale cell non-finite gradients are what they always were
    red = reduce_step(4, {0: pk(0, 4, scale=None, overflow=None), 1: pk(1, 4, scale=None, overflow=None,
                                                                       inf_count=3)}, 2)
    assert red.nonfinite_ranks == [1] and red.loss_scale_min is None


def test_rules_see_overflow_in_a_row_and_a_collapsed_scale():
    in_a_row = ThresholdRule({"rule": "threshold", "metric": "overflow", "op": ">=", "threshold": 1,
                              "for_steps": 3})
    collapsed = ThresholdRule({"rule": "threshold", "metric": "loss_scale", "op": "<=", "threshold": 1})
    fired = []
    for step, (ovf, scale) in enumerate([(False, 8.0), (True, 4.0), (True, 2.0), (False, 2.0), (True, 1.0),
                                         (True, 1.0), (True, 1.0)], start=1):
        red = reduce_step(step, {0: pk(0, step, scale=scale, overflow=ovf)}, 1)
        fired += [(f.rule, step) for f in (in_a_row.check(red), collapsed.check(red)) if f is not None]
    assert fired == [("loss_scale<=1", 5), ("overflow>=1", 7)], fired


def test_summary_totals_per_rank_and_in_all():
    t = RunTotals()
    t.add(reduce_step(1, {0: pk(0, 1), 1: pk(1, 1)}, 2))
    assert t.as_dict()["overflow_steps"] == {"total": 0, "per_rank": {}}
    t.add(reduce_step(2, {0: pk(0, 2, scale=512.0, overflow=True, skipped=1),
                          1: pk(1, 2, scale=512.0, overflow=True, skipped=1)}, 2))
    d = t.as_dict()
    assert d["overflow_steps"] == {"total": 1, "per_rank": {"0": 1, "1": 1}}
    assert d["loss_scale"] == {"min": 512.0, "max": 512.0, "step": 2}
    empty = RunTotals().as_dict()
    assert empty["loss_scale"] is None and empty["overflow_steps"] is None


def test_a_non_finite_loss_scale_travels_through_node_partials():
    """A broken cell's Inf or NaN scale is shown, as on the flat path, not refused by the wire."""
    packets = {0: pk(0, 6, scale=math.inf), 1: pk(1, 6, scale=2.0)}
    flat = reduce_step(6, packets, 2)
    merged = finalize(from_wire(msgpack.unpackb(msgpack.packb(to_wire(partial_of(6, packets))), raw=False)), 2)
    for red in (flat, merged):  # a non-finite value wins either extreme: it is what to see
        assert (red.loss_scale_min, red.loss_scale_min_rank, red.loss_scale_max) == (math.inf, 0, math.inf)
    w = to_wire(partial_of(6, packets))
    w["values"]["loss_scale_min"] = [True, 0]
    with pytest.raises(ValueError, match="loss_scale_min"):
        from_wire(w)


def test_an_overflow_a_cell_reports_without_counts_is_judged_by_its_scale():
    """MindFormers' cell without use_clip_grad reports no norm and no counts, only its flag."""
    bare = dict(grad_norm=None, grad_norm_local=None, inf_count=0)
    at_one = reduce_step(3, {0: pk(0, 3, scale=1.0, overflow=True, **bare)}, 1)
    assert at_one.nonfinite_ranks == [0] and NonFiniteRule({}).check(at_one) is not None
    scaled = reduce_step(3, {0: pk(0, 3, scale=4096.0, overflow=True, **bare)}, 1)
    assert scaled.nonfinite_ranks == [] and NonFiniteRule({}).check(scaled) is None
    with pytest.raises(ValueError, match="overflow_steps"):
        packet_from_wire(dict(pk(0, 3).to_wire(), overflow_steps=-1))
