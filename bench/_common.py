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
import time
from collections.abc import Iterable, Sequence
from contextlib import closing
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

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


# ---- misc ------------------------------------------------------------------------------
def free_port() -> int:
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def aggregator_settings(*overrides: str) -> Any:
    """The `AggregatorSettings` `mindpulse launch` passes with the default config (changed by
    `--set`-style `overrides`, e.g. "monitor.max_lag_steps=2"), built by the launcher's own
    `launcher/spec.py` function (first attempt, no resume)."""
    from mindpulse.config import load_config
    from mindpulse.launcher.spec import aggregator_settings as settings_of

    cfg, _ = load_config(None, list(overrides))
    return settings_of(cfg)


TRACKER_SINKS = {"none": [], "mlflow": ["sinks.mlflow.enabled=true"], "swanlab": ["sinks.swanlab.enabled=true"]}
"""A tracker sink by name → the `--set` lines that turn it on (MLflow: a file store in
`<output.root>/mlruns`, the run directory's parent; SwanLab: offline, under the run directory):
the settings path a launch takes, `aggregator_settings`."""


def tracker_missing(sink: str) -> str | None:
    """Why the tracker `sink` cannot run here (its package is not installed), or None."""
    import importlib.util

    if sink == "none" or importlib.util.find_spec(sink) is not None:
        return None
    return f"{sink} is not installed (pip install 'mindpulse[{sink}]')"


def write_result(path: str | os.PathLike | None, name: str, data: dict[str, Any], t0: float) -> None:
    """Write a benchmark's result JSON (when a path was given)."""
    if not path:
        return
    # this run's stamp last: a result merged into a former one (`rules.py --merge-into`) carries
    # the former run's date and wall time, which must not stand for this run's
    out = {**data, "name": name, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "wall_s": time.time() - t0,
           "load_after": load_average()}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=1, default=str))


def table(headers: list[str], rows: list[list[Any]]) -> str:
    """A Markdown table (also readable on a terminal)."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    sep = "| " + " | ".join("-" * w for w in widths) + " |"
    # blank lines around it: in Markdown a table runs until the next blank line
    return "\n" + "\n".join([line(headers), sep, *(line(r) for r in cells)]) + "\n"


class ForeignLoad:
    """Samples, in a thread, how much CPU processes outside this process tree use.

    On a shared machine this tells which benchmark figures were taken while someone
    else's work ran: `window(t0, t1)` gives the mean and peak cores used by foreign
    processes between two times, and the busiest of them.
    """

    def __init__(self, interval_s: float = 2.0):
        import threading

        self.interval_s = interval_s
        self.samples: list[tuple[float, float, list[str]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._last: dict[int, float] = {}

    def start(self) -> ForeignLoad:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _mine(self, psutil) -> set[int]:
        me = psutil.Process()
        out = {me.pid}
        try:
            out |= {c.pid for c in me.children(recursive=True)}
        except psutil.Error:
            pass
        p = me.parent()
        while p is not None:
            out.add(p.pid)
            p = p.parent()
        return out

    def _loop(self) -> None:
        import psutil

        last_t = time.time()
        while not self._stop.is_set():
            mine = self._mine(psutil)
            now_cpu: dict[int, float] = {}
            names: dict[int, str] = {}
            for p in psutil.process_iter(["pid", "name", "cmdline"]):
                if p.pid in mine:
                    continue
                try:
                    t = p.cpu_times()
                    now_cpu[p.pid] = t.user + t.system
                    cmd = " ".join((p.info.get("cmdline") or [])[:4]) or p.info.get("name") or "?"
                    names[p.pid] = cmd[:80]
                except Exception:  # a process gone or unreadable: the sampler itself goes on
                    continue
            t = time.time()
            if self._last:
                deltas = {pid: c - self._last.get(pid, c) for pid, c in now_cpu.items()}
                used = sum(max(0.0, d) for d in deltas.values()) / max(1e-3, t - last_t)
                top = [f"{names[pid]} ({d / max(1e-3, t - last_t):.2f} cores)"
                       for pid, d in sorted(deltas.items(), key=lambda kv: -kv[1])[:3] if d > 0.1 * (t - last_t)]
                self.samples.append((t, used, top))
            self._last, last_t = now_cpu, t
            self._stop.wait(self.interval_s)

    def window(self, t0: float, t1: float) -> dict[str, Any]:
        """Foreign load between t0 and t1: the samples covering that time (a sample at t
        covers the interval before t, so the first one after t1 is included)."""
        if self._thread.is_alive() and time.time() < t1 + self.interval_s:
            deadline = time.time() + 2 * self.interval_s + 1  # a short window: wait for its sample
            while time.time() < deadline and not any(s[0] >= t1 for s in self.samples):
                time.sleep(0.05)
        after = [s for s in self.samples if s[0] >= t1][:1]
        xs = [s for s in self.samples if t0 <= s[0] < t1] + after
        if not xs:
            return {"mean_cores": 0.0, "max_cores": 0.0, "top": []}
        top: dict[str, int] = {}
        for _, _, names in xs:
            for n in names:
                key = n.rsplit(" (", 1)[0]
                top[key] = top.get(key, 0) + 1
        return {"mean_cores": sum(s[1] for s in xs) / len(xs), "max_cores": max(s[1] for s in xs),
                "top": [k for k, _ in sorted(top.items(), key=lambda kv: -kv[1])[:3]]}

    def current(self, over_s: float = 4.0) -> float:
        t = time.time()
        xs = [s[1] for s in self.samples if s[0] >= t - over_s]
        return sum(xs) / len(xs) if xs else 0.0


QUIET_CORES = 0.3
"""Foreign load (cores used by other processes) under which a measurement counts as quiet."""


def wait_quiet(load: ForeignLoad, max_wait_s: float, threshold: float = QUIET_CORES) -> float:
    """Wait (at most `max_wait_s`) until other processes use less than `threshold` cores."""
    t0 = time.time()
    while time.time() - t0 < max_wait_s and load.current(over_s=3.0) > threshold:
        time.sleep(1.0)
    return time.time() - t0


def gated_repeats(load: ForeignLoad, n: int, deadline: float, run_one, threshold: float = QUIET_CORES,
                  max_wait_s: float = 30.0, log=None, min_repeats: int = 2) -> dict[str, Any]:
    """Run `run_one(i)` until `n` repeats ran while other processes were quiet.

    Before each repeat the machine gets up to `max_wait_s` to go quiet. A repeat beside
    foreign load (more than `threshold` cores on average) is discarded while another
    repeat still fits before `deadline`; past the deadline the repeats stop as soon as
    `min_repeats` are kept (disturbed ones then count, and are counted).
    Returns {"kept": [results], "disturbed_kept": k, "discarded": d, "foreign": [...],
    "waited_s": w}.
    """
    kept, foreign = [], []
    discarded = disturbed_kept = 0
    waited = 0.0
    last_s = 0.0
    i = 0
    while len(kept) < n:
        now = time.time()
        if now > deadline and len(kept) >= min(n, min_repeats):
            break  # out of time: report the repeats that ran
        waited += wait_quiet(load, min(max_wait_s, max(0.0, deadline - now - last_s)), threshold)
        t0 = time.time()
        res = run_one(i)
        i += 1
        t1 = time.time()
        last_s = t1 - t0
        f = load.window(t0, t1)
        if f["mean_cores"] > threshold and deadline - t1 > last_s:
            discarded += 1
            if log:
                log(f"repeat discarded: other processes used {f['mean_cores']:.2f} cores meanwhile")
            continue
        if f["mean_cores"] > threshold:
            disturbed_kept += 1
        kept.append(res)
        foreign.append(f["mean_cores"])
    return {"kept": kept, "disturbed_kept": disturbed_kept, "discarded": discarded, "foreign": foreign,
            "waited_s": waited}


def plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")
