"""The aggregator's side of the anomaly rules changed on a running job (`mindpulse rules
RUN_DIR set|add|disable`): `LiveRules` claims the requests the driver queued in the run
directory, checks each with the base's validator (`mindpulse/rules/changes.py`, the same
check `mindpulse rules` made before queuing it), builds the changed rules and swaps them into
the policy engine between steps, and keeps `rules.json`. The files and their formats are
described in `mindpulse/rules/changes.py`.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from mindpulse.config import ConfigError, RunConfig
from mindpulse.config.settings import AggregatorSettings
from mindpulse.reduction.baselines import Baseline
from mindpulse.rules.changes import (
    KEEP_REJECTED,
    MAX_CHANGES,
    MAX_PER_SCAN,
    REQUEST_NAME,
    REQUESTS_DIR,
    SCAN_EVERY_S,
    STATE_FILE,
    Entry,
    describe,
    entries_of,
    plan,
    read_request,
    read_state,
    refs_of,
)
from mindpulse.rundir.rundir_io import write_json_atomic

from .policies import RULES, Rule


class LiveRules:
    """The aggregator's rules as changed while the job runs: the policy engine's list is
    replaced in place, between steps."""

    def __init__(self, run_dir: Path, engine: Any, settings: AggregatorSettings, *,
                 next_step: Callable[[], int], say: Callable[[str], None],
                 milestone: Callable[[str, int], None] | None = None, replay: bool = False):
        self.run_dir = Path(run_dir)
        self.engine = engine
        self.settings = settings
        self.st = settings.config.monitor.straggler_threshold
        self.next_step = next_step
        self.say = say
        self.milestone = milestone
        self.attempt = settings.attempt
        self.kinds: dict[str, type[Rule]] = dict(RULES, **settings.extra_rules)
        self.entries = entries_of(list(engine.rules), settings.config.anomalies, self.st, self.kinds)
        self._run_cfg: RunConfig | None = None
        self._last_scan = 0.0
        state = read_state(self.run_dir) or {}
        self.changes: list[dict[str, Any]] = [c for c in state.get("changes") or [] if isinstance(c, dict)]
        self.applied: list[dict[str, Any]] = [a for a in state.get("applied") or [] if isinstance(a, dict)]
        self.rejected: list[dict[str, Any]] = [r for r in state.get("rejected") or [] if isinstance(r, dict)]
        self._replay_queue: deque[dict[str, Any]] = deque()
        self._unwritten = replay
        for req in self.applied:
            if replay and req.get("attempt") == self.attempt:
                self._replay_queue.append(req)  # at the step it applied from, as metrics.msgpack replays
            else:
                self._apply_again(req)
        if self.applied and not replay:
            self.say(f"rules: the {len(self.applied)} change(s) made while the job ran still apply "
                     f"(mindpulse rules {self.run_dir})")
        if not replay:
            self.write()

    # -- run config (the metrics a threshold rule may name) --
    def run_cfg(self) -> RunConfig | None:
        if self._run_cfg is None:
            from mindpulse.config import from_dict

            try:
                self._run_cfg = from_dict(yaml.safe_load(self.settings.config_yaml))
            except Exception:  # an unreadable stored YAML: fall back to the launcher's parsed config
                self._run_cfg = self.settings.config
        return self._run_cfg

    # -- applying --
    def _build(self, entries: list[Entry]) -> None:
        """Build the changed rules (a rule that cannot be built refuses the request)."""
        for e in entries:
            if e.enabled and e.rule is None:
                cls = self.kinds[e.kind]
                rule = cls(dict(e.cfg))
                if e.prev is not None:  # the rolling windows (baselines) carry over
                    for attr, val in vars(e.prev).items():
                        mine = getattr(rule, attr, None)
                        if isinstance(val, deque) and isinstance(mine, deque):
                            mine.extend(val)
                        elif isinstance(val, Baseline) and isinstance(mine, Baseline):
                            mine.carry(val)
                e.rule = rule
            e.prev = None

    def _commit(self, entries: list[Entry]) -> None:
        self.entries = entries
        self.engine.rules[:] = [e.rule for e in entries if e.enabled and e.rule is not None]

    def _plan(self, req: dict[str, Any]) -> tuple[list[Entry], list[dict[str, Any]]]:
        new, records = plan(self.entries, req, self.run_cfg(), self.st, self.kinds)
        self._build(new)
        return new, records

    def _apply_again(self, req: dict[str, Any]) -> None:
        """A change applied before (an earlier attempt, or before a restart), re-applied silently."""
        try:
            new, _ = self._plan(req)
        except Exception as exc:  # a change that no longer applies is said, the rules stand as they are
            self.say(f"rules: WARNING the change {req.get('command')!r} could not be applied again: {exc}")
            return
        self._commit(new)

    def before_step(self, step: int, replaying: bool = False) -> None:
        """Called before the rules judge reduced step `step`."""
        if replaying:
            while self._replay_queue and int(self._replay_queue[0].get("step") or 0) <= step:
                self._apply_again(self._replay_queue.popleft())
            return
        self.tick(step)

    def tick(self, step: int | None = None) -> None:
        """Pick up requests (at most every SCAN_EVERY_S); they apply from `step` (default:
        the next step to be reduced)."""
        if self._unwritten:  # a restarted aggregator's replay is over
            while self._replay_queue:
                self._apply_again(self._replay_queue.popleft())
            self._unwritten = False
            self.write()
        now = time.monotonic()
        if now - self._last_scan < SCAN_EVERY_S:
            return
        self._last_scan = now
        try:
            names = sorted(os.listdir(self.run_dir / REQUESTS_DIR))
        except OSError:
            return
        if not names:
            return
        self._scan(names, self.next_step() if step is None else step)

    def _scan(self, names: list[str], step: int) -> None:
        folder = self.run_dir / REQUESTS_DIR
        done = {str(a.get("id")) for a in self.applied} | {str(r.get("id")) for r in self.rejected}
        taken: list[tuple[str, Path]] = []
        for name in names:
            m = REQUEST_NAME.match(name)
            if not m:
                continue
            rid, path = m.group(1), folder / name
            if not m.group(2):
                claimed = folder / (name + ".taken")
                try:
                    os.rename(path, claimed)  # the client withdrew it, or it is ours now
                except OSError:
                    continue
                path = claimed
            if rid in done:  # applied before a crash could delete it
                _unlink(path)
                continue
            if any(t[0] == rid for t in taken):
                continue
            taken.append((rid, path))
            if len(taken) >= MAX_PER_SCAN:
                break
        if not taken:
            return
        for rid, path in taken:
            self._handle(rid, path, step)
        self.write()
        for _, path in taken:
            _unlink(path)

    def _handle(self, rid: str, path: Path, step: int) -> None:
        now = time.time()
        command = "?"
        try:
            req = read_request(path)
            command = str(req.get("command") or req.get("op"))[:500]
            if len(self.applied) >= MAX_CHANGES:
                raise ConfigError(f"this run has applied {MAX_CHANGES} rule changes, the most one run takes")
            new, records = self._plan(req)
        except Exception as exc:  # any refused change is recorded and answered, the running rules stay
            why = str(exc) if isinstance(exc, ConfigError) else f"{type(exc).__name__}: {exc}"
            self.rejected.append({"id": rid, "time": now, "step": step, "command": command, "error": why[:1000]})
            del self.rejected[:-KEEP_REJECTED]
            self.say(f"RULE CHANGE refused at {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(now))} "
                     f"(`mindpulse rules ... {command}`): {why}")
            return
        self._commit(new)
        req = {k: req[k] for k in ("op", "set", "entry", "rule", "command") if k in req}
        self.applied.append(dict(req, id=rid, step=step, attempt=self.attempt, time=now))
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))
        for rec in records:
            full = {"time": now, "step": step, "attempt": self.attempt, "op": rec["op"], "command": command,
                    "rule": rec["rule"], "field": rec["field"], "old": rec["old"], "new": rec["new"],
                    "request": rid}
            if rec.get("renamed"):
                full["renamed"] = rec["renamed"]
            self.changes.append(full)
            text = f"RULE CHANGE at {when}, from step {step} on: {describe(rec)}"
            self.say(text)
            if self.milestone is not None:
                self.milestone(text, step)

    # -- rules.json --
    def listing(self) -> list[dict[str, Any]]:
        return [{"ref": ref, "name": e.name, "rule": e.kind, "enabled": e.enabled, "action": e.cfg.get("action"),
                 "fields": e.shown(), "config": e.cfg} for ref, e in zip(refs_of(self.entries), self.entries)]

    def write(self) -> None:
        state = {"version": 1, "updated": time.time(), "attempt": self.attempt,
                 "reduced_through": self.next_step() - 1, "rules": self.listing(), "changes": self.changes,
                 "applied": self.applied, "rejected": self.rejected}
        try:
            write_json_atomic(self.run_dir / STATE_FILE, state)
        except OSError as exc:
            self.say(f"rules: WARNING could not write {STATE_FILE}: {exc}")


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
