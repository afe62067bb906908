"""The typed contracts: the launcher's settings for the aggregator and the node agents, the
stop and rollback decisions, the directive's checkpoint kinds and the heartbeat's state."""

from __future__ import annotations

import msgpack
import pytest

from mindpulse.config import RULE_DEFAULTS, MonitorConfig, RuleKind, from_dict, load_config
from mindpulse.config.settings import COMPUTE_DROP_WINDOW, AggregatorSettings, BestSeed, NodeSettings
from mindpulse.launcher.spec import aggregator_settings, node_settings
from mindpulse.wire.directives import Directive
from mindpulse.wire.protocol import CheckpointKind, EventPacket, PacketError, RankState, decode
from mindpulse.wire.stop_decision import RollbackDecision, StopDecision
from mindpulse.workers.heartbeat import BUSY_SAVING, Heartbeat


def test_aggregator_settings_are_built_once_from_the_config():
    cfg, _ = load_config(None, ["monitor.straggler_window=7", "world.ranks_per_node=2"])
    s = aggregator_settings(cfg, attempt=2, start_step=40, rollbacks={"loss_spike": 1},
                            goodput={"started": 5.0, "productive_s": 3.0}, config_yaml="x: 1",
                            best={"metric": 1.5, "metric_name": "loss", "step": 30, "path": "/c/best.ckpt"})
    assert s.config is cfg and s.config.monitor.straggler_window == 7 and s.tensorboard == cfg.output.tensorboard
    assert (s.attempt, s.start_step, dict(s.rollbacks)) == (2, 40, {"loss_spike": 1})
    assert (s.launch_started, s.productive_before_s) == (5.0, 3.0)
    assert s.best == BestSeed(metric=1.5, metric_name="loss", step=30, path="/c/best.ckpt")
    with pytest.raises(AttributeError):
        s.attempt = 3  # type: ignore[misc]


def test_the_plain_form_takes_every_default_from_the_config():
    s = AggregatorSettings.of({"monitor": {"max_lag_steps": 0}, "goodput": {"started": 1.0}, "attempt": 1,
                               "best": {"metric": float("nan"), "metric_name": "loss"}})
    assert s.config.monitor.max_lag_steps == 0
    assert s.config.monitor.straggler_window == MonitorConfig.straggler_window
    assert (s.attempt, s.launch_started, s.best) == (1, 1.0, None), "a NaN best is no best"
    assert AggregatorSettings.of(s) is s and AggregatorSettings.of(None) == AggregatorSettings()


def test_node_settings_name_the_nodes_cards_and_the_configs_windows():
    cfg = from_dict({"world": {"nodes": 2, "ranks_per_node": 2},
                     "anomalies": [{"rule": "compute_drop", "window": 33}]})
    n = node_settings(cfg, 1, relay_token="t", driver={"pid": 1})
    assert n == NodeSettings(node=1, device=cfg.world.device.value, rank_devices={2: 0, 3: 1}, world_size=4,
                             telemetry_interval_s=cfg.monitor.telemetry_interval_s,
                             straggler_window=cfg.monitor.straggler_window, collect_freq=cfg.monitor.collect_freq,
                             compute_window=33, relay_token="t", driver={"pid": 1})
    assert n.local_ranks == 2
    assert node_settings(from_dict({}), 0).compute_window == COMPUTE_DROP_WINDOW


def test_a_stop_decision_reads_as_summary_json_says_it():
    rb = RollbackDecision(rule="loss_high", anomaly_step=2, skip_batches=True, lr_factor=0.25, lr_steps=7)
    asked = StopDecision(rule="loss_high", message="loss", rank=1, value=9.0, threshold=4.0, rollback=rb)
    assert asked.to_dict() == {"rule": "loss_high", "rank": 1, "value": 9.0, "threshold": 4.0, "message": "loss",
                               "rollback": rb.to_dict()}
    decided = StopDecision(rule="interrupt", message="ctrl-c", step=5, decided_at=4, save_last=True)
    assert list(decided.to_dict()) == ["rule", "rank", "value", "threshold", "message", "step", "decided_at",
                                       "save_last"]
    # the driver reads the aggregator's map back as the same decision (`save`, the ask, stays in the aggregator)
    assert StopDecision.from_dict(decided.to_dict()) == decided
    assert StopDecision.from_dict(asked.to_dict()) == asked and StopDecision.from_dict(asked.to_dict()).rollback == rb


def test_a_directive_carries_a_set_of_checkpoint_kinds():
    d = Directive(step=3, saves={CheckpointKind.LAST, CheckpointKind.PERIODIC})
    assert d.saves == frozenset({CheckpointKind.PERIODIC, CheckpointKind.LAST})
    assert d.save_kinds == [CheckpointKind.PERIODIC, CheckpointKind.LAST] and d.save == "periodic,last"
    wire = msgpack.unpackb(d.encode())
    assert wire["save"] == ["periodic", "last"]
    assert Directive.decode(d.encode()) == d
    with pytest.raises(PacketError):
        Directive.decode(msgpack.packb(dict(wire, save="periodic")))
    with pytest.raises(AttributeError):
        d.saves = frozenset()  # type: ignore[misc]


def test_the_heartbeat_sends_its_state_as_fields():
    inside = decode(Heartbeat(None, 1, lambda: 4, lambda: 5).packet().encode())
    assert isinstance(inside, EventPacket)
    assert (inside.rank_state, inside.state_step, inside.step) == (RankState.IN_STEP, 5, 4)
    saving = decode(Heartbeat(None, 0, lambda: 20, busy=lambda: BUSY_SAVING).packet().encode())
    assert (saving.rank_state, saving.state_step) == (RankState.SAVING, 20) and saving.rank_state.busy
    idle = Heartbeat(None, 0, lambda: 3).packet()
    assert idle.rank_state is RankState.IDLE and not idle.rank_state.busy
    assert EventPacket(rank=0, kind="heartbeat", state="unknown").rank_state is RankState.IDLE


def test_rules_get_their_typed_config():
    from mindpulse.aggregator.policies import GradExplosionRule, build_rules

    rule = GradExplosionRule({"factor": 10})
    assert rule.config.rule is RuleKind.GRAD_EXPLOSION and rule.config.factor == 10
    assert rule.config.window == RULE_DEFAULTS[RuleKind.GRAD_EXPLOSION]["window"]
    cfg = from_dict({"anomalies": [{"rule": "straggler", "patience": 3}], "monitor": {"straggler_threshold": 0.5}})
    (straggler,) = [r for r in build_rules(cfg.anomalies, straggler_threshold=0.5) if r.kind == "straggler"]
    assert (straggler.threshold, straggler.patience) == (0.5, 3)
