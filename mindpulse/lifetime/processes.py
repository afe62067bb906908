"""Ending the run's processes, and tying a process's life to its parent's: one policy for
the launcher, the node agents and the ranks.

**Ending** (:func:`end_processes`), for a set of processes each named by its pid and, where
known, its creation time:

1. a pid that is this process, no longer runs (a zombie counts as gone), or now belongs to
   another process (its creation time differs: the system reused the pid) is left alone;
2. with ``ask`` (SIGTERM), each is asked to end, then given ``grace_s`` to do so; without
   it they were told some other way already (a rank's run ended), and ``grace_s`` is how
   long they may still take;
3. those still running then are sent SIGKILL, which cannot be refused; ``kill_wait_s``
   waits for them to be gone (the kernel frees a killed process's memory and devices
   before its pid is gone).

With ``groups`` every signal goes to the process's whole process group: what the run
starts runs in sessions of its own, whose members (a tool's helpers) are not known by pid.
This process's own group is never signalled as a group. :func:`end_process_tree` ends a
child and every process under it so; :func:`descendants` lists them.

**Parent death** (:func:`die_with_parent`, :func:`die_with_parent_preexec`): Linux's
``PR_SET_PDEATHSIG`` has the kernel send a signal to a process when its parent dies, so
nothing the run starts trains on unsupervised when what started it is killed outright.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping

from mindpulse.lifetime.process_identity import process_alive

PR_SET_PDEATHSIG = 1
"""prctl's option that sets the parent-death signal (linux/prctl.h)."""

POLL_S = 0.05
"""How often a wait looks whether the processes are gone."""


# ---- ending processes ------------------------------------------------------------------------------
def end_processes(
    targets: Mapping[int, float | None] | Iterable[int],
    *,
    ask: int | None = None,
    grace_s: float = 0.0,
    kill_wait_s: float = 0.0,
    groups: bool = False,
) -> list[int]:
    """End `targets` ({pid: creation time or None}, or pids): send `ask` (if any), wait up
    to `grace_s` for them to exit, SIGKILL those still running, then wait up to
    `kill_wait_s` for those to be gone (the module's docstring says the policy). Returns the
    pids that were sent SIGKILL; never raises for a process that is gone or not ours."""
    times = dict(targets) if isinstance(targets, Mapping) else dict.fromkeys(targets)
    left = _running(times)
    if ask is not None:
        for pid in left:
            _signal(pid, ask, groups)
    left = _wait_gone(left, grace_s)
    killed = [pid for pid in left if _signal(pid, signal.SIGKILL, groups)]
    _wait_gone({pid: left[pid] for pid in killed}, kill_wait_s)
    return killed


def end_process_tree(proc: subprocess.Popen, grace_s: float) -> list[int]:
    """End the child `proc` and every process under it (those that run in sessions of their
    own too): each one's process group is sent SIGTERM, then SIGKILL after `grace_s`, then
    waited for up to `grace_s` more; `proc` is reaped. Returns the pids that needed SIGKILL."""
    targets: dict[int, float | None] = {proc.pid: None}  # our child: its pid is ours until reaped
    targets.update(descendants(proc.pid))
    killed = end_processes(targets, ask=signal.SIGTERM, grace_s=grace_s, kill_wait_s=grace_s, groups=True)
    proc.poll()
    return killed


def descendants(pid: int) -> dict[int, float]:
    """pid → creation time of every live process under `pid` (empty when it is gone)."""
    import psutil

    out: dict[int, float] = {}
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return out
    for child in children:
        try:
            out[child.pid] = child.create_time()
        except psutil.Error:  # it ended while being listed
            pass
    return out


def _running(times: Mapping[int, float | None]) -> dict[int, float | None]:
    me = os.getpid()
    return {pid: ct for pid, ct in times.items() if pid != me and process_alive(pid, ct)}


def _wait_gone(left: dict[int, float | None], wait_s: float) -> dict[int, float | None]:
    """Those of `left` still running after up to `wait_s` (at once once none is)."""
    deadline = time.monotonic() + wait_s
    while True:
        left = _running(left)
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(POLL_S)


def _signal(pid: int, sig: int, group: bool) -> bool:
    """`sig` to `pid` (to its process group with `group`, unless that is this process's own
    group); False where it could not be sent (gone, or not ours)."""
    if group:
        try:
            pgid = os.getpgid(pid)
            if pgid != os.getpgrp():
                os.killpg(pgid, sig)
                return True
        except OSError:
            pass  # gone, or not ours: the pid itself below
    try:
        os.kill(pid, sig)
        return True
    except OSError:
        return False


# ---- parent death ----------------------------------------------------------------------------------
def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Have the kernel send `sig` to this process when its parent dies; exits at once if the
    parent is already gone. False where prctl is not available (not Linux)."""
    prctl = _prctl()
    return prctl is not None and _arm(prctl, sig, os.getppid())


def die_with_parent_preexec(sig: int) -> Callable[[], None] | None:
    """A `preexec_fn` that gives the child the parent-death signal `sig`, or None where
    prctl is not available. libc is resolved here, before the fork: the child only calls it.
    The signal comes when the *thread* that started the child ends, so start such children
    from a thread that lives as long as the parent does."""
    prctl = _prctl()
    if prctl is None:
        return None
    parent = os.getpid()

    def preexec() -> None:
        _arm(prctl, sig, parent)

    return preexec


def _prctl() -> Callable[..., int] | None:
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def _arm(prctl: Callable[..., int], sig: int, parent: int) -> bool:
    """Set the parent-death signal (False where the kernel refused it); if `parent` died
    before that, nobody will send it: exit now."""
    armed = prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    if os.getppid() != parent:
        os._exit(1)
    return armed
