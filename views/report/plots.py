"""The report's figures, drawn with matplotlib's Agg canvas directly (no pyplot, no display
needed): loss, gradient norm, loss scale, step time, throughput, card telemetry, straggler
score, MFU.

A figure shows only what was measured: a card metric no card reported is named under the
figure ("not reported by this device"), never drawn as an empty panel; a figure with nothing
to draw is a one-line note on the page (its PNG file still exists, saying so). Above
`MAX_LINES` ranks (cards) a figure draws the range over them, not one line each.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mindpulse.common import formatting as fmt
from mindpulse.wire.protocol import StepPacket

from .data import RunData, card_series
from .markers import ANOMALY_COLOR, BEST_COLOR, Markers, PlotLink

log = logging.getLogger(__package__)

_MAX_POINTS = 4000
"""Longest line drawn per series; longer series are thinned by a stride."""
_MAX_LEGEND = 16
MAX_LINES = 16
"""Above this many ranks (cards) a plot draws the range over ranks (cards), not one line each."""


@dataclass
class Plot:
    """One figure of the report."""

    name: str
    path: Path
    drawn: bool
    message: str = ""
    """Why nothing was drawn, or what the figure leaves out (e.g. metrics a device does not report)."""
    links: list[PlotLink] = field(default_factory=list)

    @property
    def anchor(self) -> str:
        return "plot-" + self.path.stem


_RC = {"font.size": 12, "axes.titlesize": 13, "axes.labelsize": 12, "xtick.labelsize": 11, "ytick.labelsize": 11,
       "legend.fontsize": 10, "figure.titlesize": 14}
"""Font sizes that stay readable when a plot is shown at half the page's width."""


def _figure(nrows: int = 1, ncols: int = 1, size: tuple[float, float] = (8.5, 4.0)):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, axes


def _clean(values: Iterable[Any]) -> list[float]:
    """Numbers with None / NaN / Inf as NaN (a gap in the line)."""
    return [float(v) if fmt.is_number(v) else math.nan for v in values]


def _thin(xs: list[float], ys: list[float]) -> tuple[list[float], list[float]]:
    if len(xs) <= _MAX_POINTS:
        return xs, ys
    stride = math.ceil(len(xs) / _MAX_POINTS)
    keep = list(range(0, len(xs), stride))
    if keep[-1] != len(xs) - 1:
        keep.append(len(xs) - 1)
    return [xs[i] for i in keep], [ys[i] for i in keep]


def _plot(ax, xs: list[float], ys: list[float], label: str | None, **kw) -> bool:
    if not any(fmt.is_number(y) for y in ys):
        return False
    xs, ys = _thin(list(xs), list(ys))
    ax.plot(xs, ys, label=label, **kw)
    return True


def _band(ax, xs: list[float], lo: list[Any], hi: list[Any], label: str, color: str) -> bool:
    """The range over ranks (cards) as a shaded band."""
    los, his = _clean(lo), _clean(hi)
    keep = [i for i in range(len(xs)) if math.isfinite(los[i]) and math.isfinite(his[i])]
    if not keep:
        return False
    xk, lk = _thin([xs[i] for i in keep], [los[i] for i in keep])
    _, hk = _thin([xs[i] for i in keep], [his[i] for i in keep])
    ax.fill_between(xk, lk, hk, color=color, alpha=0.2, linewidth=0, label=label)
    return True


def _finish(fig, axes, path: Path, title: str, marks: Markers, footer: str = "") -> Plot:
    fig.suptitle(title)
    for ax in axes.flat:
        if not ax.get_visible():
            continue
        handles, _ = ax.get_legend_handles_labels()
        if handles and len(handles) <= _MAX_LEGEND:
            ax.legend(loc="best", framealpha=0.85)
        ax.grid(True, alpha=0.3)
    if footer:
        fig.text(0.5, 0.012, footer, ha="center", va="bottom", fontsize=10, color="#555555", style="italic")
        fig.tight_layout(rect=(0, 0.05, 1, 1))
    else:
        fig.tight_layout()
    links = marks.links(fig)
    fig.savefig(path, format="png")
    return Plot(path.name, path, drawn=True, message=footer, links=links)


def placeholder(path: Path, title: str, message: str) -> Plot:
    """A figure that says in one line why nothing was drawn."""
    fig, axes = _figure(size=(10.0, 3.0))
    ax = axes[0, 0]
    ax.axis("off")
    ax.text(0.5, 0.5, message, ha="center", va="center", fontsize=16, color="gray", transform=ax.transAxes)
    fig.suptitle(title)
    fig.savefig(path, format="png")
    return Plot(path.name, path, drawn=False, message=message)


def _many_ranks(data: RunData) -> bool:
    return len(data.per_rank) > MAX_LINES


def _step_axes():
    """A one-axis figure for a plot over steps: (figure, axes, the axis)."""
    fig, axes = _figure()
    return fig, axes, axes[0, 0]


def _finish_steps(fig, axes, path: Path, marks: Markers, ylabel: str, title: str) -> Plot:
    """The run's markers and the axis labels of a plot over steps, then `_finish`."""
    ax = axes[0, 0]
    marks.draw(ax)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    return _finish(fig, axes, path, title, marks)


def _rank_lines(ax, data: RunData, value: Callable[[StepPacket], float | None], suffix: str = "") -> bool:
    """One line per rank of `value(packet)` over steps (the packets without one left out)."""
    drawn = False
    for r, pkts in data.per_rank.items():
        pts = [(p.step, v) for p in pkts if (v := value(p)) is not None]
        drawn |= _plot(ax, [s for s, _ in pts], _clean(v for _, v in pts), f"rank {r}{suffix}",
                       linewidth=0.9, alpha=0.8)
    return drawn


def _plot_loss(data: RunData, path: Path, marks: Markers) -> Plot:
    if not data.has_steps and not data.reduced:
        return placeholder(path, "loss", "no data")
    fig, axes, ax = _step_axes()
    drawn = False
    red = [x for x in data.reduced if x.loss_mean is not None]
    if _many_ranks(data):
        drawn |= _band(ax, [x.step for x in red], [x.loss_min for x in red], [x.loss_max for x in red],
                       f"min..max over {data.world_size} ranks", "tab:blue")
    else:
        drawn |= _rank_lines(ax, data, lambda p: p.loss)
    bad_x = [p.step for pkts in data.per_rank.values() for p in pkts
             if p.loss is not None and not math.isfinite(p.loss)]
    bad_x += [x.step for x in red if not math.isfinite(x.loss_mean)]
    drawn |= _plot(ax, [x.step for x in red], _clean(x.loss_mean for x in red), "mean (reduced)",
                   color="black", linewidth=2.0)
    finite = [(x.step, x.loss_mean) for x in red if x.step > 0 and math.isfinite(x.loss_mean)]
    if finite:
        bs, bv = min(finite, key=lambda sv: sv[1])
        ax.plot([bs], [bv], marker="*", color=BEST_COLOR, markeredgecolor="black", markersize=13, linestyle="none",
                label=f"best {fmt.metric(bv)} (step {bs})", zorder=5)
    if bad_x:
        lo, hi = ax.get_ylim() if drawn else (0.0, 1.0)
        ax.plot(sorted(set(bad_x)), [hi] * len(set(bad_x)), "x", color=ANOMALY_COLOR, markersize=8,
                label="non-finite loss", clip_on=False)
    if not drawn and not bad_x:
        return placeholder(path, "loss", "no loss values reported")
    title = "loss: reduced mean" + (" and range over ranks" if _many_ranks(data) else " and per rank")
    return _finish_steps(fig, axes, path, marks, "loss", title)


def _plot_grad_norm(data: RunData, path: Path, marks: Markers) -> Plot:
    if not data.has_steps and not data.reduced:
        return placeholder(path, "grad norm", "no data")
    fig, axes, ax = _step_axes()
    red = [x for x in data.reduced if x.grad_norm is not None]
    drawn = _plot(ax, [x.step for x in red], _clean(x.grad_norm for x in red), "global",
                  color="black", linewidth=2.0)
    if _many_ranks(data):
        loc = [x for x in data.reduced if x.grad_norm_local_max is not None]
        drawn |= _plot(ax, [x.step for x in loc], _clean(x.grad_norm_local_max for x in loc), "largest local",
                       color="tab:orange", linewidth=1.0)
    else:
        drawn |= _rank_lines(ax, data, lambda p: p.grad_norm_local, " local")
    if not drawn:
        return placeholder(path, "grad norm", "gradient norms not reported (MonitoredTrainOneStepCell measures them)")
    ys = [y for line in ax.get_lines() for y in line.get_ydata() if fmt.is_number(y) and y > 0]
    if ys and max(ys) / min(ys) > 1e3:  # an explosion would flatten the rest of the curve
        ax.set_yscale("log")
    return _finish_steps(fig, axes, path, marks, "grad norm", "gradient norm: global and "
                         + ("largest local" if _many_ranks(data) else "per-rank local"))


def _plot_loss_scale(data: RunData, path: Path, marks: Markers) -> Plot:
    """The loss scale over steps (the reduced lowest and highest over ranks: one line while the
    ranks agree), on a log axis (a dynamic scale grows by powers of two), and the steps a rank's
    loss-scale cell skipped for overflow."""
    red = [x for x in data.reduced if x.loss_scale_min is not None]
    if not red:
        return placeholder(path, "loss scale", "no data" if not data.has_steps else
                           "no loss scale reported (no loss-scale cell ran)")
    fig, axes, ax = _step_axes()
    steps = [x.step for x in red]
    drawn = _plot(ax, steps, _clean(x.loss_scale_min for x in red), "loss scale", color="tab:blue", linewidth=1.5)
    if any(x.loss_scale_max != x.loss_scale_min for x in red):
        drawn |= _plot(ax, steps, _clean(x.loss_scale_max for x in red), "highest over ranks", color="tab:orange",
                       linewidth=1.0)
    skipped = [x for x in red if x.overflow_ranks]
    if skipped:
        ax.scatter([x.step for x in skipped], _clean(x.loss_scale_min for x in skipped), color=ANOMALY_COLOR,
                   marker="v", s=18, zorder=3, label="overflow (step skipped)")
    if not drawn:
        return placeholder(path, "loss scale", "no finite loss scale reported")
    if all(y > 0 for y in _clean(x.loss_scale_min for x in red) if fmt.is_number(y)):
        ax.set_yscale("log", base=2)
    return _finish_steps(fig, axes, path, marks, "loss scale", "loss scale (and the steps skipped for overflow)")


def _plot_step_time(data: RunData, path: Path, marks: Markers) -> Plot:
    if not data.has_steps and not data.reduced:
        return placeholder(path, "step time", "no data")
    fig, axes, ax = _step_axes()
    if _many_ranks(data):
        red = [x for x in data.reduced if x.step_time_max is not None]
        drawn = _band(ax, [x.step for x in red], [x.step_time_min for x in red], [x.step_time_max for x in red],
                      f"fastest..slowest of {data.world_size} ranks", "tab:blue")
        drawn |= _plot(ax, [x.step for x in red], _clean(x.step_time_max for x in red), "slowest rank",
                       color="black", linewidth=1.2)
    else:
        drawn = _rank_lines(ax, data, lambda p: p.step_time_s)
    if not drawn:
        return placeholder(path, "step time", "no step time values reported")
    return _finish_steps(fig, axes, path, marks, "step time (s)",
                         "step time " + ("range over ranks" if _many_ranks(data) else "per rank"))


def _plot_throughput(data: RunData, path: Path, marks: Markers) -> Plot:
    red = [x for x in data.reduced if x.samples_per_s is not None]
    if not red:
        return placeholder(path, "throughput", "no data" if not data.has_steps else "no throughput values reported")
    fig, axes, ax = _step_axes()
    if not _plot(ax, [x.step for x in red], _clean(x.samples_per_s for x in red), "cluster samples/s",
                 color="tab:blue", linewidth=1.5):
        return placeholder(path, "throughput", "no throughput values reported")
    return _finish_steps(fig, axes, path, marks, "samples / s",
                         "cluster throughput (all ranks' samples over the slowest step)")


def _plot_straggler(data: RunData, path: Path, marks: Markers) -> Plot:
    """Per-rank straggler score over time (1.0 = the fastest rank), as the aggregator scored it
    with the run's `monitor.straggler_window`, against its `monitor.straggler_threshold`."""
    monitor = data.config.monitor
    series: dict[int, tuple[list[float], list[float]]] = {}
    for red in data.reduced:
        for r, sc in red.straggler_scores.items():
            xs, ys = series.setdefault(r, ([], []))
            xs.append(red.step)
            ys.append(sc)
    if not series:
        return placeholder(path, "straggler score", "no data" if not data.has_steps else
                           f"not enough steps to score (a window of {monitor.straggler_window})")
    fig, axes, ax = _step_axes()
    shown = sorted(series.items())
    note = ""
    if len(shown) > MAX_LINES:  # the slowest ranks: the others sit near 1.0
        shown = sorted(shown, key=lambda kv: min(kv[1][1]))[:MAX_LINES]
        note = f", the {MAX_LINES} lowest of {len(series)} ranks"
    for r, (xs, ys) in sorted(shown):
        _plot(ax, xs, ys, f"rank {r}", linewidth=1.0)
    ax.axhline(monitor.straggler_threshold, color="tab:red", linestyle=":", linewidth=1.0,
               label=f"threshold {monitor.straggler_threshold:g} (monitor.straggler_threshold)")
    ax.set_ylim(0, 1.05)
    return _finish_steps(fig, axes, path, marks, "score (fastest / rank's busy time)",
                         f"straggler score per rank (1 = fastest; window {monitor.straggler_window} steps){note}")


def _peak_of(data: RunData) -> tuple[float | None, str]:
    """The peak the run's MFU was measured against: summary.json's `compute`, else the
    run's own sources again (world.peak_tflops, preflight.json: a run without a summary)."""
    from mindpulse.reporting.card_peaks import resolve_peak

    comp = (data.summary or {}).get("compute") or {}
    peak = comp.get("peak_tflops")
    if isinstance(peak, (int, float)) and not isinstance(peak, bool) and peak > 0:
        return float(peak), str(comp.get("peak_source") or "")
    return resolve_peak(data.config.world.peak_tflops, data.run_dir, [])


def _plot_mfu(data: RunData, path: Path, marks: Markers) -> Plot:
    """Per-rank MFU (achieved / peak TFLOPS) over steps, or the achieved TFLOPS when the run
    had no peak; above 16 ranks the range over ranks and the mean."""
    peak, source = _peak_of(data)
    scale = 1.0 / peak if peak else 1.0
    what = "MFU" if peak else "achieved TFLOPS"
    fig, axes, ax = _step_axes()
    if _many_ranks(data):
        red = [x for x in data.reduced if x.tflops_mean is not None]
        drawn = _band(ax, [x.step for x in red], [x.tflops_min * scale for x in red],
                      [x.tflops_max * scale for x in red], f"lowest..highest of {data.world_size} ranks", "tab:blue")
        drawn |= _plot(ax, [x.step for x in red], _clean(x.tflops_mean * scale for x in red), "mean over ranks",
                       color="black", linewidth=1.2)
    else:
        drawn = _rank_lines(ax, data, lambda p: p.tflops * scale if p.tflops is not None and p.step > 0 else None)
    if not drawn:
        return placeholder(path, "MFU", "no data" if not data.has_steps else
                           "no achieved TFLOPS reported (no tokens per step: Monitor(tokens_per_step=...))")
    title = f"{what} per rank" + (f" (peak {peak:.4g} TFLOPS per card: {source.split(' (')[0]})" if peak
                                  else " (no peak: see summary.json compute.peak_source)")
    return _finish_steps(fig, axes, path, marks, "MFU (achieved / peak TFLOPS)" if peak else "achieved TFLOPS", title)


_TELEMETRY_PANELS = (("util_pct", "utilization (%)"), ("memory_used_mb", "memory used (MB)"),
                     ("power_w", "power (W)"), ("temp_c", "temperature (°C)"))


def _step_to_time(data: RunData, t0: float) -> Callable[[int], float | None] | None:
    """A function step → seconds since t0 from the reduced steps' timestamps, or None."""
    import numpy as np

    pts = sorted((x.step, x.ts) for x in data.reduced if fmt.is_number(x.ts) and x.ts > 0)
    if len(pts) < 1:
        return None
    steps = np.array([p[0] for p in pts], dtype=float)
    ts = np.maximum.accumulate(np.array([p[1] for p in pts], dtype=float)) - t0

    def conv(step: int) -> float | None:
        if not steps[0] <= step <= steps[-1]:
            return None
        return float(np.interp(step, steps, ts))

    return conv


def _time_unit(span_s: float) -> tuple[str, float]:
    if span_s > 3 * 3600:
        return "hours", 3600.0
    if span_s > 3 * 60:
        return "minutes", 60.0
    return "seconds", 1.0


def _binned_range(samples: list[tuple[float, float]], bins: int = 400) -> tuple[list[float], ...]:
    """(x, low, median, high) over cards per time bin."""
    if not samples:
        return [], [], [], []
    lo_t, hi_t = min(t for t, _ in samples), max(t for t, _ in samples)
    width = (hi_t - lo_t) / bins or 1.0
    groups: dict[int, list[float]] = {}
    for t, v in samples:
        groups.setdefault(min(bins - 1, int((t - lo_t) / width)), []).append(v)
    xs, lows, meds, highs = [], [], [], []
    for b in sorted(groups):
        vals = groups[b]
        xs.append(lo_t + (b + 0.5) * width)
        lows.append(min(vals))
        meds.append(statistics.median(vals))
        highs.append(max(vals))
    return xs, lows, meds, highs


def _plot_telemetry(data: RunData, path: Path, marks: Markers) -> Plot:
    series = card_series(data)
    if not series:
        return placeholder(path, "card telemetry", "no card telemetry in the metrics")
    measured = [(k, label) for k, label in _TELEMETRY_PANELS
                if any(fmt.is_number(c.get(k)) for s in series.values() for _, c in s)]
    missing = [label for k, label in _TELEMETRY_PANELS if (k, label) not in measured]
    sources = sorted({str(c.get("source") or p.source) for p in data.telemetry for c in p.cards
                      if isinstance(c, dict) and (c.get("source") or p.source)})
    footer = (f"not reported by this device{' (' + '/'.join(sources) + ')' if sources else ''}: "
              + ", ".join(missing)) if missing else ""
    if not measured:
        return placeholder(path, "card telemetry", "no card metric was reported by this device")
    have_time = any(fmt.is_number(t) and t > 0 for s in series.values() for t, _ in s)
    t0 = min((t for s in series.values() for t, _ in s if fmt.is_number(t) and t > 0), default=0.0)
    all_t = [t - t0 for s in series.values() for t, _ in s if fmt.is_number(t) and t > 0]
    lo, hi = min(all_t, default=0.0), max(all_t, default=0.0)
    unit, scale = _time_unit(hi - lo)
    conv = _step_to_time(data, t0) if have_time else None

    def to_x(step: int) -> float | None:
        # only markers inside the sampled time range: the others would stretch the axis
        t = conv(step) if conv is not None else None
        return None if t is None or not lo <= t <= hi else t / scale

    n = len(measured)
    rows, cols = (1, n) if n <= 2 else ((1, 3) if n == 3 else (2, 2))
    fig, axes = _figure(rows, cols, size=(14.0, 4.6 if rows == 1 else 7.6))
    many = len(series) > MAX_LINES
    for ax, (key, label) in zip(axes.flat, measured):
        if many:
            pts = [((t - t0) / scale, float(c[key])) for s in series.values() for t, c in s
                   if fmt.is_number(c.get(key)) and fmt.is_number(t)]
            xs, lows, meds, highs = _binned_range(pts)
            _band(ax, xs, lows, highs, f"min..max over {len(series)} cards", "tab:blue")
            _plot(ax, xs, meds, "median card", color="tab:blue", linewidth=1.2)
        else:
            for card, samples in sorted(series.items()):
                xs = [(t - t0) / scale for t, _ in samples] if have_time else list(range(len(samples)))
                _plot(ax, xs, _clean(c.get(key) for _, c in samples), card,
                      linewidth=1.0, marker="." if len(samples) < 50 else None)
        ax.set_ylabel(label)
        ax.set_xlabel(f"{unit} since the first sample" if have_time else "sample")
        if conv is not None:
            marks.draw(ax, to_x)
    title = f"card telemetry ({fmt.plural(len(series), 'card')}, labelled node/card)"
    return _finish(fig, axes, path, title, marks, footer=footer)


PLOTTERS: dict[str, tuple[str, Callable[[RunData, Path, Markers], Plot]]] = {
    "loss.png": ("Loss", _plot_loss),
    "grad_norm.png": ("Gradient norm", _plot_grad_norm),
    "loss_scale.png": ("Loss scale", _plot_loss_scale),
    "step_time.png": ("Step time", _plot_step_time),
    "throughput.png": ("Throughput", _plot_throughput),
    "telemetry.png": ("Card telemetry", _plot_telemetry),
    "straggler.png": ("Straggler score", _plot_straggler),
    "mfu.png": ("MFU", _plot_mfu),
}
WIDE_PLOTS = ("telemetry.png",)


PLOT_NAMES: tuple[str, ...] = tuple(PLOTTERS)


def draw_plots(data: RunData, out: Path) -> list[Plot]:
    """Every figure of `PLOT_NAMES` as a PNG file in `out`; a figure that fails becomes a
    placeholder and a note, never the end of the report."""
    import matplotlib

    plots: list[Plot] = []
    marks = Markers(data)
    for name in PLOT_NAMES:
        path = out / name
        try:
            with matplotlib.rc_context(_RC):
                plots.append(PLOTTERS[name][1](data, path, marks))
        except Exception as exc:  # one bad plot must not cost the whole report
            log.warning("report: %s failed (%s: %s)", name, type(exc).__name__, exc)
            data.notes.append(f"{name} could not be drawn: {type(exc).__name__}: {exc}")
            plots.append(placeholder(path, name, "plot failed"))
    return plots
