"""Silent divergence between ranks (fingerprints) and stragglers, with real CPU ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).resolve().parent / "scripts" / "user_train.py"


def test_ranks_with_different_seeds_are_stopped_at_step_0(run_cli):
    r = run_cli("launch", "--set", f"job.script={SCRIPT}", "--set", "job.args=[--seed-per-rank, --steps, '6']",
                "--set", "name=seeds", timeout=300)
    assert r.returncode == 3, r.output
    s = r.summary
    assert s["status"] == "anomaly_stop"
    assert s["stop"]["rule"] == "desync" and s["stop"]["rank"] == 1 and s["stop"]["step"] == 0, s["stop"]
    assert "seed" in s["stop"]["message"]
    assert s["steps_completed"] == 0 and [x["last_step"] for x in s["ranks"]] == [0, 0]


def test_inject_desync_at_step_0_stops_with_rank_1(run_cli):
    r = run_cli("launch", "--set", "train.steps=6", "--inject", "desync@1:0", timeout=300)
    assert r.returncode == 3, r.output
    stop = r.summary["stop"]
    assert stop["rule"] == "desync" and stop["rank"] == 1 and stop["step"] == 0


def test_slow_data_path_names_rank_1_as_straggler(run_cli):
    r = run_cli("launch", "--set", "train.steps=9", "--inject", "slow@1:3", "--set", "monitor.straggler_window=4",
                "--set", "monitor.per_print_step=3", timeout=400)
    assert r.returncode == 0, r.output
    recs = json.loads((r.run_dir / "anomalies.json").read_text())
    strag = [x for x in recs if x["rule"] == "straggler"]
    assert strag and {x["rank"] for x in strag} == {1}, recs
    assert strag[0]["step"] <= 3 + 4, strag
    assert "STRAGGLER" in r.stdout
