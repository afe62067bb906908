"""The rules benchmark's pure parts: a run's anomaly firings read into detection records,
and the statistics of the tables (bench/rules.py runs the launches; tests/unit/test_bench_rules.py
checks this module).

A *firing* is one record of a run's `anomalies.jsonl` (rule, step, rank, message, ...) with
`seen_at`: the wall-clock time the benchmark first saw its line (the record itself carries no
time). An *injection* is one fault: its kind, rank and step, and `at`, the wall-clock time it
acted (the rank's packet of the step before: the fault acts as its step begins).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Injection:
    spec: str
    """As given to `--inject` (`nan_grad@1:37`), or the telemetry fault's words."""
    rank: int
    step: int
    at: float | None
    """Wall-clock time the fault acted (None: the run never reached it)."""


@dataclass
class Detection:
    detected: bool
    by: str | None = None
    """The rule (or the launcher's failure kind) that caught it."""
    step: int | None = None
    steps: int | None = None
    """Firing step minus the fault's step (0: caught at the faulty step itself)."""
    seconds: float | None = None
    """From the fault acting to the firing (or the launcher's decision) being seen."""
    rank: int | None = None
    right_rank: bool | None = None
    message: str | None = None
    early: list[dict[str, Any]] = field(default_factory=list)
    """The same detectors' firings before the fault acted: false alarms inside a fault run."""

    def to_record(self) -> dict[str, Any]:
        return asdict(self)


def detect(firings: Iterable[Mapping[str, Any]], inj: Injection, detectors: Sequence[str]) -> Detection:
    """The first firing of one of `detectors` at or after the fault's step; the detectors'
    firings before it are kept as `early` (they cannot be the fault's)."""
    early: list[dict[str, Any]] = []
    for f in sorted(firings, key=_order):
        if f.get("rule") not in detectors:
            continue
        step = f.get("step")
        if isinstance(step, int) and step < inj.step:
            early.append(dict(f))
            continue
        seen = f.get("seen_at")
        rank = f.get("rank")
        return Detection(True, f["rule"], step, step - inj.step if isinstance(step, int) else None,
                         seen - inj.at if seen is not None and inj.at is not None else None,
                         rank, rank == inj.rank, f.get("message"), early)
    return Detection(False, early=early)


def _order(f: Mapping[str, Any]) -> tuple[float, float]:
    """Firings in the order they were seen (else by step): the first one caught the fault."""
    seen = f.get("seen_at")
    step = f.get("step")
    return (seen if seen is not None else math.inf, step if isinstance(step, (int, float)) else math.inf)


def failure_detection(summary: Mapping[str, Any], inj: Injection, kind: str, decided_at: float | None) -> Detection:
    """A hang or a crash: caught by the launcher (summary.json's `failure`), not by a rule;
    `decided_at` is when the launcher said so (its console line)."""
    f = summary.get("failure") or {}
    if f.get("kind") != kind:
        return Detection(False, message=f"failure: {f.get('kind')!r}, status {summary.get('status')!r}")
    rank = f.get("root_cause_rank")
    seconds = decided_at - inj.at if decided_at is not None and inj.at is not None else None
    return Detection(True, kind, None, None, seconds, rank, rank == inj.rank, (f.get("message") or "")[:300])


def injection_time(step_ts: Mapping[tuple[int, int], float], rank: int, step: int) -> float | None:
    """When a fault of `rank` at `step` acted: the end of that rank's step before (its packet's
    `ts`; step 0's packet is sent at the start), where the fault's `before_step` runs."""
    return step_ts.get((rank, step - 1))


@dataclass(frozen=True)
class Stat:
    n: int
    median: float | None
    max: float | None

    @classmethod
    def of(cls, xs: Iterable[float | None]) -> Stat:
        vals = [float(x) for x in xs if x is not None]
        if not vals:
            return cls(0, None, None)
        return cls(len(vals), statistics.median(vals), max(vals))


def kind_summary(detections: Sequence[Detection]) -> dict[str, Any]:
    """Detection rate, seconds and steps (median, max), right-rank rate of one fault kind."""
    caught = [d for d in detections if d.detected]
    n = len(detections)
    sec, steps = Stat.of(d.seconds for d in caught), Stat.of(d.steps for d in caught)
    return {
        "runs": n, "detected": len(caught), "rate": len(caught) / n if n else None,
        "seconds": asdict(sec), "steps": asdict(steps),
        "right_rank": sum(1 for d in caught if d.right_rank), "right_rank_rate":
            sum(1 for d in caught if d.right_rank) / len(caught) if caught else None,
        "by": sorted({d.by for d in caught if d.by}),
        "early": sum(len(d.early) for d in detections),
    }


def per_thousand(count: int, over: int) -> float | None:
    return 1000.0 * count / over if over else None


def false_alarms(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Healthy runs (`workload`, `rank_steps`, `steps`, `firings`) → firings per 1,000 rank-steps
    and per 1,000 steps, by workload and by rule, over all runs too."""
    by_wl: dict[str, dict[str, Any]] = {}
    total = {"runs": 0, "rank_steps": 0, "steps": 0, "firings": 0, "by_rule": {}}
    for r in runs:
        w = by_wl.setdefault(r["workload"], {"runs": 0, "rank_steps": 0, "steps": 0, "firings": 0, "by_rule": {}})
        for acc in (w, total):
            acc["runs"] += 1
            acc["rank_steps"] += int(r["rank_steps"])
            acc["steps"] += int(r["steps"])
            acc["firings"] += len(r["firings"])
            for f in r["firings"]:
                acc["by_rule"][f["rule"]] = acc["by_rule"].get(f["rule"], 0) + 1
    for acc in (*by_wl.values(), total):
        acc["per_1000_rank_steps"] = per_thousand(acc["firings"], acc["rank_steps"])
        acc["per_1000_steps"] = per_thousand(acc["firings"], acc["steps"])
        acc["by_rule"] = dict(sorted(acc["by_rule"].items()))
    return {"by_workload": by_wl, "total": total}


def step_counts(step_packets: Iterable[tuple[int, int]]) -> tuple[int, int]:
    """(rank-steps, steps) of a run from its step packets' (rank, step): step 0 (the weights
    before any update) is no step; a packet seen twice counts once."""
    pairs = {(r, s) for r, s in step_packets if s > 0}
    return len(pairs), len({s for _, s in pairs})
