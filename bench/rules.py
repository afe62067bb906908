"""Rules: false alarms on healthy runs, and how fast every injected fault is caught.

*Healthy corpus*: real launches (`mindpulse launch CONFIG --set train.steps=N`), no fault,
each workload repeated: the recipe (cluster_configs/local_cpu.yaml), an unmodified
`Model.train` script (tests/integration/scripts/plain_train.py, GRAPH mode, `job.script`), the
MindFormers YAML (cluster_configs/mindformers_finetune.yaml) and the recipe on 8 ranks. Every
anomaly a run records (`anomalies.jsonl`) is a false alarm: counted per rule, per 1,000
rank-steps and per 1,000 steps.

*Fault campaign*: each fault kind injected at a random step of a random rank (seeded; the step
drawn after the rules' baselines can be established: `first_fault_step`), one fault a run, on
the recipe: NaN/Inf (`nan_grad`, `inf_grad`, `nan_loss` in turn), a loss spike, a gradient
explosion (`grad_spike`), a slow data path (`slow`), a throttled card (`throttle`: the rank's
own compute slows; judged as a slow rank by `straggler` and as a compute drop by
`compute_drop`, from the same runs), a desync (3 ranks, so a majority exists), a hang and a
crash (caught by the launcher: summary.json's `failure`), and a card over temperature (in this
process: bench/_card_faults.py). While a launch runs, its `anomalies.jsonl` is read every
0.1 s and each firing stamped when first seen; the fault acted at its rank's packet of the step
before (`ts` in metrics.msgpack). Per kind: detection rate, seconds and steps to detect
(median, max), the right rank named.

Every launch holds the lock file named by `--lock` (or $MINDPULSE_BENCH_LOCK) while it runs,
so launches of other users of the machine do not run beside it.

Usage: .venv/bin/python bench/rules.py [--quick] [--part healthy,faults,cards] [--kinds nan,hang]
       [--seed 47] [--json out.json] [--merge-into old.json]
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _common as C
from _rules_records import Injection, detect, failure_detection, false_alarms, injection_time, kind_summary, step_counts

PLAIN_SCRIPT = C.ROOT / "tests" / "integration" / "scripts" / "plain_train.py"


@dataclass(frozen=True)
class Workload:
    name: str
    what: str
    ranks: int
    steps: int
    quick_steps: int
    config: str | None = None
    sets: tuple[str, ...] = ()

    def args(self, steps: int, tmp: Path) -> list[str]:
        out = [str(C.ROOT / self.config)] if self.config else []
        for s in self.sets:
            out += ["--set", s]
        if self.name == "script":  # the script counts its own steps (train.steps=0: no cap)
            ckpt = tmp / "ckpt_{rank}"
            out += ["--set", f"job.script={PLAIN_SCRIPT}", "--set",
                    f"job.args=[--steps, '{steps}', --mode, graph, --cell, model, --ckpt-dir, '{ckpt}']",
                    "--set", "train.steps=0"]
        else:
            out += ["--set", f"train.steps={steps}"]
        return out


WORKLOADS = (
    Workload("recipe", "the recipe (cluster_configs/local_cpu.yaml, 2 ranks, PYNATIVE)", 2, 50, 20,
             "cluster_configs/local_cpu.yaml"),
    Workload("script", "an unmodified Model.train script (plain_train.py, 2 ranks, GRAPH, dataset sink)", 2, 300, 60),
    # the shipped YAML trains 2 epochs of its corpus (~33 steps); 5 take the run past every rule's window
    Workload("mindformers", "the MindFormers YAML (cluster_configs/mindformers_finetune.yaml, 2 ranks, 5 epochs)",
             2, 50, 15, "cluster_configs/mindformers_finetune.yaml",
             ("job.mindformers.overrides={runner_config.epochs: 5}",)),
    Workload("recipe8", "the recipe on 8 ranks", 8, 25, 8, "cluster_configs/local_cpu.yaml",
             ("world.ranks_per_node=8",)),
)


@dataclass(frozen=True)
class FaultCase:
    name: str
    what: str
    faults: tuple[str, ...]
    """Fault kinds given to `--inject`, taken in turn over the runs."""
    detectors: tuple[str, ...]
    """Rules whose firing at or after the fault's step catches it ("hang"/"crash": the launcher)."""
    baseline: tuple[str, ...] = ()
    """Rules that judge against a baseline: the fault comes after they can have one."""
    after: int = 10
    """Steps the run goes on after the fault (a stopping rule ends it sooner)."""
    ranks: int = 2
    sets: tuple[str, ...] = ()
    judged_as: tuple[tuple[str, str, tuple[str, ...]], ...] = ()
    """Further rows from the same runs: (name, what, detectors)."""
    leaves_out: str = ""
    """What this simulation of the fault leaves out (said in its row)."""


CPU = "CPU ranks on one host; "
CASES = (
    FaultCase("nonfinite", "NaN or Inf in gradients or loss", ("nan_grad", "inf_grad", "nan_loss"), ("nonfinite",),
              leaves_out=CPU + "the value made by multiplying the rank's loss or local gradients in its train cell"),
    FaultCase("loss_spike", "a loss spike (the rank's loss x5)", ("loss_spike",), ("loss_spike",), ("loss_spike",),
              leaves_out=CPU + "one step's loss scaled, not a bad batch"),
    FaultCase("grad_explosion", "a gradient explosion (the rank's gradients x1000)", ("grad_spike",),
              ("grad_explosion",), ("grad_explosion",), leaves_out=CPU + "one step's local gradients scaled"),
    FaultCase("slow_data", "a slow data path (1.5 s more a step)", ("slow",), ("straggler", "compute_drop"),
              ("straggler", "compute_drop"), after=12, leaves_out=CPU + "a sleep before the step, not real I/O"),
    FaultCase("throttle", "a slow rank (its compute 2 s longer a step), by `straggler`", ("throttle",),
              ("straggler",), ("straggler", "compute_drop"), after=12,
              judged_as=(("compute_drop", "a compute drop (the same throttled card), by `compute_drop`",
                          ("compute_drop",)),),
              leaves_out=CPU + "a sleep inside the forward pass (PYNATIVE), not a throttled card"),
    FaultCase("desync", "a desync (one weight +1e-3 on one of 3 ranks)", ("desync",), ("desync",), after=14,
              ranks=3, sets=("world.ranks_per_node=3",),
              leaves_out=CPU + "3 ranks (with 2 a tie names rank 1); a weight changed by the injector, not by a card"),
    FaultCase("hang", "a hang (the rank blocks before its step)", ("hang",), ("hang",), after=200,
              leaves_out=CPU + "a Python sleep with the heartbeat alive, not a stuck collective or driver"),
    FaultCase("crash", "a crash (the rank raises)", ("crash",), ("crash",),
              leaves_out=CPU + "a Python exception, not a lost process or host"),
)
CARD_CASE = ("card", "a card over temperature (recorded npu-smi output, 99 C)",
             "no card: the npu-smi sampler on recorded Atlas 800T A2 output, its samples fed to the aggregator's "
             "code in-process (no launch)")
LAUNCHER_KINDS = {"hang", "crash"}
REPEATS = 3
"""Healthy repeats of each workload (the campaign's minimum)."""
RUNS = 5
"""Runs of each fault kind (the campaign's minimum)."""

FIELD = [
    ("Mycroft", "90% of anomalies within 15 s"),
    ("Minder", "3.6 s to detect; precision 0.904"),
    ("Holmes", "30 s to localise"),
    ("MindCluster", "fault discovery under 5 s"),
    ("504-B200 report (55 days)", "0.84 false positives a day"),
]


# ---- when a baseline can exist ---------------------------------------------------------
def first_fault_step(rules: tuple[str, ...], overrides: tuple[str, ...] = ()) -> int:
    """The first step a fault may act at so that each rule of `rules` can judge it against an
    established baseline: the rule's warm-up and a full window (its defaults, as the launch's
    config builds them; the straggler's window is `monitor.straggler_window`), plus two steps."""
    if not rules:
        return 3
    from mindpulse.config import load_config

    cfg, _ = load_config(str(C.ROOT / "cluster_configs" / "local_cpu.yaml"), list(overrides))
    return 2 + max(rule_span(cfg, k) for k in rules)


def rule_span(cfg: Any, kind: str) -> int:
    """Steps a rule of `kind` needs before it judges: its warm-up fields, its window (or the
    straggler's), its consecutive steps (`for_steps`, `patience`), and the timing baselines'
    warm-up after the start."""
    import dataclasses

    from mindpulse.aggregator.policies import build_rules

    span = 0
    for rule in build_rules(list(cfg.anomalies), straggler_threshold=cfg.monitor.straggler_threshold):
        if rule.kind != kind:
            continue
        c = rule.config
        for f in dataclasses.fields(c):
            v = getattr(c, f.name)
            if isinstance(v, bool) or not isinstance(v, int):
                continue
            if "warmup" in f.name or f.name in ("window", "for_steps", "patience"):
                span += max(v, 0)
    if kind == "straggler":
        span += int(cfg.monitor.straggler_window)
    if kind in ("straggler", "compute_drop"):
        try:  # the timing baselines' fixed warm-up after the start, where the rules have one
            from mindpulse.reduction.baselines import START_WARMUP_STEPS
        except ImportError:
            START_WARMUP_STEPS = 0  # noqa: N806
        span += START_WARMUP_STEPS
    return span


# ---- one launch ------------------------------------------------------------------------
@contextmanager
def machine_lock(path: str | None):
    """Hold `path` (flock) while a launch runs: other users' launches wait, and we wait for theirs."""
    if not path:
        yield 0.0
        return
    t0 = time.time()
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield time.time() - t0
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def launch(args: list[str], timeout_s: float, lock: str | None) -> dict[str, Any]:
    """One `mindpulse launch` with `args`: its console lines and anomaly records stamped as seen,
    its summary, its step packets' times; the run directory removed after."""
    from mindpulse.aggregator.anomaly_log import read_records
    from mindpulse.rundir.metrics_store import read_wire

    tmp = Path(tempfile.mkdtemp(prefix="mindpulse-bench-rules-"))
    out_root = tmp / "runs"
    cmd = [sys.executable, "-m", "mindpulse.launcher.cli", "launch", *args, "--set", f"output.root={out_root}",
           "--set", "output.report=false", "--set", "monitor.per_print_step=1000"]
    env = dict(os.environ, PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION="python", RAY_USAGE_STATS_ENABLED="0")
    lines: list[tuple[float, str]] = []
    firings: list[dict[str, Any]] = []
    try:
        with machine_lock(lock) as waited:
            t0 = time.time()
            proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, start_new_session=True)

            def read() -> None:
                for line in proc.stdout:  # type: ignore[union-attr]
                    lines.append((time.time(), line.rstrip("\n")))

            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            run_dir: Path | None = None
            n_seen = 0
            killed = False
            while True:
                done = proc.poll() is not None
                if run_dir is None and out_root.exists():
                    run_dir = next(iter(sorted(out_root.iterdir())), None)
                if run_dir is not None:
                    recs = list(read_records(run_dir)) if (run_dir / "anomalies.jsonl").exists() else []
                    now = time.time()
                    for r in recs[n_seen:]:
                        firings.append(dict(r, seen_at=now))
                    n_seen = max(n_seen, len(recs))
                if done:
                    break
                if time.time() - t0 > timeout_s:
                    os.killpg(proc.pid, signal.SIGTERM)  # the launch's own process group
                    try:
                        proc.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        os.killpg(proc.pid, signal.SIGKILL)
                        proc.wait()
                    killed = True
                    break
                time.sleep(0.1)
            t_exit = time.time()
            reader.join(timeout=10)
        if run_dir is None and out_root.exists():
            run_dir = next(iter(sorted(out_root.iterdir())), None)
        summary: dict[str, Any] = {}
        step_ts: dict[tuple[int, int], float] = {}
        if run_dir is not None:
            if (run_dir / "summary.json").exists():
                summary = json.loads((run_dir / "summary.json").read_text())
            # records the poll missed (written as the aggregator closed): unstamped
            recs = list(read_records(run_dir))
            for r in recs[len(firings):]:
                firings.append(dict(r, seen_at=None))
            if (run_dir / "metrics.msgpack").exists():
                for o in read_wire(run_dir / "metrics.msgpack"):
                    if o.get("t") == "step" and o.get("ts") is not None:
                        step_ts.setdefault((int(o["rank"]), int(o["step"])), float(o["ts"]))
        rank_steps, steps = step_counts(step_ts)
        return {"rc": proc.returncode, "killed": killed, "wall_s": t_exit - t0, "lock_wait_s": waited,
                "lines": lines, "firings": firings, "summary": summary, "step_ts": step_ts,
                "rank_steps": rank_steps, "steps": steps, "started": t0}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _tail(r: dict[str, Any]) -> list[str]:
    """The console's last lines of a launch that did not end as its case expects (else none)."""
    return [line for _, line in r["lines"][-15:]] if r["rc"] not in (0, 1, 3) or r["killed"] else []


def _firing_record(f: dict[str, Any]) -> dict[str, Any]:
    return {k: f.get(k) for k in ("rule", "step", "rank", "value", "threshold", "action", "message", "seen_at")}


# ---- the healthy corpus ----------------------------------------------------------------
def healthy(workloads: list[Workload], repeats: int, quick: bool, lock: str | None, load: C.ForeignLoad,
            log, save=None) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = []
    for rep in range(repeats):
        with machine_lock(lock) as waited:  # a round at a time: others' launches run between rounds
            log(f"healthy round {rep + 1}: the machine's launch lock taken after {waited:.0f}s")
            runs += healthy_round(workloads, rep, quick, load, log, save, runs)
    return runs


def healthy_round(workloads: list[Workload], rep: int, quick: bool, load: C.ForeignLoad, log, save,
                  former: list[dict[str, Any]]) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = []
    for wl in workloads:  # workloads interleaved: a disturbed minute does not hit one workload only
        steps = wl.quick_steps if quick else wl.steps
        with tempfile.TemporaryDirectory(prefix="mindpulse-bench-rules-ckpt-") as ck:
            r = launch(wl.args(steps, Path(ck)), timeout_s=300 + steps * wl.ranks * 2.0, lock=None)
        fl = load.window(r["started"], r["started"] + r["wall_s"])
        s = r["summary"]
        rec = {"workload": wl.name, "repeat": rep, "ranks": wl.ranks, "asked_steps": steps, "rc": r["rc"],
               "status": s.get("status"), "wall_s": r["wall_s"], "lock_wait_s": r["lock_wait_s"],
               "rank_steps": r["rank_steps"], "steps": r["steps"], "foreign_cores": fl["mean_cores"],
               "firings": [_firing_record(f) for f in r["firings"]], "tail": _tail(r)}
        runs.append(rec)
        if save is not None:
            save(former + runs)
        log(f"healthy {wl.name} #{rep + 1}: {rec['status']} rc {rec['rc']}, {rec['rank_steps']} rank-steps, "
            f"{len(rec['firings'])} firings " + ", ".join(f"{f['rule']}@{f['step']}/r{f['rank']}"
                                                         for f in rec["firings"])
            + f" ({r['wall_s']:.0f}s, foreign {fl['mean_cores']:.2f} cores)")
    return runs


# ---- the fault campaign ----------------------------------------------------------------
DECIDED = {"hang": re.compile(r"mindpulse: HANG\b"), "crash": re.compile(r"mindpulse: rank \d+ failed")}


def fault_run(case: FaultCase, i: int, rng: random.Random, lo: int, span: int, lock: str | None,
              load: C.ForeignLoad) -> dict[str, Any]:
    kind = case.faults[i % len(case.faults)]
    rank = rng.randrange(case.ranks)
    step = rng.randint(lo, lo + span)
    spec = f"{kind}@{rank}:{step}"
    args = [str(C.ROOT / "cluster_configs" / "local_cpu.yaml"), "--set", f"train.steps={step + case.after}", "--inject", spec]
    for s in case.sets:
        args += ["--set", s]
    r = launch(args, timeout_s=240 + (step + case.after) * 3.0, lock=lock)
    inj = Injection(spec, rank, step, injection_time(r["step_ts"], rank, step))
    s = r["summary"]
    if case.name in LAUNCHER_KINDS:
        decided = next((t for t, line in r["lines"] if DECIDED[case.name].search(line)), None)
        dets = {case.name: failure_detection(s, inj, case.name, decided)}
    else:
        dets = {case.name: detect(r["firings"], inj, case.detectors)}
        for name, _, detectors in case.judged_as:
            dets[name] = detect(r["firings"], inj, detectors)
    fl = load.window(r["started"], r["started"] + r["wall_s"])
    return {"case": case.name, "spec": spec, "rank": rank, "step": step, "injected_at": inj.at, "rc": r["rc"],
            "status": s.get("status"), "wall_s": r["wall_s"], "lock_wait_s": r["lock_wait_s"],
            "foreign_cores": fl["mean_cores"], "firings": [_firing_record(f) for f in r["firings"]],
            "failure": {k: (s.get("failure") or {}).get(k) for k in ("kind", "ranks", "root_cause_rank")},
            "detections": {k: d.to_record() for k, d in dets.items()}, "tail": _tail(r)}


def faults(cases: list[FaultCase], n: int, seed: int, lock: str | None, load: C.ForeignLoad, log,
           save=None, span: int = 8, deadline: float | None = None) -> dict[str, Any]:
    """`n` runs of each case, in rounds (one run of every case a round), so a campaign cut short
    by `deadline` still holds every kind; `save(out)` after each run."""
    out: dict[str, Any] = {"runs": [], "first_step": {}}
    rngs = {}
    for case in cases:
        out["first_step"][case.name] = first_fault_step(case.baseline, case.sets)
        rngs[case.name] = random.Random(f"{seed}:{case.name}")
    for i in range(n):
        if deadline is not None and time.time() > deadline:
            log(f"deadline reached: {i} round(s) of {n} done")
            return out
        with machine_lock(lock) as waited:  # a round at a time: others' launches run between rounds
            log(f"fault round {i + 1}: the machine's launch lock taken after {waited:.0f}s")
            fault_round(cases, i, rngs, span, load, log, save, out, deadline)
    return out


def fault_round(cases: list[FaultCase], i: int, rngs: dict[str, random.Random], span: int, load: C.ForeignLoad,
                log, save, out: dict[str, Any], deadline: float | None = None) -> None:
    for case in cases:
        if deadline is not None and time.time() > deadline:
            log(f"deadline reached in round {i + 1}")
            return
        rec = fault_run(case, i, rngs[case.name], out["first_step"][case.name], span, None, load)
        out["runs"].append(rec)
        if save is not None:
            save(out)
        d = rec["detections"][case.name]
        log(f"fault {case.name} {rec['spec']}: " + (
            f"caught by {d['by']} at step {d['step']} (rank {d['rank']}), {_s(d['seconds'])}"
            if d["detected"] else f"NOT caught ({rec['status']}, rc {rec['rc']})")
            + (f"; {len(d['early'])} firing(s) before the fault" if d["early"] else "")
            + f" ({rec['wall_s']:.0f}s)")


def _s(x: float | None) -> str:
    return f"{x:.1f} s" if x is not None else "- s"


def cards(n: int, seed: int, log) -> list[dict[str, Any]]:
    from _card_faults import card_runs

    runs = card_runs(n, seed, C.aggregator_settings())
    for r in runs:
        d = r["detection"]
        log(f"card {r['spec']}: " + (f"caught by {d['by']} (rank {d['rank']}), {_s(d['seconds'])}"
                                     if d["detected"] else "NOT caught"))
    return runs


# ---- summary and table -----------------------------------------------------------------
def summarise(out: dict[str, Any]) -> dict[str, Any]:
    from _rules_records import Detection

    def dets(name: str) -> list[Detection]:
        return [Detection(**r["detections"][name]) for r in out.get("faults", {}).get("runs", [])
                if name in r["detections"]]

    kinds: dict[str, Any] = {}
    for case in CASES:
        for name, what in [(case.name, case.what), *[(n, w) for n, w, _ in case.judged_as]]:
            ds = dets(name)
            if ds:
                kinds[name] = dict(kind_summary(ds), what=what, leaves_out=case.leaves_out,
                                   first_step=out["faults"].get("first_step", {}).get(case.name))
    if out.get("cards"):
        c0 = out["cards"][0]
        what = CARD_CASE[1] + (f"; the rule asks for {c0['for_s']:g} s above its limit, the sampler reads every "
                               f"{c0['interval_s']:g} s" if c0.get("for_s") is not None else "")
        kinds[CARD_CASE[0]] = dict(kind_summary([Detection(**r["detection"]) for r in out["cards"]]),
                                   what=what, leaves_out=CARD_CASE[2], first_step=None)
    return {"false_alarms": false_alarms(out.get("healthy", [])), "kinds": kinds}


def render(out: dict[str, Any]) -> str:
    summ = out.get("summary") or summarise(out)
    parts = []
    stamps = out.get("parts") or {}
    if stamps:
        parts.append("Parts: " + "; ".join(
            f"{k} at {v.get('date')} (commit {v.get('commit')}" + (", quick" if v.get("quick") else "") + ")"
            for k, v in stamps.items()) + ".")
    short = [f"healthy: {v['repeats']} repeat(s) of {REPEATS}" for k, v in stamps.items()
             if k == "healthy" and not v.get("quick") and (v.get("repeats") or REPEATS) < REPEATS]
    short += [f"{k.split(':', 1)[1]}: {v['runs']} run(s) of {RUNS}" for k, v in stamps.items()
              if k.startswith("faults:") and not v.get("quick") and (v.get("runs") or RUNS) < RUNS]
    if short:
        parts.append("**Cut short** (the shared machine's launch lock was free for too little of the time this run "
                     "had): " + "; ".join(short) + ". These figures are that many runs, not the campaign's minimum.")
    fa = summ["false_alarms"]
    if fa["total"]["runs"]:
        rows = []
        whats = {w.name: w.what for w in WORKLOADS}
        def busy(name: str | None) -> str:
            xs = [r.get("foreign_cores") for r in out.get("healthy", []) if name in (None, r["workload"])]
            xs = [x for x in xs if x is not None]
            return f"{sum(xs) / len(xs):.2f}" if xs else "-"

        for name, w in fa["by_workload"].items():
            rows.append([whats.get(name, name), w["runs"], f"{w['rank_steps']:,}", f"{w['steps']:,}", w["firings"],
                         _f(w["per_1000_rank_steps"]), _f(w["per_1000_steps"]),
                         ", ".join(f"{k} {v}" for k, v in w["by_rule"].items()) or "none", busy(name)])
        t = fa["total"]
        rows.append(["**all**", t["runs"], f"{t['rank_steps']:,}", f"{t['steps']:,}", t["firings"],
                     _f(t["per_1000_rank_steps"]), _f(t["per_1000_steps"]),
                     ", ".join(f"{k} {v}" for k, v in t["by_rule"].items()) or "none", busy(None)])
        parts.append("False alarms on healthy runs (no fault injected; target: 0 per 1,000 healthy steps):")
        parts.append(C.table(["workload", "runs", "rank-steps", "steps", "firings", "per 1,000 rank-steps",
                              "per 1,000 steps", "by rule", "other processes' cores meanwhile (mean)"], rows))
        msgs = [f"- {r['workload']} #{r['repeat'] + 1}: {f['rule']} (rank {f['rank']}, step {f['step']}): "
                f"{f['message']}" for r in out.get("healthy", []) for f in r["firings"]]
        if msgs:
            parts.append("Each false alarm's message:\n\n" + "\n".join(msgs[:40])
                         + (f"\n- ... {len(msgs) - 40} more (bench/results/rules.json)" if len(msgs) > 40 else ""))
    if summ["kinds"]:
        rows = []
        for k in summ["kinds"].values():
            sec, st = k["seconds"], k["steps"]
            lo = k.get("first_step")
            rows.append([k["what"], f"{lo}-{lo + 8}" if lo is not None else "-",
                         f"{k['detected']}/{k['runs']} ({_pct(k['rate'])})",
                         _pair(sec, "s"), _pair(st, ""), f"{k['right_rank']}/{k['detected']}"
                         + (f" ({_pct(k['right_rank_rate'])})" if k["detected"] else ""),
                         ", ".join(k["by"]) or "-", k["early"], k.get("leaves_out") or "-"])
        parts.append("Injected faults, one a run, at a random step of a random rank (seeded; the step drawn after "
                     "the judging rules' warm-up and window; targets: 100% detected, the right rank named):")
        parts.append(C.table(["fault", "steps drawn from", "detected", "seconds to detect (median, max)",
                              "steps to detect (median, max)", "right rank", "caught by",
                              "its rules' firings before the fault", "what the simulation leaves out"], rows))
        parts.append(field_table(out, summ))
    return "\n\n".join(parts)


def field_table(out: dict[str, Any], summ: dict[str, Any]) -> str:
    """This run's figures beside the published ones."""
    secs = [r["detections"][k]["seconds"] for r in out.get("faults", {}).get("runs", [])
            for k in r["detections"] if r["detections"][k]["detected"] and r["detections"][k]["seconds"] is not None]
    secs += [r["detection"]["seconds"] for r in out.get("cards", []) if r["detection"]["detected"]
             and r["detection"]["seconds"] is not None]
    runs = sum(k["runs"] for k in summ["kinds"].values())
    caught = sum(k["detected"] for k in summ["kinds"].values())
    within = sum(1 for x in secs if x <= 15.0)
    t = summ["false_alarms"]["total"]
    wall_h = sum(r.get("wall_s") or 0 for r in out.get("healthy", [])) / 3600
    ours_fp = (f"{_f(t['per_1000_steps'])} per 1,000 steps ({t['firings']} in {t['steps']:,} steps, "
               f"{t['rank_steps']:,} rank-steps); {t['firings'] / wall_h * 24:.1f} a day of these runs' wall time"
               if t["runs"] and wall_h else "not measured")
    med = _median_max(secs)
    rows = [
        ["Mycroft", "90% of anomalies within 15 s",
         f"{within}/{len(secs)} caught faults within 15 s ({_pct(within / len(secs)) if secs else '-'})"],
        ["Minder", "3.6 s to detect; precision 0.904",
         f"median {_s(med[0])}, max {_s(med[1])} to detect; {caught}/{runs} faults caught"],
        ["Holmes", "30 s to localise", f"{sum(1 for x in secs if x <= 30.0)}/{len(secs)} within 30 s, the rank named "
         f"in {sum(k['right_rank'] for k in summ['kinds'].values())}/{caught}"],
        ["MindCluster", "fault discovery under 5 s", f"{sum(1 for x in secs if x < 5.0)}/{len(secs)} under 5 s"],
        ["504-B200 report (55 days)", "0.84 false positives a day", ours_fp],
    ]
    return "Beside the field's published figures (their clusters, their faults; ours: CPU ranks on one shared host, " \
           "injected faults):\n\n" + C.table(["system", "their figure", "this run"], rows)


def _median_max(xs: list[float]) -> tuple[float | None, float | None]:
    import statistics

    return (statistics.median(xs), max(xs)) if xs else (None, None)


def target_rows(out: dict[str, Any]) -> list[list[str]]:
    """The rules campaign's rows of docs/benchmarks.md's targets table."""
    summ = out.get("summary") or summarise(out)
    rows = []
    t = summ["false_alarms"]["total"]
    if t["runs"]:
        per = t["per_1000_steps"] or 0.0
        rows.append([f"a healthy run is silent: 0 anomalies per 1,000 healthy steps ({t['runs']} runs of "
                     f"{len(summ['false_alarms']['by_workload'])} workloads, {t['rank_steps']:,} rank-steps)",
                     f"{t['firings']} in {t['steps']:,} steps: {per:.2f} per 1,000 steps "
                     f"({_f(t['per_1000_rank_steps'])} per 1,000 rank-steps)"
                     + (": " + ", ".join(f"{k} {v}" for k, v in t["by_rule"].items()) if t["by_rule"] else ""),
                     "met" if t["firings"] == 0 else "missed",
                     "none" if t["firings"] == 0 else f"{t['firings']} false alarm(s)"])
    kinds = summ["kinds"]
    if kinds:
        runs = sum(k["runs"] for k in kinds.values())
        caught = sum(k["detected"] for k in kinds.values())
        missed = [f"{n} {k['detected']}/{k['runs']}" for n, k in kinds.items() if k["detected"] < k["runs"]]
        rows.append([f"every injected fault caught ({len(kinds)} kinds, at least "
                     f"{min(k['runs'] for k in kinds.values())} runs each)",
                     f"{caught}/{runs} ({_pct(caught / runs if runs else None)})", "met" if not missed else "missed",
                     "all caught" if not missed else "missed: " + ", ".join(missed)])
        right = sum(k["right_rank"] for k in kinds.values())
        wrong = [f"{n} {k['right_rank']}/{k['detected']}" for n, k in kinds.items() if k["right_rank"] < k["detected"]]
        rows.append(["the right rank named", f"{right}/{caught} caught faults", "met" if not wrong else "missed",
                     "every caught fault" if not wrong else "wrong rank: " + ", ".join(wrong)])
    return rows


def _f(x: float | None) -> str:
    return f"{x:.2f}" if x is not None else "-"


def _pct(x: float | None) -> str:
    return f"{100 * x:.0f}%" if x is not None else "-"


def _pair(s: dict[str, Any], unit: str) -> str:
    if not s["n"]:
        return "-"
    fmt = (lambda v: f"{v:.1f} {unit}") if unit else (lambda v: f"{v:g}")  # noqa: E731
    return f"{fmt(s['median'])}, {fmt(s['max'])}"


# ---- main ------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a smoke run: 1 repeat, 1 run a fault kind, short runs")
    ap.add_argument("--part", default="healthy,faults,cards", help="comma-separated: healthy, faults, cards")
    ap.add_argument("--kinds", default="", help="fault kinds to run (default: all): " + ", ".join(c.name for c in CASES))
    ap.add_argument("--workloads", default="", help="healthy workloads (default: all): "
                    + ", ".join(w.name for w in WORKLOADS))
    ap.add_argument("--repeats", type=int, default=None, help="healthy repeats (default 3; --quick 1)")
    ap.add_argument("--runs", type=int, default=None, help="runs a fault kind (default 5; --quick 1)")
    ap.add_argument("--seed", type=int, default=47)
    ap.add_argument("--lock", default=os.environ.get("MINDPULSE_BENCH_LOCK"),
                    help="a lock file every launch holds while it runs (flock)")
    ap.add_argument("--lock-scope", choices=["round", "run"], default="round",
                    help="hold the lock a round at a time (others' launches run between rounds), or for the whole "
                         "run once taken (a machine whose other users hold it for long sessions)")
    ap.add_argument("--merge-into", default=None, help="a former result: the parts run now replace its parts")
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="no fault run starts after this many seconds (the rounds done are kept)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    t0 = time.time()
    parts = set(args.part.split(","))
    repeats = args.repeats or (1 if args.quick else REPEATS)
    n = args.runs or (1 if args.quick else RUNS)
    load = C.ForeignLoad(interval_s=1.0).start()

    def log(msg: str) -> None:
        print(f"[rules {time.time() - t0:5.0f}s] {msg}", file=sys.stderr, flush=True)

    out: dict[str, Any] = {}
    if args.merge_into and Path(args.merge_into).exists():
        out = json.loads(Path(args.merge_into).read_text())
        out.pop("summary", None)
    out.setdefault("parts", {})
    stamp = {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "commit": _commit(), "quick": args.quick, "seed": args.seed}
    def save() -> None:
        out["summary"] = summarise(out)
        C.write_result(args.json, "rules", out, t0)

    lock = args.lock if args.lock_scope == "round" else None
    if "cards" in parts:  # first: in this process, beside no launch of ours
        out["cards"] = cards(n, args.seed, log)
        out["parts"]["cards"] = dict(stamp, runs=n)
        save()
    if args.lock_scope == "run" and args.lock and parts - {"cards"}:
        whole = open(args.lock, "a+")  # held until this process ends
        t_wait = time.time()
        fcntl.flock(whole, fcntl.LOCK_EX)
        log(f"the machine's launch lock taken for the whole run after {time.time() - t_wait:.0f}s")
    if "healthy" in parts:
        wls = [w for w in WORKLOADS if not args.workloads or w.name in args.workloads.split(",")]
        out["parts"]["healthy"] = dict(stamp, repeats=repeats)

        def save_healthy(runs: list[dict[str, Any]]) -> None:
            out["healthy"] = runs
            save()

        out["healthy"] = healthy(wls, repeats, args.quick, lock, load, log, save_healthy)
    if "faults" in parts:
        cases = [c for c in CASES if not args.kinds or c.name in args.kinds.split(",")]
        kept = [r for r in (out.get("faults") or {}).get("runs", []) if r["case"] not in {c.name for c in cases}]
        first = dict((out.get("faults") or {}).get("first_step", {}))
        for c in cases:
            out["parts"][f"faults:{c.name}"] = dict(stamp, runs=n)

        def save_faults(got: dict[str, Any]) -> None:  # the other kinds' former runs kept
            out["faults"] = {"runs": kept + got["runs"], "first_step": dict(first, **got["first_step"])}
            save()

        deadline = t0 + args.max_seconds if args.max_seconds else None
        save_faults(faults(cases, n, args.seed, lock, load, log, save_faults, deadline=deadline))
    load.stop()
    out["summary"] = summarise(out)
    print(render(out))
    C.write_result(args.json, "rules", out, t0)


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=C.ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


if __name__ == "__main__":
    main()
