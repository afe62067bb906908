"""launcher/shared_output.py: each node agent writes a marker on its own host and the driver
reads it; a host whose marker it cannot read is named (warning), or the launch refused with
`checkpoint.require_shared: true`."""

from __future__ import annotations

from pathlib import Path

import pytest

from mindpulse.config import RunConfig
from mindpulse.launcher.preflight import LaunchRefused
from mindpulse.launcher.shared_output import check_shared_output, marker_path
from mindpulse.node.agent import NodeAgent


class _Call:
    def __init__(self, fn):
        self.remote = fn


class FakeAgent:
    """A node agent whose host sees `root` where the driver sees `run_dir` (the same
    folder: a shared filesystem; another one: a host with its own disk)."""

    def __init__(self, run_dir: Path, root: Path):
        def write(path: str, token: str):
            local = root / Path(path).relative_to(run_dir)
            return NodeAgent.write_marker(None, str(local), token)  # type: ignore[arg-type]

        def remove(path: str):
            NodeAgent.remove_marker(None, str(root / Path(path).relative_to(run_dir)))  # type: ignore[arg-type]

        self.write_marker = _Call(write)
        self.remove_marker = _Call(remove)


@pytest.fixture(autouse=True)
def _plain_get(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: ref)


def _infos(n: int) -> list[dict]:
    return [{"node": i, "host": f"host{i}", "ip": f"198.18.0.{i + 1}"} for i in range(n)]


def test_every_host_sharing_the_run_dir_says_nothing_and_leaves_no_marker(tmp_path):
    said: list[str] = []
    agents = [FakeAgent(tmp_path, tmp_path), FakeAgent(tmp_path, tmp_path)]
    assert check_shared_output(RunConfig(), tmp_path, agents, _infos(2), said.append) == []
    assert said == []
    assert not marker_path(tmp_path, 0).parent.exists()


def test_a_host_with_its_own_disk_is_named_in_a_warning(tmp_path):
    said: list[str] = []
    other = tmp_path / "host1-disk"
    agents = [FakeAgent(tmp_path, tmp_path), FakeAgent(tmp_path, other)]
    hosts = check_shared_output(RunConfig(), tmp_path, agents, _infos(2), said.append)
    assert [(h["node"], h["host"], h["ip"]) for h in hosts] == [(1, "host1", "198.18.0.2")]
    assert len(said) == 1 and "WARNING" in said[0] and "node 1 (host1, 198.18.0.2" in said[0]
    assert "output.root" in said[0]
    assert not list(other.rglob("*.marker"))  # removed on its own host too


def test_require_shared_refuses_the_launch(tmp_path):
    cfg = RunConfig()
    cfg.checkpoint.require_shared = True
    agents = [FakeAgent(tmp_path, tmp_path / "a"), FakeAgent(tmp_path, tmp_path)]
    with pytest.raises(LaunchRefused, match=r"node 0 \(host0.*checkpoint.require_shared: true"):
        check_shared_output(cfg, tmp_path, agents, _infos(2), print)


def test_a_host_that_cannot_write_there_is_named_with_why(tmp_path):
    (tmp_path / "ro").write_text("a file where the folder should be")
    agents = [FakeAgent(tmp_path, tmp_path / "ro")]
    hosts = check_shared_output(RunConfig(), tmp_path, agents, _infos(1), lambda s: None)
    assert hosts and "could not write" in hosts[0]["why"]


def test_the_key_is_in_the_config_with_its_default():
    assert RunConfig().checkpoint.require_shared is False
