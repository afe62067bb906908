"""Complete-step reduction: reduced once, when every rank reported; NaN is never hidden."""

from __future__ import annotations

import math

import pytest

from mindpulse.reduction.reducer import StepReducer, reduce_all, reduce_step
from mindpulse.wire.protocol import StepPacket


def pkt(rank, step, loss=1.0, **kw):
    kw.setdefault("step_time_s", 0.1)
    kw.setdefault("samples", 8)
    return StepPacket(rank=rank, step=step, loss=loss, **kw)


def test_reduces_only_complete_steps():
    red = StepReducer(3)
    assert red.add(pkt(0, 1)) == []
    assert red.add(pkt(1, 1)) == []
    assert red.missing_ranks(1) == [2]
    out = red.add(pkt(2, 1))
    assert [r.step for r in out] == [1]
    assert red.pending_steps() == []


def test_statistics_and_ranks_of_extremes():
    packets = {
        0: pkt(0, 4, loss=2.0, grad_norm=1.5, grad_norm_local=1.0, step_time_s=0.10, lr=0.1),
        1: pkt(1, 4, loss=1.0, grad_norm=1.5, grad_norm_local=3.0, step_time_s=0.30, lr=0.1),
        2: pkt(2, 4, loss=3.0, grad_norm=1.5, grad_norm_local=2.0, step_time_s=0.20, lr=0.1),
    }
    r = reduce_step(4, packets, 3)
    assert r.loss_mean == pytest.approx(2.0)
    assert (r.loss_min, r.loss_min_rank, r.loss_max, r.loss_max_rank) == (1.0, 1, 3.0, 2)
    assert r.loss_std == pytest.approx(math.sqrt(2 / 3))
    assert r.grad_norm == 1.5
    assert (r.grad_norm_local_max, r.grad_norm_local_max_rank) == (3.0, 1)
    assert (r.step_time_min, r.step_time_min_rank, r.step_time_max, r.step_time_max_rank) == (0.1, 0, 0.3, 1)
    assert r.samples_per_s == pytest.approx(24 / 0.3)
    assert r.lr == 0.1 and r.nonfinite_ranks == []
    assert r.metric("loss") == r.loss_mean


def test_nan_on_one_rank_is_named_and_propagates():
    packets = {0: pkt(0, 5, loss=1.0, grad_norm_local=1.0),
               1: pkt(1, 5, loss=float("nan"), grad_norm_local=float("nan"), nan_count=12)}
    r = reduce_step(5, packets, 2)
    assert math.isnan(r.loss_mean)
    assert r.nonfinite_ranks == [1]
    assert r.loss_max_rank == 1 and math.isnan(r.loss_max)
    assert r.grad_norm_local_max_rank == 1
    assert r.nan_count == 12


def test_out_of_order_duplicates_and_late_packets():
    red = StepReducer(2)
    assert red.add(pkt(0, 2)) == [] and red.add(pkt(0, 1)) == []
    assert [r.step for r in red.add(pkt(1, 1))] == [1]
    assert [r.step for r in red.add(pkt(1, 2))] == [2]
    assert red.add(pkt(1, 2)) == [] and red.duplicates == 1
    assert red.add(pkt(0, 2)) == [] and red.duplicates == 2
    assert red.add(pkt(5, 3)) == [] and red.out_of_range == 1
    assert red.last_step_of_rank == {0: 2, 1: 2}


def test_memory_is_bounded_when_a_rank_goes_silent():
    red = StepReducer(2, max_pending=10)
    for s in range(1, 101):
        red.add(pkt(0, s))
    assert len(red.pending_steps()) == 10
    assert red.evicted_incomplete == 90


def test_reduce_all_over_a_stream():
    stream = [pkt(r, s, loss=10 - s) for s in range(1, 6) for r in range(4)]
    out = reduce_all(stream, 4)
    assert [r.step for r in out] == [1, 2, 3, 4, 5]
    assert out[-1].loss_mean == 5


def test_fingerprints_and_extra_metrics():
    packets = {0: pkt(0, 10, fingerprint="aa", extra={"acc": 0.5}),
               1: pkt(1, 10, fingerprint="aa", extra={"acc": 0.7})}
    r = reduce_step(10, packets, 2)
    assert r.fingerprints == {0: "aa", 1: "aa"}
    assert r.metric("acc") == pytest.approx(0.6)
    rec = r.to_record()
    assert "per_rank" not in rec and rec["fingerprints"] == {"0": "aa", "1": "aa"}
