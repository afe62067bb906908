"""Multi-node for real: hosts with their own addresses (network namespaces on a bridge,
tests/netns_hosts.py), Ray started on each as the README's "Multi-node" section says (token
auth, `ray start --head --node-ip-address=…` then `ray start --address=…`), and
`mindpulse launch` run on the head with `ray.address` set; 2 ranks per host.

- one launch per backend across two hosts (the ray launch also: a NaN on a rank of the
  second host stops every rank after the same step, the best checkpoint by rank 0, the
  listening sockets of each host, `mindpulse plan` on the head);
- a launch refused when a host does not share `output.root` (`checkpoint.require_shared`);
- a node lost mid-run (every process of a worker host killed at once), the run restarted
  on the hosts left with a spare host;
- a link lost mid-run (a worker host's link down for 30 s).

The measured times (launch to first step, lost node to every rank stopped, lost link to
named) are printed and written to `multihost_times.json` in the test's folder.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import NO_REPORT, ROOT, assert_every_step_from_every_rank, last_steps, mindpulse_cmd
from netns_hosts import Testbed, can_create_namespaces

from mindpulse.rundir.metrics_store import read_wire

# one multi-host test bed at a time (tests/suite_schedule.py): each is a cluster of its own (2-3 Ray
# nodes, 4 ranks), and several beside the other launches overloaded the 2 cores
pytestmark = [pytest.mark.slow, pytest.mark.cluster, pytest.mark.xdist_group("netns"),
              pytest.mark.skipif(can_create_namespaces() is not None, reason=str(can_create_namespaces()))]
RAY = str(Path(sys.executable).parent / "ray")
BASE = ["--set", "world.nodes=2", "--set", "world.ranks_per_node=2", "--set", "monitor.per_print_step=50",
        "--set", "monitor.telemetry_interval_s=2", *NO_REPORT]
TIMES: dict[str, float] = {}


def _say_time(name: str, seconds: float, tmp: Path) -> None:
    TIMES[name] = round(seconds, 1)
    print(f"multihost time: {name} = {seconds:.1f} s")
    (tmp / "multihost_times.json").write_text(json.dumps(TIMES, indent=1))


class Launch:
    """`mindpulse launch` on the head host, its output in a file, watched while it runs."""

    def __init__(self, bed: Testbed, env: dict[str, str], out: Path, args: list[str]):
        self.out_root = out
        self.log = out.parent / f"{out.name}-launch.log"
        self.started = time.monotonic()
        self.fh = open(self.log, "w")
        self.proc = bed.spawn(0, mindpulse_cmd() + ["launch", "--set", f"ray.address={bed.hosts[0].address}:6379",
                                                    "--set", f"output.root={out}", *args],
                              env=env, stdout=self.fh, cwd=ROOT)
        self.first_step_s: float | None = None

    @property
    def run_dir(self) -> Path | None:
        dirs = [d for d in self.out_root.iterdir() if d.is_dir()] if self.out_root.exists() else []
        return dirs[0] if dirs else None

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_step(self, step: int, timeout: float = 240) -> dict[int, int]:
        """Until every rank reported `step` (the first step's time kept)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"the launch ended early:\n{self.output()[-4000:]}"
            steps = last_steps(self.run_dir) if self.run_dir else {}
            if steps and self.first_step_s is None:
                self.first_step_s = time.monotonic() - self.started
            if steps and min(steps.values()) >= step and len(steps) >= 4:
                return steps
            time.sleep(0.3)
        raise AssertionError(f"no step {step} within {timeout}s:\n{self.output()[-4000:]}")

    def wait_line(self, pattern: str, timeout: float) -> float:
        """Seconds until the output holds `pattern` (a regex)."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if re.search(pattern, self.output()):
                return time.monotonic() - t0
            time.sleep(0.2)
        raise AssertionError(f"no {pattern!r} within {timeout}s:\n{self.output()[-4000:]}")

    def checkpoint_trail(self) -> str:
        """What rank 0 and the aggregator said about checkpoints (a failed best-checkpoint check)."""
        lines: list[str] = []
        rank0 = self.run_dir / "logs" / "rank_0.log" if self.run_dir else None
        if rank0 is not None and rank0.exists():
            lines += [x for x in rank0.read_text(errors="replace").splitlines()
                      if re.search(r"checkpoint|save|directive|verdict|lease|relay", x, re.I)][-40:]
        lines += [x for x in self.output().splitlines() if re.search(r"checkpoint|WARNING|ERROR|dropped", x)][-40:]
        manifest = self.run_dir / "checkpoints" / "manifest.json" if self.run_dir else None
        if manifest is not None and manifest.exists():
            lines.append("manifest: " + manifest.read_text()[:2000])
        return "\n".join(lines)

    def finish(self, timeout: float = 300) -> tuple[int, dict]:
        try:
            code = self.proc.wait(timeout=timeout)
        finally:
            self.fh.close()
        summary = json.loads((self.run_dir / "summary.json").read_text()) if self.run_dir else {}
        return code, summary


def _cluster(count: int, tmp: Path, *, start: int | None = None, private: dict[int, list[str]] | None = None):
    """A test bed of `count` hosts with Ray on the first `start` of them (2 CPUs each)."""
    token = tmp / "ray_token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    bed = Testbed(count, private=private)
    bed.create()
    try:
        bed.start_ray(RAY, token, resources={i: 2 for i in range(count)}, count=start)
    except BaseException:
        bed.teardown()
        raise
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", **bed.ray_env(token))
    return bed, env, token


def _join(bed: Testbed, host: int, token: Path) -> None:
    """`ray start --address=HEAD_IP:6379 --node-ip-address=THIS_IP` on one more host."""
    h = bed.hosts[host]
    res = bed.run(host, [RAY, "start", f"--address={bed.hosts[0].address}:6379", f"--node-ip-address={h.address}",
                         "--num-cpus=2", "--disable-usage-stats"], env=bed.ray_env(token), timeout=90)
    assert res.returncode == 0, res.stdout + res.stderr


def _down(bed: Testbed, token: Path) -> None:
    try:
        bed.stop_ray()
    finally:
        bed.teardown()
    assert bed.leftovers() == [], bed.leftovers()


def _listeners(bed: Testbed, host: int) -> list[tuple[str, str]]:
    """(local address, command line) of every TCP listener on a host."""
    out = bed.run(host, ["ss", "-Hltnp"]).stdout
    found = []
    for line in out.splitlines():
        cols = line.split()
        if len(cols) >= 4:
            pid = re.search(r"pid=(\d+)", line)
            try:
                cmd = Path(f"/proc/{pid.group(1)}/cmdline").read_bytes().replace(b"\0", b" ").decode() if pid else "?"
            except OSError:
                cmd = "?"
            found.append((cols[3], cmd.strip()))
    return found


RAYS_OWN = re.compile(r"^(ray::|\S*raylet|\S*gcs_server|\S*python\S* .*/ray/|\S*python\S* -m ray\.)")
"""Ray's own servers (GCS, raylet, object manager, core workers' gRPC, its agents): they bind
every interface whatever `--node-ip-address` says (docs/multinode.md: firewall them)."""


RAY_WORKER_PORTS = range(10002, 20000)
"""Ray's `--min-worker-port`..`--max-worker-port`: the gRPC server of every Ray worker and
driver (rank actors, node agents, the aggregator, the launcher itself), Ray's own."""


def _check_listeners(listening: dict[str, list[tuple[str, str]]], bed: Testbed, run_dir: Path, tmp: Path) -> None:
    """mindpulse's own listeners are on the host's cluster address or loopback: each node's
    packet relay on loopback, the aggregator's uplink on the head's address. What binds every
    interface is Ray's own or MindSpore's scheduler (listed in multihost_listeners.json)."""
    relays = json.loads((run_dir / "job.json").read_text())["relays"]
    ports = {int(str(a).rsplit(":", 1)[1]) for a in relays.values()}
    wide: dict[str, list[tuple[str, str]]] = {}
    for h in bed.hosts:
        mine = [(a, c) for a, c in listening[h.name] if int(a.rsplit(":", 1)[1]) in ports]
        assert all(a.startswith("127.0.0.1:") for a, _ in mine), mine
        near = (h.address + ":", "127.", "[::1]", "[::ffff:127.", f"[::ffff:{h.address}]")
        wide_full = [(a, c) for a, c in listening[h.name] if not a.startswith(near)]
        wide[h.name] = [(a, c[:120]) for a, c in wide_full]
        ours = [(a, c) for a, c in wide_full if not RAYS_OWN.match(c) and "mindpulse.workers.scheduler" not in c
                and int(a.rsplit(":", 1)[1]) not in RAY_WORKER_PORTS]
        assert not ours, f"{h.name}: mindpulse listens beyond {h.address} and loopback: {ours}"
    head = bed.hosts[0]
    assert any(a.startswith(head.address + ":") and "Aggregator" in c for a, c in listening[head.name]), \
        "the aggregator's uplink is not on the head's cluster address"
    (tmp / "multihost_listeners.json").write_text(json.dumps(wide, indent=1))


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("twohosts")
    private = str(tmp / "unshared")
    bed, env, token = _cluster(2, tmp, private={1: [private]})
    try:
        yield bed, env, tmp
    finally:
        _down(bed, token)


def test_ray_backend_across_two_hosts_nan_on_the_second_stops_every_rank(two_hosts):
    bed, env, tmp = two_hosts
    run = Launch(bed, env, tmp / "ray", [*BASE, "--set", "train.steps=14", "--set", "checkpoint.best_every_steps=5",
                                         "--inject", "nan_grad@2:10"])
    run.wait_step(2)
    listening = {h.name: _listeners(bed, i) for i, h in enumerate(bed.hosts)}
    code, s = run.finish()
    out = run.output()
    _say_time("ray launch to first step (2 hosts, pre-flight check on)", run.first_step_s or 0, tmp)
    assert code == 3, out[-4000:]
    assert s["status"] == "anomaly_stop" and s["stop"]["rule"] == "nonfinite" and s["stop"]["rank"] == 2, s["stop"]
    steps = last_steps(run.run_dir)
    assert len(set(steps.values())) == 1 and steps[0] == s["stop"]["step"], f"not after the same step: {steps}"
    # the loss reduced over all four ranks, two on each host
    assert {o["rank"] for o in read_wire(run.run_dir / "metrics.msgpack") if o.get("t") == "step"} == {0, 1, 2, 3}
    assert len({x["node_id"] for x in s["ranks"]}) == 2
    # the node table names both hosts; telemetry from both
    for h in bed.hosts:
        assert h.name in out, f"{h.name} is not in the launch's output:\n{out[-4000:]}"
    tel = {o["node"] for o in read_wire(run.run_dir / "metrics.msgpack") if o.get("t") == "telemetry"}
    assert len(tel) == 2, tel
    best = s["best_checkpoint"]  # written by rank 0, on the head
    assert best and best["step"] in (5, 10) and Path(best["path"]).exists(), \
        f"best checkpoint {best}; packets {s.get('packets')}; monitor {s.get('monitor')}\n{run.checkpoint_trail()}"
    assert s["output_not_shared"] == []
    _check_listeners(listening, bed, run.run_dir, tmp)
    # `mindpulse plan` on the head prints what ran
    plan = bed.run(0, mindpulse_cmd() + ["plan", "--json", "--set", f"ray.address={bed.hosts[0].address}:6379", *BASE],
                   env=env, cwd=ROOT, timeout=120)
    assert plan.returncode == 0, plan.stdout + plan.stderr

    def shape(specs: list[dict]) -> list[tuple]:
        return [(x["node"], x["rank"], x["local_rank"], x["device_id"]) for x in specs]

    assert shape(json.loads(plan.stdout)) == shape(json.loads((run.run_dir / "plan.json").read_text()))


def test_msrun_across_two_hosts(two_hosts):
    bed, env, tmp = two_hosts
    run = Launch(bed, env, tmp / "msrun", [*BASE, "--set", "backend=msrun", "--set", "train.steps=6",
                                           "--set", "monitor.group_size=2", "--set", "preflight.enabled=false"])
    run.wait_step(1)
    code, s = run.finish()
    _say_time("msrun launch to first step (2 hosts)", run.first_step_s or 0, tmp)
    assert code == 0, run.output()[-4000:]
    assert s["status"] == "succeeded" and s["steps_completed"] == 6
    assert_every_step_from_every_rank(run.run_dir, 6, 4)
    assert len({x["node_id"] for x in s["ranks"]}) == 2
    assert len({x["param_fingerprint"] for x in s["ranks"]}) == 1, s["ranks"]
    # the two hosts form one group: host 1's agent sends through host 0's, which merges them (a step
    # whose member partial is late goes up node by node, node/group.py STRAGGLE_S: not every step)
    assert s["packets"]["group_partials"] >= 1, f"no step came merged by the group leader: {s['packets']}"
    assert s["packets"]["dropped"] == 0 and s["packets"]["rejected"] == 0, s["packets"]
    # each host's msrun started its own ranks (--node_rank), with the ranks' environment
    _assert_msrun_ran(run.run_dir, node=0, ranks=[0, 1])
    _assert_msrun_ran(run.run_dir, node=1, ranks=[2, 3])
    assert (run.run_dir / "logs" / "scheduler.log").exists(), "msrun's scheduler log (node 0) is missing"


def _assert_msrun_ran(run_dir: Path, node: int, ranks: list[int]) -> None:
    """What the node's msrun ran, from msrun's own lines (not the agent's echo of the msrun
    command) and from the ranks it started: each worker's command and log, the scheduler on
    node 0, and in each rank's log the rank id MindSpore's cluster took from the environment
    msrun exported (RANK_ID, MS_NODE_ID)."""
    from mindpulse.launcher.msrun_logs import parse_msrun_log

    logs = run_dir / "logs"
    ms = parse_msrun_log((logs / f"msrun_node{node}.log").read_text())
    task = f"python -m mindpulse.workers.rank_main --job {run_dir}/job.json"
    assert sorted(ms.workers) == ranks, f"msrun on node {node} started workers {sorted(ms.workers)}"
    for r in ranks:
        assert ms.workers[r].command == task, ms.workers[r]
        assert Path(ms.workers[r].log).resolve() == (logs / f"rank_{r}.log").resolve(), ms.workers[r]
        text = (logs / f"rank_{r}.log").read_text(errors="replace")
        assert f"[rank {r}] pid " in text and f"[rank {r}] finished with exit code 0" in text
        assert f"This node {r} rank id: {r}" in text, f"rank {r}'s cluster ids are not in its log"
    if node == 0:
        assert ms.scheduler_command == task
    assert not ms.died and not ms.killed_others


def test_a_host_that_does_not_share_output_root_refuses_the_launch(two_hosts):
    bed, env, tmp = two_hosts
    out = tmp / "unshared"  # a tmpfs of its own on the second host
    res = bed.run(0, mindpulse_cmd() + ["launch", "--set", f"ray.address={bed.hosts[0].address}:6379",
                                        "--set", f"output.root={out}", *BASE, "--set", "train.steps=2",
                                        "--set", "preflight.enabled=false", "--set", "checkpoint.require_shared=true"],
                  env=env, cwd=ROOT, timeout=240)
    assert res.returncode == 2, res.stdout[-3000:] + res.stderr[-3000:]
    text = res.stdout + res.stderr
    assert "is not shared with node 1" in text and bed.hosts[1].name in text and bed.hosts[1].address in text


def _rank_pids(run_dir: Path, ranks: list[int]) -> list[int]:
    pids = json.loads((run_dir / "pids.json").read_text()).get("ranks") or {}
    return [int(pids[str(r)]) for r in ranks if str(r) in pids]


def test_a_lost_node_is_named_and_the_run_goes_on_on_a_spare_host(tmp_path):
    bed, env, token = _cluster(3, tmp_path, start=2)  # the spare joins once the job runs
    try:
        run = Launch(bed, env, tmp_path / "runs", [*BASE, "--set", "train.steps=16", "--set", "max_restarts=1",
                                                    "--set", "checkpoint.save_checkpoint_steps=4",
                                                    "--set", "preflight.enabled=false"])
        run.wait_step(1)
        _join(bed, 2, token)
        run.wait_step(6)
        head_ranks = _rank_pids(run.run_dir, [0, 1])
        lost_at = time.monotonic()
        bed.kill_host(1)
        named = run.wait_line(r"node 1 \(\S+, 198\.18\.0\.2\) lost with ranks \[2, 3\]", timeout=30)
        while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in head_ranks):
            assert time.monotonic() - lost_at < 60, "the head's ranks were not stopped"
            time.sleep(0.1)
        _say_time("lost node to named", named, tmp_path)
        _say_time("lost node to every rank stopped", time.monotonic() - lost_at, tmp_path)
        code, s = run.finish(timeout=400)
        out = run.output()
        assert named <= 10, f"the lost node was named {named:.1f}s after the kill"
        assert "RpcError" not in out.split("lost with ranks")[0][-2000:]
        first = s["attempts"][0]
        assert first["failure"]["kind"] == "node_lost", first["failure"]
        node = first["failure"]["nodes"][0]
        assert (node["node"], node["host"], node["address"], node["ranks"]) == (1, bed.hosts[1].name,
                                                                               bed.hosts[1].address, [2, 3])
        assert "CPU device is not supported" not in first["failure"]["log_tail"]
        assert code == 0 and s["status"] == "succeeded", out[-4000:]
        assert len(s["attempts"]) == 2 and s["attempts"][1]["resumed_from"]["step"] >= 4, s["attempts"]
    finally:
        _down(bed, token)


def test_a_lost_link_is_named_as_a_partition_not_a_crash(tmp_path):
    bed, env, token = _cluster(2, tmp_path)
    try:
        run = Launch(bed, env, tmp_path / "runs", [*BASE, "--set", "train.steps=40",
                                                    "--set", "preflight.enabled=false"])
        run.wait_step(3)
        bed.link(1, up=False)
        cut = time.monotonic()
        try:
            named = run.wait_line(r"node 1 \(\S+, 198\.18\.0\.2\) cut off \(link lost\)", timeout=30)
            _say_time("lost link to named", named, tmp_path)
            while time.monotonic() - cut < 30:
                time.sleep(0.5)
        finally:
            bed.link(1, up=True)
        code, s = run.finish(timeout=300)
        assert code == 1, run.output()[-4000:]
        assert s["failure"]["kind"] == "link_lost" and s["failure"]["nodes"][0]["address"] == bed.hosts[1].address
        assert s["ranks"][0]["error"].startswith("stopped after another rank failed")
    finally:
        _down(bed, token)
