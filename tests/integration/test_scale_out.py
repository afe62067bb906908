"""A real two-node Ray cluster on this machine (`ray start` twice, one CPU each, token
authentication on): what the launcher and `mindpulse doctor` check on every node of an existing
cluster before anything starts. Launches across nodes run in tests/integration/test_multihost.py,
whose hosts have addresses, host names and /tmp of their own (msrun on one node: test_faults.py,
test_processes.py)."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import NO_REPORT, ROOT, mindpulse_cmd

from mindpulse.launcher.spec import free_port

pytestmark = [pytest.mark.slow, pytest.mark.cluster]
RAY = str(Path(sys.executable).parent / "ray")


@pytest.fixture(scope="module")
def two_node_cluster(tmp_path_factory):
    """A Ray cluster of two nodes on this machine, with token authentication on."""
    tmp = tmp_path_factory.mktemp("raycluster")
    token = tmp / "token"
    token.write_text(secrets.token_hex(32))
    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token), RAY_USAGE_STATS_ENABLED="0")
    port = free_port()
    before = {p.pid for p in psutil.process_iter()}
    # a short temp dir: Ray's socket paths must stay under 107 bytes
    temp = f"/tmp/mp-cluster-{secrets.token_hex(3)}"
    head = subprocess.run([RAY, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}", "--num-cpus=1",
                           "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp}"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert head.returncode == 0, head.stdout + head.stderr
    worker = subprocess.run([RAY, "start", f"--address=127.0.0.1:{port}", "--node-ip-address=127.0.0.1",
                             "--num-cpus=1"], env=env, capture_output=True, text=True, timeout=120)
    assert worker.returncode == 0, worker.stdout + worker.stderr
    try:
        yield {"address": f"127.0.0.1:{port}", "env": env}
    finally:
        # stop this cluster only (`ray stop` would stop every Ray on the machine): the
        # processes that carry its temp dir (GCS, raylets, agents) and everything they started
        # (its `ray::` workers are the raylets' children). Never match `ray::` by name: other
        # tests' clusters run beside this one (`make test` runs cluster tests side by side),
        # and killing their DashboardAgent takes their raylet down with it
        import shutil

        for rounds in range(2):
            for p in _cluster_processes(temp, before):
                try:
                    p.terminate() if rounds == 0 else p.kill()
                except psutil.Error:
                    pass
            time.sleep(2)
        shutil.rmtree(temp, ignore_errors=True)


def _cluster_processes(temp: str, before: set[int]) -> list[psutil.Process]:
    """The processes of the cluster whose temp dir is `temp`, started after `before` was taken:
    those naming the temp dir and all their descendants."""
    roots = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        if p.pid not in before and temp in " ".join(p.info["cmdline"] or []):
            roots.append(p)
    found = {p.pid: p for p in roots}
    for p in roots:
        try:
            found.update({c.pid: c for c in p.children(recursive=True)})
        except psutil.Error:
            pass
    return list(found.values())


def launch_on(cluster, tmp_path, *args, timeout=500):
    out = tmp_path / "runs"
    proc = subprocess.run(mindpulse_cmd() + ["launch", "--set", f"ray.address={cluster['address']}",
                                             "--set", f"output.root={out}", *NO_REPORT, *args],
                          cwd=ROOT, env=cluster["env"], capture_output=True, text=True, timeout=timeout)
    run_dir = next(out.iterdir()) if out.exists() and any(out.iterdir()) else None
    return proc, run_dir


def test_no_npu_in_the_cluster_is_refused_before_anything_starts(two_node_cluster, tmp_path):
    proc, run_dir = launch_on(two_node_cluster, tmp_path, "--set", "world.device=ascend", "--set", "world.nodes=2",
                              "--set", "world.ranks_per_node=1", timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "NPU" in proc.stderr and "needs 2" in proc.stderr
    assert run_dir is None


def test_doctor_probes_every_node_through_ray(two_node_cluster, tmp_path):
    """`mindpulse doctor` on a Ray cluster: one pinned probe task per node that can host a
    node's ranks, each reading that node's ranks' Python with the real MindSpore; a MindSpore
    outside the range on the ranks' path is named on every node, with exit 2."""
    base = mindpulse_cmd() + ["doctor", "--set", f"ray.address={two_node_cluster['address']}",
                              "--set", "world.nodes=2", "--set", "world.ranks_per_node=1"]
    proc = subprocess.run(base + ["--json"], cwd=ROOT, env=two_node_cluster["env"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    nodes = doc["nodes"]
    assert len(nodes) == 2 and len({n["probe"]["node_id"] for n in nodes}) == 2, nodes
    import importlib.metadata

    for n in nodes:
        assert n["probe"]["mindspore"]["version"] == importlib.metadata.version("mindspore"), n
        assert n["probe"]["mindspore"]["smoke"]["ok"] is True, n["probe"]["mindspore"]
    old = tmp_path / "old" / "mindspore"
    old.mkdir(parents=True)
    (old / "__init__.py").write_text('__version__ = "2.6.0"\n')
    proc = subprocess.run(base + ["--set", f"env.PYTHONPATH={old.parent}"], cwd=ROOT, env=two_node_cluster["env"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.split()[:2] == ["mindspore", "FAIL"]]
    assert len(rows) == 2 and all("2.6.0" in r for r in rows), proc.stdout
    # two Ray nodes on one host share its address: each is named with its node id too
    import re

    heads = re.findall(r"^node \S+ .*\[([0-9a-f]{8})\]$", proc.stdout, re.M)
    assert len(set(heads)) == 2, proc.stdout
