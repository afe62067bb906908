"""The launcher's end of a run: summary.json written, then the console summary in the report's
order (the status and why first, times as dates), then the report, from one read of the run."""

from __future__ import annotations

import datetime as dt
import json
import re
import time

import pytest

from mindpulse.aggregator.core import AggregatorCore
from mindpulse.config import from_dict
from mindpulse.launcher.rundir import write_config
from mindpulse.launcher.spec import RankOutcome, RunResult, RunStatus
from mindpulse.launcher.summary import RunHistory, write_summary
from mindpulse.wire.protocol import StepPacket, TelemetryPacket

WORLD = 2
STEPS = 8
T0 = time.time() - 600
EPOCH_NUMBER = re.compile(r"\b1[5-9]\d{8}(\.\d+)?\b")


def _cfg(tmp_path, report: bool = True):
    return from_dict({"name": "eor", "world": {"nodes": 1, "ranks_per_node": WORLD},
                      "train": {"steps": STEPS}, "output": {"root": str(tmp_path), "report": report}})


def _aggregate(run_dir, steps: int = STEPS) -> dict:
    """A real aggregator fed real packets: its metrics file and its snapshot for the summary."""
    core = AggregatorCore(run_dir, world_size=WORLD, settings={"tensorboard": False, "monitor": {"collect_freq": 4}})
    for s in range(steps + 1):
        core.ingest([StepPacket(rank=r, step=s, loss=None if s == 0 else 2.0 / s + 0.01 * r, lr=1e-3,
                                grad_norm=1.0, grad_norm_local=1.0, step_time_s=0.5, samples=8, ts=T0 + s,
                                monitor_self_s=0.001 * (r + 1), monitor_wait_s=0.01,
                                fingerprint="fp" if s % 4 == 0 else None).encode() for r in range(WORLD)])
        core.ingest([TelemetryPacket(node="node0-vm", ts=T0 + s, source="psutil", cards=[
            {"card": -1, "name": "cpu", "util_pct": 90.0, "memory_used_mb": 2000.0, "source": "psutil"}]).encode()])
    snap = core.snapshot()
    core.close()
    return snap


def _end(tmp_path, result: RunResult, report: bool = True, steps: int = STEPS) -> tuple[list[str], dict]:
    run_dir = tmp_path / "run"
    snap = _aggregate(run_dir, steps)
    (run_dir / "logs").mkdir()
    cfg = _cfg(tmp_path, report)
    write_config(run_dir, cfg)  # as the launcher does when it makes the run directory
    lines: list[str] = []
    started = T0 - 5
    _, summary = write_summary(cfg, run_dir, result, snap, RunHistory(logs_dir=run_dir / "logs"),
                               {"ray_temp_dir": "/tmp/ray-x"}, started, lines.append)
    return "\n".join(lines).splitlines(), summary


def test_the_console_summary_starts_with_status_and_why_and_shows_dates(tmp_path):
    ok = RunResult(RunStatus.SUCCEEDED, {r: RankOutcome(r, exit_code=0) for r in range(WORLD)})
    out, summary = _end(tmp_path, ok)
    written = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert written["status"] == "succeeded"
    # every run total of the metric registry (Reduction.total), summed over ranks and steps 0..8
    assert written["monitor_self_s"] == pytest.approx(0.003 * (STEPS + 1)), written
    assert written["monitor_wait_s"] == pytest.approx(0.02 * (STEPS + 1)), written
    start = out.index("run eor: succeeded — completed all 8 steps")
    block = out[start:]
    labels = [ln.strip().split("  ")[0] for ln in block[1:] if ln.startswith("  ")][:7]
    assert labels == ["wall time", "steps", "loss (mean)", "throughput", "world", "goodput", "best checkpoint"], block
    wall = next(ln for ln in block if ln.strip().startswith("wall time"))
    began = dt.datetime.fromtimestamp(summary["started"]).astimezone()
    assert f"{began:%Y-%m-%d %H:%M:%S}" in wall and "→" in wall, wall
    assert "  loss (mean)      2.0050 (step 1) → best 0.2550 (step 8) → last 0.2550 (step 8)" in block
    assert "  throughput       32.0 samples/s, 0.5 s per step" in "\n".join(block)
    # the registry's run totals in the report's monitor line (the console's text with a report)
    # and in the totals table (the console's text without one)
    assert "ranks blocked on the monitor 0.180 s in all; ranks spent in mindpulse's code 0.027 s in all" in (
        "\n".join(out))
    from mindpulse.reporting.tables import totals_table

    rows = totals_table(summary).splitlines()
    assert any(ln.startswith("monitor wait s (all ranks)") and ln.endswith("0.180") for ln in rows), rows
    assert any(ln.startswith("monitor self s (all ranks)") and ln.endswith("0.027") for ln in rows), rows
    assert "node0-vm/cpu" in next(ln for ln in block if ln.strip().startswith("world"))
    text = "\n".join(out)
    assert not EPOCH_NUMBER.search(text), f"an epoch number on the console:\n{text}"
    assert "ray-x" not in text, "the console summary shows no pids or temp dirs"
    # the last lines: the outcome with its exit code, and where the report is
    assert out[-2] == f"mindpulse: succeeded (exit code 0); run directory {tmp_path / 'run'}"
    assert out[-1] == f"mindpulse: report {tmp_path / 'run' / 'report' / 'report.html'}"
    page = (tmp_path / "run" / "report" / "report.html").read_text()
    assert 'id="status">succeeded<' in page


def test_a_failed_run_says_its_root_cause_after_the_traceback(tmp_path):
    outcomes = {0: RankOutcome(0, exit_code=1, error="RuntimeError: out of memory on rank 0\nsecond line",
                               traceback="Traceback (most recent call last):\n  File \"x.py\", line 1\n"
                                         "RuntimeError: out of memory on rank 0"),
                1: RankOutcome(1, exit_code=None, error="stopped after another rank failed")}
    failed = RunResult(RunStatus.FAILED, outcomes, message="rank 0 failed", order=[0, 1])
    out, summary = _end(tmp_path, failed, report=False, steps=5)
    assert summary["failure"]["root_cause_rank"] == 0
    tb = out.index("  traceback of the root cause:")  # the failure block, printed first, stays
    head = next(i for i, ln in enumerate(out) if ln.startswith("run eor: failed"))
    assert tb < head
    assert out[head] == "run eor: failed — rank 0 failed at step 5 (the root cause), exit code 1"
    assert out[head + 1].strip() == "RuntimeError: out of memory on rank 0"
    # output.report off: no report, and the summary is read without replaying the metrics
    assert not (tmp_path / "run" / "report").exists()
    assert any(ln.strip().startswith("throughput") and ln.strip().endswith("-") for ln in out)
    assert out[-1] == f"mindpulse: failed (exit code 1); run directory {tmp_path / 'run'}"
