"""Offline report of a run directory: PNG plots and one self-contained HTML page, and the
run's end-of-run summary as console text.

Reads what a run leaves behind, all but the metrics file optional, and copes with a
crashed run (a torn last record in `metrics.msgpack`, no `summary.json`):

* `metrics.msgpack` (and the segments closed before it), `summary.json`, `config.yaml` —
  through `run_reader.RunReader`: every accepted packet replayed with the aggregator's reducer
  and straggler tracker (built from the run's config), one timeline over the attempts (a
  restarted attempt's steps replace the earlier attempts' from where it resumed), the
  aggregator's reduced records for the steps whose per-rank packets were thinned, damaged
  bytes skipped and counted; the launcher's summary; the resolved configuration (shown as is);
* `anomalies.json` — a list of {rule, step, rank, value, threshold, action, message};
* `checkpoints/manifest.json` — {"files": [{path, step, metric, metric_name, kind, size, sha256}],
  "best": {...}}; `path` is a file name inside `checkpoints/`;
* `profile/rank_*/` — profiler output folders, linked relatively.

The page reads top down in the order a user asks (`Headline`): did the run succeed and why
did it end (the stop rule and its message, or the failure's root-cause rank and first error
line), wall time, steps, loss first → best → last, throughput, world and cards, the best and
latest checkpoints as links, the anomalies, and (when `summary.json` holds `goodput`) the
effective training time ratio with its largest badput causes. Then the plots, with anomaly,
checkpoint and restart markers that link to the rows of the anomaly, checkpoint and attempt
tables (and back); the raw `summary.json` and the resolved config are folded away at the
bottom. `final_tables` renders the same headline, in the same order, as console text: the
launcher prints it at the end of every run.

Plots are drawn with matplotlib's Agg canvas directly (no pyplot, no display needed), and
show only what was measured: a card metric no card reported is named under the figure
("not reported by this device"), never drawn as an empty panel; a plot with nothing to draw
is a one-line note on the page (its PNG file still exists, saying so).
"""

from __future__ import annotations

import base64
import datetime as _dt
import html
import json
import logging
import math
import os
import statistics
import urllib.parse
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tabulate import tabulate

from mindpulse.aggregator.reducer import ReducedStep
from mindpulse.config import RunConfig
from mindpulse.protocol import EventPacket, StepPacket, TelemetryPacket
from mindpulse.views.run_reader import (
    CONFIG,
    METRICS,
    SUMMARY,
    AttemptInfo,
    RunReader,
    read_config,
    read_json,
)

log = logging.getLogger(__name__)

PLOT_NAMES: tuple[str, ...] = ("loss.png", "grad_norm.png", "step_time.png", "throughput.png", "telemetry.png",
                               "straggler.png", "mfu.png")
_MAX_POINTS = 4000
"""Longest line drawn per series; longer series are thinned by a stride."""
_MAX_MARKERS = 200
"""At most this many vertical markers of one kind per plot."""
_MAX_MARKER_LABELS = 40
"""Anomaly markers carry their label (A1, A2, ...) on the plot up to this many."""
_MAX_LEGEND = 16
_MAX_LINES = 16
"""Above this many ranks (cards) a plot draws the range over ranks (cards), not one line each."""
_MAX_TABLE_ROWS = 500
"""Rows of the anomaly timeline on the page; the rest are counted (anomalies.json holds all)."""
_CONSOLE_ANOMALIES = 20
"""Rows of the anomaly timeline on the console."""
_CONSOLE_RANKS = 16
"""Up to this many ranks the console lists every rank; above, the ranks that failed."""
_ANOMALY_COLOR = "#c62828"
_CHECKPOINT_COLOR = "#2e7d32"
_ATTEMPT_COLOR = "purple"
_BEST_COLOR = "gold"


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
    manifest_best: dict[str, Any] | None = None
    """The manifest's `best` record (the newest best checkpoint), when it has one."""
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
    metrics_read: bool = True
    """False when only summary.json, config.yaml and the side files were read (`load_run(metrics=False)`)."""
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
        return (len(self.attempts) > 1 or any(a.attempt > 0 for a in self.attempts)
                or len(self.summary_attempts) > 1)

    @property
    def summary_attempts(self) -> list[dict[str, Any]]:
        """The launcher's record of each attempt (summary.json `attempts`)."""
        att = (self.summary or {}).get("attempts")
        return [a for a in att if isinstance(a, dict)] if isinstance(att, list) else []

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
        if not self.has_steps and not self.reduced:
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
    data.notes += run.config_file.notes


def _read_side_files(data: RunData) -> None:
    """summary.json and config.yaml without the metrics (`load_run(metrics=False)`)."""
    summary = _read_json(data.run_dir / SUMMARY, data)
    if isinstance(summary, dict):
        data.summary = summary
    elif summary is not None:
        data.notes.append(f"{SUMMARY} is not a JSON object")
    cfg = read_config(data.run_dir / CONFIG)
    data.config, data.config_text = cfg.config, cfg.text
    data.notes += cfg.notes
    data.world_size = cfg.world_size or _int((data.summary or {}).get("world_size")) or 0


def load_run(run_dir: Path | str, metrics: bool = True) -> RunData:
    """Read a run directory; never fails on a damaged or missing optional file.

    `metrics=False` reads only summary.json, config.yaml, anomalies, the checkpoint manifest
    and the profiler folders (no replay of the metrics: cheap for any run size); the
    headline then lacks what only the metrics hold (throughput, cards, the loss steps)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"no run directory at {run_dir}")
    data = RunData(run_dir=run_dir, metrics_read=metrics)
    if metrics:
        _read_run(RunReader(run_dir, history=True), data)
    else:
        _read_side_files(data)

    anomalies = _read_json(run_dir / "anomalies.json", data)
    if isinstance(anomalies, dict):  # tolerate {"anomalies": [...]}
        anomalies = anomalies.get("anomalies")
    if isinstance(anomalies, list):
        data.anomalies = sorted((a for a in anomalies if isinstance(a, dict)),
                                key=lambda a: _int(a.get("step")) if _int(a.get("step")) is not None else 1 << 62)
    elif anomalies is not None:
        data.notes.append("anomalies.json is not a list of records")

    manifest = _read_json(run_dir / "checkpoints" / "manifest.json", data)
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if isinstance(files, list):
        data.checkpoints = sorted((f for f in files if isinstance(f, dict)),
                                  key=lambda f: (_int(f.get("step")) or 0, str(f.get("path"))))
        best = manifest.get("best")
        data.manifest_best = best if isinstance(best, dict) else None
    elif manifest is not None:
        data.notes.append("checkpoints/manifest.json has no list of files")

    prof = run_dir / "profile"
    if prof.is_dir():
        data.profile_dirs = sorted((d for d in prof.glob("rank_*") if d.is_dir()), key=_rank_dir_key)
    return data


def _rank_dir_key(d: Path) -> tuple[int, str]:
    tail = d.name[len("rank_"):]
    return (int(tail), d.name) if tail.isdigit() else (1 << 30, d.name)


# ------------------------------------------------------------------------------ formatting


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


def _local(ts: float) -> _dt.datetime:
    return _dt.datetime.fromtimestamp(float(ts)).astimezone()


def _zone(t: _dt.datetime) -> str:
    off = t.utcoffset()
    if not off:
        return "UTC"
    z = t.strftime("%z")
    return f"UTC{z[:3]}:{z[3:]}"


def _when(ts: Any) -> str:
    """An epoch time as a local date and time with its offset, e.g. `2026-12-01 11:13:36 UTC`."""
    if not _finite(ts) or ts <= 0:
        return "-"
    t = _local(ts)
    return f"{t:%Y-%m-%d %H:%M:%S} {_zone(t)}"


def _span(start: Any, end: Any) -> str:
    """`2026-12-01 11:13:36 → 11:14:48 UTC` (the end's date only when it differs)."""
    if not (_finite(start) and start > 0):
        return _when(end)
    if not (_finite(end) and end > 0):
        return _when(start)
    a, b = _local(start), _local(end)
    if _zone(a) != _zone(b):
        return f"{_when(start)} → {_when(end)}"
    tail = f"{b:%H:%M:%S}" if a.date() == b.date() else f"{b:%Y-%m-%d %H:%M:%S}"
    return f"{a:%Y-%m-%d %H:%M:%S} → {tail} {_zone(a)}"


def _duration(s: Any) -> str:
    """Seconds in human units: `42 s`, `1 min 12 s`, `8 h 03 min`, `3 d 04 h`."""
    if not _finite(s) or s < 0:
        return "-"
    if s < 10:
        return f"{s:.1f} s"
    if s < 60:
        return f"{s:.0f} s"
    m, sec = divmod(int(round(s)), 60)
    if m < 60:
        return f"{m} min {sec:02d} s"
    h, m = divmod(m, 60)
    if h < 48:
        return f"{h} h {m:02d} min"
    d, h = divmod(h, 24)
    return f"{d} d {h:02d} h"


def _size(n: Any) -> str:
    if not _finite(n) or n < 0:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return "-"  # pragma: no cover


def _num(x: Any, digits: int = 4) -> str:
    """A metric value: fixed decimals in the usual range, scientific outside, as is when not a number."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        if not math.isfinite(x):
            return str(x)
        if x != 0 and (abs(x) < 1e-3 or abs(x) >= 1e6):
            return f"{x:.3e}"
        return f"{x:.{digits}f}"
    return "-" if x is None else str(x)


def _rate(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def _plural(n: int, word: str, many: str | None = None) -> str:
    return f"{n} {word if n == 1 else (many or word + 's')}"


# ------------------------------------------------------------------------------- headline


@dataclass
class Checkpoint:
    """One checkpoint file as the page links it."""

    name: str
    file: Path
    step: int | None
    kind: str
    metric: float | None
    metric_name: str
    size: int | None
    exists: bool

    def describe(self) -> str:
        parts = [f"step {self.step}" if self.step is not None else "step ?"]
        if self.metric is not None:
            parts.append(f"{self.metric_name or 'metric'} {_num(self.metric)}")
        if self.size is not None:
            parts.append(_size(self.size))
        return ", ".join(parts)


@dataclass
class LossPoint:
    value: Any
    step: int | None


@dataclass
class Headline:
    """The figures that matter, in the order the page and the console show them."""

    name: str
    status: str
    why: str
    """One sentence: what ended the run."""
    detail: str = ""
    """The stop rule's message or the failure's first error line."""
    started: float | None = None
    ended: float | None = None
    wall_s: float | None = None
    wall_source: str = ""
    steps_done: int | None = None
    steps_total: int | None = None
    epoch: int | None = None
    loss_first: LossPoint | None = None
    loss_best: LossPoint | None = None
    loss_last: LossPoint | None = None
    samples_per_s: float | None = None
    step_time_s: float | None = None
    world_size: int = 0
    world_shape: str = ""
    cards: list[str] = field(default_factory=list)
    card_kinds: str = ""
    best: Checkpoint | None = None
    latest: Checkpoint | None = None
    goodput: dict[str, Any] | None = None
    anomaly_counts: list[tuple[str, int, str]] = field(default_factory=list)
    """(rule, firings, actions) by rule, most frequent first."""
    anomalies: int = 0
    attempts: int = 1

    @property
    def status_class(self) -> str:
        if self.status == "succeeded":
            return "ok"
        if self.status in ("failed", "anomaly_stop"):
            return "bad"
        return "other"

    def steps_text(self) -> str:
        if self.steps_done is None:
            return "-"
        if self.steps_total:
            return f"{self.steps_done:,} / {self.steps_total:,}"
        return f"{self.steps_done:,}"

    def loss_text(self) -> str:
        """`2.1669 (step 1) → best 2.0508 (step 27) → last 2.1351 (step 30)`."""
        def at(p: LossPoint | None) -> str:
            if p is None:
                return "-"
            return _num(p.value) + (f" (step {p.step})" if p.step is not None else "")
        if not (self.loss_first or self.loss_best or self.loss_last):
            return "not reported"
        return f"{at(self.loss_first)} → best {at(self.loss_best)} → last {at(self.loss_last)}"

    def throughput_text(self) -> str:
        if self.samples_per_s is None and self.step_time_s is None:
            return "not reported"
        parts = []
        if self.samples_per_s is not None:
            parts.append(f"{_rate(self.samples_per_s)} samples/s")
        if self.step_time_s is not None:
            parts.append(f"{_duration(self.step_time_s)} per step")
        return ", ".join(parts) + " (median over steps; step time of the slowest rank)"

    def cards_text(self, limit: int = 4) -> str:
        if not self.cards:
            return "cards not reported"
        shown = ", ".join(self.cards[:limit])
        more = f" … (+{len(self.cards) - limit})" if len(self.cards) > limit else ""
        kinds = f" ({self.card_kinds})" if self.card_kinds else ""
        return f"{_plural(len(self.cards), 'card')}{kinds}: {shown}{more}"

    def wall_text(self) -> str:
        if self.wall_s is None:
            return "-"
        return _duration(self.wall_s)

    def anomalies_text(self) -> str:
        if not self.anomalies:
            return "none"
        rules = ", ".join(f"{rule} ×{n} ({actions})" for rule, n, actions in self.anomaly_counts[:4])
        more = f", {len(self.anomaly_counts) - 4} more rules" if len(self.anomaly_counts) > 4 else ""
        return f"{self.anomalies}: {rules}{more}"


def _first_line(text: Any) -> str:
    for ln in str(text or "").splitlines():
        if ln.strip():
            return ln.strip()
    return ""


def _exception_line(tb: Any) -> str:
    """The exception line that ends a Python traceback ('' when there is none)."""
    lines = [ln for ln in str(tb or "").splitlines() if ln.strip()]
    for ln in reversed(lines):
        if not ln.startswith((" ", "\t")) and not ln.startswith("Traceback"):
            return ln.strip()
    return ""


def _failure_error(f: dict[str, Any]) -> str:
    """A failure's first error line: its error's, else its traceback's exception line."""
    return _first_line(f.get("error")) or _exception_line(f.get("traceback"))


def _why(data: RunData, steps_done: int | None, steps_total: int | None, last_step: int | None) -> tuple[str, str]:
    """(what ended the run, the message behind it)."""
    s = data.summary
    restarts = max(len(data.summary_attempts), len(data.attempts)) - 1
    after = f" after {_plural(restarts, 'restart')}" if restarts > 0 else ""
    if not s:
        if not data.has_steps and not data.reduced:
            return "no data: the run left no step in its metrics", ""
        last = f"; its last complete step is {last_step}" if last_step is not None else ""
        return (f"did not finish: {SUMMARY} is missing (crashed, killed or still running){last}", "")
    status = str(s.get("status") or "")
    stop = s.get("stop") if isinstance(s.get("stop"), dict) else None
    if status == "succeeded":
        if steps_total and steps_done is not None and steps_done >= steps_total:
            return f"completed all {steps_total:,} steps{after}", _first_line(s.get("message"))
        return (f"completed {_plural(steps_done or 0, 'step')}{after}",
                _first_line(s.get("no_steps_reason") or s.get("message")))
    if status == "anomaly_stop" and stop:
        rank = stop.get("rank")
        who = f" on rank {rank}" if rank is not None else ""
        at = stop.get("decided_at", stop.get("step"))
        after_step = f"; every rank stopped after step {stop['step']}" if stop.get("step") is not None else ""
        return (f"stopped by rule {stop.get('rule')}{who} at step {at}{after_step}{after}",
                _first_line(stop.get("message")))
    if status == "interrupted":
        after_step = f"; every rank stopped after step {stop['step']}" if stop and stop.get("step") is not None else ""
        saved = ", a last checkpoint was saved" if stop and stop.get("save_last") else ""
        return f"interrupted (Ctrl-C or a signal){after_step}{saved}", _first_line(s.get("message"))
    if status == "preflight_failed":  # launcher/card_check.py: refused before any step
        return "refused by the pre-flight card check (preflight.json): no step ran", _first_line(s.get("message"))
    if status == "failed":
        f = s.get("failure") if isinstance(s.get("failure"), dict) else None
        if f is None:
            return f"failed{after}", _first_line(s.get("message"))
        root, step = f.get("root_cause_rank"), f.get("step")
        at = f" at step {step}" if step is not None else ""
        how = "".join([f", exit code {f['exit_code']}" if f.get("exit_code") is not None else "",
                       f", signal {f['signal']}" if f.get("signal") else ""])
        tries = f" (after {_plural(restarts, 'restart')})" if restarts > 0 else ""
        if f.get("kind") == "hang":
            ranks = f.get("ranks") or ([root] if root is not None else [])
            return (f"hung: no progress from rank(s) {', '.join(str(r) for r in ranks)}{at}; "
                    f"root cause rank {root}{tries}", _failure_error(f) or _first_line(s.get("message")))
        if f.get("kind") == "launcher" or root is None:
            return f"the launcher failed{tries}", _failure_error(f) or _first_line(s.get("message"))
        return (f"rank {root} failed{at} (the root cause){how}{tries}",
                _failure_error(f) or _first_line(s.get("message")))
    return status or "unknown", _first_line(s.get("message"))


def _card_label(node: str, card: Any, index: int, name: Any = None) -> str:
    """`node/card` as the console's card table names a card (the host as its name, e.g. `cpu`)."""
    if card == -1:
        return f"{node}/{name or 'host'}"
    return f"{node}/{index if card is None else card}"


def _card_series(data: RunData) -> dict[str, list[tuple[float, dict[str, Any]]]]:
    """Card label → its samples (time, record), in time order."""
    out: dict[str, list[tuple[float, dict[str, Any]]]] = {}
    for pkt in data.telemetry:
        for j, card in enumerate(pkt.cards):
            if isinstance(card, dict):
                out.setdefault(_card_label(pkt.node, card.get("card"), j, card.get("name")), []).append((pkt.ts, card))
    return out


def _card_kinds(data: RunData) -> str:
    kinds: Counter[str] = Counter()
    seen: set[str] = set()
    sources: set[str] = set()
    for pkt in data.telemetry:
        for j, card in enumerate(pkt.cards):
            if not isinstance(card, dict):
                continue
            label = _card_label(pkt.node, card.get("card"), j, card.get("name"))
            src = card.get("source") or pkt.source
            if src:
                sources.add(str(src))
            if label in seen:
                continue
            seen.add(label)
            if card.get("card") == -1:
                kinds[f"host {card.get('name') or 'cpu'}"] += 1
            elif card.get("name"):
                kinds[str(card["name"])] += 1
    text = ", ".join(f"{k} ×{n}" if n > 1 else k for k, n in kinds.most_common())
    if sources:
        text += (", " if text else "") + "via " + "/".join(sorted(sources))
    return text


def _checkpoint(data: RunData, rec: dict[str, Any] | None, out_dir: Path | None = None) -> Checkpoint | None:
    if not isinstance(rec, dict) or not isinstance(rec.get("path"), str) or not rec.get("path"):
        return None
    path = Path(rec["path"])
    ckpt_dir = data.run_dir / "checkpoints"
    if path.is_absolute():
        file = path
        if not file.exists() and (ckpt_dir / path.name).exists():  # the run directory was moved
            file = ckpt_dir / path.name
    else:
        candidates = [ckpt_dir / path, data.run_dir / path]
        file = next((c for c in candidates if c.exists()), candidates[0] if len(path.parts) == 1 else candidates[1])
    exists = file.exists()
    size = _int(rec.get("size"))
    if size is None and exists:
        try:
            size = file.stat().st_size
        except OSError:
            size = None
    metric = rec.get("metric")
    return Checkpoint(name=path.name, file=file, step=_int(rec.get("step")), kind=str(rec.get("kind") or ""),
                      metric=float(metric) if _finite(metric) else None,
                      metric_name=str(rec.get("metric_name") or data.config.checkpoint.best_metric or ""),
                      size=size, exists=exists)


def _best_and_latest(data: RunData) -> tuple[Checkpoint | None, Checkpoint | None]:
    files = data.checkpoints
    bests = [f for f in files if f.get("kind") == "best"]
    best_rec: dict[str, Any] | None = None
    if bests:
        best_rec = max(bests, key=lambda f: (_finite(f.get("time")) and f["time"] or 0, _int(f.get("step")) or 0))
    elif data.manifest_best:
        best_rec = data.manifest_best
    elif isinstance((data.summary or {}).get("best_checkpoint"), dict):
        best_rec = dict(data.summary["best_checkpoint"], kind="best")  # type: ignore[index]
    latest_rec = max(files, key=lambda f: (_int(f.get("step")) or 0, _finite(f.get("time")) and f["time"] or 0),
                     default=None)
    return _checkpoint(data, best_rec), _checkpoint(data, latest_rec)


def _goodput(summary: dict[str, Any] | None) -> dict[str, Any] | None:
    g = (summary or {}).get("goodput")
    return g if isinstance(g, dict) else None


def _ettr_pct(g: dict[str, Any]) -> float | None:
    e = g.get("ettr")
    if not _finite(e):
        wall, prod = g.get("wall_s"), g.get("productive_s")
        if _finite(wall) and _finite(prod) and wall > 0:
            e = prod / wall
        else:
            return None
    return float(e) * 100.0 if e <= 1.0 else float(e)


def _badput(g: dict[str, Any]) -> list[tuple[str, float]]:
    b = g.get("badput_s")
    if not isinstance(b, dict):
        return []
    return sorted(((str(k), float(v)) for k, v in b.items() if _finite(v) and v > 0), key=lambda kv: -kv[1])


def goodput_text(g: dict[str, Any], top: int = 3) -> str:
    """`ETTR 92.1%: productive 7 h 22 min of 8 h 00 min; badput: restart 20 min (4.2%), ...`."""
    pct = _ettr_pct(g)
    parts = [f"ETTR {pct:.1f}%" if pct is not None else "ETTR -"]
    wall, prod = g.get("wall_s"), g.get("productive_s")
    if _finite(prod) and _finite(wall):
        parts[0] += f": productive {_duration(prod)} of {_duration(wall)}"
    causes = _badput(g)
    if causes:
        def share(s: float) -> str:
            return f" ({100 * s / wall:.1f}%)" if _finite(wall) and wall > 0 else ""
        shown = [f"{k} {_duration(v)}{share(v)}" for k, v in causes[:top]]
        rest = causes[top:]
        if rest:
            shown.append(f"{len(rest)} more {_duration(sum(v for _, v in rest))}")
        parts.append("badput: " + ", ".join(shown))
    if _finite(g.get("unaccounted_s")) and g["unaccounted_s"] > 0:
        parts.append(f"unaccounted {_duration(g['unaccounted_s'])}")
    return "; ".join(parts)


def headline(data: RunData) -> Headline:
    """The figures that matter, from the summary and the metrics the run left."""
    s = data.summary or {}
    tot = data.totals()
    name = str(s.get("name") or data.run_dir.name)
    red = data.reduced
    last_step = red[-1].step if red else None

    steps_done = _int(tot.get("steps_completed"))
    if steps_done is None and last_step is not None:
        steps_done = last_step
    steps_total = data.config.train.steps if data.config.train.steps > 0 and not data.config.job.script else None
    why, detail = _why(data, steps_done, steps_total, last_step)

    # loss: the timeline's reduced mean (every attempt, each step from the attempt shown)
    finite = [(r.step, r.loss_mean) for r in red if r.step > 0 and _finite(r.loss_mean)]
    last = next(((r.step, r.loss_mean) for r in reversed(red) if r.step > 0 and r.loss_mean is not None), None)
    if finite:
        first_p = LossPoint(finite[0][1], finite[0][0])
        b = min(finite, key=lambda sv: sv[1])
        best_p = LossPoint(b[1], b[0])
        last_p = LossPoint(last[1], last[0]) if last else None
    else:
        def pt(key: str, step_key: str | None = None) -> LossPoint | None:
            v = tot.get(key)
            return None if v is None else LossPoint(v, _int(tot.get(step_key)) if step_key else None)
        first_p, best_p, last_p = pt("first_loss"), pt("best_loss", "best_loss_step"), pt("last_loss")

    sps = [r.samples_per_s for r in red if r.step > 0 and _finite(r.samples_per_s)]
    stt = [r.step_time_max for r in red if r.step > 0 and _finite(r.step_time_max)]

    started = s.get("started") if _finite(s.get("started")) else None
    wall = s.get("wall_time_s") if _finite(s.get("wall_time_s")) else None
    wall_source = ""
    if started is None or wall is None:  # no summary: the metrics' own clock
        times = [t for t in ([a.started for a in data.attempts] + [r.ts for r in red]) if _finite(t) and t > 0]
        if times:
            started = started if started is not None else min(times)
            if wall is None:
                wall = max(times) - started
                wall_source = "from the metrics (no summary.json)"
    ended = started + wall if started is not None and wall is not None else None

    ws = data.world_size or _int(s.get("world_size")) or 0
    w = data.config.world
    device = getattr(w.device, "value", w.device)
    shape = (f"{_plural(w.nodes, 'node')} × {w.ranks_per_node}, {device}"
             if w.nodes * w.ranks_per_node == ws and ws else "")

    by_rule: dict[str, list[str]] = {}
    for a in data.anomalies:
        by_rule.setdefault(str(a.get("rule")), []).append(str(a.get("action") or "-"))
    counts = sorted(((rule, len(acts), "/".join(sorted(set(acts)))) for rule, acts in by_rule.items()),
                    key=lambda x: (-x[1], x[0]))
    best, latest = _best_and_latest(data)
    epoch = red[-1].epoch if red else None
    return Headline(
        name=name, status=data.status, why=why, detail=detail, started=started, ended=ended, wall_s=wall,
        wall_source=wall_source, steps_done=steps_done, steps_total=steps_total, epoch=epoch,
        loss_first=first_p, loss_best=best_p, loss_last=last_p,
        samples_per_s=statistics.median(sps) if sps else None,
        step_time_s=statistics.median(stt) if stt else None,
        world_size=ws, world_shape=shape, cards=sorted(_card_series(data)), card_kinds=_card_kinds(data),
        best=best, latest=latest, goodput=_goodput(data.summary), anomaly_counts=counts,
        anomalies=len(data.anomalies), attempts=max(len(data.summary_attempts), len(data.attempts), 1),
    )


# ----------------------------------------------------------------------------------- plots


@dataclass
class AnomalyGroup:
    """The anomalies of one step: one marker on the plots, one anchor in the timeline."""

    step: int
    label: str
    records: list[dict[str, Any]]

    @property
    def anchor(self) -> str:
        return f"anomaly-{self.step}"

    def title(self) -> str:
        parts = []
        for a in self.records[:3]:
            rank = a.get("rank")
            parts.append(f"{a.get('rule')}" + (f" rank {rank}" if rank is not None else "")
                         + f" ({a.get('action')})")
        more = f" +{len(self.records) - 3}" if len(self.records) > 3 else ""
        return f"{self.label} · step {self.step}: " + "; ".join(parts) + more


def anomaly_groups(data: RunData) -> list[AnomalyGroup]:
    by_step: dict[int, list[dict[str, Any]]] = {}
    for a in data.anomalies:
        s = _int(a.get("step"))
        if s is not None:
            by_step.setdefault(s, []).append(a)
    return [AnomalyGroup(step, f"A{i + 1}", recs) for i, (step, recs) in enumerate(sorted(by_step.items()))]


@dataclass
class PlotLink:
    """A clickable strip over a marker line of a plot, in percent of the image."""

    left: float
    top: float
    height: float
    kind: str
    href: str
    title: str


@dataclass
class Plot:
    """One figure of the report."""

    name: str
    path: Path
    drawn: bool
    message: str = ""
    """Why nothing was drawn, or what the figure leaves out (e.g. metrics a device does not report)."""
    links: list[PlotLink] = field(default_factory=list)

    @property
    def anchor(self) -> str:
        return "plot-" + self.path.stem


@dataclass
class _Mark:
    ax: Any
    x: float
    kind: str
    href: str
    title: str


class _Markers:
    """Draws the anomaly, checkpoint and restart markers of the run on an axis, and remembers
    where they are so the page can link them."""

    def __init__(self, data: RunData):
        self.groups = anomaly_groups(data)
        self.checkpoints: dict[int, list[str]] = {}
        for c in data.checkpoints:
            s = _int(c.get("step"))
            if s is not None:
                self.checkpoints.setdefault(s, []).append(str(c.get("kind") or "checkpoint"))
        self.attempts = data.attempt_starts
        self.marks: list[_Mark] = []

    def draw(self, ax, to_x: Callable[[int], float | None] | None = None) -> None:
        conv = to_x or float
        label_them = len(self.groups) <= _MAX_MARKER_LABELS
        first = True
        for g in self.groups[:_MAX_MARKERS]:
            x = conv(g.step)
            if x is None:
                continue
            ax.axvline(x, color=_ANOMALY_COLOR, linestyle="--", linewidth=1.0, alpha=0.75,
                       label="anomaly" if first else None)
            first = False
            if label_them:
                ax.text(x, 0.985, g.label, transform=ax.get_xaxis_transform(), color=_ANOMALY_COLOR, fontsize=7,
                        ha="center", va="top", fontweight="bold",
                        bbox={"boxstyle": "round,pad=0.15", "facecolor": "white", "edgecolor": "none", "alpha": 0.8})
            self.marks.append(_Mark(ax, x, "anomaly", "#" + g.anchor, g.title()))
        first = True
        for step, kinds in sorted(self.checkpoints.items())[:_MAX_MARKERS]:
            x = conv(step)
            if x is None:
                continue
            ax.axvline(x, color=_CHECKPOINT_COLOR, linestyle="--", linewidth=0.9, alpha=0.6,
                       label="checkpoint" if first else None)
            first = False
            self.marks.append(_Mark(ax, x, "checkpoint", f"#ckpt-{step}",
                                    f"checkpoint at step {step} ({', '.join(kinds)})"))
        for step, attempt in self.attempts[:_MAX_MARKERS]:  # where a restarted attempt resumed
            x = conv(step)
            if x is None:
                continue
            ax.axvline(x, color=_ATTEMPT_COLOR, linestyle=":", linewidth=1.3, alpha=0.9, label=f"attempt {attempt}")
            self.marks.append(_Mark(ax, x, "attempt", f"#attempt-{attempt}",
                                    f"attempt {attempt} resumed at step {step}"))

    def links(self, fig) -> list[PlotLink]:
        """Where each marker drawn on `fig` lies in the saved image, in percent."""
        width, height = fig.bbox.width, fig.bbox.height
        out = []
        for m in self.marks:
            if m.ax.figure is not fig:
                continue
            bb = m.ax.bbox
            px = float(m.ax.get_xaxis_transform().transform((m.x, 0.0))[0])
            if not (bb.x0 - 0.5 <= px <= bb.x1 + 0.5) or not math.isfinite(px):
                continue
            out.append(PlotLink(left=100.0 * px / width, top=100.0 * (height - bb.y1) / height,
                                height=100.0 * bb.height / height, kind=m.kind, href=m.href, title=m.title))
        return out


_RC = {"font.size": 12, "axes.titlesize": 13, "axes.labelsize": 12, "xtick.labelsize": 11, "ytick.labelsize": 11,
       "legend.fontsize": 10, "figure.titlesize": 14}
"""Font sizes that stay readable when a plot is shown at half the page's width."""


def _figure(nrows: int = 1, ncols: int = 1, size: tuple[float, float] = (8.5, 4.0)):
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


def _band(ax, xs: list[float], lo: list[Any], hi: list[Any], label: str, color: str) -> bool:
    """The range over ranks (cards) as a shaded band."""
    los, his = _clean(lo), _clean(hi)
    keep = [i for i in range(len(xs)) if math.isfinite(los[i]) and math.isfinite(his[i])]
    if not keep:
        return False
    xk, lk = _thin([xs[i] for i in keep], [los[i] for i in keep])
    _, hk = _thin([xs[i] for i in keep], [his[i] for i in keep])
    ax.fill_between(xk, lk, hk, color=color, alpha=0.2, linewidth=0, label=label)
    return True


def _finish(fig, axes, path: Path, title: str, marks: _Markers, footer: str = "") -> Plot:
    fig.suptitle(title)
    for ax in axes.flat:
        if not ax.get_visible():
            continue
        handles, _ = ax.get_legend_handles_labels()
        if handles and len(handles) <= _MAX_LEGEND:
            ax.legend(loc="best", framealpha=0.85)
        ax.grid(True, alpha=0.3)
    if footer:
        fig.text(0.5, 0.012, footer, ha="center", va="bottom", fontsize=10, color="#555555", style="italic")
        fig.tight_layout(rect=(0, 0.05, 1, 1))
    else:
        fig.tight_layout()
    links = marks.links(fig)
    fig.savefig(path, format="png")
    return Plot(path.name, path, drawn=True, message=footer, links=links)


def _placeholder(path: Path, title: str, message: str) -> Plot:
    fig, axes = _figure(size=(10.0, 3.0))
    ax = axes[0, 0]
    ax.axis("off")
    ax.text(0.5, 0.5, message, ha="center", va="center", fontsize=16, color="gray", transform=ax.transAxes)
    fig.suptitle(title)
    fig.savefig(path, format="png")
    return Plot(path.name, path, drawn=False, message=message)


def _many_ranks(data: RunData) -> bool:
    return len(data.per_rank) > _MAX_LINES


def _plot_loss(data: RunData, path: Path, marks: _Markers) -> Plot:
    if not data.has_steps and not data.reduced:
        return _placeholder(path, "loss", "no data")
    fig, axes = _figure()
    ax = axes[0, 0]
    drawn = False
    bad_x: list[float] = []
    red = [x for x in data.reduced if x.loss_mean is not None]
    if _many_ranks(data):
        drawn |= _band(ax, [x.step for x in red], [x.loss_min for x in red], [x.loss_max for x in red],
                       f"min..max over {data.world_size} ranks", "tab:blue")
    for r, pkts in data.per_rank.items():
        pkts = [p for p in pkts if p.loss is not None]
        if not _many_ranks(data):
            drawn |= _plot(ax, [p.step for p in pkts], _clean(p.loss for p in pkts), f"rank {r}",
                           linewidth=0.9, alpha=0.8)
        bad_x += [p.step for p in pkts if not math.isfinite(p.loss)]
    bad_x += [x.step for x in red if not math.isfinite(x.loss_mean)]
    drawn |= _plot(ax, [x.step for x in red], _clean(x.loss_mean for x in red), "mean (reduced)",
                   color="black", linewidth=2.0)
    finite = [(x.step, x.loss_mean) for x in red if x.step > 0 and math.isfinite(x.loss_mean)]
    if finite:
        bs, bv = min(finite, key=lambda sv: sv[1])
        ax.plot([bs], [bv], marker="*", color=_BEST_COLOR, markeredgecolor="black", markersize=13, linestyle="none",
                label=f"best {_num(bv)} (step {bs})", zorder=5)
    if bad_x:
        lo, hi = ax.get_ylim() if drawn else (0.0, 1.0)
        ax.plot(sorted(set(bad_x)), [hi] * len(set(bad_x)), "x", color=_ANOMALY_COLOR, markersize=8,
                label="non-finite loss", clip_on=False)
    if not drawn and not bad_x:
        return _placeholder(path, "loss", "no loss values reported")
    marks.draw(ax)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    title = "loss: reduced mean" + (" and range over ranks" if _many_ranks(data) else " and per rank")
    return _finish(fig, axes, path, title, marks)


def _plot_grad_norm(data: RunData, path: Path, marks: _Markers) -> Plot:
    if not data.has_steps and not data.reduced:
        return _placeholder(path, "grad norm", "no data")
    fig, axes = _figure()
    ax = axes[0, 0]
    drawn = False
    red = [x for x in data.reduced if x.grad_norm is not None]
    drawn |= _plot(ax, [x.step for x in red], _clean(x.grad_norm for x in red), "global",
                   color="black", linewidth=2.0)
    if _many_ranks(data):
        loc = [x for x in data.reduced if x.grad_norm_local_max is not None]
        drawn |= _plot(ax, [x.step for x in loc], _clean(x.grad_norm_local_max for x in loc), "largest local",
                       color="tab:orange", linewidth=1.0)
    else:
        for r, pkts in data.per_rank.items():
            pkts = [p for p in pkts if p.grad_norm_local is not None]
            drawn |= _plot(ax, [p.step for p in pkts], _clean(p.grad_norm_local for p in pkts),
                           f"rank {r} local", linewidth=0.9, alpha=0.8)
    if not drawn:
        return _placeholder(path, "grad norm", "gradient norms not reported (MonitoredTrainOneStepCell measures them)")
    ys = [y for line in ax.get_lines() for y in line.get_ydata() if _finite(y) and y > 0]
    if ys and max(ys) / min(ys) > 1e3:  # an explosion would flatten the rest of the curve
        ax.set_yscale("log")
    marks.draw(ax)
    ax.set_xlabel("step")
    ax.set_ylabel("grad norm")
    return _finish(fig, axes, path, "gradient norm: global and " + ("largest local" if _many_ranks(data)
                                                                     else "per-rank local"), marks)


def _plot_step_time(data: RunData, path: Path, marks: _Markers) -> Plot:
    if not data.has_steps and not data.reduced:
        return _placeholder(path, "step time", "no data")
    fig, axes = _figure()
    ax = axes[0, 0]
    drawn = False
    if _many_ranks(data):
        red = [x for x in data.reduced if x.step_time_max is not None]
        drawn |= _band(ax, [x.step for x in red], [x.step_time_min for x in red], [x.step_time_max for x in red],
                       f"fastest..slowest of {data.world_size} ranks", "tab:blue")
        drawn |= _plot(ax, [x.step for x in red], _clean(x.step_time_max for x in red), "slowest rank",
                       color="black", linewidth=1.2)
    else:
        for r, pkts in data.per_rank.items():
            pkts = [p for p in pkts if p.step_time_s is not None]
            drawn |= _plot(ax, [p.step for p in pkts], _clean(p.step_time_s for p in pkts), f"rank {r}",
                           linewidth=0.9, alpha=0.8)
    if not drawn:
        return _placeholder(path, "step time", "no step time values reported")
    marks.draw(ax)
    ax.set_xlabel("step")
    ax.set_ylabel("step time (s)")
    return _finish(fig, axes, path, "step time " + ("range over ranks" if _many_ranks(data) else "per rank"), marks)


def _plot_throughput(data: RunData, path: Path, marks: _Markers) -> Plot:
    red = [x for x in data.reduced if x.samples_per_s is not None]
    if not red:
        return _placeholder(path, "throughput", "no data" if not data.has_steps else "no throughput values reported")
    fig, axes = _figure()
    ax = axes[0, 0]
    if not _plot(ax, [x.step for x in red], _clean(x.samples_per_s for x in red), "cluster samples/s",
                 color="tab:blue", linewidth=1.5):
        return _placeholder(path, "throughput", "no throughput values reported")
    marks.draw(ax)
    ax.set_xlabel("step")
    ax.set_ylabel("samples / s")
    return _finish(fig, axes, path, "cluster throughput (all ranks' samples over the slowest step)", marks)


def _plot_straggler(data: RunData, path: Path, marks: _Markers) -> Plot:
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
        return _placeholder(path, "straggler score", "no data" if not data.has_steps else
                            f"not enough steps to score (a window of {monitor.straggler_window})")
    fig, axes = _figure()
    ax = axes[0, 0]
    shown = sorted(series.items())
    note = ""
    if len(shown) > _MAX_LINES:  # the slowest ranks: the others sit near 1.0
        shown = sorted(shown, key=lambda kv: min(kv[1][1]))[:_MAX_LINES]
        note = f", the {_MAX_LINES} lowest of {len(series)} ranks"
    for r, (xs, ys) in sorted(shown):
        _plot(ax, xs, ys, f"rank {r}", linewidth=1.0)
    ax.axhline(monitor.straggler_threshold, color="tab:red", linestyle=":", linewidth=1.0,
               label=f"threshold {monitor.straggler_threshold:g} (monitor.straggler_threshold)")
    marks.draw(ax)
    ax.set_xlabel("step")
    ax.set_ylabel("score (fastest / rank's busy time)")
    ax.set_ylim(0, 1.05)
    return _finish(fig, axes, path, f"straggler score per rank (1 = fastest; window {monitor.straggler_window} "
                                    f"steps){note}", marks)


def _peak_of(data: RunData) -> tuple[float | None, str]:
    """The peak the run's MFU was measured against: summary.json's `compute`, else the
    run's own sources again (world.peak_tflops, preflight.json: a run without a summary)."""
    from mindpulse.aggregator.card_peaks import resolve_peak

    comp = (data.summary or {}).get("compute") or {}
    peak = comp.get("peak_tflops")
    if isinstance(peak, (int, float)) and not isinstance(peak, bool) and peak > 0:
        return float(peak), str(comp.get("peak_source") or "")
    return resolve_peak(data.config.world.peak_tflops, data.run_dir, [])


def _plot_mfu(data: RunData, path: Path, marks: _Markers) -> Plot:
    """Per-rank MFU (achieved / peak TFLOPS) over steps, or the achieved TFLOPS when the run
    had no peak; above 16 ranks the range over ranks and the mean."""
    peak, source = _peak_of(data)
    scale = 1.0 / peak if peak else 1.0
    what = "MFU" if peak else "achieved TFLOPS"
    fig, axes = _figure()
    ax = axes[0, 0]
    drawn = False
    if _many_ranks(data):
        red = [x for x in data.reduced if x.tflops_mean is not None]
        drawn |= _band(ax, [x.step for x in red], [x.tflops_min * scale for x in red],
                       [x.tflops_max * scale for x in red], f"lowest..highest of {data.world_size} ranks", "tab:blue")
        drawn |= _plot(ax, [x.step for x in red], _clean(x.tflops_mean * scale for x in red), "mean over ranks",
                       color="black", linewidth=1.2)
    else:
        for r, pkts in data.per_rank.items():
            pkts = [p for p in pkts if p.tflops is not None and p.step > 0]
            drawn |= _plot(ax, [p.step for p in pkts], _clean(p.tflops * scale for p in pkts), f"rank {r}",
                           linewidth=0.9, alpha=0.8)
    if not drawn:
        return _placeholder(path, "MFU", "no data" if not data.has_steps else
                            "no achieved TFLOPS reported (no tokens per step: Monitor(tokens_per_step=...))")
    marks.draw(ax)
    ax.set_xlabel("step")
    ax.set_ylabel("MFU (achieved / peak TFLOPS)" if peak else "achieved TFLOPS")
    title = f"{what} per rank" + (f" (peak {peak:.4g} TFLOPS per card: {source.split(' (')[0]})" if peak
                                  else " (no peak: see summary.json compute.peak_source)")
    return _finish(fig, axes, path, title, marks)


_TELEMETRY_PANELS = (("util_pct", "utilization (%)"), ("memory_used_mb", "memory used (MB)"),
                     ("power_w", "power (W)"), ("temp_c", "temperature (°C)"))


def _step_to_time(data: RunData, t0: float) -> Callable[[int], float | None] | None:
    """A function step → seconds since t0 from the reduced steps' timestamps, or None."""
    import numpy as np

    pts = sorted((x.step, x.ts) for x in data.reduced if _finite(x.ts) and x.ts > 0)
    if len(pts) < 1:
        return None
    steps = np.array([p[0] for p in pts], dtype=float)
    ts = np.maximum.accumulate(np.array([p[1] for p in pts], dtype=float)) - t0

    def conv(step: int) -> float | None:
        if not steps[0] <= step <= steps[-1]:
            return None
        return float(np.interp(step, steps, ts))

    return conv


def _time_unit(span_s: float) -> tuple[str, float]:
    if span_s > 3 * 3600:
        return "hours", 3600.0
    if span_s > 3 * 60:
        return "minutes", 60.0
    return "seconds", 1.0


def _binned_range(samples: list[tuple[float, float]], bins: int = 400) -> tuple[list[float], ...]:
    """(x, low, median, high) over cards per time bin."""
    if not samples:
        return [], [], [], []
    lo_t, hi_t = min(t for t, _ in samples), max(t for t, _ in samples)
    width = (hi_t - lo_t) / bins or 1.0
    groups: dict[int, list[float]] = {}
    for t, v in samples:
        groups.setdefault(min(bins - 1, int((t - lo_t) / width)), []).append(v)
    xs, lows, meds, highs = [], [], [], []
    for b in sorted(groups):
        vals = groups[b]
        xs.append(lo_t + (b + 0.5) * width)
        lows.append(min(vals))
        meds.append(statistics.median(vals))
        highs.append(max(vals))
    return xs, lows, meds, highs


def _plot_telemetry(data: RunData, path: Path, marks: _Markers) -> Plot:
    series = _card_series(data)
    if not series:
        return _placeholder(path, "card telemetry", "no card telemetry in the metrics")
    measured = [(k, label) for k, label in _TELEMETRY_PANELS
                if any(_finite(c.get(k)) for s in series.values() for _, c in s)]
    missing = [label for k, label in _TELEMETRY_PANELS if (k, label) not in measured]
    sources = sorted({str(c.get("source") or p.source) for p in data.telemetry for c in p.cards
                      if isinstance(c, dict) and (c.get("source") or p.source)})
    footer = (f"not reported by this device{' (' + '/'.join(sources) + ')' if sources else ''}: "
              + ", ".join(missing)) if missing else ""
    if not measured:
        return _placeholder(path, "card telemetry", "no card metric was reported by this device")
    have_time = any(_finite(t) and t > 0 for s in series.values() for t, _ in s)
    t0 = min((t for s in series.values() for t, _ in s if _finite(t) and t > 0), default=0.0)
    all_t = [t - t0 for s in series.values() for t, _ in s if _finite(t) and t > 0]
    lo, hi = min(all_t, default=0.0), max(all_t, default=0.0)
    unit, scale = _time_unit(hi - lo)
    conv = _step_to_time(data, t0) if have_time else None

    def to_x(step: int) -> float | None:
        # only markers inside the sampled time range: the others would stretch the axis
        t = conv(step) if conv is not None else None
        return None if t is None or not lo <= t <= hi else t / scale

    n = len(measured)
    rows, cols = (1, n) if n <= 2 else ((1, 3) if n == 3 else (2, 2))
    fig, axes = _figure(rows, cols, size=(14.0, 4.6 if rows == 1 else 7.6))
    many = len(series) > _MAX_LINES
    for ax, (key, label) in zip(axes.flat, measured):
        if many:
            pts = [((t - t0) / scale, float(c[key])) for s in series.values() for t, c in s
                   if _finite(c.get(key)) and _finite(t)]
            xs, lows, meds, highs = _binned_range(pts)
            _band(ax, xs, lows, highs, f"min..max over {len(series)} cards", "tab:blue")
            _plot(ax, xs, meds, "median card", color="tab:blue", linewidth=1.2)
        else:
            for card, samples in sorted(series.items()):
                xs = [(t - t0) / scale for t, _ in samples] if have_time else list(range(len(samples)))
                _plot(ax, xs, _clean(c.get(key) for _, c in samples), card,
                      linewidth=1.0, marker="." if len(samples) < 50 else None)
        ax.set_ylabel(label)
        ax.set_xlabel(f"{unit} since the first sample" if have_time else "sample")
        if conv is not None:
            marks.draw(ax, to_x)
    title = f"card telemetry ({len(series)} card{'s' if len(series) != 1 else ''}, labelled node/card)"
    return _finish(fig, axes, path, title, marks, footer=footer)


_PLOTTERS: dict[str, tuple[str, Callable[[RunData, Path, _Markers], Plot]]] = {
    "loss.png": ("Loss", _plot_loss),
    "grad_norm.png": ("Gradient norm", _plot_grad_norm),
    "step_time.png": ("Step time", _plot_step_time),
    "throughput.png": ("Throughput", _plot_throughput),
    "telemetry.png": ("Card telemetry", _plot_telemetry),
    "straggler.png": ("Straggler score", _plot_straggler),
    "mfu.png": ("MFU", _plot_mfu),
}
_WIDE_PLOTS = ("telemetry.png",)


def _plot_for_rule(rule: str) -> str:
    """The plot an anomaly's marker is best seen on."""
    r = rule.lower()
    if "grad" in r:
        return "grad_norm"
    if "straggler" in r or "step_time" in r:
        return "straggler" if "straggler" in r else "step_time"
    if "card" in r or "overload" in r or "temp" in r or "power" in r:
        return "telemetry"
    if "throughput" in r or "samples" in r:
        return "throughput"
    if "compute" in r or "mfu" in r or "tflops" in r:
        return "mfu"
    return "loss"


# ------------------------------------------------------------------------------------ text


def _rank_table_rows(data: RunData, only_failed: bool = False) -> tuple[list[str], list[list[Any]]]:
    headers = ["rank", "last step", "loss", "grad norm local", "step ms", "fingerprint", "exit", "host", "pid"]
    all_rows = data.rank_rows()
    picked = [r for r in all_rows if (r["exit_code"] not in (0, None) or r["error"])] if only_failed else all_rows
    with_error = any(r["error"] for r in picked)
    rows = []
    for r in picked:
        row = [r["rank"], r["last_step"], _fmt(r["loss"]), _fmt(r["grad_norm_local"], ".3f"),
               "-" if not _finite(r["step_time_s"]) else f"{r['step_time_s'] * 1000:.0f}",
               (r["fingerprint"] or "-")[:16], _fmt(r["exit_code"]), r["host"] or "-", r["pid"] or "-"]
        if data.multi_attempt:  # the attempt behind each rank's last step
            row.append(_fmt(r["attempt"]))
        if with_error:
            row.append(_first_line(r["error"]) or "-")
        rows.append(row)
    if data.multi_attempt:
        headers.append("attempt")
    if with_error:
        headers.append("error")
    return headers, rows


_ATTEMPT_KEYS = ("attempt", "started", "status", "steps shown", "resumed from", "ended with", "superseded steps")


def _attempt_rows(data: RunData) -> list[tuple[int, list[str]]]:
    """(attempt, row): one row per attempt, from the launcher's record and the metrics."""
    launcher = {a.get("attempt"): a for a in data.summary_attempts if _int(a.get("attempt")) is not None}
    metrics = {a.attempt: a for a in data.attempts}
    rows = []
    for k in sorted(set(launcher) | set(metrics)):
        la, me = launcher.get(k, {}), metrics.get(k)
        steps = "-"
        if me is not None and me.first_step is not None:
            steps = f"{me.first_step} → {me.last_step if me.last_step is not None else '?'}"
        elif _int(la.get("steps_completed")) is not None:
            steps = f"→ {la['steps_completed']}"
        res = la.get("resumed_from")
        resumed = "-"
        if isinstance(res, dict) and res.get("path"):
            resumed = f"{Path(str(res['path'])).name} (step {res.get('step')})"
        f = la.get("failure") if isinstance(la.get("failure"), dict) else None
        ended = ""
        if f:
            ended = (f"rank {f.get('root_cause_rank')} at step {f.get('step')}: " if f.get("root_cause_rank")
                     is not None else "") + _failure_error(f)
        ended = ended or _first_line(la.get("message")) or "-"
        rows.append((k, [str(k), _when(me.started) if me is not None else "-", str(la.get("status") or "-"), steps,
                         resumed, ended, str(me.superseded) if me is not None else "-"]))
    return rows


_ANOMALY_KEYS = ("step", "rule", "rank", "value", "threshold", "action", "message")
_CHECKPOINT_KEYS = ("step", "kind", "metric", "file", "size", "sha256")


def _anomaly_cells(a: dict[str, Any]) -> list[str]:
    out = []
    for k in _ANOMALY_KEYS:
        v = a.get(k)
        out.append(_fmt(v, ".6g") if k in ("value", "threshold") else _fmt(v))
    return out


def _anomaly_rows(data: RunData) -> list[list[str]]:
    return [_anomaly_cells(a) for a in data.anomalies]


def _checkpoint_cells(data: RunData, c: dict[str, Any], short_sha: bool = True) -> list[str]:
    ck = _checkpoint(data, c)
    sha = c.get("sha256")
    sha_text = (sha[:16] if short_sha else sha) if isinstance(sha, str) else "-"
    metric = "-" if ck is None or ck.metric is None else f"{ck.metric_name} {_num(ck.metric)}".strip()
    return [_fmt(c.get("step")), _fmt(c.get("kind")), metric, ck.name if ck else _fmt(c.get("path")),
            _size(ck.size) if ck else "-", sha_text]


def _checkpoint_rows(data: RunData, short_sha: bool = True) -> list[list[str]]:
    return [_checkpoint_cells(data, c, short_sha) for c in data.checkpoints]


def compute_text(comp: dict[str, Any] | None) -> str:
    """summary.json's `compute` in one line: `544 tokens/s, 0.000449 TFLOPS per card, MFU 0.015 of a
    0.0299 TFLOPS peak (preflight); medians over steps`; empty when the ranks reported no tokens."""
    if not isinstance(comp, dict) or comp.get("tokens_per_s") is None and comp.get("tflops_per_card") is None:
        return ""
    parts = []
    if comp.get("tokens_per_s") is not None:
        parts.append(f"{_rate(comp['tokens_per_s'])} tokens/s")
    if comp.get("tflops_per_card") is not None:
        parts.append(f"{comp['tflops_per_card']:.3g} TFLOPS per card")
    source = str(comp.get("peak_source") or "")
    if comp.get("mfu") is not None and comp.get("peak_tflops"):
        parts.append(f"MFU {comp['mfu']:.3g} of a {comp['peak_tflops']:.3g} TFLOPS peak ({source.split(' (')[0]})")
    else:
        parts.append("MFU - (no peak: summary.json compute.peak_source)")
    return ", ".join(parts) + "; medians over steps"


def _headline_rows(h: Headline, data: RunData) -> list[tuple[str, str]]:
    """The headline as (label, text) rows, in the page's order."""
    rows = [("wall time", h.wall_text() + (f"  ({_span(h.started, h.ended)})" if h.started else "")
             + (f"  {h.wall_source}" if h.wall_source else ""))]
    if h.started and not h.wall_s:
        rows[0] = ("started", _when(h.started))
    rows.append(("steps", h.steps_text() + (f"  (epoch {h.epoch})" if h.epoch else "")
                 + (f"  in {_plural(h.attempts, 'attempt')}" if h.attempts > 1 else "")))
    rows.append(("loss (mean)", h.loss_text()))
    rows.append(("throughput", h.throughput_text() if data.metrics_read else "-"))
    comp = compute_text((data.summary or {}).get("compute"))
    if comp:
        rows.append(("compute", comp))
    world = _plural(h.world_size, "rank") + (f" ({h.world_shape})" if h.world_shape else "")
    rows.append(("world", world + ("; " + h.cards_text() if data.metrics_read else "")))
    if h.goodput is not None:
        rows.append(("goodput", goodput_text(h.goodput)))
    if h.best is not None:
        rows.append(("best checkpoint", f"{h.best.describe()}  {_display_path(h.best.file, data.run_dir)}"))
    else:
        rows.append(("best checkpoint", "none saved"))
    if h.latest is not None and (h.best is None or h.latest.file != h.best.file):
        rows.append(("latest checkpoint", f"{h.latest.describe()}  {_display_path(h.latest.file, data.run_dir)}"))
    rows.append(("anomalies", h.anomalies_text()))
    return rows


def _display_path(p: Path, run_dir: Path) -> str:
    try:
        return str(p.relative_to(run_dir))
    except ValueError:
        return str(p)


def final_tables(run: Path | str | RunData) -> str:
    """The run's end-of-run summary as console text: the status and why first, then the
    figures that matter (dates, not epoch numbers), the anomaly timeline, the attempts and
    the ranks. Takes a run directory or what `load_run` read from one."""
    data = run if isinstance(run, RunData) else load_run(run)
    return _final_tables(data)


def _final_tables(data: RunData) -> str:
    h = headline(data)
    head = f"run {h.name}: {h.status} — {h.why}"
    if h.detail:
        head += f"\n  {h.detail}"
    parts = [head]
    width = max(len(k) for k, _ in _headline_rows(h, data))
    parts.append("\n".join(f"  {k:<{width}}  {v}" for k, v in _headline_rows(h, data)))
    if not data.has_steps and data.metrics_read:
        parts.append("no data: metrics.msgpack holds no step packets")
    advice = data.summary.get("advice") if isinstance(data.summary, dict) else None
    if isinstance(advice, list) and advice:
        parts.append("advice\n" + "\n".join(f"  - {a.get('message')}" + (f" (to fix: {a['fix']})" if a.get("fix")
                                                                          and a.get("kind") == "no_monitor" else "")
                                            for a in advice if isinstance(a, dict)))
    if data.anomalies:
        shown = data.anomalies[:_CONSOLE_ANOMALIES]
        more = len(data.anomalies) - len(shown)
        table = tabulate([_anomaly_cells(a) for a in shown], headers=list(_ANOMALY_KEYS), tablefmt="simple",
                         disable_numparse=True)
        parts.append("anomalies (timeline)\n" + table + (f"\n… {more} more in anomalies.json" if more > 0 else ""))
    if data.multi_attempt:
        parts.append("attempts (each step from the newest attempt that ran it)\n"
                     + tabulate([r for _, r in _attempt_rows(data)], headers=list(_ATTEMPT_KEYS), tablefmt="simple",
                                disable_numparse=True))
    if data.checkpoints and len(data.checkpoints) > 1:
        parts.append("checkpoints\n" + tabulate(_checkpoint_rows(data), headers=list(_CHECKPOINT_KEYS),
                                                tablefmt="simple", disable_numparse=True))
    many = data.world_size > _CONSOLE_RANKS
    headers, rows = _rank_table_rows(data, only_failed=many)
    if rows:
        title = f"ranks that failed ({len(rows)} of {data.world_size})" if many else "ranks"
        parts.append(title + "\n" + tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True))
    tot = data.totals()
    pk = tot.get("packets") if isinstance(tot.get("packets"), dict) else {}
    mon = []
    if pk:
        mon.append(f"{pk.get('accepted', 0)} packets accepted, {pk.get('rejected', 0)} rejected"
                   + (f", {pk['dropped']} dropped" if pk.get("dropped") else ""))
    if _finite(tot.get("monitor_wait_s")):
        mon.append(f"ranks blocked on the monitor {tot['monitor_wait_s']:.3f} s in all")
    if tot.get("fingerprints_equal") is not None:
        mon.append("parameters equal on every rank" if tot["fingerprints_equal"] else
                   "PARAMETERS DIFFER between ranks")
    if mon:
        parts.append("monitor: " + "; ".join(mon))
    m = data.metrics
    if m.get("damaged_bytes_skipped") or m.get("thinned_segments"):
        parts.append(f"metrics: {m.get('segments', 0)} segment(s), {m.get('damaged_bytes_skipped', 0)} damaged "
                     f"byte(s) skipped in {m.get('damaged_stretches', 0)} stretch(es), "
                     f"{m.get('thinned_segments', 0)} thinned segment(s)")
    return "\n\n".join(parts)


# ------------------------------------------------------------------------------------ html

_CSS = """
:root { --ok: #2e7d32; --bad: #c62828; --other: #ef6c00; --muted: #5f6368; --line: #dadce0; }
* { box-sizing: border-box; }
body { font-family: system-ui, -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif; margin: 0 auto;
       padding: 16px 28px 48px; max-width: 1500px; color: #202124; line-height: 1.35; }
header.run { margin-bottom: 10px; }
header.run h1 { display: inline; font-size: 1.55em; margin: 0 12px 0 0; vertical-align: middle; }
.status { display: inline-block; padding: 3px 12px; border-radius: 4px; color: #fff; font-weight: 700;
          vertical-align: middle; letter-spacing: .02em; }
.ok { background: var(--ok); } .bad { background: var(--bad); } .other { background: var(--other); }
.why { font-size: 1.15em; margin: 8px 0 4px; }
.detail { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: .92em; margin: 4px 0;
          padding: 4px 10px; border-left: 4px solid var(--bad); background: #fdf1f0; overflow-wrap: anywhere; }
.detail.ok, .detail.other { border-left-color: var(--other); background: #fff6ec; }
.meta { color: var(--muted); font-size: .88em; margin: 4px 0; overflow-wrap: anywhere; }
.tiles { display: grid; grid-template-columns: repeat(auto-fill, minmax(185px, 1fr)); gap: 8px; margin: 12px 0; }
.tile { border: 1px solid var(--line); border-radius: 6px; padding: 7px 10px; background: #fafbfc; min-width: 0; }
.tile.span2 { grid-column: span 2; }
.tile .k { font-size: .72em; text-transform: uppercase; letter-spacing: .05em; color: var(--muted); }
.tile .v { font-size: 1.3em; font-weight: 650; margin: 2px 0; overflow-wrap: anywhere; }
.tile .s { font-size: .8em; color: #3c4043; overflow-wrap: anywhere; }
.tile .none { color: var(--muted); font-weight: 400; }
.lossrow { display: flex; align-items: flex-start; gap: 4px 10px; flex-wrap: wrap; }
.lp .n { font-size: 1em; } .lp .c { font-size: .55em; font-weight: 400; color: var(--muted); }
.lp.best .n { color: #1b5e20; } .lp.nonfinite .n { color: var(--bad); }
.lossrow .arrow { color: var(--muted); font-weight: 400; }
.tile .v.link { font-size: 1em; }
.goodput { border: 2px dashed #8fa3ad; border-radius: 6px; padding: 8px 12px; margin: 8px 0 12px;
           background: #f5f9fb; }
.goodput .k { font-size: .72em; text-transform: uppercase; letter-spacing: .05em; color: var(--muted); }
.goodput .v { font-size: 1.3em; font-weight: 650; }
.goodput .gline .s { margin-left: 8px; color: #3c4043; }
.gbar { display: flex; height: 10px; border-radius: 3px; overflow: hidden; margin: 6px 0 4px; background: #eee; }
.gbar span { display: block; height: 100%; }
.g-prod { background: var(--ok); } .g0 { background: #c62828; } .g1 { background: #ef6c00; }
.g2 { background: #f9a825; } .g3 { background: #8d6e63; } .g-un { background: #cfd8dc; }
ol.badput { list-style: none; padding: 0; margin: 2px 0; font-size: .88em; }
ol.badput li { display: inline-block; margin-right: 14px; }
.g-dot { display: inline-block; width: 9px; height: 9px; border-radius: 2px; margin-right: 4px; }
nav.toc { font-size: .9em; margin: 6px 0 14px; padding: 6px 0; border-top: 1px solid var(--line);
          border-bottom: 1px solid var(--line); }
nav.toc a { margin-right: 16px; color: #1a73e8; text-decoration: none; }
h2 { margin: 26px 0 8px; font-size: 1.25em; border-bottom: 1px solid var(--line); padding-bottom: 3px; }
table { border-collapse: collapse; margin: 6px 0; font-size: .88em; }
th, td { border: 1px solid #d5d7da; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f1f3f4; }
tr:target, tr.hl { background: #fff3c4; }
td.long, code { overflow-wrap: anywhere; }
td.long { min-width: 12em; }
pre { background: #f7f7f7; border: 1px solid #ddd; padding: 10px; overflow-x: auto; font-size: .84em; }
.note { color: #8a4b00; margin: 3px 0; } .empty { color: var(--muted); font-style: italic; }
.notes { border: 1px solid #f0c36d; background: #fff8e1; border-radius: 6px; padding: 4px 12px; margin: 8px 0; }
.plots { display: grid; grid-template-columns: repeat(auto-fit, minmax(min(100%, 560px), 1fr)); gap: 14px; }
figure { margin: 0; min-width: 0; }
figure.wide { grid-column: 1 / -1; }
figcaption { color: var(--muted); font-size: .86em; margin-top: 2px; }
.pimg { position: relative; display: inline-block; max-width: 100%; line-height: 0;
        border: 1px solid #eee; }
.pimg img { display: block; max-width: 100%; height: auto; }
.mk { position: absolute; width: 12px; margin-left: -6px; }
.mk:hover, .mk:focus { background: rgba(198, 40, 40, .16); outline: none; }
.mk.checkpoint:hover { background: rgba(46, 125, 50, .16); }
.mk.attempt:hover { background: rgba(128, 0, 128, .16); }
.missing-plot { color: var(--muted); font-style: italic; border: 1px dashed var(--line); padding: 10px;
                border-radius: 6px; }
a.marker { font-weight: 700; color: var(--bad); text-decoration: none; }
details { margin: 6px 0; } details > summary { cursor: pointer; font-weight: 600; }
.legend-line { font-size: .86em; color: var(--muted); }
"""


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


_LONG_TOKEN = 32
"""A cell holding a word longer than this (hashes, paths) may break anywhere, so a table
never runs past the right edge of a narrow window."""


def _html_cell(value: Any, raw: bool = False) -> str:
    text = str(value)
    cls = ' class="long"' if any(len(tok) > _LONG_TOKEN for tok in text.split()) else ""
    return f"<td{cls}>{text if raw else _e(text)}</td>"


def _html_table(headers: list[str], rows: list[list[Any]], empty: str, row_attrs: list[str] | None = None,
                raw_cols: tuple[int, ...] = ()) -> str:
    """A table; `raw_cols` hold markup already escaped (links)."""
    if not rows:
        return f'<p class="empty">{_e(empty)}</p>'
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = []
    for i, row in enumerate(rows):
        attrs = row_attrs[i] if row_attrs else ""
        cells = "".join(_html_cell(c, raw=j in raw_cols) for j, c in enumerate(row))
        body.append(f"<tr{attrs}>{cells}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _href(target: Path, out_dir: Path) -> str:
    try:
        rel = os.path.relpath(target, out_dir)
    except ValueError:  # another drive (Windows)
        rel = str(target)
    return urllib.parse.quote(Path(rel).as_posix())


def _ckpt_link(ck: Checkpoint, out_dir: Path, ident: str = "") -> str:
    idattr = f' id="{ident}"' if ident else ""
    missing = "" if ck.exists else ' title="not found on this machine (rank 0 writes checkpoints on its host)"'
    return f'<a{idattr} href="{_e(_href(ck.file, out_dir))}"{missing}>{_e(ck.name)}</a>'


def _tile(key: str, value: str, sub: str = "", cls: str = "", ident: str = "", vcls: str = "") -> str:
    idattr = f' id="{ident}"' if ident else ""
    return (f'<div class="tile {cls}"{idattr}><div class="k">{_e(key)}</div> <div class="v {vcls}">{value}</div> '
            + (f'<div class="s">{sub}</div>' if sub else "") + "</div>")


def _loss_tile(h: Headline) -> str:
    def part(p: LossPoint | None, what: str) -> str:
        if p is None:
            return f'<div class="lp"><div class="n none">-</div><div class="c">{what}</div></div>'
        step = f" · step {p.step}" if p.step is not None else ""
        bad = "" if _finite(p.value) else " nonfinite"
        return (f'<div class="lp {what}{bad}" id="loss-{what}"><div class="n">{_e(_num(p.value))}</div> '
                f'<div class="c">{what}{_e(step)}</div></div>')
    if not (h.loss_first or h.loss_best or h.loss_last):
        return _tile("loss (mean over ranks)", '<span class="none">not reported</span>', cls="span2 loss",
                     ident="loss-figures")
    arrow = ' <div class="arrow">→</div> '
    value = ('<div class="lossrow">' + arrow.join([part(h.loss_first, "first"), part(h.loss_best, "best"),
                                                   part(h.loss_last, "last")]) + "</div>")
    sub = ""
    if h.loss_first and h.loss_last and _finite(h.loss_first.value) and _finite(h.loss_last.value) \
            and h.loss_first.value:
        change = 100.0 * (h.loss_last.value - h.loss_first.value) / abs(h.loss_first.value)
        sub = f"{change:+.1f}% from first to last"
    elif h.loss_last and not _finite(h.loss_last.value):
        sub = "the last loss is not finite"
    return _tile("loss (mean over ranks)", value, _e(sub), cls="span2 loss", ident="loss-figures")


def _header_html(h: Headline, data: RunData, out_dir: Path) -> list[str]:
    parts = [
        '<header class="run" id="top">',
        f'<h1>{_e(h.name)}</h1><span class="status {h.status_class}" id="status">{_e(h.status)}</span>',
        f'<p class="why" id="why">{_e(h.why[:1].upper() + h.why[1:])}.</p>',
    ]
    if h.detail:
        parts.append(f'<p class="detail {h.status_class}" id="why-detail">{_e(h.detail)}</p>')
    meta = [f"run directory <code>{_e(data.run_dir)}</code>"]
    parts.append(f'<p class="meta">{" · ".join(meta)}</p></header>')

    tiles = []
    wall_sub = _e(_span(h.started, h.ended)) if h.started else ""
    if h.wall_source:
        wall_sub += ("<br>" if wall_sub else "") + _e(h.wall_source)
    tiles.append(_tile("wall time", _e(h.wall_text()), wall_sub, ident="wall-time"))
    steps_sub = []
    if h.epoch:
        steps_sub.append(f"epoch {h.epoch}")
    if h.attempts > 1:
        steps_sub.append(f'<a href="#attempts">{_plural(h.attempts, "attempt")}</a>')
    tiles.append(_tile("steps", _e(h.steps_text()), " · ".join(steps_sub), ident="steps"))
    tiles.append(_loss_tile(h))
    if data.metrics_read:
        thr = (f"{_e(_rate(h.samples_per_s))} samples/s" if h.samples_per_s is not None
               else '<span class="none">not reported</span>')
        thr_sub = (f"{_e(_duration(h.step_time_s))} per step (slowest rank); medians over steps"
                   if h.step_time_s is not None else "")
        tiles.append(_tile("throughput", thr, thr_sub, ident="throughput"))
    world_sub = _e(h.world_shape)
    if data.metrics_read:
        world_sub += ("<br>" if world_sub else "") + _e(h.cards_text(limit=3))
    tiles.append(_tile("world", _e(_plural(h.world_size, "rank")), world_sub, ident="world"))
    if h.best is not None:
        tiles.append(_tile("best checkpoint", _ckpt_link(h.best, out_dir, "best-checkpoint"),
                           _e(h.best.describe()), ident="best", vcls="link"))
    else:
        tiles.append(_tile("best checkpoint", '<span class="none">none saved</span>', ident="best"))
    if h.latest is not None and (h.best is None or h.latest.file != h.best.file):
        tiles.append(_tile("latest checkpoint", _ckpt_link(h.latest, out_dir, "latest-checkpoint"),
                           _e(h.latest.describe() + (f", {h.latest.kind}" if h.latest.kind else "")), ident="latest",
                           vcls="link"))
    elif h.latest is not None:
        tiles.append(_tile("latest checkpoint", '<span class="none">same as the best</span>', ident="latest",
                           vcls="link"))
    anom = (f'<a href="#anomalies">{h.anomalies}</a>' if h.anomalies else '<span class="none">none</span>')
    anom_sub = _e(", ".join(f"{rule} ×{n} ({acts})" for rule, n, acts in h.anomaly_counts[:3])
                  + (f", +{len(h.anomaly_counts) - 3} rules" if len(h.anomaly_counts) > 3 else ""))
    tiles.append(_tile("anomalies", anom, anom_sub, ident="anomaly-count"))
    parts.append('<section class="tiles" id="figures">' + "".join(tiles) + "</section>")
    if h.goodput is not None:
        parts.append(_goodput_html(h.goodput))
    return parts


def _goodput_html(g: dict[str, Any]) -> str:
    """ETTR, a bar of productive time and the badput causes, and the largest causes (summary.json `goodput`)."""
    pct = _ettr_pct(g)
    wall, prod = g.get("wall_s"), g.get("productive_s")
    value = f"ETTR {pct:.1f}%" if pct is not None else "ETTR -"
    sub = (f"productive {_duration(prod)} of {_duration(wall)} wall time" if _finite(prod) and _finite(wall) else "")
    unaccounted = g.get("unaccounted_s") if _finite(g.get("unaccounted_s")) and g["unaccounted_s"] > 0 else None
    if unaccounted is not None:
        sub += f"; {_duration(unaccounted)} unaccounted (between the measured parts of the steps)"
    causes = _badput(g)
    known = _finite(wall) and wall > 0

    def share(v: float) -> str:
        return f"{100 * v / wall:.1f}%" if known else "-"

    bar = ""
    if known and _finite(prod):
        segs = [f'<span class="g-prod" style="width:{100 * prod / wall:.2f}%" title="productive {_e(_duration(prod))}">'
                "</span>"]
        for i, (k, v) in enumerate(causes):
            segs.append(f'<span class="g-bad g{min(i, 3)}" style="width:{100 * v / wall:.2f}%" '
                        f'title="{_e(k)} {_e(_duration(v))} ({share(v)})"></span>')
        if unaccounted is not None:
            segs.append(f'<span class="g-un" style="width:{100 * unaccounted / wall:.2f}%" '
                        f'title="unaccounted {_e(_duration(unaccounted))} ({share(unaccounted)})"></span>')
        bar = '<div class="gbar">' + "".join(segs) + "</div>"
    top = [f'<li><span class="g-dot g{min(i, 3)}"></span><b>{_e(k)}</b> {_e(_duration(v))} ({share(v)})</li>'
           for i, (k, v) in enumerate(causes[:3])]
    if len(causes) > 3:
        rest = sum(v for _, v in causes[3:])
        top.append(f'<li><span class="g-dot g3"></span>{len(causes) - 3} more {_e(_duration(rest))} '
                   f"({share(rest)})</li>")
    listing = ('<ol class="badput"><li class="lead">badput:</li>' + "".join(top) + "</ol>") if top else \
        '<p class="s">no badput recorded</p>'
    table = ""
    if len(causes) > 3:
        table = ("<details><summary>every badput cause</summary>"
                 + _html_table(["badput cause", "time", "of wall time"],
                               [[k, _duration(v), share(v)] for k, v in causes], "-") + "</details>")
    return ('<section class="goodput" id="goodput"><div class="k">goodput (effective training time ratio)</div>'
            f'<div class="gline"><span class="v">{_e(value)}</span> <span class="s">{_e(sub)}</span></div>'
            f"{bar}{listing}{table}</section>")


def _plot_html(p: Plot, title: str, out_dir: Path) -> str:
    wide = " wide" if p.path.name in _WIDE_PLOTS else ""
    if not p.drawn:
        return (f'<figure class="plot{wide}" id="{p.anchor}"><div class="missing-plot">{_e(title)}: '
                f"{_e(p.message)}</div></figure>")
    b64 = base64.b64encode(p.path.read_bytes()).decode("ascii")
    links = "".join(
        f'<a class="mk {lk.kind}" href="{_e(lk.href)}" title="{_e(lk.title)}" aria-label="{_e(lk.title)}" '
        f'style="left:{lk.left:.2f}%;top:{lk.top:.2f}%;height:{lk.height:.2f}%"></a>' for lk in p.links)
    caption = f"{_e(title)} ({_e(p.path.name)})" + (f" — {_e(p.message)}" if p.message else "")
    return (f'<figure class="plot{wide}" id="{p.anchor}"><div class="pimg">'
            f'<img alt="{_e(p.path.stem)}" src="data:image/png;base64,{b64}">{links}</div>'
            f"<figcaption>{caption}</figcaption></figure>")


def _anomaly_html(data: RunData) -> str:
    groups = anomaly_groups(data)
    if not data.anomalies:
        return '<p class="empty">no anomalies recorded</p>'
    label_of = {g.step: g for g in groups}
    headers = ["marker", *_ANOMALY_KEYS]
    rows, attrs = [], []
    seen: set[int] = set()
    for a in data.anomalies[:_MAX_TABLE_ROWS]:
        step = _int(a.get("step"))
        g = label_of.get(step) if step is not None else None
        if g is not None:
            plot = "plot-" + _plot_for_rule(str(a.get("rule") or ""))
            marker = f'<a class="marker" href="#{plot}" title="see the marker on the plot">{_e(g.label)}</a>'
        else:
            marker = "-"
        rows.append([marker, *[_e(c) for c in _anomaly_cells(a)]])
        first = g is not None and step not in seen
        if first:
            seen.add(step)  # type: ignore[arg-type]
        attrs.append(f' id="{g.anchor}"' if first and g is not None else "")
    out = _html_table(headers, rows, "no anomalies recorded", attrs, raw_cols=tuple(range(len(headers))))
    if len(data.anomalies) > _MAX_TABLE_ROWS:
        out += f'<p class="note">… {len(data.anomalies) - _MAX_TABLE_ROWS} more in anomalies.json</p>'
    return out


def _checkpoints_html(data: RunData, h: Headline, out_dir: Path) -> str:
    if not data.checkpoints:
        extra = ""
        if h.best is not None:
            extra = f" (summary.json names the best one: {_ckpt_link(h.best, out_dir)}, {_e(h.best.describe())})"
        return f'<p class="empty">no checkpoints in checkpoints/manifest.json{extra}</p>'
    rows, attrs = [], []
    seen: set[int] = set()
    for c in data.checkpoints:
        cells = [_e(x) for x in _checkpoint_cells(data, c, short_sha=False)]
        ck = _checkpoint(data, c)
        if ck is not None:
            cells[3] = _ckpt_link(ck, out_dir)
        step = _int(c.get("step"))
        first = step is not None and step not in seen
        if first:
            seen.add(step)  # type: ignore[arg-type]
        attrs.append(f' id="ckpt-{step}"' if first else "")
        rows.append(cells)
    return _html_table(list(_CHECKPOINT_KEYS), rows, "no checkpoints", attrs, raw_cols=tuple(range(6)))


def _failure_html(data: RunData) -> list[str]:
    f = (data.summary or {}).get("failure")
    if not isinstance(f, dict):
        return []
    parts = ['<section id="failure"><h2>Failure</h2>']
    rows = [["kind", f.get("kind")], ["root-cause rank", f.get("root_cause_rank")], ["at step", f.get("step")],
            ["exit code", f.get("exit_code")], ["signal", f.get("signal")], ["ranks", f.get("ranks")],
            ["error", _failure_error(f)]]
    body = "".join(f"<tr><th>{_e(k)}</th>{_html_cell(', '.join(map(str, v)) if isinstance(v, list) else _fmt(v))}</tr>"
                   for k, v in rows if v not in (None, "", []))
    parts.append(f'<table class="kv">{body}</table>')
    errs = [e for e in (f.get("errors") or []) if isinstance(e, dict)]
    if len(errs) > 1:
        parts.append(_html_table(["error", "ranks"], [[e.get("error"), ", ".join(map(str, e.get("ranks") or []))]
                                                      for e in errs], "-"))
    root = f.get("root_cause_rank")
    if f.get("traceback"):
        parts.append(f"<details><summary>traceback of rank {_e(root)}</summary><pre>{_e(f['traceback'])}</pre>"
                     "</details>")
    if f.get("log_tail"):
        parts.append(f"<details><summary>last lines of logs/rank_{_e(root)}.log</summary>"
                     f"<pre>{_e(f['log_tail'])}</pre></details>")
    parts.append("</section>")
    return parts


def _render_html(data: RunData, plots: list[Plot], out_dir: Path) -> str:
    h = headline(data)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{_e(h.status)} · {_e(h.name)} · mindpulse report</title>",
        f"<style>{_CSS}</style></head><body>",
    ]
    parts += _header_html(h, data, out_dir)
    nav = [("plots", "Plots"), ("anomalies", f"Anomalies ({len(data.anomalies)})"),
           ("checkpoints", f"Checkpoints ({len(data.checkpoints)})"), ("attempts", f"Attempts ({h.attempts})"),
           ("ranks", "Ranks")]
    if isinstance((data.summary or {}).get("failure"), dict):
        nav.insert(0, ("failure", "Failure"))
    nav.append(("raw", "Raw data"))
    parts.append('<nav class="toc">' + "".join(f'<a href="#{a}">{_e(t)}</a>' for a, t in nav) + "</nav>")

    notes = list(data.notes)
    if not data.has_steps and data.metrics_read:
        notes.insert(0, "No data: metrics.msgpack holds no step packets.")
    if notes:
        parts.append('<div class="notes" id="notes">' + "".join(f'<p class="note">{_e(n)}</p>' for n in notes)
                     + "</div>")

    parts += _failure_html(data)

    parts.append('<section id="plots"><h2>Plots</h2>')
    parts.append(f'<p class="legend-line">Markers: <span style="color:{_ANOMALY_COLOR}">red dashed</span> = anomaly '
                 f'(A1, A2, … as in the <a href="#anomalies">timeline</a>), '
                 f'<span style="color:{_CHECKPOINT_COLOR}">green dashed</span> = checkpoint'
                 + (f', <span style="color:{_ATTEMPT_COLOR}">purple dotted</span> = where a restarted attempt resumed'
                    if data.attempt_starts else "")
                 + "; a gold star marks the best loss. Click a marker for its row.</p>")
    parts.append('<div class="plots">')
    for p in plots:
        parts.append(_plot_html(p, _PLOTTERS.get(p.name, (p.path.stem, None))[0], out_dir))
    parts.append("</div></section>")

    parts.append('<section id="anomalies"><h2>Anomalies</h2>')
    parts.append(_anomaly_html(data))
    parts.append("</section>")

    parts.append('<section id="checkpoints"><h2>Checkpoints</h2>')
    parts.append(_checkpoints_html(data, h, out_dir))
    parts.append("</section>")

    parts.append('<section id="attempts">')
    parts.append("<h2>Attempts</h2>")
    arows = _attempt_rows(data)
    if data.multi_attempt:
        parts.append("<p>The run was restarted (<code>max_restarts</code>): each step is shown from the newest "
                     "attempt that ran it; an attempt's steps from where the next one resumed are superseded.</p>")
        parts.append(_html_table(list(_ATTEMPT_KEYS), [r for _, r in arows], "no attempts",
                                 [f' id="attempt-{k}"' for k, _ in arows]))
    else:
        parts.append('<p class="empty">one attempt, no restarts</p>')
    parts.append("</section>")

    parts.append('<section id="ranks"><h2>Ranks</h2>')
    headers, rows = _rank_table_rows(data)
    parts.append(_html_table(headers, rows, "no ranks reported"))
    parts.append("</section>")

    parts.append('<section id="profiler"><h2>Profiler output</h2>')
    if data.profile_dirs:
        items = []
        for d in data.profile_dirs:
            rel = Path(os.path.relpath(d, out_dir)).as_posix() + "/"
            items.append(f'<li><a href="{_e(urllib.parse.quote(rel))}">{_e(d.name)}</a></li>')
        parts.append("<ul>" + "".join(items) + "</ul>")
    else:
        parts.append('<p class="empty">no profiler output</p>')
    parts.append("</section>")

    parts.append('<section id="raw"><h2>Raw data</h2>')
    if data.summary is not None:
        raw = json.dumps(data.summary, indent=2, sort_keys=False, default=str)
        parts.append(f'<details id="raw-summary"><summary>summary.json</summary><pre>{_e(raw)}</pre></details>')
    else:
        parts.append('<p class="empty">no summary.json</p>')
    if data.config_text is not None:
        parts.append(f'<details id="raw-config"><summary>config.yaml (the resolved config)</summary>'
                     f"<pre>{_e(data.config_text)}</pre></details>")
    else:
        parts.append('<p class="empty">no config.yaml</p>')
    parts.append(f'<details id="raw-console"><summary>the end-of-run summary as the console prints it</summary>'
                 f"<pre>{_e(_final_tables(data))}</pre></details>")
    parts.append("</section>")
    parts.append("</body></html>")
    return "\n".join(parts)


def build_report(run_dir: Path | str, out_dir: Path | str | None = None, data: RunData | None = None) -> dict:
    """Write PNG plots and `report.html` for a run; returns where they are and what they hold.
    `data`: what `load_run(run_dir)` read, when the caller has it already."""
    if data is None:
        data = load_run(run_dir)
    out = Path(out_dir) if out_dir is not None else data.run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    plots: list[Plot] = []
    marks = _Markers(data)
    import matplotlib

    for name in PLOT_NAMES:
        path = out / name
        try:
            with matplotlib.rc_context(_RC):
                plots.append(_PLOTTERS[name][1](data, path, marks))
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
        "plots": [str(p.path) for p in plots],
        "drawn": [p.path.name for p in plots if p.drawn],
        "html": str(html_path),
        "steps": len(data.reduced),
        "world_size": data.world_size,
        "attempts": len(data.attempts) or 1,
        "metrics": data.metrics,
    }


__all__ = ["build_report", "final_tables", "goodput_text", "headline", "load_run", "Headline", "RunData",
           "PLOT_NAMES"]
