"""Stop latency: steps and seconds from an injected NaN to every rank stopped.

A real 2-rank CPU run of the default job: `mindpulse launch --set train.steps=40
--inject nan_grad@1:5` (rank 1's gradients become NaN at step 5). From the run's
metrics.msgpack and summary.json:

  steps    the step after which every rank stopped, minus 5 (0: no rank ran a step
           after the NaN one), and whether all ranks stopped after the same step
  seconds  from the NaN step's packet (its `ts`, rank 1) to the last rank's `end`
           event, to the last rank process (`ray::RankActor`) gone, and to the launcher's
           exit (everything stopped, summary written; the HTML report is turned off)

Usage: .venv/bin/python bench/stop_latency.py [--repeats 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common as C

NAN_RANK, NAN_STEP = 1, 5


def watch_ranks(proc: subprocess.Popen, timeout_s: float) -> dict[int, float]:
    """Until `proc` exits: the last time each rank process (`ray::RankActor`) below it was seen."""
    import threading

    import psutil

    seen: dict[int, float] = {}
    buf: list[str] = []
    reader = threading.Thread(target=lambda: buf.append(proc.stdout.read()), daemon=True)
    reader.start()  # keep the pipe drained
    deadline = time.time() + timeout_s
    try:
        root = psutil.Process(proc.pid)
    except psutil.Error:
        root = None
    while proc.poll() is None and time.time() < deadline:
        now = time.time()
        try:
            kids = root.children(recursive=True) if root else []
        except psutil.Error:
            kids = []
        for k in kids:
            try:
                if "RankActor" in " ".join(k.cmdline()[:1]):
                    seen[k.pid] = now
            except psutil.Error:
                continue
        time.sleep(0.05)
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    reader.join(timeout=5)
    proc.stdout = None
    watch_ranks.output = "".join(buf)
    return seen


def one_run(steps: int) -> dict:
    from mindpulse.rundir.metrics_store import read_wire

    tmp = Path(tempfile.mkdtemp(prefix="mindpulse-bench-stop-"))
    try:
        cmd = [sys.executable, "-m", "mindpulse.launcher.cli", "launch", "--set", f"train.steps={steps}",
               "--inject", f"nan_grad@{NAN_RANK}:{NAN_STEP}", "--set", f"output.root={tmp}",
               "--set", "monitor.per_print_step=50", "--set", "output.report=false"]
        env = dict(os.environ, PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION="python", RAY_USAGE_STATS_ENABLED="0")
        t0 = time.time()
        proc = subprocess.Popen(cmd, cwd=C.ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        seen = watch_ranks(proc, timeout_s=600)
        out_text = watch_ranks.output
        t_exit = time.time()
        p = subprocess.CompletedProcess(cmd, proc.returncode, out_text, "")
        run_dir = next(tmp.iterdir())
        summary = json.loads((run_dir / "summary.json").read_text())
        last: dict[int, int] = {}
        nan_ts = None
        end_ts: dict[int, float] = {}
        for o in read_wire(run_dir / "metrics.msgpack"):
            if o.get("t") == "step":
                last[o["rank"]] = max(last.get(o["rank"], 0), o["step"])
                if o["step"] == NAN_STEP and o["rank"] == NAN_RANK:
                    nan_ts = o["ts"]
            elif o.get("t") == "event" and o.get("kind") == "end":
                end_ts[o["rank"]] = o["ts"]
        if p.returncode != 3 or nan_ts is None:
            raise RuntimeError(f"expected an anomaly stop (exit 3), got {p.returncode}: {p.stdout[-2000:]}")
        stop_step = (summary.get("stop") or {}).get("step")
        return {
            "exit_code": p.returncode, "status": summary.get("status"), "rule": (summary.get("stop") or {}).get("rule"),
            "stop_step": stop_step, "steps_after_nan": max(last.values()) - NAN_STEP,
            "ranks_last_step": {str(k): v for k, v in sorted(last.items())},
            "same_step": len(set(last.values())) == 1,
            "to_last_end_event_s": (max(end_ts.values()) - nan_ts) if len(end_ts) == len(last) else None,
            "to_rank_processes_gone_s": (max(seen.values()) - nan_ts) if seen else None,
            "rank_processes_seen": len(seen),
            "to_launcher_exit_s": t_exit - nan_ts, "launch_to_nan_s": nan_ts - t0, "total_s": t_exit - t0,
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--max-seconds", type=float, default=150.0,
                    help="time after which disturbed runs are no longer run again")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    t0 = time.time()
    load = C.ForeignLoad(interval_s=1.0).start()

    def repeat(i: int) -> dict:
        r = one_run(args.steps)
        print(f"[stop] run {i + 1}: stopped after step {max(r['ranks_last_step'].values())} "
              f"(+{r['steps_after_nan']}), {r['to_launcher_exit_s']:.1f}s to exit ({time.time() - t0:.0f}s)",
              file=sys.stderr, flush=True)
        return r

    # a run beside other processes' load is run again while `--max-seconds` allows
    g = C.gated_repeats(load, args.repeats, t0 + args.max_seconds, repeat, max_wait_s=20.0,
                        log=lambda m: print(f"[stop] {m}", file=sys.stderr, flush=True))
    load.stop()
    runs = g["kept"]
    for r, f in zip(runs, g["foreign"]):
        r["foreign_cores"] = f
    out = {"runs": runs, "nan": f"nan_grad@{NAN_RANK}:{NAN_STEP}", "steps": args.steps,
           "discarded": g["discarded"], "disturbed_kept": g["disturbed_kept"],
           "steps_after_nan": C.summary([r["steps_after_nan"] for r in runs]),
           "to_last_end_event_s": C.summary([r["to_last_end_event_s"] for r in runs
                                             if r["to_last_end_event_s"] is not None]),
           "to_launcher_exit_s": C.summary([r["to_launcher_exit_s"] for r in runs])}
    gone = [r["to_rank_processes_gone_s"] for r in runs if r["to_rank_processes_gone_s"] is not None]
    out["to_rank_processes_gone_s"] = C.summary(gone) if gone else None
    print(render(out))
    C.write_result(args.json, "stop_latency", out, t0)


def render(out: dict) -> str:
    rows = []
    for i, r in enumerate(out["runs"], 1):
        end, gone = r["to_last_end_event_s"], r.get("to_rank_processes_gone_s")
        rows.append([i, r["rule"], r["stop_step"], ", ".join(f"{k}: {v}" for k, v in r["ranks_last_step"].items()),
                     r["steps_after_nan"], "yes" if r["same_step"] else "NO",
                     f"{end:.2f}" if end is not None else "-", f"{gone:.2f}" if gone is not None else "-",
                     f"{r['to_launcher_exit_s']:.2f}"])
    s, e, x = out["steps_after_nan"], out["to_last_end_event_s"], out["to_launcher_exit_s"]
    g = out.get("to_rank_processes_gone_s")
    note = ""
    if out.get("discarded") or out.get("disturbed_kept"):
        note = (f"\n{C.plural(out.get('discarded', 0), 'run')} beside other processes' load discarded and run "
                f"again; {out.get('disturbed_kept', 0)} kept although other processes were busy (no time left)")
    return note.lstrip("\n") + ("\n\n" if note else "") + "\n".join([
        C.table(["run", "rule", "stop step", "last step per rank", "steps after the NaN step", "same step",
                 "NaN packet -> last rank's end event (s)", "NaN packet -> last rank process gone (s)",
                 "NaN packet -> launcher exit (s)"], rows),
        f"median: {s['median']:.0f} steps after the NaN step; {e['median']:.2f} s to every rank's end event, "
        + (f"{g['median']:.2f} s to every rank process gone, " if g else "")
        + f"{x['median']:.2f} s to the launcher's exit (range {x['min']:.2f}-{x['max']:.2f})",
    ])


if __name__ == "__main__":
    main()
