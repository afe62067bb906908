"""The report's tables as rows of display strings — ranks, attempts, anomalies, checkpoints —
shared by the console text (`text`) and the page (`html`), so both show the same cells.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mindpulse.common import formatting as fmt

from .data import RunData, as_int
from .headline import checkpoint_file, failure_error, first_line


def rank_table_rows(data: RunData, only_failed: bool = False) -> tuple[list[str], list[list[Any]]]:
    """(headers, rows): one row per rank (`only_failed`: the ranks that failed); the attempt and error
    columns only where the run has them."""
    headers = ["rank", "last step", "loss", "grad norm local", "step ms", "fingerprint", "exit", "host", "pid"]
    all_rows = data.rank_rows()
    picked = [r for r in all_rows if (r["exit_code"] not in (0, None) or r["error"])] if only_failed else all_rows
    with_error = any(r["error"] for r in picked)
    rows = []
    for r in picked:
        row = [r["rank"], r["last_step"], fmt.cell(r["loss"]), fmt.cell(r["grad_norm_local"], ".3f"),
               fmt.millis(r["step_time_s"]) if fmt.is_number(r["step_time_s"]) else fmt.MISSING,
               (r["fingerprint"] or "-")[:16], fmt.cell(r["exit_code"]), r["host"] or "-", r["pid"] or "-"]
        if data.multi_attempt:  # the attempt behind each rank's last step
            row.append(fmt.cell(r["attempt"]))
        if with_error:
            row.append(first_line(r["error"]) or "-")
        rows.append(row)
    if data.multi_attempt:
        headers.append("attempt")
    if with_error:
        headers.append("error")
    return headers, rows


ATTEMPT_KEYS = ("attempt", "started", "status", "steps shown", "resumed from", "ended with", "superseded steps")


def attempt_rows(data: RunData) -> list[tuple[int, list[str]]]:
    """(attempt, row): one row per attempt, from the launcher's record and the metrics."""
    launcher = {a.get("attempt"): a for a in data.summary_attempts if as_int(a.get("attempt")) is not None}
    metrics = {a.attempt: a for a in data.attempts}
    rows = []
    for k in sorted(set(launcher) | set(metrics)):
        la, me = launcher.get(k, {}), metrics.get(k)
        steps = "-"
        if me is not None and me.first_step is not None:
            steps = f"{me.first_step} → {me.last_step if me.last_step is not None else '?'}"
        elif as_int(la.get("steps_completed")) is not None:
            steps = f"→ {la['steps_completed']}"
        res = la.get("resumed_from")
        resumed = "-"
        if isinstance(res, dict) and res.get("path"):
            resumed = f"{Path(str(res['path'])).name} (step {res.get('step')})"
        f = la.get("failure") if isinstance(la.get("failure"), dict) else None
        ended = ""
        if f:
            ended = (f"rank {f.get('root_cause_rank')} at step {f.get('step')}: " if f.get("root_cause_rank")
                     is not None else "") + failure_error(f)
        ended = ended or first_line(la.get("message")) or "-"
        rows.append((k, [str(k), fmt.when(me.started) if me is not None else "-", str(la.get("status") or "-"), steps,
                         resumed, ended, str(me.superseded) if me is not None else "-"]))
    return rows


ANOMALY_KEYS = ("step", "rule", "rank", "value", "threshold", "action", "message")
CHECKPOINT_KEYS = ("step", "kind", "metric", "file", "size", "sha256")


def anomaly_cells(a: dict[str, Any]) -> list[str]:
    """One anomaly record as the cells of `ANOMALY_KEYS`."""
    out = []
    for k in ANOMALY_KEYS:
        v = a.get(k)
        out.append(fmt.cell(v, ".6g") if k in ("value", "threshold") else fmt.cell(v))
    return out


def checkpoint_cells(data: RunData, c: dict[str, Any], short_sha: bool = True) -> list[str]:
    """One manifest record as the cells of `CHECKPOINT_KEYS` (`short_sha`: its first 16 hex digits)."""
    ck = checkpoint_file(data, c)
    sha = c.get("sha256")
    sha_text = (sha[:16] if short_sha else sha) if isinstance(sha, str) else "-"
    metric = "-" if ck is None or ck.metric is None else f"{ck.metric_name} {fmt.metric(ck.metric)}".strip()
    return [fmt.cell(c.get("step")), fmt.cell(c.get("kind")), metric, ck.name if ck else fmt.cell(c.get("path")),
            fmt.size(ck.size) if ck else "-", sha_text]


def checkpoint_rows(data: RunData, short_sha: bool = True) -> list[list[str]]:
    return [checkpoint_cells(data, c, short_sha) for c in data.checkpoints]
