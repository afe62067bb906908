"""Run every benchmark in sequence within a time budget, print the tables and rewrite
docs/benchmarks.md with exactly those figures.

Each piece runs in its own process (`bench/<name>.py --json ...`); its result lands in
bench/results/<name>.json and its console output in bench/results/logs/<name>.log. A
thread samples the CPU used by processes outside this run (the machine may be shared):
before a piece starts, the run waits a little for foreign load to settle, and a piece
that ran beside heavy foreign load (or failed) is run again while the budget allows; the
document says which figures were taken beside foreign load.

Usage: .venv/bin/python bench/run_all.py [--budget-s S] [--only fanin,memory] [--no-docs]
       [--only overhead [--piece-args "..."]]  (one piece again, with its own arguments)
       [--only rules]  (`make bench-rules`: the rules campaign alone)
       [--all]         (the performance pieces, then the rules campaign)

By default (`make bench`) it runs the performance pieces: every row but the rules campaign's,
within 20 minutes here. The campaign is its own command (`make bench-rules`) because issue 47's
minimums (12 healthy launches, 5 runs of each of 9 fault kinds, every launch a real cluster with
its ~15 s start) take about 45 minutes on their own on this machine; its rows in the document
are those of its last run, dated.

`--only` runs those pieces and merges them into the last run's record (bench/results/run_all.json):
docs/benchmarks.md is then rewritten with their new figures beside the others' (the date line
names the pieces re-run and when), unless `--no-docs`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import fields

import _common as C
from _run_pieces import (
    FOREIGN_BUSY_CORES,
    PERF_BUDGET_S,
    PERF_NAMES,
    PIECES,
    REFERENCE_CARDS_PER_S,
    RULES_PLANNED_S,
    SLOW_FACTOR,
    Attempt,
    Piece,
)
from _run_report import RELATED, build_report, failed_pieces, load_result
from _run_report import module_of as _module_of
from _run_targets import targets_table

# what other code reads here: the tests read the pieces, the targets table and the section map
__all__ = ["PERF_NAMES", "PIECES", "RELATED", "RESULTS", "_module_of", "build_report", "main", "merged_run",
           "targets_table"]

RESULTS = C.BENCH / "results"
"""Where the pieces' results and the run's record are (read here at each call: a test points it elsewhere)."""
DOC = C.ROOT / "docs" / "benchmarks.md"


def _load(name: str) -> dict | None:
    """A piece's stored result (None where it has none), read from RESULTS as it is now."""
    return load_result(RESULTS, name)


def python_slowdown() -> float:
    """How many times slower than the reference machine this one runs pure Python (from the
    npu_smi piece's result; 1.0 when it is missing)."""
    r = _load("npu_smi")
    try:
        return max(1.0, REFERENCE_CARDS_PER_S / float(r["cards_per_s"]["median"]))
    except (TypeError, KeyError, ValueError, ZeroDivisionError):
        return 1.0


def run_piece(p: Piece, args: list[str], timeout_s: float, load: C.ForeignLoad) -> Attempt:
    out_json = RESULTS / f"{p.name}.attempt.json"
    out_json.unlink(missing_ok=True)
    log = RESULTS / "logs" / f"{p.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(C.BENCH / p.script), *args, "--json", str(out_json)]
    env = dict(os.environ, PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION="python", RAY_USAGE_STATS_ENABLED="0")
    print(f"\n=== {p.name}: {' '.join(shlex.quote(a) for a in cmd[1:])}", flush=True)
    t0 = time.time()
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=C.ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=max(10.0, timeout_s))
        except subprocess.TimeoutExpired:
            import signal

            os.killpg(proc.pid, signal.SIGTERM)  # the piece's own process group only
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc = -9
    t1 = time.time()
    foreign = load.window(t0, t1)
    ok = rc == 0 and out_json.exists()
    print(f"=== {p.name}: rc {rc}, {t1 - t0:.0f}s, foreign load {foreign['mean_cores']:.2f} cores "
          f"(peak {foreign['max_cores']:.2f})" + ("" if ok else f"  FAILED, see {log}"), flush=True)
    return Attempt(args, rc, t1 - t0, foreign, str(log), ok)


def wait_quiet(load: C.ForeignLoad, max_wait_s: float) -> float:
    """Wait (at most `max_wait_s`) until other processes use less than the threshold."""
    return C.wait_quiet(load, max_wait_s, FOREIGN_BUSY_CORES)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-s", type=float, default=None,
                    help="total wall-time budget (default 19 min for the performance pieces, 56 for the rules "
                         "campaign, their sum with --all)")
    ap.add_argument("--only", default="", help="comma-separated pieces (default: every performance piece)")
    ap.add_argument("--all", action="store_true", help="the performance pieces, then the rules campaign")
    ap.add_argument("--no-docs", action="store_true", help="do not rewrite docs/benchmarks.md")
    ap.add_argument("--piece-args", default="",
                    help="with --only and one piece: the arguments it runs with instead of its planned ones")
    ap.add_argument("--docs-only", action="store_true",
                    help="rewrite docs/benchmarks.md from the last run's results (bench/results), running nothing")
    args = ap.parse_args()
    only = args.only or ("" if args.all else ",".join(p.name for p in PIECES if p.name != "rules"))
    pieces = [p for p in PIECES if not only or p.name in only.split(",")]
    if args.budget_s is None:
        args.budget_s = (PERF_BUDGET_S - 60.0 if any(p.name != "rules" for p in pieces) else 0.0) + (
            RULES_PLANNED_S * 1.25 if any(p.name == "rules" for p in pieces) else 0.0)  # room for its full run
    if args.docs_only:
        rewrite_docs(args.budget_s)
        return
    t_start = time.time()
    started = time.strftime("%Y-%m-%d %H:%M %Z")
    RESULTS.mkdir(parents=True, exist_ok=True)
    load = C.ForeignLoad().start()
    machine = C.machine()
    print(f"machine: {machine}", flush=True)

    attempts: dict[str, list[Attempt]] = {}
    waited = 0.0
    slowdown = 1.0
    for i, p in enumerate(pieces):
        rest = pieces[i + 1:]
        if i and pieces[i - 1].name == "npu_smi":
            slowdown = python_slowdown()
            machine["python_slowdown"] = round(slowdown, 2)
            print(f"=== this machine runs Python {slowdown:.1f}x slower than the reference machine"
                  + (": reduced arguments for every piece" if slowdown > SLOW_FACTOR else ""), flush=True)
        slow = slowdown > SLOW_FACTOR
        mult = min(slowdown, 2.0) if slow else 1.0  # time reserved for the pieces to come
        left = args.budget_s - (time.time() - t_start)
        need_full = p.planned_s + sum(x.reduced_s or x.planned_s for x in rest)
        use_reduced = bool(p.reduced_args) and (slow or left < need_full * 1.1)
        piece_args = p.reduced_args if use_reduced else p.args
        if args.piece_args:
            piece_args = shlex.split(args.piece_args)
        planned = (p.reduced_s if use_reduced else p.planned_s) or p.planned_s
        slack = left - planned - sum(x.reduced_s or x.planned_s for x in rest)
        waited += wait_quiet(load, max(0.0, min(45.0, slack * 0.5)))
        left = args.budget_s - (time.time() - t_start)
        reserve = sum(x.reduced_s or x.planned_s for x in rest) * mult
        timeout = max(planned * 1.5 * min(slowdown, 4.0), left - reserve)
        if p.max_s:
            gate_s = max(planned, min(p.max_s, left - reserve - 20))
            piece_args = [*piece_args, "--max-seconds", f"{gate_s:.0f}"]
        (RESULTS / f"{p.name}.json").unlink(missing_ok=True)  # never report a stale result
        att: list[Attempt] = []
        kept: Attempt | None = None
        while True:
            a = run_piece(p, piece_args, timeout, load)
            att.append(a)
            if a.ok and (kept is None or a.foreign["mean_cores"] < kept.foreign["mean_cores"]):
                (RESULTS / f"{p.name}.attempt.json").replace(RESULTS / f"{p.name}.json")
                kept = a
            (RESULTS / f"{p.name}.attempt.json").unlink(missing_ok=True)
            if kept is not None and (p.max_s or kept.foreign["mean_cores"] <= FOREIGN_BUSY_CORES):
                break  # gated pieces dealt with foreign load themselves
            # a failed or disturbed piece runs again while the budget allows it
            left = args.budget_s - (time.time() - t_start)
            if len(att) >= 3 or left - reserve < a.wall_s * 1.2 + 10:
                break
            waited += wait_quiet(load, max(0.0, min(60.0, (left - reserve - a.wall_s * 1.2) * 0.3)))
            if kept is not None and load.current() > FOREIGN_BUSY_CORES:
                print(f"=== {p.name}: other processes are still busy ({load.current():.2f} cores): "
                      "a rerun would not be cleaner, keeping this result", flush=True)
                break
            left = args.budget_s - (time.time() - t_start)
            if left - reserve < a.wall_s * 1.2 + 10:
                break
            reason = "failed" if not a.ok else f"foreign load {a.foreign['mean_cores']:.2f} cores"
            print(f"=== {p.name}: running again ({reason})", flush=True)
            timeout = max(planned * 1.5 * min(slowdown, 4.0), args.budget_s - (time.time() - t_start) - reserve)
        for a in att:
            a.kept = a is kept
        attempts[p.name] = att
    load.stop()
    total_s = time.time() - t_start

    rules_wall = sum(a.wall_s for a in attempts.get("rules", []))
    perf_s = total_s - rules_wall if {p.name for p in pieces} >= PERF_NAMES else None
    # kept with the run: a later `--only` re-run of a failed piece does not make this run's time one
    # in which every piece ran
    perf_failed = failed_pieces(attempts) if perf_s is not None else ()
    report = build_report(pieces, attempts, machine, started, total_s, waited, args.budget_s, perf_s,
                          results=RESULTS, perf_failed=perf_failed)
    print("\n" + report["console"])
    run = {"started": started, "total_s": total_s, "waited_for_quiet_s": waited, "machine": machine,
           "perf_s": perf_s, "perf_failed": list(perf_failed),
           "attempts": {k: [a.__dict__ for a in v] for k, v in attempts.items()}}
    if only and not args.no_docs:
        run = merged_run(run, pieces, started)
    (RESULTS / "run_all.json").write_text(json.dumps(run, indent=1, default=str))
    if not args.no_docs and not only:
        DOC.parent.mkdir(parents=True, exist_ok=True)
        DOC.write_text(report["doc"])
        print(f"\nwrote {DOC.relative_to(C.ROOT)}")
    elif not args.no_docs:  # the pieces re-run, merged into the last full run's document
        rewrite_docs(args.budget_s)
    print(f"total {total_s / 60:.1f} min (budget {args.budget_s / 60:.0f} min)")
    if any(not any(a.ok for a in v) for v in attempts.values()):
        sys.exit(1)


def merged_run(run: dict, pieces: list, started: str) -> dict:
    """A run of some pieces (`--only`) merged into the last run's record (bench/results/run_all.json):
    the pieces re-run replace theirs, the others keep theirs, and the date line says which
    pieces were re-run when (every figure stays the one its own run printed)."""
    path = RESULTS / "run_all.json"
    if not path.exists():
        return run
    old = json.loads(path.read_text())
    names = [p.name for p in pieces]
    attempts = {k: v for k, v in old.get("attempts", {}).items() if k not in names}
    attempts.update(run["attempts"])
    rerun = {"pieces": names, "started": started, "total_s": run["total_s"], "machine": run["machine"]}
    if set(names) >= PERF_NAMES:  # a whole `make bench`: its date, machine and time lead the record
        rules = [r for r in old.get("reruns", []) if "rules" in r["pieces"]][-1:]
        return dict(run, attempts=attempts, perf_s=run["perf_s"],
                    started=started + (f"; rules campaign {rules[0]['started']}" if "rules" not in names and rules
                                       else ""),
                    reruns=[r for r in old.get("reruns", []) if "rules" in r["pieces"] and "rules" not in names][-1:]
                    + ([rerun] if "rules" in names else []))
    first = str(old.get("started", "")).split("; ")[0]
    reruns = [*old.get("reruns", []), rerun]
    latest: dict[str, str] = {}  # each piece's last re-run: every figure's own date stays in the line
    for r in reruns:
        latest.update((n, r["started"]) for n in r["pieces"])
    return dict(old, attempts=attempts, started="; ".join([first, *(f"{n} re-run {t}" for n, t in latest.items())]),
                total_s=float(old.get("total_s", 0.0)), reruns=reruns)


def rewrite_docs(budget_s: float) -> None:
    """docs/benchmarks.md again from the stored results of the last full run (after a change
    to how results are rendered; every figure stays the one that run measured)."""
    run = json.loads((RESULTS / "run_all.json").read_text())
    names = {f.name for f in fields(Attempt)}
    attempts = {}
    for k, v in run["attempts"].items():
        atts = []
        for d in v:
            a = Attempt(**{n: d[n] for n in names if n in d})
            a.kept = d.get("kept", False)
            atts.append(a)
        attempts[k] = atts
    report = build_report(PIECES, attempts, run["machine"], run["started"], run["total_s"],
                          run["waited_for_quiet_s"], budget_s, run.get("perf_s"), results=RESULTS,
                          perf_failed=tuple(run.get("perf_failed", ())))
    DOC.write_text(report["doc"])
    print(f"wrote {DOC.relative_to(C.ROOT)}")


if __name__ == "__main__":
    main()
