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
its ~15 s start) take about 25 minutes on their own on this machine; its rows in the document
are those of its last run, dated.

`--only` runs those pieces and merges them into the last run's record (bench/results/run_all.json):
docs/benchmarks.md is then rewritten with their new figures beside the others' (the date line
names the pieces re-run and when), unless `--no-docs`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field, fields

import _common as C

RESULTS = C.BENCH / "results"
DOC = C.ROOT / "docs" / "benchmarks.md"
INVESTIGATIONS = C.BENCH / "investigations.md"
"""The dated notes measured by hand (docs/architecture.md's choices), copied at the end of the document."""
FOREIGN_BUSY_CORES = C.QUIET_CORES
"""Mean cores used by other processes above which a piece counts as disturbed."""


RULES_PLANNED_S = 1900.0
"""The rules campaign (bench/rules.py): 12 healthy launches and 40 fault launches, each paying
the launch's start-up (about 15 s here) besides its steps."""
PERF_BUDGET_S = 1200.0
"""The performance pieces (all but the rules campaign) fit in 20 minutes on this machine."""


@dataclass
class Piece:
    name: str
    script: str
    args: list[str]
    planned_s: float
    """Expected wall time on the 2-core reference machine (for the budget)."""
    reduced_args: list[str] = field(default_factory=list)
    """Arguments used instead when the budget is short."""
    reduced_s: float = 0.0
    max_s: float = 0.0
    """Gated pieces (repeats beside foreign load are run again inside the piece): the most
    time they may take with such reruns (`--max-seconds`); 0 for the others."""


PIECES = [
    Piece("npu_smi", "npu_smi_parse.py", ["--seconds", "1.0", "--repeats", "5"], 15),
    Piece("grad_cell", "grad_cell.py", ["--steps", "10", "--repeats", "5"], 80,
          ["--steps", "6", "--repeats", "3"], 50, max_s=110),
    Piece("overhead", "overhead.py", [], 430, ["--repeats-small", "5", "--repeats-larger", "2"], 260, max_s=430),
    # replayed senders (bench/_replay.py): 40 s a run, so the 32,768-rank target's row is over ~40 steps
    Piece("fanin", "fanin.py", ["--targets", "--repeats", "2", "--seconds", "40", "--agent-seconds", "20"], 330,
          ["--targets", "--repeats", "1", "--seconds", "30", "--agent-repeats", "2", "--agent-seconds", "15"], 200),
    Piece("exporter", "exporter.py", ["--scrapes", "10", "--sink-steps", "300"], 60,
          ["--scrapes", "5", "--sink-steps", "100"], 30),
    # planned times estimated from a 64-rank smoke run (3 sinks, 36 s), not yet from a timed 4,096-rank one
    Piece("fanin_sinks", "fanin.py", ["--ranks", "4096", "--rate", "2", "--seconds", "15", "--repeats", "1",
                                      "--sink", "none,mlflow,swanlab"], 150,
          ["--ranks", "4096", "--rate", "2", "--seconds", "10", "--repeats", "1", "--sink", "none,mlflow,swanlab"],
          110),
    Piece("memory", "memory.py", ["--steps", "100000", "--tensorboard", "off"], 30),
    Piece("memory_tb", "memory.py", ["--steps", "8000", "--tensorboard", "on"], 45,
          ["--steps", "4000", "--tensorboard", "on"], 25),
    Piece("stop_latency", "stop_latency.py", ["--repeats", "2"], 70, ["--repeats", "1"], 40, max_s=110),
    Piece("startup", "startup.py", ["--repeats", "3"], 120, ["--repeats", "2"], 80, max_s=170),
    # real launches one after another (about 60): planned from a quiet 2-core machine; its own
    # repeats are the campaign's, so it is never run again whole (max_s: no rerun)
    Piece("rules", "rules.py", [], RULES_PLANNED_S, ["--quick"], 420, max_s=RULES_PLANNED_S),
]
PERF_NAMES = {p.name for p in PIECES if p.name != "rules"}
"""`make bench`'s pieces; the rules campaign is `make bench-rules`."""


REFERENCE_CARDS_PER_S = 26607.0
"""`npu_smi_parse.py`'s median rate (all fixtures in turn, pure Python) on the reference
machine the planned times are for (Intel Xeon, 2 cores, 2026-12-04 08:00). The first piece
measures it here: a machine whose Python runs more than `SLOW_FACTOR` times slower takes
every piece's reduced arguments, reserves more time for the pieces to come, and gives each
piece a timeout scaled to its speed (measured on an AMD EPYC VM on 2026-12-04: 4.0x slower,
and two pieces were killed at the reference machine's timeouts)."""
SLOW_FACTOR = 1.5


def python_slowdown() -> float:
    """How many times slower than the reference machine this one runs pure Python (from the
    npu_smi piece's result; 1.0 when it is missing)."""
    r = _load("npu_smi")
    try:
        return max(1.0, REFERENCE_CARDS_PER_S / float(r["cards_per_s"]["median"]))
    except (TypeError, KeyError, ValueError, ZeroDivisionError):
        return 1.0


@dataclass
class Attempt:
    args: list[str]
    rc: int
    wall_s: float
    foreign: dict
    log: str
    ok: bool
    kept: bool = False


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
                    help="total wall-time budget (default 19 min for the performance pieces, 32 for the rules "
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
            RULES_PLANNED_S if any(p.name == "rules" for p in pieces) else 0.0)
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
    report = build_report(pieces, attempts, machine, started, total_s, waited, args.budget_s, perf_s)
    print("\n" + report["console"])
    run = {"started": started, "total_s": total_s, "waited_for_quiet_s": waited, "machine": machine,
           "perf_s": perf_s,
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
    return dict(old, attempts=attempts, started=f"{first}; {', '.join(names)} re-run {started}",
                total_s=float(old.get("total_s", 0.0)), reruns=[*old.get("reruns", []), rerun])


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
                          run["waited_for_quiet_s"], budget_s, run.get("perf_s"))
    DOC.write_text(report["doc"])
    print(f"wrote {DOC.relative_to(C.ROOT)}")


# ---- the report ------------------------------------------------------------------------
def _load(name: str) -> dict | None:
    p = RESULTS / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else None


def _render(module: str, data: dict) -> str:
    return importlib.import_module(module).render(data)  # bench/ is on sys.path (this script's folder)


def targets_table(res: dict, perf_s: float | None, rules_wall_s: float = 0.0) -> tuple[str, list[str]]:
    rows = []
    ov = res.get("overhead")
    if ov:
        for t in ov["targets"]:
            where = "the rank pinned to its own core" if t.get("pinned") else "unpinned"
            if t.get("kind") == "path":
                rows.append([f"{t['path']} path: default monitoring's mean added time <= MindFormers' MFLossMonitor's "
                             f"on the same cell ({t['model']} model, {t['bare_step_s'] * 1000:.0f} ms bare step, "
                             f"{where})",
                             f"{t['mp_added_ms']:+.2f} ms against {t['mf_added_ms']:+.2f} ms a step (n={t['repeats']}; "
                             f"worst repeat of the difference {t['worst_over_ms']:+.2f} ms)",
                             "met" if t["met"] else "missed",
                             f"{abs(t['mp_added_ms'] - t['mf_added_ms']):.2f} ms " + ("under" if t["met"] else "over")
                             + ("" if t["met"] else "; where the rank's time goes: the per-part table under "
                                "'In-rank overhead'")
                             + (f"; {t['disturbed_kept']} repeats kept from a loaded machine"
                                if t.get("disturbed_kept") else "")])
                continue
            if t.get("kind") == "first_step":
                rows.append([f"the MindFormers path's first step adds <= {t['limit_ms']:.0f} ms to MFLossMonitor's on "
                             f"the same cell ({t['model']} model, {where}; graphs compiled)",
                             f"{t['added_ms']:+.1f} ms (mean of {t['runs']} runs)", "met" if t["met"] else "missed",
                             f"{abs(t['limit_ms'] - t['added_ms']):.1f} ms " + ("under" if t["met"] else "over")])
                continue
            if t.get("kind") == "callback_cpu":
                rows.append([f"the callback's own CPU <= {t['limit_ms']:.1f} ms a step (training thread, every step "
                             f"counted, collect steps included; {t['model']} model, recipe path)",
                             f"{t['cpu_ms']:.3f} ms; rank 0's verdict wait {t['verdict_wait_ms']:.3f} ms a step",
                             "met" if t["met"] else "missed",
                             f"{abs(t['limit_ms'] - t['cpu_ms']):.3f} ms " + ("under" if t["met"] else "over")
                             + ("" if t["met"] else "; by part: the per-part table under 'In-rank overhead'")])
                continue
            if t.get("kind") == "over_mf":
                rows.append([f"default monitoring adds at most MindFormers' MFLossMonitor's added time + "
                             f"{t['limit_ms']:.1f} ms to a step, every repeat ({t['model']} model, "
                             f"{t['none_step_s'] * 1000:.0f} ms step, {where})",
                             f"worst of {t['repeats']}: {t['worst_ms']:+.2f} ms (mean {t['mean_ms']:+.2f} ms)",
                             "met" if t["met"] else "missed",
                             f"{abs(t['limit_ms'] - t['worst_ms']):.2f} ms " + ("under" if t["met"] else "over")
                             + ("" if t["met"] else "; where the rank's time goes: the per-part table under "
                                "'In-rank overhead'")])
                continue
            beside = (f"; unpinned beside it: worst {t['unpinned_worst']:.3f}x (mean {t['unpinned_mean']:.3f}x)"
                      if t.get("unpinned_worst") is not None else "")
            rows.append([f"default monitoring (monitored cell + Monitor + relay + aggregator) <= {t['limit']:.2f}x a bare "
                         f"TrainOneStepCell, mean step over all steps, worst repeat ({t['model']} model, "
                         f"{t['none_step_s'] * 1000:.0f} ms step, {where})",
                         f"worst of {t['repeats']}: {t['worst_ratio']:.3f}x (mean {t['mean_ratio']:.3f}x)"
                         + (f"; noise floor: LossMonitor's worst repeat {t['noise_floor_worst']:.3f}x"
                            if t.get("noise_floor_worst") is not None else "") + beside,
                         "met" if t["met"] else "missed",
                         f"{t['limit'] - t['worst_ratio']:.3f} under the limit" if t["met"] else
                         f"{t['worst_ratio'] - t['limit']:.3f} over the limit; where the rank's time goes: the "
                         "per-part table under 'In-rank overhead'"])
    fi = res.get("fanin")
    if fi:
        from fanin import TARGETS, judge, p99_label, simulated

        for j in fi["targets"]:
            now = next((t for t in TARGETS if (t["ranks"], t["rate"]) == (j["target"]["ranks"], j["target"]["rate"])),
                       None)
            if now is not None and now != j["target"]:
                j = judge(now, j["runs"])  # the stored runs judged against the target as it stands now
            t, w = j["target"], j["worst"]
            limits = fanin_limits(t)
            r0 = j["runs"][0]
            got = (f"worst of {len(j['runs'])}: {w['achieved_steps_per_s']:.3f} steps/s, reduce "
                   f"{w['reduce_p99_ms']:.0f} ms ({p99_label(w.get('reduce_n'))}), aggregator {w['aggregator_cpu_frac'] * 100:.0f}% of a core, "
                   f"rank wait p99 {w['rank_wait_p99_ms']:.1f} ms")
            if "end_to_end_p99_ms" in r0:  # what the ranks see, the members' hop and the simulation's own work included
                runs = j["runs"]
                e2e = max(r["end_to_end_p99_ms"] or math.inf for r in runs)
                got += (f"; end to end (every node's batch handed over to every node holding the lease) "
                        f"{e2e:.0f} ms ({p99_label(min(r['end_to_end_n'] for r in runs))}); ")
                if any(r.get("decisions") for r in runs):
                    after = max(max(r.get("directive_after_lease_ms") or [0]) for r in runs)
                    got += (f"rank 0's directive wait at {C.plural(sum(r['decisions'] for r in runs), 'candidate')} up to "
                            f"{max(r['decision_wait_max_ms'] or 0 for r in runs):.0f} ms"
                            + (f" ({after:.0f} ms of it after the step's lease reached node 0); " if after else "; "))
                else:
                    got += "no checkpoint candidate reached; "
                got += (f"the sender processes up to {max(max(r['sender_cpu_frac']) for r in runs) * 100:.0f}% "
                        "of a core each")
            missed = [k for k, ok in j["checks"].items() if not ok]
            scraped = (f", Prometheus endpoint scraped every {w['scrape_every_s']:g} s (worst scrape "
                       f"{w['scrape_max_ms']:.0f} ms)" if w.get("scrape_max_ms") is not None else "")
            what = (f"; {simulated(r0)}" if "heartbeat_s" in r0
                    else "; no card telemetry or heartbeats in this simulation")
            rows.append([f"{t['ranks']:,} ranks at {t['rate']:g} steps/s, TensorBoard on{scraped}: "
                         + ", ".join(limits) + what, got,
                         "met" if j["met"] else "missed", "all limits held" if not missed else
                         "missed: " + ", ".join(missed) + ("; where the aggregator's time goes: the investigations below, "
                                                          "'Where the aggregator's time goes at 32,768 ranks'"
                                                          if t["ranks"] >= 32768 else "")])
        if fi.get("agent_a3"):
            rows.append(agent_row(fi))
        elif fi.get("agent"):  # results stored before the A3-shaped target
            agent = max(r["cpu_ms_per_step"] for r in fi["agent"])
            traffic = max(r["cpu_ms_per_step"] - r["idle_cpu_ms_per_step"] for r in fi["agent"])
            rows.append(["node agent <= 1 ms of CPU per step for 8 ranks (the whole process, as launched)",
                         f"worst of {len(fi['agent'])}: {agent:.3f} ms (above the same process idle: at most "
                         f"{traffic:.3f} ms)",
                         "met" if agent <= 1.0 else "missed", f"{abs(1.0 - agent):.3f} ms "
                         + ("under" if agent <= 1.0 else "over")])
    ex = res.get("exporter")
    if ex:
        big = max(ex["scrape"], key=lambda s: s["ranks"])
        rows.append([f"a scrape of the Prometheus endpoint answers in < {ex['target_ms']:.0f} ms at {big['ranks']:,} "
                     f"ranks (every node's card telemetry in, {big['cards']:,} cards; the aggregator's own code, "
                     "scraped over loopback)",
                     f"worst of {big['scrapes']}: {big['scrape_max_ms']:.1f} ms ({big['series']:,} series)",
                     "met" if big["met"] else "missed",
                     f"{abs(ex['target_ms'] - big['scrape_max_ms']):.1f} ms "
                     + ("under the limit" if big["met"] else "over the limit")])
    if res.get("fanin_sinks"):
        rows += sink_rows(res["fanin_sinks"])
    mem = res.get("memory")
    if mem:
        g = mem["growth_second_half_mb"]
        rows.append([f"aggregator memory bounded over {mem['steps']:,} steps ({mem['world']} ranks): growth over "
                     "the second half < 5 MiB", f"{g:+.1f} MiB ({mem['growth_total_mb']:+.1f} MiB in all)",
                     "met" if g < 5 else "missed", f"{5 - g:.1f} MiB under the limit" if g < 5 else
                     f"{g - 5:.1f} MiB over the limit"])
    if res.get("rules"):
        from rules import target_rows

        rows += target_rows(res["rules"])
    rules_s = f"; its last run took {rules_wall_s / 60:.1f} min" if rules_wall_s else ""
    what = ("`make bench` under 20 minutes on this machine, every performance piece run (the rules campaign's "
            f"real launches are `make bench-rules`{rules_s})")
    if perf_s is None:
        rows.append([what, "no run of every performance piece recorded", "missed", "-"])
    else:
        rows.append([what, f"{perf_s / 60:.1f} min", "met" if perf_s < PERF_BUDGET_S else "missed",
                     f"{abs(PERF_BUDGET_S - perf_s) / 60:.1f} min " + ("to spare" if perf_s < PERF_BUDGET_S else "over")])
    return C.table(["target", "measured", "result", "by how much"], rows), [r[2] for r in rows]


def fanin_limits(t: dict) -> list[str]:
    """A fan-in target's limits in words."""
    limits = [f"achieved >= {t['achieved']}", f"reduce p99 < {t['p99_ms']:.0f} ms"]
    if t["cpu"] is not None:
        limits.append(f"aggregator <= {t['cpu'] * 100:.0f}% of a core")
    if t["wait_ms"] is not None:
        limits.append(f"rank wait p99 {t['wait_ms']:.0f} ms")
    return limits


def sink_rows(fs: dict) -> list[list[str]]:
    """The fan-in with each tracker sink (`fanin.py --sink none,mlflow,swanlab`): one row a sink,
    the aggregator's CPU per reduced step; the row without a tracker is judged against the fan-in
    target of its ranks and rate, the trackers' rows are costs set beside its limits,
    saying what was simulated and what the simulation leaves out."""
    from fanin import p99_label, simulated, tracker_failures

    t = fs.get("target")
    ok = {s: [r for r in runs if "skipped" not in r] for s, runs in fs["sink_runs"].items()}
    base = max((r["aggregator_cpu_ms_per_step"] for r in ok.get("none", [])), default=None)
    rows = []
    for sink, runs in fs["sink_runs"].items():
        if not ok[sink]:
            rows.append([f"fan-in with tracker sink {sink}", runs[0].get("skipped", "no run"), "not measured", "-"])
            continue
        r0, n = ok[sink][0], len(ok[sink])
        cpu_ms = max(r["aggregator_cpu_ms_per_step"] for r in ok[sink])
        what = (f"{r0['ranks']:,} ranks at {r0['asked_steps_per_s']:g} steps/s, TensorBoard "
                f"{'on' if r0['tensorboard'] else 'off'}, Prometheus endpoint scraped every {r0['scrape_every_s']:g} s, "
                f"tracker sink {sink}: the aggregator's CPU per reduced step (its whole process)"
                + (f", within the {t['ranks']:,}-rank fan-in target's limits: " + ", ".join(fanin_limits(t)) if t
                   else "") + f"; {simulated(r0)}")
        got = (f"worst of {n}: {cpu_ms:.2f} ms of CPU per reduced step"
               + (f" ({cpu_ms - base:+.2f} ms over none)" if base is not None and sink != "none" else "")
               + f", {max(r['aggregator_cpu_frac'] for r in ok[sink]) * 100:.0f}% of a core; "
               f"{min(r['achieved_steps_per_s'] for r in ok[sink]):.3f} steps/s, reduce "
               f"{max(r['reduce_p99_ms'] or math.inf for r in ok[sink]):.0f} ms "
               f"({p99_label(min(r.get('reduce_n') or 0 for r in ok[sink]))}), rank wait p99 "
               f"{max(r['rank_wait_p99_ms'] or 0.0 for r in ok[sink]):.1f} ms")
        failed = [x for r in ok[sink] for x in tracker_failures(r)]
        if failed:
            got += f"; the tracker failed: {failed[0]}"
        j = (fs.get("judged") or {}).get(sink)
        if j is None:
            rows.append([what, got, "measured", "no target of this size and rate"])
            continue
        missed = [k for k, v in j["checks"].items() if not v]
        if sink != "none":  # a cost row: the 4,096-rank target is judged with TensorBoard and the endpoint
            rows.append([what, got, "missed" if failed else "measured", "no target for a tracker; " + (
                "within the fan-in target's limits" if not missed and not failed else
                "beyond the fan-in target's limits: " + ", ".join(missed + (["the tracker failed"] if failed else [])))
                + " (the tracker's own writes run in the aggregator's process: MLflow's file store writes a file "
                "a series, SwanLab offline its own log)"])
            continue
        rows.append([what, got, "met" if j["met"] and not failed else "missed",
                     "all limits held" if not missed and not failed else
                     "missed: " + ", ".join(missed + (["the tracker failed"] if failed else []))])
    return rows


def agent_row(fi: dict) -> list[str]:
    """The node agent's target row: an Atlas A3-shaped node, with the 8-rank figure as context."""
    t = fi["agent_target"]
    runs = fi["agent_a3"]
    a = runs[0]
    worst = max(r["cpu_frac"] for r in runs)
    ok = worst <= t["cpu_frac"]
    eight = fi.get("agent_8") or []
    context = (f"; 8 ranks at {eight[0]['rate']:g} steps/s (the earlier target, 1 ms a step): "
               f"{max(r['cpu_ms_per_step'] for r in eight):.3f} ms a step, {max(r['cpu_frac'] for r in eight) * 100:.2f}% "
               "of a core" if eight else "")
    return [f"node agent <= {t['cpu_frac'] * 100:.0f}% of one core for {t['ranks']} ranks on one node (an Atlas A3 "
            f"node has 16 chips) at {t['rate']:g} steps/s, whole process, with telemetry on ({a['cards']} cards every "
            f"{a['telemetry_interval_s']:g} s through the npu-smi sampler on recorded output; heartbeats every "
            f"{a['heartbeat_s']:g} s; rank 0 decides at checkpoint candidates; the ranks' frames of a step within "
            f"{a['spread_ms']:g} ms)",
            f"worst of {len(runs)}: {worst * 100:.2f}% of a core ({max(r['cpu_ms_per_step'] for r in runs):.3f} ms "
            f"a step; ranks between steps: {max(r['idle_cpu_frac'] for r in runs) * 100:.2f}%; the fake npu-smi's "
            f"own processes {max(r['npu_smi_children_cpu_frac'] for r in runs) * 100:.2f}%, not counted){context}",
            "met" if ok else "missed",
            f"{abs(t['cpu_frac'] - worst) * 100:.2f} points " + ("under" if ok else "over")]


SECTIONS = [
    ("overhead", "overhead", "In-rank overhead of monitoring callbacks", "overhead.py"),
    ("grad_cell", "grad_cell", "The grad-statistics cell against a plain TrainOneStepCell", "grad_cell.py"),
    ("fanin", "fanin", "Aggregator fan-in with simulated ranks", "fanin.py"),
    ("exporter", "exporter", "Dashboards and trackers: the Prometheus scrape, and each sink's CPU", "exporter.py"),
    ("memory", "memory", "Aggregator memory over 100,000 steps", "memory.py"),
    ("stop_latency", "stop_latency", "Stop latency: injected NaN to every rank stopped", "stop_latency.py"),
    ("startup", "startup", "Start-up: `mindpulse launch` against bare `msrun`", "startup.py"),
    ("npu_smi", "npu_smi_parse", "`npu-smi` parsing speed", "npu_smi_parse.py"),
    ("rules", "rules", "Rules: false alarms on healthy runs, and every injected fault caught", "rules.py"),
]

RELATED = {"memory": ("memory_tb",), "exporter": ("fanin_sinks",)}
"""Pieces shown in another piece's section, after it (each rendered by its own script's module)."""
RELATED_TITLES = {"memory_tb": " (TensorBoard on)", "fanin_sinks": " (the fan-in with each tracker sink)"}


def _module_of(piece: str) -> str:
    return next(p.script for p in PIECES if p.name == piece).removesuffix(".py")


NOTES = {
    "exporter": (
        "A real `AggregatorCore` (the aggregator's code, in this process) with `exporters.prometheus.port` on, fed "
        "what a job of that size sends: every node's card telemetry (8 cards a node) and a few steps of node partials, "
        "then scraped over loopback with plain HTTP (Prometheus asks for gzip, which prometheus_client then spends "
        "more CPU on). Beyond 256 ranks the endpoint names only the cards and ranks that matter (docs/dashboards.md). "
        "The sink rows feed 8 ranks' packets through the flat path; MLflow logs to a file store from its own writer "
        "thread (its CPU is not in the row: the row is what the aggregator's thread, which reduces and decides, "
        "pays), SwanLab offline; the Prometheus row includes a scrape every 15 s (served on the endpoint's thread). "
        "Both take the settings a launch passes (the default config with `--set` changes). Then the fan-in simulation "
        "(`bench/fanin.py --sink none,mlflow,swanlab`, as its section says: TensorBoard on, the endpoint scraped every "
        "15 s) at 4,096 ranks once with each tracker sink in turn: the aggregator process's CPU per reduced step, "
        "everything it did over the timed steps counted (heartbeats, telemetry, the driver's polls, the scrapes, the "
        "tracker's own threads)."),
    "overhead": (
        "One process, GRAPH mode, `Model.train(..., dataset_sink_mode=False)`; one model, its weights, optimizer (a "
        "Tensor of learning rates, as the recipe's) and fixed random byte tokens shared by every configuration. "
        "*Where it runs*: the targets are judged with the rank pinned to its own core (every thread of the rank's "
        "process on core 0; Ray's processes, the node agent, the aggregator and this benchmark's load sampler on "
        "the other cores), as on an Ascend server where msrun `--bind_core` gives each rank its own cores; the "
        "baseline, mindpulse's default and the two loss monitors run again unpinned (every process on every "
        "core, a one-machine launch on this 2-core machine), with half the repeats, shown beside. SummaryCollector "
        "is timed unpinned only: pinned, its writer process (the rank's own child, so on the rank's core) made a "
        "step ~9x the bare one in a trial run, too slow to time within the budget for a figure no target reads. "
        "*Baseline*: a bare `nn.TrainOneStepCell`, no callback. *mindpulse default*: the path a launch runs, with the "
        "default config: the recipe's `MonitoredTrainOneStepCell`, the `Monitor` callback over a `RankSession` whose "
        "`RankSettings` come from the launcher's own `rank_settings` (collect_freq 10, max_lag_steps 1, weight "
        "statistics on, best checkpoint judged every 10 steps: rank 0 copies the candidate's weights to host buffers, asks "
        "for the verdict and trains on, reading it once it came; the recipe's "
        "tokens per step and FLOPs per token, so the per-step TFLOPS work is measured), its `RelayChannel` "
        "to a real node agent started by the launcher's `NodeAgents` (relay and node pre-reduction; card telemetry "
        "on), streaming over its node uplink to the aggregator actor as `start_aggregator` starts it with the settings a launch passes "
        "(TensorBoard on), in a local Ray cluster; heartbeat on. The save the aggregator asks for is not written "
        "(writing checkpoints is not monitoring). Unlike a launch: one rank on one node, GRAPH mode (the shipped "
        "config trains in PYNATIVE), the rank is the benchmark's own process, no driver loop polls the aggregator, "
        "and every timed run starts a new `Monitor` whose steps continue the count (its start is not timed). Each "
        "target is stated for a bare step of a given length (~13 ms, ~200 ms): where the model's default batch (8) "
        "gives a bare step more than 1.2x longer on the machine at hand, the batch is halved until the step is "
        "closest to that length (the batches tried and their steps are printed with each model). "
        "*Three paths* (issue 49), each against MindFormers' `MFLossMonitor` on the same cell: the recipe's (above; "
        "its monitored cell has no MFLossMonitor twin, so MFLossMonitor runs on the plain cell and the monitored "
        "cell's own cost counts in mindpulse's figure); an unmodified `Model.train` script as auto-attach leaves it "
        "(a plain `nn.TrainOneStepCell` with the gradient statistics around its reducer, and the `Monitor` "
        "auto-attach adds, finding the train cell, batch and tokens in `Model.train`); and the MindFormers path "
        "(MindFormers' `MFTrainOneStepCell` as the shipped YAML's runner_wrapper builds it, scale 1 and clipping to "
        "norm 1, with `MindPulseMonitor` as a MindFormers launch adds it, against the same cell bare and with "
        "MFLossMonitor). A path's target: its mean added time over the bare cell at most MFLossMonitor's, with the "
        "worst repeat of the difference beside it. The MindFormers path's first step: from each run's start "
        "(every callback's `on_train_begin`, the Monitor's start included) to its second step's start, against "
        "MFLossMonitor's, graphs already compiled (the first run of each configuration left out). "
        "The other callbacks run on the plain cell; `LossMonitor` and "
        "`MFLossMonitor` print every step (to a log file); SummaryCollector at collect_freq 1 and 10 (like for like "
        "with mindpulse's collect_freq). A timing callback placed first stamps the start of every step, so a step's "
        "time holds the step and every callback's work for it; a repeat runs every configuration in rounds (4 for "
        "the small model, 2 for the larger), each round every configuration once, the baseline next to mindpulse's, "
        "the order reversing from round to round; each run drops its first 3 steps and times the next 10 (every run "
        "holds the same share of collect and decision steps). Per "
        "configuration: the mean step over all timed steps (collect steps included), its range over repeats (of the "
        "per-repeat means), the median step, and the ratio to the baseline within each repeat (mean and worst "
        "repeat; a target is met only when its worst repeat meets it); the CPU time per step of the rank, the "
        "aggregator and the node agent processes. The MFLossMonitor target compares, repeat by repeat, what each "
        "adds to the same bare step. After the timed repeats one more run of the default path clocks its parts: "
        "each function of a part is wrapped to add up the training thread's CPU clock (`time.thread_time`; a "
        "wrapper costs well under a microsecond, unlike a profiler, which inflated these parts several times "
        "over). MindFormers' context is "
        "created (and GRAPH mode set again) before anything is timed; every run checks that the mode stayed GRAPH."),
    "grad_cell": (
        "Same model, batch and optimizer; the two cells alternate step by step; a step is timed until its outputs "
        "are on the host (loss, and the statistics vector for the monitored cell). The in-rank overhead above runs "
        "the default path on this monitored cell (its row 'of which: MonitoredTrainOneStepCell alone' is the cell without "
        "the callback) and every "
        "other callback on the plain cell."),
    "fanin": (
        "`bench/fanin.py --ranks N --ranks-per-node 8 --rate R --seconds S --json`. The real `AggregatorActor` "
        "(the options `start_aggregator` uses, the settings a launch passes with the default config: TensorBoard on, "
        "default rules, `monitor.max_lag_steps` 1, the console table every `monitor.per_print_step` steps), its "
        "Prometheus endpoint scraped every 15 s, and a driver thread doing what the launcher's supervisor does (poll "
        "every 0.5 s: the console, tables included, and the progress; the hang check every 2 s). Every node sends "
        "what its agent sends (bench/_node_sim.py): its ranks' real `StepPacket`s of every step (values by rank and "
        "step, fingerprints every collect step, rank 0's weight statistics) through the real `NodePreReducer` with "
        "the launcher's `NodeSettings` (this node-side work is done before the timed run, as each node does its own "
        "on a cluster), every rank's `Heartbeat` packet every `monitor.heartbeat_s` (5 s), its card telemetry (8 "
        "cards, the records `NodeSampler` makes) every `monitor.telemetry_interval_s` (5 s), phases spread evenly; "
        "at each checkpoint candidate node 0 sends its batch with a decide and rank 0 waits for the directive before "
        "the next step. Groups of 64 nodes. By default (`--senders replay`, the target rows) the senders replay "
        "pre-encoded frames (bench/_replay.py): each group leader's frame of a step is built before the run by the "
        "real `NodePreReducer` and `GroupLeader` (the merged partial, the group's step packets as one bytes, each "
        "node's heartbeats as one record), a cycle of 10 steps replayed with the step written in, over one real "
        "`Uplink` per leader to the aggregator's uplink server (acknowledged, the lease pushed down; node 0's leader "
        "asks the decision at candidates): the live senders took ~55% of a core each at 32,768 ranks beside the "
        "aggregator on this 2-core machine. With `--senders live` (bench/_node_sim.py) each leader is the real node "
        "agent's code at run time (`NodeAgent.lead`: the `GroupLeader`, the `UplinkServer` for its members, its "
        "`Uplink` up, the lease pushed on to its members); in 2 groups the members stream to their leader over uplinks "
        "of their own, in the others they hand their batches to the leader in-process. Two Ray actors hold the "
        "senders. A step runs one period from its start and sends at its end; it "
        "starts once every node holds the lease of the step before last (and after a candidate, once rank 0 has its "
        "directive), so a slow aggregator shows as a lower achieved rate and as rank wait (how long after a step's "
        "end the last node had the lease it needs: 0 when every node had it before). *Reduce latency* (the "
        "target's): a step's last group partial leaving its leader to every leader holding the lease that says it is "
        "reduced; *end to end*: every node's batch handed over to every leader and streaming member holding that "
        "lease; *aggregator CPU*: its process over the timed steps. Senders and aggregator share this machine's 2 "
        "cores (the senders' CPU is in the table). A target is met only when its worst repeat meets it; the repeats "
        "alternate the two targets. Then the node agent's whole process (bench/_agent_node.py): the launcher's "
        "`NodeAgents` start the real `NodeAgent` for one node with `world.device: ascend`; its ranks are "
        "`RelayChannel`s in this process sending full step packets, rank 0's decide at candidates, and each rank's "
        "`Heartbeat`; with no Ascend driver here its telemetry is the npu-smi sampler running a script that prints "
        "recorded `npu-smi` output (the Atlas 800T A2 capture of tests/fixtures/npu-smi for 8 cards; an A3 table, two "
        "chips an NPU with physical ids, for 16); the rank processes it reads are stand-ins."),
    "memory": (
        "`AggregatorCore` (what the actor wraps) driven in one process with real packets in node batches of 8, a "
        "decision packet per rank and step, a fingerprint every 10 steps, the console drained every 1,000 steps "
        "(the launcher polls it every second). RSS of the process sampled along the run. 100,000 steps with "
        "TensorBoard off (the aggregator's own state: reducer, directives, histories, metrics writer), and a "
        "shorter run with TensorBoard on for the event writer (its steps/s below: 100,000 steps with it would not "
        "fit the time budget). `metrics.msgpack` and the event files grow on disk by design."),
    "stop_latency": (
        "A real 2-rank CPU run of the default job (`mindpulse launch --set train.steps=40 --inject nan_grad@1:5`): "
        "rank 1's gradients become NaN at step 5. From `metrics.msgpack` and `summary.json`: the step after which "
        "every rank stopped minus 5, and the seconds from the NaN step's packet (`ts`) to the last rank's `end` "
        "event, to the last rank process (`ray::RankActor`, polled every 50 ms) gone, and to the launcher's exit "
        "(every process stopped, summary written; the HTML report is turned off: `output.report=false`)."),
    "startup": (
        "The same 2-rank data-parallel script (`bench/scripts/first_step.py`: the regression of "
        "`tests/integration/scripts/user_train.py`, monitored with one line) run by `mindpulse launch --set "
        "job.script=...` and by bare `msrun --worker_num=2 --local_worker_num=2 --join=True` (PATH starts with the "
        "virtualenv's bin), alternating. The script prints the wall clock at the end of step 1 on each rank; the "
        "job's first step is the later rank's."),
    "rules": (
        "Real launches through the CLI (`mindpulse launch CONFIG --set train.steps=N`, the HTML report off, the "
        "console table every 1,000 steps), one after another, each holding the machine's launch lock. *Healthy "
        "corpus*: no fault; the recipe (cluster_configs/local_cpu.yaml, 2 ranks, PYNATIVE), an unmodified "
        "`Model.train` script (tests/integration/scripts/plain_train.py: GRAPH mode, dataset sink, its own "
        "LossMonitor, TimeMonitor and ModelCheckpoint, launched as `job.script`), the MindFormers YAML "
        "(cluster_configs/mindformers_finetune.yaml) and the recipe on 8 ranks, 3 repeats each, interleaved. Every "
        "record of a run's `anomalies.jsonl` is a false alarm; rank-steps and steps are counted from its "
        "`metrics.msgpack` (step 0, the weights before any update, is no step). *Fault campaign*: the recipe, one "
        "fault a run (`--inject KIND@RANK:STEP`), its rank and step drawn at random (seeded, recorded in "
        "bench/results/rules.json); a fault judged by a baseline rule comes after that rule's warm-up, window and "
        "consecutive steps as the config sets them, plus two. The run's `anomalies.jsonl` is read every 0.1 s "
        "while it runs and each firing stamped when first seen; the fault acted when its rank finished the step "
        "before (that packet's `ts`), so the seconds include the step's own time, the reduction and the file's "
        "write. Hang and crash are decided by the launcher (its hang clocks, the failed rank): timed to its "
        "console line (`HANG: ...`, `rank R failed`), the rank from summary.json's `failure.root_cause_rank`. A "
        "throttled card (`throttle`: 2 s inside the rank's forward pass each step) is judged twice from the same "
        "runs: as a slow rank by `straggler`, as a compute drop by `compute_drop`. The card over temperature runs "
        "in this process (bench/_card_faults.py: the real npu-smi sampler on recorded output, the aggregator's "
        "code with the default rules; 5 runs side by side), timed from the switch of the recorded output. A card's "
        "fault code (npu-smi's health) is not in the campaign: no rule reads a card's health (the console's card "
        "table shows it), and the sampler reads it at discovery, every 300 s."),
    "npu_smi": (
        "`parse_npu_smi` on every fixture of `tests/fixtures/npu-smi/` (real captures of `npu-smi info` tables and "
        "`-t` listings); all fixtures parsed in turn for 1 s, 5 repeats (median and range), and each fixture "
        "alone."),
}


def build_report(pieces, attempts, machine, started, total_s, waited, budget_s, perf_s=None) -> dict:
    res = {p.name: _load(p.name) for p in pieces}
    m = machine
    rules_att = [a for a in attempts.get("rules", []) if a.kept]
    tt, verdicts = targets_table(res, perf_s, rules_att[0].wall_s if rules_att else 0.0)
    lines_console = [tt]
    doc = [
        "# Benchmarks",
        "",
        "Written by `make bench` (`bench/run_all.py`); every figure below is the one that run printed. "
        "Each benchmark can also be run alone: `.venv/bin/python bench/<name>.py` (see its docstring). "
        "Benchmarks are never timed assertions in tests.",
        "",
        "| | |",
        "| --- | --- |",
        f"| machine | {m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB RAM"
        + (f"; pure Python {m['python_slowdown']:.1f}x slower than the reference machine the planned times are "
           "for (npu_smi parse rate)" + ("; every piece ran its reduced arguments" if m['python_slowdown'] > SLOW_FACTOR
                                         else "") if m.get("python_slowdown") else "") + " |",
        f"| OS | {m['os']} |",
        f"| software | Python {m['python']}, MindSpore {m['mindspore']} (CPU), MindFormers {m['mindformers']}, "
        f"Ray {m['ray']}, msgpack {m['msgpack']} |",
        f"| date | {started} |",
        "| command | `make bench` (= `.venv/bin/python bench/run_all.py`: the performance pieces); the rules "
        "campaign's rows: `make bench-rules` (= `bench/run_all.py --only rules`) |",
        f"| total run time | {total_s / 60:.1f} min (budget {budget_s / 60:.0f} min; "
        f"{waited:.0f} s of it waiting for other processes to go quiet) |",
        "",
        "## Targets",
        "",
        tt,
        "",
        "## Interference",
        "",
        interference_text(attempts),
        "",
    ]
    for name, module, title, script in SECTIONS:
        related = [name, *RELATED.get(name, ())]
        if not any(res.get(n) for n in related if n in res):
            if name in res:
                doc += [f"## {title}", "", f"Not measured in this run ({name} failed or did not fit the budget).", ""]
            continue
        doc += [f"## {title}", "", f"`bench/{script}`. {NOTES[name]}", ""]
        for n in related:
            data = res.get(n)
            if not data:
                continue
            text = _render(module if n == name else _module_of(n), data)
            att = attempts.get(n) or []
            w = next((a for a in att if a.kept), att[-1] if att else None)
            if w is None:  # results run piece by piece outside this run (their parts say when)
                doc += [f"Finished {data['date']} after {data['wall_s']:.0f} s (run alone, not by this "
                        "`make bench`).", "", text, ""]
            else:
                doc += [f"Finished {data['date']} after {data['wall_s']:.0f} s; other processes used "
                        f"{w.foreign['mean_cores']:.2f} cores on average over the whole piece"
                        + (" (discarded repeats included)." if any(p.max_s for p in PIECES if p.name == n) else ".")
                        + (f" Arguments: `{' '.join(w.args)}`." if w.args else ""), "", text, ""]
            lines_console += [f"\n## {title}" + RELATED_TITLES.get(n, ""), text]
    doc += [INVESTIGATIONS.read_text().strip(), ""]
    squeeze = lambda text: re.sub(r"\n{3,}", "\n\n", text)  # noqa: E731
    return {"doc": squeeze("\n".join(doc)).rstrip() + "\n", "console": squeeze("\n".join(lines_console))}


def _gating(name: str, data: dict | None) -> str:
    """What a gated piece says about the repeats it discarded or kept beside foreign load."""
    if not data:
        return "-"
    if name == "overhead":
        parts = [f"{m}: {r.get('discarded', 0)} discarded, {r.get('disturbed_kept', 0)} kept disturbed"
                 for m, r in data["results"].items()]
    elif name == "grad_cell":
        parts = [f"{c['mode']}:{c['model']}: {c.get('discarded', 0)} discarded, {c.get('disturbed_kept', 0)} kept "
                 "disturbed" for c in data["cases"]]
    elif name == "fanin":
        parts = [f"{data.get('rerun', 0)} configurations run again, {data.get('disturbed', 0)} kept disturbed"]
    elif "discarded" in data:
        parts = [f"{data.get('discarded', 0)} discarded, {data.get('disturbed_kept', 0)} kept disturbed"]
    else:
        return "-"
    return "; ".join(parts)


def interference_text(attempts: dict[str, list[Attempt]]) -> str:
    lines = [
        "The machine may be shared. A thread sampled the CPU used by processes outside this run (every 2 s here, "
        f"every 1 s inside the pieces). A repeat counts as disturbed when other processes used more than "
        f"{FOREIGN_BUSY_CORES} cores on average while it ran. The pieces with repeats (in-rank overhead, grad cell, "
        "fan-in, stop latency, start-up) wait for the machine to go quiet before each repeat and run a disturbed "
        "repeat again while their time allows, so their figures come from quiet repeats unless the table says some "
        "were kept disturbed; the others run again whole when disturbed (the run with less foreign load is kept).",
        ""]
    rows = []
    for name, att in attempts.items():
        for i, a in enumerate(att, 1):
            rows.append([name, i, ("ok, kept" if a.kept else "ok") if a.ok else f"failed (rc {a.rc})", f"{a.wall_s:.0f}",
                         f"{a.foreign['mean_cores']:.2f}", f"{a.foreign['max_cores']:.2f}",
                         _gating(name, _load(name)) if a.kept else "-",
                         "; ".join(a.foreign["top"])[:100] or "-"])
    lines.append(C.table(["piece", "attempt", "result", "seconds", "foreign cores (mean over the piece)",
                          "foreign cores (peak)", "disturbed repeats", "busiest foreign processes"], rows))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
