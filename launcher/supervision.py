"""Watching one attempt's ranks until it ends (one `tick` per pass of the controller).

A tick collects finished ranks, prints the aggregator's tables and progress, and ends the
attempt on the first rank failure (the others are stopped at once so no rank is left
blocked in a collective), on a hang (stacks dumped first), or on a second interrupt (kill);
a first interrupt asks every rank to stop after the same step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from mindpulse.config import RunConfig
from mindpulse.inputs.input_paths import INPUT_MISSING

from .attempt import Attempt
from .failures import VICTIM
from .interrupts import Interrupts, start_up_interrupted
from .node_health import NodeWatch, dead_node_ids, describe_loss, endpoints
from .progress import Console
from .spec import RankOutcome, RunResult, RunStatus
from .worker_group import RefOwner

__all__ = ["AttemptWatch", "Interrupts"]

WAIT_S = 0.5
"""How long a tick waits for a rank to finish; also the aggregator poll interval."""
HANG_CHECK_EVERY_S = 2.0
INPUT_GRACE_S = 5.0
"""After a rank's input failure (a file missing on its node) the other ranks still running get
this long to report their own before they are stopped: each checks the same files at its start,
so on a node that lacks them every rank fails the same way, and a rank that started a moment
later (a busy node) was recorded as a victim instead of its own missing file."""


class AttemptWatch:
    def __init__(self, cfg: RunConfig, attempt: Attempt, refs: dict[Any, RefOwner], interrupts: Interrupts,
                 console: Console, started: float):
        self.cfg = cfg
        self.attempt = attempt
        self.refs = refs
        self.pending = list(refs)
        self.interrupts = interrupts
        self.console = console
        self.started = started
        self.outcomes: dict[int, RankOutcome] = {}
        self.failure_order: list[int] = []
        self.status = RunStatus.RUNNING
        self.message = ""
        self.hang: list[int] = []
        self.interrupted_at: float | None = None
        self._last_poll = 0.0
        self._last_hang_check = 0.0
        self._hang_info: dict[str, Any] | None = None
        self._save_wait: tuple[int, float] | None = None
        """(step, deadline) while a failure waits for rank 0's checkpoint write."""
        self._save_wait_said = False
        self.lost: list[dict[str, Any]] = []
        """The nodes lost or cut off that ended the attempt (launcher/node_health.py)."""
        self._node_watch: NodeWatch | None = None
        self._input_wait: float | None = None
        """Until when an input failure waits for the other ranks' own outcomes (`INPUT_GRACE_S`)."""

    def tick(self) -> RunStatus:
        import ray

        done, self.pending = ray.wait(self.pending, num_returns=len(self.pending), timeout=WAIT_S)
        for ref in done:
            self._collect(ref, self.refs[ref])
        failed = [o for o in self.outcomes.values() if o.exit_code != 0]
        if self.pending and (failed or self._nodes().due(time.monotonic())):
            lost = self._nodes().check(dead_ids=dead_node_ids() if failed else None, at_failure=bool(failed))
            if lost:
                return self._end_lost(lost)
        if failed and self.pending:
            first = failed[0]
            if first.error and first.error.startswith(INPUT_MISSING):
                now = time.monotonic()
                if self._input_wait is None:
                    self._input_wait = now + INPUT_GRACE_S
                if now < self._input_wait:
                    return self.status  # the other ranks' own checks report at their start
            self.message = f"rank {first.rank} failed: {first.error or 'exit code ' + str(first.exit_code)}"
            if self._let_save_finish():
                return self.status
            self.console.say(f"mindpulse: {self.message}; stopping the other ranks")
            return self._end(RunStatus.FAILED, lambda r: VICTIM)
        if self.interrupts.count and self.interrupted_at is None:
            self.interrupted_at = time.time()
            if self._before_first_step():
                self.message = start_up_interrupted(self.attempt.index)
                self.console.say("mindpulse: interrupt during start-up: no step has run yet; stopping every rank now")
                return self._end(RunStatus.INTERRUPTED, lambda r: "killed")
            self.console.say("mindpulse: interrupt: every rank stops after the same step, in at most "
                             f"{self.cfg.monitor.max_lag_steps + 1} step(s) (interrupt again to kill)")
            self.attempt.request_stop("interrupted by the user (signal)")
        if self.interrupts.count >= 2 and self.pending:
            self.console.say("mindpulse: second interrupt: killing every rank")
            return self._end(RunStatus.INTERRUPTED, lambda r: "killed")
        if time.time() - self._last_poll > WAIT_S:
            progress = self.attempt.poll()
            if progress is not None:
                self.console.progress.update(progress, self.attempt.total_steps(), self.started)
                lingering = self._lingering(progress.get("ended_at") or {}) if self.pending and not failed else []
                if lingering:
                    return self._end_lingering(lingering, progress.get("pids") or {})
            self._last_poll = time.time()
            stuck = self._check_hang()
            if stuck and self.pending:
                self.hang = stuck
                info = self._hang_info or {}
                if info.get("phase") == "startup":
                    self.message = f"hang: ranks {stuck} reported no first step within {info.get('limit_s', 0):g}s " \
                                   "(monitor.startup_timeout_s)"
                else:
                    limit = info.get("limit_s") or self.cfg.monitor.hang_timeout_s or 0
                    how = "" if self.cfg.monitor.hang_timeout_s else " (monitor.hang_timeout_s: auto)"
                    self.message = f"hang: ranks {stuck} made no progress for {limit:.0f}s{how}"
                return self._end(RunStatus.FAILED, lambda r: "stuck" if r in stuck else VICTIM)
        if not self.pending:
            lost = self._nodes().check(dead_ids=dead_node_ids(), at_failure=True) if failed else []
            if lost:
                return self._end_lost(lost)
            if failed:
                first = failed[0]
                self.message = f"rank {first.rank} failed: {first.error or 'exit code ' + str(first.exit_code)}"
                self.status = RunStatus.FAILED
            elif self.interrupted_at is not None:
                self.status = RunStatus.INTERRUPTED
            else:
                self.status = RunStatus.SUCCEEDED
            self.console.progress.clear()
        return self.status

    def _before_first_step(self) -> bool:
        """True when the aggregator (asked now) has reduced no training step of this attempt:
        the ranks are still starting (importing, joining the cluster, loading, compiling), so
        stopping "after the same step" would first wait out the whole start-up and a step.
        False when it cannot tell (no answer): the stop then goes through the steps as usual."""
        progress = self.attempt.poll()
        if progress is None:
            return False
        # the reducer's count too: a restarted aggregator that rebuilt thinned steps from their
        # reduced records knows them only there
        done = max(int(progress.get("step") or 0), int(progress.get("reduced_through") or 0))
        return done <= self.attempt.start_step()

    def _let_save_finish(self) -> bool:
        """A rank failed while rank 0 may be writing a checkpoint: True while the write goes
        on and `checkpoint.save_grace_s` allows (the other ranks are stopped once it ends, so
        the restart, or the user, has the checkpoint that was being written); False to stop
        the ranks now. A second interrupt stops them at once."""
        grace = self.cfg.checkpoint.save_grace_s
        if grace <= 0 or self.interrupts.count >= 2:
            return False
        now = time.time()
        note = self.attempt.save_in_progress()
        if self._save_wait is None:
            if not note or not note.get("alive"):
                return False
            self._save_wait = (int(note["step"]), now + grace)
            self.console.say(f"mindpulse: {self.message}; rank 0 is writing the checkpoint of step {note['step']}: "
                             f"letting it finish (up to {grace:g}s, checkpoint.save_grace_s) before stopping the "
                             "other ranks (interrupt again to stop now)")
            return True
        step, until = self._save_wait
        if note is None:
            self.console.say(f"mindpulse: rank 0 finished writing the checkpoint of step {step}")
            return False
        if "error" in note:
            self.console.say(f"mindpulse: cannot tell whether rank 0 still writes the checkpoint of step {step}: "
                             f"{note['error']}")
            return False
        if not note.get("alive"):
            self.console.say(f"mindpulse: rank 0 ended before its checkpoint of step {step} was written")
            return False
        if now >= until:
            self.console.say(f"mindpulse: the checkpoint of step {step} was still being written after {grace:g}s "
                             "(checkpoint.save_grace_s)")
            return False
        if self.interrupts.count == 1 and not self._save_wait_said:
            self._save_wait_said = True
            self.console.say(f"mindpulse: interrupt: still letting rank 0 write the checkpoint of step {step}; "
                             "interrupt again to stop now")
        return True

    def result(self) -> RunResult:
        return RunResult(status=self.status, outcomes=self.outcomes, message=self.message,
                         order=list(self.failure_order), hang=self.hang, lost=list(self.lost))

    def _nodes(self) -> NodeWatch:
        """The attempt's nodes as the health probe sees them (built at the first tick: the
        agents have answered by then)."""
        if self._node_watch is None:
            import ray

            try:
                table = ray.nodes()
            except Exception:  # no raylet ports: nothing is probed, failures read as before
                table = []
            self._node_watch = NodeWatch(endpoints(self.attempt.nodes.infos, table,
                                                   self.cfg.world.ranks_per_node))
        return self._node_watch

    def _end_lost(self, lost: list[dict[str, Any]]) -> RunStatus:
        """A node lost or cut off: its ranks went with it (their own errors, "actor died", are
        not the cause), the other ranks are stopped, and no call waits on its agent again."""
        self.lost = lost
        self.message = describe_loss(lost)
        self.console.say(f"mindpulse: {self.message}; stopping the other ranks")
        self.attempt.nodes.lost.update(x["node"] for x in lost)
        went = {r: x for x in lost for r in x["ranks"]}
        for r, x in went.items():
            self.outcomes[r] = RankOutcome(rank=r, exit_code=None, pid=self.attempt.group.rank_pids.get(r),
                                           host=x["host"], error=f"went with node {x['node']} ({x['host']}, "
                                                                 f"{x['address']}): {x['kind']}")
        self.failure_order = sorted(went) + [r for r in self.failure_order if r not in went]
        return self._end(RunStatus.FAILED, lambda r: VICTIM)

    def _end(self, status: RunStatus, error_of: Callable[[int], str]) -> RunStatus:
        """Kill every rank still running; those without an outcome get `error_of(rank)` (and, when
        the run succeeded all the same, exit code 0: their training completed)."""
        self.attempt.kill_ranks()
        code = 0 if status is RunStatus.SUCCEEDED else None
        for r in range(self.cfg.world.world_size):
            self.outcomes.setdefault(r, RankOutcome(rank=r, exit_code=code, error=error_of(r)))
        self.pending = []
        self.status = status
        self.console.progress.clear()
        return status

    def _collect(self, ref: Any, owner: RefOwner) -> None:
        for o in self.attempt.group.outcomes(ref, owner):
            seen = o.rank in self.outcomes
            self.outcomes[o.rank] = o
            if not seen and (o.exit_code != 0 or o.error):
                self.failure_order.append(o.rank)

    def _lingering(self, ended_at: dict[Any, float]) -> list[int]:
        """The ranks still running `monitor.exit_timeout_s` after their training ended, once every
        rank's training ended (a rank that finished early waits for the others: not lingering)
        and every one still running is past the limit: all of them are ended together (and each
        named as lingering), so none may be named before its own limit passed (rank 0, which
        writes the last checkpoint, often ends its training a moment after the others)."""
        ended = {int(r): float(t) for r, t in ended_at.items()}
        running = [r for r in range(self.cfg.world.world_size) if r not in self.outcomes]
        if not running or any(r not in ended for r in running):
            return []
        limit = self.cfg.monitor.exit_timeout_s
        now = time.time()
        return running if all(now - ended[r] > limit for r in running) else []

    def _end_lingering(self, ranks: list[int], known: dict[Any, int | None]) -> RunStatus:
        """Every rank's training ended, these processes did not exit: their stacks into logs/
        (as for a hang), then they are ended; the training itself completed."""
        limit = self.cfg.monitor.exit_timeout_s
        self.console.say(f"mindpulse: rank(s) {ranks} did not exit within {limit:g}s after their training ended "
                         "(monitor.exit_timeout_s); dumping their stacks into logs/ and ending them")
        self._dump_stacks(known, ranks, ready=ranks)
        self.message = (f"the training completed; rank(s) {ranks} did not exit within {limit:g}s after it "
                        "(monitor.exit_timeout_s: stacks in logs/stacks_rank_<r>.txt) and were ended")
        return self._end(RunStatus.SUCCEEDED, lambda r: f"did not exit within {limit:g}s after its training ended; "
                                                        "ended (stacks in logs/)")

    def _check_hang(self) -> list[int]:
        """Ask the aggregator whether the job is hung; if so name the ranks, dump stacks."""
        now = time.time()
        if now - self._last_hang_check < HANG_CHECK_EVERY_S:
            return []
        self._last_hang_check = now
        info = self.attempt.hang_check()
        if not info:
            return []
        stuck = info["stuck"]
        self._hang_info = info
        self.console.say(f"mindpulse: HANG: no rank made progress for {info['no_progress_s']:.0f}s; stuck ranks "
                         f"{stuck} at steps {[info['steps'][r] for r in stuck]}"
                         + (f" (heartbeats silent: {info['silent']})" if info["silent"] else "")
                         + "; dumping every rank's stacks into logs/")
        self._dump_stacks(info["pids"], None, ready=info.get("started", []))
        return stuck

    def _dump_stacks(self, known: dict[Any, int | None], ranks: list[int] | None, ready: list[int]) -> None:
        """The ranks' stacks (every rank's with None) into logs/: their pids as the aggregator
        knows them (their START), else as the launcher recorded them."""
        def wanted(r: Any) -> bool:
            return ranks is None or int(r) in ranks

        pids = {int(r): p for r, p in known.items() if p and wanted(r)}
        pids.update({int(r): p for r, p in (self.attempt.pids.get("ranks") or {}).items()
                     if wanted(r) and int(r) not in pids})
        self.attempt.nodes.dump_stacks(pids, str(self.attempt.logs_dir), ready, self.console.say)
