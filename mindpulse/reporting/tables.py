"""Cluster tables for the console (tabulate): one row per rank and a cluster line, the
per-card table, and the end-of-run rank and totals tables. The driver prints them as the
aggregator renders them; `mindpulse top` renders the same tables from a run directory.
Every number is written by `mindpulse.common.formatting`."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from tabulate import tabulate

from mindpulse.common.formatting import finite_float, number
from mindpulse.config import MonitorConfig
from mindpulse.reduction.reducer import ReducedStep
from mindpulse.registry.metrics import columns, total_words, with_unit

MAX_TABLE_RANKS = 16
"""Above this many ranks the table shows the ranks that matter and counts the rest."""


_COLUMNS = columns()
"""The metric registry's columns (mindpulse/registry/metrics.py, `StepMetric.column`), between the rank
and step and the fingerprint and note."""


def cluster_table(red: ReducedStep, total_steps: int | None = None,
                  straggler_threshold: float = MonitorConfig.straggler_threshold,
                  ranks: range | None = None) -> str:
    """The step's table: every rank up to MAX_TABLE_RANKS, else the ranks that matter and a
    count of the rest; `ranks`: exactly those ranks (a page of `mindpulse top`)."""
    rows = []
    shown = red.per_rank
    if ranks is not None:
        shown = {r: red.per_rank[r] for r in ranks if r in red.per_rank}
    elif len(shown) > MAX_TABLE_RANKS or len(shown) < red.world_size:
        matter = red.ranks_that_matter(straggler_threshold)
        shown = {r: p for r, p in red.per_rank.items() if r in matter}
    for r, p in shown.items():
        mark = []
        if r in red.nonfinite_ranks:
            mark.append("NONFINITE")
        score = red.straggler_scores.get(r)
        if score is not None and score < straggler_threshold:
            mark.append(f"STRAGGLER {score:.2f}")
        rows.append([r, red.step, *(c.rank_cell(p, red) for c in _COLUMNS), (p.fingerprint or "")[:12], " ".join(mark)])
    hidden = red.world_size - len(shown)
    if hidden > 0:
        what = "other ranks, within the ranges of the row below"
        if ranks is not None and shown:
            what = f"other ranks (shown: {min(shown)}..{max(shown)})"
        rows.append([f"+{hidden}", red.step, *[""] * (len(_COLUMNS) + 1), what])
    note = f"lr {number(red.lr, '.2e')}"
    if red.loss_scale_min is not None:  # a loss-scale cell runs: its scale and the steps it skipped
        scale = number(red.loss_scale_min, ".4g")
        if red.loss_scale_max is not None and red.loss_scale_max != red.loss_scale_min:
            scale += f"..{number(red.loss_scale_max, '.4g')}"
        note += f"  loss scale {scale}  overflow steps {red.overflow_steps}"
        if red.overflow_ranks:
            note += " (this step skipped)"
    if red.extra:
        note += "  " + "  ".join(f"{k} {number(v)}" for k, v in red.extra.items())
    rows.append(["all", red.step, *(c.cluster_cell(red) for c in _COLUMNS), "", note])
    of = f"/{total_steps}" if total_steps else ""
    head = f"step {red.step}{of}  epoch {red.epoch}  ranks {red.world_size}"
    table = tabulate(
        rows,
        headers=["rank", "step", *(c.header for c in _COLUMNS), "fingerprint", "note"],
        tablefmt="simple",
        disable_numparse=True,
    )
    return head + "\n" + table


def summary_table(ranks: Iterable[dict[str, Any]]) -> str:
    rows = [
        [
            r.get("rank"),
            r.get("last_step"),
            r.get("exit_code"),
            (r.get("param_fingerprint") or "-")[:16],
            r.get("host") or "-",
            r.get("pid") or "-",
        ]
        for r in ranks
    ]
    return tabulate(rows, headers=["rank", "last step", "exit", "fingerprint", "host", "pid"], tablefmt="simple")


def totals_table(summary: dict[str, Any]) -> str:
    rows = [
        ["status", summary.get("status")],
        ["steps completed", summary.get("steps_completed")],
        ["world size", summary.get("world_size")],
        ["first loss (mean)", number(summary.get("first_loss"))],
        ["last loss (mean)", number(summary.get("last_loss"))],
        ["best loss (mean)", number(summary.get("best_loss"))],
        ["fingerprints equal", summary.get("fingerprints_equal")],
        ["packets accepted", summary.get("packets", {}).get("accepted")],
        ["packets rejected", summary.get("packets", {}).get("rejected")],
        # the registry's run totals: a key in seconds says so (`monitor_wait_s`), another its unit
        *([f"{key.replace('_', ' ')} (all ranks)", number(summary.get(key), ".3f") if unit == "s"
           else with_unit(summary.get(key), unit)] for key, _, unit in total_words()),
        ["wall time s", number(summary.get("wall_time_s"), ".1f")],
    ]
    if summary.get("stop"):
        rows.append(["stop", summary["stop"].get("message")])
    return tabulate(rows, tablefmt="simple")


MAX_CARD_ROWS = 64
"""Above this many cards (8 nodes of 8) the card table lists only the cards worth a look
(`cards_worth_a_row`) and one line over all of them: at 32,768 cards a row per card was
~1.2 s of the aggregator's CPU and 3 MB of text per table."""
CARD_ROWS_PER_KIND = 8
"""Cards listed for each of hottest, most power-hungry, fullest, idlest (and unhealthy)."""
CARD_EXTREMES = (("temp_c", True), ("power_w", True), ("memory_used_mb", True), ("util_pct", False))
"""(card field, whether its largest value is the one worth a look): hot, power-hungry, full,
and for utilisation the idlest. The console table, the Prometheus endpoint and TensorBoard
pick a big job's cards by it."""
_SEVERITY = {"CRITICAL": 4, "ALARM": 3, "WARNING": 2}
"""npu-smi's health words, worst first; anything else not OK (UNKNOWN) ranks below them."""
CardValues = dict[str, list[tuple[float, int]]]
"""Per field of CARD_EXTREMES: (finite value, index of its card)."""


def card_values(cards: list[dict[str, Any]]) -> CardValues:
    """Each field's finite values over `cards`, read once for the rows and the summary line."""
    return {key: [(v, i) for i, c in enumerate(cards) if (v := finite_float(c.get(key))) is not None]
            for key, _ in CARD_EXTREMES}


def cards_worth_a_row(cards: list[dict[str, Any]], values: CardValues | None = None) -> list[dict[str, Any]]:
    """The hottest, most power-hungry, fullest and idlest cards (CARD_ROWS_PER_KIND each),
    and those whose health is not OK: what an operator scans a big cluster's table for."""
    import heapq

    values = card_values(cards) if values is None else values
    picked: set[int] = set()
    for key, biggest in CARD_EXTREMES:
        pick = heapq.nlargest if biggest else heapq.nsmallest
        picked.update(i for _, i in pick(CARD_ROWS_PER_KIND, values[key]))
    unhealthy = [(_SEVERITY.get(h, 1), i) for i, c in enumerate(cards)
                 if (h := str(c.get("health") or "OK").upper()) not in ("OK", "-", "")]
    picked.update(i for _, i in heapq.nlargest(CARD_ROWS_PER_KIND, unhealthy, key=lambda x: (x[0], -x[1])))
    return [cards[i] for i in sorted(picked)]


def _cards_line(total: int, shown: int, values: CardValues) -> str:
    """One line over every card: the spread of each value."""
    parts = []
    for key, label, unit in (("util_pct", "util", "%"), ("temp_c", "temp", " C"), ("power_w", "power", " W"),
                             ("memory_used_mb", "memory", " MB")):
        vals = [v for v, _ in values[key]]
        if vals:
            parts.append(f"{label} {min(vals):.0f}/{sum(vals) / len(vals):.0f}/{max(vals):.0f}{unit}")
    spread = ("; min/mean/max over all " + f"{total:,} cards: " + ", ".join(parts)) if parts else ""
    return (f"{total - shown:,} more cards not listed (above {MAX_CARD_ROWS} cards the table lists the "
            f"hottest, most power-hungry, fullest, idlest and unhealthy ones){spread}")


def card_table(cards: Iterable[dict[str, Any]], tflops_of: Callable[[dict[str, Any]], float | None] | None = None
               ) -> str:
    """Latest sample per card: node, card, ranks, util, memory, power, temp, health; with
    `tflops_of` (the aggregator's newest achieved TFLOPS of the card's ranks) a `TFLOPS`
    column beside the utilisation. Above MAX_CARD_ROWS cards only those worth a row, and a
    line over all of them."""
    every = list(cards)
    values = card_values(every) if len(every) > MAX_CARD_ROWS else None
    shown = every if values is None else cards_worth_a_row(every, values)
    rows = []
    for c in sorted(shown, key=lambda c: (str(c.get("node")), c.get("card") if isinstance(c.get("card"), int) else -9)):
        used, total = c.get("memory_used_mb"), c.get("memory_total_mb")
        mem = "-" if used is None else (f"{used:.0f}/{total:.0f} MB" if total else f"{used:.0f} MB")
        card = c.get("card")
        rows.append([
            c.get("node"),
            c.get("name") if card == -1 else card,
            ",".join(str(r) for r in c.get("ranks") or []) or "-",
            number(c.get("util_pct"), ".0f") + ("%" if c.get("util_pct") is not None else ""),
            *([number(tflops_of(c), ".3g")] if tflops_of is not None else []),
            mem,
            number(c.get("power_w"), ".1f"),
            number(c.get("temp_c"), ".0f"),
            c.get("health") or "-",
        ])
    headers = ["node", "card", "ranks", "util", *(["TFLOPS"] if tflops_of is not None else []), "memory", "power W",
               "temp C", "health"]
    table = tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True)
    return table if values is None else table + "\n" + _cards_line(len(every), len(shown), values)
