"""The head needs neither MindSpore nor MindFormers: a CPU-only head launches ranks on a node
that has them.

Two hosts (network namespaces, tests/netns_hosts.py), Ray started on each as the README's
"Multi-node" section says. The head's Ray and the launch run from a real environment that
holds mindpulse and its core dependencies and neither framework (tests/headless_venv.py,
what `pip install mindpulse` gives a CPU-only head); the head offers Ray no CPU, so every rank
goes to the worker host, whose Ray runs from this test environment (MindSpore and
MindFormers installed). The driver, the aggregator (pinned to the driver's node) and the end
of run report run on the head; then `config`, `plan`, `report`, `top` and `rules` run there on
the finished run directory. One short launch of the default job (the recipe, 3 steps).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from headless_venv import headless_venv
from netns_hosts import Testbed, can_create_namespaces

# one multi-host test bed at a time (tests/suite_schedule.py): each is a cluster of its own (2-3 Ray
# nodes, 4 ranks), and several beside the other launches overloaded the 2 cores
pytestmark = [pytest.mark.slow, pytest.mark.cluster, pytest.mark.xdist_group("netns"),
              pytest.mark.skipif(can_create_namespaces() is not None, reason=str(can_create_namespaces()))]
WORKER_RAY = str(Path(sys.executable).parent / "ray")

WHERE = textwrap.dedent("""\
    import json, sys
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=0)
    def where():
        import importlib.util, socket, sys
        return {"python": sys.executable, "host": socket.gethostname(),
                "frameworks": [m for m in ("mindspore", "mindformers") if importlib.util.find_spec(m)]}

    ray.init(address=sys.argv[1], logging_level="ERROR")
    nodes = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}
    print(json.dumps({a: dict(ray.get(where.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        node_id=n, soft=False)).remote()), node_id=n) for a, n in nodes.items()}))
""")


def test_a_head_without_either_framework_launches_ranks_on_a_node_that_has_them(tmp_path):
    venv = headless_venv()
    head_py = str(venv / "bin" / "python")
    token = tmp_path / "ray_token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    bed = Testbed(2)
    bed.create()
    try:
        head, worker = bed.hosts
        env = {"RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": "", **bed.ray_env(token)}
        started = bed.run(0, [str(venv / "bin" / "ray"), "start", "--head", f"--node-ip-address={head.address}",
                              "--port=6379", "--include-dashboard=false", "--num-cpus=0", "--disable-usage-stats"],
                          env=env, timeout=120)
        assert started.returncode == 0, started.stdout + started.stderr
        joined = bed.run(1, [WORKER_RAY, "start", f"--address={head.address}:6379",
                             f"--node-ip-address={worker.address}", "--num-cpus=2", "--disable-usage-stats"],
                         env=env, timeout=120)
        assert joined.returncode == 0, joined.stdout + joined.stderr
        address = f"{head.address}:6379"
        # what each node's Ray workers run: the head's, the environment without either framework
        probe = bed.run(0, [head_py, "-c", WHERE, address], env=env, timeout=120, cwd=tmp_path)
        assert probe.returncode == 0, probe.stderr[-3000:]
        where = json.loads(probe.stdout.strip().splitlines()[-1])
        assert where[head.address]["python"].startswith(str(venv)), where
        assert where[head.address]["frameworks"] == [], f"the head's environment holds {where[head.address]}"
        assert where[worker.address]["frameworks"] == ["mindspore", "mindformers"], where

        out = tmp_path / "runs"
        launch = bed.run(0, [head_py, "-m", "mindpulse.launcher.cli", "launch", "--set", f"ray.address={address}",
                             "--set", f"output.root={out}", "--set", "train.steps=3",
                             "--set", "monitor.per_print_step=1", "--set", "preflight.enabled=false"],
                         env=env, timeout=480, cwd=tmp_path)
        text = launch.stdout + launch.stderr
        assert launch.returncode == 0, text[-5000:]
        (run_dir,) = [d for d in out.iterdir() if d.is_dir()]
        s = json.loads((run_dir / "summary.json").read_text())
        assert s["status"] == "succeeded" and s["steps_completed"] == 3, s
        assert {x["node_id"] for x in s["ranks"]} == {where[worker.address]["node_id"]}, \
            f"ranks not (all) on the worker host: {s['ranks']}"
        for rank in (0, 1):  # each rank checked the frameworks of the worker's environment
            log = (run_dir / "logs" / f"rank_{rank}.log").read_text()
            assert f"[rank {rank}] mindspore 2.9" in log and "; mindformers 1.9.0 from " in log, log[-3000:]
        assert (run_dir / "report" / "report.html").exists(), "the head's end-of-run report was not written"
    finally:
        try:
            bed.stop_ray()
        finally:
            bed.teardown()
        assert bed.leftovers() == [], bed.leftovers()

    # the offline commands, in the head's environment, on the finished run
    def mindpulse(*args: str) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        return subprocess.run([head_py, "-m", "mindpulse.launcher.cli", *args], capture_output=True, text=True,
                              timeout=300, cwd=tmp_path, env=env)

    for args, needle in [(["config", "--set", "train.steps=3"], "steps: 3"),
                         (["plan", "--set", "world.nodes=2"], "mindpulse.workers.rank_main"),
                         (["report", str(run_dir), "--out", str(tmp_path / "report")], "report: "),
                         (["top", str(run_dir), "--once"], "step"),
                         (["rules", str(run_dir)], "nonfinite")]:
        res = mindpulse(*args)
        assert res.returncode == 0 and needle in res.stdout, f"mindpulse {' '.join(args)}:\n{res.stdout[-2000:]}" \
                                                               f"\n{res.stderr[-3000:]}"
        assert "mindspore" not in res.stderr.lower(), res.stderr[-2000:]
    assert (tmp_path / "report" / "report.html").exists()
