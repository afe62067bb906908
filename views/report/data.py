"""What the report reads from a run directory, and what it derives from it without judging it.

`load_run` reads what a run leaves behind, all but the metrics file optional, and copes with
a crashed run (a torn last record in `metrics.msgpack`, no `summary.json`):

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

Problems met on the way (a missing or damaged file) become `RunData.notes`, shown on the page.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mindpulse.config import RunConfig
from mindpulse.reduction.reducer import ReducedStep
from mindpulse.views.run_reader import (
    CONFIG,
    METRICS,
    SUMMARY,
    AttemptInfo,
    RunReader,
    read_config,
    read_json,
)
from mindpulse.wire.protocol import EventPacket, StepPacket, TelemetryPacket


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


def as_int(x: Any) -> int | None:
    """An integer, or a float that is one; None for anything else (bools included)."""
    if isinstance(x, bool):
        return None
    if isinstance(x, int):
        return x
    if isinstance(x, float) and x.is_integer():
        return int(x)
    return None


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
    data.world_size = cfg.world_size or as_int((data.summary or {}).get("world_size")) or 0


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
                                key=lambda a: as_int(a.get("step")) if as_int(a.get("step")) is not None else 1 << 62)
    elif anomalies is not None:
        data.notes.append("anomalies.json is not a list of records")

    manifest = _read_json(run_dir / "checkpoints" / "manifest.json", data)
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if isinstance(files, list):
        data.checkpoints = sorted((f for f in files if isinstance(f, dict)),
                                  key=lambda f: (as_int(f.get("step")) or 0, str(f.get("path"))))
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


def card_label(node: str, card: Any, index: int, name: Any = None) -> str:
    """`node/card` as the console's card table names a card (the host as its name, e.g. `cpu`)."""
    if card == -1:
        return f"{node}/{name or 'host'}"
    return f"{node}/{index if card is None else card}"


def card_series(data: RunData) -> dict[str, list[tuple[float, dict[str, Any]]]]:
    """Card label → its samples (time, record), in time order."""
    out: dict[str, list[tuple[float, dict[str, Any]]]] = {}
    for pkt in data.telemetry:
        for j, card in enumerate(pkt.cards):
            if isinstance(card, dict):
                out.setdefault(card_label(pkt.node, card.get("card"), j, card.get("name")), []).append((pkt.ts, card))
    return out


def card_kinds(data: RunData) -> str:
    """The kinds of card that reported and their sources: `910B ×8, via npu-smi`."""
    kinds: Counter[str] = Counter()
    seen: set[str] = set()
    sources: set[str] = set()
    for pkt in data.telemetry:
        for j, card in enumerate(pkt.cards):
            if not isinstance(card, dict):
                continue
            label = card_label(pkt.node, card.get("card"), j, card.get("name"))
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
