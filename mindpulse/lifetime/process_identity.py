"""Naming one process so that another process, later, can tell whether it still runs: its
host's process table (host name, kernel boot id, pid namespace), its pid, and the pid's
creation time (a pid is reused; the pair is not).

Used where a process must judge another it did not start: a node agent's watchdog and the
reaper judging the launcher, the launcher judging rank 0's checkpoint write.
"""

from __future__ import annotations

import os
import socket
from typing import Any


def host_identity() -> dict[str, Any]:
    """What tells whether two processes share a process table: host name, kernel boot id and
    pid namespace (host names alone repeat across containers)."""
    ident: dict[str, Any] = {"host": socket.gethostname()}
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            ident["boot_id"] = fh.read().strip()
    except OSError:
        pass
    try:
        ident["pidns"] = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        pass
    return ident


def process_identity() -> dict[str, Any]:
    """This process: `host_identity()` with its pid and creation time."""
    import psutil

    me = psutil.Process()
    return dict(host_identity(), pid=me.pid, create_time=me.create_time())


def same_process_table(ident: dict[str, Any]) -> bool:
    here = host_identity()
    return all(ident.get(k) == here.get(k) for k in ("host", "boot_id", "pidns"))


def process_alive(pid: int | None, create_time: float | None = None) -> bool:
    """`pid` runs (not a zombie), and is the process that had `create_time` (not a reuse)."""
    if not pid:
        return False
    try:
        import psutil

        p = psutil.Process(int(pid))
        if create_time is not None and abs(p.create_time() - float(create_time)) > 1.0:
            return False
        return p.status() != psutil.STATUS_ZOMBIE
    except Exception:  # a process psutil cannot read (gone, denied, bad pid) counts as not this one alive
        return False


def driver_identity() -> dict[str, Any]:
    """The launcher's process, as the node agents' watchdogs look for it."""
    return process_identity()
