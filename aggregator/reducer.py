"""Complete-step reduction: a step is reduced once, when every rank has reported it.

Pure logic (no Ray, no MindSpore) so it is unit-tested directly and reused by the
report and `top` commands that replay `metrics.msgpack`.
"""

from __future__ import annotations

import math
import statistics
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from mindpulse.protocol import StepPacket


@dataclass
class ReducedStep:
    """Cluster-wide view of one optimizer step."""

    step: int
    epoch: int
    world_size: int
    loss_mean: float | None
    loss_min: float | None
    loss_min_rank: int | None
    loss_max: float | None
    loss_max_rank: int | None
    loss_std: float | None
    grad_norm: float | None
    """Global (post-reduction) grad norm; the largest report if ranks disagree."""
    grad_norm_local_max: float | None
    grad_norm_local_max_rank: int | None
    step_time_min: float | None
    step_time_min_rank: int | None
    step_time_max: float | None
    step_time_max_rank: int | None
    samples_per_s: float | None
    """Cluster throughput: all ranks' samples over the slowest rank's step time."""
    lr: float | None
    nan_count: int
    inf_count: int
    nonfinite_ranks: list[int]
    """Ranks whose local loss or local gradients were NaN/Inf (pre-reduction)."""
    fingerprints: dict[int, str] = field(default_factory=dict)
    extra: dict[str, float] = field(default_factory=dict)
    """Means over ranks of the packets' `extra` scalars."""
    ts: float = 0.0
    per_rank: dict[int, StepPacket] = field(default_factory=dict)
    straggler_scores: dict[int, float] = field(default_factory=dict)
    """Per rank, fastest / this rank's effective step time over a window (1.0 best);
    filled by the aggregator's StragglerTracker."""

    def metric(self, name: str) -> float | None:
        """A reduced metric by name, for rules and best-checkpoint choice."""
        aliases = {"loss": "loss_mean", "grad_norm_global": "grad_norm", "throughput": "samples_per_s"}
        key = aliases.get(name, name)
        if key in self.extra:
            return self.extra[key]
        value = getattr(self, key, None)
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    def to_record(self) -> dict:
        """A JSON/msgpack-friendly dict without the per-rank packets."""
        d = {k: v for k, v in self.__dict__.items() if k != "per_rank"}
        d["fingerprints"] = {str(k): v for k, v in self.fingerprints.items()}
        d["straggler_scores"] = {str(k): v for k, v in self.straggler_scores.items()}
        return d


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


def _argext(values: dict[int, float | None], pick) -> tuple[float | None, int | None]:
    """min/max over ranks; a NaN wins (it is what the user must see)."""
    items = [(r, v) for r, v in values.items() if v is not None]
    if not items:
        return None, None
    nan = [(r, v) for r, v in items if not math.isfinite(v)]
    if nan:
        r, v = min(nan)
        return v, r
    r, v = pick(items, key=lambda rv: (rv[1], -rv[0] if pick is max else rv[0]))
    return v, r


def reduce_step(step: int, packets: dict[int, StepPacket], world_size: int) -> ReducedStep:
    losses = {r: p.loss for r, p in packets.items()}
    finite_losses = [v for v in losses.values() if _finite(v)]
    if len(finite_losses) == len(packets):
        loss_mean = statistics.fmean(finite_losses)
        loss_std = statistics.pstdev(finite_losses) if len(finite_losses) > 1 else 0.0
    elif any(v is not None for v in losses.values()):
        loss_mean, loss_std = math.nan, math.nan
    else:
        loss_mean, loss_std = None, None
    loss_min, loss_min_rank = _argext(losses, min)
    loss_max, loss_max_rank = _argext(losses, max)
    gl, glr = _argext({r: p.grad_norm_local for r, p in packets.items()}, max)
    globals_ = [p.grad_norm for p in packets.values() if p.grad_norm is not None]
    grad_norm = None
    if globals_:
        grad_norm = math.nan if any(not math.isfinite(g) for g in globals_) else max(globals_)
    times = {r: p.step_time_s for r, p in packets.items()}
    tmin, tmin_r = _argext(times, min)
    tmax, tmax_r = _argext(times, max)
    samples = sum(p.samples for p in packets.values())
    sps = samples / tmax if (tmax and _finite(tmax) and tmax > 0 and samples) else None
    lrs = [p.lr for p in packets.values() if p.lr is not None]
    nonfinite = sorted(
        r
        for r, p in packets.items()
        if p.nan_count or p.inf_count or (p.loss is not None and not math.isfinite(p.loss))
        or (p.grad_norm_local is not None and not math.isfinite(p.grad_norm_local))
    )
    extra_keys = set().union(*(p.extra.keys() for p in packets.values())) if packets else set()
    extra = {}
    for k in sorted(extra_keys):
        vals = [p.extra[k] for p in packets.values() if k in p.extra]
        extra[k] = statistics.fmean(vals) if vals else math.nan
    return ReducedStep(
        step=step,
        epoch=max(p.epoch for p in packets.values()),
        world_size=world_size,
        loss_mean=loss_mean,
        loss_min=loss_min,
        loss_min_rank=loss_min_rank,
        loss_max=loss_max,
        loss_max_rank=loss_max_rank,
        loss_std=loss_std,
        grad_norm=grad_norm,
        grad_norm_local_max=gl,
        grad_norm_local_max_rank=glr,
        step_time_min=tmin,
        step_time_min_rank=tmin_r,
        step_time_max=tmax,
        step_time_max_rank=tmax_r,
        samples_per_s=sps,
        lr=lrs[0] if lrs else None,
        nan_count=sum(p.nan_count for p in packets.values()),
        inf_count=sum(p.inf_count for p in packets.values()),
        nonfinite_ranks=nonfinite,
        fingerprints={r: p.fingerprint for r, p in packets.items() if p.fingerprint is not None},
        extra=extra,
        ts=max(p.ts for p in packets.values()),
        per_rank=dict(sorted(packets.items())),
    )


class StepReducer:
    """Collects step packets and emits each step's reduction once all ranks reported it.

    Bounded: at most `max_pending` incomplete steps are held; older incomplete steps are
    evicted (counted in `evicted_incomplete`) so a lost rank cannot grow memory forever.
    """

    def __init__(self, world_size: int, max_pending: int = 256):
        if world_size <= 0:
            raise ValueError("world_size must be positive")
        self.world_size = world_size
        self.max_pending = max_pending
        self._pending: OrderedDict[int, dict[int, StepPacket]] = OrderedDict()
        self.reduced_through = -1
        """Highest step already reduced (steps at or below it are late or duplicates)."""
        self.last_step_of_rank: dict[int, int] = {}
        self.last_packet_of_rank: dict[int, StepPacket] = {}
        self.duplicates = 0
        self.late = 0
        self.out_of_range = 0
        self.evicted_incomplete = 0
        # a ring of recently reduced steps tells duplicates from late packets
        self._ring: deque[int] = deque()
        self._reduced_recent: set[int] = set()

    def add(self, packet: StepPacket) -> list[ReducedStep]:
        if packet.rank >= self.world_size:
            self.out_of_range += 1
            return []
        r, s = packet.rank, packet.step
        if s <= self.reduced_through and s in self._reduced_recent:
            self.duplicates += 1
            return []
        bucket = self._pending.get(s)
        if bucket is None:
            if s <= self.reduced_through:
                self.late += 1
                return []
            bucket = self._pending[s] = {}
            if len(self._pending) > 1 and s < next(reversed(self._pending)):
                self._pending = OrderedDict(sorted(self._pending.items()))
        if r in bucket:
            self.duplicates += 1
            return []
        bucket[r] = packet
        if s >= self.last_step_of_rank.get(r, -1):
            self.last_step_of_rank[r] = s
            self.last_packet_of_rank[r] = packet
        out: list[ReducedStep] = []
        if len(bucket) == self.world_size:
            del self._pending[s]
            out.append(reduce_step(s, bucket, self.world_size))
            self.reduced_through = max(self.reduced_through, s)
            self._remember(s)
        while len(self._pending) > self.max_pending:
            self._pending.popitem(last=False)
            self.evicted_incomplete += 1
        return out

    def _remember(self, s: int) -> None:
        self._ring.append(s)
        self._reduced_recent.add(s)
        if len(self._ring) > 4096:
            self._reduced_recent.discard(self._ring.popleft())

    def missing_ranks(self, step: int) -> list[int]:
        bucket = self._pending.get(step, {})
        return [r for r in range(self.world_size) if r not in bucket]

    def pending_steps(self) -> list[int]:
        return list(self._pending)


def reduce_all(packets: Iterable[StepPacket], world_size: int) -> list[ReducedStep]:
    red = StepReducer(world_size, max_pending=1 << 30)
    out: list[ReducedStep] = []
    for p in packets:
        out.extend(red.add(p))
    return out


class StragglerTracker:
    """Scores each rank against the fastest over a rolling window (1.0 is the fastest).

    The all-reduce makes every rank's step end at the same moment, so step times cannot
    name a straggler: the fast ranks' step time includes their wait inside the collective.
    The score uses what a rank does *before* the collective, its busy time:
    `data_wait_s` (getting the batch ready) + `compute_s` (forward and backward up to the
    gradient reduction, measured in PYNATIVE mode). Where the compute time cannot be
    measured (GRAPH mode, dataset sinking) the shortest step time of the step stands in
    for everyone's compute (it is the last-arriving rank's, which waited for nobody), so
    the score then sees data-path stragglers only. Median over `window` steps, so one
    slow batch does not make a straggler.
    """

    def __init__(self, window: int = 10, min_steps: int | None = None):
        self.window = max(1, window)
        # half a window before judging: a one-off slow step (a profiler window, a
        # checkpoint write) must not make a straggler
        self.min_steps = max(1, min(min_steps if min_steps is not None else max(3, self.window // 2), self.window))
        self.history: dict[int, deque[float]] = {}

    def update(self, red: ReducedStep) -> dict[int, float]:
        if red.step == 0:
            return {}
        times = [p.step_time_s for p in red.per_rank.values()
                 if p.step_time_s is not None and math.isfinite(p.step_time_s)]
        if not times:
            return {}
        common = min(times)
        for r, p in red.per_rank.items():
            wait = p.data_wait_s if p.data_wait_s is not None and math.isfinite(p.data_wait_s) else 0.0
            comp = p.compute_s if p.compute_s is not None and math.isfinite(p.compute_s) else common
            self.history.setdefault(r, deque(maxlen=self.window)).append(max(0.0, wait) + max(0.0, comp))
        meds = {r: statistics.median(h) for r, h in self.history.items() if len(h) >= self.min_steps}
        if len(meds) < 2:
            return {}
        fastest = min(meds.values())
        scores = {r: (fastest / m if m > 0 else 1.0) for r, m in sorted(meds.items())}
        red.straggler_scores = scores
        return scores


class RunTotals:
    """summary.json's loss and fingerprint totals, accumulated per reduced step (first and
    best finite loss, last reported loss, newest fingerprint per rank): the aggregator keeps
    them live, the offline views rebuild them for a run that has no summary.json."""

    def __init__(self) -> None:
        self.first_loss: float | None = None
        self.last_loss: float | None = None
        self.best_loss: tuple[float, int] | None = None
        self.fingerprints: dict[int, str] = {}

    def add(self, red: ReducedStep) -> None:
        loss = red.loss_mean
        if loss is not None:
            self.last_loss = loss
            if math.isfinite(loss):
                if self.first_loss is None:
                    self.first_loss = loss
                if self.best_loss is None or loss < self.best_loss[0]:
                    self.best_loss = (loss, red.step)
        self.fingerprints.update(red.fingerprints)

    def as_dict(self) -> dict[str, Any]:
        fps = set(self.fingerprints.values())
        return {
            "first_loss": self.first_loss,
            "last_loss": self.last_loss,
            "best_loss": self.best_loss[0] if self.best_loss else None,
            "best_loss_step": self.best_loss[1] if self.best_loss else None,
            "fingerprints_equal": (len(fps) == 1) if fps else None,
        }
