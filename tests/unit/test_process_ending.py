"""Ending processes and the parent-death signal (mindpulse/lifetime/processes.py), with real
processes: a child that ends when asked, one that ignores SIGTERM, one in a process group
of its own, and a process tree like msrun's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from mindpulse.lifetime.processes import descendants, end_process_tree, end_processes

# a child that says it is ready only once its SIGTERM handler is in place
STUBBORN = ("import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('ready', flush=True); time.sleep(60)")


def _sleep(**kw) -> subprocess.Popen:
    return subprocess.Popen(["sleep", "60"], **kw)


def _stubborn(**kw) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE, text=True, **kw)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _python(code: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True,
                            **kw)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _gone_within(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return not _alive(pid)


@pytest.fixture(autouse=True)
def _no_strays():
    """Whatever a test started and left running (a failed assertion) is killed."""
    before = descendants(os.getpid())
    yield
    end_processes({pid: ct for pid, ct in descendants(os.getpid()).items() if pid not in before},
                  kill_wait_s=5.0)


def test_a_process_that_ends_when_asked_is_not_killed():
    proc = _sleep()
    t0 = time.monotonic()
    killed = end_processes({proc.pid: psutil.Process(proc.pid).create_time()}, ask=signal.SIGTERM, grace_s=5.0)
    assert killed == []
    assert proc.wait(5) == -signal.SIGTERM
    assert time.monotonic() - t0 < 2.0, "the grace was waited out although the process had ended"


def test_a_process_that_ignores_sigterm_is_killed_after_the_grace():
    proc = _stubborn()
    t0 = time.monotonic()
    killed = end_processes([proc.pid], ask=signal.SIGTERM, grace_s=0.5, kill_wait_s=5.0)
    took = time.monotonic() - t0
    assert killed == [proc.pid]
    assert proc.wait(5) == -signal.SIGKILL
    assert 0.4 <= took < 3.0, f"the grace was not kept ({took:.2f} s)"


def test_without_a_request_the_processes_get_the_grace_then_sigkill():
    leaving = _python("import time; time.sleep(0.2)")
    lingering = _sleep()
    killed = end_processes([leaving.pid, lingering.pid], grace_s=1.0)
    assert killed == [lingering.pid]
    assert leaving.wait(5) == 0, "a process that ended within the grace was signalled"
    assert lingering.wait(5) == -signal.SIGKILL


def test_a_reused_pid_and_this_process_are_never_signalled():
    other = _sleep()
    ct = psutil.Process(other.pid).create_time()
    assert end_processes({other.pid: ct - 100.0, os.getpid(): None}, ask=signal.SIGTERM) == []
    assert other.poll() is None, "a process with another creation time was signalled"
    assert end_processes([]) == []
    other.kill()
    other.wait(5)


def test_with_groups_the_whole_process_group_is_ended():
    """A member of the group that nobody named by pid goes with it (a tool's helper)."""
    leader = _python("""
        import subprocess, sys, time
        helper = subprocess.Popen(["sleep", "60"])  # same process group as its parent
        print(helper.pid, flush=True)
        time.sleep(60)
    """, start_new_session=True)
    helper = int(leader.stdout.readline())
    assert os.getpgid(helper) == leader.pid
    killed = end_processes([leader.pid], ask=signal.SIGTERM, grace_s=5.0, groups=True)
    assert killed == []
    assert leader.wait(5) == -signal.SIGTERM
    assert _gone_within(helper, 5), "the group's other member outlived the group's end"


def test_this_process_group_is_never_signalled_as_a_group():
    """A child in this test's own process group: only the child is signalled."""
    proc = _sleep()
    assert os.getpgid(proc.pid) == os.getpgrp()
    assert end_processes([proc.pid], ask=signal.SIGTERM, grace_s=5.0, groups=True) == []
    assert proc.wait(5) == -signal.SIGTERM  # and this process is still here to see it


def test_a_process_tree_ends_with_its_members_in_sessions_of_their_own():
    """msrun's shape: the child's worker runs in a session of its own and ignores SIGTERM."""
    parent = _python(f"""
        import subprocess, sys, time
        worker = subprocess.Popen([sys.executable, "-c", {STUBBORN!r}], stdout=subprocess.PIPE,
                                  start_new_session=True)
        worker.stdout.readline()
        print(worker.pid, flush=True)
        time.sleep(60)
    """, start_new_session=True)
    worker = int(parent.stdout.readline())
    assert worker in descendants(parent.pid)
    assert abs(descendants(parent.pid)[worker] - psutil.Process(worker).create_time()) < 1e-6
    t0 = time.monotonic()
    killed = end_process_tree(parent, grace_s=0.5)
    assert killed == [worker], "only the worker that ignored SIGTERM needed SIGKILL"
    assert parent.returncode == -signal.SIGTERM, "the child was not reaped"
    assert _gone_within(worker, 5)
    assert time.monotonic() - t0 < 3.0


def test_descendants_of_a_gone_process_are_none():
    proc = subprocess.Popen(["true"])
    proc.wait(5)
    assert descendants(proc.pid) == {}


def test_a_process_with_the_parent_death_signal_dies_with_its_parent():
    parent = _python("""
        import subprocess, sys, time
        code = ("import time; from mindpulse.lifetime.processes import die_with_parent; "
                "print(die_with_parent(), flush=True); time.sleep(60)")
        child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        armed = child.stdout.readline().strip()
        print(child.pid, armed, flush=True)
        time.sleep(60)
    """)
    pid, armed = parent.stdout.readline().split()
    child = int(pid)
    assert armed == "True"
    assert _alive(child)
    parent.kill()
    parent.wait(5)
    assert _gone_within(child, 5), "the child outlived its parent"

