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
import time
from pathlib import Path
from typing import Any

from mindpulse.config import RunConfig
from mindpulse.wire.stop_decision import RollbackDecision, StopDecision

from .attempt import Attempt, logs_dir_of
from .failure_policy import Decision, FailurePolicy
from .interrupts import StartInterrupted, start_up_interrupted
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
        except StartInterrupted as exc:
            # no step of this attempt has run: nothing to finish; what was started is killed
            self.console.say(f"mindpulse: interrupt during start-up ({exc}): stopping now")
            self.snapshot = self.attempt.abort(interrupted=True) if self.attempt is not None else {}
            self.result = RunResult(status=RunStatus.INTERRUPTED, message=start_up_interrupted(self.index))
        except LaunchRefused as exc:
            if self.index == 0:
                raise
            # a later attempt cannot be placed (a node is gone): the run has a history; keep it
            self.result, self.snapshot = RunResult(status=RunStatus.FAILED, message=f"restart refused: {exc}"), {}
        # any launcher error fails this attempt with its message (logged), never the controller
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
        if self.interrupts.pending():  # during the Ray session's start, or between attempts
            raise StartInterrupted("interrupted before the attempt started")
        self.history.logs_dir = logs_dir_of(self.run_dir, self.index)
        # the line this attempt continues becomes the manifest's before any of its ranks (or
        # its aggregator, which takes the manifest's best) reads it
        for line in supersede_newer(self.history.resume):
            self.console.say(f"mindpulse: {line}")
        from mindpulse.reporting.goodput import combine

        self._attempt_started = time.time()
        kept = combine(self.history.clocks, self.started, self._attempt_started, self.history.attempts)
        attempt = Attempt(self.cfg, index=self.index, run_dir=self.run_dir, run_id=self.run_id,
                          session=self.session, resume=self.history.resume, pids=self.pids, console=self.console,
                          goodput={"started": self.started, "productive_s": kept["productive_s"]},
                          interrupts=self.interrupts)
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
        if not self._rolling_back:
            self.console.say(f"mindpulse: attempt {self.index} failed ({self.result.message}); restarting every "
                             f"rank (attempt {self.index + 1} of {self.cfg.max_restarts + 1}) from "
                             + (f"step {resume['step']} ({resume['path']})" if resume and resume["path"]
                                else "the start"))
        self._rolling_back = False
        self.index += 1
        return ControllerState.STARTING

    _rolling_back = False
    _attempt_started = 0.0

    def _rollback(self, rb: RollbackDecision, stop: StopDecision) -> None:
        """Resume from the newest valid checkpoint strictly before the anomaly step, past the
        batches from there to it, the learning rate lowered for a while (rule action `rollback`)."""
        from .resume import rollback_point

        anomaly = rb.anomaly_step
        ckpt_dir = self.run_dir / "checkpoints"
        point, refused = rollback_point(ckpt_dir, anomaly)
        for why in refused:
            self.console.say(f"mindpulse: rollback: refused {why}")
        to_step = int(point["step"]) if point else 0
        skipped = anomaly - to_step if rb.skip_batches else 0
        before = self.history.resume or {}
        counts = dict(before.get("rollbacks") or {})
        counts[rb.rule] = counts.get(rb.rule, 0) + 1
        resume = dict(point or {"path": "", "step": 0, "epoch": 0, "kind": ""})
        resume.update(skip_batches=int(before.get("skip_batches") or 0) + skipped, lr_factor=rb.lr_factor,
                      lr_until_step=to_step + rb.lr_steps, rollbacks=counts)
        if point is None:  # back to the start: no checkpoint of the abandoned line stays latest or best
            from mindpulse.rundir.checkpoint_manifest import supersede_after

            try:
                supersede_after(ckpt_dir, 0, note="rolled back to the start")
            except Exception as exc:  # the rollback goes on from the start; the stale listing is only said
                self.console.say(f"mindpulse: rollback: the newer checkpoints stay listed: {exc}")
        record = {"rule": rb.rule, "anomaly_step": anomaly, "from_step": stop.step, "to_step": to_step,
                  "skipped_batches": skipped, "lr_factor": rb.lr_factor}
        self.history.rollbacks.append(record)
        self.history.resume = resume
        self._rolling_back = True
        self.console.say(f"mindpulse: rollback {len(self.history.rollbacks)} ({rb.rule} at step {anomaly}): every "
                         f"rank stopped after step {stop.step}; resuming from "
                         + (f"step {to_step} ({point['path']})" if point else "the start (no checkpoint before it)")
                         + (f", skipping {skipped} batch(es)" if skipped else "")
                         + f", learning rate x{rb.lr_factor:g} until step {resume['lr_until_step']}")

    def _enough_hosts_left(self) -> bool:
        """After a lost node: whether the cluster still holds `world.nodes` hosts for a
        restart (the lost ones left out, a spare one counted); if not the run ends now,
        saying how many it needs, instead of waiting out the placement's timeout."""
        from .node_agents import DEVICE_RESOURCE
        from .node_health import hosts_left

        w = self.cfg.world
        resource = DEVICE_RESOURCE[w.device.value]
        left = hosts_left(resource, w.ranks_per_node, {x["node_id"] for x in self.result.lost})
        if left < 0 or left >= w.nodes:
            return True
        self.result.message += (f"; no restart: the job needs {w.nodes} hosts with {w.ranks_per_node} {resource} "
                                f"each and {left} {'is' if left == 1 else 'are'} left (add a host, or lower "
                                "world.nodes)")
        self.console.say(f"mindpulse: cannot restart: the job needs {w.nodes} hosts with {w.ranks_per_node} "
                         f"{resource} each; {left} left after the loss")
        return False

    # ---- after each attempt -----------------------------------------------------------------
    def _conclude(self) -> ControllerState:
        """Record the attempt that just ended and ask the failure policy what comes next."""
        self._record()
        stop = StopDecision.from_dict(self.snapshot["stop"]) if self.snapshot.get("stop") else None
        if (stop is not None and stop.rollback is not None and self.result.status is not RunStatus.FAILED
                and not self.interrupts.count):
            self._rollback(stop.rollback, stop)
            return ControllerState.RESTARTING
        decision = self.policy.decide(self.result, self.index, self.interrupts.count > 0, self.history.resume)
        if decision.decision is Decision.STOP:
            return ControllerState.FINISHED
        if self.result.lost and not self._enough_hosts_left():
            return ControllerState.FINISHED
        for line in decision.notes:
            self.console.say(f"mindpulse: {line}")
        self.history.resume = carry_rollbacks(decision.resume, self.history.resume)
        return ControllerState.RESTARTING

    def _record(self) -> None:
        result, snapshot, attempt = self.result, self.snapshot, self.attempt
        if attempt is not None:
            self.history.dropped_packets += attempt.dropped_packets
            self.history.aggregator_lost |= attempt.aggregator_lost
            if attempt.unshared:
                self.history.unshared_hosts = attempt.unshared
            if attempt.group.rank_nodes is not None:
                self.history.rank_nodes = attempt.group.rank_nodes
        record: dict[str, Any] = {"attempt": self.index, "status": result.status.value, "message": result.message,
                                  "resumed_from": self.history.resume, "logs": str(self.history.logs_dir),
                                  "steps_completed": snapshot.get("steps_completed", 0),
                                  "started_at": self._attempt_started, "ended_at": time.time()}
        self.history.add_losses(snapshot)
        clock = snapshot.get("goodput")
        self.history.clocks.append(clock if clock and clock.get("first_start") is not None else None)
        if (snapshot.get("stop") or {}).get("rollback"):
            record["rollback"] = snapshot["stop"]["rollback"]
        if result.status is RunStatus.FAILED:
            from .failures import FailureKind, describe_failure, failure_kind

            last = {x["rank"]: x["last_step"] for x in snapshot.get("ranks", [])}
            kind = failure_kind(result)
            record["failure"] = describe_failure(result.outcomes, result.order, self.history.logs_dir, last,
                                                 FailureKind.CRASH if kind is FailureKind.LAUNCHER else kind,
                                                 stuck=result.hang, message=result.message, lost=result.lost)
        self.history.attempts.append(record)


def carry_rollbacks(new: dict[str, Any] | None, old: dict[str, Any] | None) -> dict[str, Any] | None:
    """A restart after a failure keeps what earlier rollbacks set: the data stream's offset
    (the skipped batches stay skipped), the lowered learning rate's window and the counts."""
    keep = {k: v for k, v in (old or {}).items() if k in ("skip_batches", "lr_factor", "lr_until_step", "rollbacks")}
    if not keep:
        return new
    return dict(new or {"path": "", "step": 0, "epoch": 0, "kind": ""}, **keep)
