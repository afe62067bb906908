"""The report as one self-contained HTML page, and `build_report`, which writes it beside
the PNG figures.

The page reads top down in the order a user asks (`headline.Headline`): did the run succeed
and why did it end, wall time, steps, loss first → best → last, throughput, world and
cards, the best and latest checkpoints as links, the anomalies, and (when `summary.json`
holds `goodput`) the effective training time ratio with its largest badput causes. Then the
figures, with anomaly, checkpoint and restart markers that link to the rows of the anomaly,
checkpoint and attempt tables (and back); the raw `summary.json`, the resolved config and the
console text are folded away at the bottom.
"""

from __future__ import annotations

import base64
import html
import json
import os
import urllib.parse
from pathlib import Path
from typing import Any

from mindpulse.common import formatting as fmt

from .data import RunData, as_int, load_run
from .headline import Checkpoint, Headline, LossPoint, badput, checkpoint_file, ettr_pct, failure_error, headline
from .markers import ANOMALY_COLOR, ATTEMPT_COLOR, CHECKPOINT_COLOR, anomaly_groups, plot_for_rule
from .plots import PLOTTERS, WIDE_PLOTS, Plot, draw_plots
from .rows import (
    ANOMALY_KEYS,
    ATTEMPT_KEYS,
    CHECKPOINT_KEYS,
    anomaly_cells,
    attempt_rows,
    checkpoint_cells,
    rank_table_rows,
)
from .text import final_tables

_MAX_TABLE_ROWS = 500
"""Rows of the anomaly timeline on the page; the rest are counted (anomalies.json holds all)."""

_CSS = """
:root { --ok: #2e7d32; --bad: #c62828; --other: #ef6c00; --muted: #5f6368; --line: #dadce0; }
* { box-sizing: border-box; }
body { font-family: system-ui, -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif; margin: 0 auto;
       padding: 16px 28px 48px; max-width: 1500px; color: #202124; line-height: 1.35; }
header.run { margin-bottom: 10px; }
header.run h1 { display: inline; font-size: 1.55em; margin: 0 12px 0 0; vertical-align: middle; }
.status { display: inline-block; padding: 3px 12px; border-radius: 4px; color: #fff; font-weight: 700;
          vertical-align: middle; letter-spacing: .02em; }
.ok { background: var(--ok); } .bad { background: var(--bad); } .other { background: var(--other); }
.why { font-size: 1.15em; margin: 8px 0 4px; }
.detail { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: .92em; margin: 4px 0;
          padding: 4px 10px; border-left: 4px solid var(--bad); background: #fdf1f0; overflow-wrap: anywhere; }
.detail.ok, .detail.other { border-left-color: var(--other); background: #fff6ec; }
.meta { color: var(--muted); font-size: .88em; margin: 4px 0; overflow-wrap: anywhere; }
.tiles { display: grid; grid-template-columns: repeat(auto-fill, minmax(185px, 1fr)); gap: 8px; margin: 12px 0; }
.tile { border: 1px solid var(--line); border-radius: 6px; padding: 7px 10px; background: #fafbfc; min-width: 0; }
.tile.span2 { grid-column: span 2; }
.tile .k { font-size: .72em; text-transform: uppercase; letter-spacing: .05em; color: var(--muted); }
.tile .v { font-size: 1.3em; font-weight: 650; margin: 2px 0; overflow-wrap: anywhere; }
.tile .s { font-size: .8em; color: #3c4043; overflow-wrap: anywhere; }
.tile .none { color: var(--muted); font-weight: 400; }
.lossrow { display: flex; align-items: flex-start; gap: 4px 10px; flex-wrap: wrap; }
.lp .n { font-size: 1em; } .lp .c { font-size: .55em; font-weight: 400; color: var(--muted); }
.lp.best .n { color: #1b5e20; } .lp.nonfinite .n { color: var(--bad); }
.lossrow .arrow { color: var(--muted); font-weight: 400; }
.tile .v.link { font-size: 1em; }
.goodput { border: 2px dashed #8fa3ad; border-radius: 6px; padding: 8px 12px; margin: 8px 0 12px;
           background: #f5f9fb; }
.goodput .k { font-size: .72em; text-transform: uppercase; letter-spacing: .05em; color: var(--muted); }
.goodput .v { font-size: 1.3em; font-weight: 650; }
.goodput .gline .s { margin-left: 8px; color: #3c4043; }
.gbar { display: flex; height: 10px; border-radius: 3px; overflow: hidden; margin: 6px 0 4px; background: #eee; }
.gbar span { display: block; height: 100%; }
.g-prod { background: var(--ok); } .g0 { background: #c62828; } .g1 { background: #ef6c00; }
.g2 { background: #f9a825; } .g3 { background: #8d6e63; } .g-un { background: #cfd8dc; }
ol.badput { list-style: none; padding: 0; margin: 2px 0; font-size: .88em; }
ol.badput li { display: inline-block; margin-right: 14px; }
.g-dot { display: inline-block; width: 9px; height: 9px; border-radius: 2px; margin-right: 4px; }
nav.toc { font-size: .9em; margin: 6px 0 14px; padding: 6px 0; border-top: 1px solid var(--line);
          border-bottom: 1px solid var(--line); }
nav.toc a { margin-right: 16px; color: #1a73e8; text-decoration: none; }
h2 { margin: 26px 0 8px; font-size: 1.25em; border-bottom: 1px solid var(--line); padding-bottom: 3px; }
table { border-collapse: collapse; margin: 6px 0; font-size: .88em; }
th, td { border: 1px solid #d5d7da; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f1f3f4; }
tr:target, tr.hl { background: #fff3c4; }
td.long, code { overflow-wrap: anywhere; }
td.long { min-width: 12em; }
pre { background: #f7f7f7; border: 1px solid #ddd; padding: 10px; overflow-x: auto; font-size: .84em; }
.note { color: #8a4b00; margin: 3px 0; } .empty { color: var(--muted); font-style: italic; }
.notes { border: 1px solid #f0c36d; background: #fff8e1; border-radius: 6px; padding: 4px 12px; margin: 8px 0; }
.plots { display: grid; grid-template-columns: repeat(auto-fit, minmax(min(100%, 560px), 1fr)); gap: 14px; }
figure { margin: 0; min-width: 0; }
figure.wide { grid-column: 1 / -1; }
figcaption { color: var(--muted); font-size: .86em; margin-top: 2px; }
.pimg { position: relative; display: inline-block; max-width: 100%; line-height: 0;
        border: 1px solid #eee; }
.pimg img { display: block; max-width: 100%; height: auto; }
.mk { position: absolute; width: 12px; margin-left: -6px; }
.mk:hover, .mk:focus { background: rgba(198, 40, 40, .16); outline: none; }
.mk.checkpoint:hover { background: rgba(46, 125, 50, .16); }
.mk.attempt:hover { background: rgba(128, 0, 128, .16); }
.missing-plot { color: var(--muted); font-style: italic; border: 1px dashed var(--line); padding: 10px;
                border-radius: 6px; }
a.marker { font-weight: 700; color: var(--bad); text-decoration: none; }
details { margin: 6px 0; } details > summary { cursor: pointer; font-weight: 600; }
.legend-line { font-size: .86em; color: var(--muted); }
"""


def _e(x: Any) -> str:
    """Text escaped for HTML, quotes included (it may stand in an attribute)."""
    return html.escape(str(x), quote=True)


_LONG_TOKEN = 32
"""A cell holding a word longer than this (hashes, paths) may break anywhere, so a table
never runs past the right edge of a narrow window."""


def _html_cell(value: Any, raw: bool = False) -> str:
    text = str(value)
    cls = ' class="long"' if any(len(tok) > _LONG_TOKEN for tok in text.split()) else ""
    return f"<td{cls}>{text if raw else _e(text)}</td>"


def _html_table(headers: list[str], rows: list[list[Any]], empty: str, row_attrs: list[str] | None = None,
                raw_cols: tuple[int, ...] = ()) -> str:
    """A table; `raw_cols` hold markup already escaped (links)."""
    if not rows:
        return f'<p class="empty">{_e(empty)}</p>'
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = []
    for i, row in enumerate(rows):
        attrs = row_attrs[i] if row_attrs else ""
        cells = "".join(_html_cell(c, raw=j in raw_cols) for j, c in enumerate(row))
        body.append(f"<tr{attrs}>{cells}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _first_ids(anchors: list[str | None]) -> list[str]:
    """Row attributes: each anchor as the id of the first row that has it (a marker's link
    lands there), nothing on the later rows of the same step or on rows without one."""
    seen: set[str] = set()
    out = []
    for a in anchors:
        out.append(f' id="{a}"' if a is not None and a not in seen else "")
        if a is not None:
            seen.add(a)
    return out


def _href(target: Path, out_dir: Path) -> str:
    try:
        rel = os.path.relpath(target, out_dir)
    except ValueError:  # another drive (Windows)
        rel = str(target)
    return urllib.parse.quote(Path(rel).as_posix())


def _ckpt_link(ck: Checkpoint, out_dir: Path, ident: str = "") -> str:
    idattr = f' id="{ident}"' if ident else ""
    missing = "" if ck.exists else ' title="not found on this machine (rank 0 writes checkpoints on its host)"'
    return f'<a{idattr} href="{_e(_href(ck.file, out_dir))}"{missing}>{_e(ck.name)}</a>'


def _tile(key: str, value: str, sub: str = "", cls: str = "", ident: str = "", vcls: str = "") -> str:
    idattr = f' id="{ident}"' if ident else ""
    return (f'<div class="tile {cls}"{idattr}><div class="k">{_e(key)}</div> <div class="v {vcls}">{value}</div> '
            + (f'<div class="s">{sub}</div>' if sub else "") + "</div>")


def _loss_tile(h: Headline) -> str:
    def part(p: LossPoint | None, what: str) -> str:
        if p is None:
            return f'<div class="lp"><div class="n none">-</div><div class="c">{what}</div></div>'
        step = f" · step {p.step}" if p.step is not None else ""
        bad = "" if fmt.is_number(p.value) else " nonfinite"
        return (f'<div class="lp {what}{bad}" id="loss-{what}"><div class="n">{_e(fmt.metric(p.value))}</div> '
                f'<div class="c">{what}{_e(step)}</div></div>')
    if not (h.loss_first or h.loss_best or h.loss_last):
        return _tile("loss (mean over ranks)", '<span class="none">not reported</span>', cls="span2 loss",
                     ident="loss-figures")
    arrow = ' <div class="arrow">→</div> '
    value = ('<div class="lossrow">' + arrow.join([part(h.loss_first, "first"), part(h.loss_best, "best"),
                                                   part(h.loss_last, "last")]) + "</div>")
    sub = ""
    if h.loss_first and h.loss_last and fmt.is_number(h.loss_first.value) and fmt.is_number(h.loss_last.value) \
            and h.loss_first.value:
        change = 100.0 * (h.loss_last.value - h.loss_first.value) / abs(h.loss_first.value)
        sub = f"{change:+.1f}% from first to last"
    elif h.loss_last and not fmt.is_number(h.loss_last.value):
        sub = "the last loss is not finite"
    return _tile("loss (mean over ranks)", value, _e(sub), cls="span2 loss", ident="loss-figures")


def _header_html(h: Headline, data: RunData, out_dir: Path) -> list[str]:
    parts = [
        '<header class="run" id="top">',
        f'<h1>{_e(h.name)}</h1><span class="status {h.status_class}" id="status">{_e(h.status)}</span>',
        f'<p class="why" id="why">{_e(h.why[:1].upper() + h.why[1:])}.</p>',
    ]
    if h.detail:
        parts.append(f'<p class="detail {h.status_class}" id="why-detail">{_e(h.detail)}</p>')
    meta = [f"run directory <code>{_e(data.run_dir)}</code>"]
    parts.append(f'<p class="meta">{" · ".join(meta)}</p></header>')

    tiles = []
    wall_sub = _e(fmt.time_span(h.started, h.ended)) if h.started else ""
    if h.wall_source:
        wall_sub += ("<br>" if wall_sub else "") + _e(h.wall_source)
    tiles.append(_tile("wall time", _e(h.wall_text()), wall_sub, ident="wall-time"))
    steps_sub = []
    if h.epoch:
        steps_sub.append(f"epoch {h.epoch}")
    if h.attempts > 1:
        steps_sub.append(f'<a href="#attempts">{fmt.plural(h.attempts, "attempt")}</a>')
    tiles.append(_tile("steps", _e(h.steps_text()), " · ".join(steps_sub), ident="steps"))
    tiles.append(_loss_tile(h))
    if data.metrics_read:
        thr = (f"{_e(fmt.rate(h.samples_per_s))} samples/s" if h.samples_per_s is not None
               else '<span class="none">not reported</span>')
        thr_sub = (f"{_e(fmt.duration(h.step_time_s))} per step (slowest rank); medians over steps"
                   if h.step_time_s is not None else "")
        tiles.append(_tile("throughput", thr, thr_sub, ident="throughput"))
    world_sub = _e(h.world_shape)
    if data.metrics_read:
        world_sub += ("<br>" if world_sub else "") + _e(h.cards_text(limit=3))
    tiles.append(_tile("world", _e(fmt.plural(h.world_size, "rank")), world_sub, ident="world"))
    if h.best is not None:
        tiles.append(_tile("best checkpoint", _ckpt_link(h.best, out_dir, "best-checkpoint"),
                           _e(h.best.describe()), ident="best", vcls="link"))
    else:
        tiles.append(_tile("best checkpoint", '<span class="none">none saved</span>', ident="best"))
    if h.latest is not None and (h.best is None or h.latest.file != h.best.file):
        tiles.append(_tile("latest checkpoint", _ckpt_link(h.latest, out_dir, "latest-checkpoint"),
                           _e(h.latest.describe() + (f", {h.latest.kind}" if h.latest.kind else "")), ident="latest",
                           vcls="link"))
    elif h.latest is not None:
        tiles.append(_tile("latest checkpoint", '<span class="none">same as the best</span>', ident="latest",
                           vcls="link"))
    anom = (f'<a href="#anomalies">{h.anomalies}</a>' if h.anomalies else '<span class="none">none</span>')
    anom_sub = _e(", ".join(f"{rule} ×{n} ({acts})" for rule, n, acts in h.anomaly_counts[:3])
                  + (f", +{len(h.anomaly_counts) - 3} rules" if len(h.anomaly_counts) > 3 else ""))
    tiles.append(_tile("anomalies", anom, anom_sub, ident="anomaly-count"))
    parts.append('<section class="tiles" id="figures">' + "".join(tiles) + "</section>")
    if h.goodput is not None:
        parts.append(_goodput_html(h.goodput))
    return parts


def _goodput_html(g: dict[str, Any]) -> str:
    """ETTR, a bar of productive time and the badput causes, and the largest causes (summary.json `goodput`)."""
    pct = ettr_pct(g)
    wall, prod = g.get("wall_s"), g.get("productive_s")
    value = f"ETTR {pct:.1f}%" if pct is not None else "ETTR -"
    sub = (f"productive {fmt.duration(prod)} of {fmt.duration(wall)} wall time"
           if fmt.is_number(prod) and fmt.is_number(wall) else "")
    unaccounted = g.get("unaccounted_s") if fmt.is_number(g.get("unaccounted_s")) and g["unaccounted_s"] > 0 else None
    if unaccounted is not None:
        sub += f"; {fmt.duration(unaccounted)} unaccounted (between the measured parts of the steps)"
    causes = badput(g)
    known = fmt.is_number(wall) and wall > 0

    def share(v: float) -> str:
        return f"{100 * v / wall:.1f}%" if known else "-"

    bar = ""
    if known and fmt.is_number(prod):
        segs = [f'<span class="g-prod" style="width:{100 * prod / wall:.2f}%" '
                f'title="productive {_e(fmt.duration(prod))}"></span>']
        for i, (k, v) in enumerate(causes):
            segs.append(f'<span class="g-bad g{min(i, 3)}" style="width:{100 * v / wall:.2f}%" '
                        f'title="{_e(k)} {_e(fmt.duration(v))} ({share(v)})"></span>')
        if unaccounted is not None:
            segs.append(f'<span class="g-un" style="width:{100 * unaccounted / wall:.2f}%" '
                        f'title="unaccounted {_e(fmt.duration(unaccounted))} ({share(unaccounted)})"></span>')
        bar = '<div class="gbar">' + "".join(segs) + "</div>"
    top = [f'<li><span class="g-dot g{min(i, 3)}"></span><b>{_e(k)}</b> {_e(fmt.duration(v))} ({share(v)})</li>'
           for i, (k, v) in enumerate(causes[:3])]
    if len(causes) > 3:
        rest = sum(v for _, v in causes[3:])
        top.append(f'<li><span class="g-dot g3"></span>{len(causes) - 3} more {_e(fmt.duration(rest))} '
                   f"({share(rest)})</li>")
    listing = ('<ol class="badput"><li class="lead">badput:</li>' + "".join(top) + "</ol>") if top else \
        '<p class="s">no badput recorded</p>'
    table = ""
    if len(causes) > 3:
        table = ("<details><summary>every badput cause</summary>"
                 + _html_table(["badput cause", "time", "of wall time"],
                               [[k, fmt.duration(v), share(v)] for k, v in causes], "-") + "</details>")
    return ('<section class="goodput" id="goodput"><div class="k">goodput (effective training time ratio)</div>'
            f'<div class="gline"><span class="v">{_e(value)}</span> <span class="s">{_e(sub)}</span></div>'
            f"{bar}{listing}{table}</section>")


def _plot_html(p: Plot, title: str, out_dir: Path) -> str:
    wide = " wide" if p.path.name in WIDE_PLOTS else ""
    if not p.drawn:
        return (f'<figure class="plot{wide}" id="{p.anchor}"><div class="missing-plot">{_e(title)}: '
                f"{_e(p.message)}</div></figure>")
    b64 = base64.b64encode(p.path.read_bytes()).decode("ascii")
    links = "".join(
        f'<a class="mk {lk.kind}" href="{_e(lk.href)}" title="{_e(lk.title)}" aria-label="{_e(lk.title)}" '
        f'style="left:{lk.left:.2f}%;top:{lk.top:.2f}%;height:{lk.height:.2f}%"></a>' for lk in p.links)
    caption = f"{_e(title)} ({_e(p.path.name)})" + (f" — {_e(p.message)}" if p.message else "")
    return (f'<figure class="plot{wide}" id="{p.anchor}"><div class="pimg">'
            f'<img alt="{_e(p.path.stem)}" src="data:image/png;base64,{b64}">{links}</div>'
            f"<figcaption>{caption}</figcaption></figure>")


def _anomaly_html(data: RunData) -> str:
    groups = anomaly_groups(data)
    if not data.anomalies:
        return '<p class="empty">no anomalies recorded</p>'
    label_of = {g.step: g for g in groups}
    headers = ["marker", *ANOMALY_KEYS]
    rows, anchors = [], []
    for a in data.anomalies[:_MAX_TABLE_ROWS]:
        step = as_int(a.get("step"))
        g = label_of.get(step) if step is not None else None
        if g is not None:
            plot = "plot-" + plot_for_rule(str(a.get("rule") or ""))
            marker = f'<a class="marker" href="#{plot}" title="see the marker on the plot">{_e(g.label)}</a>'
        else:
            marker = "-"
        rows.append([marker, *[_e(c) for c in anomaly_cells(a)]])
        anchors.append(g.anchor if g is not None else None)
    out = _html_table(headers, rows, "no anomalies recorded", _first_ids(anchors),
                      raw_cols=tuple(range(len(headers))))
    if len(data.anomalies) > _MAX_TABLE_ROWS:
        out += f'<p class="note">… {len(data.anomalies) - _MAX_TABLE_ROWS} more in anomalies.json</p>'
    return out


def _checkpoints_html(data: RunData, h: Headline, out_dir: Path) -> str:
    if not data.checkpoints:
        extra = ""
        if h.best is not None:
            extra = f" (summary.json names the best one: {_ckpt_link(h.best, out_dir)}, {_e(h.best.describe())})"
        return f'<p class="empty">no checkpoints in checkpoints/manifest.json{extra}</p>'
    rows, anchors = [], []
    for c in data.checkpoints:
        cells = [_e(x) for x in checkpoint_cells(data, c, short_sha=False)]
        ck = checkpoint_file(data, c)
        if ck is not None:
            cells[3] = _ckpt_link(ck, out_dir)
        step = as_int(c.get("step"))
        anchors.append(f"ckpt-{step}" if step is not None else None)
        rows.append(cells)
    return _html_table(list(CHECKPOINT_KEYS), rows, "no checkpoints", _first_ids(anchors), raw_cols=tuple(range(6)))


def _failure_html(data: RunData) -> list[str]:
    f = (data.summary or {}).get("failure")
    if not isinstance(f, dict):
        return []
    parts = ['<section id="failure"><h2>Failure</h2>']
    rows = [["kind", f.get("kind")], ["root-cause rank", f.get("root_cause_rank")], ["at step", f.get("step")],
            ["exit code", f.get("exit_code")], ["signal", f.get("signal")], ["ranks", f.get("ranks")],
            ["error", failure_error(f)]]
    body = "".join(f"<tr><th>{_e(k)}</th>"
                   f"{_html_cell(', '.join(map(str, v)) if isinstance(v, list) else fmt.cell(v))}</tr>"
                   for k, v in rows if v not in (None, "", []))
    parts.append(f'<table class="kv">{body}</table>')
    errs = [e for e in (f.get("errors") or []) if isinstance(e, dict)]
    if len(errs) > 1:
        parts.append(_html_table(["error", "ranks"], [[e.get("error"), ", ".join(map(str, e.get("ranks") or []))]
                                                      for e in errs], "-"))
    root = f.get("root_cause_rank")
    if f.get("traceback"):
        parts.append(f"<details><summary>traceback of rank {_e(root)}</summary><pre>{_e(f['traceback'])}</pre>"
                     "</details>")
    if f.get("log_tail"):
        parts.append(f"<details><summary>last lines of logs/rank_{_e(root)}.log</summary>"
                     f"<pre>{_e(f['log_tail'])}</pre></details>")
    parts.append("</section>")
    return parts


def _render_html(data: RunData, plots: list[Plot], out_dir: Path) -> str:
    h = headline(data)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{_e(h.status)} · {_e(h.name)} · mindpulse report</title>",
        f"<style>{_CSS}</style></head><body>",
    ]
    parts += _header_html(h, data, out_dir)
    nav = [("plots", "Plots"), ("anomalies", f"Anomalies ({len(data.anomalies)})"),
           ("checkpoints", f"Checkpoints ({len(data.checkpoints)})"), ("attempts", f"Attempts ({h.attempts})"),
           ("ranks", "Ranks")]
    if isinstance((data.summary or {}).get("failure"), dict):
        nav.insert(0, ("failure", "Failure"))
    nav.append(("raw", "Raw data"))
    parts.append('<nav class="toc">' + "".join(f'<a href="#{a}">{_e(t)}</a>' for a, t in nav) + "</nav>")

    notes = list(data.notes)
    if not data.has_steps and data.metrics_read:
        notes.insert(0, "No data: metrics.msgpack holds no step packets.")
    if notes:
        parts.append('<div class="notes" id="notes">' + "".join(f'<p class="note">{_e(n)}</p>' for n in notes)
                     + "</div>")

    parts += _failure_html(data)

    parts.append('<section id="plots"><h2>Plots</h2>')
    parts.append(f'<p class="legend-line">Markers: <span style="color:{ANOMALY_COLOR}">red dashed</span> = anomaly '
                 f'(A1, A2, … as in the <a href="#anomalies">timeline</a>), '
                 f'<span style="color:{CHECKPOINT_COLOR}">green dashed</span> = checkpoint'
                 + (f', <span style="color:{ATTEMPT_COLOR}">purple dotted</span> = where a restarted attempt resumed'
                    if data.attempt_starts else "")
                 + "; a gold star marks the best loss. Click a marker for its row.</p>")
    parts.append('<div class="plots">')
    for p in plots:
        parts.append(_plot_html(p, PLOTTERS.get(p.name, (p.path.stem, None))[0], out_dir))
    parts.append("</div></section>")

    parts.append('<section id="anomalies"><h2>Anomalies</h2>')
    parts.append(_anomaly_html(data))
    parts.append("</section>")

    parts.append('<section id="checkpoints"><h2>Checkpoints</h2>')
    parts.append(_checkpoints_html(data, h, out_dir))
    parts.append("</section>")

    parts.append('<section id="attempts">')
    parts.append("<h2>Attempts</h2>")
    arows = attempt_rows(data)
    if data.multi_attempt:
        parts.append("<p>The run was restarted (<code>max_restarts</code>): each step is shown from the newest "
                     "attempt that ran it; an attempt's steps from where the next one resumed are superseded.</p>")
        parts.append(_html_table(list(ATTEMPT_KEYS), [r for _, r in arows], "no attempts",
                                 [f' id="attempt-{k}"' for k, _ in arows]))
    else:
        parts.append('<p class="empty">one attempt, no restarts</p>')
    parts.append("</section>")

    parts.append('<section id="ranks"><h2>Ranks</h2>')
    headers, rows = rank_table_rows(data)
    parts.append(_html_table(headers, rows, "no ranks reported"))
    parts.append("</section>")

    parts.append('<section id="profiler"><h2>Profiler output</h2>')
    if data.profile_dirs:
        items = []
        for d in data.profile_dirs:
            rel = Path(os.path.relpath(d, out_dir)).as_posix() + "/"
            items.append(f'<li><a href="{_e(urllib.parse.quote(rel))}">{_e(d.name)}</a></li>')
        parts.append("<ul>" + "".join(items) + "</ul>")
    else:
        parts.append('<p class="empty">no profiler output</p>')
    parts.append("</section>")

    parts.append('<section id="raw"><h2>Raw data</h2>')
    if data.summary is not None:
        raw = json.dumps(data.summary, indent=2, sort_keys=False, default=str)
        parts.append(f'<details id="raw-summary"><summary>summary.json</summary><pre>{_e(raw)}</pre></details>')
    else:
        parts.append('<p class="empty">no summary.json</p>')
    if data.config_text is not None:
        parts.append(f'<details id="raw-config"><summary>config.yaml (the resolved config)</summary>'
                     f"<pre>{_e(data.config_text)}</pre></details>")
    else:
        parts.append('<p class="empty">no config.yaml</p>')
    parts.append(f'<details id="raw-console"><summary>the end-of-run summary as the console prints it</summary>'
                 f"<pre>{_e(final_tables(data))}</pre></details>")
    parts.append("</section>")
    parts.append("</body></html>")
    return "\n".join(parts)


def build_report(run_dir: Path | str, out_dir: Path | str | None = None, data: RunData | None = None) -> dict:
    """Write PNG plots and `report.html` for a run; returns where they are and what they hold.
    `data`: what `load_run(run_dir)` read, when the caller has it already."""
    if data is None:
        data = load_run(run_dir)
    out = Path(out_dir) if out_dir is not None else data.run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    plots = draw_plots(data, out)
    html_path = out / "report.html"
    tmp = html_path.with_name(html_path.name + ".tmp")
    tmp.write_text(_render_html(data, plots, out), encoding="utf-8")
    os.replace(tmp, html_path)
    return {
        "out_dir": str(out),
        "plots": [str(p.path) for p in plots],
        "drawn": [p.path.name for p in plots if p.drawn],
        "html": str(html_path),
        "steps": len(data.reduced),
        "world_size": data.world_size,
        "attempts": len(data.attempts) or 1,
        "metrics": data.metrics,
    }
