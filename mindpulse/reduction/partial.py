"""Node partials: one node's part of one step, reduced where its packets arrive.

Runs in node agents (node/relay.py builds them, node/group.py merges a group's) and in the
aggregator (it merges one partial per node, or builds one from packets that came without a
relay, and replays). Pure logic: no Ray, no MindSpore.

Each node agent reduces its ranks' packets of a step into one `NodePartial`: one accumulator
per reduction of the metric registry (mindpulse/registry/metrics.py: counts, exact sums, extremes with
their ranks, histograms), plus what is reduced by hand (non-finite ranks, fingerprint groups,
parameter norms, user `extra` scalars, straggler inputs, compute-drop flags and the few
packets worth keeping whole). The aggregator merges one partial per node, so its work per
step follows the number of nodes, not ranks. Merging is exact and associative: sums are kept
as integers in units of the smallest float (2**-1074), so a merge of node partials finalizes
to exactly what one partial of all the packets does — the flat reduction is that one partial.

On the wire a partial is a msgpack map of its fields (exact sums as signed big-endian bytes).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mindpulse.registry.metrics import STEP_METRICS, Reduce, Reduction, is_rate, kept_extremes, reductions
from mindpulse.wire.protocol import StepPacket

_ONE_BITS = 1074
_ONE = 1 << _ONE_BITS
EXACT_ONE = _ONE
"""An exact float as an integer: x * 2**1074 is an integer for every finite double."""

HIST_EDGES = tuple(10.0 ** (k / 8) for k in range(-32, 33))
"""Upper bucket edges of the per-step histograms over ranks (loss, step time): 1e-4 .. 1e4,
8 buckets a decade; a last bucket takes what is larger. Fixed edges make node histograms
add up exactly."""


# ---- exact sums ------------------------------------------------------------------------------
def exact(x: float) -> int:
    n, d = float(x).as_integer_ratio()
    return n * (_ONE // d)


def exact_sum(values: Iterable[float], squares: bool = False) -> int:
    """`sum(map(exact, values))` (or of `exact(v) ** 2`), the same integer, at a fraction of
    the cost: every finite double is n / 2**k, so the values are summed as small integers
    over their largest 2**k and scaled up once by a shift, instead of one ~1,100-bit
    integer (and its square) per value. This runs for every step of every node."""
    s, q = exact_sums(values, squares)
    return q if squares else s


def exact_sums(values: Iterable[float], squares: bool = True) -> tuple[int, int]:
    """(`exact_sum(values)`, `exact_sum(values, squares=True)`) from one pass over the
    values (the squares only with `squares`; 0 without)."""
    ratios = [float(v).as_integer_ratio() for v in values]
    if not ratios:
        return 0, 0
    top = max(d for _, d in ratios)
    shift = _ONE_BITS - top.bit_length() + 1
    scaled = [n * (top // d) for n, d in ratios]
    return sum(scaled) << shift, (sum(x * x for x in scaled) << (2 * shift)) if squares else 0


def _to_bytes(i: int) -> bytes:
    return i.to_bytes((i.bit_length() + 8) // 8 or 1, "big", signed=True)


def _from_bytes(b: Any) -> int:
    if not isinstance(b, (bytes, bytearray)):
        raise ValueError("an exact sum is not bytes")
    return int.from_bytes(b, "big", signed=True)


def mean_of(total: int, n: int) -> float:
    try:
        return total / (n * _ONE)  # int / int: one correct rounding
    except OverflowError:  # a sum of squares of huge values
        return math.inf if total > 0 else -math.inf


def pstdev_of(total: int, squares: int, n: int) -> float:
    var_num = max(n * squares - total * total, 0)  # n**2 * ONE**2 * variance, exactly
    try:
        return math.isqrt(var_num) / (n * _ONE)  # floor of an exact root: deterministic to the last bit
    except OverflowError:
        return math.inf


# ---- extremes with their ranks -------------------------------------------------------------------
def argext(items: Iterable[tuple[int, float | None]], biggest: bool) -> list | None:
    """[value, rank] of the smallest (or biggest) value, ties to the lowest rank; a NaN/Inf
    wins over every finite value (it is what the user must see), the lowest such rank first."""
    items = [(r, v) for r, v in items if v is not None]
    if not items:
        return None
    if all(map(math.isfinite, [v for _, v in items])):  # the usual step: a tuple compare does it
        if biggest:
            v, neg = max([(v, -r) for r, v in items])
            return [v, -neg]
        v, r = min([(v, r) for r, v in items])
        return [v, r]
    best: tuple[int, float] | None = None
    for r, v in items:
        if best is None:
            best = (r, v)
            continue
        br, bv = best
        bad, bbad = not math.isfinite(v), not math.isfinite(bv)
        if bad or bbad:
            if bad and (not bbad or r < br):
                best = (r, v)
            continue
        if (v > bv if biggest else v < bv) or (v == bv and r < br):
            best = (r, v)
    assert best is not None
    return [best[1], best[0]]


def _merge_ext(a: list | None, b: list | None, biggest: bool) -> list | None:
    return argext([(x[1], x[0]) for x in (a, b) if x is not None], biggest)


def hist_counts(values: Iterable[float | None]) -> list[int]:
    counts = [0] * (len(HIST_EDGES) + 1)
    for v in values:
        if v is not None and math.isfinite(v):
            counts[bisect.bisect_left(HIST_EDGES, v)] += 1
    return counts


rate = is_rate
"""A figure of achieved TFLOPS worth reducing (the registry's test, mindpulse/registry/metrics.py)."""


# ---- one accumulator per kind of reduction ------------------------------------------------------
# Each kind has: `of` (the node's ranks' (rank, value) pairs → accumulator), `merge` (two
# accumulators of disjoint ranks → one, exact and associative), `wire` / `unwire` (msgpack form,
# unwire raising ValueError on anything malformed).
@dataclass(frozen=True)
class _Kind:
    of: Callable[[list[tuple[int, Any]], bool], Any]
    merge: Callable[[Any, Any], Any]
    wire: Callable[[Any, bool], Any] = lambda x, is_float: x
    unwire: Callable[[Any, bool], Any] = lambda x, is_float: x


def _is_count(x: Any) -> bool:
    return type(x) is int and x >= 0


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(what)


def _sum_of(items: list[tuple[int, Any]], is_float: bool) -> int:
    if is_float:
        return exact_sum(v for _, v in items if v and math.isfinite(v))
    return sum(v for _, v in items)


def _sum_unwire(x: Any, is_float: bool) -> int:
    if is_float:
        return _from_bytes(x)
    _check(_is_count(x), "is not a count")
    return x


def _mean_unwire(x: Any, is_float: bool) -> list[int]:
    _check(isinstance(x, list) and len(x) == 2 and _is_count(x[0]), "is not [count, exact sum]")
    return [x[0], _from_bytes(x[1])]


def _mean_all_of(items: list[tuple[int, Any]], is_float: bool) -> list[int]:
    finite = [v for _, v in items if math.isfinite(v)]
    s, q = exact_sums(finite)
    return [len(items), len(finite), s, q]


def _mean_all_unwire(x: Any, is_float: bool) -> list[int]:
    _check(isinstance(x, list) and len(x) == 4 and _is_count(x[0]) and _is_count(x[1]),
           "is not [reported, finite, exact sum, exact squares]")
    return [x[0], x[1], _from_bytes(x[2]), _from_bytes(x[3])]


def _ext_unwire(x: Any, is_float: bool) -> list | None:
    # a value may be Inf or NaN (a broken rank): shown, not refused
    _check(x is None or (isinstance(x, list) and len(x) == 2 and _is_num(x[0]) and _is_count(x[1])),
           "is not [value, rank]")
    return x


def _peak_of(items: list[tuple[int, Any]], is_float: bool) -> Any:
    return max((v for _, v in items if math.isfinite(v)), default=0.0 if is_float else 0)


def _peak_unwire(x: Any, is_float: bool) -> Any:
    _check(_is_num(x) and math.isfinite(x) and (is_float or type(x) is int), "is not a finite number")
    return float(x) if is_float else x


def _first_unwire(x: Any, is_float: bool) -> list | None:
    _check(x is None or (isinstance(x, list) and len(x) == 2 and _is_count(x[0]) and _is_num(x[1])),
           "is not [rank, value]")
    return x


def _global_of(items: list[tuple[int, Any]], is_float: bool) -> list:
    vals = [v for _, v in items]
    return [len(vals), not all(map(math.isfinite, vals)), max((g for g in vals if math.isfinite(g)), default=None)]


def _global_merge(a: list, b: list) -> list:
    return [a[0] + b[0], a[1] or b[1], max((g for g in (a[2], b[2]) if g is not None), default=None)]


def _global_unwire(x: Any, is_float: bool) -> list:
    _check(isinstance(x, list) and len(x) == 3 and _is_count(x[0]) and isinstance(x[1], bool)
           and (x[2] is None or _is_num(x[2])), "is not [reported, any non-finite, largest]")
    return x


def _hist_of(items: list[tuple[int, Any]], is_float: bool) -> list:
    finite = [v for _, v in items if math.isfinite(v)]
    s, q = exact_sums(finite)
    return [hist_counts(finite), s, q]


def _hist_unwire(x: Any, is_float: bool) -> list:
    _check(isinstance(x, list) and len(x) == 3 and isinstance(x[0], list) and len(x[0]) == len(HIST_EDGES) + 1
           and all(_is_count(c) for c in x[0]), "is not a histogram")
    return [x[0], _from_bytes(x[1]), _from_bytes(x[2])]


_KINDS: dict[Reduce, _Kind] = {
    Reduce.SUM: _Kind(_sum_of, lambda a, b: a + b, lambda x, f: _to_bytes(x) if f else x, _sum_unwire),
    Reduce.MEAN: _Kind(lambda items, f: [len(items), exact_sum(v for _, v in items)],
                       lambda a, b: [a[0] + b[0], a[1] + b[1]], lambda x, f: [x[0], _to_bytes(x[1])], _mean_unwire),
    Reduce.MEAN_ALL: _Kind(_mean_all_of, lambda a, b: [x + y for x, y in zip(a, b)],
                           lambda x, f: [x[0], x[1], _to_bytes(x[2]), _to_bytes(x[3])], _mean_all_unwire),
    Reduce.MIN: _Kind(lambda items, f: argext(items, False), lambda a, b: _merge_ext(a, b, False), unwire=_ext_unwire),
    Reduce.MAX: _Kind(lambda items, f: argext(items, True), lambda a, b: _merge_ext(a, b, True), unwire=_ext_unwire),
    Reduce.PEAK: _Kind(_peak_of, max, unwire=_peak_unwire),
    Reduce.COUNT: _Kind(lambda items, f: len(items), lambda a, b: a + b,
                        unwire=lambda x, f: _sum_unwire(x, False)),
    Reduce.FIRST: _Kind(lambda items, f: list(min(items)) if items else None,
                        lambda a, b: min((x for x in (a, b) if x is not None), default=None), unwire=_first_unwire),
    Reduce.GLOBAL: _Kind(_global_of, _global_merge, unwire=_global_unwire),
    Reduce.HIST: _Kind(_hist_of, lambda a, b: [[x + y for x, y in zip(a[0], b[0])], a[1] + b[1], a[2] + b[2]],
                       lambda x, f: [x[0], _to_bytes(x[1]), _to_bytes(x[2])], _hist_unwire),
}


@dataclass(frozen=True)
class _Plan:
    """One registry reduction, ready to run: its packet field, kind, filter."""

    name: str
    field: str
    is_float: bool
    kind: _Kind
    include: Callable[[Any], bool] | None
    rate: bool


def _plans() -> tuple[_Plan, ...]:
    out = []
    for m, r in reductions():
        out.append(_Plan(r.name, m.name, m.type is float, _KINDS[r.how], r.include, r.rate))
    return tuple(out)


_PLANS = _plans()
_EXTREMES = kept_extremes()


# ---- the partial ---------------------------------------------------------------------------------
@dataclass(slots=True)
class NodePartial:
    """One node's (or group's) part of one step: every accumulator a reduced step needs."""

    step: int
    n: int
    """Ranks in it."""
    values: dict[str, Any]
    """One accumulator per registry reduction (mindpulse/registry/metrics.py), by its reduced name; the
    shape of each is its `Reduce` kind's (see `_KINDS`)."""
    nonfinite: list[int] = field(default_factory=list)
    """Ranks with a non-finite loss, or non-finite gradients no loss scale explains."""
    fingerprints: dict[str, list[int]] = field(default_factory=dict)
    """Parameter fingerprint → the ranks that reported it (collect steps)."""
    param_norms: dict[int, float] = field(default_factory=dict)
    extra: dict[str, list] = field(default_factory=dict)
    """User scalar → [count, exact sum of the finite values, the non-finite values...]: a NaN or
    Inf among them makes the mean NaN or Inf, as over the flat list."""
    packets: dict[int, Any] = field(default_factory=dict)
    """The packets kept whole (StepPacket, or the validated wire map it came as)."""
    keep_all: bool = False
    """Every packet kept (the flat reduction)."""
    keep: list[int] = field(default_factory=list)
    """The collect step's ranks, kept whole through `finalize`."""
    stragglers: list[dict[str, Any]] = field(default_factory=list)
    """Each node's straggler medians (`mindpulse/reduction/baselines.py`, `NodeStragglers.update`)."""
    compute_drops: list[list[Any]] | None = None
    """[rank, TFLOPS, its median, its MAD, steps in its baseline] of the nodes' flagged ranks
    (`mindpulse/reduction/baselines.py`, `NodeComputeDrops`); None where no node judged (the aggregator's
    own tracker on the flat path)."""


def nonfinite(p: StepPacket) -> bool:
    """A NaN/Inf loss, or non-finite gradients that a loss scale does not explain. A loss-scale
    cell that reports overflow skipped the update; where its scale is above 1, the scale is what
    overflowed them (fp16's dynamic scaling finds its level that way: the scale comes down,
    `overflow_steps` counts the step), so they are expected. At a scale of 1 (a fixed scale, as
    MindFormers' bf16 and fp32 configs run, or a dynamic one that came all the way down) nothing
    explains them: the gradients themselves are NaN or Inf."""
    if p.loss is not None and not math.isfinite(p.loss):
        return True
    if p.overflow:  # the cell found non-finite gradients (a cell without counts reports only this)
        return not (p.loss_scale is not None and p.loss_scale > 1)
    return bool(p.nan_count or p.inf_count or (p.grad_norm_local is not None and not math.isfinite(p.grad_norm_local)))


def partial_of(step: int, packets: Mapping[int, StepPacket], keep_all: bool = False,
               wires: Mapping[int, dict[str, Any]] | None = None, collect: Iterable[int] = ()) -> NodePartial:
    """The partial of one step from these ranks' packets (one per rank). `keep_all` keeps
    every packet whole (the flat reduction); otherwise the ones worth keeping, and at a
    collect step those of the `collect` ranks (`collect_ranks`), marked to be kept through
    `finalize`. `wires`: the packets' validated wire maps (a node agent has them: they
    travel on as they are)."""
    items = list(packets.items())
    columns: dict[str, list[tuple[int, Any]]] = {}
    values: dict[str, Any] = {}
    for plan in _PLANS:
        if plan.include is None:
            col = columns.get(plan.field)
            if col is None:
                col = columns[plan.field] = [(r, v) for r, p in items if (v := getattr(p, plan.field)) is not None]
        else:
            col = [(r, v) for r, p in items if (v := getattr(p, plan.field)) is not None and plan.include(p)]
        values[plan.name] = plan.kind.of(col, plan.is_float)
    extra: dict[str, list] = {}
    fps: list[tuple[int, str]] = []
    bad, pnorm = [], {}
    for r, p in items:
        if nonfinite(p):
            bad.append(r)
        if p.param_norm is not None:
            pnorm[r] = p.param_norm
        if p.fingerprint is not None:
            fps.append((r, p.fingerprint))
        for k, v in p.extra.items():
            x = extra.setdefault(k, [0, 0])
            x[0] += 1
            if math.isfinite(v):
                x[1] += exact(v)
            else:
                x.append(v)
    fp: dict[str, list[int]] = {}
    for r, f in sorted(fps):
        fp.setdefault(f, []).append(r)
    part = NodePartial(step=step, n=len(items), values=values, nonfinite=sorted(bad), fingerprints=fp,
                       param_norms=pnorm,
                       extra=extra, keep_all=keep_all, keep=sorted(set(collect).intersection(packets)))
    keep = sorted(set(packets) if keep_all else _worth_keeping(part, packets) | set(part.keep))
    part.packets = {r: (wires[r] if wires is not None else packets[r]) for r in keep}
    return part


def as_packet(p: StepPacket | dict[str, Any]) -> StepPacket | None:
    """A kept packet as a StepPacket (a wire map was validated where it was decoded)."""
    if isinstance(p, StepPacket):
        return p
    try:
        return StepPacket(**{k: v for k, v in p.items() if k not in ("v", "t")})
    except TypeError:
        return None


def has_weights(p: StepPacket | dict[str, Any]) -> bool:
    return bool(p.weights if isinstance(p, StepPacket) else p.get("weights"))


def asks_decision(p: StepPacket | dict[str, Any]) -> bool:
    """Rank 0's packet at a checkpoint candidate: the aggregator judges a best checkpoint only
    when it is among the step's packets, so it always travels whole."""
    return bool(p.decision if isinstance(p, StepPacket) else p.get("decision"))


def extreme_ranks(part: NodePartial) -> set[int]:
    """The ranks at the ends that are worth a look (`Reduction.keep`)."""
    v = part.values
    return {x[1] for x in (v.get(name) for name in _EXTREMES) if x is not None}


def _worth_keeping(part: NodePartial, packets: Mapping[int, StepPacket]) -> set[int]:
    """The node's extremes, its non-finite ranks, a packet with weight statistics, and one
    that asks for a decision."""
    keep = extreme_ranks(part)
    keep.update(part.nonfinite)
    keep.update(r for r, p in packets.items() if p.weights or p.decision)
    return keep


def kept_packets(part: NodePartial) -> dict[int, Any]:
    """The packets a partial still needs whole: its extremes (the merged extremes are
    among the parts' kept packets), its non-finite ranks, the collect window (`keep`), the
    weight statistics and a decision's asker; every packet of a flat reduction (`keep_all`)."""
    packets = part.packets
    if part.keep_all:
        return packets
    wanted = extreme_ranks(part)
    wanted.update(part.nonfinite)
    wanted.update(part.keep)
    wanted.update(r for r, p in packets.items() if has_weights(p) or asks_decision(p))
    return {r: packets[r] for r in sorted(wanted) if r in packets}


RANKS_PER_COLLECT = 256
"""Ranks whose every field is kept whole at a collect step (per-rank TensorBoard detail)."""


def collect_ranks(step: int, world_size: int, collect_freq: int) -> range | set[int]:
    """The ranks kept whole at `step`: none off a collect step; every rank up to
    RANKS_PER_COLLECT; beyond that a window that moves on at each collect step, so every
    rank shows up in turn while the work per step stays bounded. A pure function of the
    step, so the node agents (which keep those packets) and the aggregator's sinks (which
    write them) agree without talking, and a restarted aggregator picks up where it was."""
    world = max(world_size, 1)
    if step % max(1, collect_freq):
        return range(0)
    if world <= RANKS_PER_COLLECT:
        return range(world)
    lo = (step // max(1, collect_freq)) * RANKS_PER_COLLECT % world
    if lo + RANKS_PER_COLLECT <= world:
        return range(lo, lo + RANKS_PER_COLLECT)
    return set(range(lo, world)) | set(range(lo + RANKS_PER_COLLECT - world))


# ---- merging node partials ------------------------------------------------------------------------
def merge(a: NodePartial, b: NodePartial) -> NodePartial:
    """Two partials of one step (disjoint ranks) as one; exact and associative."""
    av, bv = a.values, b.values
    extra: dict[str, list] = {}
    for k in a.extra.keys() | b.extra.keys():
        xa, xb = a.extra.get(k, [0, 0]), b.extra.get(k, [0, 0])
        extra[k] = [xa[0] + xb[0], xa[1] + xb[1]] + xa[2:] + xb[2:]
    drops = None if a.compute_drops is None and b.compute_drops is None else \
        (a.compute_drops or []) + (b.compute_drops or [])
    out = NodePartial(
        step=a.step, n=a.n + b.n,
        values={p.name: p.kind.merge(av[p.name], bv[p.name]) for p in _PLANS},
        nonfinite=sorted(a.nonfinite + b.nonfinite),
        fingerprints={k: sorted(a.fingerprints.get(k, []) + b.fingerprints.get(k, []))
                      for k in a.fingerprints.keys() | b.fingerprints.keys()},
        param_norms={**a.param_norms, **b.param_norms},
        extra=extra,
        packets={**a.packets, **b.packets},
        keep_all=a.keep_all and b.keep_all,
        keep=sorted(a.keep + b.keep),
        stragglers=a.stragglers + b.stragglers,
        compute_drops=drops,
    )
    # a node's extremes that are no longer the group's need not travel on: what goes up
    # stays a few packets whatever the number of nodes merged
    out.packets = kept_packets(out)
    return out


# ---- the wire -------------------------------------------------------------------------------------
def to_wire(part: NodePartial) -> dict[str, Any]:
    """msgpack-able: exact sums as bytes, kept packets as their wire maps."""
    return {
        "step": part.step, "n": part.n,
        "values": {p.name: p.kind.wire(part.values[p.name], p.is_float) for p in _PLANS},
        "nonfinite": part.nonfinite,
        "fingerprints": part.fingerprints,
        "param_norms": [[r, v] for r, v in part.param_norms.items()],
        "extra": {k: [v[0], _to_bytes(v[1])] + v[2:] for k, v in part.extra.items()},
        "packets": [p.to_wire() if isinstance(p, StepPacket) else p for p in part.packets.values()],
        "keep_all": part.keep_all, "keep": part.keep,
        "stragglers": part.stragglers,
        "compute_drops": part.compute_drops,
    }


def _ranks(x: Any, what: str) -> list[int]:
    _check(isinstance(x, list) and all(_is_count(r) for r in x), f"partial field {what!r} is not a list of ranks")
    return x


def from_wire(w: dict[str, Any]) -> NodePartial:
    """A partial from its wire map; raises ValueError on anything malformed (naming the field)."""
    _check(isinstance(w, dict), "a partial is not a map")
    for k in ("step", "n"):
        _check(_is_count(w.get(k)), f"partial field {k!r} is not a count")
    raw = w.get("values")
    _check(isinstance(raw, dict), "partial field 'values' is not a map")
    values: dict[str, Any] = {}
    for p in _PLANS:
        if p.name not in raw:  # a metric an older node agent does not know: none of its ranks reported it
            values[p.name] = p.kind.of([], p.is_float)
            continue
        try:
            values[p.name] = v = p.kind.unwire(raw[p.name], p.is_float)
        except (ValueError, TypeError, OverflowError) as exc:
            raise ValueError(f"partial value {p.name!r} {exc}") from None
        if p.rate and isinstance(v, list) and v and not (isinstance(v[0], bool) or rate(v[0])):
            raise ValueError(f"partial value {p.name!r} is not a finite, non-negative rate")
    extra = w.get("extra") or {}
    _check(isinstance(extra, dict), "partial field 'extra' is not a map")
    ex: dict[str, list] = {}
    for k, v in extra.items():
        _check(isinstance(v, list) and len(v) >= 2 and _is_count(v[0]) and all(_is_num(x) for x in v[2:]),
               f"partial extra {k!r} is not [count, exact sum, non-finite values...]")
        ex[str(k)] = [v[0], _from_bytes(v[1])] + [float(x) for x in v[2:]]
    pn = w.get("param_norms") or []
    _check(isinstance(pn, list) and all(isinstance(x, list) and len(x) == 2 and _is_count(x[0]) and _is_num(x[1])
                                        for x in pn), "partial field 'param_norms' is not a list of [rank, norm]")
    fps = w.get("fingerprints") or {}
    _check(isinstance(fps, dict), "partial field 'fingerprints' is not a map")
    drops = w.get("compute_drops")
    _check(drops is None or (isinstance(drops, list) and all(
        isinstance(x, list) and len(x) == 5 and _is_count(x[0]) and _is_count(x[4])
        and all(rate(v) and not isinstance(v, bool) for v in x[1:4]) for x in drops)),
        "partial field 'compute_drops' is not a list of [rank, TFLOPS, median, MAD, steps]")
    strag = w.get("stragglers") or []
    _check(isinstance(strag, list) and all(isinstance(x, dict) for x in strag),
           "partial field 'stragglers' is not a list of node medians")
    packets = w.get("packets") or []
    _check(isinstance(packets, list), "partial field 'packets' is not a list")
    # the kept packets stay wire maps (validated on the node); `as_packet` builds the few a
    # reduced step shows
    return NodePartial(
        step=w["step"], n=w["n"], values=values,
        nonfinite=_ranks(w.get("nonfinite") or [], "nonfinite"),
        fingerprints={str(k): _ranks(v, "fingerprints") for k, v in fps.items()},
        param_norms={int(r): float(v) for r, v in pn},
        extra=ex,
        packets={p["rank"]: p for p in packets
                 if isinstance(p, dict) and isinstance(p.get("rank"), int) and p.get("t") == "step"},
        keep_all=bool(w.get("keep_all")),
        keep=_ranks(w.get("keep") or [], "keep"),
        stragglers=strag,
        compute_drops=None if drops is None else [[x[0], float(x[1]), float(x[2]), float(x[3]), x[4]]
                                                   for x in drops],
    )


def reduction(name: str) -> Reduction:
    """The registry's reduction of this reduced name (KeyError when none)."""
    for _, r in reductions():
        if r.name == name:
            return r
    raise KeyError(name)


STEP_FIELDS = tuple(m.name for m in STEP_METRICS)
