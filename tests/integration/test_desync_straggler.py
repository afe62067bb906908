"""Silent divergence between ranks (fingerprints), with real CPU ranks (stragglers: test_compute_mfu.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.cluster]
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
