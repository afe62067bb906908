"""What the aggregator decides from a reduced step: the rules' firings, a stop (and a
rollback), the checkpoints rank 0 writes after the step (periodic and best), the directive
that says so, and the lease every rank runs by.

A stop is first requested (by a rule, an interrupt, a failed save) and decided at the next
reduced step S: every rank stops after S + `monitor.max_lag_steps`, the first step no rank
may have started yet.
"""

from __future__ import annotations

import json
import logging
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from mindpulse.config import CheckpointConfig
from mindpulse.config.settings import AggregatorSettings
from mindpulse.reduction.reducer import ReducedStep
from mindpulse.rules.configs import rule_config
from mindpulse.wire.directives import Directive, Lease
from mindpulse.wire.protocol import Action, CheckpointKind, EventPacket
from mindpulse.wire.stop_decision import RollbackDecision, StopDecision

from .live_rules import LiveRules
from .policies import Firing, PolicyEngine, build_rules

log = logging.getLogger(__name__)

KEEP_DIRECTIVES = 1024
"""Directives kept for rank 0 to ask (it asks within a few steps)."""


@dataclass
class Verdict:
    """What the decisions found, for the pipeline to record and hand to the sinks (no decision
    writes to a view): the firings, the rules that raised, the lines to say, and at a reduced
    step its directive."""

    directive: Directive | None = None
    anomalies: list[dict[str, Any]] = field(default_factory=list)
    """The firings reported (anomalies.jsonl's records; a firing repeated while its stop is under
    way is only counted)."""
    rule_errors: list[dict[str, Any]] = field(default_factory=list)
    """anomalies.jsonl's records of the rules that raised (each rule and cause once)."""
    notes: list[str] = field(default_factory=list)

    @property
    def records(self) -> list[dict[str, Any]]:
        """What anomalies.jsonl gets, in order."""
        return self.anomalies + self.rule_errors


class Decisions:
    def __init__(self, run_dir: Path, settings: AggregatorSettings, *, next_step: Callable[[], int],
                 say: Callable[[str], None], milestone: Callable[[str, int], None], replay: bool = False):
        """`say`, `milestone`: where the live rule changes (`LiveRules`) tell what they applied."""
        cfg = settings.config
        self.ckpt: CheckpointConfig = cfg.checkpoint
        self.max_lag = cfg.monitor.max_lag_steps
        self.rollbacks_done: dict[str, int] = dict(settings.rollbacks)
        """Rollbacks each rule has made in this launch (the launcher's count, per attempt)."""
        self.policies = PolicyEngine(build_rules(cfg.anomalies, extra_kinds=settings.extra_rules,
                                                 straggler_threshold=cfg.monitor.straggler_threshold))
        self.rule_errors: list[dict[str, Any]] = []
        self.anomalies_total = 0
        self.repeats_while_stopping = 0
        """Firings of the stopping rule between its decision and the stop step, not re-reported."""
        self.stop_request: StopDecision | None = None
        self.stop: StopDecision | None = None
        self.directives: OrderedDict[int, Directive] = OrderedDict()
        self.best: tuple[float, int] | None = None
        """(metric, step) of the best reduced metric that was saved (or asked to be)."""
        self.checkpoints: list[dict[str, Any]] = []
        self.best_checkpoint: dict[str, Any] | None = None
        seed = settings.best  # the manifest's best when this attempt started (a restart)
        if seed is not None and seed.metric_name == self.ckpt.best_metric:
            self.best = (seed.metric, seed.step)
            self.best_checkpoint = {"path": seed.path, "step": seed.step, "metric": seed.metric,
                                    "metric_name": seed.metric_name}
        # rules changed on the running job (`mindpulse rules`), kept across restarts: rule_changes.py
        self.live_rules = LiveRules(run_dir, self.policies, settings, replay=replay, say=say,
                                    next_step=next_step, milestone=milestone)

    # ---- requests
    def request_stop(self, reason: str, rule: str = "interrupt", rank: int | None = None,
                     value: float | None = None, save: bool = False, threshold: float | None = None,
                     rollback: RollbackDecision | None = None) -> None:
        """Stop every rank after the next reduced step plus monitor.max_lag_steps (first request wins).

        `save`: rank 0 also writes a `last` checkpoint after that step (interrupts and
        save_and_stop rules); `rollback`: the launcher then resumes from a checkpoint before
        the anomaly (`stop.rollback` in summary.json's attempts)."""
        if self.stop_request is None and self.stop is None:
            self.stop_request = StopDecision(rule=rule, message=reason, rank=rank, value=value, threshold=threshold,
                                             save=save, rollback=rollback)

    def on_rank_error(self, pkt: EventPacket) -> None:
        if pkt.message.startswith("checkpoint save") and self.ckpt.on_save_error == "stop":
            self.request_stop(f"{pkt.message} (checkpoint.on_save_error: stop)", rule="checkpoint_save",
                              rank=pkt.rank)

    def on_checkpoint(self, pkt: EventPacket) -> tuple[list[dict[str, Any]], int | None]:
        """Rank 0's checkpoint event: the entries it wrote. Returns them with how many entries
        were refused (malformed: checked before they reach a table; None when the event is no list)."""
        try:
            entries = json.loads(pkt.message)
        except ValueError:
            return [], None
        refused = 0
        kept: list[dict[str, Any]] = []
        for e in entries if isinstance(entries, list) else []:
            step = e.get("step") if isinstance(e, dict) else None
            if not (isinstance(step, int) and not isinstance(step, bool) and 0 <= step
                    and isinstance(e.get("path"), str) and isinstance(e.get("kind"), str)):
                refused += 1
                continue
            self.checkpoints.append(e)
            kept.append(e)
            if e.get("kind") == CheckpointKind.BEST:
                self.best_checkpoint = {"path": e.get("path"), "step": e.get("step"), "metric": e.get("metric"),
                                        "metric_name": e.get("metric_name")}
        del self.checkpoints[:-200]
        return kept, refused

    # ---- the rules
    def on_telemetry(self, cards: list[dict[str, Any]], now: float, step: int) -> Verdict:
        verdict = Verdict()
        for f in self.policies.on_telemetry(cards, now, step):
            self._on_firing(f, verdict)
        self._on_rule_errors(step, verdict)
        return verdict

    def _on_rule_errors(self, step: int, verdict: Verdict) -> None:
        """A rule that raised is reported once per rule and cause (it would never fire)."""
        for err in self.policies.take_errors():
            if len(self.rule_errors) < 100:
                self.rule_errors.append(dict(err, step=step))
            verdict.rule_errors.append({"rule": err["rule"], "kind": "rule_error", "step": step, "rank": None,
                                        "value": None, "threshold": None, "action": "none",
                                        "message": f"rule {err['rule']} failed and is not checking: {err['error']}"})
            verdict.notes.append(f"RULE ERROR {err['rule']} at step {step}: {err['error']} (the rule cannot fire)")
            log.error("rule %s raised at step %d: %s", err["rule"], step, err["error"])

    def _on_firing(self, f: Firing, verdict: Verdict) -> None:
        """Report once (the verdict's anomalies), and stop every rank if the rule says so."""
        stop = self.stop
        if stop is not None and f.rule == stop.rule and f.step > (stop.decided_at if stop.decided_at is not None
                                                                   else f.step):
            # the steps run while every rank reaches the stop step repeat its cause (a NaN
            # in the weights stays there): reported once, counted
            self.repeats_while_stopping += 1
            return
        self.anomalies_total += 1
        verdict.anomalies.append(f.to_record())
        if f.action.stops:
            self.request_stop(f.message, rule=f.rule, rank=f.rank, value=f.value,
                              save=f.action is Action.SAVE_AND_STOP, threshold=f.threshold,
                              rollback=self._rollback_of(f, verdict))

    def _rollback_of(self, f: Firing, verdict: Verdict) -> RollbackDecision | None:
        """What the launcher needs to roll back after `f` (a rollback rule with rollbacks
        left), else None: the rule then stops the job as `stop` does, and says why."""
        if f.action is not Action.ROLLBACK:
            return None
        rule = next((r for r in self.policies.rules if r.name == f.rule), None)
        if rule is None:
            cfg = rule_config({})  # the rule is gone (changed meanwhile): the config's defaults
        else:
            cfg = rule.config
        done = int(self.rollbacks_done.get(f.rule, 0))
        if done >= cfg.max_rollbacks:
            verdict.notes.append(f"ANOMALY {f.rule}: {done} rollback(s) made, max_rollbacks {cfg.max_rollbacks}: "
                                 "stopping the job")
            return None
        return RollbackDecision(rule=f.rule, anomaly_step=f.step, skip_batches=bool(cfg.skip_batches),
                                lr_factor=float(cfg.lr_factor), lr_steps=int(cfg.lr_steps))

    # ---- a reduced step
    def on_reduced(self, red: ReducedStep, replaying: bool) -> Verdict:
        """The rules judge the step, a requested stop is decided, and the step's directive is made."""
        self.live_rules.before_step(red.step, replaying)  # changes apply between steps
        verdict = Verdict()
        for f in self.policies.on_step(red):
            self._on_firing(f, verdict)
        self._on_rule_errors(red.step, verdict)
        if self.stop_request is not None and self.stop is None:
            # decided now, at step S; ranks may already be running up to S+max_lag (their
            # lease allowed it): every rank stops after that same step
            req = self.stop_request
            self.stop = replace(req, save=False, step=red.step + self.max_lag, decided_at=red.step,
                                save_last=bool(req.save and self.ckpt.save_last))
            verdict.notes.append(f"stopping every rank after step {self.stop.step}: {req.message}"
                                 + (f" (decided at step {red.step})" if self.max_lag else ""))
        kinds: set[CheckpointKind] = set()
        metric: float | None = None
        metric_name = ""
        if any(p.decision for p in red.per_rank.values()):
            kinds, metric, metric_name = self._save_decision(red)
        action, reason = Action.CONTINUE, ""
        if self.stop is not None and self.stop.step is not None and red.step >= self.stop.step:
            action, reason = Action.STOP, self.stop.message
            if self.stop.save_last:
                kinds.add(CheckpointKind.LAST)
        directive = Directive(step=red.step, action=action, reason=reason, saves=kinds, metric=metric,
                              metric_name=metric_name)
        self.directives[red.step] = directive
        while len(self.directives) > KEEP_DIRECTIVES:
            self.directives.popitem(last=False)
        verdict.directive = directive
        return verdict

    def _save_decision(self, red: ReducedStep) -> tuple[set[CheckpointKind], float | None, str]:
        """Which checkpoints rank 0 writes after this step (periodic and/or best), and the
        metric a best one is judged by."""
        c = self.ckpt
        kinds: set[CheckpointKind] = set()
        metric, metric_name = None, ""
        if c.periodic_due(red.step):  # the rule rank 0's schedule waits by
            kinds.add(CheckpointKind.PERIODIC)
        if c.best_due(red.step) and not red.nonfinite_ranks:
            name = c.best_metric
            value = red.metric(name)  # None where the step has no such metric (no evaluation)
            if value is not None and math.isfinite(value):
                better = (self.best is None or (value < self.best[0] if c.best_mode.value == "min"
                                                else value > self.best[0]))
                if better:
                    self.best = (value, red.step)
                    kinds.add(CheckpointKind.BEST)
                    metric, metric_name = value, name
        return kinds, metric, metric_name

    # ---- what the ranks are told
    def directive_for(self, step: int) -> Directive | None:
        return self.directives.get(step)

    def lease(self, reduced_through: int) -> Lease:
        """What every rank may do now (pushed to the ranks through their node's relay)."""
        stop = self.stop
        if stop is None or stop.step is None:
            return Lease(reduced_through=reduced_through, stop_after=-1, reason="", save_last=False)
        return Lease(reduced_through=reduced_through, stop_after=stop.step, reason=stop.message,
                     save_last=stop.save_last)

    def stop_dict(self) -> dict[str, Any] | None:
        return self.stop.to_dict() if self.stop is not None else None


__all__ = ["KEEP_DIRECTIVES", "Decisions", "RollbackDecision", "StopDecision", "Verdict"]
