"""The rank's side: settings in, one channel out, decisions and stops from the schedule."""

from __future__ import annotations

import dataclasses
import json

import pytest

from mindpulse.protocol import (
    SETTINGS_ENV,
    Action,
    CheckpointSettings,
    Directive,
    EventKind,
    MonitorSettings,
    ProfileSettings,
    RankSettings,
    ResumePoint,
    Schedule,
    StepPacket,
    decode,
)
from mindpulse.workers.channel import BATCH_PACKETS, ActorChannel, Channel, RelayChannel, connect
from mindpulse.workers.settings import SettingsError, settings_at


def settings(tmp_path, **changes) -> RankSettings:
    s = RankSettings(
        run_id="t", run_dir=str(tmp_path), attempt=0, namespace="t", aggregator="t", ray_address="", world_size=4,
        ranks_per_node=2, device_target="CPU", relays={0: "127.0.0.1:1", 1: "127.0.0.1:2"}, batch_size=8,
        schedule=Schedule(total_steps=10, collect_freq=100, decision_every=3, save_every=4, best_every=1,
                          eval_every=5, eval_per_epoch=False),
        monitor=MonitorSettings(decision_timeout_s=2.0, heartbeat_s=1.0, weight_stats=False, histogram_regex=""),
        checkpoint=CheckpointSettings(keep_periodic=5, keep_best=1, format="ckpt"),
        profile=ProfileSettings(steps=(), ranks=(0,)), faults=(), resume=None, config={},
    )
    return dataclasses.replace(s, **changes)


class Recording(Channel):
    """Answers decisions from a plan {step: Directive kwargs}."""

    def __init__(self, plan=None):
        super().__init__()
        self.plan = plan or {}
        self.packets = []
        self.calls = 0

    def _ship(self, batch):
        self.calls += 1
        self.packets.extend(map(decode, batch))

    def _decide(self, batch, step):
        self._ship(batch)
        return Directive(step=step, **self.plan.get(step, {}))


def test_decision_steps_come_from_the_schedule_and_every_rank_stops_after_the_same_step(tmp_path):
    from mindpulse.workers.session import RankSession

    ch = Recording({6: dict(action=Action.STOP, reason="rule fired")})
    s = RankSession(settings(tmp_path), rank=1, channel=ch, evaluate=lambda: {"eval_loss": 1.0})
    outcomes = [s.record(1.0) for _ in range(7)]
    steps = [p for p in ch.packets if isinstance(p, StepPacket)]
    assert [p.step for p in steps if p.decision] == [3, 4, 5, 6]  # every 3, save every 4, eval every 5
    assert [p.step for p in steps if "eval_loss" in p.extra] == [5]
    assert {p.samples for p in steps} == {8}, "the batch size comes from the settings"
    assert [o.stop for o in outcomes] == [False] * 5 + [True, True]
    assert outcomes[5].reason == "rule fired"


def test_the_total_steps_stop_and_the_monitor_overrides(tmp_path):
    from mindpulse.workers.monitor import Monitor

    st = settings(tmp_path, resume=ResumePoint(path="x", step=4))
    m = Monitor(settings=st, client=Recording(), rank=1, collect_freq=2, total_steps=6, batch_size=3)
    sched = m.session.schedule
    assert (sched.collect_freq, sched.decision_every, sched.total_steps) == (2, 3, 6)
    assert m.session.batch_size == 3 and m.step_num == 4, "the resume point is the step offset"
    assert m.record(1.0).stop is False
    out = m.record(1.0)
    assert out.stop and out.step == 6 and "train.steps=6" in out.reason


def test_rank_zero_reports_a_save_it_cannot_do_and_goes_on(tmp_path, caplog):
    from mindpulse.workers.session import RankSession

    ch = Recording({3: dict(save="best", metric=1.0, metric_name="loss")})
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
