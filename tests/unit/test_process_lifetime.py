"""Nothing of a run outlives its launcher, with real processes and no cluster: the
parent-death signal the node agent gives what it starts, the agent's watchdog, the
embedded session's reaper, and the tests' own leftover check (msrun's ranks included)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from conftest import ROOT, run_leftovers

SLEEP = [sys.executable, "-c", "import time; time.sleep(120)"]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _wait_gone(pids, timeout: float) -> list[int]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        left = [p for p in pids if _alive(p)]
        if not left:
            return []
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _kill(*pids: int) -> None:
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass


def _python(code: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True, **kw)


# ---- 13: what the node agent starts dies with it ------------------------------------------------------
def test_a_child_started_with_the_death_signal_dies_with_its_parent():
    parent = _python("""
        import subprocess, sys, signal, time
        from mindpulse.lifetime.processes import die_with_parent_preexec
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True,
                                 preexec_fn=die_with_parent_preexec(signal.SIGKILL))
        print(child.pid, flush=True)
        time.sleep(120)
    """)
    child = int(parent.stdout.readline())
    try:
        assert _alive(child)
        parent.kill()
        parent.wait()
        assert _wait_gone([child], 5) == [], "the child outlived its parent"
    finally:
        _kill(child)


class WatchedAgent:
    """A NodeAgent (the real class, no Ray) whose own end is recorded instead of taken."""

    @staticmethod
    def make(driver: dict):
        from mindpulse.config.settings import NodeSettings
        from mindpulse.node.agent import NodeAgent

        class Agent(NodeAgent):
            exited = False

            def _exit(self) -> None:
                type(self).exited = True

        return Agent(None, NodeSettings(node=0, device="cpu", rank_devices={0: 0}, telemetry_interval_s=0,
                                        driver=driver))


@pytest.mark.slow  # real processes killed and reaped: seconds each
@pytest.mark.cluster
def test_the_agents_watchdog_ends_the_nodes_run_processes_when_the_driver_dies():
    from mindpulse.lifetime.process_identity import host_identity

    driver = subprocess.Popen(SLEEP)
    rank = subprocess.Popen(SLEEP, start_new_session=True)
    agent = WatchedAgent.make(dict(host_identity(), pid=driver.pid,
                                   create_time=psutil.Process(driver.pid).create_time()))
    # an msrun stand-in: its worker runs in a session of its own, as msrun's do
    code = ("import subprocess, sys, time; w = subprocess.Popen([sys.executable, '-c', 'import time; "
            "time.sleep(120)'], start_new_session=True); print(w.pid, flush=True); time.sleep(120)")
    msrun = agent._spawn([sys.executable, "-c", code], env=dict(os.environ), stdout=subprocess.PIPE,
                         death_signal=signal.SIGINT)
    agent.msrun = msrun
    worker = int(msrun.stdout.readline())
    agent.start_telemetry({0: rank.pid})  # telemetry off: the agent still learns its ranks' pids
    try:
        time.sleep(2.5)  # the watchdog (a second a look) has seen msrun's worker
        assert all(_alive(p) for p in (msrun.pid, worker, rank.pid)) and not agent.exited
        driver.kill()
        driver.wait()
        assert _wait_gone([msrun.pid, worker, rank.pid], 8) == [], "run processes outlived the driver"
        assert agent.exited
    finally:
        agent._ending.set()
        agent.relay.stop()
        _kill(msrun.pid, worker, rank.pid)
        for p in (msrun, rank):
            p.wait()


def test_a_driver_on_another_machine_is_not_judged_by_this_process_table():
    from mindpulse.lifetime.process_identity import host_identity

    agent = WatchedAgent.make(dict(host_identity(), boot_id="another-kernel", pid=1, create_time=0.0))
    try:
        assert agent.driver_alive() is None  # Ray would tell; without Ray: cannot tell, kill nothing
    finally:
        agent._ending.set()
        agent.relay.stop()


# ---- 13: the embedded session's reaper ------------------------------------------------------------------
FAKE_LAUNCHER = """
    import os, subprocess, sys, tempfile, time
    from mindpulse.config import from_dict
    from mindpulse.launcher.ray_session import RUN_TAG_ENV, RaySession
    s = RaySession(from_dict({}))
    s.private_dir = tempfile.mkdtemp(prefix="mindpulse-ray-")
    s.temp_dir = os.path.join(s.private_dir, "ray")
    s._start_reaper()
    os.environ[RUN_TAG_ENV] = s.temp_dir
    sleep = [sys.executable, "-c", "import time; time.sleep(120)"]
    # an msrun worker: a session of its own, known by the run's tag in its environment only
    tagged = subprocess.Popen(sleep, start_new_session=True)
    # one that carries no tag (Ray's agents do not name the folder): known as a descendant
    env = {k: v for k, v in os.environ.items() if k != RUN_TAG_ENV}
    plain = subprocess.Popen(sleep, start_new_session=True, env=env)
    print(s.private_dir, s._reaper.pid, tagged.pid, plain.pid, flush=True)  # the folder the reaper removes
    if sys.argv[1:] == ["done"]:
        time.sleep(1.5)
        s._restore_env()
        s._stop_reaper()
        sys.exit(0)
    time.sleep(120)
"""


def _fake_launcher(*args: str) -> tuple[subprocess.Popen, str, list[int]]:
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(FAKE_LAUNCHER), *args], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    tag, *pids = proc.stdout.readline().split()
    return proc, tag, [int(p) for p in pids]


@pytest.mark.slow  # real processes killed and reaped: seconds each
@pytest.mark.cluster
def test_the_reaper_kills_the_run_when_the_launcher_is_killed():
    launcher, tag, (reaper, tagged, plain) = _fake_launcher()
    try:
        time.sleep(3)  # the reaper (a second a look) has seen the launcher's descendants
        assert all(_alive(p) for p in (reaper, tagged, plain))
        launcher.kill()
        launcher.wait()
        assert _wait_gone([tagged, plain, reaper], 10) == [], "processes of the run outlived the launcher"
        assert not os.path.exists(tag), "the run's temp folder was left behind"
    finally:
        _kill(reaper, tagged, plain)


@pytest.mark.slow  # real processes killed and reaped: seconds each
@pytest.mark.cluster
def test_after_a_normal_end_the_reaper_only_sweeps_tagged_stragglers():
    launcher, tag, (reaper, tagged, plain) = _fake_launcher("done")
    try:
        assert launcher.wait(timeout=30) == 0
        assert _wait_gone([reaper, tagged], 15) == []
        assert _alive(plain), "the reaper killed a process that is not the run's"
    finally:
        _kill(reaper, tagged, plain)
        subprocess.run(["rm", "-rf", tag])


# ---- 26: the tests' leftover check sees msrun's ranks --------------------------------------------------
def test_the_leftover_check_sees_a_rank_msrun_started_in_its_own_session(tmp_path):
    run_dir = tmp_path / "runs" / "local-cpu-20261201-000000"
    run_dir.mkdir(parents=True)
    before = set(psutil.pids())
    # msrun's worker: its own session, python on PATH, no Ray or scheduler name in its command line
    env = dict(os.environ, MINDPULSE_SETTINGS=f"{run_dir}/job.json", RANK_ID="1")
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], env=env,
                            start_new_session=True)
    try:
        time.sleep(0.3)
        assert rank.pid in run_leftovers(before, run_dir, {}), "an msrun rank is invisible to the check"
        assert rank.pid not in run_leftovers(before, tmp_path / "another-run", {})
    finally:
        rank.kill()
        rank.wait()


def test_the_leftover_check_reads_pids_json_when_the_launcher_left_no_summary(tmp_path):
    from conftest import run_pids

    (tmp_path / "pids.json").write_text(json.dumps({"ray_temp_dir": "/tmp/x/ray", "run_tag": "/tmp/x"}))
    assert run_pids(tmp_path)["run_tag"] == "/tmp/x"
    assert run_pids(Path(tempfile.mkdtemp())) == {}


@pytest.fixture(autouse=True)
def _no_strays():
    before = set(psutil.Process().children(recursive=True))
    yield
    for p in set(psutil.Process().children(recursive=True)) - before:
        try:
            p.kill()
        except psutil.Error:
            pass


def test_ray_runs_the_node_agent_as_a_threaded_actor():
    """Ray makes an actor whose class has any coroutine method (a private one too) an async
    actor, which runs every plain method in one event loop, one call at a time: with msrun,
    `run_msrun` holds a call for the whole job, and `start_telemetry` (the launcher's start
    waited 28 s of a 30 s run for it), `kill_ranks`, `dump_stacks` and `stop` waited behind
    it. Asked with Ray's own test."""
    from ray._private.async_compat import has_async_methods

    from mindpulse.node.agent import NodeAgent

    assert not has_async_methods(NodeAgent), "NodeAgent has a coroutine method: Ray would run it as an async actor"


def test_a_rank_process_still_running_after_its_run_ended_is_killed_after_the_grace():
    """`end_lingering` (the node agent's last stop): a process that exits within the grace
    is left to exit, one still running after it is killed, and a pid whose start time does
    not match (the system gave it to another process) is never touched."""
    from mindpulse.node.agent import end_lingering

    lingering = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    leaving = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ct = {p.pid: psutil.Process(p.pid).create_time() for p in (lingering, leaving, other)}
        t0 = time.monotonic()
        killed = end_lingering({lingering.pid: ct[lingering.pid], leaving.pid: ct[leaving.pid],
                                other.pid: ct[other.pid] - 100.0}, grace_s=1.5)
        took = time.monotonic() - t0
        assert killed == [lingering.pid], f"killed {killed}"
        assert lingering.wait(5) == -signal.SIGKILL
        assert leaving.wait(5) == 0, "a process that ended within the grace was killed"
        assert other.poll() is None, "a process with another start time was killed"
        assert 1.0 <= took < 5.0, f"the grace was not waited out ({took:.2f} s)"
        assert end_lingering({}, grace_s=10.0) == []
    finally:
        for p in (lingering, leaving, other):
            if p.poll() is None:
                p.kill()
                p.wait(5)
