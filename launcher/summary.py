"""The end of a run: `RUN_DIR/summary.json`, the final tables, the failure's root cause,
and the HTML report when `output.report` asks for it."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mindpulse.config import RunConfig
from mindpulse.registry.metrics import totals
from mindpulse.rules.changes import changes_in

from .rundir import write_json
from .spec import ExitCode, RunResult, RunStatus


@dataclass
class RunHistory:
    """What the attempts leave for the summary."""

    logs_dir: Path
    """The last attempt's log folder."""
    resume: dict[str, Any] | None = None
    """The checkpoint the last attempt started from."""
    attempts: list[dict[str, Any]] = field(default_factory=list)
    """One record per attempt: status, message, resumed_from, logs, steps_completed, failure."""
    rank_nodes: dict[int, str] = field(default_factory=dict)
    """Rank → Ray node id, of the last attempt whose ranks were started."""
    dropped_packets: int = 0
    aggregator_lost: bool = False
    unshared_hosts: list[dict[str, Any]] = field(default_factory=list)
    """summary.json `output_not_shared`: the hosts that did not see the run directory."""

    def add_losses(self, snap: dict[str, Any]) -> None:
        """An attempt's loss totals: the run's first loss is the first attempt's that has
        one; its best the lowest of all attempts' (each attempt's aggregator sees its own)."""
        if "first_loss" not in self.losses and snap.get("first_loss") is not None:
            self.losses["first_loss"] = snap["first_loss"]
        best = snap.get("best_loss")
        if best is not None and ("best_loss" not in self.losses or best < self.losses["best_loss"]):
            self.losses.update(best_loss=best, best_loss_step=snap.get("best_loss_step"))
    losses: dict[str, Any] = field(default_factory=dict)
    """The run's loss totals across attempts: the first attempt's first loss, the lowest best."""
    clocks: list[dict[str, Any] | None] = field(default_factory=list)
    """Each attempt's goodput clock (the aggregator's `GoodputClock`; None: no step reduced)."""
    rollbacks: list[dict[str, Any]] = field(default_factory=list)
    """summary.json `rollbacks`: rule, anomaly_step, from_step, to_step, skipped_batches, lr_factor."""


def final_status(result: RunResult, snap: dict[str, Any]) -> RunStatus:
    """The run's status: a clean end after an anomaly rule's stop is ANOMALY_STOP, after an
    interrupt's stop INTERRUPTED."""
    status = result.status
    stop = snap.get("stop")
    if status is RunStatus.SUCCEEDED and stop and stop.get("rule") not in (None, "interrupt"):
        status = RunStatus.ANOMALY_STOP
    if stop and stop.get("rule") == "interrupt" and status is RunStatus.SUCCEEDED:
        status = RunStatus.INTERRUPTED
    return status


def no_steps_reason(snap: dict[str, Any]) -> str | None:
    """Why no step was reduced, and what to add (None when steps were reduced)."""
    if snap.get("steps_completed"):
        return None
    missing = [a for a in snap.get("advice") or [] if a.get("kind") == "no_monitor"]
    if missing:
        return "; ".join(f"{a['message']}: its steps are never reported. To fix: {a['fix']}" for a in missing)
    return None


def _say_final_summary(cfg: RunConfig, run_dir: Path, summary: dict[str, Any], say: Callable[[str], None]) -> Any:
    """The end-of-run summary in the report's order: the status and why first, then wall time
    (as dates), steps, loss first → best → last, throughput, world and cards, checkpoints,
    anomalies, attempts and ranks. The metrics are read once, for this and the report; with
    `output.report` off only the summary and the side files are (cheap for a run of any size).
    Returns what was read, for the report."""
    from mindpulse.reporting.tables import summary_table, totals_table

    say("")
    try:
        from mindpulse.views.report import final_tables, load_run

        data = load_run(run_dir, metrics=cfg.output.report)
        say(final_tables(data))
        return data
    except Exception as exc:  # the summary.json written stands; fall back to the plain tables
        say(summary_table(summary.get("ranks", [])))
        say("")
        say(totals_table(summary))
        say(f"mindpulse: could not read the run back for its summary: {type(exc).__name__}: {exc}")
        return None


def write_summary(cfg: RunConfig, run_dir: Path, result: RunResult, snap: dict[str, Any], history: RunHistory,
                  pids: dict[str, Any], started: float, say: Callable[[str], None]) -> tuple[RunStatus, dict[str, Any]]:
    status = final_status(result, snap)
    stop = snap.get("stop")
    ranks = []
    for r in range(cfg.world.world_size):
        base = next((x for x in snap.get("ranks", []) if x["rank"] == r), {"rank": r, "last_step": 0,
                                                                           "param_fingerprint": None})
        o = result.outcomes.get(r)
        ranks.append(dict(base, exit_code=o.exit_code if o else None, error=o.error if o else "",
                          pid=base.get("pid") or (o.pid if o else None),
                          node=r // cfg.world.ranks_per_node,
                          node_id=history.rank_nodes.get(r)))
    summary = {
        "status": status.value,
        "exit_code": int(ExitCode.of(status)),
        "run_dir": str(run_dir),
        "name": cfg.name,
        "world_size": cfg.world.world_size,
        "steps_completed": snap.get("steps_completed", 0),
        "ranks": ranks,
        "stop": stop if status is not RunStatus.SUCCEEDED else None,
        "best_checkpoint": snap.get("best_checkpoint"),
        "anomalies": snap.get("anomalies", 0),
        "rule_errors": snap.get("rule_errors", []),
        "rule_changes": snap["rule_changes"] if "rule_changes" in snap else changes_in(run_dir),  # mindpulse rules
        "resumed_from": history.resume,
        "attempts": history.attempts,
        "rollbacks": history.rollbacks,
        "aggregator_lost": history.aggregator_lost,
        "output_not_shared": history.unshared_hosts,
        "message": result.message,
        "first_loss": history.losses.get("first_loss", snap.get("first_loss")),
        "last_loss": snap.get("last_loss"),
        "best_loss": history.losses.get("best_loss", snap.get("best_loss")),
        "best_loss_step": history.losses.get("best_loss_step", snap.get("best_loss_step")),
        "fingerprints_equal": snap.get("fingerprints_equal"),
        **{key: snap.get(key, 0.0) for key, _ in totals()},  # the registry's run totals (Reduction.total)
        "monitor_errors": snap.get("monitor_errors", 0),
        "last_grad_norm": snap.get("last_grad_norm"),
        "loss_scale": snap.get("loss_scale"),
        "overflow_steps": snap.get("overflow_steps"),
        "packets": dict(snap.get("packets", {}), dropped=history.dropped_packets,
                        aggregator_restarts=snap.get("aggregator_restarts", 0)),
        "advice": snap.get("advice") or [],
        "no_steps_reason": no_steps_reason(snap),
        "pids": pids,
        "started": started,
        "wall_time_s": time.time() - started,
    }
    from mindpulse.reporting.goodput import combine

    # each attempt's clock as the controller kept it; a summary written without them (the
    # launcher lost its history) falls back to the final snapshot's
    clocks = history.clocks or [snap.get("goodput")]
    summary["goodput"] = combine(clocks, started, time.time(), history.attempts)
    summary["compute"] = snap.get("compute")  # tokens/s, TFLOPS per card, MFU and its peak
    summary["failure"] = None
    if status is RunStatus.FAILED:
        from .failures import describe_failure, failure_kind, format_failure

        last_steps = {x["rank"]: x["last_step"] for x in ranks}
        summary["failure"] = describe_failure(result.outcomes, result.order, history.logs_dir, last_steps,
                                              failure_kind(result), stuck=result.hang, message=result.message,
                                              lost=result.lost)
        say(format_failure(summary["failure"]))
    write_json(run_dir / "summary.json", summary)
    data = _say_final_summary(cfg, run_dir, summary, say)
    say(f"\nmindpulse: {status.value} (exit code {int(ExitCode.of(status))}); run directory {run_dir}")
    if cfg.output.report:
        try:
            from mindpulse.views.report import build_report

            rep = build_report(run_dir, data=data)
            say(f"mindpulse: report {rep['html']}")
        except Exception as exc:  # the run's outcome stands; say why there is no report
            say(f"mindpulse: could not write the report: {type(exc).__name__}: {exc}")
    from .rundir import apply_run_mode

    apply_run_mode(run_dir, cfg)  # the report's files follow output.mode too
    return status, summary
