"""Pre-flight card check: the verdict (slow, failed), preflight.json's shape, the table,
the `preflight.*` config, the slow_card fault spec, and the in-rank matmul on this CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mindpulse.config import ConfigError, from_dict
from mindpulse.config.fault_specs import Fault, FaultKind, parse_fault
from mindpulse.config.rank_settings import RankSettings
from mindpulse.launcher import card_check
from mindpulse.launcher.card_check import build_report, format_table, judge, verdict_message
from mindpulse.launcher.preflight import LaunchRefused
from mindpulse.launcher.spec import ExitCode, RunStatus
from mindpulse.wire.protocol import Action

ROOT = Path(__file__).resolve().parents[2]


def row(rank: int, gflops: float | None, gbps: float | None, reason: str = "") -> dict:
    return {"rank": rank, "node": 0, "card": rank, "host": "h", "matmul_gflops": gflops, "allreduce_gbps": gbps,
            "ok": True, "reason": reason}


# ---- the verdict ------------------------------------------------------------------------------
def test_every_card_alike_is_ok():
    rows = [row(r, 100.0 + r, 5.0) for r in range(4)]
    v = judge(rows, 0.8)
    assert v["slow"] == [] and v["failed"] == []
    assert v["median"] == {"matmul_gflops": 101.5, "allreduce_gbps": 5.0}
    assert all(r["ok"] and r["reason"] == "" for r in rows)


def test_a_card_below_min_ratio_of_the_median_is_slow_and_says_by_how_much():
    rows = [row(0, 100.0, 5.0), row(1, 100.0, 5.0), row(2, 25.0, 5.0), row(3, 100.0, 5.0)]
    v = judge(rows, 0.8)
    assert v["slow"] == [2] and v["failed"] == []
    assert rows[2]["ok"] is False
    assert rows[2]["reason"] == "slow: matmul 25 GFLOP/s < 0.8 x median 100"
    assert all(rows[r]["ok"] for r in (0, 1, 3))


def test_slow_all_reduce_and_the_boundary():
    rows = [row(0, 100.0, 10.0), row(1, 100.0, 7.9), row(2, 80.0, 10.0)]
    v = judge(rows, 0.8)
    assert v["slow"] == [1]  # 80 == 0.8 x 100 is not below it
    assert "all-reduce 7.9 GB/s < 0.8 x median 10" in rows[1]["reason"]


def test_failed_ranks_are_kept_out_of_the_median():
    rows = [row(0, 100.0, 5.0), row(1, None, None, "rank process died: killed"), row(2, 90.0, 5.0),
            row(3, 0.0, 5.0), row(4, 95.0, float("nan"))]
    v = judge(rows, 0.8)
    assert v["failed"] == [1, 3, 4] and v["slow"] == []
    assert v["median"]["matmul_gflops"] == 95.0
    assert rows[1]["reason"] == "rank process died: killed"
    assert rows[3]["reason"] == "no matmul_gflops result"
    assert rows[4]["reason"] == "no allreduce_gbps result"
    assert not any(rows[r]["ok"] for r in (1, 3, 4))


def test_every_rank_failed_has_no_median():
    rows = [row(0, None, None, "no result"), row(1, None, None, "no result")]
    v = judge(rows, 0.8)
    assert v["failed"] == [0, 1] and v["median"] == {"matmul_gflops": None, "allreduce_gbps": None}


def test_one_rank_is_never_slow_against_itself():
    rows = [row(0, 3.0, 0.1)]
    assert judge(rows, 1.0)["slow"] == []


# ---- preflight.json ----------------------------------------------------------------------------
def result(rank: int, gflops: float, gbps: float, phase: str = "done", errors=()) -> dict:
    return {"rank": rank, "host": f"host{rank}", "phase": phase, "errors": list(errors), "backend": "mccl",
            "matmul_size": 512, "allreduce_bytes": 4 << 20, "matmul_gflops": gflops,
            "allreduce_gbps": gbps if phase == "done" else None}


def test_report_shape_and_rank_placement():
    cfg = from_dict({"world": {"nodes": 2, "ranks_per_node": 2, "devices": [4, 6]}, "ray": {"address": "auto"}})
    results = {0: result(0, 50.0, 2.0), 1: result(1, 52.0, 2.0), 2: result(2, 10.0, 2.0), 3: result(3, 49.0, 2.0)}
    rep = build_report(cfg, results, {}, 1000.0, 1012.5)
    assert set(rep) == {"ok", "refuse", "action", "min_ratio", "refuse_ratio", "world_size", "device", "backend",
                        "matmul_size", "matmul_seconds", "allreduce_bytes", "allreduce_iters", "median", "ranks",
                        "slow", "too_slow", "failed", "started", "ended", "seconds", "message"}
    assert [list(r) for r in rep["ranks"]] == [list(card_check.ROW_FIELDS)] * 4
    assert [(r["rank"], r["node"], r["card"]) for r in rep["ranks"]] == [(0, 0, 4), (1, 0, 6), (2, 1, 4), (3, 1, 6)]
    assert rep["slow"] == [2] and rep["failed"] == [] and rep["ok"] is False
    assert rep["seconds"] == 12.5 and rep["started"] == 1000.0 and rep["ended"] == 1012.5
    assert rep["backend"] == "mccl" and rep["action"] == "warn" and rep["world_size"] == 4
    assert rep["too_slow"] == [2] and rep["refuse"] is True  # 10 < 0.5 x the median: refused even under warn
    assert "slow rank(s) [2]: rank 2 matmul 10 GFLOP/s < 0.8 x median" in rep["message"]
    json.dumps(rep, allow_nan=False)  # preflight.json and --json: plain JSON


def test_report_names_why_a_rank_has_no_figures():
    cfg = from_dict({"world": {"ranks_per_node": 4}})
    results = {0: result(0, 50.0, 2.0), 1: result(1, 50.0, 0.0, phase="matmul"),
               2: result(2, 50.0, 2.0, errors=["matmul product wrong: largest relative error 0.5 (allowed 0.02)"])}
    rep = build_report(cfg, results, {1: "no result within preflight.timeout_s (600 s)", 3: "exit code 1"}, 0, 1)
    assert rep["failed"] == [1, 2, 3] and rep["slow"] == []
    rows = {r["rank"]: r for r in rep["ranks"]}
    assert rows[1]["matmul_gflops"] == 50.0 and rows[1]["allreduce_gbps"] is None
    assert rows[1]["reason"].startswith("no result within preflight.timeout_s")
    assert rows[2]["reason"].startswith("matmul product wrong")
    assert rows[3]["reason"] == "exit code 1" and rows[3]["host"] is None
    assert "failed rank(s) [1, 2, 3]" in rep["message"]


def test_report_all_ok_message():
    cfg = from_dict({})
    rep = build_report(cfg, {0: result(0, 10.0, 0.05), 1: result(1, 11.0, 0.05)}, {}, 0.0, 3.25)
    assert rep["ok"] is True and rep["slow"] == [] and rep["failed"] == []
    assert verdict_message(rep) == "pre-flight card check: all 2 ranks ok (3.2 s)"


def test_table_has_the_fields_every_rank_and_the_verdict():
    cfg = from_dict({})
    rep = build_report(cfg, {0: result(0, 10.0, 0.05), 1: result(1, 2.5, 0.05)}, {}, 0.0, 3.0)
    text = format_table(rep)
    header = text.splitlines()[1].split()
    assert header == list(card_check.ROW_FIELDS)
    assert "NO" in text and "slow: matmul 2.5 GFLOP/s < 0.8 x median 6.25" in text
    assert "median" in text and "slow: [1]  failed: []" in text
    assert "matmul 512x512 float32 for 2 s, all-reduce 4 MiB x10 over mccl" in text


# ---- config, faults, exit code -------------------------------------------------------------------
def test_enabled_is_auto_by_nodes_unless_set():
    assert card_check.enabled(from_dict({})) is False
    assert card_check.enabled(from_dict({"world": {"nodes": 2}})) is True
    assert card_check.enabled(from_dict({"preflight": {"enabled": "auto"}, "world": {"nodes": 3}})) is True
    assert card_check.enabled(from_dict({"preflight": {"enabled": True}})) is True
    assert card_check.enabled(from_dict({"world": {"nodes": 2}, "preflight": {"enabled": False}})) is False
    cfg = from_dict({"preflight": {"enabled": "auto", "action": "warn"}})
    assert cfg.preflight.enabled is None and cfg.preflight.action is Action.WARN
    assert cfg.to_dict()["preflight"]["enabled"] is None  # round-trips through config.yaml and job.json
    assert from_dict(cfg.to_dict()).preflight.enabled is None


@pytest.mark.parametrize("raw, needle", [
    ({"enabled": "maybe"}, "preflight.enabled: 'maybe' is not allowed; use true or false"),
    ({"action": "refuse"}, "preflight.action: 'refuse' is not allowed; use one of 'stop', 'warn'"),
    ({"min_ratio": 0}, "preflight.min_ratio: 0.0 is not allowed; use a number in (0, 1]"),
    ({"min_ratio": 1.5}, "preflight.min_ratio: 1.5 is not allowed"),
    ({"refuse_ratio": 0.9}, "preflight.refuse_ratio: 0.9 is not allowed; use a number in (0, preflight.min_ratio"),
    ({"matmul_size": -1}, "preflight.matmul_size: -1 is not allowed"),
    ({"matmul_seconds": 0}, "preflight.matmul_seconds: 0.0 is not allowed"),
    ({"allreduce_mb": 0}, "preflight.allreduce_mb: 0.0 is not allowed"),
    ({"allreduce_iters": 0}, "preflight.allreduce_iters: 0 is not allowed"),
    ({"timeout_s": -5}, "preflight.timeout_s: -5.0 is not allowed"),
    ({"timeout_s": ".inf"}, "preflight.timeout_s"),
    ({"min_rato": 0.5}, "preflight.min_rato: unknown key"),
])
def test_bad_preflight_values_name_the_field(raw, needle):
    with pytest.raises(ConfigError, match=None) as exc:
        from_dict({"preflight": raw})
    assert needle in str(exc.value)


def test_slow_card_fault_spec():
    f = parse_fault("slow_card@1", world_size=2)
    assert f == Fault(FaultKind.SLOW_CARD, 1, 0) and str(f) == "slow_card@1"
    assert parse_fault(str(f)) == f
    with pytest.raises(ValueError, match="before any step; write slow_card@1"):
        parse_fault("slow_card@1:5")
    with pytest.raises(ValueError, match="needs the step it acts at; use nan_grad@1:STEP"):
        parse_fault("nan_grad@1")
    with pytest.raises(ValueError, match="rank 2 does not exist"):
        parse_fault("slow_card@2", world_size=2)
    assert str(parse_fault("nan_grad@1:5")) == "nan_grad@1:5"  # the step faults are as before
    with pytest.raises(ConfigError, match=r"faults\[0\]"):
        from_dict({"faults": ["slow_card@1:3"]})


def test_slow_card_in_a_launch_without_the_check_is_refused():
    cfg = from_dict({"faults": ["slow_card@1"]})
    with pytest.raises(LaunchRefused, match="slow_card@1 rehearses the pre-flight card check.*preflight.enabled=true"):
        card_check.check_faults(cfg, card_check.enabled(cfg))
    card_check.check_faults(cfg, True)  # `mindpulse preflight`, or preflight.enabled
    card_check.check_faults(from_dict({"faults": ["nan_grad@1:5"]}), False)


def test_card_check_repeats_only_under_slow_card(capsys):
    from mindpulse.workers.faults import SLOW_CARD_FACTOR, card_check_repeats

    assert card_check_repeats(1, [parse_fault("slow_card@1")]) == SLOW_CARD_FACTOR > 1
    assert "injecting fault slow_card@1" in capsys.readouterr().out
    assert card_check_repeats(0, []) == 1
    assert card_check_repeats(1, [parse_fault("slow@1:3")]) == 1


def test_preflight_failed_exits_4():
    assert ExitCode.of(RunStatus.PREFLIGHT_FAILED) == ExitCode.PREFLIGHT == 4


def test_rank_settings_task_travels_in_job_json():
    from mindpulse.launcher.spec import rank_settings

    cfg = from_dict({})
    kw = dict(run_dir="/r", run_id="x", attempt=0, aggregator="agg", ray_address="", relays={0: "127.0.0.1:1"},
              resume=None)
    s = rank_settings(cfg, task="card_check", **kw)
    assert RankSettings.from_json(s.to_json()).task == "card_check"
    old = json.loads(rank_settings(cfg, **kw).to_json())
    old.pop("task")  # a job.json of before: the ranks train
    assert RankSettings.from_dict(old).task == "train"


def test_cli_preflight_bad_config_exits_2_and_starts_nothing(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mindpulse.launcher.cli", "preflight", "--set",
                           "preflight.min_ratio=2", "--set", f"output.root={tmp_path / 'runs'}"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert "preflight.min_ratio: 2.0 is not allowed" in proc.stderr
    assert not (tmp_path / "runs").exists()


def test_cli_documents_exit_code_4():
    from mindpulse.launcher import cli

    assert "4 refused by the pre-flight card check" in cli.__doc__
    assert "4 refused by the pre-flight card check" in (ROOT / "README.md").read_text()


# ---- in the rank (MindSpore on this CPU, no cluster) -------------------------------------------
def test_matmul_benchmark_measures_and_checks_the_product():
    from mindpulse.workers.card_check import matmul_benchmark

    res = matmul_benchmark(128, 0.2)
    assert res["matmul_ok"] and res["matmul_rel_error"] < 1e-4
    assert res["matmul_count"] >= 1 and res["matmul_s"] >= 0.2
    assert res["matmul_gflops_window"] == pytest.approx(2 * 128 ** 3 * res["matmul_count"] / res["matmul_s"] / 1e9)
    # the judged figure is the median of the ~50 ms chunks' rates: a figure the window also reached
    assert res["matmul_chunks"] >= 1 and 0 < res["matmul_gflops"] < 50 * res["matmul_gflops_window"]



@pytest.mark.parametrize("gflops, action, slow, too_slow, refuse", [
    (45.0, "warn", [], [], False),       # 0.9 x the median: ok
    (35.0, "warn", [2], [], False),      # 0.7 x: reported, trains (a shared or busy host)
    (35.0, "stop", [2], [], True),       # ... refused with action stop (the old behaviour)
    (20.0, "warn", [2], [2], True),      # 0.4 x: below the refuse ratio, refused whatever the action
])
def test_two_bounds_report_a_slow_card_and_refuse_a_much_slower_one(gflops, action, slow, too_slow, refuse):
    cfg = from_dict({"world": {"ranks_per_node": 4}, "preflight": {"action": action}})
    results = {0: result(0, 50.0, 2.0), 1: result(1, 52.0, 2.0), 2: result(2, gflops, 2.0), 3: result(3, 49.0, 2.0)}
    rep = build_report(cfg, results, {}, 0.0, 1.0)
    assert (rep["slow"], rep["too_slow"], rep["refuse"]) == (slow, too_slow, refuse), rep["message"]
    assert rep["ok"] is (not slow)


def test_a_failed_card_refuses_under_warn_too():
    cfg = from_dict({"world": {"ranks_per_node": 2}})
    rep = build_report(cfg, {0: result(0, 50.0, 2.0)}, {1: "crashed"}, 0.0, 1.0)
    assert rep["failed"] == [1] and rep["refuse"] is True and rep["action"] == "warn"
