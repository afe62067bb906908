"""The compatibility matrix's pure parts (compat/): the pairs it runs, how a launch is judged,
what mindpulse adds to a user's environment, the MindFormers API check and the generated table.
The launches themselves: tests/integration/test_compat_matrix.py and `make compat`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "compat"))

import doc  # noqa: E402
import features  # noqa: E402
import matrix  # noqa: E402
import mindformers_next  # noqa: E402
import venvs  # noqa: E402

from mindpulse.frameworks.framework_support import MINDFORMERS_PAIRS  # noqa: E402

F = matrix.Feature


def test_every_supported_pair_is_in_the_matrix_with_its_features():
    rows = {p.name: feats for p, feats in matrix.supported_pairs()}
    for mf, ms in MINDFORMERS_PAIRS.items():
        assert rows[f"ms{ms}-mf{mf}"] == (F.SCRIPT_MODEL_TRAIN, F.SCRIPT_HAND_LOOP, F.MINDFORMERS_YAML, F.RECIPE)
    for ms in matrix.MINDSPORE_ONLY:
        assert rows[f"ms{ms}"] == matrix.SCRIPT
    order = [tuple(map(int, p.mindspore.split("."))) for p, _ in matrix.supported_pairs()]
    assert order == sorted(order), "oldest MindSpore first"
    assert all(p.partial for p, _ in matrix.tried_pairs())


def test_the_ci_pairs_are_the_oldest_mindformers_pair_and_the_newest_mindspore():
    from mindpulse.frameworks.framework_support import MINDSPORE_BELOW

    oldest, newest = (p for p, _ in matrix.oldest_and_newest())
    oldest_mf = min(MINDFORMERS_PAIRS, key=lambda v: tuple(map(int, v.split("."))))
    assert (oldest.mindformers, oldest.mindspore) == (oldest_mf, MINDFORMERS_PAIRS[oldest_mf]), oldest
    versions = [tuple(map(int, p.mindspore.split("."))) for p, _ in matrix.supported_pairs()]
    assert tuple(map(int, newest.mindspore.split("."))) == max(versions) and newest.mindformers is None, newest
    # the newest tested MindSpore is the minor release just below the range's end
    major, minor = (int(x) for x in MINDSPORE_BELOW.split(".")[:2])
    assert max(versions)[:2] == (major, minor - 1), max(versions)
    # and the oldest tested is the range's first release
    from mindpulse.frameworks.framework_support import MINDSPORE_MIN

    assert min(versions) == tuple(map(int, MINDSPORE_MIN.split("."))), min(versions)


def test_core_dependencies_leave_the_framework_out():
    deps = venvs.core_dependencies()
    names = [d.split(">")[0].split("=")[0].split("<")[0].split("[")[0].strip().lower() for d in deps]
    assert "mindspore" not in names and "mindformers" not in names, deps
    assert "ray" in names and "msgpack" in names


def _summary(run_dir: Path, **over) -> None:
    s = {"status": "succeeded", "steps_completed": 3, "first_loss": 2.0, "last_loss": 1.5, "monitor_errors": 0,
         "ranks": [{"rank": 0, "last_step": 3}, {"rank": 1, "last_step": 3}], "message": "run ended"}
    s.update(over)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / "summary.json").write_text(json.dumps(s))
    for r in (0, 1):
        (run_dir / "logs" / f"rank_{r}.log").write_text(f"[rank {r}] {features.AUTO_ATTACHED}\n")


def test_a_clean_run_passes(tmp_path):
    _summary(tmp_path)
    assert features.judge(F.SCRIPT_MODEL_TRAIN, 0, tmp_path, 3, "") == (True, "")


@pytest.mark.parametrize("over, code, expected", [
    ({}, 1, "exit code 1"),
    ({"status": "failed"}, 0, "status failed"),
    ({"steps_completed": 2}, 0, "2 of 3 steps completed"),
    ({"last_loss": None}, 0, "no loss reached the aggregator"),
    ({"first_loss": float("nan")}, 0, "no loss reached the aggregator"),
    ({"ranks": [{"rank": 0, "last_step": 3}, {"rank": 1, "last_step": 1}]}, 0, "did not see every rank"),
    ({"monitor_errors": 2}, 0, "2 monitor errors"),
])
def test_each_failed_check_is_named(tmp_path, over, code, expected):
    _summary(tmp_path, **over)
    passed, reason = features.judge(F.RECIPE, code, tmp_path, 3, "")
    assert not passed and expected in reason, reason


def test_a_failure_carries_the_ranks_last_error(tmp_path):
    _summary(tmp_path, status="failed")
    (tmp_path / "logs" / "rank_1.log").write_text("Traceback ...\nAttributeError: module 'x' has no attribute 'y'\n")
    passed, reason = features.judge(F.RECIPE, 1, tmp_path, 3, "launcher said something")
    assert not passed and reason == "exit code 1; AttributeError: module 'x' has no attribute 'y'", reason


def test_model_train_needs_auto_attach_on_every_rank(tmp_path):
    _summary(tmp_path)
    (tmp_path / "logs" / "rank_1.log").write_text("trained without a monitor\n")
    passed, reason = features.judge(F.SCRIPT_MODEL_TRAIN, 0, tmp_path, 3, "")
    assert not passed and "auto-attach did not add the Monitor" in reason
    assert features.judge(F.SCRIPT_HAND_LOOP, 0, tmp_path, 3, "") == (True, "")


def test_no_run_directory_is_a_failure():
    passed, reason = features.judge(F.RECIPE, 2, None, 3, "config error: job.recipe.name: ...\n")
    assert not passed and reason.startswith("exit code 2") and "job.recipe.name" in reason


def test_the_used_mindformers_names_are_read_from_the_rank_code():
    needs = mindformers_next.used_names()
    labels = [mindformers_next.need_label(n) for n in needs]
    assert "mindformers.trainer.Trainer" in labels, labels
    assert {"mindformers.tools.register.MindFormerModuleType", "mindformers.tools.register.MindFormerRegister"} \
        <= set(labels)
    # the shim for MindFormers 1.7.0: either place will do
    assert ((("mindformers.utils.file_utils", "set_output_path"), ("mindformers.tools.utils", "set_output_path"))
            in needs), needs


def test_a_fallback_import_is_one_need_with_two_places(tmp_path):
    (tmp_path / "w.py").write_text(
        "try:\n    from mindformers.a import f\nexcept ImportError:\n    from mindformers.b import f\n"
        "from mindformers.c import g, h\nfrom os import path\n")
    assert mindformers_next.used_names(tmp_path) == [
        (("mindformers.a", "f"), ("mindformers.b", "f")), (("mindformers.c", "g"),), (("mindformers.c", "h"),)]


def test_the_api_check_finds_a_missing_name(tmp_path):
    pkg = tmp_path / "mindformers" / "trainer"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .trainer import Trainer\nVALUE = 1\n")
    (tmp_path / "mindformers" / "__init__.py").write_text("")
    (tmp_path / "mindformers" / "old.py").write_text("def moved():\n    pass\n")
    needs = [(("mindformers.trainer", "Trainer"),), (("mindformers.trainer", "VALUE"),),
             (("mindformers.trainer", "Gone"),), (("mindformers.core.context", "build_context"),),
             (("mindformers.new", "moved"), ("mindformers.old", "moved"))]
    assert mindformers_next.check_api(tmp_path, needs) == {
        "mindformers.trainer.Trainer": "ok", "mindformers.trainer.VALUE": "ok",
        "mindformers.trainer.Gone": "mindformers.trainer has no Gone",
        "mindformers.core.context.build_context": "no module mindformers.core.context",
        "mindformers.new.moved or mindformers.old.moved": "ok"}


def test_the_table_links_each_failing_cell_to_its_reason():
    results = {"date": "2026-01-01 00:00 UTC", "machine": "Linux x86_64, a CPU, 2 cores", "python": "3.11.7",
               "steps": 3, "ranks": 2, "wall_s": 10, "mindformers_next": [
                   {"version": "2.0.0", "requires_mindspore": "~=2.10.0", "missing": ["hyper-parallel~=1.0.0"],
                    "api": {"mindformers.trainer.Trainer": "ok"}, "error": ""}],
               "pairs": [
                   {"name": "ms2.8.0", "pair": {"mindspore": "2.8.0", "mindformers": None, "partial": False},
                    "built_s": None, "cells": {
                        "script_model_train": {"passed": True, "seconds": 41.2, "reason": ""},
                        "script_hand_loop": {"passed": False, "seconds": 12.0, "reason": "exit code 1; KeyError: 'x'"},
                    }},
                   {"name": "ms2.9.0-mf1.9.0", "pair": {"mindspore": "2.9.0", "mindformers": "1.9.0", "partial": False},
                    "built_s": 200.0, "build_error": "pip said no", "cells": {}}]}
    text = doc.render(results)
    row = ("| MindSpore 2.8.0 | pass (41 s) | [**fail**](#ms2.8.0-script_hand_loop) | cached (built) "
           "| 2026-01-01 00:00 UTC |")
    assert row in text, text
    assert '<a id="ms2.8.0-script_hand_loop"></a>' in text and "KeyError: 'x'" in text
    assert "[**not built**](#ms2.9.0-mf1.9.0-build)" in text and "pip said no" in text
    assert "| 2.0.0 | `~=2.10.0` | `hyper-parallel~=1.0.0` | all 1 present |" in text
    assert "2026-01-01 00:00 UTC" in text and "2 cores" in text


def test_the_train_cell_outputs_and_callback_slot_are_checked(tmp_path):
    wrapper = tmp_path / "mindformers" / "wrapper"
    register = tmp_path / "mindformers" / "tools" / "register"
    wrapper.mkdir(parents=True)
    register.mkdir(parents=True)
    (register / "register.py").write_text("class MindFormerModuleType:\n    CALLBACK = 'callback'\n")
    body = ("class MFTrainOneStepCell:\n    def construct(self, x):\n        if x:\n"
            "            return loss, overflow, scaling_sens, learning_rate, global_norm, local_norm, size\n"
            "        return {ret}\n")
    (wrapper / "wrapper.py").write_text(body.format(ret="loss, overflow, scaling_sens, learning_rate, global_norm"))
    key = "MFTrainOneStepCell outputs loss, overflow, scaling_sens, learning_rate, global_norm"
    assert mindformers_next.check_shapes(tmp_path) == {key: "ok", "MindFormerModuleType.CALLBACK": "ok"}
    (wrapper / "wrapper.py").write_text(body.format(ret="loss, learning_rate"))
    (register / "register.py").write_text("class MindFormerModuleType:\n    CALLBACKS = 'callback'\n")
    got = mindformers_next.check_shapes(tmp_path)
    assert got[key].startswith("returns ") and "('loss', 'learning_rate')" in got[key], got
    assert got["MindFormerModuleType.CALLBACK"] == "MindFormerModuleType.CALLBACK missing"


def test_a_cached_venv_is_reused_only_for_its_pair_and_dependencies(tmp_path):
    pair = venvs.Pair("2.8.0")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").write_text("")
    stamp = {"build": venvs.BUILD, "pair": {"mindspore": "2.8.0", "mindformers": None, "partial": False},
             "deps": venvs.core_dependencies(), "installed": {"mindspore": "2.8.0"}, "missing": [],
             "kept": ["numpy>=1.26,<2 (numpy 2.4.6 kept)"], "built_s": 89.1}
    (tmp_path / venvs.STAMP).write_text(json.dumps(stamp))
    got = venvs._cached(pair, tmp_path)
    assert got is not None and got.reused and got.built_s == 89.1 and got.kept == stamp["kept"], got
    assert got.installed == {"mindspore": "2.8.0"} and got.python == tmp_path / "bin" / "python"
    assert venvs._cached(venvs.Pair("2.9.0"), tmp_path) is None
    (tmp_path / venvs.STAMP).write_text(json.dumps(dict(stamp, deps=["ray"])))
    assert venvs._cached(pair, tmp_path) is None, "built for other dependencies: built again"


def test_the_framework_keeps_a_version_mindpulse_would_change():
    install, kept = venvs.requirements_beside({"numpy": "2.4.6", "protobuf": "7.36.2"},
                                              ["numpy>=1.26,<2", "protobuf>=4", "msgpack>=1.0,<2"])
    assert install == ["protobuf>=4", "msgpack>=1.0,<2"] and kept == ["numpy>=1.26,<2 (numpy 2.4.6 kept)"]
