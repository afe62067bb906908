"""Complete-step reduction: a step is reduced once, when every rank has reported it.

Runs in the aggregator (and in the offline views, which replay `metrics.msgpack` with the
same code). Pure logic: no Ray, no MindSpore. Its inputs are node partials
(mindpulse/reduction/partial.py: one per node, reduced where the packets arrive) or single packets
(a rank without a relay, a replay), which become a partial of their own; `finalize` turns the
partial of every rank of a step into a `ReducedStep`, whose fields the metric registry
(mindpulse/registry/metrics.py) declares.
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict, deque
from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import field
from typing import Any

from mindpulse.reduction.baselines import MAD_SIGMA, NOISE_SIGMAS, START_WARMUP_STEPS, NodeStragglers
from mindpulse.reduction.partial import (
    EXACT_ONE,
    HIST_EDGES,
    NodePartial,
    as_packet,
    kept_packets,
    mean_of,
    merge,
    partial_of,
    pstdev_of,
)
from mindpulse.registry.metrics import DERIVED, Reduce, aliases, kept_extremes, reductions, totals
from mindpulse.wire.protocol import StepPacket


def straggler_scores(inputs: Iterable[dict[str, Any]], threshold: float, every_rank: bool = False,
                     also: Container[int] = ()) -> dict[int, float]:
    """Scores of the ranks below `threshold` — each node's list is read only while it holds
    such ranks — and of the ranks in `also` (a collect step's window), or of every rank.

    A score is the fastest rank's median busy time over all nodes, plus that rank's noise
    (`NOISE_SIGMAS` x 1.4826 x its MAD: the step-to-step jitter a shared host shows), over the
    rank's median, at most 1: a rank slower than the fastest only by what the host's noise
    explains scores 1 (on 4 ms steps a millisecond of scheduling jitter is no straggler)."""
    inputs = [x for x in inputs if x]
    if sum(len(x["med"]) for x in inputs) < 2:
        return {}  # one rank alone is no comparison
    best = min(inputs, key=lambda x: x["fast"])
    fastest = best["fast"] + NOISE_SIGMAS * MAD_SIGMA * float(best.get("fast_mad") or 0.0)
    scores: dict[int, float] = {}
    for x in inputs:
        for r, m in x["med"]:  # slowest first
            score = min(1.0, fastest / m) if m > 0 else 1.0
            if score >= threshold and not every_rank:
                if not also:
                    break
                if r not in also:
                    continue
            scores[int(r)] = score
    return dict(sorted(scores.items()))


class _ReducedStepBase:
    """Cluster-wide view of one optimizer step: the fields below, and one field per reduced
    value of the metric registry (mindpulse/registry/metrics.py, `reduced_fields`)."""

    step: int
    world_size: int
    nonfinite_ranks: list[int]
    fingerprints: dict[int, str]
    param_norms: dict[int, float]
    extra: dict[str, float]
    per_rank: dict[int, StepPacket]
    peak_tflops: float | None
    mfu_mean: float | None
    mfu_min: float | None
    mfu_min_rank: int | None
    mfu_max: float | None
    mfu_max_rank: int | None
    straggler_scores: dict[int, float]
    compute_flags: list[list[Any]] | None

    def set_peak(self, peak: float | None) -> None:
        """MFU from the achieved TFLOPS and the card's peak (None or not positive: no MFU)."""
        self.peak_tflops = peak if peak and peak > 0 else None
        if self.peak_tflops is None:
            self.mfu_mean = self.mfu_min = self.mfu_max = self.mfu_min_rank = self.mfu_max_rank = None
            return

        def mfu(x: float | None) -> float | None:
            return None if x is None else x / peak

        t = self.__dict__
        self.mfu_mean, self.mfu_min, self.mfu_max = mfu(t["tflops_mean"]), mfu(t["tflops_min"]), mfu(t["tflops_max"])
        self.mfu_min_rank, self.mfu_max_rank = t["tflops_min_rank"], t["tflops_max_rank"]

    def metric(self, name: str) -> float | None:
        """A reduced metric by name, for rules and best-checkpoint choice."""
        key = _ALIASES.get(name, name)
        if key in self.extra:
            return self.extra[key]
        value = getattr(self, key, None)
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    def ranks_that_matter(self, straggler_threshold: float) -> set[int]:
        """The ranks whose detail is worth a look every step: the extremes, the non-finite
        ranks, the stragglers."""
        t = self.__dict__
        out = {r for r in (t[name + "_rank"] for name in _EXTREMES) if r is not None}
        out.update(int(x[0]) for x in self.compute_flags or ())
        out.update(self.nonfinite_ranks)
        out.update(r for r, sc in self.straggler_scores.items() if sc < straggler_threshold)
        return out

    def to_record(self) -> dict:
        """A JSON/msgpack-friendly dict without the per-rank packets."""
        d = {k: v for k, v in self.__dict__.items() if k not in ("per_rank", "straggler_inputs", "histograms")}
        d["fingerprints"] = {str(k): v for k, v in self.fingerprints.items()}
        d["straggler_scores"] = {str(k): v for k, v in self.straggler_scores.items()}
        d["param_norms"] = {str(k): v for k, v in self.param_norms.items()}
        d["rank_cards"] = {str(k): v for k, v in self.rank_cards.items()}
        return d


_ALIASES = aliases()
_EXTREMES = kept_extremes()

_FIXED_FIELDS: list[tuple[Any, ...]] = [
    ("step", "int"),
    ("world_size", "int"),
    ("nonfinite_ranks", "list[int]", field(default_factory=list)),
    ("fingerprints", "dict[int, str]", field(default_factory=dict)),
    ("param_norms", "dict[int, float]", field(default_factory=dict)),
    ("extra", "dict[str, float]", field(default_factory=dict)),
    ("per_rank", "dict[int, StepPacket]", field(default_factory=dict)),
    ("ranks_reported", "int", 0),
    ("straggler_scores", "dict[int, float]", field(default_factory=dict)),
    ("histograms", "dict[str, dict[str, Any]]", field(default_factory=dict)),
    ("straggler_inputs", "list[dict[str, Any]]", field(default_factory=list)),
    ("peak_tflops", "float | None", None),
    ("mfu_mean", "float | None", None),
    ("mfu_min", "float | None", None),
    ("mfu_min_rank", "int | None", None),
    ("mfu_max", "float | None", None),
    ("mfu_max_rank", "int | None", None),
    ("rank_cards", "dict[int, str]", field(default_factory=dict)),
    ("compute_flags", "list[list[Any]] | None", None),
]
"""What a reduced step holds beyond the registry's values: the ranks' maps, the kept packets,
the straggler scores, the histograms, the MFU against the card's peak (set by the aggregator,
which knows the card), the flagged ranks' cards and compute drops."""


def _registry_fields() -> list[tuple[str, str, Any]]:
    out: list[tuple[str, str, Any]] = []
    for m, r in reductions():
        if r.internal or r.how is Reduce.HIST:
            continue
        if r.how in (Reduce.SUM, Reduce.COUNT, Reduce.PEAK):
            hint = "float" if m.type is float and r.how is not Reduce.COUNT else "int"
            out.append((r.name, hint, 0.0 if hint == "float" else 0))
        else:
            out.append((r.name, "float | None", None))
        if r.how in (Reduce.MIN, Reduce.MAX):
            out.append((r.name + "_rank", "int | None", None))
        if r.std:
            out.append((r.std, "float | None", None))
    out += [(d.name, "float | None", None) for d in DERIVED]
    return out


ReducedStep = dataclasses.make_dataclass(
    "ReducedStep", _FIXED_FIELDS + _registry_fields(), bases=(_ReducedStepBase,),
    namespace={"__module__": __name__, "__doc__": _ReducedStepBase.__doc__})


def _value(how: Reduce, acc: Any, is_float: bool, n: int) -> tuple[Any, ...]:
    """A reduction's finished value(s) from its accumulator: (value,), (value, rank) for
    MIN/MAX, (mean, std) for MEAN_ALL."""
    if how is Reduce.SUM:
        return (mean_of(acc, 1) if is_float else acc,)
    if how in (Reduce.COUNT, Reduce.PEAK):
        return (acc,)
    if how is Reduce.MEAN:
        return (mean_of(acc[1], acc[0]) if acc[0] else None,)
    if how is Reduce.MEAN_ALL:
        reported, finite, s, q = acc
        if finite == n and n:
            return mean_of(s, n), (pstdev_of(s, q, n) if n > 1 else 0.0)
        return (math.nan, math.nan) if reported else (None, None)
    if how in (Reduce.MIN, Reduce.MAX):
        return (acc[0], acc[1]) if acc is not None else (None, None)
    if how is Reduce.FIRST:
        return (acc[1] if acc else None,)
    if how is Reduce.GLOBAL:
        return ((math.nan if acc[1] else acc[2]) if acc[0] else None,)
    raise ValueError(f"no finished value for {how}")


def finalize(part: NodePartial, world_size: int, keep_all: bool = False) -> ReducedStep:
    """The `ReducedStep` of a partial holding every rank of the step."""
    n = part.n
    values: dict[str, Any] = {}
    hists: list[tuple[str, list, str, str]] = []
    for m, r in reductions():
        acc = part.values[r.name]
        if r.how is Reduce.HIST:
            ends = [x.name for x in m.reduce if x.how in (Reduce.MIN, Reduce.MAX)]
            hists.append((r.name, acc, *ends))
            continue
        out = _value(r.how, acc, m.type is float, n)
        values[r.name] = out[0]
        if r.how in (Reduce.MIN, Reduce.MAX):
            values[r.name + "_rank"] = out[1]
        elif r.std:
            values[r.std] = out[1]
    for d in DERIVED:
        values[d.name] = d.fn(values)
    histograms = {}
    for name, (counts, s, q), lo, hi in hists:
        h = _histogram(counts, values[lo], values[hi], s, q)
        if h:
            histograms[name] = h
    extra = {}
    for k in sorted(part.extra):
        cnt, total, *bad = part.extra[k]
        extra[k] = sum(bad) if bad else mean_of(total, cnt)
    packets = part.packets if keep_all else kept_packets(part)
    packets = {r: pk for r, pk in ((r, as_packet(p)) for r, p in packets.items()) if pk is not None}
    for r in _INTERNAL:
        values.pop(r, None)
    return ReducedStep(
        step=part.step,
        world_size=world_size,
        nonfinite_ranks=list(part.nonfinite),
        fingerprints={r: fp for fp, rs in part.fingerprints.items() for r in rs},
        param_norms=dict(part.param_norms),
        extra=extra,
        per_rank=dict(sorted(packets.items())),
        ranks_reported=n,
        histograms=histograms,
        straggler_inputs=list(part.stragglers),
        compute_flags=None if part.compute_drops is None else [list(x) for x in part.compute_drops],
        **values,
    )


_INTERNAL = tuple(r.name for _, r in reductions() if r.internal)


def _histogram(counts: list[int], lo: float | None, hi: float | None, total: int, squares: int
               ) -> dict[str, Any] | None:
    num = sum(counts)
    if not num or lo is None or hi is None or not (math.isfinite(lo) and math.isfinite(hi)):
        return None
    # the last bucket's limit is the largest value (TensorBoard needs a finite edge)
    limits = list(HIST_EDGES) + [max(hi, HIST_EDGES[-1])]
    return {"min": lo, "max": hi, "num": num, "sum": mean_of(total, 1), "sum_squares": mean_of(squares, EXACT_ONE),
            "bucket_limits": limits, "bucket_counts": list(counts)}


def reduce_step(step: int, packets: dict[int, StepPacket], world_size: int) -> ReducedStep:
    """The flat reduction: one partial of every rank's packet."""
    return finalize(partial_of(step, packets, keep_all=True), world_size, keep_all=True)


class _Bucket:
    """One pending step: packets of ranks that reported directly, and merged node partials."""

    __slots__ = ("packets", "partial", "nodes", "count")

    def __init__(self) -> None:
        self.packets: dict[int, StepPacket] = {}
        self.partial: NodePartial | None = None
        self.nodes: set[int] = set()
        self.count = 0


class _LastSteps(Mapping[int, int]):
    """Each rank's newest reported step: from its own packets, or its node's partials."""

    def __init__(self, red: StepReducer):
        self._red = red

    def __getitem__(self, rank: int) -> int:
        red = self._red
        node = red.node_last.get(rank // red.ranks_per_node, -1) if red.ranks_per_node else -1
        step = max(red.rank_last.get(rank, -1), node)
        if step < 0:
            raise KeyError(rank)
        return step

    def __iter__(self):
        red = self._red
        ranks = set(red.rank_last)
        if red.ranks_per_node:
            for n in red.node_last:
                ranks.update(range(n * red.ranks_per_node, min((n + 1) * red.ranks_per_node, red.world_size)))
        return iter(sorted(ranks))

    def __len__(self) -> int:
        return sum(1 for _ in self)


class StepReducer:
    """Collects a step's reports and emits its reduction once every rank is in.

    Reports are step packets of single ranks (`add`), or node partials (`add_partial`:
    one per node, reduced by its agent), or a mix (a restarted aggregator replays packets).
    Bounded: at most `max_pending` incomplete steps are held; older incomplete steps are
    evicted (counted in `evicted_incomplete`) so a lost rank cannot grow memory forever.
    """

    def __init__(self, world_size: int, max_pending: int = 256, ranks_per_node: int = 0):
        if world_size <= 0:
            raise ValueError("world_size must be positive")
        self.world_size = world_size
        self.ranks_per_node = ranks_per_node
        self.max_pending = max_pending
        self._pending: OrderedDict[int, _Bucket] = OrderedDict()
        self.reduced_through = -1
        """Highest step already reduced (steps at or below it are late or duplicates)."""
        self.rank_last: dict[int, int] = {}
        self.node_last: dict[int, int] = {}
        self.duplicates = 0
        self.late = 0
        self.out_of_range = 0
        self.evicted_incomplete = 0
        # a ring of recently reduced steps tells duplicates from late packets
        self._ring: deque[int] = deque()
        self._reduced_recent: set[int] = set()

    @property
    def last_step_of_rank(self) -> Mapping[int, int]:
        return _LastSteps(self)

    def _bucket(self, s: int) -> _Bucket | None:
        if s <= self.reduced_through and s in self._reduced_recent:
            self.duplicates += 1
            return None
        bucket = self._pending.get(s)
        if bucket is None:
            if s <= self.reduced_through:
                self.late += 1
                return None
            bucket = self._pending[s] = _Bucket()
            if len(self._pending) > 1 and s < next(reversed(self._pending)):
                self._pending = OrderedDict(sorted(self._pending.items()))
        return bucket

    def add(self, packet: StepPacket) -> list[ReducedStep]:
        if packet.rank >= self.world_size:
            self.out_of_range += 1
            return []
        r, s = packet.rank, packet.step
        bucket = self._bucket(s)
        if bucket is None:
            return []
        if r in bucket.packets or (self.ranks_per_node and r // self.ranks_per_node in bucket.nodes):
            self.duplicates += 1
            return []
        bucket.packets[r] = packet
        bucket.count += 1
        if s >= self.rank_last.get(r, -1):
            self.rank_last[r] = s
        return self._complete(s, bucket)

    def add_partial(self, nodes: int | Sequence[int], part: NodePartial) -> list[ReducedStep]:
        """One node's partial of a step (every rank of the node, reduced on the node), or a
        group's (the partials of several nodes merged by a group leader)."""
        s = part.step
        nodes = [nodes] if isinstance(nodes, int) else list(nodes)
        rpn = self.ranks_per_node
        sizes = [min(rpn, self.world_size - n * rpn) for n in nodes] if rpn else []
        if not rpn or not nodes or len(set(nodes)) != len(nodes) or min(sizes) <= 0 or part.n != sum(sizes):
            self.out_of_range += 1
            return []
        bucket = self._bucket(s)
        if bucket is None:
            return []
        if any(n in bucket.nodes for n in nodes) or any(r // rpn in nodes for r in bucket.packets):
            self.duplicates += 1
            return []
        bucket.nodes.update(nodes)
        bucket.partial = part if bucket.partial is None else merge(bucket.partial, part)
        bucket.count += part.n
        for n in nodes:
            if s >= self.node_last.get(n, -1):
                self.node_last[n] = s
        return self._complete(s, bucket)

    def _complete(self, s: int, bucket: _Bucket) -> list[ReducedStep]:
        out: list[ReducedStep] = []
        if bucket.count == self.world_size:
            del self._pending[s]
            if bucket.partial is None:
                out.append(reduce_step(s, bucket.packets, self.world_size))
            else:
                part = bucket.partial
                if bucket.packets:
                    part = merge(part, partial_of(s, bucket.packets))
                out.append(finalize(part, self.world_size))
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
        bucket = self._pending.get(step) or _Bucket()
        rpn = self.ranks_per_node
        return [r for r in range(self.world_size)
                if r not in bucket.packets and not (rpn and r // rpn in bucket.nodes)]

    def pending_steps(self) -> list[int]:
        return list(self._pending)


def reduce_all(packets: Iterable[StepPacket], world_size: int) -> list[ReducedStep]:
    red = StepReducer(world_size, max_pending=1 << 30)
    out: list[ReducedStep] = []
    for p in packets:
        out.extend(red.add(p))
    return out


class StragglerTracker:
    """Every rank's straggler score where one process sees every rank's packets: the
    aggregator's flat path (ranks without relays) and the offline views. It runs the node
    scorer (`NodeStragglers`, what each node agent runs live) over the same nodes the live
    run had (`ranks_per_node`; 0: one node that holds every rank), and scores them as the
    aggregator scores the nodes' medians (`straggler_scores`), so report, `top` and the live
    rule give the same scores on the same packets."""

    def __init__(self, window: int, ranks_per_node: int = 0, warmup: int = START_WARMUP_STEPS):
        self.window = window
        self.warmup = warmup
        self.ranks_per_node = ranks_per_node
        self.nodes: dict[int, NodeStragglers] = {}

    def update(self, red: ReducedStep) -> dict[int, float]:
        rpn = self.ranks_per_node
        groups: dict[int, dict[int, StepPacket]] = {}
        for r, p in red.per_rank.items():
            groups.setdefault(r // rpn if rpn else 0, {})[r] = p
        inputs = [self.nodes.setdefault(n, NodeStragglers(self.window, self.warmup)).update(red.step, packets)
                  for n, packets in sorted(groups.items())]
        inputs = [x for x in inputs if x]
        scores = straggler_scores(inputs, 1.0, every_rank=True)
        if scores:
            red.straggler_scores = scores
            red.straggler_inputs = inputs  # the baselines the rule's message quotes
        return scores


_TOTALS = totals()


class RunTotals:
    """summary.json's loss and fingerprint totals, accumulated per reduced step (first and
    best finite loss, last reported loss, newest fingerprint per rank): the aggregator keeps
    them live, the offline views rebuild them for a run that has no summary.json."""

    def __init__(self) -> None:
        self.first_loss: float | None = None
        self.last_loss: float | None = None
        self.best_loss: tuple[float, int] | None = None
        self.fingerprints: dict[int, str] = {}
        self.sums: dict[str, float] = {key: 0.0 for key, _ in _TOTALS}
        """The registry's run totals (`Reduction.total`: seconds ranks blocked on the aggregator,
        spent in mindpulse's code...), summed over ranks and steps."""
        self.monitor_errors = 0
        """Errors inside the ranks' monitors (the counts their newest packets carry)."""
        self.last_grad_norm: float | None = None
        """The newest reduced global grad norm (after the all-reduce)."""
        self.loss_scale: dict[str, Any] | None = None
        """The newest loss scale (min, max over ranks, its step), where a loss-scale cell runs."""
        self.overflow_steps = 0
        self.overflow_per_rank: dict[int, int] = {}
        """Steps skipped for overflow: in all, and per rank (the counts the kept packets carry)."""

    def add(self, red: ReducedStep) -> None:
        for key, name in _TOTALS:
            self.sums[key] += getattr(red, name)
        if red.grad_norm is not None:
            self.last_grad_norm = red.grad_norm
        if red.loss_scale_min is not None:
            self.loss_scale = {"min": red.loss_scale_min, "max": red.loss_scale_max, "step": red.step}
            self.overflow_steps = max(self.overflow_steps, red.overflow_steps)
            for r, p in red.per_rank.items():
                if p.overflow_steps:
                    self.overflow_per_rank[r] = max(self.overflow_per_rank.get(r, 0), p.overflow_steps)
        self.monitor_errors = max(self.monitor_errors, red.monitor_errors)
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
            **self.sums,
            "monitor_errors": self.monitor_errors,
            "last_grad_norm": self.last_grad_norm,
            "loss_scale": self.loss_scale,
            "overflow_steps": ({"total": self.overflow_steps,
                                "per_rank": {str(r): n for r, n in sorted(self.overflow_per_rank.items())}}
                               if self.loss_scale is not None else None),
        }
