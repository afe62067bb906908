"""Rules changed on a running job: parsing and checking a change, the aggregator applying it
between steps (a real AggregatorCore, real request and rules.json files), its record, a
restarted aggregator and a later attempt keeping it, and the `mindpulse rules` command."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import yaml

from mindpulse.aggregator.anomaly_log import read_records
from mindpulse.aggregator.core import AggregatorCore
from mindpulse.config import RULE_DEFAULTS, ConfigError, RuleKind, from_dict
from mindpulse.launcher.cli import main
from mindpulse.rules import changes as rc
from mindpulse.wire.protocol import Action, StepPacket

LOSS_HIGH = {"rule": "threshold", "name": "loss_high", "metric": "loss", "op": ">", "threshold": 100.0,
             "action": "stop"}


def step(rank, s, loss=1.0):
    return StepPacket(rank=rank, step=s, loss=loss, decision=False, step_time_s=0.1, samples=4).encode()


def run_config(**extra):
    raw = {"anomalies": [LOSS_HIGH, {"rule": "card_overload", "metric": "power_w", "threshold": 300},
                         {"rule": "card_overload", "metric": "temp_c"}],
           "monitor": {"max_lag_steps": 0}}
    raw.update(extra)
    return from_dict(raw)


def make_run(tmp_path, **extra):
    """A run directory as the launcher leaves it (config.yaml) and the aggregator's settings."""
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    cfg = run_config(**extra)
    text = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
    (run_dir / "config.yaml").write_text(text)
    plain = cfg.to_dict()
    settings = {"anomalies": plain["anomalies"], "monitor": plain["monitor"], "eval": plain["eval"],
                "tensorboard": False, "config_yaml": text}
    return run_dir, cfg, settings


def test_the_drivers_rules_are_the_aggregators_without_its_code():
    """`mindpulse rules` lists and checks a run's rules from their configs alone (the base's
    rules/ package); the aggregator builds them with its rule classes. Both give the same
    rules in the same order, named alike, with the same resolved configs: a threshold rule
    named by its condition, two rules of one kind, a turned-off default, a straggler rule
    taking monitor.straggler_threshold."""
    from mindpulse.aggregator.policies import build_rules

    cfg = from_dict({"anomalies": [
        {"rule": "threshold", "metric": "grad_norm", "op": ">=", "threshold": 2.5, "for_steps": 3},
        {"rule": "card_overload", "metric": "power_w", "threshold": 300},
        {"rule": "card_overload", "metric": "temp_c"},
        {"rule": "loss_spike", "enabled": False},
        {"rule": "straggler", "patience": 4},
    ], "monitor": {"straggler_threshold": 0.35}})
    st = cfg.monitor.straggler_threshold
    driver = [(e.name, e.cfg, e.enabled) for e in rc.entries_from_config(cfg)]
    live = rc.entries_of(build_rules(cfg.anomalies, straggler_threshold=st), cfg.anomalies, st)
    aggregator = [(e.name, e.cfg, e.enabled) for e in live]
    assert driver == aggregator, f"the driver's rules {driver}\ndiffer from the aggregator's {aggregator}"
    names = [n for n, _, _ in driver]
    assert "grad_norm>=2.5" in names and names.count("card_overload") == 2, names
    assert ("loss_spike", False) in [(n, on) for n, _, on in driver], driver
    assert next(c for n, c, _ in driver if n == "straggler")["threshold"] == 0.35, driver


def core_of(run_dir, settings, **kw):
    return AggregatorCore(run_dir, world_size=2, settings=settings, **kw)


def steps(core, first, last, loss=1.0):
    for s in range(first, last + 1):
        core.ingest([step(0, s, loss), step(1, s, loss)])


def request(run_dir, op, *args):
    req = rc.request_of(op, list(args))
    return rc.write_request(run_dir, req), req


def rule(core, name):
    return next(r for r in core.policies.rules if r.name == name)


# ---- parsing and checking ------------------------------------------------------------------


def test_assignments_parse_names_with_dots_and_operators():
    assert rc.parse_assignment("loss_high.threshold=0.5") == ["loss_high", "threshold", 0.5]
    assert rc.parse_assignment("loss>5.5.threshold=3") == ["loss>5.5", "threshold", 3]
    assert rc.parse_assignment("loss>=5.op=<") == ["loss>=5", "op", "<"]
    assert rc.parse_assignment("x.op=>") == ["x", "op", ">"]
    assert rc.parse_assignment("x.threshold=1e-3") == ["x", "threshold", "1e-3"]
    assert rc.parse_assignment("x.enabled=false") == ["x", "enabled", False]
    for bad in ("x.threshold", "threshold=3", "=3"):
        with pytest.raises(ConfigError, match="NAME.FIELD=VALUE"):
            rc.parse_assignment(bad)
    with pytest.raises(ConfigError, match="add: give one rule"):
        rc.request_of("add", [])
    with pytest.raises(ConfigError, match="is not a rule"):
        rc.request_of("add", ["[1, 2]"])


def test_a_change_is_checked_as_the_config_is_and_names_the_field(tmp_path):
    cfg = run_config()
    entries = rc.entries_from_config(cfg)
    refs = rc.refs_of(entries)
    assert "loss_high" in refs and "card_overload#1" in refs and "card_overload#2" in refs

    def plan(op, *args):
        return rc.plan(entries, rc.request_of(op, list(args)), cfg, 0.7)

    cases = {
        ("set", "loss_high.threshold=abc"): r"^loss_high\.threshold: 'abc' is not allowed; use a number",
        ("set", "loss_high.threshold=.nan"): r"^loss_high\.threshold: .*finite number",
        ("set", "loss_high.for_steps=0"): r"^loss_high\.for_steps: 0 is not allowed; use 1 or more",
        ("set", "loss_high.action=explode"): r"^loss_high\.action: 'explode' is not allowed",
        ("set", "loss_high.metric=losss"): r"^loss_high\.metric: 'losss' is not a metric this job reports",
        ("set", "loss_high.metric=eval_loss"): r"only when evaluation is on",
        ("set", "loss_high.colour=red"): r"^loss_high\.colour: unknown field",
        ("set", "loss_high.z=3"): r"^loss_high\.z: a threshold rule does not use z",
        ("set", "loss_high.rule=loss_spike"): r"^loss_high\.rule: a rule's kind cannot change",
        ("set", "nope.threshold=1"): r"^nope: no rule of that name",
        ("set", "card_overload.threshold=80"): r"2 rules have that name; use one of card_overload#1, card_overload#2",
        ("set", "loss_spike.name=loss_high"): r"^loss_high: a rule of that name exists already",
        ("add", "{rule: threshold, metric: loss}"): r"^add\.threshold: a threshold rule needs a number",
        ("add", "{rule: loss_spike, z: 8}"): r"^loss_spike: a rule of that name exists already; change it with "
                                              r"`set loss_spike\.FIELD=VALUE`",
        ("add", "{rule: sparkle}"): r"^add\.rule: 'sparkle' is not allowed",
        ("disable", "nope"): r"^nope: no rule of that name",
    }
    for (op, arg), pattern in cases.items():
        with pytest.raises(ConfigError, match=pattern):
            plan(op, arg)
    # good ones: one record per field, values resolved as the rule sees them
    new, recs = plan("set", "loss_high.threshold=2.5", "loss_high.for_steps=2")
    assert [(r["rule"], r["field"], r["old"], r["new"]) for r in recs] == [
        ("loss_high", "threshold", 100.0, 2.5), ("loss_high", "for_steps", 1, 2)]
    assert [e.cfg["threshold"] for e in new if e.name == "loss_high"] == [2.5]
    assert [e.cfg["threshold"] for e in entries if e.name == "loss_high"] == [100.0], "the input is not changed"
    new, recs = plan("set", "loss_spike.warmup=-1")  # a placeholder takes the rule's default, as in a config
    assert recs[0]["new"] == RULE_DEFAULTS[RuleKind.LOSS_SPIKE]["warmup"]
    new, recs = plan("set", "card_overload#1.threshold=250")
    assert recs[0]["rule"] == "card_overload" and new[rc.refs_of(new).index("card_overload#1")].cfg["threshold"] == 250
    _, recs = plan("disable", "grad_explosion")
    assert recs == [{"op": "disable", "rule": "grad_explosion", "field": "enabled", "old": True, "new": False}]
    new, recs = plan("add", "{rule: threshold, metric: grad_norm, threshold: 50}")
    assert new[-1].name == "grad_norm>50" and recs[0]["new"]["threshold"] == 50.0


# ---- the aggregator applies it -------------------------------------------------------------


def test_a_lowered_threshold_fires_at_the_next_reduced_step(tmp_path):
    run_dir, _, settings = make_run(tmp_path)
    core = core_of(run_dir, settings)
    state = rc.read_state(run_dir)
    assert state is not None and "loss_high" in [r["name"] for r in state["rules"]], "rules.json at start"
    assert oct(os.stat(run_dir / rc.STATE_FILE).st_mode & 0o777) == "0o600", "the run dir's file mode"
    steps(core, 1, 3, loss=2.0)
    assert core.anomalies_total == 0
    path, req = request(run_dir, "set", "loss_high.threshold=1.5")
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    core.live_rules._last_scan = 0.0  # the next look at the folder is due
    steps(core, 4, 4, loss=2.0)
    assert not path.exists() and not list((run_dir / rc.REQUESTS_DIR).iterdir()), "the request was consumed"
    firings = [r for r in read_records(run_dir) if r.get("rule") == "loss_high"]
    assert [f["step"] for f in firings] == [4] and firings[0]["threshold"] == 1.5
    assert core.directive_for(4).action is Action.STOP
    changes = core.snapshot()["rule_changes"]
    assert len(changes) == 1
    c = changes[0]
    assert (c["step"], c["op"], c["rule"], c["field"], c["old"], c["new"], c["request"]) == (
        4, "set", "loss_high", "threshold", 100.0, 1.5, req["id"])
    assert c["command"] == "set loss_high.threshold=1.5" and abs(c["time"] - time.time()) < 60
    lines = core.drain_console()
    assert any(line.startswith("RULE CHANGE at ") and "from step 4 on: set loss_high.threshold: 100.0 -> 1.5"
               in line for line in lines), lines
    state = rc.read_state(run_dir)
    assert [r["config"]["threshold"] for r in state["rules"] if r["name"] == "loss_high"] == [1.5]
    assert state["changes"] == changes and state["applied"][0]["id"] == req["id"]


def test_changes_picked_up_between_steps_apply_from_the_next_one(tmp_path):
    run_dir, _, settings = make_run(tmp_path)
    core = core_of(run_dir, settings)
    steps(core, 1, 2)
    request(run_dir, "disable", "loss_spike")
    request(run_dir, "add", "{rule: threshold, name: slow, metric: step_time_max, threshold: 0.05}")
    core.live_rules._last_scan = 0.0
    core.live_rules.tick()  # what the actor's poll does
    assert [(c["op"], c["rule"], c["step"]) for c in core.live_rules.changes] == [("disable", "loss_spike", 3),
                                                                                   ("add", "slow", 3)]
    names = [r.name for r in core.policies.rules]
    assert "loss_spike" not in names and "slow" in names
    steps(core, 3, 3)
    assert [r["step"] for r in read_records(run_dir) if r.get("rule") == "slow"] == [3]
    core.live_rules.tick()  # not due again yet: no listing, nothing happens
    # a disabled rule is listed as such and comes back with set NAME.enabled=true
    listed = {r["ref"]: r for r in rc.read_state(run_dir)["rules"]}
    assert listed["loss_spike"]["enabled"] is False
    request(run_dir, "set", "loss_spike.enabled=true")
    core.live_rules._last_scan = 0.0
    core.live_rules.tick()
    assert "loss_spike" in [r.name for r in core.policies.rules]


def test_a_changed_rule_keeps_its_baseline_and_restarts_its_counters(tmp_path):
    run_dir, _, settings = make_run(tmp_path)
    core = core_of(run_dir, settings)
    steps(core, 1, 12, loss=2.0)
    before = list(rule(core, "loss_spike").history)
    assert len(before) == 12 - RULE_DEFAULTS[RuleKind.LOSS_SPIKE]["warmup"]  # the warm-up steps stay out
    request(run_dir, "set", "loss_spike.z=9", "loss_spike.window=5")
    core.live_rules._last_scan = 0.0
    core.live_rules.tick()
    after = rule(core, "loss_spike")
    assert after.z == 9 and list(after.history) == before[-5:] and after.history.maxlen == 5


def test_a_bad_request_is_refused_and_changes_nothing(tmp_path):
    run_dir, _, settings = make_run(tmp_path)
    core = core_of(run_dir, settings)
    (run_dir / rc.REQUESTS_DIR).mkdir()
    rid = rc.new_request_id()
    (run_dir / rc.REQUESTS_DIR / f"{rid}.json").write_text(json.dumps(
        {"op": "set", "set": [["loss_high", "threshold", "abc"]], "command": "set loss_high.threshold=abc"}))
    (run_dir / rc.REQUESTS_DIR / "notes.txt").write_text("not a request")
    rid2 = rc.new_request_id()
    (run_dir / rc.REQUESTS_DIR / f"{rid2}.json").write_text("{torn")
    core.live_rules._last_scan = 0.0
    steps(core, 1, 1)
    state = rc.read_state(run_dir)
    assert [r["id"] for r in state["rejected"]] == [rid, rid2]
    assert "loss_high.threshold: 'abc' is not allowed; use a number" in state["rejected"][0]["error"]
    assert state["changes"] == [] and rule(core, "loss_high").threshold == 100.0
    assert sorted(os.listdir(run_dir / rc.REQUESTS_DIR)) == ["notes.txt"]
    assert any("RULE CHANGE refused" in line for line in core.drain_console())


def test_a_restarted_aggregator_replays_the_changes_at_their_steps(tmp_path):
    run_dir, _, settings = make_run(tmp_path)
    settings["anomalies"] = [dict(LOSS_HIGH, action="warn")]
    core = core_of(run_dir, settings)
    steps(core, 1, 2)
    request(run_dir, "set", "loss_high.threshold=0.5")
    core.live_rules._last_scan = 0.0
    steps(core, 3, 5)  # past the new limit from step 3 on: fires once, at 3
    assert [r["step"] for r in read_records(run_dir) if r.get("rule") == "loss_high"] == [3]
    assert rule(core, "loss_high").count == 3
    core.metrics.close()  # a crash: the actor is gone without closing anything else
    again = core_of(run_dir, settings, replay=True)
    r = rule(again, "loss_high")
    # the change applied at step 3 of the replay, as it did: counted steps 3, 4, 5, not 1 .. 5
    assert r.threshold == 0.5 and r.count == 3
    assert again.anomalies_total == 1
    assert [c["step"] for c in again.snapshot()["rule_changes"]] == [3]
    steps(again, 6, 6)
    assert [r["step"] for r in read_records(run_dir) if r.get("rule") == "loss_high"] == [3], "no second firing"
    assert rc.read_state(run_dir)["changes"] == again.snapshot()["rule_changes"]


def test_a_later_attempt_starts_with_every_change(tmp_path):
    run_dir, _, settings = make_run(tmp_path)
    core = core_of(run_dir, settings)
    steps(core, 1, 2)
    request(run_dir, "set", "loss_high.threshold=7")
    core.live_rules._last_scan = 0.0
    core.live_rules.tick()
    core.close()
    nxt = core_of(run_dir, dict(settings, attempt=1))
    assert rule(nxt, "loss_high").threshold == 7
    assert any("still apply" in line for line in nxt.drain_console())
    assert [c["attempt"] for c in nxt.snapshot()["rule_changes"]] == [0]


# ---- the command ---------------------------------------------------------------------------


class Ticking:
    """The aggregator's loop: the actor's poll ticks the live rules while a command waits."""

    def __init__(self, core):
        self.core = core
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self.stop.is_set():
            self.core.live_rules.tick()
            time.sleep(0.05)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def test_the_command_lists_sets_refuses_and_knows_a_finished_run(tmp_path, capsys):
    run_dir, _, settings = make_run(tmp_path)
    # before the aggregator wrote rules.json: the config's rules
    assert main(["rules", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "from config.yaml" in out and "loss_high" in out and "card_overload#2" in out
    core = core_of(run_dir, settings)
    steps(core, 1, 3)
    assert main(["rules", str(run_dir), "set", "loss_high.threshold=abc"]) == 2
    err = capsys.readouterr().err
    assert "loss_high.threshold: 'abc' is not allowed; use a number" in err and "nothing changed" in err
    assert not (run_dir / rc.REQUESTS_DIR).exists() or not os.listdir(run_dir / rc.REQUESTS_DIR)
    with Ticking(core):
        assert main(["rules", str(run_dir), "set", "loss_high.threshold=0.5", "--wait", "20"]) == 0
    out = capsys.readouterr().out
    assert "set loss_high.threshold: 100.0 -> 0.5, from step 4 on" in out
    assert main(["rules", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "from rules.json" in out and "threshold=0.5" in out and "changes (1):" in out
    assert main(["rules", str(run_dir), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["status"] == "running" and listed["changes"][0]["new"] == 0.5
    assert next(r for r in listed["rules"] if r["ref"] == "loss_high")["fields"]["threshold"] == 0.5
    # no aggregator takes it: withdrawn, nothing changed
    assert main(["rules", str(run_dir), "disable", "loss_spike", "--wait", "0.3"]) == 1
    assert "withdrawn, nothing changed" in capsys.readouterr().err
    assert not os.listdir(run_dir / rc.REQUESTS_DIR)
    # a finished run
    (run_dir / "summary.json").write_text(json.dumps({"status": "succeeded"}))
    assert main(["rules", str(run_dir), "set", "loss_high.threshold=1"]) == 2
    assert "has finished (succeeded)" in capsys.readouterr().err
    assert main(["rules", str(tmp_path / "nowhere")]) == 2
