"""Bad dashboard and tracker config through the `mindpulse` command itself: `mindpulse launch`
exits 2 with a message that names the config key (or the extra to install), before anything
starts — no Ray cluster, no run directory left behind."""

from __future__ import annotations

import socket
import sys

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
