"""The launcher's pieces without a cluster: the failure policy, the controller's states
(attempts replaced by fakes), and the one environment a rank is given."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mindpulse.config import from_dict
from mindpulse.config.rank_settings import NODE_RANK_ENV, SETTINGS_ENV, RankSettings
from mindpulse.launcher import controller as controller_mod
from mindpulse.launcher.controller import Controller, ControllerState
from mindpulse.launcher.failure_policy import Decision, FailurePolicy
from mindpulse.launcher.preflight import LaunchRefused
from mindpulse.launcher.progress import Console
from mindpulse.launcher.rundir import PidFile
from mindpulse.launcher.spec import RankOutcome, RunResult, RunStatus, rank_settings, rank_specs
from mindpulse.launcher.supervision import Interrupts

FAILED = RunResult(status=RunStatus.FAILED, outcomes={0: RankOutcome(rank=0, exit_code=1, error="boom")},
                   message="rank 0 failed: boom", order=[0])
OK = RunResult(status=RunStatus.SUCCEEDED, outcomes={0: RankOutcome(rank=0, exit_code=0)})


def _checkpoint(ckpt_dir: Path, step: int) -> str:
    from mindpulse.rundir.checkpoint_manifest import CkptEntry, sha256_of, write_manifest

    ckpt_dir.mkdir(parents=True, exist_ok=True)
    name = f"step_{step:08d}-periodic.ckpt"
    (ckpt_dir / name).write_bytes(b"weights")
    entry = CkptEntry(name, step, 0, "periodic", None, "", 7, sha256_of(ckpt_dir / name), float(step))
    write_manifest(ckpt_dir, [entry])
    return str(ckpt_dir / name)


# ---- failure policy ------------------------------------------------------------------------------
def test_policy_stops_on_success_interrupt_and_the_last_attempt(tmp_path):
    policy = FailurePolicy(2, tmp_path / "checkpoints")
    assert policy.decide(OK, 0, False, None).decision is Decision.STOP
    assert policy.decide(FAILED, 0, True, None).decision is Decision.STOP
    assert policy.decide(FAILED, 2, False, None).decision is Decision.STOP


def test_policy_restarts_from_the_newest_valid_checkpoint(tmp_path):
    policy = FailurePolicy(1, tmp_path / "checkpoints")
    first = policy.decide(FAILED, 0, False, {"path": "/given", "step": 3})
    assert first.decision is Decision.RESTART and first.resume == {"path": "/given", "step": 3}
    path = _checkpoint(tmp_path / "checkpoints", 20)
    d = policy.decide(FAILED, 0, False, None)
    assert d.decision is Decision.RESTART
    assert d.resume == {"path": path, "step": 20, "epoch": 0, "kind": "periodic"} and d.notes == []


# ---- controller ----------------------------------------------------------------------------------
class FakeGroup:
    rank_nodes = {0: "node-a"}


class FakeAttempt:
    """Stands in for `Attempt`: results come from the test's script, one per attempt."""

    script: list[Any] = []
    made: list[FakeAttempt] = []

    def __init__(self, cfg, *, index, run_dir, run_id, session, resume, pids, console, goodput=None,
                 interrupts=None):
        self.index, self.resume = index, resume
        self.group = FakeGroup()
        self.dropped_packets, self.aggregator_lost = 1, False
        self.unshared: list = []
        self.outcome = self.script[index]
        self.finished = self.aborted = False
        FakeAttempt.made.append(self)

    def start(self):
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return {}

    def finish(self, result, graceful):
        self.finished = graceful
        return {"steps_completed": 10 * (self.index + 1), "ranks": [{"rank": 0, "last_step": 4}]}

    def abort(self, interrupted=False):
        self.aborted = True
        return {"steps_completed": 3} if interrupted else {}


class FakeWatch:
    def __init__(self, cfg, attempt, refs, interrupts, console, started):
        self.attempt, self.ticks = attempt, 0

    def tick(self) -> RunStatus:
        self.ticks += 1
        return RunStatus.RUNNING if self.ticks < 2 else self.attempt.outcome.status

    def result(self) -> RunResult:
        return self.attempt.outcome


@pytest.fixture
def make_controller(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(controller_mod, "Attempt", FakeAttempt)
    monkeypatch.setattr(controller_mod, "AttemptWatch", FakeWatch)
    FakeAttempt.made = []

    def make(script, max_restarts=2, interrupts=0):
        FakeAttempt.script = script
        cfg = from_dict({"max_restarts": max_restarts})
        intr = Interrupts()
        intr.count = interrupts
        import sys

        return Controller(cfg, run_dir=tmp_path, run_id="r", session=None, resume=None, pids=PidFile(tmp_path),
                          console=Console(sys.stdout), interrupts=intr, started=0.0)

    return make


def test_a_clean_run_is_one_attempt(make_controller):
    ctl = make_controller([OK])
    result, snap = ctl.run()
    assert result.status is RunStatus.SUCCEEDED and snap["steps_completed"] == 10
    assert ctl.state is ControllerState.FINISHED and ctl.state.is_terminal()
    assert [a["status"] for a in ctl.history.attempts] == ["succeeded"]
    assert FakeAttempt.made[0].finished is True  # graceful end
    assert ctl.history.rank_nodes == {0: "node-a"} and ctl.history.dropped_packets == 1


def test_a_failure_restarts_every_rank_from_the_checkpoint_with_logs_apart(make_controller, tmp_path):
    path = _checkpoint(tmp_path / "checkpoints", 8)
    ctl = make_controller([FAILED, OK])
    result, snap = ctl.run()
    assert result.status is RunStatus.SUCCEEDED and snap["steps_completed"] == 20
    first, second = ctl.history.attempts
    assert first["status"] == "failed" and first["failure"]["root_cause_rank"] == 0
    assert first["logs"] == str(tmp_path / "logs") and second["logs"] == str(tmp_path / "logs" / "attempt_1")
    assert first["resumed_from"] is None and second["resumed_from"]["path"] == path
    assert FakeAttempt.made[1].resume["step"] == 8 and FakeAttempt.made[0].finished is False
    assert ctl.history.dropped_packets == 2


def test_restarts_end_at_max_restarts(make_controller):
    ctl = make_controller([FAILED, FAILED, FAILED], max_restarts=1)
    result, _ = ctl.run()
    assert result.status is RunStatus.FAILED and len(ctl.history.attempts) == 2


def test_an_interrupted_failure_is_not_restarted(make_controller, monkeypatch):
    ctl = make_controller([FAILED, OK])

    def start(self):  # the user interrupts once the attempt runs; then it fails
        ctl.interrupts.count = 1
        return {}

    monkeypatch.setattr(FakeAttempt, "start", start)
    result, _ = ctl.run()
    assert result.status is RunStatus.FAILED and len(ctl.history.attempts) == 1


def test_a_launcher_error_fails_the_attempt_and_kills_what_it_started(make_controller):
    ctl = make_controller([RuntimeError("agent gone"), OK])
    result, _ = ctl.run()
    assert FakeAttempt.made[0].aborted and result.status is RunStatus.SUCCEEDED
    assert ctl.history.attempts[0]["message"] == "launcher error: RuntimeError: agent gone"


def test_an_interrupt_during_the_start_ends_the_run_at_once_without_a_restart(make_controller, capsys):
    from mindpulse.launcher.interrupts import StartInterrupted

    ctl = make_controller([StartInterrupted("interrupted while waiting for the rank actors"), OK])
    result, snap = ctl.run()
    assert result.status is RunStatus.INTERRUPTED and snap == {"steps_completed": 3}, "the aggregator's last word"
    assert result.message == "interrupted by the user during start-up, before any step"
    assert FakeAttempt.made[0].aborted and len(FakeAttempt.made) == 1, "what was started is ended, no restart"
    assert [a["status"] for a in ctl.history.attempts] == ["interrupted"]
    assert "interrupt during start-up (interrupted while waiting for the rank actors): stopping now" in \
        capsys.readouterr().out


def test_an_interrupt_during_a_restarts_start_names_that_attempt(make_controller, tmp_path):
    from mindpulse.launcher.interrupts import StartInterrupted

    _checkpoint(tmp_path / "checkpoints", 8)
    ctl = make_controller([FAILED, StartInterrupted("interrupted while waiting for the node agents"), OK])
    result, _ = ctl.run()
    assert result.status is RunStatus.INTERRUPTED and len(FakeAttempt.made) == 2
    assert result.message == "interrupted by the user during the start-up of attempt 1, before any of its steps"
    assert [a["status"] for a in ctl.history.attempts] == ["failed", "interrupted"]


def test_an_interrupt_before_an_attempt_starts_starts_nothing(make_controller):
    ctl = make_controller([OK], interrupts=1)
    result, _ = ctl.run()
    assert result.status is RunStatus.INTERRUPTED and FakeAttempt.made == []


def test_refusal_of_the_first_attempt_propagates_a_later_one_is_recorded(make_controller):
    with pytest.raises(LaunchRefused):
        make_controller([LaunchRefused("no NPU")]).run()
    ctl = make_controller([FAILED, LaunchRefused("node lost")], max_restarts=1)
    result, _ = ctl.run()
    assert result.message == "restart refused: node lost" and len(ctl.history.attempts) == 2


# ---- the rank's environment ----------------------------------------------------------------------
def test_a_rank_gets_the_settings_path_and_the_attempts_log_folder():
    cfg = from_dict({"backend": "msrun", "world": {"nodes": 2, "ranks_per_node": 1}, "env": {"FOO": "1"}})
    specs = rank_specs(cfg, run_dir="/runs/x", logs_dir="/runs/x/logs/attempt_1", sched_host="10.0.0.1",
                       sched_port=9000)
    for s in specs:
        assert s.env[SETTINGS_ENV] == "/runs/x/job.json" and s.env[NODE_RANK_ENV] == str(s.node)
        assert s.env["FOO"] == "1" and s.env["MS_SCHED_PORT"] == "9000"
        assert "--log_dir=/runs/x/logs/attempt_1" in s.command and s.command[-1] == "/runs/x/job.json"
        assert not [k for k in s.env if k.startswith("MINDPULSE_") and k not in (SETTINGS_ENV, NODE_RANK_ENV)]
    ray_specs = rank_specs(from_dict({}), run_dir="/runs/x")
    assert all(NODE_RANK_ENV not in s.env for s in ray_specs)


def test_settings_of_a_restart_carry_the_resume_point_and_no_faults():
    cfg = from_dict({"faults": ["nan_loss@0:3"]})
    kw = dict(run_dir="/r", run_id="id", aggregator="agg", ray_address="a:1", relays={0: "127.0.0.1:5"})
    first = rank_settings(cfg, attempt=0, resume=None, **kw)
    again = rank_settings(cfg, attempt=1, resume={"path": "/r/c.ckpt", "step": 8}, **kw)
    assert first.faults == ("nan_loss@0:3",) and again.faults == () and again.resume.step == 8
    assert RankSettings.from_json(again.to_json()) == again


def test_an_attempt_aborted_by_a_launcher_error_gives_its_cards_back():
    """A launcher error mid-start (an agent or the aggregator not answering) ends what was
    started and removes the placement group: a restart can reserve the cards again."""
    from mindpulse.launcher.attempt import Attempt

    calls = []

    class Group:
        def kill(self):
            calls.append("kill ranks")

        def terminate(self, graceful):
            calls.append(f"terminate graceful={graceful}")

    class Nodes:
        def shutdown(self):
            calls.append("agents down")

        def release(self):
            calls.append("cards back")

    attempt = Attempt.__new__(Attempt)
    attempt.group, attempt.nodes, attempt.aggregator = Group(), Nodes(), None
    attempt.abort()
    assert calls == ["kill ranks", "terminate graceful=False", "agents down", "cards back"], calls
