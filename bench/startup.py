"""Start-up: seconds from `mindpulse launch` to the first step, against bare `msrun`.

The same 2-rank data-parallel script (bench/scripts/first_step.py) runs both ways, the
two alternating: `mindpulse launch --set job.script=...` (embedded Ray cluster,
aggregator, scheduler, rank actors) and `msrun --worker_num=2 --local_worker_num=2
--join=True` (no monitoring service; the script's `Monitor` only logs). The script
prints the wall-clock time at the end of its first step on each rank; the first step of
the job is the later of the two ranks. Also reported: the whole command's wall time,
and for mindpulse the `ts` of the first step packet in metrics.msgpack.

Usage: .venv/bin/python bench/startup.py [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common as C

SCRIPT = C.BENCH / "scripts" / "first_step.py"
LINE = re.compile(r"BENCH_FIRST_STEP (\d+) ([0-9.]+) ([0-9.]+)")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")  # msrun runs `python`
    env["PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"] = "python"
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    return env


def _first_steps(texts: list[str]) -> dict[int, tuple[float, float]]:
    out = {}
    for t in texts:
        for m in LINE.finditer(t):
            out[int(m.group(1))] = (float(m.group(2)), float(m.group(3)))
    return out


def run_mindpulse(tmp: Path, steps: int) -> dict:
    from mindpulse.rundir.metrics_store import read_wire

    root = tmp / "runs"
    cmd = [sys.executable, "-m", "mindpulse.launcher.cli", "launch", "--set", f"job.script={SCRIPT}",
           "--set", f"job.args=[--steps, '{steps}']", "--set", f"train.steps={steps}", "--set",
           "monitor.per_print_step=100", "--set", f"output.root={root}", "--set", "output.report=false"]
    t0 = time.time()
    p = subprocess.run(cmd, cwd=C.ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    t_end = time.time()
    run_dir = next(root.iterdir()) if root.exists() else None
    if p.returncode != 0 or run_dir is None:
        raise RuntimeError(f"mindpulse launch failed ({p.returncode}): {p.stdout[-2000:]} {p.stderr[-2000:]}")
    logs = [f.read_text(errors="replace") for f in (run_dir / "logs").glob("rank_*.log")]
    first = _first_steps(logs)
    pkt_ts = [o["ts"] for o in read_wire(run_dir / "metrics.msgpack") if o.get("t") == "step" and o.get("step") == 1]
    if len(first) < 2:
        raise RuntimeError(f"first-step lines missing in the rank logs of {run_dir}")
    return {"first_step_s": max(v[0] for v in first.values()) - t0,
            "script_start_s": min(v[1] for v in first.values()) - t0,
            "first_packet_s": (max(pkt_ts) - t0) if pkt_ts else None, "total_s": t_end - t0}


def run_msrun(tmp: Path, steps: int) -> dict:
    log_dir = tmp / "msrun_logs"
    msrun = str(Path(sys.executable).parent / "msrun")
    cmd = [msrun, "--worker_num=2", "--local_worker_num=2", f"--master_port={C.free_port()}", "--join=True",
           f"--log_dir={log_dir}", str(SCRIPT), "--steps", str(steps)]
    t0 = time.time()
    p = subprocess.run(cmd, cwd=tmp, env=_env(), capture_output=True, text=True, timeout=300)
    t_end = time.time()
    logs = [f.read_text(errors="replace") for f in log_dir.glob("*.log")] + [p.stdout, p.stderr]
    first = _first_steps(logs)
    if p.returncode != 0 or len(first) < 2:
        raise RuntimeError(f"msrun failed ({p.returncode}): {p.stdout[-2000:]} {p.stderr[-2000:]}")
    return {"first_step_s": max(v[0] for v in first.values()) - t0,
            "script_start_s": min(v[1] for v in first.values()) - t0, "total_s": t_end - t0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--max-seconds", type=float, default=220.0,
                    help="time after which disturbed pairs of runs are no longer run again")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    t0 = time.time()
    load = C.ForeignLoad(interval_s=1.0).start()

    def pair(rep: int) -> dict[str, dict]:
        out = {}
        for kind in (["mindpulse", "msrun"] if rep % 2 == 0 else ["msrun", "mindpulse"]):
            tmp = Path(tempfile.mkdtemp(prefix=f"mindpulse-bench-startup-{kind}-"))
            try:
                r = run_mindpulse(tmp, args.steps) if kind == "mindpulse" else run_msrun(tmp, args.steps)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            out[kind] = r
            print(f"[startup] {kind} run {rep + 1}: first step after {r['first_step_s']:.1f}s, "
                  f"exit after {r['total_s']:.1f}s ({time.time() - t0:.0f}s)", file=sys.stderr, flush=True)
        return out

    # a pair of runs beside other processes' load runs again while `--max-seconds` allows
    g = C.gated_repeats(load, args.repeats, t0 + args.max_seconds, pair, max_wait_s=20.0,
                        log=lambda m: print(f"[startup] {m}", file=sys.stderr, flush=True))
    load.stop()
    runs: dict[str, list[dict]] = {k: [p[k] for p in g["kept"]] for k in ("mindpulse", "msrun")}
    res = {}
    for kind, rs in runs.items():
        res[kind] = {k: C.summary([r[k] for r in rs if r.get(k) is not None])
                     for k in ("first_step_s", "script_start_s", "first_packet_s", "total_s") if rs[0].get(k) is not None}
    extra = [a["first_step_s"] - b["first_step_s"] for a, b in zip(runs["mindpulse"], runs["msrun"])]
    out = {"runs": runs, "summary": res, "extra_s": C.summary(extra), "repeats": len(g["kept"]), "steps": args.steps,
           "discarded": g["discarded"], "disturbed_kept": g["disturbed_kept"], "foreign_cores": g["foreign"]}
    print(render(out))
    C.write_result(args.json, "startup", out, t0)


def render(out: dict) -> str:
    rows = []
    labels = {"first_step_s": "command start -> first step (s)", "script_start_s": "command start -> script running (s)",
              "first_packet_s": "command start -> first step packet (s)", "total_s": "command start -> exit (s)"}
    for key, label in labels.items():
        m = out["summary"]["mindpulse"].get(key)
        b = out["summary"]["msrun"].get(key)
        fmt = lambda s: f"{s['median']:.1f} ({s['min']:.1f}-{s['max']:.1f})" if s else "-"  # noqa: E731
        rows.append([label, fmt(m), fmt(b)])
    e = out["extra_s"]
    return "\n".join([
        C.table(["2 ranks, median (range)", "mindpulse launch", "bare msrun"], rows),
        f"mindpulse costs {e['median']:+.1f} s (range {e['min']:+.1f}..{e['max']:+.1f}) to the first step over bare msrun "
        f"({out['repeats']} alternating repeats)"
        + (f"; {C.plural(out['discarded'], 'pair')} of runs beside other processes' load discarded and run again"
           if out.get("discarded") else "")
        + (f"; {C.plural(out['disturbed_kept'], 'pair')} kept although other processes were busy (no time left)"
           if out.get("disturbed_kept") else ""),
    ])


if __name__ == "__main__":
    main()
