"""The rank's side: settings in, one channel out, decisions and stops from the schedule."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn

from mindpulse.config.rank_settings import (
    SETTINGS_ENV,
    CheckpointSettings,
    MonitorSettings,
    ProfileSettings,
    RankSettings,
    ResumePoint,
    Schedule,
)
from mindpulse.wire.directives import Directive, Lease
from mindpulse.wire.protocol import Action, CheckpointKind, EventKind, StepPacket, decode
from mindpulse.workers.channel import BATCH_PACKETS, ActorChannel, Channel, RelayChannel, connect
from mindpulse.workers.settings import SettingsError, settings_at


def settings(tmp_path, **changes) -> RankSettings:
    s = RankSettings(
        run_id="t", run_dir=str(tmp_path), attempt=0, namespace="t", aggregator="t", ray_address="", world_size=4,
        ranks_per_node=2, device_target="CPU", relays={0: "127.0.0.1:1", 1: "127.0.0.1:2"}, batch_size=8,
        schedule=Schedule(total_steps=10, collect_freq=100, max_lag_steps=1, save_every=4, best_every=3,
                          save_best=True, eval_every=5, eval_per_epoch=False),
        monitor=MonitorSettings(decision_timeout_s=2.0, heartbeat_s=1.0, weight_stats=False, histogram_regex=""),
        checkpoint=CheckpointSettings(keep_periodic=5, keep_best=1, format="ckpt"),
        profile=ProfileSettings(steps=(), ranks=(0,)), faults=(), resume=None, config={},
    )
    return dataclasses.replace(s, **changes)


class Recording(Channel):
    """Answers decisions from a plan {step: Directive kwargs}; an aggregator that reduced
    every step shipped, and decides a stop when it reduces `stop_at` (lag `lag`)."""

    def __init__(self, plan=None, stop_at=None, lag=1):
        super().__init__()
        self.plan = plan or {}
        self.stop_at, self.lag = stop_at, lag
        self.packets = []
        self.calls = 0
        self.lease_calls = []

    def _ship(self, batch, step=None):
        self.calls += 1
        self.packets.extend(map(decode, batch))

    def _decide(self, batch, step, expect):
        self._ship(batch)
        return Directive(step=step, **self.plan.get(step, {}))

    def _fetch_lease(self, need):
        self.lease_calls.append(need)
        reduced = max((p.step for p in self.packets if isinstance(p, StepPacket)), default=-1)
        stop = self.stop_at + self.lag if self.stop_at is not None and reduced >= self.stop_at else -1
        return Lease(reduced_through=reduced, stop_after=stop, reason="rule fired" if stop >= 0 else ""), 0.0


def test_only_rank0_waits_at_candidates_and_every_rank_stops_after_the_same_step(tmp_path):
    from mindpulse.workers.session import RankSession

    stops = {}
    for rank in (0, 1):
        ch = Recording(stop_at=5)
        s = RankSession(settings(tmp_path), rank=rank, channel=ch, evaluate=lambda: {"eval_loss": 1.0})
        outcomes = [s.record(1.0) for _ in range(7)]
        steps = [p for p in ch.packets if isinstance(p, StepPacket)]
        # rank 0: best candidates every 3, a periodic save every 4, evaluation every 5
        assert [p.step for p in steps if p.decision] == ([3, 4, 5, 6] if rank == 0 else [])
        assert [p.step for p in steps if "eval_loss" in p.extra] == [5]
        assert {p.samples for p in steps} == {8}, "the batch size comes from the settings"
        # an aggregator that keeps up costs no wait; rank 0's wait for a verdict is carried by
        # the packet of the step after it
        after_decision = {p.step + 1 for p in steps if p.decision}
        assert {p.monitor_wait_s for p in steps if p.step not in after_decision} == {0.0}
        assert all(p.monitor_wait_s > 0 for p in steps if p.step in after_decision)
        stops[rank] = [o.stop for o in outcomes]
        assert outcomes[5].reason == "rule fired"
        assert ch.lease_calls[:3] == [0, 2, 4], "max_lag_steps back; a lease the cache grants costs no call"
    # decided at step 5, one step of lag: every rank stops after step 6
    assert stops[0] == stops[1] == [False] * 5 + [True, True]


def test_a_wait_for_the_lease_is_carried_by_the_next_packet(tmp_path):
    from mindpulse.workers.session import RankSession

    class Slow(Recording):
        def _fetch_lease(self, need):
            lease, _ = super()._fetch_lease(need)
            return lease, 0.25 if need == 2 else 0.0

    ch = Slow()
    s = RankSession(settings(tmp_path), rank=1, channel=ch)
    for _ in range(5):
        s.record(1.0)
    waits = {p.step: p.monitor_wait_s for p in ch.packets if isinstance(p, StepPacket)}
    assert waits == {1: 0.0, 2: 0.0, 3: 0.0, 4: 0.25, 5: 0.0}, "blocked after step 3, before step 4"


def test_the_total_steps_stop_and_the_monitor_overrides(tmp_path):
    from mindpulse.workers.monitor import Monitor

    st = settings(tmp_path, resume=ResumePoint(path="x", step=4))
    m = Monitor(settings=st, client=Recording(), rank=1, collect_freq=2, total_steps=6, batch_size=3)
    sched = m.session.schedule
    assert (sched.collect_freq, sched.max_lag_steps, sched.total_steps) == (2, 1, 6)
    assert m.session.batch_size == 3 and m.step_num == 4, "the resume point is the step offset"
    assert m.record(1.0).stop is False
    out = m.record(1.0)
    assert out.stop and out.step == 6 and "train.steps=6" in out.reason


def test_rank_zero_reports_a_save_it_cannot_do_and_goes_on(tmp_path, caplog):
    from mindpulse.workers.session import RankSession

    ch = Recording({3: dict(save="best", metric=1.0, metric_name="loss")})  # step 3: a best candidate
    s = RankSession(settings(tmp_path), rank=0, channel=ch)  # no train cell known
    assert [s.record(1.0).stop for _ in range(3)] == [False] * 3
    assert "asked to save best at step 3" in caplog.text


def test_events_carry_enum_values_and_finish_flushes(tmp_path):
    from mindpulse.workers.session import RankSession

    ch = Recording()
    s = RankSession(settings(tmp_path), rank=1, channel=ch)
    s.record(1.0)
    s.finish("done")
    (end,) = [p for p in ch.packets if not isinstance(p, StepPacket)]
    assert (end.kind, end.step, end.message) == (EventKind.END.value, 1, "done")
    assert isinstance(ch.packets[0], StepPacket), "the step buffered before the end went out first"


def test_outside_a_launch_nothing_is_shipped_and_nothing_blocks(monkeypatch):
    from mindpulse.workers.monitor import Monitor

    monkeypatch.delenv(SETTINGS_ENV, raising=False)
    m = Monitor()
    assert m.session.channel is None and m.session.heartbeat is None and m.session.checkpoints is None
    assert [m.record(1.0).stop for _ in range(3)] == [False] * 3


def test_channels_batch_and_flush_alike():
    ch = Recording()
    for i in range(BATCH_PACKETS - 1):
        ch.send(StepPacket(rank=0, step=i).encode())
    assert ch.calls == 0, "a batch waits for its size or the flush interval"
    ch.send(StepPacket(rank=0, step=99).encode())
    assert ch.calls == 1 and len(ch.packets) == BATCH_PACKETS


def test_a_dead_aggregator_gives_no_directive_and_training_goes_on():
    class Gone:
        class _M:
            def remote(self, *a):
                raise RuntimeError("actor died")

        ingest = decide = _M()

    ch = ActorChannel(Gone(), decision_timeout_s=0.1)
    ch.send(b"x")
    ch.flush()
    d = ch.decide(b"y", 7)
    assert d.action is Action.CONTINUE and d.step == 7 and d.reason == "no directive: actor died"
    assert ch.failures == 2


def test_connect_takes_the_relay_of_the_ranks_node(tmp_path):
    ch = connect(settings(tmp_path), rank=3)  # node 1; nothing listens there: the channel still exists
    assert isinstance(ch, RelayChannel) and ch.addr == ("127.0.0.1", 2) and ch.decision_timeout_s == 2.0
    assert ch.decide(b"x", 1).reason.startswith("no directive")


def test_settings_at_points_the_environment_at_the_job_file(tmp_path):
    path = tmp_path / "job.json"
    path.write_text(settings(tmp_path).to_json())
    env: dict[str, str] = {}
    assert settings_at(str(path), env).run_dir == str(tmp_path)
    assert env[SETTINGS_ENV] == str(path)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({}))
    with pytest.raises(SettingsError, match="different settings"):
        settings_at(str(other), env)


def test_tensors_and_numpy_scalars_are_numbers_and_monitor_errors_never_reach_the_loop(tmp_path):
    """The functional `value_and_grad` style hands the loss over as a Tensor: it killed the
    training (msgpack cannot serialize a Tensor). Now it is a number; what the monitor cannot
    handle is logged and counted, and training goes on."""
    import mindspore as ms
    import numpy as np

    from mindpulse.workers.monitor import Monitor

    ch = Recording()
    m = Monitor(settings=settings(tmp_path), client=ch, rank=1)
    out = m.step(loss=ms.Tensor(2.5, ms.float32), grad_norm=np.float64(1.5), nan_count=ms.Tensor(0, ms.int32),
                 extra={"acc": np.float32(0.5), "t": ms.Tensor([0.25], ms.float32)})
    assert out.stop is False
    (first,) = [p for p in ch.packets if isinstance(p, StepPacket) and p.step == 1]
    assert (first.loss, first.grad_norm, first.nan_count, first.extra) == (2.5, 1.5, 0, {"acc": 0.5, "t": 0.25})
    out = m.record(object())  # not a number: a monitor error, not an exception
    assert out.stop is False and m.session.errors == 1
    m.record(1.0)
    steps = {p.step: p for p in ch.packets if isinstance(p, StepPacket)}
    assert 2 not in steps and steps[3].monitor_errors == 1, "the count travels with the next packets"
    errors = [p for p in ch.packets if not isinstance(p, StepPacket) and p.kind == EventKind.MONITOR_ERROR.value]
    assert len(errors) == 1 and "TypeError" in errors[0].message and "recording step 2" in errors[0].message


def test_an_evaluation_reporting_an_undeclared_metric_is_a_monitor_error(tmp_path):
    from mindpulse.workers.monitor import Monitor

    ch = Recording()
    st = settings(tmp_path, config={"eval": {"metrics": ["eval_acc"]}})
    m = Monitor(settings=st, client=ch, rank=1, metrics=["eval_f1"], evaluate=lambda: {"eval_acc": 0.9, "evl_f1": 1},
                eval_every=1)
    m.record(1.0)
    (pk,) = [p for p in ch.packets if isinstance(p, StepPacket) and p.step == 1]
    assert pk.extra == {"eval_acc": 0.9, "evl_f1": 1.0}, "reported all the same"
    (err,) = [p for p in ch.packets if not isinstance(p, StepPacket) and p.kind == EventKind.MONITOR_ERROR.value]
    assert "['evl_f1'], not among the declared metrics ['eval_acc', 'eval_f1']" in err.message


def test_a_rank_whose_relay_is_gone_stops_after_the_decision_timeout(tmp_path):
    from mindpulse.workers.session import RankSession

    class Gone(Recording):
        def _fetch_lease(self, need):
            return self._no_lease(need, "relay closed the connection")

    ch = Gone()
    st = settings(tmp_path, monitor=MonitorSettings(decision_timeout_s=0.2, heartbeat_s=1.0, weight_stats=False,
                                                    histogram_regex=""))
    s = RankSession(st, rank=1, channel=ch)
    assert [s.record(1.0).stop for _ in range(3)] == [False] * 3, "a short outage is ridden out"
    import time

    time.sleep(0.25)
    out = s.record(1.0)
    assert out.stop and "no relay for" in out.reason and "monitor.decision_timeout_s" in out.reason


def test_the_relay_pushes_leases_and_never_holds_a_packet_behind_them():
    """The relay pushes each new lease; the rank reads it without a round trip (and asks
    nothing). Packets and decisions go on meanwhile."""
    import threading
    import time

    from mindpulse.node.relay import RelayServer

    class Up:
        def __init__(self):
            self.sent, self.decided = [], []

        def send(self, batch):
            self.sent.extend(batch)

        async def decide(self, batch, step, timeout):
            self.decided.append(step)
            return Directive(step=step, reason="ok").encode()

        def advance(self, reduced):  # the node's uplink hands the relay a new lease
            srv.loop.call_soon_threadsafe(srv.set_lease, Lease(reduced_through=reduced).encode())

    up = Up()
    srv = RelayServer(up.send, up.decide, local_ranks=1, pushed_leases=True)
    c = RelayChannel("127.0.0.1", srv.start(), decision_timeout_s=5.0)
    up.advance(2)
    try:
        lease, waited = c.lease(2)
        assert lease.reduced_through == 2 and waited == 0.0
        # a step's packet and a decision get through on the other connection meanwhile
        c.send_step(StepPacket(rank=0, step=4, loss=1.0).encode(), 4)
        assert c.decide(StepPacket(rank=0, step=5, loss=1.0, decision=True).encode(), 5, expect=1).reason == "ok"
        assert up.decided == [5]
        assert c.board is not None, "the relay's first answer names the node's lease board"
        frames, answers = srv.stats["frames"], srv.stats["lease_answers"]
        up.advance(3)
        deadline = time.time() + 5
        while srv.lease.reduced_through < 3 and time.time() < deadline:
            time.sleep(0.005)
        lease, waited = c.lease(3)
        assert lease.reduced_through == 3 and waited == 0.0, "on the board ahead: nothing to wait for"
        assert (srv.stats["frames"], srv.stats["lease_answers"]) == (frames, answers), \
            "taking the lease from the board sent nothing to the relay and read nothing from it"
        # a lease not yet there is waited for, and the wait is counted
        threading.Timer(0.3, up.advance, args=(4,)).start()
        lease, waited = c.lease(4)
        assert lease.reduced_through == 4 and waited >= 0.25, waited
        # a lease that does not come within the decision timeout: waited for once, then
        # the rank goes on with what the relay has (the session logs it)
        short = RelayChannel("127.0.0.1", srv.port, decision_timeout_s=0.3)
        t0 = time.monotonic()
        lease, waited = short.lease(9)
        assert lease.reduced_through == 4 and 0.25 <= waited and time.monotonic() - t0 < 0.55
        short.close()
    finally:
        c.close()
        srv.stop()



def test_a_hand_loop_profiles_from_its_first_step_and_ships_the_profilers_seconds(tmp_path):
    """`Monitor.start()` then `step()` per step: a profile window from step 1 starts before
    step 1 (it never started: only the faults were armed) and ends after its last step; the
    seconds the profiler took go in the packets that follow them (goodput `profile`)."""
    import time

    from mindpulse.workers.monitor import Monitor
    from mindpulse.workers.profiler import ProfileWindow

    calls = []

    class Window(ProfileWindow):  # MindSpore's Profiler itself runs in the recipe's launch test
        def begin(self, step):
            if self.window is not None and step == self.window[0]:
                calls.append(("begin", step))
                time.sleep(0.05)

        def end(self, step, force=False):
            if self.window is not None and (force or step >= self.window[1]):
                calls.append(("end", step))
                self.window = None
                time.sleep(0.1)

    st = settings(tmp_path, profile=ProfileSettings(steps=(1, 2), ranks=(1,)))
    ch = Recording()
    m = Monitor(settings=st, client=ch, rank=1)
    m.session.profile = Window(1, 1, 2, str(tmp_path / "profile"))
    m.start()
    assert calls == [("begin", 1)], "the window's first step is the loop's first: it must start before it"
    for _ in range(3):
        m.step(loss=1.0)
    m.finish()
    assert calls == [("begin", 1), ("end", 2)], calls
    spent = {p.step: p.profile_s for p in ch.packets if isinstance(p, StepPacket) and p.step > 0}
    assert spent[1] >= 0.05 and spent[2] < 0.05 and spent[3] >= 0.1, spent


def test_monitor_self_s_counts_mindpulses_own_time_and_leaves_out_evaluation(tmp_path):
    """Each packet carries the seconds the rank spent in mindpulse's code since the packet
    before: the callback's share before `record` (`since`), and the previous packet's send
    (it is counted after that packet was built); an evaluation's time is the user's, not ours."""
    import time

    from mindpulse.reduction.reducer import RunTotals, reduce_step
    from mindpulse.workers.session import RankSession

    class SlowChannel(Recording):
        def _ship(self, batch, step=None):
            time.sleep(0.02)  # the channel's own work
            super()._ship(batch, step)

    ch = SlowChannel()
    s = RankSession(settings(tmp_path), rank=1, channel=ch, evaluate=lambda: time.sleep(0.2) or {"eval_loss": 1.0})
    for _ in range(6):
        s.record(1.0, since=time.perf_counter() - 0.01)  # 10 ms in the callback before record
    steps = {p.step: p for p in ch.packets if isinstance(p, StepPacket) and p.step > 0}
    assert 0.01 <= steps[1].monitor_self_s < 0.1, steps[1]
    for n in range(2, 7):  # the callback's 10 ms + the previous packet's 20 ms send
        assert 0.03 <= steps[n].monitor_self_s < 0.15, (n, steps[n].monitor_self_s)
    assert steps[5].eval_s >= 0.2 and steps[5].monitor_self_s < 0.15, "evaluation is not mindpulse's time"
    # reduced: the most any rank spent, with its rank; summed over ranks; a rule metric; a run total
    packets = {0: dataclasses.replace(steps[3], rank=0, monitor_self_s=0.001), 1: steps[3]}
    red = reduce_step(3, packets, 2)
    assert (red.monitor_self_max, red.monitor_self_max_rank) == (steps[3].monitor_self_s, 1)
    assert red.monitor_self_sum == pytest.approx(0.001 + steps[3].monitor_self_s)
    assert red.metric("monitor_self_s") == red.monitor_self_max
    totals = RunTotals()
    totals.add(red)
    totals.add(red)
    assert totals.as_dict()["monitor_self_s"] == pytest.approx(2 * red.monitor_self_sum)


def test_monitor_self_s_shows_in_the_table_tensorboard_and_rules(tmp_path):
    """One metric of the registry, end to end past the reduction: its console column, its
    TensorBoard tags (cluster and per rank) and a threshold rule that names it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from mindpulse.aggregator.policies import ThresholdRule
    from mindpulse.aggregator.tb_sink import TensorBoardSink
    from mindpulse.config import ConfigError, from_dict
    from mindpulse.reduction.reducer import reduce_step
    from mindpulse.reporting.tables import cluster_table

    def red(step):
        return reduce_step(step, {r: StepPacket(rank=r, step=step, loss=1.0, step_time_s=0.1,
                                                monitor_self_s=0.002 + 0.01 * r) for r in range(2)}, 2)

    table = cluster_table(red(1))
    assert "self ms" in table.splitlines()[1] and "12.0 r1" in table and " 2.0" in table, table
    sink = TensorBoardSink(tmp_path, collect_freq=1)
    sink.on_reduced(red(1))
    sink.close()
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    assert acc.Scalars("monitor/self_s/max")[-1].value == pytest.approx(0.012)
    assert acc.Scalars("rank_1/monitor_self_s")[-1].value == pytest.approx(0.012)
    rule = ThresholdRule({"metric": "monitor_self_s", "op": ">", "threshold": 0.01, "for_steps": 2, "action": "warn"})
    fired = [rule.check(red(s)) for s in (1, 2)]
    assert fired[0] is None and fired[1] is not None, fired
    from_dict({"anomalies": [{"rule": "threshold", "metric": "monitor_self_s", "op": ">", "threshold": 0.05}]})
    with pytest.raises(ConfigError, match="monitor_self_z"):
        from_dict({"anomalies": [{"rule": "threshold", "metric": "monitor_self_z", "op": ">", "threshold": 0.05}]})


def test_the_packet_takes_the_registry_metrics_a_rank_reports(tmp_path):
    """`RankSession.record` fills the packet from the registry (mindpulse/registry/metrics.py): each
    metric a rank reports, coerced by its type; the seconds between packets are `SincePacket`'s,
    the monitor's `STEP_STATS` the registry's cell metrics; a field no metric declares is a
    monitor error (counted), never an exception in the training loop."""
    import numpy as np

    from mindpulse.registry.metrics import Source, cell_stats, reported, since_fields
    from mindpulse.workers.monitor import STEP_STATS
    from mindpulse.workers.session import RankSession, SincePacket

    assert tuple(f.name for f in dataclasses.fields(SincePacket)) == since_fields()
    assert STEP_STATS == cell_stats() and "loss_scale" in STEP_STATS
    assert {m.name for m in reported()} >= set(STEP_STATS) | {"loss", "lr", "tokens", "extra"}
    assert all(m.source in (Source.CALLER, Source.CELL) for m in reported())
    ch = Recording()
    s = RankSession(settings(tmp_path), rank=1, channel=ch)
    s.record(np.float32(2.5), lr=np.float64(1e-4), grad_norm=3, nan_count=np.int64(2), loss_scale=1024,
             overflow=np.bool_(True), epoch=np.int32(1), step_time_s=0.5, tokens=64, extra={"acc": np.float32(0.5)})
    (pkt,) = [p for p in ch.packets if isinstance(p, StepPacket)]
    assert (pkt.loss, pkt.lr, pkt.grad_norm, pkt.nan_count, pkt.loss_scale, pkt.overflow, pkt.epoch) == (
        2.5, 1e-4, 3.0, 2, 1024.0, True, 1), pkt
    assert type(pkt.grad_norm) is float and type(pkt.nan_count) is int and type(pkt.overflow) is bool
    assert pkt.samples == 8 and pkt.tokens == 64 and pkt.extra == {"acc": 0.5} and pkt.overflow_steps == 1
    assert s.errors == 0
    s.record(1.0, probe=3)
    assert s.errors == 1, "a field no metric declares is counted as the monitor's error"


# ---- rank 0 at a checkpoint candidate trains on instead of waiting for the verdict: it copies
# the weights a checkpoint holds, asks, and writes the copy when the verdict comes and asks for it


class Later(Recording):
    """A peer whose verdict comes `delay` polls after the question (as a relay's does, while
    the rank trains on)."""

    answers_later = True

    def __init__(self, plan=None, delay=2, **kw):
        super().__init__(plan, **kw)
        self.delay = delay
        self.asked: list[int] = []
        self.polls = 0
        self.waited = 0

    def decide_later(self, packet, step, expect=None):
        assert self._later is None, "one question at a time"
        self.asked.append(step)
        self._later = (step, self._decide(self._take() + [packet], step, expect))
        self.polls = 0

    def verdict(self, wait):
        if self._later is None:
            return None
        self.polls += 1
        if not wait and self.polls <= self.delay:
            return None
        self.waited += bool(wait and self.polls <= self.delay)
        return super().verdict(wait)


@pytest.fixture()
def small_cell():
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    net = nn.Dense(4, 2)
    opt = nn.Adam(net.trainable_params(), 1e-3)
    return net, nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), opt)


def _bump(net, value: float) -> None:
    """Stands for a training step: every weight changes."""
    for p in net.trainable_params():
        p.set_data(ms.Tensor(np.full(p.shape, value, np.float32)))


def test_rank0_trains_on_and_saves_the_candidates_own_weights(tmp_path, small_cell):
    from mindpulse.workers.session import RankSession

    net, train_cell = small_cell
    best = {"saves": frozenset({CheckpointKind.BEST}), "metric": 0.5, "metric_name": "loss"}
    ch = Later(plan={3: best}, delay=2)
    run = settings(tmp_path)
    run = dataclasses.replace(run, schedule=dataclasses.replace(run.schedule, save_every=0))
    s = RankSession(run, rank=0, channel=ch, network=net, train_cell=train_cell)
    s._copy_or_wait.waited(1.0)  # a wait measured dearer than any copy of these weights: every candidate copies
    for step in range(1, 8):
        _bump(net, float(step))  # the weights after step `step` are all `step`
        s.record(1.0)
    steps = {p.step: p for p in ch.packets if isinstance(p, StepPacket)}
    assert ch.asked == [3, 6], "best every 3: each candidate asked without waiting"
    assert ch.waited == 0, "every verdict had come before the next candidate needed the connection"
    assert all(p.monitor_wait_s == 0.0 for p in steps.values()), {k: p.monitor_wait_s for k, p in steps.items()}
    saved = ms.load_checkpoint(str(tmp_path / "checkpoints" / "step_00000003-best.ckpt"))
    w = saved[net.weight.name].asnumpy()
    assert np.all(w == 3.0), f"the best checkpoint of step 3 holds weights {w.ravel()[:4]}, not step 3's"
    assert int(saved["step"].asnumpy()) == 3
    assert any(k.startswith("moment1") or "moment" in k for k in saved), "the optimizer's state is saved too"
    s.finish()


def test_rank0_copies_or_waits_whichever_costs_it_less(tmp_path, small_cell):
    """The first candidate copies, the next waits, each measured; then the cheaper way. Weights
    above the copy limit always wait: a copy of a large model's weights and optimizer state
    costs host memory and seconds, a wait milliseconds."""
    from mindpulse.workers.session import RankSession
    from mindpulse.workers.weights_copy import CopyOrWait, WeightsCopy, saved_bytes

    net, train_cell = small_cell
    size = saved_bytes(train_cell)
    copy = WeightsCopy()
    copy.take(train_cell, 0)
    assert size == copy.nbytes > 0, "what a copy holds, known from shapes and dtypes before any is taken"
    # an instant channel and a copy made slow: the measured wait is cheaper than the copy, so after
    # one of each rank 0 waits (both are tens of microseconds here: left as they are, which is
    # cheaper is the machine's load, not the session's choice)
    ch = Later(delay=0)
    s = RankSession(settings(tmp_path), rank=0, channel=ch, network=net, train_cell=train_cell)
    take = s._weights_copy.take
    s._weights_copy.take = lambda *a: time.sleep(0.3) or take(*a)
    for _ in range(9):
        s.record(1.0)
    assert ch.asked == [3], "best every 3: candidate 3 copied, 6 waited (measured), 9 waited (cheaper)"
    assert s._copy_or_wait.copy_s > s._copy_or_wait.wait_s
    # weights over the limit: no copy at all
    big = CopyOrWait(max_bytes=size - 1)
    assert not big.copies(train_cell) and big.copy_s is None
    small = CopyOrWait(max_bytes=size)
    assert small.copies(train_cell)
    small.copied(0.002)
    assert not small.copies(train_cell), "a wait is measured once before choosing"
    small.waited(0.005)
    assert small.copies(train_cell), "the copy (2 ms) is cheaper than the wait (5 ms)"
    small.copied(0.009)
    assert not small.copies(train_cell), "the copy's new measure (9 ms) is dearer than the wait"


def test_the_last_step_and_a_named_stop_still_wait(tmp_path, small_cell):
    from mindpulse.workers.session import RankSession

    net, train_cell = small_cell
    ch = Later(delay=0)
    s = RankSession(settings(tmp_path), rank=0, channel=ch, network=net, train_cell=train_cell)
    for _ in range(10):
        s.record(1.0)
    decided = [p.step for p in ch.packets if isinstance(p, StepPacket) and p.decision]
    assert 10 in decided and 10 not in ch.asked, "the run's last step is decided while rank 0 waits"
    # a stop the lease already names for this candidate: waited for too
    ch2 = Later(delay=0)
    ch2._lease = Lease(reduced_through=100, stop_after=3, reason="stop")
    ch2._fetch_lease = lambda need: (ch2._lease, 0.0)
    s2 = RankSession(settings(tmp_path / "b"), rank=0, channel=ch2, network=net, train_cell=train_cell)
    outcomes = [s2.record(1.0) for _ in range(3)]
    assert outcomes[-1].stop and 3 not in ch2.asked


def test_a_pending_verdict_is_taken_before_the_end(tmp_path, small_cell):
    from mindpulse.workers.session import RankSession

    net, train_cell = small_cell
    ch = Later(plan={3: {"saves": frozenset({CheckpointKind.BEST}), "metric": 1.0, "metric_name": "loss"}},
               delay=100)
    s = RankSession(settings(tmp_path), rank=0, channel=ch, network=net, train_cell=train_cell)
    for step in range(1, 4):
        _bump(net, float(step))
        s.record(1.0)
    _bump(net, 99.0)
    s.finish()
    saved = ms.load_checkpoint(str(tmp_path / "checkpoints" / "step_00000003-best.ckpt"))
    assert np.all(saved[net.weight.name].asnumpy() == 3.0)


def test_the_relay_channel_asks_now_and_reads_the_verdict_when_it_came():
    from mindpulse.node.relay import RelayServer

    class Up:
        def __init__(self):
            self.sent = []

        def send(self, batch):
            self.sent.extend(batch)

        async def decide(self, batch, step, timeout):
            await asyncio.sleep(0.3)
            return Directive(step=step, reason=f"verdict {step}").encode()

    up = Up()
    srv = RelayServer(up.send, up.decide, local_ranks=1, pushed_leases=True)
    c = RelayChannel("127.0.0.1", srv.start(), decision_timeout_s=5.0)
    try:
        t0 = time.monotonic()
        c.decide_later(StepPacket(rank=0, step=5, loss=1.0, decision=True).encode(), 5, expect=1)
        assert c.verdict(wait=False) is None, "the aggregator takes 0.3 s: not here yet"
        assert time.monotonic() - t0 < 0.2, "asking did not wait for the answer"
        c.send_step(StepPacket(rank=0, step=6, loss=1.0).encode(), 6)  # the rank trains on meanwhile
        deadline = time.monotonic() + 5
        d = None
        while d is None and time.monotonic() < deadline:
            d = c.verdict(wait=False)
            time.sleep(0.01)
        assert d is not None and d.reason == "verdict 5" and d.step == 5
        assert c.verdict(wait=False) is None, "one verdict per question"
        # a verdict waited for blocks until it comes
        c.decide_later(StepPacket(rank=0, step=10, loss=1.0, decision=True).encode(), 10, expect=1)
        d = c.verdict(wait=True)
        assert d.reason == "verdict 10"
        # a connection lost after the question: no answer is waited for on the next one
        c.decide_later(StepPacket(rank=0, step=20, loss=1.0, decision=True).encode(), 20, expect=1)
        c._disconnect()
        c.send_step(StepPacket(rank=0, step=21, loss=1.0).encode(), 21)  # reconnects
        t0 = time.monotonic()
        d = c.verdict(wait=True)
        assert d.reason.startswith("no directive") or "closed" in d.reason, d.reason
        assert time.monotonic() - t0 < 1.0, "nothing was waited for on the new connection"
        deadline = time.monotonic() + 5
        while not up.sent and time.monotonic() < deadline:
            time.sleep(0.01)
        assert up.sent, "the step packet sent while the verdict was pending was forwarded after it"
    finally:
        c.close()
        srv.stop()
