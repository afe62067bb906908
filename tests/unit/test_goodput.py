"""Goodput accounting: the run's wall time as productive step time and badput by cause,
across a restart and a rollback; the aggregator's live clock equals the one rebuilt from
the reduced records of metrics.msgpack."""

from __future__ import annotations

import pytest
from test_policies import _steps

from mindpulse.aggregator.core import AggregatorCore
from mindpulse.reporting.goodput import CAUSES, GoodputClock, StepTimes, combine, goodput
from mindpulse.rundir.metrics_store import read_records

T0 = 1_000_000.0


def rec(step, ts, st=1.0, dw=0.0, mw=0.0, ck=0.0, ev=0.0, pf=0.0):
    return {"t": "reduced", "step": step, "ts": ts, "step_time_min": st, "data_wait_max": dw,
            "monitor_wait_max": mw, "checkpoint_s_max": ck, "eval_s_max": ev, "profile_s_max": pf}


def clock(*recs, checkpoints=()):
    c = GoodputClock()
    for r in recs:
        c.add(StepTimes(r))
        if r["step"] in checkpoints:
            c.checkpoint_at(r["step"])
    return c.to_dict()


def test_one_attempt_splits_every_second_of_the_wall():
    # launch at T0; step 1 starts at T0+10 (startup), each step 1 s compute; step 2 waited
    # 0.5 s for data, step 3 for rank 0's checkpoint (2 s) and the monitor (0.25 s); 0.25 s of
    # host work nobody measured; the launcher ends 3 s after the last step
    c = clock(rec(1, T0 + 11), rec(2, T0 + 12.5, dw=0.5), rec(3, T0 + 16, ck=2.0, mw=0.25))
    g = combine([c], T0, T0 + 19)
    assert g["wall_s"] == 19 and g["productive_s"] == 3.0 and g["ettr"] == pytest.approx(3 / 19, abs=1e-4)
    assert g["badput_s"] == dict(dict.fromkeys(CAUSES, 0.0), startup=10.0, data_wait=0.5, checkpoint=2.0,
                                 monitor_wait=0.25, teardown=3.0)
    assert g["unaccounted_s"] == 0.25
    assert g["productive_s"] + sum(g["badput_s"].values()) + g["unaccounted_s"] == pytest.approx(g["wall_s"])


def test_a_profiled_window_is_badput_of_its_own_not_unaccounted():
    # a rank starts the profiler before step 2 (0.5 s) and stops it after step 3 (1.5 s: the
    # trace is written and analysed before step 3's packet goes); the others wait for it
    c = clock(rec(1, T0 + 11), rec(2, T0 + 12.5, pf=0.5), rec(3, T0 + 15, pf=1.5), rec(4, T0 + 16))
    g = combine([c], T0, T0 + 16)
    assert g["badput_s"]["profile"] == 2.0 and g["unaccounted_s"] == 0.0, g
    assert g["productive_s"] == 4.0 and g["badput_s"]["startup"] == 10.0
    # a clock saved before the cause existed (no `profile` in its totals) still combines
    old = dict(c, cum={k: v for k, v in c["cum"].items() if k != "profile"})
    assert combine([old], T0, T0 + 16)["badput_s"]["profile"] == 0.0


def test_a_restart_and_a_rollback_count_redone_steps_as_recomputed():
    # attempt 0: steps 1..6, checkpoint at 4, crashes after step 6 (T0+16)
    a0 = clock(*[rec(s, T0 + 10 + s) for s in range(1, 7)], checkpoints=(4,))
    # attempt 1 resumes from 4 at T0+30: steps 5..9, checkpoint at 8; a rollback rule stops it
    a1 = clock(*[rec(s, T0 + 26 + s) for s in range(5, 10)], checkpoints=(8,))
    # attempt 2 rolls back to 8 at T0+45: steps 9..10, then the end at T0+48
    a2 = clock(rec(9, T0 + 46), rec(10, T0 + 47))
    attempts = [{"resumed_from": None}, {"resumed_from": {"step": 4}}, {"resumed_from": {"step": 8}}]
    g = combine([a0, a1, a2], T0, T0 + 48, attempts)
    b = g["badput_s"]
    assert b["startup"] == 10.0                       # T0 .. step 1's start
    assert b["recomputed"] == 3.0                     # attempt 0's 5, 6 and attempt 1's 9
    assert b["restart"] == (30 - 16) + (45 - 35)      # last step to the next attempt's first start
    assert b["teardown"] == 1.0
    assert g["productive_s"] == 4 + 4 + 2             # steps 1-4, 5-8, 9-10: each once
    assert g["productive_s"] + sum(b.values()) + g["unaccounted_s"] == pytest.approx(48)


def test_a_hang_counts_from_the_last_step_to_its_detection():
    a0 = clock(rec(1, T0 + 2), rec(2, T0 + 3))
    g = combine([a0], T0, T0 + 40, [{"failure": {"kind": "hang"}, "ended_at": T0 + 33}])
    assert g["badput_s"]["hang"] == 30.0 and g["badput_s"]["teardown"] == 7.0


def test_no_step_at_all_is_all_startup():
    g = combine([None], T0, T0 + 12, [{"status": "failed"}])
    assert g["productive_s"] == 0 and g["badput_s"]["startup"] == 12 and g["ettr"] == 0


def test_the_aggregators_clock_is_the_one_rebuilt_from_metrics(tmp_path):
    core = AggregatorCore(tmp_path, world_size=2, settings={"tensorboard": False})
    for s in range(1, 6):
        _steps(core, s, [1.0, 1.0], ts=T0 + s * 2.0)
    live = core.snapshot()["goodput"]
    core.close()
    offline = goodput(read_records(tmp_path / "metrics.msgpack"), T0, T0 + 12)
    assert combine([live], T0, T0 + 12) == offline
    assert offline["productive_s"] == pytest.approx(5 * 0.1)
