"""Baselines the anomaly rules judge against, and the timing ones kept where the packets are.

A rule that compares a value with its own past (`straggler`, `compute_drop`, `loss_spike`,
`grad_explosion`) fires only once that past is a baseline worth trusting:

- **after a warm-up**: the first steps after a start (graph compiles, cold caches, the first
  collective's connection) and after a restore or a rollback (a step number that goes back) are
  left out; for the timing baselines also the steps that follow an evaluation, a checkpoint
  write or a profiler window (they evict caches and take the host's cores);
- **over a full window**: judging starts only once the window is full, not after a handful
  of steps (a half-full window of 5 steps was what named rank 1 a straggler at step 7 of a
  healthy run);
- **robust**: the median and the MAD (median absolute deviation) of the window, so one slow
  step moves neither;
- **above the noise**: a compute drop must also lie `NOISE_SIGMAS` robust deviations below the
  median, so on a noisy shared host the bar rises with the noise.

Pure logic, no Ray, no MindSpore: node agents (node/relay.py), the aggregator (its flat path
and the loss and gradient rules) and the offline views run the same code, so the report and
`top` score what the live rules scored.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

from mindpulse.common.formatting import general
from mindpulse.registry.metrics import is_rate
from mindpulse.wire.protocol import StepPacket

START_WARMUP_STEPS = 5
"""Steps a timing baseline leaves out after a start, a restore or a rollback (the first
compile, cold caches; nvidia-resiliency-ext's straggler detector also skips 5)."""
PAUSE_WARMUP_STEPS = 2
"""Steps a timing baseline leaves out after an evaluation, a checkpoint write or a profiler
window: the step that carries it and the next one."""
RECENT_STEPS = 3
"""A compute drop is judged on the median of a rank's last 3 steps, not on one step: one
slow step (a page fault, another process's burst) is not a drop."""
NOISE_SIGMAS = 2.0
"""A timing effect counts only beyond this many robust standard deviations of single steps
(1.4826 x MAD) of the baseline: a compute drop's 3-step median must lie that far below its
median (about 3 standard errors of a 3-step median), and a straggler's median busy time that
far above the fastest rank's (its score discounts the fastest rank's noise): what a shared
host's step-time noise does not reach."""
MAD_SIGMA = 1.4826
"""MAD x this estimates a normal distribution's standard deviation."""


def median(xs: Iterable[float]) -> float:
    """`statistics.median`, the same value, without its generality (it runs for every rank
    of the node at every step)."""
    d = sorted(xs)
    n = len(d)
    return d[n // 2] if n % 2 else (d[n // 2 - 1] + d[n // 2]) / 2


def median_mad(xs: Iterable[float]) -> tuple[float, float]:
    """The median of `xs` and their median absolute deviation from it."""
    d = list(xs)
    med = median(d)
    return med, median(abs(x - med) for x in d)


class Phase(str, enum.Enum):
    """Where a baseline stands at a step."""

    WARMING = "warming"
    """A warm-up step: neither judged nor put into the baseline."""
    FILLING = "filling"
    """Not yet a full window: put into the baseline, not judged."""
    JUDGING = "judging"
    """The baseline is established: the step is judged against it (and joins it when normal)."""


class Baseline:
    """One value's rolling baseline: a window of `window` values taken after a warm-up.
    `observe` moves it to a step and says the step's `Phase`; the caller `add`s the values the
    baseline should hold. A restore or a rollback (the step goes back) empties the window and
    warms up again; a pause (evaluation, checkpoint write, profiler window) warms up again
    without emptying it."""

    __slots__ = ("window", "warmup", "values", "warm_left", "last_step")

    def __init__(self, window: int, warmup: int = START_WARMUP_STEPS):
        self.window = max(1, window)
        self.warmup = max(0, warmup)
        self.values: deque[float] = deque(maxlen=self.window)
        self.warm_left = self.warmup
        self.last_step = -1

    def observe(self, step: int, paused: bool = False, pause_warmup: int = PAUSE_WARMUP_STEPS) -> Phase:
        """Move to `step`. `paused`: an evaluation, a checkpoint write or a profiler window
        came before this step."""
        if step <= self.last_step:  # a restore or a rollback: the window is another run's past
            self.values.clear()
            self.warm_left = max(self.warm_left, self.warmup)
        self.last_step = step
        if paused:
            self.warm_left = max(self.warm_left, pause_warmup)
        if self.warm_left > 0:
            self.warm_left -= 1
            return Phase.WARMING
        return Phase.JUDGING if self.established else Phase.FILLING

    @property
    def established(self) -> bool:
        return len(self.values) >= self.window

    def add(self, value: float) -> None:
        self.values.append(value)

    def carry(self, old: Baseline) -> None:
        """Take over `old`'s window and warm-up (a rule changed on the running job keeps its
        baseline: the newest values that fit this window)."""
        self.values.extend(old.values)
        self.warm_left = old.warm_left
        self.last_step = old.last_step

    def stats(self) -> tuple[float, float]:
        """(median, MAD) of the window."""
        return median_mad(self.values)

    def describe(self, what: str = "median") -> str:
        """The baseline in words for a firing's message: its median and MAD over how many steps."""
        med, mad = self.stats()
        return f"{what} {general(med)} (MAD {general(mad)}) over the {len(self.values)} steps before"


def paused(p: StepPacket | Mapping[str, Any]) -> bool:
    """An evaluation, a checkpoint write or a profiler window since the rank's last packet.
    (Runs for every rank of a node twice a step: three plain tests, no generator.)"""
    if isinstance(p, Mapping):
        e, c, f = p.get("eval_s"), p.get("checkpoint_s"), p.get("profile_s")
    else:
        e, c, f = p.eval_s, p.checkpoint_s, p.profile_s
    return _positive(e) or _positive(c) or _positive(f)


def _positive(v: Any) -> bool:
    return isinstance(v, (int, float)) and v > 0


class NodeStragglers:
    """Each rank's busy time (data wait + compute before the collective) over a rolling
    window, on the node that has its packets; the node sends its fastest median and its
    ranks' medians, so the aggregator scores stragglers from one number per node plus the
    ranks that stand out (`mindpulse/reduction/reducer.py`, `straggler_scores`). The offline views and
    the flat path run the same class over every rank at once (one node that holds them all).

    The all-reduce makes every rank's step end at the same moment, so step times cannot name
    a straggler: the fast ranks' step time includes their wait inside the collective. Where
    compute cannot be measured (GRAPH mode, sinking) the shortest step time of the step stands
    in for it (its last rank to arrive waited for nobody), so the score then sees data-path
    stragglers only. A rank is scored only once its baseline is established (a warm-up, then a
    full window: the module docstring), on the median of that window."""

    def __init__(self, window: int, warmup: int = START_WARMUP_STEPS):
        self.window = max(1, window)
        self.warmup = warmup
        self.history: dict[int, Baseline] = {}

    def update(self, step: int, packets: Mapping[int, StepPacket]) -> dict[str, Any] | None:
        """Medians after this step: {"fast": node's fastest median, "fast_mad": that rank's MAD
        (its busy time's noise), "med": [[rank, median]...], "n": steps in each median, "w":
        warm-up steps}."""
        if step == 0:
            return None
        times = [p.step_time_s for p in packets.values() if p.step_time_s is not None and math.isfinite(p.step_time_s)]
        if not times:
            return None
        common = min(times)
        for r, p in packets.items():
            b = self.history.get(r)
            if b is None:
                b = self.history[r] = Baseline(self.window, self.warmup)
            if b.observe(step, paused(p)) is Phase.WARMING:
                continue
            wait = p.data_wait_s if p.data_wait_s is not None and math.isfinite(p.data_wait_s) else 0.0
            comp = p.compute_s if p.compute_s is not None and math.isfinite(p.compute_s) else common
            b.add(max(0.0, wait) + max(0.0, comp))
        meds = sorted(((median(b.values), r) for r, b in self.history.items() if b.established), reverse=True)
        if not meds:
            return None
        fast, fastest = meds[-1]
        return {"fast": fast, "fast_mad": self.history[fastest].stats()[1], "med": [[r, m] for m, r in meds],
                "n": self.window, "w": self.warmup}


FLAG_RATIO = 0.95
"""A rank whose achieved TFLOPS fall below this x its own rolling median (and `NOISE_SIGMAS`
below it) is flagged (the `compute_drop` rule's factor, at most this, decides what fires)."""


class NodeComputeDrops:
    """Each rank's achieved TFLOPS over a rolling window, kept where its packets are: on its
    node (node/relay.py), or in the aggregator on the flat path (no relays, replays). A rank
    is judged only once its baseline is established (a warm-up, then a full window), on the
    median of its last `RECENT_STEPS` steps; only the ranks whose recent level is below
    FLAG_RATIO x their baseline's median, and below it by more than the baseline's noise,
    travel on — [rank, recent TFLOPS, median, MAD, steps in the baseline] — so the
    aggregator's work per step follows the nodes and the flagged ranks, not the world."""

    def __init__(self, window: int, warmup: int = START_WARMUP_STEPS):
        self.window = max(1, window)
        self.warmup = warmup
        self.history: dict[int, Baseline] = {}
        self.recent: dict[int, deque[float]] = {}
        """Each rank's last RECENT_STEPS figures: their median is what is judged."""
        self.pending: dict[int, deque[float]] = {}
        """Each rank's figures not yet in its baseline: a figure joins it only once the steps
        after it showed no drop, so the start of a drop does not lower the bar it is judged by."""
        self.low: dict[int, deque[float]] = {}
        """Each flagged rank's figures since its drop began: kept out of its baseline until the
        drop lasted a whole window, then its new level."""

    def update(self, step: int, packets: Mapping[int, StepPacket | Any]) -> list[list[Any]]:
        """[[rank, recent TFLOPS, its median, its MAD, steps in its baseline], ...] of the flagged ranks."""
        out: list[list[Any]] = []
        for r in sorted(packets):
            p = packets[r]
            if isinstance(p, StepPacket):
                v, comp = p.tflops, p.compute_s
            else:
                v, comp = (p.get("tflops"), p.get("compute_s")) if isinstance(p, dict) else (None, None)
            # only where the rank's own compute was measured (PYNATIVE): in GRAPH mode, or with
            # dataset sinking, its TFLOPS come from its step time, which the all-reduce makes
            # every rank's (a card that slows slows them all), so they name no card, and on
            # millisecond steps they move with the host's jitter alone
            if step == 0 or not is_rate(v) or comp is None:
                continue
            v = float(v)
            b = self.history.get(r)
            if b is None:
                b = self.history[r] = Baseline(self.window, self.warmup)
            recent = self.recent.setdefault(r, deque(maxlen=RECENT_STEPS))
            pending = self.pending.setdefault(r, deque())
            phase = b.observe(step, paused(p))
            if phase is Phase.WARMING:
                recent.clear()
                pending.clear()
                continue
            recent.append(v)
            pending.append(v)
            if phase is Phase.JUDGING and len(recent) == RECENT_STEPS:
                # the MAD only where the level is below the ratio: the same verdict, and a
                # healthy rank's step costs one sort of its window instead of two
                med = median(b.values)
                level = median(recent)
                mad = (median([abs(x - med) for x in b.values])
                       if med > 0 and level < FLAG_RATIO * med else 0.0)
                if med > 0 and level < FLAG_RATIO * med and level < med - NOISE_SIGMAS * MAD_SIGMA * mad:
                    out.append([int(r), level, float(med), float(mad), len(b.values)])
                    pending.clear()
                    low = self.low.setdefault(r, deque(maxlen=self.window))
                    low.append(v)
                    if len(low) >= self.window:  # a lasting new level: the baseline from now on
                        b.values.clear()
                        b.values.extend(low)
                        del self.low[r]
                    continue
            self.low.pop(r, None)
            while len(pending) >= RECENT_STEPS:
                b.add(pending.popleft())
        return out
