"""`job.mindformers.source` on the head: a path that is not a MindFormers source tree is refused
by `mindpulse launch` and `mindpulse plan`, exit 2 naming the key, before anything starts (no Ray
cluster, no run directory); a tree is resolved like the job's other paths and shown by `plan`."""

from __future__ import annotations

import json

import pytest
from conftest import ROOT

from mindpulse.launcher import launch as launch_mod
from mindpulse.launcher.cli import main

CONFIG = ROOT / "cluster_configs" / "mindformers_finetune.yaml"


class NoRay:
    """Where the launch would start its Ray cluster: a refusal must come before it."""

    def __init__(self, cfg):
        raise AssertionError("the launch went on to start a Ray cluster")


def _tree(root):
    (root / "mindformers").mkdir(parents=True)
    (root / "mindformers" / "__init__.py").write_text('__version__ = "1.9.0"\n')
    return root


@pytest.mark.parametrize("case, needle", [
    ("missing", "does not exist"),
    ("a_file", "is not a folder"),
    ("no_package", "is not a MindFormers source tree: it has no mindformers/__init__.py"),
    ("the_package_itself", "it is the package itself: give its parent folder"),
])
@pytest.mark.parametrize("command", ["launch", "plan"])
def test_a_source_that_is_no_mindformers_tree_exits_2_naming_the_key(case, needle, command, tmp_path, monkeypatch,
                                                                     capsys):
    source = {"missing": lambda: tmp_path / "nowhere",
              "a_file": lambda: (tmp_path / "f.txt").write_text("x") and tmp_path / "f.txt",
              "no_package": lambda: (tmp_path / "empty").mkdir() or tmp_path / "empty",
              "the_package_itself": lambda: _tree(tmp_path / "clone") / "mindformers"}[case]()
    monkeypatch.setattr(launch_mod, "RaySession", NoRay)
    runs = tmp_path / "runs"
    assert main([command, str(CONFIG), "--set", f"output.root={runs}",
                 "--set", f"job.mindformers.source={source}"]) == 2
    err = capsys.readouterr().err
    assert f"job.mindformers.source: {str(source)!r}" in err and needle in err, err
    if case == "the_package_itself":
        assert repr(str(tmp_path / "clone")) in err, err
    assert not runs.exists() or not any(runs.iterdir()), "a refused launch left a run directory"


def test_a_tree_is_resolved_against_the_config_folder_and_shown_by_plan(tmp_path, monkeypatch, capsys):
    tree = _tree(tmp_path / "src" / "mf")
    config = tmp_path / "job.yaml"
    config.write_text(CONFIG.read_text().replace("../workers/", f"{ROOT}/workers/")
                      + "\n# the clone beside this file\n")
    monkeypatch.chdir(ROOT)  # not the config's folder: the relative path is the config's
    assert main(["plan", str(config), "--json", "--set", "job.mindformers.source=src/mf"]) == 0
    specs = json.loads(capsys.readouterr().out)
    assert {s["mindformers"]["source"] for s in specs} == {str(tree)}
    assert main(["plan", str(config), "--set", "job.mindformers.source=src/mf"]) == 0
    assert f"MindFormers is imported from the source tree {tree} (job.mindformers.source)" in capsys.readouterr().out
