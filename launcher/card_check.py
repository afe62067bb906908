"""The pre-flight card check, driver side: `mindpulse preflight`, and the gate at the start
of `launch` (`preflight.enabled`; auto: on when world.nodes > 1).

The check starts the ranks exactly as a training attempt does (launcher/attempt.py: the
same backend, placement group, node agents, environment and MindSpore scheduler), with
job.json's `task: card_check`: each rank runs workers/card_check.py (a timed float32
matmul on its card, then a timed all-reduce over the real backend with every other rank)
and exits. Its files go to `RUN_DIR/preflight/` (job.json, plan.json, logs/, the ranks'
raw `card_check` events in metrics.msgpack); the verdict to `RUN_DIR/preflight.json`:

    {"ok", "refuse", "action", "min_ratio", "refuse_ratio", "world_size", "device", "backend", "matmul_size",
     "allreduce_bytes", "median": {"matmul_gflops", "allreduce_gbps"},
     "ranks": [{"rank", "node", "card", "host", "matmul_gflops", "allreduce_gbps", "ok", "reason"}],
     "slow": [ranks], "too_slow": [ranks], "failed": [ranks], "message",
     "started", "ended", "seconds"}            # unix times; seconds = wall time of the check

A rank has **failed** when it produced no figure (it crashed, hung past
`preflight.timeout_s`, or was stopped because another rank failed), when its figures are not
positive numbers, or when its matmul product or all-reduce sum was wrong. A rank that did
not fail is **slow** when its matmul GFLOP/s or all-reduce GB/s is below
`preflight.min_ratio` × the median of the ranks that did not fail. The all-reduce is one
collective of the whole world, so a slow link lowers every rank's GB/s alike: compare the
medians between runs to see it.

Two bounds: a rank below `preflight.min_ratio` (0.8) × the median is reported (`slow`); one
below `preflight.refuse_ratio` (0.5; `too_slow`) or one that failed refuses the launch before
any training starts (status `preflight_failed`, exit code 4). With `preflight.action: stop` any
slow rank refuses it too (a shared or busy host can then refuse a healthy job).
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from pathlib import Path
from typing import Any

from mindpulse.common.formatting import number
from mindpulse.config import RunConfig
from mindpulse.config.fault_specs import CHECK_FAULTS, parse_fault
from mindpulse.wire.protocol import Action, EventKind

from .preflight import LaunchRefused

CHECK_DIR = "preflight"
"""The check's own files under the run directory (its job.json, plan.json, logs, packets)."""
REPORT_FILE = "preflight.json"
TASK = "card_check"
ROW_FIELDS = ("rank", "node", "card", "host", "matmul_gflops", "allreduce_gbps", "ok", "reason")
WAIT_S = 0.5


def enabled(cfg: RunConfig) -> bool:
    """Does `launch` run the check? `preflight.enabled`, or when unset (auto) world.nodes > 1."""
    on = cfg.preflight.enabled
    return cfg.world.nodes > 1 if on is None else bool(on)


def check_faults(cfg: RunConfig, running_check: bool) -> None:
    """A card-check fault (slow_card@R) in a launch that runs no check would rehearse
    nothing: refused before anything starts, with the key that turns the check on."""
    if running_check:
        return
    armed = [s for s in cfg.faults if parse_fault(s).kind in CHECK_FAULTS]
    if armed:
        why = "it is off" if cfg.preflight.enabled is False else "it is off by default on one node"
        raise LaunchRefused(f"{', '.join(armed)} rehearses the pre-flight card check, which this launch does not run "
                            f"({why}); add --set preflight.enabled=true, or run `mindpulse preflight`")


# ---- the verdict (pure) ---------------------------------------------------------------------
def _number(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        return None
    return float(x)


def judge(rows: list[dict[str, Any]], min_ratio: float, refuse_ratio: float | None = None) -> dict[str, Any]:
    """Mark each row `ok`/`reason` in place; returns `slow`, `too_slow` (the slow ranks below
    `refuse_ratio` x the median: they refuse the launch whatever the action), `failed` and the
    medians.

    Rows come in with `matmul_gflops`, `allreduce_gbps` (numbers or None) and `reason`
    already set for a rank that failed by itself (crash, wrong product, no result)."""
    failed: list[int] = []
    for row in rows:
        if not row.get("reason"):
            missing = [k for k in ("matmul_gflops", "allreduce_gbps") if not (_number(row.get(k)) or 0) > 0]
            if missing:
                row["reason"] = "no " + " and no ".join(missing) + " result"
        if row.get("reason"):
            row["ok"] = False
            failed.append(row["rank"])
    good = [r for r in rows if r["rank"] not in failed]
    median = {k: (statistics.median(float(r[k]) for r in good) if good else None)
              for k in ("matmul_gflops", "allreduce_gbps")}
    units = {"matmul_gflops": ("matmul", "GFLOP/s"), "allreduce_gbps": ("all-reduce", "GB/s")}
    slow: list[int] = []
    too_slow: list[int] = []
    for row in good:
        why = [f"{units[k][0]} {row[k]:.3g} {units[k][1]} < {min_ratio:g} x median {median[k]:.3g}"
               for k in units if median[k] is not None and row[k] < min_ratio * median[k]]
        row["ok"] = not why
        row["reason"] = ("slow: " + "; ".join(why)) if why else ""
        if why:
            slow.append(row["rank"])
            if refuse_ratio is not None and any(median[k] is not None and row[k] < refuse_ratio * median[k]
                                                for k in units):
                too_slow.append(row["rank"])
                row["reason"] += f" (below the refuse ratio {refuse_ratio:g})"
    return {"slow": sorted(slow), "too_slow": sorted(too_slow), "failed": sorted(failed), "median": median}


def build_report(cfg: RunConfig, results: dict[int, dict[str, Any]], problems: dict[int, str],
                 started: float, ended: float) -> dict[str, Any]:
    """preflight.json from each rank's last `card_check` result and the ranks' own failures
    (`problems`: rank → why it gave no or no complete result)."""
    from .spec import rank_specs

    rows: list[dict[str, Any]] = []
    for spec in rank_specs(cfg):
        res = results.get(spec.rank) or {}
        errors = [str(e) for e in res.get("errors") or []]
        reason = "; ".join(errors)
        if not reason and spec.rank in problems:
            reason = problems[spec.rank]
        elif not reason and res and res.get("phase") != "done":
            reason = f"stopped in the card check after its {res.get('phase')} part"
        elif not res and not reason:
            reason = "no result from the rank"
        rows.append({"rank": spec.rank, "node": spec.node, "card": spec.device_id, "host": res.get("host"),
                     "matmul_gflops": _number(res.get("matmul_gflops")),
                     "allreduce_gbps": _number(res.get("allreduce_gbps")), "ok": True, "reason": reason})
    pf = cfg.preflight
    verdict = judge(rows, pf.min_ratio, pf.refuse_ratio)
    done = [r for r in results.values() if r.get("phase") == "done"]
    first = done[0] if done else next(iter(results.values()), {})
    report: dict[str, Any] = {
        "ok": not verdict["slow"] and not verdict["failed"],
        "action": pf.action.value,
        "min_ratio": pf.min_ratio,
        "refuse_ratio": pf.refuse_ratio,
        "world_size": cfg.world.world_size,
        "device": cfg.world.device.value,
        "backend": first.get("backend"),
        "matmul_size": first.get("matmul_size") or pf.matmul_size or None,  # None: by device, no rank said
        "matmul_seconds": pf.matmul_seconds,
        "allreduce_bytes": first.get("allreduce_bytes") or int(pf.allreduce_mb * (1 << 20)) // 4 * 4,
        "allreduce_iters": pf.allreduce_iters,
        "median": verdict["median"],
        "ranks": rows,
        "slow": verdict["slow"],
        "too_slow": verdict["too_slow"],
        "failed": verdict["failed"],
        "started": started,
        "ended": ended,
        "seconds": ended - started,
    }
    report["refuse"] = refuses(report, pf.action)
    report["message"] = verdict_message(report)
    return report


def refuses(report: dict[str, Any], action: Action) -> bool:
    """Whether the launch is refused: a failed rank, or one below the refuse ratio, always; a
    slow one (below min_ratio) only with `preflight.action: stop`."""
    return bool(report["failed"] or report.get("too_slow") or (action is Action.STOP and report["slow"]))


def verdict_message(report: dict[str, Any]) -> str:
    """One line: every card ok, or the slow and failed ranks with why."""
    rows = {r["rank"]: r for r in report["ranks"]}
    if report["ok"]:
        return f"pre-flight card check: all {len(rows)} ranks ok ({report['seconds']:.1f} s)"
    parts = []
    if report["slow"]:
        parts.append(f"slow rank(s) {report['slow']}: "
                     + "; ".join(f"rank {r} {rows[r]['reason'][len('slow: '):]}" for r in report["slow"]))
    if report["failed"]:
        parts.append(f"failed rank(s) {report['failed']}: "
                     + "; ".join(f"rank {r}: {rows[r]['reason']}" for r in report["failed"]))
    return "pre-flight card check: " + " | ".join(parts)


def format_table(report: dict[str, Any]) -> str:
    """The console table: one row per rank, then the medians and the verdict."""
    from tabulate import tabulate

    rows = [[r["rank"], r["node"], r["card"], r.get("host") or "-", number(r["matmul_gflops"], ".1f"),
             number(r["allreduce_gbps"], ".3f"), "yes" if r["ok"] else "NO", r["reason"]] for r in report["ranks"]]
    med = report["median"]
    rows.append(["median", "", "", "", number(med["matmul_gflops"], ".1f"), number(med["allreduce_gbps"], ".3f"),
                 "", ""])
    size = report.get("matmul_size")
    shape = f"{size}x{size}" if size else "square"
    mib = (report.get("allreduce_bytes") or 0) / (1 << 20)
    head = (f"pre-flight card check: {report['world_size']} ranks ({report['device']}), matmul {shape} float32 "
            f"for {report['matmul_seconds']:g} s, all-reduce {mib:g} MiB x{report['allreduce_iters']}"
            + (f" over {report['backend']}" if report.get("backend") else "")
            + f"; slow below {report['min_ratio']:g} x the median")
    table = tabulate(rows, headers=list(ROW_FIELDS), tablefmt="simple", disable_numparse=True)
    return f"{head}\n{table}\nslow: {report['slow']}  failed: {report['failed']}  ({report['seconds']:.1f} s)"


# ---- running it -----------------------------------------------------------------------------
def _read_results(check_dir: Path) -> dict[int, dict[str, Any]]:
    """Each rank's newest `card_check` event from the check's metrics.msgpack."""
    import json

    from mindpulse.rundir.metrics_store import read_packets
    from mindpulse.wire.protocol import EventPacket

    out: dict[int, dict[str, Any]] = {}
    path = check_dir / "metrics.msgpack"
    if not path.exists():
        return out
    for pkt in read_packets(path):
        if isinstance(pkt, EventPacket) and pkt.kind == EventKind.CARD_CHECK.value:
            try:
                res = json.loads(pkt.message)
            except ValueError:
                continue
            if isinstance(res, dict):
                out[pkt.rank] = dict(res, host=res.get("host") or pkt.host)
    return out


def _first_line(text: str) -> str:
    return (text or "").strip().splitlines()[0][:300] if (text or "").strip() else ""


def run_check(cfg: RunConfig, *, run_dir: Path, run_id: str, session: Any, pids: Any, console: Any,
              interrupts: Any = None) -> dict[str, Any]:
    """Start the ranks in card-check mode, wait for them (at most preflight.timeout_s), end
    them, and write RUN_DIR/preflight.json. Returns the report (`interrupted`: True when a
    signal cut it short). LaunchRefused (the cluster cannot hold the job) propagates."""
    import ray

    from .attempt import Attempt
    from .interrupts import StartInterrupted
    from .rundir import make_dir, run_modes, write_config, write_json
    from .spec import RunResult, RunStatus

    started = time.time()
    check_dir = make_dir(run_dir / CHECK_DIR, run_modes(cfg)[1])
    ccfg = copy.deepcopy(cfg)
    ccfg.output.tensorboard = False  # the check's aggregator only files the ranks' events
    ccfg.output.report = False
    write_config(check_dir, ccfg)
    console.say(f"mindpulse: pre-flight card check on {cfg.world.world_size} ranks (logs in {check_dir / 'logs'})")
    attempt = Attempt(ccfg, index=0, run_dir=check_dir, run_id=f"{run_id}-check", session=session, resume=None,
                      pids=pids, console=console, task=TASK,
                      interrupts=interrupts)
    problems: dict[int, str] = {}
    status = RunStatus.SUCCEEDED
    interrupted = False
    try:
        refs = attempt.start()
        pending = list(refs)
        deadline = started + cfg.preflight.timeout_s
        while pending:
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=WAIT_S)
            for ref in done:
                for o in attempt.group.outcomes(ref, refs[ref]):
                    if o.exit_code != 0 or o.error:
                        problems.setdefault(o.rank, _first_line(o.error) or f"exit code {o.exit_code}")
            why = ""
            if problems and pending:
                why = f"stopped: rank {min(problems)} failed first"
            elif time.time() > deadline and pending:
                why = f"no result within preflight.timeout_s ({cfg.preflight.timeout_s:g} s)"
            elif interrupts is not None and interrupts.count and pending:
                why, interrupted = "interrupted", True
            if why:
                attempt.kill_ranks()
                for ref in pending:
                    for r in attempt.group.ranks_of(refs[ref]):
                        problems.setdefault(r, why)
                status = RunStatus.FAILED
                break
    except LaunchRefused:
        attempt.finish(RunResult(status=RunStatus.FAILED), graceful=False)  # what was placed, the aggregator
        raise
    except BaseException as exc:  # a launcher error, or Ctrl-C without the launch's handlers: end it all
        status = RunStatus.FAILED
        interrupted = interrupted or isinstance(exc, (KeyboardInterrupt, StartInterrupted))
        for r in range(cfg.world.world_size):
            problems.setdefault(r, "interrupted" if isinstance(exc, StartInterrupted)
                                else f"launcher error: {type(exc).__name__}: {exc}")
        if not isinstance(exc, (Exception, StartInterrupted)):
            attempt.finish(RunResult(status=status), graceful=False)
            raise
    attempt.finish(RunResult(status=status), graceful=status is RunStatus.SUCCEEDED)
    report = build_report(cfg, _read_results(check_dir), problems, started, time.time())
    if interrupted:
        report["interrupted"] = True
    write_json(run_dir / REPORT_FILE, report)
    return report


def gate(cfg: RunConfig, *, run_dir: Path, run_id: str, session: Any, pids: Any, console: Any,
         interrupts: Any) -> Any:
    """`launch`'s check before training: None when training may start, else the RunResult
    that ends the launch (preflight_failed, or interrupted)."""
    from .spec import RunResult, RunStatus

    report = run_check(cfg, run_dir=run_dir, run_id=run_id, session=session, pids=pids, console=console,
                       interrupts=interrupts)
    console.say(format_table(report))
    if report.get("interrupted"):
        return RunResult(status=RunStatus.INTERRUPTED, message="interrupted during the pre-flight card check")
    if report["ok"]:
        console.say(f"mindpulse: {report['message']}; starting the training")
        return None
    if not report["refuse"]:
        console.say(f"mindpulse: WARNING {report['message']} (above preflight.refuse_ratio "
                    f"{cfg.preflight.refuse_ratio:g} x the median, preflight.action: warn: training anyway)")
        return None
    why = ("preflight.action: stop" if cfg.preflight.action is Action.STOP and not (report["failed"] or
                                                                                   report["too_slow"])
           else f"a failed card, or one below preflight.refuse_ratio {cfg.preflight.refuse_ratio:g} x the median")
    return RunResult(status=RunStatus.PREFLIGHT_FAILED,
                     message=f"{report['message']}; launch refused before training ({why}; "
                             f"{REPORT_FILE} has every rank's figures)")


def preflight_command(cfg: RunConfig, as_json: bool = False) -> int:
    """`mindpulse preflight`: the check alone in a new run directory; exit code 0 when every
    card is ok, 4 when one is slow or failed (whatever preflight.action says), 2 when the
    cluster cannot hold the job, 130 when interrupted."""
    import json
    import shutil
    import sys
    import uuid

    from .preflight import check_local
    from .progress import Console
    from .ray_session import RaySession
    from .rundir import PidFile, apply_run_mode, make_run_dir, write_config
    from .spec import ExitCode

    console = Console(sys.stderr if as_json else sys.stdout)
    try:
        check_local(cfg)
    except LaunchRefused as exc:
        print(f"mindpulse: {exc}", file=sys.stderr, flush=True)
        return int(ExitCode.USAGE)
    run_dir = make_run_dir(cfg)
    write_config(run_dir, cfg)
    console.say(f"mindpulse: run directory {run_dir}")
    pids = PidFile(run_dir)
    try:
        with RaySession(cfg) as session:
            pids["ray_temp_dir"] = session.temp_dir
            pids.save()
            report = run_check(cfg, run_dir=run_dir, run_id=f"{run_dir.name}-{uuid.uuid4().hex[:6]}",
                               session=session, pids=pids, console=console)
    except LaunchRefused as exc:
        print(f"mindpulse: {exc}", file=sys.stderr, flush=True)
        shutil.rmtree(run_dir, ignore_errors=True)
        return int(ExitCode.USAGE)
    finally:
        pids.save()
    apply_run_mode(run_dir, cfg)
    if as_json:
        print(json.dumps(report, indent=2), flush=True)
    else:
        console.say(format_table(report))
        console.say(f"mindpulse: {report['message']}; {run_dir / REPORT_FILE}")
    if report.get("interrupted"):
        return int(ExitCode.INTERRUPTED)
    return int(ExitCode.SUCCESS if report["ok"] else ExitCode.PREFLIGHT)
