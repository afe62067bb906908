"""Stop latency: steps and seconds from an injected NaN to every rank stopped.

A real 2-rank CPU run of the default job: `mindpulse launch --set train.steps=40
--inject nan_grad@1:5` (rank 1's gradients become NaN at step 5). From the run's
metrics.msgpack and summary.json:

  steps    the step after which every rank stopped, minus 5 (0: no rank ran a step
           after the NaN one), and whether all ranks stopped after the same step
  seconds  from the NaN step's packet (its `ts`, rank 1) to the last rank's `end`
           event, and to the launcher's exit (every process gone)

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


def one_run(steps: int) -> dict:
    from mindpulse.aggregator.metrics_store import read_wire

    tmp = Path(tempfile.mkdtemp(prefix="mindpulse-bench-stop-"))
    try:
        cmd = [sys.executable, "-m", "mindpulse.launcher.cli", "launch", "--set", f"train.steps={steps}",
               "--inject", f"nan_grad@{NAN_RANK}:{NAN_STEP}", "--set", f"output.root={tmp}",
               "--set", "monitor.per_print_step=50", "--set", "output.report=false"]
        env = dict(os.environ, PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION="python", RAY_USAGE_STATS_ENABLED="0")
        t0 = time.time()
        p = subprocess.run(cmd, cwd=C.ROOT, env=env, capture_output=True, text=True, timeout=600)
        t_exit = time.time()
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
            "to_launcher_exit_s": t_exit - nan_ts, "launch_to_nan_s": nan_ts - t0, "total_s": t_exit - t0,
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    t0 = time.time()
    runs = []
    for rep in range(args.repeats):
        r = one_run(args.steps)
        runs.append(r)
        print(f"[stop] repeat {rep + 1}: stopped after step {max(r['ranks_last_step'].values())} "
              f"(+{r['steps_after_nan']}), {r['to_launcher_exit_s']:.1f}s to exit ({time.time() - t0:.0f}s)",
              file=sys.stderr, flush=True)
    out = {"runs": runs, "nan": f"nan_grad@{NAN_RANK}:{NAN_STEP}", "steps": args.steps,
           "steps_after_nan": C.summary([r["steps_after_nan"] for r in runs]),
           "to_last_end_event_s": C.summary([r["to_last_end_event_s"] for r in runs
                                             if r["to_last_end_event_s"] is not None]),
           "to_launcher_exit_s": C.summary([r["to_launcher_exit_s"] for r in runs])}
    print(render(out))
    C.write_result(args.json, "stop_latency", out, t0)


def render(out: dict) -> str:
    rows = []
    for i, r in enumerate(out["runs"], 1):
        end = r["to_last_end_event_s"]
        rows.append([i, r["rule"], r["stop_step"], ", ".join(f"{k}: {v}" for k, v in r["ranks_last_step"].items()),
                     r["steps_after_nan"], "yes" if r["same_step"] else "NO",
                     f"{end:.2f}" if end is not None else "-", f"{r['to_launcher_exit_s']:.2f}"])
    s, e, x = out["steps_after_nan"], out["to_last_end_event_s"], out["to_launcher_exit_s"]
    return "\n".join([
        C.table(["run", "rule", "stop step", "last step per rank", "steps after the NaN step", "same step",
                 "NaN packet -> last rank's end (s)", "NaN packet -> launcher exit (s)"], rows),
        f"median: {s['median']:.0f} steps after the NaN step; {e['median']:.2f} s to every rank's end event, "
        f"{x['median']:.2f} s to the launcher's exit (range {x['min']:.2f}-{x['max']:.2f})",
    ])


if __name__ == "__main__":
    main()
