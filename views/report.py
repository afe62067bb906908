"""Offline report of a run directory: PNG plots and one self-contained HTML page.

Reads what a run leaves behind, all but the metrics file optional, and copes with a
crashed run (a torn last record in `metrics.msgpack`, no `summary.json`):

* `metrics.msgpack` (and the segments closed before it), `summary.json`, `config.yaml` —
  through `run_reader.RunReader`: every accepted packet replayed with the aggregator's reducer
  and straggler tracker (built from the run's config), one timeline over the attempts (a
  restarted attempt's steps replace the earlier attempts' from where it resumed), the
  aggregator's reduced records for the steps whose per-rank packets were thinned, damaged
  bytes skipped and counted; the launcher's summary; the resolved configuration (shown as is);
* `anomalies.json` — a list of {rule, step, rank, value, threshold, action, message};
* `checkpoints/manifest.json` — {"files": [{path, step, metric, kind, size, sha256}]};
* `profile/rank_*/` — profiler output folders, linked relatively.

Plots are drawn with matplotlib's Agg canvas directly (no pyplot, no display needed).
"""

from __future__ import annotations

import base64
import datetime as _dt
import html
import json
import logging
import math
import os
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tabulate import tabulate

from mindpulse.aggregator.reducer import ReducedStep
from mindpulse.aggregator.tables import totals_table
from mindpulse.config import RunConfig
from mindpulse.protocol import EventPacket, StepPacket, TelemetryPacket
from mindpulse.views.run_reader import METRICS, SUMMARY, AttemptInfo, RunReader, read_json

log = logging.getLogger(__name__)

PLOT_NAMES: tuple[str, ...] = ("loss.png", "grad_norm.png", "step_time.png", "throughput.png", "telemetry.png",
                               "straggler.png")
_MAX_POINTS = 4000
"""Longest line drawn per series; longer series are thinned by a stride."""
_MAX_MARKERS = 200
"""At most this many vertical markers of one kind per plot."""
_MAX_LEGEND = 16
_ANOMALY_COLOR = "red"
_CHECKPOINT_COLOR = "green"
_ATTEMPT_COLOR = "purple"


# ------------------------------------------------------------------------------------ data


@dataclass
class RunData:
    """Everything the report shows, read once from a run directory."""

    run_dir: Path
    config: RunConfig = field(default_factory=RunConfig)
    """The run's resolved config (defaults where config.yaml is missing or damaged)."""
    summary: dict[str, Any] | None = None
    world_size: int = 0
    per_rank: dict[int, list[StepPacket]] = field(default_factory=dict)
    """Each rank's step packets the reducer accepted (one per step), sorted by step."""
    reduced: list[ReducedStep] = field(default_factory=list)
    """Every complete step, sorted by step, with the straggler scores the aggregator gave it."""
    telemetry: list[TelemetryPacket] = field(default_factory=list)
    events: list[EventPacket] = field(default_factory=list)
    anomalies: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    config_text: str | None = None
    profile_dirs: list[Path] = field(default_factory=list)
    records: int = 0
    derived_totals: dict[str, Any] = field(default_factory=dict)
    """summary.json's totals as the reader derived them from the metrics."""
    attempts: list[AttemptInfo] = field(default_factory=list)
    """The launcher attempts the metrics name, in order (one for a run that never restarted)."""
    step_attempt: dict[int, int] = field(default_factory=dict)
    """The attempt behind each complete step shown."""
    metrics: dict[str, Any] = field(default_factory=dict)
    """What reading the metrics met (segments, damaged bytes, thinning)."""
    notes: list[str] = field(default_factory=list)
    """Problems met while reading (missing or unreadable files), shown in the report."""

    @property
    def has_steps(self) -> bool:
        return any(self.per_rank.values())

    @property
    def anomaly_steps(self) -> list[int]:
        return sorted({s for s in (_int(a.get("step")) for a in self.anomalies) if s is not None})

    @property
    def multi_attempt(self) -> bool:
        return len(self.attempts) > 1 or any(a.attempt > 0 for a in self.attempts)

    @property
    def attempt_starts(self) -> list[tuple[int, int]]:
        """(first step, attempt) of every attempt after the first: where each resumed."""
        return [(a.first_step, a.attempt) for a in self.attempts if a.attempt > 0 and a.first_step is not None]

    @property
    def checkpoint_steps(self) -> list[int]:
        return sorted({s for s in (_int(c.get("step")) for c in self.checkpoints) if s is not None})

    @property
    def status(self) -> str:
        if self.summary and self.summary.get("status"):
            return str(self.summary["status"])
        if not self.has_steps:
            return "unknown (no data)"
        return "unknown (no summary.json: the run did not finish)"

    def totals(self) -> dict[str, Any]:
        """summary.json, or the same fields derived from the metrics when it is missing."""
        if self.summary:
            return self.summary
        return {"status": self.status, **self.derived_totals}

    def last_fingerprint(self, rank: int) -> str | None:
        for p in reversed(self.per_rank.get(rank, [])):
            if p.fingerprint:
                return p.fingerprint
        return None

    def rank_rows(self) -> list[dict[str, Any]]:
        """One row per rank: its last step packet, newest fingerprint, exit code, host."""
        info: dict[int, dict[str, Any]] = {}
        for ev in self.events:
            d = info.setdefault(ev.rank, {})
            if ev.kind == "start":
                d.update(host=ev.host or None, pid=ev.pid or None)
            elif ev.kind == "error":
                d["error"] = ev.message
        summary_ranks = {}
        if self.summary and isinstance(self.summary.get("ranks"), list):
            summary_ranks = {x.get("rank"): x for x in self.summary["ranks"] if isinstance(x, dict)}
        rows = []
        for r in range(max(self.world_size, max(self.per_rank, default=-1) + 1)):
            pkts = self.per_rank.get(r, [])
            last = pkts[-1] if pkts else None
            s = summary_ranks.get(r, {})
            rows.append({
                "rank": r,
                "last_step": last.step if last else s.get("last_step", 0),
                "attempt": self.step_attempt.get(last.step) if last else None,
                "loss": last.loss if last else None,
                "grad_norm_local": last.grad_norm_local if last else None,
                "step_time_s": last.step_time_s if last else None,
                "fingerprint": self.last_fingerprint(r) or s.get("param_fingerprint"),
                "exit_code": s.get("exit_code"),
                "host": s.get("host") or info.get(r, {}).get("host"),
                "pid": s.get("pid") or info.get(r, {}).get("pid"),
                "error": s.get("error") or info.get(r, {}).get("error") or "",
            })
        return rows


def _int(x: Any) -> int | None:
    if isinstance(x, bool):
        return None
    if isinstance(x, int):
        return x
    if isinstance(x, float) and x.is_integer():
        return int(x)
    return None


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _read_json(path: Path, data: RunData) -> Any:
    obj, err = read_json(path)
    if err is not None:
        data.notes.append(f"{path.name} could not be read: {err}")
    return obj


def _read_run(run: RunReader, data: RunData) -> None:
    """Metrics, summary and config through the shared reader, in one poll."""
    try:
        packets = run.poll().packets
    except OSError as exc:
        packets = []
        data.notes.append(f"{METRICS} could not be read: {exc}")
    data.summary = run.summary
    if run.summary is None:
        if run.summary_problem:
            data.notes.append(run.summary_problem)
        data.notes.append(f"{SUMMARY} is missing: the run did not finish (crashed, killed or still running)")
    if not (data.run_dir / METRICS).exists():
        data.notes.append(f"{METRICS} is missing")
    tail = run.tail
    if tail.skipped_bytes:
        data.notes.append(f"{METRICS}: {tail.skipped_bytes} damaged byte(s) skipped in {tail.errors} stretch(es); "
                          "the records after them were read")
    if tail.torn_bytes:
        data.notes.append(f"{METRICS}: an incomplete record ({tail.torn_bytes} bytes) at the end of a closed "
                          "segment was ignored (a crash mid-write)")
    if tail.pending_bytes:
        data.notes.append(f"{METRICS}: its last {tail.pending_bytes} bytes are no whole record (being written, or "
                          "torn by a crash)")
    if run.thinned_segments:
        data.notes.append(f"per-rank detail thinned in {run.thinned_segments} old metrics segment(s): their steps "
                          f"show every rank at multiples of monitor.collect_freq and the non-finite ranks; every "
                          "step's cluster values are the aggregator's reduced records")
    data.attempts = [run.attempts[a] for a in sorted(run.attempts)]
    for info in data.attempts:
        if info.superseded:
            later = min((a.attempt for a in data.attempts if a.attempt > info.attempt), default=info.attempt + 1)
            start = run.attempts[later].first_step if later in run.attempts else None
            data.notes.append(f"attempt {info.attempt}: {info.superseded} complete step(s)"
                              + (f" from step {start} on" if start is not None else "")
                              + f" were run again by attempt {later}; the report shows attempt {later}'s")
    data.step_attempt = dict(run.step_attempt)
    data.metrics = run.metrics_info()
    data.config = run.config
    data.config_text = run.config_file.text
    data.world_size = run.world_size
    data.records = run.records
    data.derived_totals = run.totals()
    data.per_rank = {r: sorted(pkts, key=lambda p: p.step) for r, pkts in sorted(run.per_rank.items())}
    data.reduced = sorted(run.reduced, key=lambda r: r.step)
    data.telemetry = sorted((p for p in packets if isinstance(p, TelemetryPacket)), key=lambda t: t.ts)
    data.events = [p for p in packets if isinstance(p, EventPacket)]
    if not data.has_steps:
        data.notes.append(f"no step data: {METRICS} holds no step packets")


def load_run(run_dir: Path | str) -> RunData:
    """Read a run directory; never fails on a damaged or missing optional file."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"no run directory at {run_dir}")
    data = RunData(run_dir=run_dir)
    run = RunReader(run_dir, history=True)
    _read_run(run, data)

    anomalies = _read_json(run_dir / "anomalies.json", data)
    if isinstance(anomalies, dict):  # tolerate {"anomalies": [...]}
        anomalies = anomalies.get("anomalies")
    if isinstance(anomalies, list):
        data.anomalies = [a for a in anomalies if isinstance(a, dict)]
    elif anomalies is not None:
        data.notes.append("anomalies.json is not a list of records")

    manifest = _read_json(run_dir / "checkpoints" / "manifest.json", data)
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if isinstance(files, list):
        data.checkpoints = sorted((f for f in files if isinstance(f, dict)),
                                  key=lambda f: (_int(f.get("step")) or 0, str(f.get("path"))))
    elif manifest is not None:
        data.notes.append("checkpoints/manifest.json has no list of files")

    data.notes += run.config_file.notes

    prof = run_dir / "profile"
    if prof.is_dir():
        data.profile_dirs = sorted((d for d in prof.glob("rank_*") if d.is_dir()), key=_rank_dir_key)
    return data


def _rank_dir_key(d: Path) -> tuple[int, str]:
    tail = d.name[len("rank_"):]
    return (int(tail), d.name) if tail.isdigit() else (1 << 30, d.name)


# ----------------------------------------------------------------------------------- plots


def _figure(nrows: int = 1, ncols: int = 1, size: tuple[float, float] = (10.0, 4.5)):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, axes


def _clean(values: Iterable[Any]) -> list[float]:
    """Numbers with None / NaN / Inf as NaN (a gap in the line)."""
    return [float(v) if _finite(v) else math.nan for v in values]


def _thin(xs: list[float], ys: list[float]) -> tuple[list[float], list[float]]:
    if len(xs) <= _MAX_POINTS:
        return xs, ys
    stride = math.ceil(len(xs) / _MAX_POINTS)
    keep = list(range(0, len(xs), stride))
    if keep[-1] != len(xs) - 1:
        keep.append(len(xs) - 1)
    return [xs[i] for i in keep], [ys[i] for i in keep]


def _plot(ax, xs: list[float], ys: list[float], label: str | None, **kw) -> bool:
    if not any(_finite(y) for y in ys):
        return False
    xs, ys = _thin(list(xs), list(ys))
    ax.plot(xs, ys, label=label, **kw)
    return True


def _markers(ax, anomaly_x: list[float], checkpoint_x: list[float],
             attempts: list[tuple[int, int]] | None = None) -> None:
    for xs, color, label in ((anomaly_x, _ANOMALY_COLOR, "anomaly"),
                             (checkpoint_x, _CHECKPOINT_COLOR, "checkpoint")):
        for i, x in enumerate(xs[:_MAX_MARKERS]):
            ax.axvline(x, color=color, linestyle="--", linewidth=0.9, alpha=0.7,
                       label=label if i == 0 else None)
    for step, attempt in (attempts or [])[:_MAX_MARKERS]:  # where a restarted attempt resumed
        ax.axvline(step, color=_ATTEMPT_COLOR, linestyle=":", linewidth=1.2, alpha=0.9, label=f"attempt {attempt}")


def _finish(fig, axes, path: Path, title: str) -> Path:
    fig.suptitle(title)
    for ax in axes.flat:
        handles, labels = ax.get_legend_handles_labels()
        if handles and len(handles) <= _MAX_LEGEND:
            ax.legend(fontsize="small", loc="best")
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


def _placeholder(path: Path, title: str, message: str) -> Path:
    fig, axes = _figure(size=(10.0, 3.0))
    ax = axes[0, 0]
    ax.axis("off")
    ax.text(0.5, 0.5, message, ha="center", va="center", fontsize=16, color="gray", transform=ax.transAxes)
    fig.suptitle(title)
    fig.savefig(path, format="png")
    return path


def _plot_loss(data: RunData, path: Path) -> Path:
    if not data.has_steps:
        return _placeholder(path, "loss", "no data")
    fig, axes = _figure()
    ax = axes[0, 0]
    drawn = False
    bad_x: list[float] = []
    for r, pkts in data.per_rank.items():
        pkts = [p for p in pkts if p.loss is not None]
        drawn |= _plot(ax, [p.step for p in pkts], _clean(p.loss for p in pkts), f"rank {r}",
                       linewidth=0.9, alpha=0.8)
        bad_x += [p.step for p in pkts if not math.isfinite(p.loss)]
    red = [x for x in data.reduced if x.loss_mean is not None]
    drawn |= _plot(ax, [x.step for x in red], _clean(x.loss_mean for x in red), "mean (reduced)",
                   color="black", linewidth=2.0)
    if bad_x:
        lo, hi = ax.get_ylim() if drawn else (0.0, 1.0)
        ax.plot(sorted(set(bad_x)), [hi] * len(set(bad_x)), "x", color=_ANOMALY_COLOR, markersize=8,
                label="non-finite loss", clip_on=False)
    if not drawn and not bad_x:
        return _placeholder(path, "loss", "no loss values")
    _markers(ax, data.anomaly_steps, data.checkpoint_steps, data.attempt_starts)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    return _finish(fig, axes, path, "loss per rank and reduced mean")


def _plot_grad_norm(data: RunData, path: Path) -> Path:
    if not data.has_steps:
        return _placeholder(path, "grad norm", "no data")
    fig, axes = _figure()
    ax = axes[0, 0]
    drawn = False
    red = [x for x in data.reduced if x.grad_norm is not None]
    drawn |= _plot(ax, [x.step for x in red], _clean(x.grad_norm for x in red), "global",
                   color="black", linewidth=2.0)
    for r, pkts in data.per_rank.items():
        pkts = [p for p in pkts if p.grad_norm_local is not None]
        drawn |= _plot(ax, [p.step for p in pkts], _clean(p.grad_norm_local for p in pkts),
                       f"rank {r} local", linewidth=0.9, alpha=0.8)
    if not drawn:
        return _placeholder(path, "grad norm", "no grad norm values")
    _markers(ax, data.anomaly_steps, data.checkpoint_steps, data.attempt_starts)
    ax.set_xlabel("step")
    ax.set_ylabel("grad norm")
    return _finish(fig, axes, path, "gradient norm: global and per-rank local")


def _plot_step_time(data: RunData, path: Path) -> Path:
    if not data.has_steps:
        return _placeholder(path, "step time", "no data")
    fig, axes = _figure()
    ax = axes[0, 0]
    drawn = False
    for r, pkts in data.per_rank.items():
        pkts = [p for p in pkts if p.step_time_s is not None]
        drawn |= _plot(ax, [p.step for p in pkts], _clean(p.step_time_s for p in pkts), f"rank {r}",
                       linewidth=0.9, alpha=0.8)
    if not drawn:
        return _placeholder(path, "step time", "no step time values")
    _markers(ax, data.anomaly_steps, data.checkpoint_steps, data.attempt_starts)
    ax.set_xlabel("step")
    ax.set_ylabel("step time (s)")
    return _finish(fig, axes, path, "step time per rank")


def _plot_throughput(data: RunData, path: Path) -> Path:
    red = [x for x in data.reduced if x.samples_per_s is not None]
    if not red:
        return _placeholder(path, "throughput", "no data" if not data.has_steps else "no throughput values")
    fig, axes = _figure()
    ax = axes[0, 0]
    if not _plot(ax, [x.step for x in red], _clean(x.samples_per_s for x in red), "cluster samples/s",
                 color="tab:blue", linewidth=1.5):
        return _placeholder(path, "throughput", "no throughput values")
    _markers(ax, data.anomaly_steps, data.checkpoint_steps, data.attempt_starts)
    ax.set_xlabel("step")
    ax.set_ylabel("samples / s")
    return _finish(fig, axes, path, "cluster throughput (all ranks' samples over the slowest step)")


def _plot_straggler(data: RunData, path: Path) -> Path:
    """Per-rank straggler score over time (1.0 = the fastest rank), as the aggregator scored it
    with the run's `monitor.straggler_window`, against its `monitor.straggler_threshold`."""
    monitor = data.config.monitor
    series: dict[int, tuple[list[float], list[float]]] = {}
    for red in data.reduced:
        for r, sc in red.straggler_scores.items():
            xs, ys = series.setdefault(r, ([], []))
            xs.append(red.step)
            ys.append(sc)
    if not series:
        return _placeholder(path, "straggler score", "no data" if not data.has_steps else "not enough steps to score")
    fig, axes = _figure()
    ax = axes[0, 0]
    for r, (xs, ys) in sorted(series.items()):
        _plot(ax, xs, ys, f"rank {r}", linewidth=1.0)
    ax.axhline(monitor.straggler_threshold, color="tab:red", linestyle=":", linewidth=1.0,
               label=f"threshold {monitor.straggler_threshold:g} (monitor.straggler_threshold)")
    _markers(ax, data.anomaly_steps, data.checkpoint_steps, data.attempt_starts)
    ax.set_xlabel("step")
    ax.set_ylabel("score (fastest / rank's busy time)")
    ax.set_ylim(0, 1.05)
    return _finish(fig, axes, path,
                   f"straggler score per rank (1.0 = fastest, median over {monitor.straggler_window} steps)")


_TELEMETRY_PANELS = (("util_pct", "utilization (%)"), ("memory_used_mb", "memory used (MB)"),
                     ("power_w", "power (W)"), ("temp_c", "temperature (°C)"))


def _step_to_time(data: RunData, t0: float) -> Any:
    """A function step → seconds since t0 from the reduced steps' timestamps, or None."""
    import numpy as np

    pts = sorted((x.step, x.ts) for x in data.reduced if _finite(x.ts) and x.ts > 0)
    if len(pts) < 1:
        return None
    steps = np.array([p[0] for p in pts], dtype=float)
    ts = np.maximum.accumulate(np.array([p[1] for p in pts], dtype=float)) - t0

    def conv(xs: list[int]) -> list[float]:
        return [float(np.interp(s, steps, ts)) for s in xs if steps[0] <= s <= steps[-1]]

    return conv


def _plot_telemetry(data: RunData, path: Path) -> Path:
    series: dict[tuple[str, str], list[tuple[float, dict[str, Any]]]] = {}
    for pkt in data.telemetry:
        for j, card in enumerate(pkt.cards):
            if isinstance(card, dict):
                cid = card.get("card")
                series.setdefault((pkt.node, str(j if cid is None else cid)), []).append((pkt.ts, card))
    if not series:
        return _placeholder(path, "telemetry", "no telemetry")
    have_time = any(_finite(t) and t > 0 for s in series.values() for t, _ in s)
    t0 = min((t for s in series.values() for t, _ in s if _finite(t) and t > 0), default=0.0)
    all_t = [t - t0 for s in series.values() for t, _ in s if _finite(t) and t > 0]
    lo, hi = min(all_t, default=0.0), max(all_t, default=0.0)

    def inside(xs: list[float]) -> list[float]:
        # only markers inside the sampled time range: the others would stretch the axis
        return [x for x in xs if lo <= x <= hi]

    conv = _step_to_time(data, t0) if have_time else None
    fig, axes = _figure(2, 2, size=(12.0, 7.0))
    drawn = False
    for ax, (key, label) in zip(axes.flat, _TELEMETRY_PANELS):
        for (node, card), samples in series.items():
            xs = [t - t0 for t, _ in samples] if have_time else list(range(len(samples)))
            drawn |= _plot(ax, xs, _clean(c.get(key) for _, c in samples), f"{node}:{card}",
                           linewidth=1.0, marker="." if len(samples) < 50 else None)
        ax.set_ylabel(label)
        ax.set_xlabel("seconds since first sample" if have_time else "sample")
        if conv is not None:
            _markers(ax, inside(conv(data.anomaly_steps)), inside(conv(data.checkpoint_steps)))
    if not drawn:
        return _placeholder(path, "telemetry", "no telemetry values")
    return _finish(fig, axes, path, "card telemetry")


_PLOTTERS = {
    "straggler.png": _plot_straggler,
    "loss.png": _plot_loss,
    "grad_norm.png": _plot_grad_norm,
    "step_time.png": _plot_step_time,
    "throughput.png": _plot_throughput,
    "telemetry.png": _plot_telemetry,
}


# ------------------------------------------------------------------------------------ text


def _fmt(x: Any, spec: str = ".4f") -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, float):
        if not math.isfinite(x):
            return str(x)
        if x != 0 and (abs(x) < 1e-3 or abs(x) >= 1e6):
            return f"{x:.3e}"
        return format(x, spec)
    return str(x)


def _rank_table_rows(data: RunData) -> tuple[list[str], list[list[Any]]]:
    headers = ["rank", "last step", "loss", "grad norm local", "step ms", "fingerprint", "exit", "host", "pid"]
    rows = [[
        r["rank"], r["last_step"], _fmt(r["loss"]), _fmt(r["grad_norm_local"], ".3f"),
        "-" if not _finite(r["step_time_s"]) else f"{r['step_time_s'] * 1000:.0f}",
        (r["fingerprint"] or "-")[:16], _fmt(r["exit_code"]), r["host"] or "-", r["pid"] or "-",
    ] for r in data.rank_rows()]
    if data.multi_attempt:  # the attempt behind each rank's last step
        headers.append("attempt")
        for row, r in zip(rows, data.rank_rows()):
            row.append(_fmt(r["attempt"]))
    return headers, rows


_ATTEMPT_KEYS = ("attempt", "started", "first step", "last step shown", "steps shown", "superseded",
                 "from reduced records", "aggregator restarts")


def _attempt_rows(data: RunData) -> list[list[str]]:
    """One row per attempt: where it started, what of it the report shows and what it lost."""
    rows = []
    for a in data.attempts:
        started = (_dt.datetime.fromtimestamp(a.started, tz=_dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
                   if _finite(a.started) else "-")
        rows.append([_fmt(x) for x in (a.attempt, started, a.first_step, a.last_step, a.steps, a.superseded,
                                         a.from_records, a.restarts)])
    return rows


_ANOMALY_KEYS = ("rule", "step", "rank", "value", "threshold", "action", "message")
_CHECKPOINT_KEYS = ("step", "kind", "metric", "path", "size", "sha256")


def _anomaly_rows(data: RunData) -> list[list[str]]:
    return [[_fmt(a.get(k), ".6g") for k in _ANOMALY_KEYS] for a in data.anomalies]


def _checkpoint_rows(data: RunData, short_sha: bool = True) -> list[list[str]]:
    rows = []
    for c in data.checkpoints:
        row = []
        for k in _CHECKPOINT_KEYS:
            v = c.get(k)
            if k == "sha256" and isinstance(v, str) and short_sha:
                v = v[:16]
            row.append(_fmt(v, ".6g") if k == "metric" else _fmt(v))
        rows.append(row)
    return rows


def final_tables(run_dir: Path | str) -> str:
    """The final summary of a run as text tables, for printing on a console."""
    data = load_run(run_dir)
    return _final_tables(data)


def _final_tables(data: RunData) -> str:
    name = (data.summary or {}).get("name") or data.run_dir.name
    parts = [f"run {name}: {data.status}"]
    if not data.has_steps:
        parts.append("no data: metrics.msgpack holds no step packets")
    parts.append(totals_table(data.totals()))
    headers, rows = _rank_table_rows(data)
    if rows:
        parts.append(tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True))
    if data.anomalies:
        parts.append("anomalies\n" + tabulate(_anomaly_rows(data), headers=list(_ANOMALY_KEYS),
                                              tablefmt="simple", disable_numparse=True))
    if data.checkpoints:
        parts.append("checkpoints\n" + tabulate(_checkpoint_rows(data), headers=list(_CHECKPOINT_KEYS),
                                                tablefmt="simple", disable_numparse=True))
    if data.multi_attempt:
        parts.append("attempts (each step from the newest attempt that ran it)\n"
                     + tabulate(_attempt_rows(data), headers=list(_ATTEMPT_KEYS), tablefmt="simple",
                                disable_numparse=True))
    m = data.metrics
    if m.get("damaged_bytes_skipped") or m.get("thinned_segments"):
        parts.append(f"metrics: {m.get('segments', 0)} segment(s), {m.get('damaged_bytes_skipped', 0)} damaged "
                     f"byte(s) skipped in {m.get('damaged_stretches', 0)} stretch(es), "
                     f"{m.get('thinned_segments', 0)} thinned segment(s)")
    return "\n\n".join(parts)


# ------------------------------------------------------------------------------------ html

_CSS = """
body { font-family: -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif; margin: 2em; color: #222; }
h1 { margin-bottom: 0.2em; } h2 { margin-top: 1.6em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 0.5em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
pre { background: #f7f7f7; border: 1px solid #ddd; padding: 0.8em; overflow-x: auto; font-size: 0.85em; }
.status { display: inline-block; padding: 2px 10px; border-radius: 4px; color: #fff; font-weight: bold; }
.ok { background: #2e7d32; } .bad { background: #c62828; } .other { background: #ef6c00; }
.note { color: #8a4b00; } .empty { color: #777; font-style: italic; }
img { max-width: 100%; height: auto; border: 1px solid #eee; margin: 0.4em 0; }
figure { margin: 1em 0; } figcaption { color: #555; font-size: 0.9em; }
td.long, code { overflow-wrap: anywhere; }
td.long { min-width: 12em; }
"""


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


_LONG_TOKEN = 32
"""A cell holding a word longer than this (hashes, paths) may break anywhere, so a table
never runs past the right edge of a narrow window."""


def _html_cell(value: Any) -> str:
    text = str(value)
    if any(len(tok) > _LONG_TOKEN for tok in text.split()):
        return f'<td class="long">{_e(text)}</td>'
    return f"<td>{_e(text)}</td>"


def _html_table(headers: list[str], rows: list[list[Any]], empty: str) -> str:
    if not rows:
        return f'<p class="empty">{_e(empty)}</p>'
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(_html_cell(c) for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _summary_value(key: str, value: Any) -> str:
    if key == "started" and _finite(value):
        when = _dt.datetime.fromtimestamp(value, tz=_dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        return f"{value} ({when})"
    if isinstance(value, (dict, list)):
        return json.dumps(value, default=str, sort_keys=True)
    return _fmt(value)


def _status_class(status: str) -> str:
    if status == "succeeded":
        return "ok"
    if status in ("failed", "anomaly_stop"):
        return "bad"
    return "other"


def _render_html(data: RunData, plots: list[Path], out_dir: Path) -> str:
    totals = data.totals()
    name = totals.get("name") or data.run_dir.name
    status = data.status
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>mindpulse report: {_e(name)}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>mindpulse report: {_e(name)}</h1>",
        f'<p>status: <span class="status {_status_class(status)}">{_e(status)}</span>'
        f" &nbsp; world size {_e(data.world_size)} &nbsp; reduced steps {len(data.reduced)}"
        f" &nbsp; run directory <code>{_e(data.run_dir)}</code></p>",
    ]
    if not data.has_steps:
        parts.append('<p class="note"><strong>No data:</strong> metrics.msgpack holds no step packets.</p>')
    for note in data.notes:
        parts.append(f'<p class="note">{_e(note)}</p>')

    parts.append("<h2>Summary</h2>")
    if not data.summary:
        parts.append('<p class="note">Derived from metrics.msgpack (no summary.json).</p>')
    rows = [[k, _summary_value(k, v)] for k, v in totals.items() if k not in ("ranks", "errors")]
    parts.append(_html_table(["field", "value"], rows, "no summary"))

    parts.append("<h2>Final cluster table</h2>")
    headers, rows = _rank_table_rows(data)
    parts.append(_html_table(headers, rows, "no ranks reported"))
    errors = totals.get("errors") if isinstance(totals.get("errors"), dict) else {}
    for r, err in sorted(errors.items(), key=lambda kv: str(kv[0])):
        if isinstance(err, dict):
            parts.append(f"<details><summary>rank {_e(r)}: {_e(err.get('error', ''))}</summary>"
                         f"<pre>{_e(err.get('traceback', ''))}</pre></details>")

    parts.append("<h2>Plots</h2>")
    for p in plots:
        b64 = base64.b64encode(p.read_bytes()).decode("ascii")
        parts.append(f'<figure><img alt="{_e(p.stem)}" src="data:image/png;base64,{b64}">'
                     f"<figcaption>{_e(p.name)}</figcaption></figure>")
    parts.append(f'<p>Markers: <span style="color:{_ANOMALY_COLOR}">red</span> = anomaly steps, '
                 f'<span style="color:{_CHECKPOINT_COLOR}">green</span> = checkpoint steps'
                 + (f', <span style="color:{_ATTEMPT_COLOR}">purple</span> = where a restarted attempt resumed'
                    if data.attempt_starts else "") + ".</p>")

    if data.multi_attempt:
        parts.append("<h2>Attempts</h2>")
        parts.append("<p>The run was restarted (<code>max_restarts</code>): each step is shown from the newest "
                     "attempt that ran it; an attempt's steps from where the next one resumed are superseded.</p>")
        parts.append(_html_table(list(_ATTEMPT_KEYS), _attempt_rows(data), "no attempts"))

    parts.append("<h2>Anomalies</h2>")
    parts.append(_html_table(list(_ANOMALY_KEYS), _anomaly_rows(data), "no anomalies recorded"))

    parts.append("<h2>Checkpoints</h2>")
    parts.append(_html_table(list(_CHECKPOINT_KEYS), _checkpoint_rows(data, short_sha=False),
                             "no checkpoints recorded"))

    parts.append("<h2>Configuration</h2>")
    if data.config_text is not None:
        parts.append(f"<pre>{_e(data.config_text)}</pre>")
    else:
        parts.append('<p class="empty">no config.yaml</p>')

    parts.append("<h2>Profiler output</h2>")
    if data.profile_dirs:
        items = []
        for d in data.profile_dirs:
            rel = Path(os.path.relpath(d, out_dir)).as_posix() + "/"
            items.append(f'<li><a href="{_e(urllib.parse.quote(rel))}">{_e(d.name)}</a></li>')
        parts.append("<ul>" + "".join(items) + "</ul>")
    else:
        parts.append('<p class="empty">no profiler output</p>')

    parts.append("<h2>Final tables (text)</h2>")
    parts.append(f"<pre>{_e(_final_tables(data))}</pre>")
    parts.append("</body></html>")
    return "\n".join(parts)


def build_report(run_dir: Path, out_dir: Path | None = None) -> dict:
    """Write PNG plots and `report.html` for a run; returns where they are and what they hold."""
    data = load_run(run_dir)
    out = Path(out_dir) if out_dir is not None else data.run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    plots: list[Path] = []
    for name in PLOT_NAMES:
        path = out / name
        try:
            plots.append(_PLOTTERS[name](data, path))
        except Exception as exc:  # one bad plot must not cost the whole report
            log.warning("report: %s failed (%s: %s)", name, type(exc).__name__, exc)
            data.notes.append(f"{name} could not be drawn: {type(exc).__name__}: {exc}")
            plots.append(_placeholder(path, name, "plot failed"))
    html_path = out / "report.html"
    tmp = html_path.with_name(html_path.name + ".tmp")
    tmp.write_text(_render_html(data, plots, out), encoding="utf-8")
    os.replace(tmp, html_path)
    return {
        "out_dir": str(out),
        "plots": [str(p) for p in plots],
        "html": str(html_path),
        "steps": len(data.reduced),
        "world_size": data.world_size,
        "attempts": len(data.attempts) or 1,
        "metrics": data.metrics,
    }


__all__ = ["build_report", "final_tables", "load_run", "RunData", "PLOT_NAMES"]
