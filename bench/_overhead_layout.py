"""Where the in-rank benchmark's processes run (bench/overhead.py): the rank pinned to its own
core and every other process of the run on the others, or everything on every core."""

from __future__ import annotations

import os


class Layout:
    """Where the processes run. Pinned: every thread of the rank (this process: the training
    thread and MindSpore's, the monitor's heartbeat) on core 0, and every other process of
    the run (Ray's GCS and raylet, the aggregator, the node agent, Ray's workers; all are
    this process's descendants) plus this benchmark's own load sampler on the other cores,
    as on an Ascend server where msrun `--bind_core` gives each rank its own cores and the
    node agent and aggregator never share them. Unpinned: everything on every core (a
    one-machine launch on this 2-core machine). A process or thread started later inherits
    its parent's cores; `apply` is called again before every timed run anyway."""

    RANK_CORES = frozenset({0})

    def __init__(self, helper_threads: list, ray_roots: list[int]):
        self.all = frozenset(os.sched_getaffinity(0))
        self.others = self.all - self.RANK_CORES
        self.helpers = helper_threads
        self.ray_roots = ray_roots
        """The processes `ray.init` started (GCS, raylet, ...): they and their descendants
        are the run's other processes; a process the rank starts itself (SummaryCollector's
        writer) is the rank's and stays on its cores."""
        self.pinned: bool | None = None

    @property
    def can_pin(self) -> bool:
        return bool(self.others) and self.RANK_CORES <= self.all

    def apply(self, pinned: bool) -> dict[str, int]:
        """Move every thread of every process of the run; how many threads went where."""
        import psutil

        rank = self.RANK_CORES if pinned else self.all
        others = self.others if pinned else self.all
        helpers = {t.native_id for t in self.helpers if t.native_id is not None}
        moved = {"rank": 0, "others": 0}
        for tid in _threads(os.getpid()):
            to_others = tid in helpers
            moved["others" if to_others else "rank"] += _set_cores(tid, others if to_others else rank)
        for pid in self._ray_processes(psutil):
            for tid in _threads(pid):
                moved["others"] += _set_cores(tid, others)
        self.pinned = pinned
        return moved

    def _ray_processes(self, psutil) -> set[int]:
        out: set[int] = set()
        for pid in self.ray_roots:
            try:
                proc = psutil.Process(pid)
                out.add(pid)
                out.update(c.pid for c in proc.children(recursive=True))
            except psutil.Error:  # a process that ended meanwhile
                pass
        return out

    def describe(self) -> str:
        if not self.pinned:
            return f"every process on cores {sorted(self.all)}"
        return f"the rank on core {sorted(self.RANK_CORES)}, every other process on cores {sorted(self.others)}"


def _threads(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:  # the process ended meanwhile: nothing to move
        return []


def _set_cores(tid: int, cores: frozenset[int]) -> int:
    """`sched_setaffinity` moves one thread (a Linux task), not its process."""
    try:
        os.sched_setaffinity(tid, cores)
        return 1
    except OSError:  # a thread that ended meanwhile
        return 0
