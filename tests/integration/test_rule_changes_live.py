"""One running 2-rank job, two things a user does to it: a rule changed with `mindpulse
rules` (the aggregator applies it from the next reduced step, and a lowered loss threshold
fires there), then Ctrl-C (every rank stops after the same step, rank 0 saves `last`, exit
130, nothing left running)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import ROOT, _run_processes, last_steps, mindpulse_cmd, run_leftovers, run_pids

pytestmark = pytest.mark.slow

RULE = "anomalies=[{rule: threshold, name: loss_high, metric: loss, op: '>', threshold: 100.0, action: warn}]"


def rules_cmd(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(mindpulse_cmd() + ["rules", str(run_dir), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_a_lowered_loss_threshold_fires_at_the_next_reduced_step_then_ctrl_c_stops_every_rank(tmp_path):
    out_root = tmp_path / "runs"
    before = set(_run_processes())
    proc = subprocess.Popen(mindpulse_cmd() + ["launch", "--set", f"output.root={out_root}", "--set", "train.steps=200",
                                               "--set", "monitor.per_print_step=100", "--set", RULE],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    run_dir = None
    try:
        deadline = time.time() + 300
        while time.time() < deadline:  # running: both ranks past step 3, the aggregator's rules.json there
            dirs = list(out_root.iterdir()) if out_root.exists() else []
            run_dir = dirs[0] if dirs else None
            steps = last_steps(run_dir) if run_dir else {}
            if len(steps) == 2 and min(steps.values()) >= 3 and (run_dir / "rules.json").exists():
                break
            if proc.poll() is not None:
                pytest.fail(f"the run ended early:\n{proc.stdout.read()[-3000:]}")
            time.sleep(0.3)
        else:
            pytest.fail("the run never reached step 3")

        listed = rules_cmd(run_dir)
        assert listed.returncode == 0, listed.stderr
        assert re.search(r"loss_high\s+threshold\s+warn\s+yes\s+metric=loss op=> threshold=100.0", listed.stdout), \
            listed.stdout
        bad = rules_cmd(run_dir, "set", "loss_high.threshold=abc")
        assert bad.returncode == 2 and "loss_high.threshold: 'abc' is not allowed; use a number" in bad.stderr

        changed = rules_cmd(run_dir, "set", "loss_high.threshold=0.01")
        assert changed.returncode == 0, changed.stdout + changed.stderr
        m = re.search(r"set loss_high\.threshold: 100\.0 -> 0\.01, from step (\d+) on", changed.stdout)
        assert m, changed.stdout
        applied_from = int(m.group(1))
        assert applied_from < 200, "the job was still running"

        deadline = time.time() + 120  # the warning is on record: now Ctrl-C
        jsonl = run_dir / "anomalies.jsonl"
        while not (jsonl.exists() and "loss_high" in jsonl.read_text()) and time.time() < deadline:
            time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 130, out[-4000:]
    s = json.loads((run_dir / "summary.json").read_text())
    # Ctrl-C: every rank stopped after the same step, rank 0 saved `last` of that step
    assert s["status"] == "interrupted" and s["stop"]["rule"] == "interrupt", s["stop"]
    steps = last_steps(run_dir)
    assert steps[0] == steps[1] < 200, steps
    man = json.loads((run_dir / "checkpoints" / "manifest.json").read_text())
    assert [f["step"] for f in man["files"] if f["kind"] == "last"] == [steps[0]], man["files"]
    # the changed rule fired at the step the change applied from
    firings = [a for a in json.loads((run_dir / "anomalies.json").read_text()) if a["rule"] == "loss_high"]
    assert [(a["step"], a["threshold"]) for a in firings] == [(applied_from, 0.01)], firings
    (c,) = s["rule_changes"]
    assert (c["step"], c["op"], c["rule"], c["field"], c["old"], c["new"]) == (
        applied_from, "set", "loss_high", "threshold", 100.0, 0.01), c
    assert c["command"] == "set loss_high.threshold=0.01" and c["time"] > s["started"]
    assert re.search(rf"RULE CHANGE at [\d-]+ [\d:]+, from step {applied_from} on: set loss_high\.threshold", out)
    # a finished run's rules do not change
    late = rules_cmd(run_dir, "set", "loss_high.threshold=5")
    assert late.returncode == 2 and "has finished (interrupted)" in late.stderr, late.stderr
    time.sleep(2)
    left = run_leftovers(before, run_dir, run_pids(run_dir))
    assert not left, f"processes left running: {left}"
