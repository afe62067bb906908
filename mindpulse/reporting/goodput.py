"""Goodput: where the wall-clock time of a run went.

The run's wall time (launch to the launcher's exit) is split into productive step time and
badput by cause, across restart attempts and rollbacks. It is read from the reduced
records in `metrics.msgpack` (one per step, never thinned) and the launcher's attempt
records, so `summary.json`, the report and a re-run of the accounting agree.

The job's timeline is the reduced one: a step's interval is the time between the newest
packet of the previous step and the newest of this one (`ts`, taken when each rank ships
it). Within it, in data parallel every rank ends a step at the same all-reduce, so:

- `productive` is the shortest step time over ranks: the rank that arrived last at the
  all-reduce waited for nobody, its step time is the compute the job needed;
- `data_wait`, `monitor_wait`, `checkpoint`, `eval`, `profile` are the longest of each over
  ranks (the slowest one holds everyone back): the batch wait before the step, the time
  blocked on the aggregator, rank 0 writing a checkpoint (the others wait in the next
  all-reduce), the evaluation at the step, starting or stopping MindSpore's profiler
  (`profile.steps`: its stop also writes and analyses the trace);
- what is left of the interval (the monitor's own host work, Python between steps) is
  `unaccounted_s`, reported apart: productive plus badput is the wall time less it.

Outside the steps: `startup` (launch to the first step's start, pre-flight included),
`restart` (an attempt's last step to the next attempt's first: teardown, restart and
resume), `hang` (a hung attempt's last step to its detection), `teardown` (the last step
to the end). Steps that a later attempt redid (after a restart or a rollback, the steps
past the checkpoint it resumed from) are `recomputed`, whole.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from mindpulse.rundir.metrics_store import ATTEMPT, REDUCED, attempt_of

CAUSES = ("startup", "checkpoint", "eval", "profile", "monitor_wait", "data_wait", "restart", "recomputed", "hang",
          "teardown")
"""The badput causes of `summary.json` `goodput.badput_s`, in this order."""
STEP_CAUSES = ("data_wait", "monitor_wait", "checkpoint", "eval", "profile")
"""The causes measured inside the steps' intervals: each a `StepTimes` attribute and a
`GoodputClock` part."""


def _num(x: Any) -> float:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else 0.0


class StepTimes:
    """One reduced step's share of the timeline."""

    __slots__ = ("step", "ts", "productive", *STEP_CAUSES)

    def __init__(self, rec: dict[str, Any]):
        self.step = int(rec["step"])
        self.ts = _num(rec.get("ts"))
        self.productive = max(0.0, _num(rec.get("step_time_min")))
        self.data_wait = max(0.0, _num(rec.get("data_wait_max")))
        self.monitor_wait = max(0.0, _num(rec.get("monitor_wait_max")))
        self.checkpoint = max(0.0, _num(rec.get("checkpoint_s_max")))
        self.eval = max(0.0, _num(rec.get("eval_s_max")))
        self.profile = max(0.0, _num(rec.get("profile_s_max")))

    @classmethod
    def of(cls, red: Any) -> StepTimes:
        """From a `ReducedStep` (the aggregator's live clock)."""
        return cls({"step": red.step, "ts": red.ts, "step_time_min": red.step_time_min,
                    "data_wait_max": red.data_wait_max, "monitor_wait_max": red.monitor_wait_max,
                    "checkpoint_s_max": red.checkpoint_s_max, "eval_s_max": red.eval_s_max,
                    "profile_s_max": red.profile_s_max})

    def parts(self) -> float:
        total = self.productive
        for cause in STEP_CAUSES:  # added in this order, as ever (the same float to the bit)
            total += getattr(self, cause)
        return total


class GoodputClock:
    """One attempt's timeline, step by step (the aggregator feeds it every reduced step;
    offline, the reduced records do): running totals per part, and the totals at each
    checkpoint step, so a later attempt resuming from one tells which steps were redone
    without keeping every step."""

    PARTS = ("productive", *STEP_CAUSES, "unaccounted", "span")
    RECENT = 64
    """Steps whose totals are kept until a checkpoint event names one of them."""

    def __init__(self) -> None:
        self.first_start: float | None = None
        self.first_step: int | None = None
        self.last_ts: float | None = None
        self.last_step = 0
        self.cum = dict.fromkeys(self.PARTS, 0.0)
        self.at: dict[int, dict[str, float]] = {}
        """Totals through a checkpoint's step (resume points of a later attempt)."""
        self._recent: dict[int, dict[str, float]] = {}

    def add(self, st: StepTimes) -> None:
        if st.step <= self.last_step or st.ts <= 0:
            return  # replayed or out of order: timed once
        if self.first_start is None:
            self.first_start, self.first_step = st.ts - st.parts(), st.step
            self.at[st.step - 1] = dict(self.cum)  # resuming from just before this attempt's first step
            prev = self.first_start
        else:
            prev = self.last_ts if self.last_ts is not None else st.ts
        delta = max(0.0, st.ts - prev)
        known = st.parts()
        scale = delta / known if known > delta and known > 0 else 1.0
        c = self.cum
        c["productive"] += st.productive * scale
        for cause in STEP_CAUSES:
            c[cause] += getattr(st, cause) * scale
        c["unaccounted"] += max(0.0, delta - known)
        c["span"] += delta
        self.last_ts, self.last_step = max(prev, st.ts), st.step
        self._recent[st.step] = dict(c)
        while len(self._recent) > self.RECENT:
            self._recent.pop(next(iter(self._recent)))

    def checkpoint_at(self, step: int) -> None:
        """A checkpoint of `step` was written: a later attempt may resume from it."""
        if step in self._recent:
            self.at[step] = self._recent[step]
        elif step == self.last_step:
            self.at[step] = dict(self.cum)

    def to_dict(self) -> dict[str, Any]:
        return {"first_start": self.first_start, "first_step": self.first_step, "last_ts": self.last_ts,
                "last_step": self.last_step, "cum": dict(self.cum),
                "at": {str(k): dict(v) for k, v in self.at.items()}}


def steps_by_attempt(records: Iterable[dict[str, Any]]) -> dict[int, GoodputClock]:
    """Each attempt's clock, from the reduced records of `metrics.msgpack` (checkpoint
    steps from rank 0's checkpoint events)."""
    clocks: dict[int, GoodputClock] = {}
    attempt = 0
    for rec in records:
        t = rec.get("t")
        if t == ATTEMPT:
            a = attempt_of(rec)
            attempt = a if a is not None else attempt
        elif t == REDUCED and isinstance(rec.get("step"), int) and rec["step"] > 0:
            clocks.setdefault(attempt, GoodputClock()).add(StepTimes(rec))
        elif t == "event" and rec.get("kind") == "checkpoint" and isinstance(rec.get("step"), int):
            clocks.setdefault(attempt, GoodputClock()).checkpoint_at(rec["step"])
    return clocks


def combine(clocks: list[dict[str, Any] | None], started: float, ended: float,
            attempts: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """`summary.json` `goodput`: {wall_s, productive_s, ettr, badput_s: {cause: s},
    unaccounted_s} from each attempt's clock (`GoodputClock.to_dict`, None for an attempt
    that never reduced a step) and the launcher's attempt records (`resumed_from`,
    `failure`, `ended_at`), in order."""
    attempts = attempts or []
    bad = dict.fromkeys(CAUSES, 0.0)
    productive = unaccounted = 0.0
    prev_end = started
    any_step = False
    for k in range(max(len(clocks), len(attempts))):
        clock = clocks[k] if k < len(clocks) else None
        rec = attempts[k] if k < len(attempts) else {}
        if clock and clock.get("first_start") is not None:
            cum = clock["cum"]
            nxt = attempts[k + 1] if k + 1 < len(attempts) else None
            kept = cum
            if nxt is not None:
                redo_after = int((nxt.get("resumed_from") or {}).get("step") or 0)
                if redo_after < clock["last_step"]:
                    at = {int(s): v for s, v in (clock.get("at") or {}).items()}
                    # resumed inside this attempt: its totals at that checkpoint; from before
                    # it (an earlier attempt's checkpoint, the start): none of it was kept
                    kept = at.get(redo_after) or (dict.fromkeys(cum, 0.0) if redo_after < clock["first_step"]
                                                  else at[max(s for s in at if s <= redo_after)])
            bad["recomputed"] += cum["span"] - kept["span"]
            productive += kept["productive"]
            unaccounted += kept["unaccounted"]
            for cause in STEP_CAUSES:
                bad[cause] += kept.get(cause, 0.0)  # (a clock saved before `profile` has none)
            bad["restart" if any_step else "startup"] += max(0.0, clock["first_start"] - prev_end)
            prev_end = max(prev_end, clock["last_ts"])
            any_step = True
        failure = rec.get("failure") or {}
        if failure.get("kind") == "hang" and _num(rec.get("ended_at")) > prev_end:
            bad["hang"] += rec["ended_at"] - prev_end
            prev_end = rec["ended_at"]
    wall = max(0.0, ended - started)
    bad["teardown" if any_step else "startup"] += max(0.0, ended - prev_end)
    return {"wall_s": round(wall, 3), "productive_s": round(productive, 3),
            "ettr": round(productive / wall, 4) if wall > 0 else None,
            "badput_s": {c: round(v, 3) for c, v in bad.items()}, "unaccounted_s": round(unaccounted, 3)}


def goodput(records: Iterable[dict[str, Any]], started: float, ended: float,
            attempts: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """`combine` over the clocks rebuilt from a run's records (offline: a run without its
    aggregator's clocks, a check of them)."""
    clocks = steps_by_attempt(records)
    n = max(list(clocks) + [len(attempts or []) - 1, -1]) + 1
    return combine([clocks[k].to_dict() if k in clocks else None for k in range(n)], started, ended, attempts)


__all__ = ["CAUSES", "STEP_CAUSES", "GoodputClock", "StepTimes", "combine", "goodput", "steps_by_attempt"]
