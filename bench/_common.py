"""Helpers shared by the benchmarks: statistics, machine description, result files.

Every benchmark writes one JSON result (`--json PATH`) that `bench/run_all.py` turns
into the tables of `docs/benchmarks.md`; run alone, each prints its own table.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import sys
import time
from contextlib import closing
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Iterable, Sequence

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"


# ---- statistics ------------------------------------------------------------------------
def quantile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile (q in 0..1) of a non-empty sequence."""
    s = sorted(xs)
    if not s:
        return float("nan")
    if len(s) == 1:
        return float(s[0])
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return float(s[lo] + (s[hi] - s[lo]) * (pos - lo))


def summary(xs: Iterable[float]) -> dict[str, float]:
    """Median, quartiles, extremes and count of a sample."""
    v = [float(x) for x in xs]
    if not v:
        return {"n": 0, "median": float("nan"), "q1": float("nan"), "q3": float("nan"),
                "min": float("nan"), "max": float("nan")}
    return {"n": len(v), "median": statistics.median(v), "q1": quantile(v, 0.25), "q3": quantile(v, 0.75),
            "min": min(v), "max": max(v), "p99": quantile(v, 0.99)}


def fmt_ms(s: float) -> str:
    return f"{s * 1000:.2f}" if s < 1 else f"{s * 1000:.0f}"


# ---- machine ---------------------------------------------------------------------------
def _pkg(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "-"


def machine() -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    ram_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                ram_gib = round(int(line.split()[1]) / 1024 / 1024, 1)
                break
    except OSError:
        pass
    os_name = platform.system()
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                os_name = line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "ram_gib": ram_gib,
        "os": f"{os_name} (kernel {platform.release()})",
        "python": platform.python_version(),
        "mindspore": _pkg("mindspore"),
        "mindformers": _pkg("mindformers"),
        "ray": _pkg("ray"),
        "msgpack": _pkg("msgpack"),
    }


def load_average() -> tuple[float, float, float] | None:
    try:
        return os.getloadavg()
    except OSError:
        return None


def other_busy_processes(threshold_pct: float = 20.0, sample_s: float = 0.5) -> list[str]:
    """Processes outside this benchmark's tree using more than `threshold_pct` of a core."""
    try:
        import psutil
    except ImportError:
        return []
    me = psutil.Process()
    mine = {me.pid} | {c.pid for c in me.children(recursive=True)}
    parent = me.parent()
    while parent is not None:
        mine.add(parent.pid)
        parent = parent.parent()
    procs = []
    for p in psutil.process_iter(["pid", "name"]):
        if p.pid in mine:
            continue
        try:
            p.cpu_percent(None)
            procs.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    time.sleep(sample_s)
    out = []
    for p in procs:
        try:
            pct = p.cpu_percent(None)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if pct >= threshold_pct:
            out.append(f"{p.info['name']} (pid {p.pid}, {pct:.0f}%)")
    return out


# ---- misc ------------------------------------------------------------------------------
def free_port() -> int:
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def aggregator_settings(**monitor: Any) -> dict[str, Any]:
    """The aggregator settings `mindpulse launch` passes with the default config."""
    from mindpulse.launcher.config import load_config

    cfg, _ = load_config(None)
    plain = cfg.to_dict()
    mon = dict(plain["monitor"], **monitor)
    return {"anomalies": plain["anomalies"], "checkpoint": plain["checkpoint"], "eval": plain["eval"],
            "tensorboard": cfg.output.tensorboard, "monitor": mon}


def write_result(path: str | os.PathLike | None, name: str, data: dict[str, Any], t0: float) -> None:
    """Write a benchmark's result JSON (when a path was given)."""
    if not path:
        return
    out = {"name": name, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "wall_s": time.time() - t0,
           "load_after": load_average(), **data}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=1, default=str))


def table(headers: list[str], rows: list[list[Any]]) -> str:
    """A Markdown table (also readable on a terminal)."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    sep = "| " + " | ".join("-" * w for w in widths) + " |"
    return "\n".join([line(headers), sep, *(line(r) for r in cells)])
