"""The step metrics, declared once.

Every number a rank reports about one step is declared here: its packet field (name, type,
default), its unit, how the cluster reduces it (`Reduce`) and under which names the reduced
values live, and where it shows (console column, TensorBoard tags, rule-metric aliases,
`summary.json` totals). Everything else is derived from `STEP_METRICS`:

- the step packet's fields and wire schema (`mindpulse/wire/protocol.py`, `StepPacket`),
- the node partial's accumulators, their merge, wire form and checks (`mindpulse/reduction/partial.py`),
- the aggregator's `ReducedStep` fields and `finalize` (`mindpulse/reduction/reducer.py`),
- the rule and best-checkpoint metric names (`REDUCED_METRICS`, `METRIC_ALIASES`: config
  validation), the console columns (`mindpulse/reporting/tables.py`), the TensorBoard tags
  (`aggregator/tb_sink.py`) and the totals of `summary.json` (`RunTotals`).

Adding a metric is one `StepMetric` here plus the rank code that measures it (it passes the
value to `RankSession.record` or puts it in `SincePacket`). What is not a plain number per
rank (the fingerprint, the parameter norm, user `extra` scalars, weight statistics) is
reduced by hand in `mindpulse/reduction/partial.py`; it is declared here too (`Reduce` empty) so the
packet schema stays whole.

This module imports nothing of mindpulse but the formatter: the packet codec builds on it.
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mindpulse.common.formatting import millis, number


class Reduce(str, enum.Enum):
    """How the ranks' values of one step become the cluster's (see partial.py for each
    accumulator's exact, associative merge)."""

    SUM = "sum"
    """Summed over ranks (floats exactly: integers in units of 2**-1074)."""
    MEAN = "mean"
    """Exact mean over the ranks that reported a finite, non-negative value (None: none did)."""
    MEAN_ALL = "mean_all"
    """Exact mean over every rank of the step, NaN when one reported a non-finite value or none
    while others did; with `std` the population standard deviation too."""
    MIN = "min"
    """The smallest value with its rank (`<name>_rank`); ties go to the lowest rank, and a
    NaN/Inf wins over every finite value (it is what the user must see)."""
    MAX = "max"
    """The largest value with its rank, as MIN."""
    PEAK = "peak"
    """The largest finite value, without its rank (0 when none)."""
    COUNT = "count"
    """The number of ranks whose value is true."""
    FIRST = "first"
    """The lowest rank's value (a value every rank shares, such as the learning rate)."""
    GLOBAL = "global"
    """A value the all-reduce makes equal on every rank: the largest finite report, NaN when one
    is not finite, None when none reported."""
    HIST = "hist"
    """A TensorBoard histogram over ranks, fixed edges (`ReducedStep.histograms[<name>]`); the
    metric's MIN and MAX give its ends."""


class Source(str, enum.Enum):
    """Where a rank's value of a metric comes from (`workers/session.py` builds the packet by it)."""

    CALLER = "caller"
    """Given to `RankSession.record` by name (by `Monitor.record`, `Monitor.step` or the callback),
    coerced by the metric's type."""
    CELL = "cell"
    """As CALLER, and the monitored train cell's outputs carry it (`workers/monitor.py`'s
    `STEP_STATS`: what a step's outputs may add to its packet)."""
    SESSION = "session"
    """Measured by the rank session itself (its rank and step, the time, fingerprints, TFLOPS,
    its own counters)."""
    SINCE = "since"
    """Seconds since the rank's previous packet, by cause (`SincePacket`)."""


@dataclass(frozen=True)
class Reduction:
    """One reduced value of a metric, by `ReducedStep` field name."""

    name: str
    how: Reduce
    doc: str = ""
    include: Callable[[Any], bool] | None = None
    """Which ranks' packets count (default: those whose value is not None)."""
    std: str | None = None
    """MEAN_ALL: also the standard deviation under this name."""
    internal: bool = False
    """Kept in the partial for a derived value only (no `ReducedStep` field)."""
    tb: str | None = None
    """The TensorBoard tag of the cluster's value."""
    tb_when: str | None = None
    """Written only when this `ReducedStep` field is not None (the loss-scale tags)."""
    total: str | None = None
    """`summary.json` key that sums this value over the run's steps (RunTotals); the totals
    table shows it as the key in words, `(all ranks)`."""
    total_words: str = ""
    """The report's words for that total: `ranks <total_words> <total> <unit> in all` (the
    metric's `unit`: `0.180 s`; a count has none: `3`)."""
    prom: tuple[str, str] | None = None
    """The Prometheus series of the cluster's value: (family without the `mindpulse_` prefix, in
    base units; its `stat` label, empty for none) (aggregator/prometheus_exporter.py)."""
    rate: bool = False
    """Only finite, non-negative values reach it (`include`): a node partial that says otherwise is refused."""
    keep: bool = False
    """MIN/MAX: the rank at this end is worth a look (its packet travels whole to the aggregator,
    and it is among `ReducedStep.ranks_that_matter`)."""


@dataclass(frozen=True)
class Derived:
    """A reduced value computed from other reduced values at `finalize`."""

    name: str
    fn: Callable[[dict[str, Any]], Any]
    doc: str = ""
    tb: str | None = None
    prom: tuple[str, str] | None = None


@dataclass(frozen=True)
class Column:
    """A console column of the per-step table (mindpulse/reporting/tables.py), in declaration order: a
    rank's cell from its packet (and the step's `ReducedStep`, for what only the cluster knows:
    the card's peak), the cluster row's cell from the reduced values."""

    header: str
    rank_cell: Callable[[Any, Any], str]
    cluster_cell: Callable[[Any], str]


@dataclass(frozen=True)
class StepMetric:
    """One field of the step packet and everything derived from it."""

    name: str
    type: type
    default: Any = None
    optional: bool = False
    """None is a valid value (the rank could not measure it)."""
    unit: str = ""
    doc: str = ""
    reduce: tuple[Reduction, ...] = ()
    aliases: dict[str, str] = field(default_factory=dict)
    """Other rule-metric names: alias → one of this metric's reduced names."""
    rank_tb: str | None = None
    """TensorBoard tag suffix of each shown rank's own value (`rank_<r>/<suffix>`)."""
    rank_prom: tuple[str, str] | None = None
    """The Prometheus series of each shown rank's own value: (family, `stat` label); it carries
    the `rank` and `node` labels."""
    column: Column | None = None
    required: bool = False
    source: Source = Source.SESSION
    """Where the rank's value comes from (a metric a user's code measures is CALLER)."""


def _ms(seconds: Any) -> str:
    """Seconds as milliseconds with one decimal (monitoring's own costs are a few ms)."""
    return number(None if seconds is None else seconds * 1000, ".1f")


def _ms_with_rank(value: Any, rank: Any) -> str:
    return _ms(value) + (f" r{rank}" if value is not None and rank is not None else "")


def _per_second(count: Any, seconds: Any) -> float | None:
    """A rank's own rate: `count` over its step time (None without either)."""
    return count / seconds if seconds and count is not None else None


def rank_mfu(tflops: float | None, peak: float | None) -> float | None:
    """A rank's MFU: its achieved TFLOPS over the card's peak (None without either). Every view
    of a rank's MFU (the console, TensorBoard, the trackers, Prometheus) takes it from here."""
    if tflops is None or not peak:
        return None
    return tflops / peak


def _mfu(tflops: float | None, peak: float | None) -> str:
    """A rank's MFU (achieved / peak TFLOPS), "-" without a peak or a figure."""
    return number(rank_mfu(tflops, peak), ".3f")


def _cluster_mfu(red: Any) -> str:
    """Mean MFU over ranks with its range and the ranks at its ends: `0.412 (0.301 r1..0.455 r0)`."""
    if red.mfu_mean is None:
        return "-"
    if red.mfu_min is None or red.mfu_max is None or red.world_size < 2:
        return number(red.mfu_mean, ".3f")
    return (f"{number(red.mfu_mean, '.3f')} ({number(red.mfu_min, '.3f')} r{red.mfu_min_rank}.."
            f"{number(red.mfu_max, '.3f')} r{red.mfu_max_rank})")


def _scaled(p: Any) -> bool:
    """A grad norm the loss scale overflowed (the step was skipped): not the model's."""
    return not (p.overflow and (p.loss_scale or 0) > 1)


def is_rate(x: Any) -> bool:
    """A rate worth reducing (achieved TFLOPS): a finite number, not negative."""
    return x is not None and math.isfinite(x) and x >= 0


def _per_slowest(key: str) -> Callable[[dict[str, Any]], float | None]:
    """Throughput: every rank's `key` over the slowest rank's step time."""
    def fn(v: dict[str, Any]) -> float | None:
        total, slowest = v[key], v["step_time_max"]
        if total and slowest and slowest == slowest and slowest not in (float("inf"),) and slowest > 0:
            return total / slowest
        return None
    return fn


_OPT = dict(optional=True)
_CALLER, _CELL, _SINCE = Source.CALLER, Source.CELL, Source.SINCE

STEP_METRICS: tuple[StepMetric, ...] = (
    StepMetric("rank", int, required=True),
    StepMetric("step", int, required=True, doc="Steps count from 1 (0: the report before the first step)."),
    StepMetric("epoch", int, 0, reduce=(Reduction("epoch", Reduce.PEAK, prom=("epoch", "")),), source=_CALLER),
    StepMetric("loss", float, **_OPT, reduce=(
        Reduction("loss_mean", Reduce.MEAN_ALL, "The mean loss over ranks (NaN when one rank's is not finite).",
                  std="loss_std", tb="loss/mean", prom=("loss", "mean")),
        Reduction("loss_min", Reduce.MIN, tb="loss/min", keep=True, prom=("loss", "min")),
        Reduction("loss_max", Reduce.MAX, tb="loss/max", keep=True, prom=("loss", "max")),
        Reduction("loss", Reduce.HIST)), aliases={"loss": "loss_mean"}, rank_tb="loss", rank_prom=("loss", "rank"),
        column=Column("loss", lambda p, red: number(p.loss),
                      lambda red: f"{number(red.loss_mean)} ({number(red.loss_min)}..{number(red.loss_max)})"),
        source=_CALLER),
    StepMetric("lr", float, **_OPT, reduce=(Reduction("lr", Reduce.FIRST, tb="lr", prom=("learning_rate", "")),),
               source=_CALLER),
    StepMetric("grad_norm", float, **_OPT, doc="Global grad norm, after the data-parallel reduction.",
               reduce=(Reduction("grad_norm", Reduce.GLOBAL, "Global (post-reduction) grad norm; the largest "
                                 "report if ranks disagree.", include=_scaled, tb="grad_norm/global",
                                 prom=("grad_norm", "global")),),
               aliases={"grad_norm_global": "grad_norm"},
               # a rank's row shows its own (local) norm: the one that tells which rank went wrong
               column=Column("grad norm", lambda p, red: number(p.grad_norm_local, ".3f"),
                             lambda red: number(red.grad_norm, ".3f")), source=_CELL),
    StepMetric("grad_norm_local", float, **_OPT, doc="This rank's grad norm before the reduction: tells which "
               "rank produced a NaN.", reduce=(Reduction("grad_norm_local_max", Reduce.MAX, keep=True,
                                                         prom=("grad_norm", "local_max")),),
               rank_tb="grad_norm_local", rank_prom=("grad_norm", "local"), source=_CELL),
    StepMetric("nan_count", int, 0, reduce=(Reduction("nan_count", Reduce.SUM),), source=_CELL),
    StepMetric("inf_count", int, 0, reduce=(Reduction("inf_count", Reduce.SUM),), source=_CELL),
    StepMetric("step_time_s", float, **_OPT, unit="s", reduce=(
        Reduction("step_time_min", Reduce.MIN, keep=True, prom=("step_duration_seconds", "min")),
        Reduction("step_time_max", Reduce.MAX, tb="step_time/max", keep=True, prom=("step_duration_seconds", "max")),
        Reduction("step_time", Reduce.HIST)), rank_tb="step_time", rank_prom=("step_duration_seconds", "rank"),
        column=Column("step ms", lambda p, red: millis(p.step_time_s), lambda red: millis(red.step_time_max)),
        source=_CALLER),
    StepMetric("data_wait_s", float, **_OPT, unit="s", doc="Time from the end of the previous step to the start "
               "of this one (fetching the batch, host work): before the collective, so it tells stragglers apart.",
               reduce=(Reduction("data_wait_max", Reduce.PEAK, "The longest data wait of the step over ranks.",
                                 prom=("data_wait_seconds", "max")),), source=_CALLER),
    StepMetric("compute_s", float, **_OPT, unit="s", doc="PYNATIVE: time from the step's start until the local "
               "gradients were ready (before the all-reduce); None where the mode does not allow measuring it.",
               source=_CALLER),
    StepMetric("samples", int, 0, reduce=(Reduction("samples", Reduce.SUM, internal=True),),
               column=Column("samples/s", lambda p, red: number(_per_second(p.samples, p.step_time_s), ".1f"),
                             lambda red: number(red.samples_per_s, ".1f")), source=_CALLER),
    StepMetric("tokens", int, 0, doc="Tokens this rank trained on in this step (0: not known).",
               reduce=(Reduction("tokens", Reduce.SUM, "Tokens trained in this step, summed over ranks."),),
               # a rank's 0 tokens: not known (no rate), where 0 samples is a rate of 0
               column=Column("tokens/s", lambda p, red: number(_per_second(p.tokens or None, p.step_time_s), ".0f"),
                             lambda red: number(red.tokens_per_s, ".0f")), source=_CALLER),
    StepMetric("tflops", float, **_OPT, unit="TFLOPS", doc="This rank's achieved model TFLOPS in this step.",
               reduce=(Reduction("tflops_mean", Reduce.MEAN, "Achieved TFLOPS per card, mean over ranks.",
                                 include=lambda p: is_rate(p.tflops), tb="compute/tflops/mean",
                                 prom=("tflops", "mean")),
                       Reduction("tflops_min", Reduce.MIN, include=lambda p: is_rate(p.tflops), keep=True, rate=True,
                                 prom=("tflops", "min")),
                       Reduction("tflops_max", Reduce.MAX, include=lambda p: is_rate(p.tflops), keep=True, rate=True,
                                 prom=("tflops", "max"))),
               aliases={"tflops": "tflops_mean"}, rank_tb="tflops", rank_prom=("tflops", "rank"),
               column=Column("MFU", lambda p, red: _mfu(p.tflops, red.peak_tflops), _cluster_mfu)),
    StepMetric("ts", float, 0.0, unit="s", reduce=(Reduction("ts", Reduce.PEAK),)),
    StepMetric("fingerprint", str, **_OPT, doc="Hash of the parameters, every `collect_freq` steps (and step 0)."),
    StepMetric("param_norm", float, **_OPT),
    StepMetric("decision", bool, False, doc="True when the rank waits for the directive of this step."),
    StepMetric("monitor_wait_s", float, 0.0, unit="s", doc="Seconds this rank blocked on the aggregator before "
               "this step.", reduce=(
                   Reduction("monitor_wait_max", Reduce.PEAK, tb="monitor/wait_s",
                             prom=("monitor_wait_seconds", "max")),
                   Reduction("monitor_wait_sum", Reduce.SUM, include=lambda p: bool(p.monitor_wait_s),
                             total="monitor_wait_s", total_words="blocked on the monitor",
                             prom=("monitor_wait_seconds", "sum"))), source=_SINCE),
    StepMetric("monitor_errors", int, 0, doc="Errors inside this rank's monitor so far (logged and counted).",
               reduce=(Reduction("monitor_errors", Reduce.SUM),)),
    StepMetric("checkpoint_s", float, 0.0, unit="s", reduce=(Reduction("checkpoint_s_max", Reduce.PEAK),),
               source=_SINCE),
    StepMetric("eval_s", float, 0.0, unit="s", reduce=(Reduction("eval_s_max", Reduce.PEAK),)),
    StepMetric("profile_s", float, 0.0, unit="s", reduce=(Reduction("profile_s_max", Reduce.PEAK),), source=_SINCE),
    StepMetric("loss_scale", float, **_OPT, doc="The loss scale the step ran with, where a loss-scale cell runs.",
               reduce=(Reduction("loss_scale_min", Reduce.MIN, tb="loss_scale/min", tb_when="loss_scale_min",
                                 prom=("loss_scale", "min")),
                       Reduction("loss_scale_max", Reduce.MAX, tb="loss_scale/max", tb_when="loss_scale_min",
                                 prom=("loss_scale", "max"))),
               aliases={"loss_scale": "loss_scale_min"}, source=_CELL),
    StepMetric("overflow", bool, **_OPT, doc="True when the loss-scale cell skipped the update for overflow.",
               reduce=(Reduction("overflow_ranks", Reduce.COUNT, include=lambda p: bool(p.overflow),
                                 tb="overflow/ranks", tb_when="loss_scale_min", prom=("overflow_ranks", "")),),
               aliases={"overflow": "overflow_ranks"}, source=_CELL),
    StepMetric("overflow_steps", int, 0, reduce=(Reduction("overflow_steps", Reduce.PEAK, tb="overflow/steps",
                                                           tb_when="loss_scale_min"),)),
    StepMetric("monitor_self_s", float, 0.0, unit="s", doc=(
        "Seconds this rank spent in mindpulse's own code since its previous step packet: the callback, "
        "reading the step's outputs, building and encoding the packet, the channel and the lease check; not "
        "the waits for the aggregator (monitor_wait_s), checkpoint writes, evaluation or the profiler."),
        reduce=(Reduction("monitor_self_max", Reduce.MAX, "The most any rank spent in mindpulse's code for this "
                          "step, with the rank.", tb="monitor/self_s/max",
                          prom=("monitor_self_seconds", "max")),
                Reduction("monitor_self_sum", Reduce.SUM, "Every rank's seconds in mindpulse's code, summed.",
                          tb="monitor/self_s/sum", total="monitor_self_s", total_words="spent in mindpulse's code",
                          prom=("monitor_self_seconds", "sum"))),
        aliases={"monitor_self_s": "monitor_self_max"}, rank_tb="monitor_self_s",
        rank_prom=("monitor_self_seconds", "rank"),
        column=Column("self ms", lambda p, red: _ms(p.monitor_self_s),
                      lambda red: _ms_with_rank(red.monitor_self_max, red.monitor_self_max_rank)), source=_SINCE),
    StepMetric("extra", dict, doc="Additional named scalars (user metrics); reduced like the loss.", source=_CALLER),
    StepMetric("weights", dict, doc="Every collect_freq steps: per-layer norms, update ratios, histograms."),
)
"""Every field of the step packet, in wire order."""

DERIVED: tuple[Derived, ...] = (
    Derived("samples_per_s", _per_slowest("samples"), "Cluster throughput: all ranks' samples over the slowest "
            "rank's step time.", tb="throughput/samples_per_s", prom=("samples_per_second", "")),
    Derived("tokens_per_s", _per_slowest("tokens"), "Cluster token throughput.", tb="throughput/tokens_per_s",
            prom=("tokens_per_second", "")),
)
"""Reduced values computed from others (MFU, from the card's peak, is `ReducedStep.set_peak`)."""

FIXED_REDUCED: tuple[str, ...] = ("world_size", "ranks_reported", "peak_tflops", "mfu_mean", "mfu_min",
                                   "mfu_min_rank", "mfu_max", "mfu_max_rank")
"""The numeric `ReducedStep` fields not reduced from one packet field (mindpulse/reduction/reducer.py
declares them; the MFU is achieved TFLOPS over the card's peak, which the aggregator knows)."""

OTHER_ALIASES: dict[str, str] = {"throughput": "samples_per_s", "mfu": "mfu_mean"}
"""Rule-metric aliases of values not reduced from one packet field."""


def reported() -> tuple[StepMetric, ...]:
    """The metrics a rank's code gives `RankSession.record` (CALLER and CELL), in wire order."""
    return tuple(m for m in STEP_METRICS if m.source in (Source.CALLER, Source.CELL))


def cell_stats() -> tuple[str, ...]:
    """The metrics the monitored train cell's outputs may carry (CELL)."""
    return tuple(m.name for m in STEP_METRICS if m.source is Source.CELL)


def since_fields() -> tuple[str, ...]:
    """The seconds between packets, by cause (SINCE): `SincePacket`'s fields."""
    return tuple(m.name for m in STEP_METRICS if m.source is Source.SINCE)


def by_name() -> dict[str, StepMetric]:
    return {m.name: m for m in STEP_METRICS}


def reductions() -> tuple[tuple[StepMetric, Reduction], ...]:
    """Every (metric, reduction) pair, in declaration order."""
    return tuple((m, r) for m in STEP_METRICS for r in m.reduce)


def reduced_fields() -> tuple[str, ...]:
    """The `ReducedStep` fields the registry gives (MIN/MAX with their `_rank`, std, derived)."""
    out: list[str] = []
    for _, r in reductions():
        if r.internal or r.how is Reduce.HIST:
            continue
        out.append(r.name)
        if r.how in (Reduce.MIN, Reduce.MAX):
            out.append(r.name + "_rank")
        if r.std:
            out.append(r.std)
    out += [d.name for d in DERIVED]
    return tuple(out)


def aliases() -> dict[str, str]:
    """Every rule-metric alias → the reduced field it names."""
    out = {a: target for m in STEP_METRICS for a, target in m.aliases.items()}
    out.update(OTHER_ALIASES)
    return out


def tb_scalars() -> tuple[tuple[str, str, str | None], ...]:
    """(tag, reduced field, written-only-when field) of every cluster scalar."""
    out = [(r.tb, r.name, r.tb_when) for _, r in reductions() if r.tb]
    out += [(d.tb, d.name, None) for d in DERIVED if d.tb]
    return tuple(out)


def columns() -> tuple[Column, ...]:
    """The console columns of the per-step table, in declaration order."""
    return tuple(m.column for m in STEP_METRICS if m.column)


def kept_extremes() -> tuple[str, ...]:
    """The MIN/MAX reductions whose ranks are worth a look (`Reduction.keep`)."""
    return tuple(r.name for _, r in reductions() if r.keep)


def prom_series() -> tuple[tuple[str, str, str], ...]:
    """(family, `stat` label, ReducedStep field) of every cluster series for Prometheus."""
    out = [(r.prom[0], r.prom[1], r.name) for _, r in reductions() if r.prom]
    out += [(d.prom[0], d.prom[1], d.name) for d in DERIVED if d.prom]
    return tuple(out)


RANK_MFU_TB = "mfu"
"""The TensorBoard tag suffix of a rank's MFU (`rank_<r>/mfu`)."""
RANK_MFU_PROM = ("mfu_ratio", "rank")
"""The Prometheus series of a rank's MFU (family, `stat` label)."""


@functools.cache
def _rank_values() -> tuple[tuple[str | None, tuple[str, str] | None, str], ...]:
    return tuple((m.rank_tb, m.rank_prom, m.name) for m in STEP_METRICS if m.rank_tb or m.rank_prom)


def rank_scalars(pkt: Any, peak: float | None) -> list[tuple[str | None, tuple[str, str] | None, Any]]:
    """One rank's own values of a step, for every view that shows a rank (TensorBoard, the
    trackers, Prometheus): `(TensorBoard tag suffix or None, Prometheus (family, stat) or None,
    value)`, the registry's `rank_tb`/`rank_prom` metrics and the rank's MFU against `peak`.
    Values are as the rank sent them (None, NaN included): each view keeps what it can show."""
    out: list[tuple[str | None, tuple[str, str] | None, Any]] = [
        (tb, prom, getattr(pkt, name, None)) for tb, prom, name in _rank_values()]
    out.append((RANK_MFU_TB, RANK_MFU_PROM, rank_mfu(getattr(pkt, "tflops", None), peak)))
    return out


PROM_HELP: dict[str, str] = {
    "epoch": "The training epoch of the newest reduced step.",
    "loss": "Training loss: mean, min and max over ranks (stat), and each shown rank's (stat=rank).",
    "learning_rate": "The learning rate of the newest reduced step.",
    "grad_norm": "Gradient norm: global after the all-reduce (stat=global), the largest local one "
                 "(stat=local_max) and each shown rank's local one (stat=local).",
    "step_duration_seconds": "Step time: shortest and longest over ranks, and each shown rank's.",
    "data_wait_seconds": "The longest data wait of the step over ranks (before the collective).",
    "tflops": "Achieved model TFLOPS per card: mean, min, max over ranks, and each shown rank's.",
    "mfu_ratio": "Model FLOPs utilisation (achieved / the card's peak TFLOPS), 0-1.",
    "monitor_wait_seconds": "Seconds ranks blocked on the aggregator before the step: the most any rank, the sum.",
    "monitor_self_seconds": "Seconds ranks spent in mindpulse's own code for the step: the most any rank, the sum, "
                            "and each shown rank's.",
    "loss_scale": "The loss scale over ranks (where a loss-scale cell runs).",
    "overflow_ranks": "Ranks whose loss-scale cell skipped the newest step for overflow.",
    "samples_per_second": "Cluster throughput: all ranks' samples over the slowest rank's step time.",
    "tokens_per_second": "Cluster token throughput: all ranks' tokens over the slowest rank's step time.",
}
"""Each Prometheus family's help text where one family holds several values (a family the
registry names must be here or have its metric's `doc`: `prom_help`)."""


def prom_help(family: str) -> str:
    """The help text of a Prometheus family: PROM_HELP's, else the doc of the metric that names it."""
    if family in PROM_HELP:
        return PROM_HELP[family]
    for m, r in reductions():
        if family in ((r.prom or ("",))[0], (m.rank_prom or ("",))[0]):
            return r.doc or m.doc or family.replace("_", " ")
    return family.replace("_", " ")


def totals() -> tuple[tuple[str, str], ...]:
    """(`summary.json` key, reduced field) of every run total."""
    return tuple((r.total, r.name) for _, r in reductions() if r.total)


def total_words() -> tuple[tuple[str, str, str], ...]:
    """(`summary.json` key, the report's words for it, the metric's unit) of every run total."""
    return tuple((r.total, r.total_words or r.total.replace("_", " "), m.unit)
                 for m, r in reductions() if r.total)


def with_unit(value: Any, unit: str) -> str:
    """A total in its metric's unit: seconds to the millisecond (`0.180 s`), another unit to four
    significant digits (`12.5 TFLOPS`), a count (no unit) as it is (`3`); none: `-`."""
    if value is None:
        return number(None)
    if unit == "s":
        return f"{number(value, '.3f')} s"
    if unit:
        return f"{number(value, '.4g')} {unit}"
    return number(value, ".12g")
