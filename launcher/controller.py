"""The run's control loop (after torch elastic's agent and Ray Train v2's controller).

    STARTING ──▶ RUNNING ──▶ STOPPING ──▶ FINISHED
       ▲                        │
       └──── RESTARTING ◀───────┘  (the failure policy chose another attempt)

STARTING places and starts attempt k; RUNNING watches it one tick at a time; STOPPING
collects its final metrics, ends its ranks and agents, and records it; the failure policy
then stops the run or restarts every rank from the newest valid checkpoint. A launcher
error in any state ends the attempt as failed (its ranks killed) and goes to the policy
too; a refusal to place attempt 0 (the cluster cannot run the config) propagates.
"""

from __future__ import annotations

import enum
import logging
from pathlib import Path
from typing import Any

from mindpulse.config import RunConfig

from .attempt import Attempt, logs_dir_of
from .failure_policy import Decision, FailurePolicy
from .preflight import LaunchRefused
from .progress import Console
from .ray_session import RaySession
from .resume import supersede_newer
from .rundir import PidFile
from .spec import RunResult, RunStatus
from .summary import RunHistory
from .supervision import AttemptWatch, Interrupts

log = logging.getLogger(__name__)


class ControllerState(str, enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    RESTARTING = "restarting"
    FINISHED = "finished"

    def is_terminal(self) -> bool:
        return self is ControllerState.FINISHED


class Controller:
    def __init__(self, cfg: RunConfig, *, run_dir: Path, run_id: str, session: RaySession,
                 resume: dict[str, Any] | None, pids: PidFile, console: Console, interrupts: Interrupts,
                 started: float):
        self.cfg = cfg
        self.run_dir = run_dir
        self.run_id = run_id
        self.session = session
        self.pids = pids
        self.console = console
        self.interrupts = interrupts
        self.started = started
        self.policy = FailurePolicy(cfg.max_restarts, run_dir / "checkpoints")
        self.history = RunHistory(logs_dir=logs_dir_of(run_dir, 0), resume=resume)
        self.index = 0
        self.state = ControllerState.STARTING
        self.attempt: Attempt | None = None
        self.watch: AttemptWatch | None = None
        self.result = RunResult(status=RunStatus.FAILED, message="launcher did not start")
        self.snapshot: dict[str, Any] = {}

    def run(self) -> tuple[RunResult, dict[str, Any]]:
        """Every attempt until one ends the run; returns the last one's result and the
        aggregator's final snapshot."""
        while not self.state.is_terminal():
            self.state = self._advance(self.state)
        return self.result, self.snapshot

    def _advance(self, state: ControllerState) -> ControllerState:
        if state is ControllerState.RESTARTING:
            return self._restart()
        try:
            if state is ControllerState.STARTING:
                return self._start()
            if state is ControllerState.RUNNING:
                return self._supervise()
            self._stop()
        except LaunchRefused as exc:
            if self.index == 0:
                raise
            # a later attempt cannot be placed (a node is gone): the run has a history; keep it
            self.result, self.snapshot = RunResult(status=RunStatus.FAILED, message=f"restart refused: {exc}"), {}
        except Exception as exc:
            log.exception("attempt %d failed in the launcher", self.index)
            if self.attempt is not None:
                self.attempt.abort()
            self.result = RunResult(status=RunStatus.FAILED, message=f"launcher error: {type(exc).__name__}: {exc}")
            self.snapshot = {}
        return self._conclude()

    # ---- the states -------------------------------------------------------------------------
    def _start(self) -> ControllerState:
        self.attempt = None
        self.history.logs_dir = logs_dir_of(self.run_dir, self.index)
        # the line this attempt continues becomes the manifest's before any of its ranks (or
        # its aggregator, which takes the manifest's best) reads it
        for line in supersede_newer(self.history.resume):
            self.console.say(f"mindpulse: {line}")
        attempt = Attempt(self.cfg, index=self.index, run_dir=self.run_dir, run_id=self.run_id,
                          session=self.session, resume=self.history.resume, pids=self.pids, console=self.console)
        self.attempt = attempt
        refs = attempt.start()
        self.watch = AttemptWatch(self.cfg, attempt, refs, self.interrupts, self.console, self.started)
        return ControllerState.RUNNING

    def _supervise(self) -> ControllerState:
        assert self.watch is not None
        if not self.watch.tick().is_terminal():
            return ControllerState.RUNNING
        self.result = self.watch.result()
        return ControllerState.STOPPING

    def _stop(self) -> None:
        assert self.attempt is not None
        self.snapshot = self.attempt.finish(self.result, graceful=self.result.status is not RunStatus.FAILED
                                            and self.interrupts.count < 2)

    def _restart(self) -> ControllerState:
        resume = self.history.resume
        self.console.say(f"mindpulse: attempt {self.index} failed ({self.result.message}); restarting every rank "
                         f"(attempt {self.index + 1} of {self.cfg.max_restarts + 1}) from "
                         + (f"step {resume['step']} ({resume['path']})" if resume else "the start"))
        self.index += 1
        return ControllerState.STARTING

    # ---- after each attempt -----------------------------------------------------------------
    def _conclude(self) -> ControllerState:
        """Record the attempt that just ended and ask the failure policy what comes next."""
        self._record()
        decision = self.policy.decide(self.result, self.index, self.interrupts.count > 0, self.history.resume)
        if decision.decision is Decision.STOP:
            return ControllerState.FINISHED
        for line in decision.notes:
            self.console.say(f"mindpulse: {line}")
        self.history.resume = decision.resume
        return ControllerState.RESTARTING

    def _record(self) -> None:
        result, snapshot, attempt = self.result, self.snapshot, self.attempt
        if attempt is not None:
            self.history.dropped_packets += attempt.dropped_packets
            self.history.aggregator_lost |= attempt.aggregator_lost
            if attempt.group.rank_nodes is not None:
                self.history.rank_nodes = attempt.group.rank_nodes
        record: dict[str, Any] = {"attempt": self.index, "status": result.status.value, "message": result.message,
                                  "resumed_from": self.history.resume, "logs": str(self.history.logs_dir),
                                  "steps_completed": snapshot.get("steps_completed", 0)}
        if result.status is RunStatus.FAILED:
            from .failures import FailureKind, describe_failure

            last = {x["rank"]: x["last_step"] for x in snapshot.get("ranks", [])}
            record["failure"] = describe_failure(result.outcomes, result.order, self.history.logs_dir, last,
                                                 FailureKind.HANG if result.hang else FailureKind.CRASH,
                                                 stuck=result.hang, message=result.message)
        self.history.attempts.append(record)
