"""The run's end-of-run summary as console text: the launcher prints it at the end of every run,
and the page folds it away at the bottom. The same headline in the same order as the page:
status and why first, then the figures that matter (dates, not epoch numbers), the anomaly
timeline, the attempts, the checkpoints and the ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tabulate import tabulate

from mindpulse.common import formatting as fmt
from mindpulse.registry.metrics import total_words, with_unit

from .data import RunData, load_run
from .headline import Headline, compute_text, goodput_text, headline
from .rows import (
    ANOMALY_KEYS,
    ATTEMPT_KEYS,
    CHECKPOINT_KEYS,
    anomaly_cells,
    attempt_rows,
    checkpoint_rows,
    rank_table_rows,
)

_CONSOLE_ANOMALIES = 20
"""Rows of the anomaly timeline on the console."""
_CONSOLE_RANKS = 16
"""Up to this many ranks the console lists every rank; above, the ranks that failed."""


def _headline_rows(h: Headline, data: RunData) -> list[tuple[str, str]]:
    """The headline as (label, text) rows, in the page's order."""
    rows = [("wall time", h.wall_text() + (f"  ({fmt.time_span(h.started, h.ended)})" if h.started else "")
             + (f"  {h.wall_source}" if h.wall_source else ""))]
    if h.started and not h.wall_s:
        rows[0] = ("started", fmt.when(h.started))
    rows.append(("steps", h.steps_text() + (f"  (epoch {h.epoch})" if h.epoch else "")
                 + (f"  in {fmt.plural(h.attempts, 'attempt')}" if h.attempts > 1 else "")))
    rows.append(("loss (mean)", h.loss_text()))
    rows.append(("throughput", h.throughput_text() if data.metrics_read else "-"))
    comp = compute_text((data.summary or {}).get("compute"))
    if comp:
        rows.append(("compute", comp))
    world = fmt.plural(h.world_size, "rank") + (f" ({h.world_shape})" if h.world_shape else "")
    rows.append(("world", world + ("; " + h.cards_text() if data.metrics_read else "")))
    if h.goodput is not None:
        rows.append(("goodput", goodput_text(h.goodput)))
    if h.best is not None:
        rows.append(("best checkpoint", f"{h.best.describe()}  {_display_path(h.best.file, data.run_dir)}"))
    else:
        rows.append(("best checkpoint", "none saved"))
    if h.latest is not None and (h.best is None or h.latest.file != h.best.file):
        rows.append(("latest checkpoint", f"{h.latest.describe()}  {_display_path(h.latest.file, data.run_dir)}"))
    rows.append(("anomalies", h.anomalies_text()))
    return rows


def _display_path(p: Path, run_dir: Path) -> str:
    """A path inside the run directory relative to it, any other as it is."""
    try:
        return str(p.relative_to(run_dir))
    except ValueError:
        return str(p)


def _table(rows: list[list[Any]], headers: Sequence[str]) -> str:
    """A console table of display strings (tabulate does not reformat them as numbers)."""
    return tabulate(rows, headers=list(headers), tablefmt="simple", disable_numparse=True)


def final_tables(run: Path | str | RunData) -> str:
    """The run's end-of-run summary as console text: the status and why first, then the
    figures that matter (dates, not epoch numbers), the anomaly timeline, the attempts and
    the ranks. Takes a run directory or what `load_run` read from one."""
    data = run if isinstance(run, RunData) else load_run(run)
    h = headline(data)
    head = f"run {h.name}: {h.status} — {h.why}"
    if h.detail:
        head += f"\n  {h.detail}"
    parts = [head]
    figures = _headline_rows(h, data)
    width = max(len(k) for k, _ in figures)
    parts.append("\n".join(f"  {k:<{width}}  {v}" for k, v in figures))
    if not data.has_steps and data.metrics_read:
        parts.append("no data: metrics.msgpack holds no step packets")
    advice = data.summary.get("advice") if isinstance(data.summary, dict) else None
    if isinstance(advice, list) and advice:
        parts.append("advice\n" + "\n".join(f"  - {a.get('message')}" + (f" (to fix: {a['fix']})" if a.get("fix")
                                                                          and a.get("kind") == "no_monitor" else "")
                                            for a in advice if isinstance(a, dict)))
    if data.anomalies:
        shown = data.anomalies[:_CONSOLE_ANOMALIES]
        more = len(data.anomalies) - len(shown)
        parts.append("anomalies (timeline)\n" + _table([anomaly_cells(a) for a in shown], ANOMALY_KEYS)
                     + (f"\n… {more} more in anomalies.json" if more > 0 else ""))
    if data.multi_attempt:
        parts.append("attempts (each step from the newest attempt that ran it)\n"
                     + _table([r for _, r in attempt_rows(data)], ATTEMPT_KEYS))
    if data.checkpoints and len(data.checkpoints) > 1:
        parts.append("checkpoints\n" + _table(checkpoint_rows(data), CHECKPOINT_KEYS))
    many = data.world_size > _CONSOLE_RANKS
    headers, rows = rank_table_rows(data, only_failed=many)
    if rows:
        title = f"ranks that failed ({len(rows)} of {data.world_size})" if many else "ranks"
        parts.append(title + "\n" + _table(rows, headers))
    tot = data.totals()
    pk = tot.get("packets") if isinstance(tot.get("packets"), dict) else {}
    mon = []
    if pk:
        mon.append(f"{pk.get('accepted', 0)} packets accepted, {pk.get('rejected', 0)} rejected"
                   + (f", {pk['dropped']} dropped" if pk.get("dropped") else ""))
    for key, words, unit in total_words():  # the registry's run totals (Reduction.total), in their unit
        if fmt.is_number(tot.get(key)):
            mon.append(f"ranks {words} {with_unit(tot[key], unit)} in all")
    if tot.get("fingerprints_equal") is not None:
        mon.append("parameters equal on every rank" if tot["fingerprints_equal"] else
                   "PARAMETERS DIFFER between ranks")
    if mon:
        parts.append("monitor: " + "; ".join(mon))
    m = data.metrics
    if m.get("damaged_bytes_skipped") or m.get("thinned_segments"):
        parts.append(f"metrics: {m.get('segments', 0)} segment(s), {m.get('damaged_bytes_skipped', 0)} damaged "
                     f"byte(s) skipped in {m.get('damaged_stretches', 0)} stretch(es), "
                     f"{m.get('thinned_segments', 0)} thinned segment(s)")
    return "\n\n".join(parts)
