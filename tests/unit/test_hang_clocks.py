"""The hang clock's shortcut: while every rank is live, the newest clock alone says that
some rank is within its limit; the answer is the full check's in every case."""

from __future__ import annotations

import random

import pytest

from mindpulse.aggregator import hang_clocks
from mindpulse.aggregator.hang_clocks import HangClocks
from mindpulse.wire.protocol import RankState


@pytest.mark.parametrize("seed", range(40))
def test_the_shortcut_answers_as_the_full_check(monkeypatch, seed):
    rnd = random.Random(seed)
    clock = {"t": 1000.0}
    monkeypatch.setattr(hang_clocks, "now", lambda: clock["t"])
    world, rpn = rnd.choice([(8, 8), (64, 8), (32, 0)])
    clocks = HangClocks(world, rpn, startup_timeout_s=30.0, device="cpu")
    for _ in range(rnd.randint(0, 200)):
        clock["t"] += rnd.random() * 2
        kind = rnd.random()
        r = rnd.randrange(world)
        if kind < 0.4:
            clocks.on_step_packet(r, rnd.randint(0, 20), newer=True)
        elif kind < 0.7 and rpn:
            clocks.on_node_step([rnd.randrange(world // rpn)], rnd.randint(0, 20))
        elif kind < 0.95:
            clocks.on_heartbeat(r, rnd.randint(0, 20), rnd.choice(list(RankState)), rnd.randint(0, 21))
        else:
            clocks.on_end(r, clock["t"])
    clock["t"] += rnd.choice([0.5, 5.0, 50.0])
    no_monitor = {rnd.randrange(world)} if rnd.random() < 0.2 else set()
    args = dict(no_monitor=no_monitor, last_step_of_rank=lambda r: 0, pid_of=lambda r: None, started_ranks=[])
    timeout = rnd.choice([1.0, 10.0, 100.0])
    got = clocks.check(timeout, 60.0, **args)
    clocks.newest_clock = 0.0  # the shortcut off: the full pass over the ranks
    assert got == clocks.check(timeout, 60.0, **args)


def test_a_partial_of_a_node_outside_the_world_moves_no_clock(monkeypatch):
    """A stray node id (no rank of this world reads its clock) must not stand in for progress."""
    clock = {"t": 1000.0}
    monkeypatch.setattr(hang_clocks, "now", lambda: clock["t"])
    clocks = HangClocks(8, 4, startup_timeout_s=30.0, device="cpu")
    for n in (0, 1):
        clocks.on_node_step([n], 1)
        clocks.on_node_step([n], 2)
    clock["t"] += 100.0
    clocks.on_node_step([7], 1)
    clocks.on_node_step([7], 2)  # node 7 would hold ranks 28..31 of an 8-rank world
    got = clocks.check(10.0, 60.0, no_monitor=set(), last_step_of_rank=lambda r: 2, pid_of=lambda r: None,
                       started_ranks=[])
    assert got is not None and got["stuck"] == list(range(8)), got
