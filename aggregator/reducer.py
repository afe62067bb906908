"""Complete-step reduction: a step is reduced once, when every rank has reported it.

Pure logic (no Ray, no MindSpore) so it is unit-tested directly and reused by the
report and `top` commands that replay `metrics.msgpack`.

**Node partials**: one node's part of one step, reduced where its packets arrive.

Each node agent reduces its ranks' packets of a step into one `partial` (counts, exact
sums, extremes with their ranks, non-finite ranks, fingerprint groups, straggler inputs,
and the few packets worth keeping whole); the aggregator merges one partial per node, so
its work per step follows the number of nodes, not ranks. Merging is exact and
associative: sums are kept as integers in units of the smallest float (2**-1074), so a
merge of node partials finalizes to exactly what one partial of all the packets does —
the flat reduction `reduce_step` is that one partial.

A partial is a plain dict (msgpack-able: exact sums travel as signed big-endian bytes).
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import OrderedDict, deque
from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mindpulse.protocol import StepPacket

_ONE_BITS = 1074
_ONE = 1 << _ONE_BITS
"""An exact float as an integer: x * 2**1074 is an integer for every finite double."""

Partial = dict[str, Any]

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


def _from_bytes(b: bytes) -> int:
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
def _argext(items: Iterable[tuple[int, float | None]], biggest: bool) -> list | None:
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
    return _argext([(x[1], x[0]) for x in (a, b) if x is not None], biggest)


# ---- one node's partial ------------------------------------------------------------------------
def _nonfinite(p: StepPacket) -> bool:
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
               wires: Mapping[int, dict[str, Any]] | None = None, collect: Iterable[int] = ()) -> Partial:
    """The partial of one step from these ranks' packets (one per rank). `keep_all` keeps
    every packet whole (the flat reduction); otherwise the ones worth keeping, and at a
    collect step those of the `collect` ranks (`collect_ranks`), marked to be kept through
    `finalize`. `wires`: the packets' validated wire maps (a node agent has them: they
    travel on as they are)."""
    # one pass over the packets gathers every field (this runs for every step on every
    # node: a pass per figure cost ~2x as much)
    losses, gns, lrs, tfs, sts, gls, nonfinite, pnorm = [], [], [], [], [], [], [], {}
    waits, dws, cks, evs, pfs, fps, epochs, tss, scales = [], [], [], [], [], [], [], [], []
    samples, tok, nan, inf, errors, ovf, ovf_steps = 0, 0, 0, 0, 0, 0, 0
    extra: dict[str, list] = {}
    for r, p in packets.items():
        loss = p.loss
        if loss is not None:
            losses.append((r, loss))
        if p.grad_norm is not None and not (p.overflow and (p.loss_scale or 0) > 1):  # overflowed by the scale
            gns.append(p.grad_norm)
        if p.loss_scale is not None:
            scales.append((r, p.loss_scale))
        if p.overflow:
            ovf += 1
        if p.overflow_steps > ovf_steps:
            ovf_steps = p.overflow_steps
        if p.lr is not None:
            lrs.append((r, p.lr))
        if _rate(p.tflops):
            tfs.append((r, p.tflops))
        sts.append((r, p.step_time_s))
        gls.append((r, p.grad_norm_local))
        if _nonfinite(p):
            nonfinite.append(r)
        if p.param_norm is not None:
            pnorm[r] = p.param_norm
        if p.fingerprint is not None:
            fps.append((r, p.fingerprint))
        waits.append(p.monitor_wait_s)
        if p.data_wait_s is not None:
            dws.append(p.data_wait_s)
        cks.append(p.checkpoint_s)
        evs.append(p.eval_s)
        pfs.append(p.profile_s)
        epochs.append(p.epoch)
        tss.append(p.ts)
        samples += p.samples
        tok += p.tokens
        nan += p.nan_count
        inf += p.inf_count
        errors += p.monitor_errors
        for k, v in p.extra.items():
            # [count, exact sum of the finite values, the non-finite values...]: a NaN or
            # Inf among them makes the mean NaN or Inf, as over the flat list
            x = extra.setdefault(k, [0, 0])
            x[0] += 1
            if math.isfinite(v):
                x[1] += exact(v)
            else:
                x.append(v)
    finite = [v for _, v in losses if math.isfinite(v)]
    st_finite = [v for _, v in sts if v is not None and math.isfinite(v)]
    loss_s, loss_q = exact_sums(finite)
    st_s, st_q = exact_sums(st_finite)
    fp: dict[str, list[int]] = {}
    for r, f in sorted(fps):
        fp.setdefault(f, []).append(r)
    part: Partial = {
        "step": step,
        "n": len(packets),
        "epoch": max(epochs, default=0),
        "ts": max(tss, default=0.0),
        "loss_n": len(losses),
        "loss_f": len(finite),
        "loss_s": loss_s,
        "loss_q": loss_q,
        "loss_min": _argext(losses, False),
        "loss_max": _argext(losses, True),
        "gn_n": len(gns),
        "gn_bad": not all(map(math.isfinite, gns)),
        "gn_max": max((g for g in gns if math.isfinite(g)), default=None),
        "gl_max": _argext(gls, True),
        "st_min": _argext(sts, False),
        "st_max": _argext(sts, True),
        "samples": samples,
        "tok": tok,
        "tf_n": len(tfs),
        "tf_s": exact_sum(v for _, v in tfs),
        "tf_min": _argext(tfs, False),
        "tf_max": _argext(tfs, True),
        "lr": list(min(lrs)) if lrs else None,
        "nan": nan,
        "inf": inf,
        "nonfinite": sorted(nonfinite),
        "fp": fp,
        "pnorm": pnorm,
        "extra": extra,
        # seconds a rank reports: a NaN or Inf (a broken rank) must not make the partial
        # unreadable (its finite figures still count)
        "wait_max": _finite_max(waits),
        "dw_max": _finite_max(dws),
        "ck_max": _finite_max(cks),
        "ev_max": _finite_max(evs),
        "pf_max": _finite_max(pfs),
        "wait_s": exact_sum(w for w in waits if w and math.isfinite(w)),
        "errors": errors,
        "h_loss": _hist(v for _, v in losses),
        "h_st": _hist(v for _, v in sts),
        "st_s": st_s,
        "st_q": st_q,
        "ls_min": _argext(scales, False),
        "ls_max": _argext(scales, True),
        "ovf": ovf,
        "ovf_steps": ovf_steps,
    }
    collect = set(collect).intersection(packets)
    part["all"] = keep_all
    part["keep"] = sorted(collect)
    keep = sorted(set(packets) if keep_all else _worth_keeping(part, packets) | collect)
    part["packets"] = {r: (wires[r] if wires is not None else packets[r]) for r in keep}
    return part


_SECONDS_MAX = ("dw_max", "ck_max", "ev_max", "pf_max")
"""A partial's longest seconds over its ranks (data wait, checkpoint, eval, profiler): merged
by max; absent in a partial from an older node."""


def _finite_max(values: Iterable[float]) -> float:
    return max((v for v in values if math.isfinite(v)), default=0.0)


def _rate(x: float | None) -> bool:
    """A figure of achieved TFLOPS worth reducing: a finite number, not negative."""
    return x is not None and math.isfinite(x) and x >= 0


def _hist(values: Iterable[float | None]) -> list[int]:
    counts = [0] * (len(HIST_EDGES) + 1)
    for v in values:
        if v is not None and math.isfinite(v):
            counts[bisect.bisect_left(HIST_EDGES, v)] += 1
    return counts


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


def _worth_keeping(part: Partial, packets: Mapping[int, StepPacket]) -> set[int]:
    """The node's extremes, its non-finite ranks, and a packet with weight statistics."""
    keep = {x[1] for x in (part["loss_min"], part["loss_max"], part["gl_max"], part["st_min"], part["st_max"],
                           part["tf_min"], part["tf_max"]) if x is not None}
    keep.update(part["nonfinite"])
    keep.update(r for r, p in packets.items() if p.weights)
    return keep


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


def _kept(part: Partial) -> dict[int, Any]:
    """The packets a partial still needs whole: its extremes (the merged extremes are
    among the parts' kept packets), its non-finite ranks, the collect window (`keep`) and
    the weight statistics; every packet of a flat reduction (`all`)."""
    packets = part["packets"]
    if part.get("all"):
        return packets
    wanted = {x[1] for x in (part["loss_min"], part["loss_max"], part["gl_max"], part["st_min"],
                             part["st_max"], part.get("tf_min"), part.get("tf_max")) if x is not None}
    wanted.update(part["nonfinite"])
    wanted.update(part.get("keep", ()))
    wanted.update(r for r, p in packets.items() if has_weights(p))
    return {r: packets[r] for r in sorted(wanted) if r in packets}


# ---- merging node partials ------------------------------------------------------------------------
def merge(a: Partial, b: Partial) -> Partial:
    """Two partials of one step (disjoint ranks) as one; exact and associative."""
    out: Partial = {
        "step": a["step"],
        "n": a["n"] + b["n"],
        "epoch": max(a["epoch"], b["epoch"]),
        "ts": max(a["ts"], b["ts"]),
        "loss_n": a["loss_n"] + b["loss_n"],
        "loss_f": a["loss_f"] + b["loss_f"],
        "loss_s": a["loss_s"] + b["loss_s"],
        "loss_q": a["loss_q"] + b["loss_q"],
        "loss_min": _merge_ext(a["loss_min"], b["loss_min"], False),
        "loss_max": _merge_ext(a["loss_max"], b["loss_max"], True),
        "gn_n": a["gn_n"] + b["gn_n"],
        "gn_bad": a["gn_bad"] or b["gn_bad"],
        "gn_max": max((g for g in (a["gn_max"], b["gn_max"]) if g is not None), default=None),
        "gl_max": _merge_ext(a["gl_max"], b["gl_max"], True),
        "st_min": _merge_ext(a["st_min"], b["st_min"], False),
        "st_max": _merge_ext(a["st_max"], b["st_max"], True),
        "samples": a["samples"] + b["samples"],
        "tok": a.get("tok", 0) + b.get("tok", 0),
        "tf_n": a.get("tf_n", 0) + b.get("tf_n", 0),
        "tf_s": a.get("tf_s", 0) + b.get("tf_s", 0),
        "tf_min": _merge_ext(a.get("tf_min"), b.get("tf_min"), False),
        "tf_max": _merge_ext(a.get("tf_max"), b.get("tf_max"), True),
        "lr": min((x for x in (a["lr"], b["lr"]) if x is not None), default=None),
        "nan": a["nan"] + b["nan"],
        "inf": a["inf"] + b["inf"],
        "nonfinite": sorted(a["nonfinite"] + b["nonfinite"]),
        "fp": {k: sorted(a["fp"].get(k, []) + b["fp"].get(k, [])) for k in a["fp"].keys() | b["fp"].keys()},
        "pnorm": {**a["pnorm"], **b["pnorm"]},
        "extra": {},
        "wait_max": max(a["wait_max"], b["wait_max"]),
        **{k: max(a.get(k, 0.0), b.get(k, 0.0)) for k in _SECONDS_MAX},
        "wait_s": a["wait_s"] + b["wait_s"],
        "errors": a["errors"] + b["errors"],
        "h_loss": [x + y for x, y in zip(a["h_loss"], b["h_loss"])],
        "h_st": [x + y for x, y in zip(a["h_st"], b["h_st"])],
        "st_s": a["st_s"] + b["st_s"],
        "st_q": a["st_q"] + b["st_q"],
        "packets": {**a["packets"], **b["packets"]},
        "all": a["all"] and b["all"],
        "keep": sorted(a.get("keep", []) + b.get("keep", [])),
        "strag": a.get("strag", []) + b.get("strag", []),
        "ls_min": _merge_ext(a.get("ls_min"), b.get("ls_min"), False),
        "ls_max": _merge_ext(a.get("ls_max"), b.get("ls_max"), True),
        "ovf": a.get("ovf", 0) + b.get("ovf", 0),
        "ovf_steps": max(a.get("ovf_steps", 0), b.get("ovf_steps", 0)),
    }
    if "cdrop" in a or "cdrop" in b:  # the nodes' compute-drop flags (NodeComputeDrops)
        out["cdrop"] = a.get("cdrop", []) + b.get("cdrop", [])
    for k in a["extra"].keys() | b["extra"].keys():
        xa, xb = a["extra"].get(k, [0, 0]), b["extra"].get(k, [0, 0])
        out["extra"][k] = [xa[0] + xb[0], xa[1] + xb[1]] + xa[2:] + xb[2:]
    # a node's extremes that are no longer the group's need not travel on: what goes up
    # stays a few packets whatever the number of nodes merged
    out["packets"] = _kept(out)
    return out


_EXACT = ("loss_s", "loss_q", "wait_s", "st_s", "st_q", "tf_s")


# ---- the wire -------------------------------------------------------------------------------------
def to_wire(part: Partial) -> dict[str, Any]:
    """msgpack-able: exact sums as bytes, kept packets as their wire maps."""
    w = dict(part)
    for k in _EXACT:
        w[k] = _to_bytes(part[k])
    w["extra"] = {k: [v[0], _to_bytes(v[1])] + v[2:] for k, v in part["extra"].items()}
    w["packets"] = [p.to_wire() if isinstance(p, StepPacket) else p for p in part["packets"].values()]
    w["fp"] = dict(part["fp"])
    w["pnorm"] = [[r, v] for r, v in part["pnorm"].items()]
    return w


def from_wire(w: dict[str, Any]) -> Partial:
    """Raises ValueError (or PacketError) on anything malformed."""
    w = {"tok": 0, "tf_n": 0, "tf_s": b"\x00", "tf_min": None, "tf_max": None, "ls_min": None, "ls_max": None,
         "ovf": 0, "ovf_steps": 0, **w}  # older nodes send none
    part = dict(w)
    for k in _EXACT:
        if not isinstance(w[k], (bytes, bytearray)):
            raise ValueError(f"partial field {k!r} is not bytes")
        part[k] = _from_bytes(w[k])
    part["extra"] = {str(k): [int(v[0]), _from_bytes(v[1])] + [float(x) for x in v[2:]]
                     for k, v in w["extra"].items()}
    # the kept packets stay wire maps (validated on the node); `as_packet` builds the few
    # a reduced step shows
    part["packets"] = {p["rank"]: p for p in w["packets"]
                       if isinstance(p, dict) and isinstance(p.get("rank"), int) and p.get("t") == "step"}
    part["all"] = bool(w.get("all"))
    keep = w.get("keep") or []
    if not (isinstance(keep, list) and all(isinstance(r, int) and not isinstance(r, bool) for r in keep)):
        raise ValueError("partial field 'keep' is not a list of ranks")
    part["keep"] = keep
    part["pnorm"] = {int(r): float(v) for r, v in w["pnorm"]}
    for k in _SECONDS_MAX:  # older nodes send none
        v = w.get(k, 0.0)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            raise ValueError(f"partial field {k!r} is not a number of seconds")
        part[k] = float(v)
    part["fp"] = {str(k): [int(r) for r in v] for k, v in w["fp"].items()}
    for k in ("h_loss", "h_st"):
        if not (isinstance(w[k], list) and len(w[k]) == len(HIST_EDGES) + 1
                and all(type(c) is int for c in w[k]) and min(w[k]) >= 0):
            raise ValueError(f"partial field {k!r} is not a histogram")
    for k in ("tf_min", "tf_max"):
        x = w[k]
        if x is not None and not (isinstance(x, list) and len(x) == 2 and _rate(x[0]) and not isinstance(x[0], bool)
                                  and type(x[1]) is int and x[1] >= 0):
            raise ValueError(f"partial field {k!r} is not [TFLOPS, rank]")
    for k in ("ls_min", "ls_max"):  # a loss scale may be Inf or NaN (a broken cell): shown, not refused
        x = w[k]
        if x is not None and not (isinstance(x, list) and len(x) == 2 and isinstance(x[0], (int, float))
                                  and not isinstance(x[0], bool) and type(x[1]) is int and x[1] >= 0):
            raise ValueError(f"partial field {k!r} is not [loss scale, rank]")
    if "cdrop" in w:
        cd = w["cdrop"]
        if not (isinstance(cd, list) and all(
                isinstance(x, list) and len(x) == 3 and type(x[0]) is int and x[0] >= 0
                and all(_rate(v) and not isinstance(v, bool) for v in x[1:]) for x in cd)):
            raise ValueError("partial field 'cdrop' is not a list of [rank, TFLOPS, median]")
        part["cdrop"] = [[x[0], float(x[1]), float(x[2])] for x in cd]
    for k in ("step", "n", "epoch", "loss_n", "loss_f", "gn_n", "samples", "nan", "inf", "errors", "tok", "tf_n", "ovf",
              "ovf_steps"):
        if not isinstance(part[k], int) or isinstance(part[k], bool) or part[k] < 0:
            raise ValueError(f"partial field {k!r} is not a count")
    return part


def _median(xs: Iterable[float]) -> float:
    """`statistics.median`, the same value, without its generality (it runs for every rank
    of the node at every step)."""
    d = sorted(xs)
    n = len(d)
    return d[n // 2] if n % 2 else (d[n // 2 - 1] + d[n // 2]) / 2


# ---- stragglers, scored where the packets are ------------------------------------------------------
class NodeStragglers:
    """Each rank's busy time (data wait + compute before the collective) over a rolling
    window, on the node that has its packets; the node sends its fastest median and its
    ranks' medians, so the aggregator scores stragglers from one number per node plus the
    ranks that stand out. Where compute cannot be measured (GRAPH mode, sinking) the node's
    shortest step time of the step stands in for it (its last rank to arrive waited for
    nobody; every rank's step ends at the same all-reduce)."""

    def __init__(self, window: int = 10, min_steps: int | None = None):
        self.window = max(1, window)
        # half a window before judging: a one-off slow step (a profiler window, a
        # checkpoint write) must not make a straggler
        self.min_steps = max(1, min(min_steps if min_steps is not None else max(3, self.window // 2), self.window))
        self.history: dict[int, deque[float]] = {}

    def update(self, step: int, packets: Mapping[int, StepPacket]) -> dict[str, Any] | None:
        """Medians after this step: {"fast": node's fastest median, "med": [[rank, median]...]}."""
        if step == 0:
            return None
        times = [p.step_time_s for p in packets.values() if p.step_time_s is not None and math.isfinite(p.step_time_s)]
        if not times:
            return None
        common = min(times)
        for r, p in packets.items():
            wait = p.data_wait_s if p.data_wait_s is not None and math.isfinite(p.data_wait_s) else 0.0
            comp = p.compute_s if p.compute_s is not None and math.isfinite(p.compute_s) else common
            self.history.setdefault(r, deque(maxlen=self.window)).append(max(0.0, wait) + max(0.0, comp))
        meds = sorted(((_median(h), r) for r, h in self.history.items() if len(h) >= self.min_steps),
                      reverse=True)
        if not meds:
            return None
        return {"fast": meds[-1][0], "med": [[r, m] for m, r in meds]}


# ---- compute drops, judged where the packets are --------------------------------------------------
FLAG_RATIO = 0.95
"""A rank whose achieved TFLOPS fall below this x its own rolling median is flagged (the
`compute_drop` rule's factor, at most this, decides what fires)."""


class NodeComputeDrops:
    """Each rank's achieved TFLOPS over a rolling window, kept where its packets are: on its
    node (node/relay.py), or in the aggregator on the flat path (no relays, replays). Only the
    ranks below FLAG_RATIO x their own median travel on, so the aggregator's work per step
    follows the nodes and the flagged ranks, not the world."""

    def __init__(self, window: int = 20, min_steps: int | None = None):
        self.window = max(1, window)
        # a quarter window of history before judging (at least 3 steps): the first steps
        # compile graphs and warm caches
        self.min_steps = max(1, min(min_steps if min_steps is not None else max(3, self.window // 4), self.window))
        self.history: dict[int, deque[float]] = {}
        self.low: dict[int, deque[float]] = {}
        """Each flagged rank's figures since its drop began: kept out of its baseline (a drop
        must not lower the bar it is judged by) until it lasted a whole window, then its new level."""

    def update(self, step: int, packets: Mapping[int, StepPacket | Any]) -> list[list[Any]]:
        """[[rank, TFLOPS, its median], ...] of the ranks below FLAG_RATIO x their median."""
        out: list[list[Any]] = []
        for r in sorted(packets):
            p = packets[r]
            v = p.tflops if isinstance(p, StepPacket) else (p.get("tflops") if isinstance(p, dict) else None)
            if step == 0 or not _rate(v):
                continue
            v = float(v)
            h = self.history.setdefault(r, deque(maxlen=self.window))
            if len(h) >= self.min_steps:
                med = _median(h)
                if med > 0 and v < FLAG_RATIO * med:
                    out.append([int(r), v, float(med)])
                    low = self.low.setdefault(r, deque(maxlen=self.window))
                    low.append(v)
                    if len(low) >= self.window:  # a lasting new level: the baseline from now on
                        h.clear()
                        h.extend(low)
                        del self.low[r]
                    continue
            self.low.pop(r, None)
            h.append(v)
        return out


def straggler_scores(inputs: Iterable[dict[str, Any]], threshold: float, every_rank: bool = False,
                     also: Container[int] = ()) -> dict[int, float]:
    """Scores (fastest median over all nodes / the rank's median) of the ranks below
    `threshold` — each node's list is read only while it holds such ranks — and of the
    ranks in `also` (a collect step's window), or of every rank."""
    inputs = [x for x in inputs if x]
    if sum(len(x["med"]) for x in inputs) < 2:
        return {}  # one rank alone is no comparison
    fastest = min(x["fast"] for x in inputs)
    scores: dict[int, float] = {}
    for x in inputs:
        for r, m in x["med"]:  # slowest first
            score = fastest / m if m > 0 else 1.0
            if score >= threshold and not every_rank:
                if not also:
                    break
                if r not in also:
                    continue
            scores[int(r)] = score
    return dict(sorted(scores.items()))


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
    param_norms: dict[int, float] = field(default_factory=dict)
    """Each rank's parameter norm, at collect steps (desync with a tolerance)."""
    extra: dict[str, float] = field(default_factory=dict)
    """Means over ranks of the packets' `extra` scalars."""
    ts: float = 0.0
    per_rank: dict[int, StepPacket] = field(default_factory=dict)
    """Every rank's packet (the flat reduction), or those that stand out (merged node
    partials: the extremes, the non-finite ranks, the weight statistics)."""
    ranks_reported: int = 0
    monitor_errors: int = 0
    """Errors inside the ranks' monitors so far, summed over ranks (training went on)."""
    data_wait_max: float = 0.0
    """The longest data wait of the step over ranks (it delays everyone's all-reduce)."""
    checkpoint_s_max: float = 0.0
    """Seconds rank 0 (any rank) wrote checkpoints before this step (everyone waits for it)."""
    eval_s_max: float = 0.0
    """The longest evaluation at this step over ranks."""
    profile_s_max: float = 0.0
    """The longest any rank spent starting or stopping the profiler before this step."""
    monitor_wait_max: float = 0.0
    """The longest any rank blocked on the aggregator before this step (seconds)."""
    monitor_wait_sum: float = 0.0
    """All ranks' blocked seconds before this step, summed."""
    straggler_scores: dict[int, float] = field(default_factory=dict)
    """Per rank, fastest / this rank's effective step time over a window (1.0 best):
    every rank's from the flat StragglerTracker; from node partials, the ranks below the
    threshold (every rank's at collect steps)."""
    histograms: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per-step histograms over ranks (`loss`, `step_time`): TensorBoard's raw histogram
    fields (min, max, num, sum, sum_squares, bucket_limits, bucket_counts)."""
    straggler_inputs: list[dict[str, Any]] = field(default_factory=list)
    """The nodes' straggler medians (merged node partials; see partial.NodeStragglers)."""
    tokens: int = 0
    """Tokens trained in this step, summed over ranks (0: no rank knows its tokens)."""
    tokens_per_s: float | None = None
    """Cluster token throughput: all ranks' tokens over the slowest rank's step time."""
    tflops_mean: float | None = None
    """Achieved model TFLOPS per card, mean over the ranks that reported it."""
    tflops_min: float | None = None
    tflops_min_rank: int | None = None
    tflops_max: float | None = None
    tflops_max_rank: int | None = None
    peak_tflops: float | None = None
    """The card's peak TFLOPS the MFU is measured against (the aggregator's `set_peak`)."""
    mfu_mean: float | None = None
    """Model FLOPs utilisation: achieved / peak TFLOPS (0-1), mean over ranks; None without a peak."""
    mfu_min: float | None = None
    mfu_min_rank: int | None = None
    mfu_max: float | None = None
    mfu_max_rank: int | None = None
    rank_cards: dict[int, str] = field(default_factory=dict)
    """The card of each flagged rank (the aggregator's telemetry), for the compute_drop message."""
    compute_flags: list[list[Any]] | None = None
    """[rank, TFLOPS, its rolling median] of the ranks whose TFLOPS fell below 0.95 x their own
    median (NodeComputeDrops): from the nodes' partials, or the aggregator's own tracker on the
    flat path (None until one of them set it)."""
    loss_scale_min: float | None = None
    """The smallest loss scale over ranks (None: no loss-scale cell runs)."""
    loss_scale_min_rank: int | None = None
    loss_scale_max: float | None = None
    loss_scale_max_rank: int | None = None
    overflow_ranks: int = 0
    """Ranks whose loss-scale cell skipped this step for overflow (the flag is all-reduced in
    data parallel: 0 or every rank). Rule metric `overflow` (`>= 1` for N steps: N in a row)."""
    overflow_steps: int = 0
    """Steps skipped for overflow so far in this attempt (the most any rank counted)."""

    def set_peak(self, peak: float | None) -> None:
        """MFU from the achieved TFLOPS and the card's peak (None or not positive: no MFU)."""
        self.peak_tflops = peak if peak and peak > 0 else None
        if self.peak_tflops is None:
            self.mfu_mean = self.mfu_min = self.mfu_max = self.mfu_min_rank = self.mfu_max_rank = None
            return
        def mfu(x: float | None) -> float | None:
            return None if x is None else x / peak

        self.mfu_mean, self.mfu_min, self.mfu_max = mfu(self.tflops_mean), mfu(self.tflops_min), mfu(self.tflops_max)
        self.mfu_min_rank, self.mfu_max_rank = self.tflops_min_rank, self.tflops_max_rank

    def metric(self, name: str) -> float | None:
        """A reduced metric by name, for rules and best-checkpoint choice."""
        aliases = {"loss": "loss_mean", "grad_norm_global": "grad_norm", "throughput": "samples_per_s",
                   "mfu": "mfu_mean", "tflops": "tflops_mean", "loss_scale": "loss_scale_min",
                   "overflow": "overflow_ranks"}
        key = aliases.get(name, name)
        if key in self.extra:
            return self.extra[key]
        value = getattr(self, key, None)
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    def ranks_that_matter(self, straggler_threshold: float) -> set[int]:
        """The ranks whose detail is worth a look every step: the extremes, the non-finite
        ranks, the stragglers."""
        out = {r for r in (self.loss_min_rank, self.loss_max_rank, self.grad_norm_local_max_rank,
                           self.step_time_min_rank, self.step_time_max_rank, self.tflops_min_rank,
                           self.tflops_max_rank) if r is not None}
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


def finalize(part: Partial, world_size: int, keep_all: bool = False) -> ReducedStep:
    """The `ReducedStep` of a partial holding every rank of the step (see "Node partials" above)."""
    n = part["n"]
    if part["loss_f"] == n and n:
        loss_mean = mean_of(part["loss_s"], n)
        loss_std = pstdev_of(part["loss_s"], part["loss_q"], n) if n > 1 else 0.0
    elif part["loss_n"]:
        loss_mean, loss_std = math.nan, math.nan
    else:
        loss_mean, loss_std = None, None
    grad_norm = None
    if part["gn_n"]:
        grad_norm = math.nan if part["gn_bad"] else part["gn_max"]
    st_max = part["st_max"]
    tmax = st_max[0] if st_max else None
    samples = part["samples"]
    sps = samples / tmax if (tmax and math.isfinite(tmax) and tmax > 0 and samples) else None
    tokens = part.get("tok", 0)
    tps = tokens / tmax if (tmax and math.isfinite(tmax) and tmax > 0 and tokens) else None
    tf_n = part.get("tf_n", 0)
    (tfmin, tfmin_r), (tfmax, tfmax_r) = (tuple(part.get(k) or (None, None)) for k in ("tf_min", "tf_max"))
    extra = {}
    for k in sorted(part["extra"]):
        cnt, total, *bad = part["extra"][k]
        extra[k] = sum(bad) if bad else mean_of(total, cnt)
    packets = part["packets"] if keep_all else _kept(part)
    packets = {r: pk for r, pk in ((r, as_packet(p)) for r, p in packets.items()) if pk is not None}

    def ext(key: str) -> tuple[float | None, int | None]:
        x = part[key]
        return (x[0], x[1]) if x is not None else (None, None)

    (lmin, lmin_r), (lmax, lmax_r), (gl, gl_r) = ext("loss_min"), ext("loss_max"), ext("gl_max")
    (tmin, tmin_r), (_, tmax_r) = ext("st_min"), ext("st_max")
    (lsmin, lsmin_r), (lsmax, lsmax_r) = (tuple(part.get(k) or (None, None)) for k in ("ls_min", "ls_max"))
    return ReducedStep(
        step=part["step"],
        epoch=part["epoch"],
        world_size=world_size,
        loss_mean=loss_mean,
        loss_min=lmin,
        loss_min_rank=lmin_r,
        loss_max=lmax,
        loss_max_rank=lmax_r,
        loss_std=loss_std,
        grad_norm=grad_norm,
        grad_norm_local_max=gl,
        grad_norm_local_max_rank=gl_r,
        step_time_min=tmin,
        step_time_min_rank=tmin_r,
        step_time_max=tmax,
        step_time_max_rank=tmax_r,
        samples_per_s=sps,
        lr=part["lr"][1] if part["lr"] else None,
        nan_count=part["nan"],
        inf_count=part["inf"],
        nonfinite_ranks=list(part["nonfinite"]),
        fingerprints={r: fp for fp, rs in part["fp"].items() for r in rs},
        param_norms=dict(part["pnorm"]),
        extra=extra,
        ts=part["ts"],
        per_rank=dict(sorted(packets.items())),
        monitor_wait_max=part["wait_max"],
        data_wait_max=part.get("dw_max", 0.0),
        checkpoint_s_max=part.get("ck_max", 0.0),
        eval_s_max=part.get("ev_max", 0.0),
        profile_s_max=part.get("pf_max", 0.0),
        monitor_wait_sum=mean_of(part["wait_s"], 1),
        ranks_reported=n,
        monitor_errors=part["errors"],
        histograms={name: h for name, h in (("loss", _histogram(part["h_loss"], lmin, lmax, part["loss_s"],
                                                                part["loss_q"])),
                                            ("step_time", _histogram(part["h_st"], tmin, tmax, part["st_s"],
                                                                     part["st_q"]))) if h},
        straggler_inputs=list(part.get("strag", [])),
        tokens=tokens,
        tokens_per_s=tps,
        tflops_mean=mean_of(part["tf_s"], tf_n) if tf_n else None,
        tflops_min=tfmin,
        tflops_min_rank=tfmin_r,
        tflops_max=tfmax,
        tflops_max_rank=tfmax_r,
        compute_flags=[list(x) for x in part["cdrop"]] if "cdrop" in part else None,
        loss_scale_min=lsmin,
        loss_scale_min_rank=lsmin_r,
        loss_scale_max=lsmax,
        loss_scale_max_rank=lsmax_r,
        overflow_ranks=part.get("ovf", 0),
        overflow_steps=part.get("ovf_steps", 0),
    )


def _histogram(counts: list[int], lo: float | None, hi: float | None, total: int, squares: int
               ) -> dict[str, Any] | None:
    num = sum(counts)
    if not num or lo is None or hi is None or not (math.isfinite(lo) and math.isfinite(hi)):
        return None
    # the last bucket's limit is the largest value (TensorBoard needs a finite edge)
    limits = list(HIST_EDGES) + [max(hi, HIST_EDGES[-1])]
    return {"min": lo, "max": hi, "num": num, "sum": mean_of(total, 1), "sum_squares": mean_of(squares, _ONE),
            "bucket_limits": limits, "bucket_counts": list(counts)}


def reduce_step(step: int, packets: dict[int, StepPacket], world_size: int) -> ReducedStep:
    """The flat reduction: one partial of every rank's packet (see "Node partials" above)."""
    return finalize(partial_of(step, packets, keep_all=True), world_size, keep_all=True)


class _Bucket:
    """One pending step: packets of ranks that reported directly, and merged node partials."""

    __slots__ = ("packets", "partial", "nodes", "count")

    def __init__(self) -> None:
        self.packets: dict[int, StepPacket] = {}
        self.partial: Partial | None = None
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

    def add_partial(self, nodes: int | Sequence[int], part: Partial) -> list[ReducedStep]:
        """One node's partial of a step (every rank of the node, reduced on the node), or a
        group's (the partials of several nodes merged by a group leader)."""
        s = part["step"]
        nodes = [nodes] if isinstance(nodes, int) else list(nodes)
        rpn = self.ranks_per_node
        sizes = [min(rpn, self.world_size - n * rpn) for n in nodes] if rpn else []
        if not rpn or not nodes or len(set(nodes)) != len(nodes) or min(sizes) <= 0 or part["n"] != sum(sizes):
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
        bucket.count += part["n"]
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
        self.monitor_wait_s = 0.0
        """Seconds ranks blocked on the aggregator, summed over ranks and steps."""
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
        self.monitor_wait_s += red.monitor_wait_sum
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
            "monitor_wait_s": self.monitor_wait_s,
            "monitor_errors": self.monitor_errors,
            "last_grad_norm": self.last_grad_norm,
            "loss_scale": self.loss_scale,
            "overflow_steps": ({"total": self.overflow_steps,
                                "per_rank": {str(r): n for r, n in sorted(self.overflow_per_rank.items())}}
                               if self.loss_scale is not None else None),
        }
