"""The pre-flight card check end to end, with real ranks on this machine's CPUs: the check
alone (`mindpulse preflight --json`), and a launch it refuses (`--inject slow_card@1`)."""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.cluster]


# a healthy machine's ranks are judged by their measured speed against each other: alone
@pytest.mark.exclusive
def test_preflight_json_on_the_default_config(run_cli):
    r = run_cli("preflight", "--json", timeout=400)
    assert r.returncode == 0, r.output
    report = json.loads(r.stdout)
    assert report["ok"] is True and report["slow"] == [] and report["failed"] == [], report
    assert [x["rank"] for x in report["ranks"]] == [0, 1]
    for x in report["ranks"]:
        assert x["ok"] is True and x["reason"] == ""
        assert x["matmul_gflops"] > 0 and x["allreduce_gbps"] > 0
        assert x["node"] == 0 and x["card"] == x["rank"] and x["host"]
    assert report["backend"] == "mccl" and report["world_size"] == 2
    assert 0 < report["seconds"] == pytest.approx(report["ended"] - report["started"])
    assert r.run_dir is not None
    assert json.loads((r.run_dir / "preflight.json").read_text()) == report
    logs = r.run_dir / "preflight" / "logs"
    assert "card check: matmul 512x512 float32" in (logs / "rank_1.log").read_text(errors="replace")
    assert not (r.run_dir / "summary.json").exists()  # nothing trained: no run summary


# the slow card is judged by its measured speed
@pytest.mark.exclusive
def test_a_slow_card_refuses_the_launch_before_training(run_cli):
    # action stop: refused for any slow card (4x the work measures 0.3-0.6 x the median on this
    # shared 2-core machine, around the refuse ratio; the two bounds are unit-tested)
    r = run_cli("launch", "--set", "preflight.enabled=true", "--set", "preflight.action=stop",
                "--inject", "slow_card@1", timeout=400)
    assert r.returncode == 4, r.output
    s = r.summary
    assert s["status"] == "preflight_failed" and s["exit_code"] == 4
    assert "slow rank(s) [1]" in s["message"] and "rank 1 matmul" in s["message"], s["message"]
    assert "slow rank(s) [1]" in r.stdout
    report = json.loads((r.run_dir / "preflight.json").read_text())
    assert report["slow"] == [1] and report["failed"] == [] and report["ok"] is False
    assert report["refuse"] is True and report["action"] == "stop"
    ratio = {x["rank"]: x for x in report["ranks"]}[1]["matmul_gflops"] / report["median"]["matmul_gflops"]
    assert report["too_slow"] == ([1] if ratio < report["refuse_ratio"] else []), (ratio, report["too_slow"])
    rows = {x["rank"]: x for x in report["ranks"]}
    assert rows[0]["ok"] and not rows[1]["ok"] and rows[1]["reason"].startswith("slow: matmul")
    assert rows[1]["matmul_gflops"] < 0.8 * report["median"]["matmul_gflops"]
    assert "injecting fault slow_card@1" in (r.run_dir / "preflight" / "logs" / "rank_1.log").read_text()
    # no training step ran: no training rank was started, the aggregator saw no step
    assert s["steps_completed"] == 0 and all(x["last_step"] == 0 for x in s["ranks"])
    assert not list((r.run_dir / "logs").glob("rank_*.log"))
    assert not (r.run_dir / "metrics.msgpack").exists()
