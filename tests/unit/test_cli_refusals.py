"""Bad config and bad input through the `mindpulse` command itself: `mindpulse launch` exits 2
with a message that names the config key (or the extra to install), before anything starts —
no Ray cluster, no run directory left behind."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest

from mindpulse.launcher import launch as launch_mod
from mindpulse.launcher.cli import main


class NoRay:
    """Where the launch would start its Ray cluster: a refusal must come before it."""

    started = 0

    def __init__(self, cfg):
        NoRay.started += 1
        raise AssertionError("the launch went on to start a Ray cluster")


@pytest.fixture
def taken_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize("case", ["port_in_use", "unknown_sink_option", "address_not_an_ip", "no_mlflow",
                                  "no_swanlab"])
def test_bad_dashboard_and_tracker_config_exits_2_naming_the_key(case, request, tmp_path, monkeypatch, capsys):
    sets, needles = {
        "port_in_use": (lambda: [f"exporters.prometheus.port={request.getfixturevalue('taken_port')}"],
                        ["exporters.prometheus.port: 127.0.0.1:", "cannot be served"]),
        "unknown_sink_option": (lambda: ["sinks.mlflow.enabled=true", "sinks.mlflow.uri=http://x"],
                                ["sinks.mlflow.uri"]),
        "address_not_an_ip": (lambda: ["exporters.prometheus.port=9400", "exporters.prometheus.address=localhost"],
                              ["exporters.prometheus.address"]),
        "no_mlflow": (lambda: ["sinks.mlflow.enabled=true"],
                      ["sinks.mlflow.enabled", "pip install 'mindpulse[mlflow]'"]),
        "no_swanlab": (lambda: ["sinks.swanlab.enabled=true"],
                       ["sinks.swanlab.enabled", "pip install 'mindpulse[swanlab]'"]),
    }[case]
    if case.startswith("no_"):
        monkeypatch.setitem(sys.modules, case.removeprefix("no_"), None)  # the package is not importable here
    monkeypatch.setattr(launch_mod, "RaySession", NoRay)
    monkeypatch.setattr(NoRay, "started", 0)
    argv = ["launch", "--set", f"output.root={tmp_path / 'runs'}"]
    for line in sets():
        argv += ["--set", line]
    assert main(argv) == 2
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err, err
    assert NoRay.started == 0
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir()), "a run directory was left"
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()


# ---- bad input found on the head before Ray starts (one case per config key) -----------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again: nothing answers there


MF_YAML = Path(launch_mod.__file__).resolve().parents[1] / "workers/recipes/mindformers/llama_tiny_finetune.yaml"
"""The shipped MindFormers YAML (it runs as it is)."""


def _bad_input(case: str, tmp: Path) -> tuple[list[str], list[str]]:
    """(the --set lines, what stderr must say) of one bad input."""
    blocker = tmp / "a_file"
    blocker.write_text("not a folder\n")
    folder = tmp / "scripts"
    folder.mkdir()
    bad_py = tmp / "bad.py"
    bad_py.write_text("import os\ndef f(:\n    pass\n")
    empty = tmp / "empty.txt"
    empty.write_text("")
    return {
        "job.script missing": (["job.script=" + str(tmp / "missing.py")],
                               [f"job.script: {tmp / 'missing.py'} does not exist"]),
        "job.script a folder": ([f"job.script={folder}"], [f"job.script: {folder} is a folder without a __main__.py"]),
        "job.script does not compile": ([f"job.script={bad_py}"],
                                        [f"job.script: {bad_py} line 2: SyntaxError"]),
        "job.args not a list": ([f"job.script={bad_py}", "job.args=--epochs 3"], ["job.args: expected a list"]),
        "job.args item not a string": ([f"job.script={bad_py}", "job.args=[[--epochs, 3]]"],
                                       ["job.args[0]: ['--epochs', 3] is not allowed; use a string"]),
        "job.recipe.init_from missing": ([f"job.recipe.init_from={tmp / 'base.ckpt'}"],
                                         [f"job.recipe.init_from: {tmp / 'base.ckpt'} does not exist",
                                          "mindpulse pretrain"]),
        "job.recipe.train_file missing": ([f"job.recipe.train_file={tmp / 'train.txt'}"],
                                          [f"job.recipe.train_file: {tmp / 'train.txt'} does not exist"]),
        "job.recipe.train_file empty": ([f"job.recipe.train_file={empty}"],
                                        [f"job.recipe.train_file: {empty} is empty"]),
        "job.recipe.valid_file missing": ([f"job.recipe.valid_file={tmp / 'valid.txt'}", "eval.every_steps=5"],
                                          [f"job.recipe.valid_file: {tmp / 'valid.txt'} does not exist"]),
        "train.batch_size over the corpus": (["train.batch_size=100000"],
                                             ["train.batch_size: 100000", "corpus too small"]),
        "job.mindformers.config missing": ([f"job.mindformers.config={tmp / 'mf.yaml'}"],
                                           ["job.mindformers", f"{tmp / 'mf.yaml'}"]),
        "job.mindformers.load_checkpoint missing": (
            [f"job.mindformers.config={MF_YAML}", f"job.mindformers.load_checkpoint={tmp / 'mf.ckpt'}"],
            ["job.mindformers", f"load_checkpoint: {tmp / 'mf.ckpt'} does not exist"]),
        "output.root under a file": ([f"output.root={blocker / 'runs'}"],
                                     [f"output.root: cannot make the run directory under {blocker / 'runs'}"]),
        "monitor.histogram_regex": (["monitor.histogram_regex=layers.(0"],
                                    ["monitor.histogram_regex: 'layers.(0' is not a regular expression"]),
        "ray.address malformed": (["ray.address=head-node"], ["ray.address: 'head-node' is not allowed"]),
        "ray.address nothing answers": ([f"ray.address=127.0.0.1:{_free_port()}"],
                                        ["ray.address: nothing answers at"]),
        "msrun.master_addr malformed": (["backend=msrun", "msrun.master_addr=10.0.0.1:8118"],
                                        ["msrun.master_addr: '10.0.0.1:8118' is not allowed"]),
        "msrun.master_addr unknown": (["ray.address=10.0.0.1:6379", "world.nodes=2",
                                       "backend=msrun", "msrun.master_addr=no-such-host.invalid"],
                                      ["msrun.master_addr: 'no-such-host.invalid' does not resolve here"]),
        "sinks.swanlab.logdir": (["sinks.swanlab.enabled=true", f"sinks.swanlab.logdir={blocker / 'swanlog'}"],
                                 [f"sinks.swanlab.logdir: {blocker / 'swanlog'} cannot be made: {blocker} is a file"]),
        "sinks.mlflow.tracking_uri": (["sinks.mlflow.enabled=true", f"sinks.mlflow.tracking_uri=file://{blocker}/ml"],
                                      [f"sinks.mlflow.tracking_uri: {blocker / 'ml'} cannot be made"]),
        "profile.steps a scalar": (["profile.steps=5"], ["profile.steps: expected a list, got 5"]),
        "profile.steps after the last step": (["profile.steps=[5, 8]"],
                                              ["profile.steps: [5, 8] starts after the run's last step "
                                               "(train.steps=2)"]),
        "env value a list": (["env.HCCL_CONNECT_TIMEOUT=[1, 2]"], ["env.HCCL_CONNECT_TIMEOUT: [1, 2] is not allowed"]),
    }[case]


BAD_INPUTS = ["job.script missing", "job.script a folder", "job.script does not compile", "job.args not a list",
              "job.args item not a string", "job.recipe.init_from missing", "job.recipe.train_file missing",
              "job.recipe.train_file empty", "job.recipe.valid_file missing", "train.batch_size over the corpus",
              "job.mindformers.config missing", "job.mindformers.load_checkpoint missing",
              "output.root under a file", "monitor.histogram_regex", "ray.address malformed",
              "ray.address nothing answers", "msrun.master_addr malformed", "msrun.master_addr unknown",
              "sinks.swanlab.logdir", "sinks.mlflow.tracking_uri", "profile.steps a scalar",
              "profile.steps after the last step", "env value a list"]


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_exits_2_naming_the_key_before_ray_starts(case, tmp_path, monkeypatch, capsys):
    """What used to be found only once Ray, the aggregator and every rank had started (a rank's
    FileNotFoundError, a tracker that silently did not start, weight statistics silently off,
    ray.init retrying for minutes) is refused on the head: exit 2, the key in the message."""
    sets, needles = _bad_input(case, tmp_path)
    monkeypatch.setattr(launch_mod, "RaySession", NoRay)
    monkeypatch.setattr(NoRay, "started", 0)
    runs = tmp_path / "runs"
    argv = ["launch", "--set", f"output.root={runs}", "--set", "train.steps=2"]
    for line in sets:
        argv += ["--set", line]
    assert main(argv) == 2
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err, err
    assert NoRay.started == 0
    assert not runs.exists() or not any(runs.iterdir()), f"a run directory was left: {list(runs.iterdir())}"
    assert not (tmp_path / "a_file" / "runs").exists()
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into any folder: the permission cannot be taken away")
def test_an_output_root_without_write_permission_exits_2(tmp_path, monkeypatch, capsys):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    monkeypatch.setattr(launch_mod, "RaySession", NoRay)
    assert main(["launch", "--set", f"output.root={locked / 'runs'}"]) == 2
    assert f"output.root: cannot make the run directory under {locked / 'runs'} (Permission denied" in \
        capsys.readouterr().err
