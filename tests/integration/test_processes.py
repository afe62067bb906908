"""A real local run's processes: what they listen on, what they keep private, and that none
outlives a launcher killed with SIGKILL (a real `mindpulse launch` of
cluster_configs/local_cpu.yaml, real Ray, real MindSpore ranks)."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import NO_REPORT, ROOT, last_steps, mindpulse_cmd

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

CONFIG = ROOT / "cluster_configs" / "local_cpu.yaml"
DOCUMENTED_EXCEPTIONS: dict[str, str] = {}
"""Process name → why it listens beyond loopback (docs/security.md says the same). None
with Ray 2.60 and MindSpore 2.9: the embedded cluster advertises 127.0.0.1, MindSpore's
workers get MS_WORKER_IP=127.0.0.1."""
GONE_WITHIN_S = 15


class Run:
    """A launch in the background whose processes are recorded while it runs: the
    launcher's descendants, and whatever carries the run's tag, Ray temp dir or run
    directory in its command line or environment."""

    def __init__(self, out: Path, *args: str):
        self.out = out / "runs"
        self.log = open(out / "launcher.out", "w")  # closed in stop()
        self.proc = subprocess.Popen(mindpulse_cmd() + ["launch", str(CONFIG), "--set", f"output.root={self.out}",
                                                        "--set", "monitor.per_print_step=100", *NO_REPORT, *args],
                                     cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.seen: dict[int, tuple[float, str]] = {}

    @property
    def run_dir(self) -> Path | None:
        dirs = list(self.out.iterdir()) if self.out.exists() else []
        return dirs[0] if dirs else None

    def pids(self) -> dict:
        try:
            return json.loads((self.run_dir / "pids.json").read_text())
        except (OSError, TypeError, ValueError):
            return {}

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-4000:]

    def _marks(self) -> list[str]:
        p = self.pids()
        return [m for m in (p.get("run_tag"), p.get("ray_temp_dir"), str(self.run_dir) if self.run_dir else None)
                if m]

    def record(self) -> None:
        """Add every process of the run alive now to `seen`."""
        procs: list[psutil.Process] = []
        try:
            me = psutil.Process(self.proc.pid)
            procs = [me] + me.children(recursive=True)
        except psutil.Error:
            pass
        marks = self._marks()
        if marks:
            for p in psutil.process_iter():
                try:
                    text = " ".join(p.cmdline())
                    env = p.environ()
                except psutil.Error:
                    continue
                text += " " + " ".join(f"{k}={v}" for k, v in env.items() if k.startswith("MINDPULSE_"))
                if any(m in text for m in marks):
                    procs.append(p)
        for p in procs:
            try:
                self.seen.setdefault(p.pid, (p.create_time(), " ".join(p.cmdline())[:160] or p.name()))
            except psutil.Error:
                pass

    def alive(self) -> dict[int, str]:
        out = {}
        for pid, (ct, cmd) in self.seen.items():
            try:
                p = psutil.Process(pid)
                if abs(p.create_time() - ct) < 1.0 and p.status() != psutil.STATUS_ZOMBIE:
                    out[pid] = cmd
            except psutil.Error:
                pass
        return out

    def wait_for_step(self, step: int, timeout: float = 300) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            self.record()
            steps = last_steps(self.run_dir) if self.run_dir else {}
            if len(steps) >= 2 and min(steps.values()) >= step:
                return
            if self.proc.poll() is not None:
                pytest.fail(f"the run ended early:\n{self.output()}")
            time.sleep(0.5)
        pytest.fail(f"the run never reached step {step}:\n{self.output()}")

    def stop(self) -> None:
        """Whatever the test did: nothing of the run is left running."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        time.sleep(1)
        self.record()
        for pid in self.alive():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        self.log.close()


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    run = Run(tmp_path_factory.mktemp("live"), "--set", "train.steps=2000")
    try:
        run.wait_for_step(2)
        yield run
    finally:
        run.stop()


def _exposed(run: Run, seconds: float) -> dict[str, set[str]]:
    """Process → the non-loopback addresses it listened on (TCP listening, UDP bound) while
    sampled for `seconds`."""
    exposed: dict[str, set[str]] = {}
    deadline = time.time() + seconds
    while time.time() < deadline:
        run.record()
        for pid in run.alive():
            try:
                p = psutil.Process(pid)
                conns = p.net_connections(kind="inet")
                name = p.name()
            except psutil.Error:
                continue
            for c in conns:
                listening = c.status == psutil.CONN_LISTEN or (c.type == 2 and not c.raddr)  # SOCK_DGRAM
                if not listening:
                    continue
                ip = ipaddress.ip_address(c.laddr.ip.split("%")[0])
                ip = getattr(ip, "ipv4_mapped", None) or ip
                if not ip.is_loopback:
                    exposed.setdefault(f"{name} (pid {pid})", set()).add(f"{c.laddr.ip}:{c.laddr.port}")
        time.sleep(0.5)
    return exposed


# ---- 10 -------------------------------------------------------------------------------------------------
def test_a_local_run_listens_on_loopback_only(live):
    exposed = _exposed(live, 6)
    names = {k.split(" (pid")[0] for k in exposed}
    unexplained = {k: v for k, v in exposed.items() if k.split(" (pid")[0] not in DOCUMENTED_EXCEPTIONS}
    assert not unexplained, (f"a local run listens beyond loopback: {unexplained} "
                             f"(documented exceptions: {sorted(names & set(DOCUMENTED_EXCEPTIONS))})")
    kinds = " ".join(c for _, c in live.seen.values())
    for must in ("gcs_server", "raylet", "DashboardAgent", "RuntimeEnvAgent", "mindpulse.workers.scheduler"):
        assert must in kinds or any(must in psutil.Process(p).name() for p in live.alive()), (
            f"{must} was not among the run's processes: the check would not have seen it")
    settings = json.loads((live.run_dir / "job.json").read_text())
    assert settings["ray_address"].startswith("127.0.0.1:"), settings["ray_address"]
    # the lean head (launcher/ray_session.py LEAN_HEAD_SKIPS): no API server, autoscaler monitor or log
    # monitor (no process, so no log of theirs), and the agents do not keep asking for the dashboard
    skipped = [c for c in kinds.split(" ") if c.endswith(("dashboard/dashboard.py", "autoscaler/_private/monitor.py",
                                                           "_private/log_monitor.py"))]
    logs = Path(live.pids()["ray_temp_dir"]) / "session_latest" / "logs"
    skipped += [p.name for p in logs.iterdir() if p.name.startswith(("dashboard.", "monitor.", "log_monitor."))]
    assert not skipped, f"the embedded cluster started what it should skip: {skipped}"
    agent_log = logs / "dashboard_agent.log"
    asking = agent_log.read_text(errors="replace").count("Get dashboard http address failed")
    time.sleep(3)
    assert agent_log.read_text(errors="replace").count("Get dashboard http address failed") == asking, \
        "the DashboardAgent keeps asking for a dashboard address (NO_DASHBOARD_ADDRESS not registered)"


# ---- 12 -------------------------------------------------------------------------------------------------
def test_the_embedded_cluster_runs_with_a_private_token(live):
    private = Path(live.pids()["run_tag"]).parent  # the run's folder: Ray's temp dir and the token
    token = private / "auth_token"
    assert stat.S_IMODE(private.stat().st_mode) == 0o700
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    raylets = [p for p in live.alive() if psutil.Process(p).name() == "raylet"]
    assert raylets, "no raylet found"
    env = psutil.Process(raylets[0]).environ()
    assert env.get("RAY_AUTH_MODE") == "token" and env.get("RAY_AUTH_TOKEN_PATH") == str(token)


def test_ray_auth_mode_disabled_is_refused_before_anything_starts(run_cli):
    r = run_cli("launch", str(CONFIG), "--set", "train.steps=2", env={"RAY_AUTH_MODE": "disabled"}, timeout=120)
    assert r.returncode == 2, r.output
    assert "RAY_AUTH_MODE=disabled" in r.stderr and "ray.allow_no_auth" in r.stderr, r.output
    assert r.run_dir is None, "a refused launch left a run directory"


# ---- 15 -------------------------------------------------------------------------------------------------
def test_the_run_directory_is_private(live):
    d = live.run_dir
    assert stat.S_IMODE(d.stat().st_mode) == 0o700 and stat.S_IMODE((d / "logs").stat().st_mode) == 0o700
    for name in ("config.yaml", "job.json", "plan.json", "pids.json", "logs/rank_0.log", "logs/rank_1.log",
                 "logs/scheduler.log"):
        assert stat.S_IMODE((d / name).stat().st_mode) == 0o600, name


# ---- 13 (last: it ends the run) ----------------------------------------------------------------------------
def _assert_nothing_outlives_a_killed_launcher(run: Run) -> None:
    for _ in range(6):  # a few more looks at the tree, as it is now
        run.record()
        time.sleep(0.5)
    before = run.alive()
    names = " ".join(before.values())
    assert len(before) >= 8 and "raylet" in names, f"too few run processes recorded to judge: {before}"
    killed_at = time.time()
    run.proc.send_signal(signal.SIGKILL)
    run.proc.wait()
    left: dict[int, str] = {}
    while time.time() - killed_at < GONE_WITHIN_S:
        left = run.alive()
        if not left:
            break
        time.sleep(0.5)
    # what carries the run's marks now, recorded or not
    run.record()
    left.update(run.alive())
    assert not left, (f"{len(left)} of the run's {len(before)} processes were alive {GONE_WITHIN_S}s after "
                      f"the launcher's SIGKILL: {left}")


def test_every_process_of_the_run_ends_when_the_launcher_is_killed(live):
    assert any("mindpulse.workers.scheduler" in c for c in live.alive().values())
    _assert_nothing_outlives_a_killed_launcher(live)


def test_with_msrun_nothing_outlives_a_killed_launcher(tmp_path):
    run = Run(tmp_path, "--set", "backend=msrun", "--set", "train.steps=2000")
    try:
        run.wait_for_step(2)
        # the node's card telemetry runs while msrun does (the agent answers next to run_msrun:
        # a threaded actor; as an async one it sampled only once msrun had ended)
        from mindpulse.rundir.metrics_store import read_wire

        deadline = time.time() + 15
        while not any(o.get("t") == "telemetry" for o in read_wire(run.run_dir / "metrics.msgpack")):
            assert time.time() < deadline, "no telemetry from the node while msrun runs"
            time.sleep(0.5)
        exposed = _exposed(run, 3)
        assert not exposed, f"an msrun run listens beyond loopback: {exposed}"
        ranks = [p for p, c in run.alive().items() if "mindpulse.workers.rank_main" in c]
        assert len(ranks) >= 2, f"msrun's ranks were not found among the run's processes: {run.alive()}"
        _assert_nothing_outlives_a_killed_launcher(run)
    finally:
        run.stop()


# ---- an interrupt before any step -----------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["ray", "msrun"])
def test_ctrl_c_while_the_ranks_start_stops_them_at_once(tmp_path, backend):
    """Ctrl-C once the ranks (Ray actors, or msrun's processes) run their job but before any
    step: nothing to finish, so every rank is stopped now (not after start-up and a first
    step), and nothing is left. Rank 1 hangs before step 1 (hang@1:1), so no step can
    complete before the interrupt."""
    run = Run(tmp_path, "--set", f"backend={backend}", "--set", "train.steps=2000", "--inject", "hang@1:1")
    try:
        deadline = time.time() + 180
        log = None
        while time.time() < deadline:  # the ranks' job has started (the launcher's start is over)
            run.record()
            log = run.run_dir / "logs" / "rank_1.log" if run.run_dir else None
            if log is not None and log.exists() and "injecting fault hang@1:1" in log.read_text(errors="replace"):
                break
            if run.proc.poll() is not None:
                pytest.fail(f"the run ended early:\n{run.output()}")
            time.sleep(0.2)
        else:
            pytest.fail(f"rank 1 never reached its fault:\n{run.output()}")
        time.sleep(1)
        run.record()
        assert max(last_steps(run.run_dir).values(), default=0) == 0, "a step ran despite the hang"
        run.proc.send_signal(signal.SIGINT)
        assert run.proc.wait(timeout=120) == 130, run.output()
        out = run.output()
        s = json.loads((run.run_dir / "summary.json").read_text())
        assert s["status"] == "interrupted" and s["steps_completed"] == 0, s
        assert s["message"] == "interrupted by the user during start-up, before any step", s["message"]
        assert "interrupt during start-up: no step has run yet; stopping every rank now" in out, out
        assert {r["error"] for r in s["ranks"]} == {"killed"}, s["ranks"]
        assert not any((run.run_dir / "checkpoints").glob("*")), "a checkpoint was written before any step"
        time.sleep(2)
        assert not run.alive(), f"processes left running: {run.alive()}"
    finally:
        run.stop()


@pytest.mark.parametrize("backend", ["ray", "msrun"])
def test_sighup_stops_like_a_first_ctrl_c_and_a_second_interrupt_kills_at_once(tmp_path, backend):
    """Mid-run, on ~1.5 s steps (slow@0:1: the graceful stop takes seconds): SIGHUP (the terminal
    closed) asks every rank to stop after the same step, as a first Ctrl-C does; a Ctrl-C while
    that stop goes on kills every rank at once; exit 130, nothing left running."""
    run = Run(tmp_path, "--set", f"backend={backend}", "--set", "train.steps=2000", "--inject", "slow@0:1")
    try:
        run.wait_for_step(2, timeout=240)
        run.proc.send_signal(signal.SIGHUP)
        deadline = time.time() + 30
        while "interrupt: every rank stops after the same step" not in run.output() and time.time() < deadline:
            time.sleep(0.1)
        assert "interrupt: every rank stops after the same step" in run.output(), run.output()
        assert run.proc.poll() is None, "the launcher ended on the first interrupt"
        t0 = time.time()
        run.proc.send_signal(signal.SIGINT)
        assert run.proc.wait(timeout=60) == 130, run.output()
        assert time.time() - t0 < 20, f"the second interrupt took {time.time() - t0:.1f}s to end the launch"
        assert "second interrupt: killing every rank" in run.output(), run.output()
        s = json.loads((run.run_dir / "summary.json").read_text())
        assert s["status"] == "interrupted", s["status"]
        assert "killed" in {r["error"] for r in s["ranks"]}, s["ranks"]
        time.sleep(2)
        run.record()
        assert not run.alive(), f"processes left running: {run.alive()}"
    finally:
        run.stop()


def test_ctrl_c_while_the_launcher_starts_the_attempt_ends_the_launch_at_once(tmp_path):
    """Ctrl-C while the launcher waits for the nodes, the agents, the scheduler or the rank
    actors: the start gives up there (not after its timeouts), ends what it started, and the
    launch exits 130."""
    run = Run(tmp_path, "--set", "train.steps=2000")
    try:
        deadline = time.time() + 180
        while not run.pids().get("run_tag") and time.time() < deadline:  # the attempt's start began
            run.record()
            if run.proc.poll() is not None:
                pytest.fail(f"the run ended early:\n{run.output()}")
            time.sleep(0.05)
        assert not run.pids().get("ranks"), "the ranks started already: the test came too late"
        run.proc.send_signal(signal.SIGINT)
        assert run.proc.wait(timeout=120) == 130, run.output()
        out = run.output()
        assert re.search(r"interrupt during start-up \(interrupted (while waiting for the [a-zA-Z ]+|before the "
                         r"attempt started)\): stopping now", out), out
        s = json.loads((run.run_dir / "summary.json").read_text())
        assert s["status"] == "interrupted" and s["steps_completed"] == 0, s
        assert s["message"] == "interrupted by the user during start-up, before any step", s["message"]
        time.sleep(2)
        run.record()
        assert not run.alive(), f"processes left running: {run.alive()}"
    finally:
        run.stop()


WAIT_SCRIPT = """
import logging, os, signal, sys, threading, time
import ray
from ray.util.placement_group import placement_group
from mindpulse.launcher.interrupts import Interrupts, StartInterrupted, get

ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR,
         _node_ip_address="127.0.0.1")
intr = Interrupts()
signal.signal(signal.SIGINT, intr.on_signal)
pg = placement_group([{"CPU": 64}])  # more than the cluster has: never placed
threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
t0 = time.monotonic()
try:
    get(pg.ready(), 120, intr.pending, "the placement of the nodes")
    print("placed?!")
except StartInterrupted as exc:
    print(f"interrupted after {time.monotonic() - t0:.1f} s: {exc}")
print("ready:", get([ray.put(1), ray.put(2)], 10, lambda: False), get(ray.put(3), 10, lambda: False))


@ray.remote(num_cpus=0)
def boom():
    raise ValueError("boom")


t0 = time.monotonic()
try:  # one fails while another never ends: the failure, at once (as ray.get), not the timeout
    get([boom.remote(), placement_group([{"CPU": 64}]).ready()], 60, lambda: False, "the pair")
except Exception as exc:
    print(f"failed after {time.monotonic() - t0:.1f} s: {'boom' in str(exc)}")
ray.shutdown()
"""


def test_the_starts_waits_on_ray_hear_an_interrupt(tmp_path):
    """Ray runs the signal handler during `ray.get` but keeps waiting (here: for a placement
    group it can never place, up to the 120 s timeout); the launcher's waits stop at once."""
    r = subprocess.run([sys.executable, "-c", WAIT_SCRIPT], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    m = re.search(r"interrupted after ([\d.]+) s: interrupted while waiting for the placement of the nodes", r.stdout)
    assert m, r.stdout + r.stderr[-3000:]
    assert float(m.group(1)) < 30, "the wait went on long after the interrupt"
    assert "ready: [1, 2] 3" in r.stdout, r.stdout
    m = re.search(r"failed after ([\d.]+) s: True", r.stdout)
    assert m and float(m.group(1)) < 30, r.stdout + r.stderr[-3000:]
