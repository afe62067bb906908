"""The hang detector: whom it blames (the rank the others wait for, not every rank) and
when its clock runs (from each rank's first finished step; start-up has its own limit)."""

from __future__ import annotations

import pytest

import mindpulse.aggregator.hang_clocks as core_mod
from mindpulse.aggregator.core import AggregatorCore
from mindpulse.config import ConfigError, from_dict
from mindpulse.config.fault_specs import parse_fault
from mindpulse.wire.protocol import EventKind, EventPacket, StepPacket
from mindpulse.workers.faults import FaultInjector
from mindpulse.workers.heartbeat import Heartbeat
from mindpulse.workers.session import RankSession

TIMEOUT, STALE = 60.0, 15.0


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def time(self) -> float:
        return self.now

    def strftime(self, *a):  # milestones (TensorBoard is off here)
        return ""


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(core_mod, "time", c)
    return c


def make(tmp_path, world=2, **settings) -> AggregatorCore:
    return AggregatorCore(tmp_path, world, settings=dict({"tensorboard": False}, **settings))


def steps(core, rank, through, start=0):
    for s in range(start, through + 1):
        core.ingest([StepPacket(rank=rank, step=s, loss=1.0, decision=False).encode()])


def beat(core, rank, step, inside=None):
    """What the rank's heartbeat thread sends (its own packet)."""
    hb = Heartbeat(None, rank, lambda: step, lambda: inside)
    core.ingest([hb.packet().encode()])


def test_an_injected_hang_names_the_rank_the_others_wait_for(tmp_path, clock):
    """hang@1:5: rank 1 blocks before step 5 (heartbeat alive), rank 0 waits inside step 5 (its
    all-reduce). Both last reported step 4."""
    core = make(tmp_path)
    steps(core, 0, 4)
    steps(core, 1, 4)
    clock.now += TIMEOUT + 1
    beat(core, 0, 4, inside=5)
    beat(core, 1, 4)
    info = core.hang_check(TIMEOUT, STALE)
    assert info is not None and info["stuck"] == [1], info
    assert info["silent"] == [] and info["inside"] == [0] and info["phase"] == "running"


def test_a_rank_behind_the_others_last_step_is_named_even_when_they_ran_ahead(tmp_path, clock):
    """With max_lag_steps a rank's packets run ahead of the reduction: the last step each rank
    reported, packet or heartbeat, is what counts."""
    core = make(tmp_path, monitor={"max_lag_steps": 2})
    steps(core, 0, 6)
    steps(core, 1, 4)
    beat(core, 1, 5)  # its step-5 packet is still on its way: the heartbeat says 5
    clock.now += TIMEOUT + 1
    beat(core, 0, 6, inside=7)
    beat(core, 1, 5)
    info = core.hang_check(TIMEOUT, STALE)
    assert info["stuck"] == [1] and info["steps"] == {0: 6, 1: 5}


def test_all_inside_the_step_or_all_outside_names_every_rank(tmp_path, clock):
    core = make(tmp_path)
    steps(core, 0, 4)
    steps(core, 1, 4)
    clock.now += TIMEOUT + 1
    beat(core, 0, 4, inside=5)
    beat(core, 1, 4, inside=5)
    assert core.hang_check(TIMEOUT, STALE)["stuck"] == [0, 1]
    beat(core, 0, 4)
    beat(core, 1, 4)
    assert core.hang_check(TIMEOUT, STALE)["stuck"] == [0, 1]


def test_a_silent_heartbeat_is_named_first(tmp_path, clock):
    core = make(tmp_path)
    steps(core, 0, 4)
    steps(core, 1, 4)
    clock.now += TIMEOUT + 1
    beat(core, 0, 4, inside=5)  # rank 1 (SIGSTOP) sends nothing
    info = core.hang_check(TIMEOUT, STALE)
    assert info["stuck"] == [1] and info["silent"] == [1]


def test_no_hang_while_any_rank_finishes_steps(tmp_path, clock):
    core = make(tmp_path)
    steps(core, 0, 4)
    steps(core, 1, 4)
    clock.now += TIMEOUT - 1
    steps(core, 0, 5, start=5)
    clock.now += 2
    assert core.hang_check(TIMEOUT, STALE) is None


def test_a_slow_start_is_not_a_hang_until_the_startup_limit(tmp_path, clock):
    """Start-up (until each rank's first finished step: the first graph compile, HCCL's
    first connection) runs on msrun.cluster_time_out, not hang_timeout_s."""
    core = make(tmp_path, msrun={"cluster_time_out": 7200})
    assert core.startup_timeout_s == 7200
    steps(core, 0, 0)  # the step-0 packet: sent before the first step's compile
    steps(core, 1, 0)
    clock.now += 1200
    beat(core, 0, 0, inside=1)
    beat(core, 1, 0, inside=1)
    assert core.hang_check(TIMEOUT, STALE) is None
    clock.now += 6000 + 1
    beat(core, 0, 0, inside=1)
    beat(core, 1, 0)
    info = core.hang_check(TIMEOUT, STALE)
    assert info["phase"] == "startup" and info["limit_s"] == 7200 and info["stuck"] == [1]


def test_the_hang_clock_starts_at_each_ranks_first_finished_step(tmp_path, clock):
    core = make(tmp_path, monitor={"startup_timeout_s": 900})
    assert core.startup_timeout_s == 900
    steps(core, 0, 0)
    steps(core, 1, 0)
    clock.now += 800  # a slow first compile
    steps(core, 0, 1, start=1)
    steps(core, 1, 1, start=1)
    clock.now += TIMEOUT - 1  # past the start-up limit since the start, not since step 1
    assert core.hang_check(TIMEOUT, STALE) is None
    clock.now += 2
    beat(core, 0, 1, inside=2)
    beat(core, 1, 1, inside=2)
    info = core.hang_check(TIMEOUT, STALE)
    assert info is not None and info["phase"] == "running" and info["limit_s"] == TIMEOUT


def test_a_resumed_rank_starts_up_until_the_step_after_its_resume_step(tmp_path, clock):
    core = make(tmp_path)
    assert core.startup_timeout_s == 600  # msrun.cluster_time_out's default
    steps(core, 0, 40, start=40)
    steps(core, 1, 40, start=40)
    clock.now += TIMEOUT + 100
    assert core.hang_check(TIMEOUT, STALE) is None
    steps(core, 0, 41, start=41)
    steps(core, 1, 41, start=41)
    clock.now += TIMEOUT + 1
    assert core.hang_check(TIMEOUT, STALE) is not None


def test_ended_ranks_are_not_blamed(tmp_path, clock):
    core = make(tmp_path)
    steps(core, 0, 4)
    steps(core, 1, 4)
    core.ingest([EventPacket(rank=0, kind=EventKind.END.value).encode()])
    clock.now += TIMEOUT + 1
    beat(core, 1, 4)
    assert core.hang_check(TIMEOUT, STALE)["stuck"] == [1]
    core.ingest([EventPacket(rank=1, kind=EventKind.END.value).encode()])
    assert core.hang_check(TIMEOUT, STALE) is None


def test_the_session_is_inside_a_step_only_past_its_faults():
    """What the heartbeat reports: a hang (or any block) in the step's faults is outside it."""
    s = RankSession(None, rank=1)
    s.before_step(1)
    assert s.in_step == 1 and Heartbeat(None, 1, lambda: s.step, lambda: s.in_step).packet().message == "in step 1"
    s.after_step(1)
    assert s.in_step is None
    assert Heartbeat(None, 1, lambda: s.step, lambda: s.in_step).packet().message == ""
    s.injector = FaultInjector(1, [parse_fault("crash@1:2")])
    with pytest.raises(RuntimeError):
        s.before_step(2)
    assert s.in_step is None


def test_startup_timeout_must_not_be_negative():
    assert from_dict({}).monitor.startup_timeout_s == 0
    with pytest.raises(ConfigError, match="monitor.startup_timeout_s"):
        from_dict({"monitor": {"startup_timeout_s": -1}})


def test_ranks_that_train_without_a_monitor_are_named_not_hung(tmp_path, clock):
    """A rank that said it trains without a Monitor (workers/auto_attach.py) reports no step:
    its silence is no hang; once its Monitor starts after all, its clock runs again."""
    import json

    core = make(tmp_path, msrun={"cluster_time_out": 30})
    for r in (0, 1):
        core.ingest([EventPacket(rank=r, kind=EventKind.NO_MONITOR.value, message=json.dumps(
            {"why": "it trains without mindpulse's Monitor", "fix": "add Monitor()"})).encode()])
    clock.now += 3600
    assert core.hang_check(TIMEOUT, STALE) is None
    said = core.drain_console()
    assert len([line for line in said if "without mindpulse's Monitor" in line]) == 1, said  # once, not per rank
    advice = core.snapshot()["advice"]
    assert advice == [{"kind": "no_monitor", "ranks": [0, 1], "message": "rank(s) 0,1: it trains without "
                       "mindpulse's Monitor", "fix": "add Monitor()"}], advice
    core.ingest([EventPacket(rank=1, kind=EventKind.START.value).encode()])
    info = core.hang_check(TIMEOUT, STALE)
    assert info is not None and info["stuck"] == [1] and info["phase"] == "startup", info


def timed_steps(core, clock, through, step_s, ranks=(0, 1)):
    for s in range(0, through + 1):
        clock.now += step_s if s else 0
        for r in ranks:
            core.ingest([StepPacket(rank=r, step=s, loss=1.0, step_time_s=step_s if s else None).encode()])


def test_auto_limit_follows_the_slowest_ranks_step_times():
    from mindpulse.config import auto_hang_timeout

    assert auto_hang_timeout([1.0] * 9) == 300.0  # fewer than 10 steps: the early limit
    assert auto_hang_timeout([1.0] * 10) == 60.0  # 20 x 1 s is below the 60 s floor
    assert auto_hang_timeout([5.0] * 50) == 100.0
    # p99, not the maximum: one step in a hundred may be slow (a compile, a checkpoint wait)
    assert auto_hang_timeout([1.0] * 99 + [30.0]) == 60.0
    assert auto_hang_timeout([4.0] * 98 + [30.0, 31.0]) == 600.0
    assert auto_hang_timeout([None, float("nan")] * 20) == 300.0
    # CPU ranks: below the 30 s after which MindSpore's CPU collectives give up on a peer
    assert auto_hang_timeout([5.0] * 50, "cpu") == 25.0 and auto_hang_timeout([], "cpu") == 25.0
    # ... but never less than a step: 40 s steps on CPU are not hangs at 25 s (before 10 steps too)
    assert auto_hang_timeout([40.0] * 50, "cpu") == 80.0 and auto_hang_timeout([12.0, 40.0], "cpu") == 80.0


def test_auto_names_a_hang_on_one_second_steps_after_a_minute(tmp_path, clock):
    core = AggregatorCore(tmp_path, 2, settings={"tensorboard": False, "world": {"device": "ascend"}})
    timed_steps(core, clock, 20, 1.0)
    clock.now += 59
    beat(core, 0, 20, inside=21)
    beat(core, 1, 20)
    assert core.hang_check(None, STALE) is None, "named before the auto limit (60 s)"
    clock.now += 2
    beat(core, 0, 20, inside=21)
    beat(core, 1, 20)
    info = core.hang_check(None, STALE)
    assert info is not None and info["stuck"] == [1] and info["limit_s"] == 60.0, info


def test_a_checkpoint_save_or_evaluation_is_not_a_hang(tmp_path, clock):
    """Rank 0 writes a checkpoint for 100x a step (the others wait in the next all-reduce): its
    heartbeat says so, and the clock runs again from the end of the write."""
    from mindpulse.workers.heartbeat import BUSY_SAVING

    core = make(tmp_path)
    timed_steps(core, clock, 20, 1.0)
    for _ in range(20):  # 100 s of saving, a beat every 5 s
        clock.now += 5
        core.ingest([Heartbeat(None, 0, lambda: 20, busy=lambda: BUSY_SAVING).packet().encode()])
        beat(core, 1, 20, inside=21)
        assert core.hang_check(None, STALE) is None
    clock.now += 61  # the write ended 61 s ago and nothing moved since: now it is one
    beat(core, 0, 20)
    beat(core, 1, 20, inside=21)
    assert core.hang_check(None, STALE)["stuck"] == [0]


def test_auto_on_cpu_ranks_names_a_hang_before_their_collectives_give_up(tmp_path, clock):
    core = make(tmp_path)  # world.device cpu
    timed_steps(core, clock, 20, 1.0)
    clock.now += 26
    beat(core, 0, 20, inside=21)
    beat(core, 1, 20)
    info = core.hang_check(None, STALE)
    assert info is not None and info["stuck"] == [1] and info["limit_s"] == 25.0, info
