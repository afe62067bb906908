"""The host (CPU runs, and host statistics of every sample) through psutil."""

from __future__ import annotations

import threading
import time
from typing import Any

import psutil

from .base import PROCESS_KEYS, Sampler, bytes_to_mb, card_record

__all__ = ["PsutilSampler"]


class _CpuMeter:
    """Host CPU % between two readings, private to its owner (``psutil.cpu_percent``
    keeps one process-wide baseline that every caller resets)."""

    MIN_INTERVAL_S = 0.1

    def __init__(self) -> None:
        self._last = self._read()

    @staticmethod
    def _read() -> tuple[float, float, float]:
        t = psutil.cpu_times()
        total = sum(t)
        # guest time is already counted in user time on Linux
        total -= getattr(t, "guest", 0.0) + getattr(t, "guest_nice", 0.0)
        idle = t.idle + getattr(t, "iowait", 0.0)
        return time.monotonic(), total, idle

    def percent(self) -> float | None:
        wait = self.MIN_INTERVAL_S - (time.monotonic() - self._last[0])
        if wait > 0:  # right after the baseline: measure over a short interval instead
            time.sleep(wait)
        now = self._read()
        d_total = now[1] - self._last[1]
        d_busy = d_total - (now[2] - self._last[2])
        self._last = now
        if d_total <= 0:
            return None
        return round(max(0.0, min(100.0, 100.0 * d_busy / d_total)), 1)


class PsutilSampler(Sampler):
    """The host as one card (``card=-1``, name ``cpu``) and per-rank process statistics.

    ``util_pct`` is the host CPU % since the previous sample (the first sample measures
    over 0.1 s); memory is host memory in use (total - available) and total, in MB.
    """

    name = "psutil"

    def __init__(self) -> None:
        super().__init__()
        self._cpu = _CpuMeter()
        self._procs: dict[int, psutil.Process] = {}
        self._lock = threading.Lock()

    def host_stats(self) -> dict[str, Any]:
        """``{"cpu_pct", "mem_used_mb", "mem_total_mb"}`` of this host."""
        with self._lock:
            cpu = self._cpu.percent()
        vm = psutil.virtual_memory()
        return {
            "cpu_pct": cpu,
            "mem_used_mb": bytes_to_mb(vm.total - vm.available),
            "mem_total_mb": bytes_to_mb(vm.total),
        }

    def sample(self) -> list[dict[str, Any]]:
        warnings: list[str] = []
        try:
            h = self.host_stats()
            return [card_record(card=-1, name="cpu", util_pct=h["cpu_pct"],
                                memory_used_mb=h["mem_used_mb"], memory_total_mb=h["mem_total_mb"],
                                source=self.name)]
        except Exception as exc:  # noqa: BLE001 - a sampler never raises: its failure is a warning of the sample
            warnings.append(f"psutil sampler failed: {type(exc).__name__}: {exc}")
            return []
        finally:
            self.last_warnings = warnings

    def process_stats(self, pids: dict[int, int]) -> list[dict[str, Any]]:
        """Per rank ``{"rank", "pid", "cpu_pct", "rss_mb"}`` for ``{rank: pid}``, by rank.

        ``cpu_pct`` is the process's CPU % since the previous call (can exceed 100 with
        several threads busy; ``None`` the first time a pid is seen). A pid that is gone,
        a zombie, or not readable gives ``None`` values.
        """
        out: list[dict[str, Any]] = []
        with self._lock:
            wanted = set()
            for rank, pid in sorted((pids or {}).items(), key=lambda kv: kv[0]):
                entry: dict[str, Any] = {**dict.fromkeys(PROCESS_KEYS), "rank": rank, "pid": pid}
                out.append(entry)
                if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
                    continue
                wanted.add(pid)
                proc = self._procs.get(pid)
                first = False
                try:
                    if proc is None or not proc.is_running():  # is_running also catches pid reuse
                        proc = psutil.Process(pid)
                        self._procs[pid] = proc
                        first = True
                    with proc.oneshot():
                        if proc.status() == psutil.STATUS_ZOMBIE:
                            continue
                        cpu = proc.cpu_percent(interval=None)
                        entry["rss_mb"] = bytes_to_mb(proc.memory_info().rss)
                    entry["cpu_pct"] = None if first else round(cpu, 1)
                except (psutil.NoSuchProcess, psutil.ZombieProcess):
                    self._procs.pop(pid, None)
                except psutil.AccessDenied:
                    pass
            for pid in list(self._procs):
                if pid not in wanted:
                    del self._procs[pid]
        return out
