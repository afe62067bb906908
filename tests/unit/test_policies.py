"""Anomaly rules on synthetic reduced steps and telemetry: each fires with the numbers."""

from __future__ import annotations

import json
import math

import pytest

from mindpulse.aggregator.anomaly_log import read_records
from mindpulse.aggregator.core import AggregatorCore
from mindpulse.aggregator.policies import (
    Action,
    CardOverloadRule,
    GradExplosionRule,
    LossSpikeRule,
    NonFiniteRule,
    ThresholdRule,
    build_rules,
)
from mindpulse.reduction.reducer import reduce_step
from mindpulse.wire.protocol import Action as DirectiveAction
from mindpulse.wire.protocol import StepPacket, TelemetryPacket


def red(step, losses, grad_norm=1.0, locals_=None, **kw):
    packets = {}
    for r, loss in enumerate(losses):
        gl = (locals_ or [1.0] * len(losses))[r]
        packets[r] = StepPacket(rank=r, step=step, loss=loss, grad_norm=grad_norm, grad_norm_local=gl,
                                step_time_s=0.1, samples=4, **kw.get("per_rank", {}).get(r, {}))
    return reduce_step(step, packets, len(losses))


def test_nonfinite_names_the_rank_from_local_values():
    rule = NonFiniteRule({})
    assert rule.check(red(3, [1.0, 1.0])) is None
    f = rule.check(red(5, [1.0, 1.0], grad_norm=math.nan, locals_=[1.0, math.nan],
                       per_rank={1: {"nan_count": 42}}))
    assert f.rule == "nonfinite" and f.rank == 1 and f.step == 5 and f.action is Action.STOP
    assert "rank 1" in f.message and "42 NaN" in f.message
    f = rule.check(red(6, [1.0, math.inf]))
    assert f.rank == 1 and "loss inf" in f.message


def test_grad_explosion_absolute_and_relative():
    rule = GradExplosionRule({"threshold": 100.0})
    assert rule.check(red(1, [1, 1], grad_norm=50)) is None
    f = rule.check(red(2, [1, 1], grad_norm=150, locals_=[1, 290]))  # the absolute limit holds from step 1
    assert f.value == 150 and f.threshold == 100 and f.rank == 1
    rel = GradExplosionRule({"factor": 10, "warmup": 3, "window": 4})
    # steps 1-3 warm up (left out), 4-7 fill the window: a spike there is not judged yet
    for s in range(1, 8):
        assert rel.check(red(s, [1, 1], grad_norm=50.0 if s == 2 else 1.0 + 0.01 * s)) is None
    assert list(rel.history) == pytest.approx([1.04, 1.05, 1.06, 1.07])
    f = rel.check(red(8, [1, 1], grad_norm=50.0))
    assert f is not None and "x its baseline" in f.message and "over the 4 steps before" in f.message, f
    assert "after a 3-step warm-up" in f.message
    # the spike did not enter the baseline: the next normal step is quiet
    assert rel.check(red(9, [1, 1], grad_norm=1.2)) is None


def test_loss_spike_robust_z_warmup_full_window_and_patience():
    rule = LossSpikeRule({"z": 5, "warmup": 2, "window": 6, "patience": 2})
    losses = [9.0, 7.0, 2.0, 2.02, 1.98, 2.01, 1.99, 2.0]  # 2 warm-up steps (left out), then a full window
    for s, v in enumerate(losses, 1):
        assert rule.check(red(s, [v, v])) is None
    assert list(rule.history) == [2.0, 2.02, 1.98, 2.01, 1.99, 2.0]
    assert rule.check(red(9, [5.0, 5.0])) is None  # first hit: patience 2
    f = rule.check(red(10, [5.0, 6.0]))
    assert f is not None and f.rule == "loss_spike" and f.rank == 1 and f.action is Action.WARN
    assert "robust z-scores" in f.message and "median 2 (MAD 0.01) over the 6 steps before" in f.message, f
    # a window that is not full yet judges nothing, however large the jump
    early = LossSpikeRule({"warmup": 0, "window": 10})
    assert all(early.check(red(s, [v, v])) is None for s, v in enumerate([1] * 9 + [50], 1))


def test_a_restore_or_rollback_warms_the_loss_and_gradient_baselines_up_again():
    spike = LossSpikeRule({"z": 5, "warmup": 2, "window": 4})
    grad = GradExplosionRule({"factor": 10, "warmup": 2, "window": 4})
    for s in range(1, 21):
        assert spike.check(red(s, [1.0 + 0.001 * (s % 3)] * 2)) is None
        assert grad.check(red(s, [1, 1], grad_norm=1.0)) is None
    # a rollback to step 11 (restored older weights: a higher loss, other gradients) is not a spike
    for s in range(11, 17):
        assert spike.check(red(s, [4.0 + 0.001 * (s % 3)] * 2)) is None, s
        assert grad.check(red(s, [1, 1], grad_norm=30.0)) is None, s
    assert len(spike.history) == 4 and min(spike.history) >= 4.0


def test_timing_baselines_wait_for_a_warm_up_and_a_full_window_and_rewarm_after_a_pause():
    from mindpulse.reduction.baselines import PAUSE_WARMUP_STEPS, START_WARMUP_STEPS, Baseline, Phase

    b = Baseline(window=3, warmup=START_WARMUP_STEPS)
    phases = [b.observe(s) for s in range(1, START_WARMUP_STEPS + 1)]
    assert phases == [Phase.WARMING] * START_WARMUP_STEPS
    for s in range(START_WARMUP_STEPS + 1, START_WARMUP_STEPS + 4):
        assert b.observe(s) is Phase.FILLING
        b.add(1.0)
    assert b.observe(START_WARMUP_STEPS + 4) is Phase.JUDGING
    # a checkpoint write (or an evaluation, a profiler window) before a step: that step and the next warm up
    s = START_WARMUP_STEPS + 5
    assert [b.observe(s + i, paused=(i == 0)) for i in range(PAUSE_WARMUP_STEPS + 1)] == \
        [Phase.WARMING] * PAUSE_WARMUP_STEPS + [Phase.JUDGING]
    # a step number that goes back (a restore): the window empties and warms up again
    assert b.observe(2) is Phase.WARMING and not b.values


def test_threshold_rule_for_steps_and_absent_metric():
    rule = ThresholdRule({"metric": "eval_loss", "op": ">", "threshold": 3.0, "for_steps": 2, "action": "stop"})
    assert rule.check(red(1, [5, 5])) is None  # no eval_loss at this step
    s2 = red(2, [1, 1], per_rank={0: {"extra": {"eval_loss": 4.0}}, 1: {"extra": {"eval_loss": 4.0}}})
    s3 = red(3, [1, 1], per_rank={0: {"extra": {"eval_loss": 3.5}}, 1: {"extra": {"eval_loss": 3.5}}})
    assert rule.check(s2) is None
    f = rule.check(s3)
    assert f is not None and f.value == 3.5 and f.action is Action.STOP and f.rule == "eval_loss>3"
    low = ThresholdRule({"metric": "samples_per_s", "op": "<", "threshold": 1000})
    assert low.check(red(1, [1, 1])) is not None


def test_card_overload_needs_duration():
    rule = CardOverloadRule({"metric": "temp_c", "threshold": 90, "for_s": 10})
    hot = [{"node": "n0", "card": 3, "temp_c": 97.0, "ranks": [3], "ts": 100.0}]
    assert rule.check_telemetry(hot, now=101.0, step=0) == []  # first seen hot (the aggregator's clock)
    assert rule.check_telemetry(hot, now=105.0, step=1) == []
    fs = rule.check_telemetry(hot, now=111.0, step=2)
    assert len(fs) == 1 and fs[0].rank == 3 and "card 3" in fs[0].message and "97" in fs[0].message
    assert rule.check_telemetry(hot, now=120.0, step=3) == []  # once per excursion
    mem = CardOverloadRule({"metric": "memory_pct", "threshold": 90, "for_s": 0})
    fs = mem.check_telemetry([{"node": "n0", "card": 0, "memory_used_mb": 63000, "memory_total_mb": 65536,
                               "ranks": [0], "ts": 1.0}], now=1.0, step=1)
    assert fs and fs[0].value > 90


def test_defaults_are_on_and_can_be_replaced_or_disabled():
    kinds = [r.kind for r in build_rules([])]
    assert kinds == ["nonfinite", "grad_explosion", "loss_spike", "card_overload", "desync", "straggler",
                     "compute_drop"]
    rules = build_rules([{"rule": "loss_spike", "enabled": False},
                         {"rule": "grad_explosion", "action": "warn", "factor": 5},
                         {"rule": "threshold", "metric": "loss", "op": ">", "threshold": 9}])
    assert [r.kind for r in rules] == ["nonfinite", "card_overload", "desync", "straggler", "compute_drop",
                                       "grad_explosion", "threshold"]
    assert rules[5].action is Action.WARN and rules[5].factor == 5
    two = build_rules([{"rule": "card_overload", "metric": "temp_c"}, {"rule": "card_overload", "metric": "power_w",
                                                                       "threshold": 300}])
    assert [r.metric for r in two if r.kind == "card_overload"] == ["temp_c", "power_w"]


def _steps(core, s, losses, **kw):
    core.ingest([StepPacket(rank=r, step=s, loss=v, decision=True, grad_norm=1.0, grad_norm_local=1.0,
                            step_time_s=0.1, samples=4, **kw).encode() for r, v in enumerate(losses)])


def test_core_records_firings_once_and_stops_at_that_step(tmp_path):
    core = AggregatorCore(tmp_path, world_size=2, settings={"monitor": {"max_lag_steps": 0}, "anomalies": [
        {"rule": "threshold", "metric": "loss", "op": ">", "threshold": 2.5, "action": "warn"}]})
    _steps(core, 1, [1.0, 1.0])
    _steps(core, 2, [3.0, 3.0])  # warn: recorded, run goes on
    assert core.directive_for(2).action is DirectiveAction.CONTINUE
    _steps(core, 3, [1.0, math.nan])
    d = core.directive_for(3)
    assert d.action is DirectiveAction.STOP and "rank 1" in d.reason
    recs = list(read_records(tmp_path))  # anomalies.jsonl while the run goes on
    assert [(r["rule"], r["step"], r["rank"], r["action"]) for r in recs] == [
        ("loss>2.5", 2, None, "warn"), ("nonfinite", 3, 1, "stop")]
    assert recs[1]["value"] == "nan"
    lines = [x for x in core.drain_console() if x.startswith("ANOMALY")]
    assert len(lines) == 2
    snap = core.snapshot()
    assert snap["stop"]["rule"] == "nonfinite" and snap["stop"]["rank"] == 1 and snap["stop"]["step"] == 3


def test_core_card_overload_from_synthetic_telemetry(tmp_path):
    core = AggregatorCore(tmp_path, world_size=1, settings={"monitor": {"max_lag_steps": 0}, "anomalies": [
        {"rule": "card_overload", "metric": "temp_c", "threshold": 90, "for_s": 0, "action": "stop"}]})
    _steps(core, 1, [1.0])
    core.ingest([TelemetryPacket(node="n0", ts=1.0, source="test",
                                 cards=[{"card": 0, "temp_c": 99.0, "ranks": [0]}]).encode()])
    _steps(core, 2, [1.0])
    assert core.directive_for(2).action is DirectiveAction.STOP
    assert core.snapshot()["stop"]["rule"] == "card_overload"


def test_save_and_stop_asks_rank0_for_a_last_checkpoint(tmp_path):
    core = AggregatorCore(tmp_path, world_size=1, settings={
        "monitor": {"max_lag_steps": 0},
        "anomalies": [{"rule": "threshold", "metric": "loss", "op": ">", "threshold": 5, "action": "save_and_stop"}],
        "checkpoint": {"save_last": True}})
    _steps(core, 1, [9.0])
    d = core.directive_for(1)
    assert d.action is DirectiveAction.STOP and "last" in d.save_kinds


def test_a_stop_decided_at_step_s_lands_after_s_plus_max_lag_on_every_rank(tmp_path):
    core = AggregatorCore(tmp_path, world_size=2, settings={"monitor": {"max_lag_steps": 2}})
    _steps(core, 1, [1.0, 1.0])
    _steps(core, 2, [1.0, math.nan])
    lease = core.lease()
    assert (lease.reduced_through, lease.stop_after) == (2, 4) and "rank 1" in lease.reason
    assert [lease.allows(s, 2) for s in (3, 4, 5)] == [True, True, True], "a stop lets every rank reach it"
    for s in (3, 4):
        _steps(core, s, [1.0, 1.0])
    assert [core.directive_for(s).action for s in (2, 3, 4)] == [DirectiveAction.CONTINUE] * 2 + [DirectiveAction.STOP]
    assert core.snapshot()["stop"]["step"] == 4 and core.snapshot()["stop"]["decided_at"] == 2


def test_best_and_periodic_save_decisions(tmp_path):
    core = AggregatorCore(tmp_path, world_size=2, settings={"checkpoint": {
        "save_checkpoint_steps": 2, "save_best_ckpt": True, "best_metric": "loss", "best_mode": "min",
        "best_every_steps": 1}})
    saves = {}
    for s, v in enumerate([3.0, 2.0, 2.5, 1.0], 1):
        _steps(core, s, [v, v])
        saves[s] = core.directive_for(s).save_kinds
    assert saves == {1: ["best"], 2: ["periodic", "best"], 3: [], 4: ["periodic", "best"]}
    assert core.directive_for(4).metric == 1.0


def test_desync_names_ranks_off_the_majority_and_ties_keep_rank0():
    from mindpulse.aggregator.policies import DesyncRule

    rule = DesyncRule({})
    r3 = reduce_step(0, {r: StepPacket(rank=r, step=0, fingerprint=fp) for r, fp in enumerate("aab")}, 3)
    f = rule.check(r3)
    # the whole message: the odd ranks, the majority, its fingerprint, then the causes (a bare
    # `"seed" in message` held for any message, CAUSES always names the seed)
    assert f.rank == 2 and f.step == 0 and f.action is Action.STOP
    assert f.message == ("parameters out of sync at step 0: ranks [2] differ from the majority [0, 1] "
                         f"(fingerprint a). Likely causes: {DesyncRule.CAUSES}"), f.message
    r2 = reduce_step(4, {r: StepPacket(rank=r, step=4, fingerprint=fp) for r, fp in enumerate("xy")}, 2)
    assert rule.check(r2).rank == 1
    same = reduce_step(4, {r: StepPacket(rank=r, step=4, fingerprint="z") for r in range(2)}, 2)
    assert rule.check(same) is None
    tol = DesyncRule({"tolerance": 1e-3})
    close = reduce_step(5, {0: StepPacket(rank=0, step=5, fingerprint="a", param_norm=100.0),
                            1: StepPacket(rank=1, step=5, fingerprint="b", param_norm=100.01)}, 2)
    assert tol.check(close) is None


def test_straggler_scores_and_rule():
    from mindpulse.aggregator.policies import StragglerRule
    from mindpulse.reduction.reducer import StragglerTracker

    tr = StragglerTracker(window=5, warmup=2)
    rule = StragglerRule({"threshold": 0.8, "patience": 1})
    fired, scored = [], []
    for s in range(1, 14):
        # rank 1's data path is slow from step 8; steps 1-2 warm up, 3-7 fill the window
        slow = 1.5 if s >= 8 else 0.001
        rs = reduce_step(s, {0: StepPacket(rank=0, step=s, step_time_s=1.0, data_wait_s=0.001),
                             1: StepPacket(rank=1, step=s, step_time_s=1.0, data_wait_s=slow)}, 2)
        tr.update(rs)
        scored.append(bool(rs.straggler_scores))
        f = rule.check(rs)
        if f:
            fired.append(f)
    assert scored[:6] == [False] * 6 and all(scored[6:]), scored  # no score before a full window
    # the median of 5 turns once 3 of its steps are slow: step 10
    assert len(fired) == 1 and fired[0].rank == 1 and fired[0].value < 0.8 and fired[0].step == 10, fired
    want = "the fastest rank's median busy time 1001 ms over 5 steps, after a 2-step warm-up"
    assert want in fired[0].message, fired[0].message
    assert rs.straggler_scores[0] == 1.0
    even = StragglerTracker(window=5, warmup=0)
    for s in range(1, 6):
        rs = reduce_step(s, {r: StepPacket(rank=r, step=s, step_time_s=1.0, data_wait_s=0.001 * (r + 1))
                             for r in range(2)}, 2)
        even.update(rs)
    assert min(rs.straggler_scores.values()) > 0.99


def test_warm_up_steps_name_no_straggler():
    """A healthy run's first steps (compiles, cold caches) differ by rank: the seed article's
    program named rank 1 a straggler at step 7 on a half-full window."""
    from mindpulse.aggregator.policies import StragglerRule
    from mindpulse.reduction.reducer import StragglerTracker

    tr = StragglerTracker(window=10)
    rule = StragglerRule({"threshold": 0.7, "patience": 2})
    for s in range(1, 40):
        first = 3.0 if s <= 5 else 0.0  # rank 1 compiles its graphs slowly
        rs = reduce_step(s, {0: StepPacket(rank=0, step=s, step_time_s=1.0, data_wait_s=0.01, compute_s=0.5),
                             1: StepPacket(rank=1, step=s, step_time_s=1.0, data_wait_s=0.01 + first,
                                           compute_s=0.5 + 0.02 * (s % 3))}, 2)
        tr.update(rs)
        assert rule.check(rs) is None, (s, rs.straggler_scores)


def test_the_stopping_rule_is_reported_once_while_ranks_reach_the_stop_step(tmp_path):
    core = AggregatorCore(tmp_path, world_size=2, settings={"monitor": {"max_lag_steps": 1}})
    _steps(core, 1, [1.0, 1.0])
    _steps(core, 2, [1.0, math.nan])
    _steps(core, 3, [math.nan, math.nan])  # the NaN weights of step 2 are still there
    recs = list(read_records(tmp_path))  # anomalies.jsonl while the run goes on
    assert [(r["rule"], r["step"]) for r in recs] == [("nonfinite", 2)]
    assert [x for x in core.drain_console() if x.startswith("ANOMALY")] == [
        x for x in [f"ANOMALY nonfinite (rank 1) -> stop: {recs[0]['message']}"]]
    assert core.snapshot()["anomalies_repeated_while_stopping"] == 1
    assert core.directive_for(3).action is DirectiveAction.STOP


def test_a_rule_that_raises_is_reported_once_per_cause(tmp_path):
    from mindpulse.aggregator.policies import Rule

    class Broken(Rule):
        kind = "broken"

        def check(self, red):
            raise ZeroDivisionError("division by zero in my rule")

    core = AggregatorCore(tmp_path, world_size=1, settings={"tensorboard": False,
                                                             "anomalies": [{"rule": "broken"}],
                                                             "extra_rules": {"broken": Broken}})
    for s in (1, 2, 3):
        _steps(core, s, [1.0])
    recs = [r for r in read_records(tmp_path) if r.get("kind") == "rule_error"]
    assert [(r["rule"], r["step"]) for r in recs] == [("broken", 1)], recs
    assert "ZeroDivisionError: division by zero in my rule" in recs[0]["message"]
    assert [x for x in core.drain_console() if x.startswith("RULE ERROR")] == [
        "RULE ERROR broken at step 1: ZeroDivisionError: division by zero in my rule (the rule cannot fire)"]
    assert core.snapshot()["rule_errors"] == [{"rule": "broken", "error": "ZeroDivisionError: division by zero "
                                                                         "in my rule", "step": 1}]


def test_anomalies_are_appended_not_rewritten_and_a_restart_continues_them(tmp_path):
    settings = {"tensorboard": False, "anomalies": [
        {"rule": "threshold", "metric": "loss", "op": ">", "threshold": 0.5, "action": "warn"}]}
    core = AggregatorCore(tmp_path, world_size=1, settings=settings)
    for s in range(1, 401):
        _steps(core, s, [1.0 if s % 2 else 0.0])  # a new excursion every other step
    assert not (tmp_path / "anomalies.json").exists(), "no full rewrite per firing"
    lines = (tmp_path / "anomalies.jsonl").read_text().splitlines()
    assert len(lines) == 200 and json.loads(lines[-1])["step"] == 399
    core.close()
    assert [r["step"] for r in json.loads((tmp_path / "anomalies.json").read_text())] == list(range(1, 400, 2))
    again = AggregatorCore(tmp_path, world_size=1, settings=dict(settings, start_step=400))  # a resumed attempt
    _steps(again, 401, [1.0])
    again.close()
    assert len(json.loads((tmp_path / "anomalies.json").read_text())) == 201, "nothing dropped, nothing lost"
