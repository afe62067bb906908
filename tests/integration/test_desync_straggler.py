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
    # found in the step-0 fingerprints; ranks run one step ahead (monitor.max_lag_steps: 1)
    assert s["stop"]["rule"] == "desync" and s["stop"]["rank"] == 1 and s["stop"]["decided_at"] == 0, s["stop"]
    assert s["stop"]["step"] == 1
    # rank 1 alone differs (on a 1-1 tie the group holding rank 0 is the reference), at step 0
    assert s["stop"]["message"].startswith("parameters out of sync at step 0: ranks [1] differ from the "
                                           "majority [0] (fingerprint "), s["stop"]
    assert s["steps_completed"] == 1 and [x["last_step"] for x in s["ranks"]] == [1, 1]


def test_inject_desync_at_step_0_stops_with_rank_1(run_cli):
    r = run_cli("launch", "--set", "train.steps=6", "--inject", "desync@1:0", timeout=300)
    assert r.returncode == 3, r.output
    stop = r.summary["stop"]
    assert stop["rule"] == "desync" and stop["rank"] == 1 and stop["decided_at"] == 0 and stop["step"] == 1


def test_slow_data_path_names_rank_1_as_straggler(run_cli):
    r = run_cli("launch", "--set", "train.steps=9", "--inject", "slow@1:3", "--set", "monitor.straggler_window=4",
                "--set", "monitor.per_print_step=3", timeout=400)
    assert r.returncode == 0, r.output
    recs = json.loads((r.run_dir / "anomalies.json").read_text())
    strag = [x for x in recs if x["rule"] == "straggler"]
    assert strag and {x["rank"] for x in strag} == {1}, recs
    assert strag[0]["step"] <= 3 + 4, strag
    assert "STRAGGLER" in r.stdout
