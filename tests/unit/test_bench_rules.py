"""The rules benchmark's pure parts (bench/_rules_records.py): a run's anomaly records read into
detection records, the launcher's hang and crash decisions, and the false-alarm statistics;
and the recorded npu-smi output a hot card is made of (bench/_card_faults.py).

No launch here: the benchmark itself is run by `make bench` (bench/rules.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import _card_faults  # noqa: E402
import _rules_records as R  # noqa: E402
import rules  # noqa: E402


def firing(rule, step, rank, seen_at=None, message="m"):
    return {"rule": rule, "step": step, "rank": rank, "seen_at": seen_at, "message": message}


INJ = R.Injection("slow@1:20", rank=1, step=20, at=1000.0)


def test_the_first_firing_of_a_detector_at_or_after_the_fault_catches_it():
    fs = [firing("loss_spike", 25, 0, 1009.0), firing("straggler", 22, 1, 1004.5),
          firing("compute_drop", 23, 1, 1006.0)]
    d = R.detect(fs, INJ, ("straggler", "compute_drop"))
    assert d.detected and d.by == "straggler" and d.step == 22 and d.steps == 2
    assert d.seconds == pytest.approx(4.5) and d.rank == 1 and d.right_rank is True
    assert d.early == []


def test_firings_before_the_fault_are_early_not_detections_and_a_wrong_rank_is_said():
    fs = [firing("compute_drop", 8, 1, 990.0), firing("compute_drop", 21, 0, 1003.0)]
    d = R.detect(fs, INJ, ("compute_drop",))
    assert d.detected and d.step == 21 and d.rank == 0 and d.right_rank is False
    assert [e["step"] for e in d.early] == [8]


def test_firings_are_taken_in_the_order_seen_and_unstamped_ones_last():
    fs = [firing("straggler", 30, 1, None), firing("compute_drop", 26, 1, 1012.0)]
    d = R.detect(fs, INJ, ("straggler", "compute_drop"))
    assert d.by == "compute_drop" and d.seconds == pytest.approx(12.0)
    only_unstamped = R.detect([firing("straggler", 30, 1, None)], INJ, ("straggler",))
    assert only_unstamped.detected and only_unstamped.seconds is None and only_unstamped.steps == 10


def test_no_detector_firing_is_a_miss():
    d = R.detect([firing("loss_spike", 25, 1, 1002.0)], INJ, ("straggler",))
    assert not d.detected and d.by is None and d.seconds is None and d.early == []


def test_an_injection_that_never_acted_has_no_time():
    inj = R.Injection("hang@0:50", 0, 50, R.injection_time({(0, 48): 5.0}, 0, 50))
    assert inj.at is None
    d = R.detect([firing("straggler", 51, 0, 1000.0)], inj, ("straggler",))
    assert d.detected and d.seconds is None
    assert R.injection_time({(0, 49): 5.0, (1, 49): 6.0}, 1, 50) == 6.0


def test_hang_and_crash_come_from_the_summary_and_the_launchers_line():
    s = {"status": "failed", "failure": {"kind": "hang", "ranks": [1], "root_cause_rank": 1, "message": "hang: ..."}}
    d = R.failure_detection(s, INJ, "hang", decided_at=1026.0)
    assert d.detected and d.by == "hang" and d.seconds == pytest.approx(26.0) and d.right_rank is True
    wrong = R.failure_detection(dict(s, failure=dict(s["failure"], root_cause_rank=0)), INJ, "hang", 1026.0)
    assert wrong.detected and wrong.right_rank is False
    other = R.failure_detection(s, INJ, "crash", 1026.0)
    assert not other.detected and "'hang'" in other.message
    assert not R.failure_detection({"status": "succeeded", "failure": None}, INJ, "crash", None).detected


def test_kind_summary_rates_medians_and_maxima():
    ds = [R.Detection(True, "nonfinite", 5, 0, 1.0, 1, True), R.Detection(True, "nonfinite", 9, 2, 3.0, 0, False),
          R.Detection(True, "nonfinite", 7, 1, 2.0, 1, True), R.Detection(False, early=[{"rule": "x"}])]
    k = R.kind_summary(ds)
    assert k["runs"] == 4 and k["detected"] == 3 and k["rate"] == 0.75
    assert k["seconds"] == {"n": 3, "median": 2.0, "max": 3.0}
    assert k["steps"] == {"n": 3, "median": 1.0, "max": 2.0}
    assert k["right_rank"] == 2 and k["right_rank_rate"] == pytest.approx(2 / 3) and k["early"] == 1
    empty = R.kind_summary([R.Detection(False)])
    assert empty["rate"] == 0 and empty["seconds"]["median"] is None and empty["right_rank_rate"] is None


def test_false_alarms_per_thousand_by_workload_and_rule():
    runs = [{"workload": "recipe", "rank_steps": 120, "steps": 60, "firings": [firing("compute_drop", 9, 1)]},
            {"workload": "recipe", "rank_steps": 80, "steps": 40, "firings": []},
            {"workload": "recipe8", "rank_steps": 800, "steps": 100,
             "firings": [firing("straggler", 7, 3), firing("compute_drop", 8, 2)]}]
    fa = R.false_alarms(runs)
    r = fa["by_workload"]["recipe"]
    assert (r["runs"], r["rank_steps"], r["steps"], r["firings"]) == (2, 200, 100, 1)
    assert r["per_1000_rank_steps"] == pytest.approx(5.0) and r["per_1000_steps"] == pytest.approx(10.0)
    t = fa["total"]
    assert t["rank_steps"] == 1000 and t["firings"] == 3 and t["per_1000_rank_steps"] == pytest.approx(3.0)
    assert t["by_rule"] == {"compute_drop": 2, "straggler": 1}
    assert R.false_alarms([])["total"]["per_1000_steps"] is None


def test_step_counts_leave_out_step_0_and_duplicates():
    assert R.step_counts([(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (0, 2), (1, 2)]) == (4, 2)


def test_a_fault_waits_for_the_baselines_of_its_rules():
    """The fault's first step follows from each rule's own warm-up and window, as configured."""
    from mindpulse.config import load_config

    cfg, _ = load_config(str(rules.C.ROOT / "cluster_configs" / "local_cpu.yaml"), [])
    assert rules.first_fault_step(()) == 3
    for case in rules.CASES:
        lo = rules.first_fault_step(case.baseline, case.sets)
        for kind in case.baseline:
            assert lo >= rules.rule_span(cfg, kind) + 2, (case.name, kind)
    assert rules.rule_span(cfg, "straggler") >= cfg.monitor.straggler_window


def test_the_hot_card_is_the_recorded_output_with_one_temperature_raised(tmp_path):
    from mindpulse.node.npu_smi import parse_npu_smi

    _card_faults.fake_npu_smi(tmp_path)
    hot = _card_faults.hot_copy(tmp_path, 3)
    before = {c.npu: c.temp_c for c in parse_npu_smi((tmp_path / "cards8" / "info.txt").read_text()).cards}
    after = {c.npu: c.temp_c for c in parse_npu_smi((hot / "info.txt").read_text()).cards}
    assert after[3] == _card_faults.HOT_C and before[3] < 95
    assert {k: v for k, v in after.items() if k != 3} == {k: v for k, v in before.items() if k != 3}
    assert f": {_card_faults.HOT_C}" in (hot / "temp_3.txt").read_text()
    assert (hot / "temp_2.txt").read_text() == (tmp_path / "cards8" / "temp_2.txt").read_text()


def test_the_report_names_the_rules_and_the_fields_figures():
    out = {"healthy": [{"workload": "recipe", "repeat": 0, "rank_steps": 120, "steps": 60,
                        "firings": [firing("compute_drop", 9, 1, message="compute drop: rank 1 ...")]}],
           "faults": {"runs": [{"case": "nonfinite", "detections": {"nonfinite": R.Detection(
               True, "nonfinite", 5, 0, 1.2, 1, True).to_record()}}]}}
    text = rules.render(out)
    assert "compute_drop 1" in text and "8.33" in text and "16.67" in text
    assert "compute drop: rank 1 ..." in text
    assert "1/1 (100%)" in text and "1.2 s, 1.2 s" in text and "Mycroft" in text and "0.84 false positives" in text
