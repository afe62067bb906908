"""`mindpulse doctor` and the launch's framework check on this machine, with the real MindSpore.

The doctor's probe runs the installed MindSpore in the ranks' Python (import, device targets,
the one-op run_check); the refused launch puts a MindSpore 2.6.0 stand-in first on the ranks'
path through the config's `env:` (PYTHONPATH), which is what the ranks would import. Through a
Ray cluster of two nodes: tests/integration/test_scale_out.py.
"""

from __future__ import annotations

import importlib.metadata
import json

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.cluster]


def verdicts_of(node: dict) -> dict[str, dict]:
    return {v["item"]: v for v in node["verdicts"]}


def test_doctor_on_this_machine_fits_the_installed_pair(run_cli):
    r = run_cli("doctor", "--json", timeout=300)
    assert r.returncode == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["ok"] is True and len(doc["nodes"]) == 1, r.output
    node = doc["nodes"][0]
    probe = node["probe"]
    assert probe["mindspore"]["version"] == importlib.metadata.version("mindspore")
    assert "CPU" in probe["mindspore"]["built_for"] and "CPU" in probe["mindspore"]["usable"]
    assert probe["mindspore"]["smoke"]["ok"] is True and probe["mindspore"]["smoke"]["target"] == "CPU"
    assert probe["mindformers"]["version"] == importlib.metadata.version("mindformers")
    assert probe["ray"]["version"] == importlib.metadata.version("ray")
    v = verdicts_of(node)
    assert v["mindspore"]["level"] == "ok" and v["mindformers"]["level"] == "ok" and v["mindspore run_check"]
    # this machine has no Ascend software: said, not a failure for the cpu job
    assert v["cann toolkit"]["level"] == "info" and "not found" in v["cann toolkit"]["found"]
    assert v["npu driver"]["level"] == "info"


def test_doctor_msrun_backend_table(run_cli):
    r = run_cli("doctor", "--set", "backend=msrun", timeout=300)
    assert r.returncode == 0, r.output
    out = r.stdout
    assert "backend msrun" in out and "every node fits this job" in out, out
    row = next(line for line in out.splitlines() if line.startswith("msrun "))
    assert " ok " in row and row.rstrip().endswith("/msrun"), row


def fake_mindspore(tmp_path, version: str = "2.6.0"):
    root = tmp_path / "old-mindspore"
    (root / "mindspore").mkdir(parents=True)
    (root / "mindspore" / "__init__.py").write_text(f'__version__ = "{version}"\n')
    return root


def test_doctor_exits_2_for_a_mindspore_outside_the_range(run_cli, tmp_path):
    r = run_cli("doctor", "--set", f"env.PYTHONPATH={fake_mindspore(tmp_path)}", timeout=300)
    assert r.returncode == 2, r.output
    row = next(line for line in r.stdout.splitlines() if line.startswith("mindspore "))
    assert "FAIL" in row and "2.6.0" in row and ">=2.7.0,<2.11" in row, row
    assert "problem(s)" in r.stdout


def test_launch_refuses_a_node_whose_mindspore_is_out_of_range(run_cli, tmp_path):
    """Exit 2 before any rank starts, naming the node, what was found, the range and the fix,
    pointing to doctor; no run directory is left."""
    r = run_cli("launch", "--set", f"env.PYTHONPATH={fake_mindspore(tmp_path)}", "--set", "train.steps=5",
                timeout=300)
    assert r.returncode == 2, r.output
    err = r.stderr
    assert "no rank was started" in err and "(this machine): mindspore 2.6.0 from" in err, err
    assert "(supported: >=2.7.0,<2.11)" in err and "fix: install the MindSpore" in err, err
    assert "run `mindpulse doctor" in err and "local_cpu.yaml` to see everything each node has" in err, err
    assert r.run_dir is None, f"the refused launch left {r.run_dir}"
    assert "mindpulse: started" not in r.stdout, r.output  # no rank (and no msrun) was started
    assert "framework check" not in r.stdout
