"""Node partials: one node's part of one step, reduced where its packets arrive.

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
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

from mindpulse.protocol import StepPacket

_ONE = 1 << 1074
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
def _argext(items: Iterable[tuple[int, float]], biggest: bool) -> list | None:
    """[value, rank] of the smallest (or biggest) value, ties to the lowest rank; a NaN/Inf
    wins over every finite value (it is what the user must see), the lowest such rank first."""
    best: tuple[int, float] | None = None
    for r, v in items:
        if v is None:
            continue
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
    return None if best is None else [best[1], best[0]]


def _merge_ext(a: list | None, b: list | None, biggest: bool) -> list | None:
    return _argext([(x[1], x[0]) for x in (a, b) if x is not None], biggest)


# ---- one node's partial ------------------------------------------------------------------------
def _nonfinite(p: StepPacket) -> bool:
    return bool(p.nan_count or p.inf_count or (p.loss is not None and not math.isfinite(p.loss))
                or (p.grad_norm_local is not None and not math.isfinite(p.grad_norm_local)))


def partial_of(step: int, packets: Mapping[int, StepPacket], keep_all: bool = False,
               wires: Mapping[int, dict[str, Any]] | None = None) -> Partial:
    """The partial of one step from these ranks' packets (one per rank). `keep_all` keeps
    every packet whole (the flat reduction, a collect step); otherwise only the ones worth
    keeping. `wires`: the packets' validated wire maps (a node agent has them: they travel
    on as they are)."""
    losses = [(r, p.loss) for r, p in packets.items() if p.loss is not None]
    finite = [v for _, v in losses if math.isfinite(v)]
    gns = [p.grad_norm for p in packets.values() if p.grad_norm is not None]
    lrs = [(r, p.lr) for r, p in packets.items() if p.lr is not None]
    extra: dict[str, list] = {}
    for p in packets.values():
        for k, v in p.extra.items():
            # [count, exact sum of the finite values, the non-finite values...]: a NaN or
            # Inf among them makes the mean NaN or Inf, as over the flat list
            x = extra.setdefault(k, [0, 0])
            x[0] += 1
            if math.isfinite(v):
                x[1] += exact(v)
            else:
                x.append(v)
    part: Partial = {
        "step": step,
        "n": len(packets),
        "epoch": max((p.epoch for p in packets.values()), default=0),
        "ts": max((p.ts for p in packets.values()), default=0.0),
        "loss_n": len(losses),
        "loss_f": len(finite),
        "loss_s": sum(map(exact, finite)),
        "loss_q": sum(exact(v) ** 2 for v in finite),
        "loss_min": _argext(losses, False),
        "loss_max": _argext(losses, True),
        "gn_n": len(gns),
        "gn_bad": any(not math.isfinite(g) for g in gns),
        "gn_max": max((g for g in gns if math.isfinite(g)), default=None),
        "gl_max": _argext(((r, p.grad_norm_local) for r, p in packets.items()), True),
        "st_min": _argext(((r, p.step_time_s) for r, p in packets.items()), False),
        "st_max": _argext(((r, p.step_time_s) for r, p in packets.items()), True),
        "samples": sum(p.samples for p in packets.values()),
        "lr": list(min(lrs)) if lrs else None,
        "nan": sum(p.nan_count for p in packets.values()),
        "inf": sum(p.inf_count for p in packets.values()),
        "nonfinite": sorted(r for r, p in packets.items() if _nonfinite(p)),
        "fp": _fp_groups(packets),
        "pnorm": {r: p.param_norm for r, p in packets.items() if p.param_norm is not None},
        "extra": extra,
        "wait_max": max((p.monitor_wait_s for p in packets.values()), default=0.0),
        "wait_s": sum(exact(p.monitor_wait_s) for p in packets.values()),
        "errors": sum(p.monitor_errors for p in packets.values()),
        "h_loss": _hist(v for _, v in losses),
        "h_st": _hist(p.step_time_s for p in packets.values()),
        "st_s": sum(exact(p.step_time_s) for p in packets.values()
                    if p.step_time_s is not None and math.isfinite(p.step_time_s)),
        "st_q": sum(exact(p.step_time_s) ** 2 for p in packets.values()
                    if p.step_time_s is not None and math.isfinite(p.step_time_s)),
    }
    part["all"] = keep_all
    keep = sorted(set(packets) if keep_all else _worth_keeping(part, packets))
    part["packets"] = {r: (wires[r] if wires is not None else packets[r]) for r in keep}
    return part


def _hist(values: Iterable[float | None]) -> list[int]:
    counts = [0] * (len(HIST_EDGES) + 1)
    for v in values:
        if v is not None and math.isfinite(v):
            counts[bisect.bisect_left(HIST_EDGES, v)] += 1
    return counts


def _fp_groups(packets: Mapping[int, StepPacket]) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {}
    for r in sorted(packets):
        fp = packets[r].fingerprint
        if fp is not None:
            groups.setdefault(fp, []).append(r)
    return groups


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
    keep = {x[1] for x in (part["loss_min"], part["loss_max"], part["gl_max"], part["st_min"], part["st_max"])
            if x is not None}
    keep.update(part["nonfinite"])
    keep.update(r for r, p in packets.items() if p.weights)
    return keep


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
        "lr": min((x for x in (a["lr"], b["lr"]) if x is not None), default=None),
        "nan": a["nan"] + b["nan"],
        "inf": a["inf"] + b["inf"],
        "nonfinite": sorted(a["nonfinite"] + b["nonfinite"]),
        "fp": {k: sorted(a["fp"].get(k, []) + b["fp"].get(k, [])) for k in a["fp"].keys() | b["fp"].keys()},
        "pnorm": {**a["pnorm"], **b["pnorm"]},
        "extra": {},
        "wait_max": max(a["wait_max"], b["wait_max"]),
        "wait_s": a["wait_s"] + b["wait_s"],
        "errors": a["errors"] + b["errors"],
        "h_loss": [x + y for x, y in zip(a["h_loss"], b["h_loss"])],
        "h_st": [x + y for x, y in zip(a["h_st"], b["h_st"])],
        "st_s": a["st_s"] + b["st_s"],
        "st_q": a["st_q"] + b["st_q"],
        "packets": {**a["packets"], **b["packets"]},
        "all": a["all"] and b["all"],
        "strag": a.get("strag", []) + b.get("strag", []),
    }
    for k in a["extra"].keys() | b["extra"].keys():
        xa, xb = a["extra"].get(k, [0, 0]), b["extra"].get(k, [0, 0])
        out["extra"][k] = [xa[0] + xb[0], xa[1] + xb[1]] + xa[2:] + xb[2:]
    return out


_EXACT = ("loss_s", "loss_q", "wait_s", "st_s", "st_q")


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
    part["pnorm"] = {int(r): float(v) for r, v in w["pnorm"]}
    part["fp"] = {str(k): [int(r) for r in v] for k, v in w["fp"].items()}
    for k in ("h_loss", "h_st"):
        if not (isinstance(w[k], list) and len(w[k]) == len(HIST_EDGES) + 1
                and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in w[k])):
            raise ValueError(f"partial field {k!r} is not a histogram")
    for k in ("step", "n", "epoch", "loss_n", "loss_f", "gn_n", "samples", "nan", "inf", "errors"):
        if not isinstance(part[k], int) or isinstance(part[k], bool) or part[k] < 0:
            raise ValueError(f"partial field {k!r} is not a count")
    return part


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
        import statistics

        meds = sorted(((statistics.median(h), r) for r, h in self.history.items() if len(h) >= self.min_steps),
                      reverse=True)
        if not meds:
            return None
        return {"fast": meds[-1][0], "med": [[r, m] for m, r in meds]}


def straggler_scores(inputs: Iterable[dict[str, Any]], threshold: float, every_rank: bool = False
                     ) -> dict[int, float]:
    """Scores (fastest median over all nodes / the rank's median) of the ranks below
    `threshold` — each node's list is read only while it holds such ranks — or of every rank."""
    inputs = [x for x in inputs if x]
    if sum(len(x["med"]) for x in inputs) < 2:
        return {}  # one rank alone is no comparison
    fastest = min(x["fast"] for x in inputs)
    scores: dict[int, float] = {}
    for x in inputs:
        for r, m in x["med"]:  # slowest first
            score = fastest / m if m > 0 else 1.0
            if score >= threshold and not every_rank:
                break
            scores[int(r)] = score
    return dict(sorted(scores.items()))
