"""`make bench` (the performance pieces) and `make bench-rules` (the rules campaign) each
merge into the one record docs/benchmarks.md is written from (bench/run_all.py): neither
loses the other's figures, and the 20-minute row reads the performance run's own time."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import run_all  # noqa: E402


def _attempt(wall_s: float) -> dict:
    return {"args": [], "rc": 0, "wall_s": wall_s, "foreign": {"mean_cores": 0.0}, "log": "", "ok": True, "kept": True}


def _run(pieces: list[str], started: str, total_s: float, perf_s: float | None) -> dict:
    return {"started": started, "total_s": total_s, "waited_for_quiet_s": 0.0, "machine": {"cpu": started},
            "perf_s": perf_s, "attempts": {n: [_attempt(total_s / len(pieces))] for n in pieces}}


def _pieces(names):
    return [p for p in run_all.PIECES if p.name in names]


def test_the_two_commands_merge_into_one_record(tmp_path, monkeypatch):
    monkeypatch.setattr(run_all, "RESULTS", tmp_path)
    perf = sorted(run_all.PERF_NAMES)
    assert "rules" not in perf and {"overhead", "fanin", "startup"} <= set(perf)

    (tmp_path / "run_all.json").write_text(json.dumps(_run(perf, "day 1 10:00", 900.0, 900.0)))
    rules = run_all.merged_run(_run(["rules"], "day 1 11:00", 1500.0, None), _pieces({"rules"}), "day 1 11:00")
    assert rules["perf_s"] == 900.0, "a rules campaign keeps the performance run's time"
    assert set(rules["attempts"]) == {*perf, "rules"}
    assert rules["started"].startswith("day 1 10:00") and "rules re-run day 1 11:00" in rules["started"]
    (tmp_path / "run_all.json").write_text(json.dumps(rules))

    again = run_all.merged_run(_run(perf, "day 2 09:00", 1000.0, 1000.0), _pieces(set(perf)), "day 2 09:00")
    assert again["perf_s"] == 1000.0 and again["machine"] == {"cpu": "day 2 09:00"}, "a new make bench leads the record"
    assert again["started"] == "day 2 09:00; rules campaign day 1 11:00"
    assert again["attempts"]["rules"][0]["wall_s"] == 1500.0, "the rules campaign's attempt is kept"


def test_the_twenty_minute_row_reads_the_performance_run_alone():
    table, verdicts = run_all.targets_table({}, 1000.0, rules_wall_s=1500.0)
    assert "16.7 min" in table and "`make bench-rules`; its last run took 25.0 min" in table
    assert verdicts == ["met"]
    table, verdicts = run_all.targets_table({}, 1300.0)
    assert verdicts == ["missed"] and "1.7 min over" in table
    table, verdicts = run_all.targets_table({}, None)
    assert verdicts == ["missed"] and "no run of every performance piece recorded" in table


def test_a_piece_that_failed_in_every_attempt_misses_the_twenty_minute_row(tmp_path):
    """A run that timed every piece but one of which never succeeded did not run every piece:
    the row is missed and names it, however short the run was."""
    table, verdicts = run_all.targets_table({}, 900.0, perf_failed=("overhead",))
    assert verdicts == ["missed"] and "overhead failed in every attempt" in table, table

    quiet = {"mean_cores": 0.0, "max_cores": 0.0, "top": []}
    failed = run_all.Attempt(**{**_attempt(120.0), "rc": 1, "ok": False, "kept": False, "foreign": quiet})
    ok = run_all.Attempt(**{**_attempt(60.0), "foreign": quiet})
    perf = sorted(run_all.PERF_NAMES)
    attempts = {n: [ok] for n in perf} | {"overhead": [failed, failed]}
    machine = {"cpu": "x", "cores": 2, "ram_gib": 24, "os": "linux", "python": "3.11", "mindspore": "2.9.0",
               "mindformers": "1.9.0", "ray": "2.60.0", "msgpack": "1.2.4"}
    report = run_all.build_report(_pieces(set(perf)), attempts, machine, "day 1",
                                  900.0, 0.0, 1200.0, 900.0, results=tmp_path)
    assert "overhead failed in every attempt" in report["doc"], "build_report reads the failures from the attempts"
    attempts["overhead"] = [failed, ok]
    report = run_all.build_report(_pieces(set(perf)), attempts, machine, "day 1",
                                  900.0, 0.0, 1200.0, 900.0, results=tmp_path)
    assert "failed in every attempt" not in report["doc"] and "15.0 min" in report["doc"]


def test_a_failed_piece_rerun_alone_leaves_the_timed_run_missed(tmp_path, monkeypatch):
    """`--only overhead` after a `make bench` whose overhead failed: the record keeps which pieces
    failed in the timed run, so the documents written again still read the row missed (the
    re-run's success is not that run's)."""
    monkeypatch.setattr(run_all, "RESULTS", tmp_path)
    perf = sorted(run_all.PERF_NAMES)
    timed = _run(perf, "day 1 10:00", 900.0, 900.0)
    timed["attempts"]["overhead"][0].update(ok=False, rc=1, kept=False)
    timed["perf_failed"] = ["overhead"]
    (tmp_path / "run_all.json").write_text(json.dumps(timed))
    again = run_all.merged_run(_run(["overhead"], "day 1 11:00", 400.0, None), _pieces({"overhead"}), "day 1 11:00")
    assert again["perf_failed"] == ["overhead"] and again["attempts"]["overhead"][0]["ok"]
    for d in again["attempts"].values():
        for a in d:
            a["foreign"] = {"mean_cores": 0.0, "max_cores": 0.0, "top": []}
    again["machine"] = {"cpu": "x", "cores": 2, "ram_gib": 24, "os": "linux", "python": "3.11", "mindspore": "2.9.0",
                        "mindformers": "1.9.0", "ray": "2.60.0", "msgpack": "1.2.4"}
    (tmp_path / "run_all.json").write_text(json.dumps(again))
    doc = tmp_path / "benchmarks.md"
    monkeypatch.setattr(run_all, "DOC", doc)
    monkeypatch.setattr(run_all.C, "ROOT", tmp_path)  # the path it prints is the document's under the root
    run_all.rewrite_docs(1200.0)
    assert "overhead failed in every attempt" in doc.read_text()


def test_the_date_line_names_every_piece_re_run_since_the_timed_run(tmp_path, monkeypatch):
    """Two pieces re-run one after the other: the record's date line names both, each with its
    last re-run (the figures of the first must not read as the timed run's)."""
    monkeypatch.setattr(run_all, "RESULTS", tmp_path)
    perf = sorted(run_all.PERF_NAMES)
    (tmp_path / "run_all.json").write_text(json.dumps(_run(perf, "day 1 10:00", 900.0, 900.0)))
    for piece, at in (("fanin", "day 1 11:00"), ("fanin", "day 1 12:00"), ("fanin_sinks", "day 1 13:00")):
        merged = run_all.merged_run(_run([piece], at, 60.0, None), _pieces({piece}), at)
        (tmp_path / "run_all.json").write_text(json.dumps(merged))
    assert merged["started"] == "day 1 10:00; fanin re-run day 1 12:00; fanin_sinks re-run day 1 13:00"
