"""Parsed cards as a plain-text table, for the CLI (`mindpulse telemetry parse-npu-smi`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .values import NpuCard


def _fmt_num(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if v.is_integer() and abs(v) < 1e15:
            return str(int(v))
        return f"{v:.1f}"
    return str(v)


def _fmt_pair(used: Any, total: Any) -> str:
    if used is None and total is None:
        return "-"
    return f"{_fmt_num(used)}/{_fmt_num(total)}"


def format_cards_table(cards: Iterable[NpuCard | dict[str, Any]]) -> str:
    """Plain-text table of cards for the CLI (one line per chip, no trailing newline)."""
    headers = ["NPU", "Chip", "Phy", "Name", "Health", "Power(W)", "Temp(C)", "AICore(%)",
               "HBM(MB)", "Memory(MB)", "Bus-Id", "Procs"]
    rows: list[list[str]] = []
    for card in cards or []:
        d = card.to_dict() if isinstance(card, NpuCard) else dict(card)
        rows.append(
            [
                _fmt_num(d.get("npu")),
                _fmt_num(d.get("chip")),
                _fmt_num(d.get("phy_id")),
                str(d.get("name") or "-"),
                str(d.get("health") or "-"),
                _fmt_num(d.get("power_w")),
                _fmt_num(d.get("temp_c")),
                _fmt_num(d.get("aicore_pct")),
                _fmt_pair(d.get("hbm_used_mb"), d.get("hbm_total_mb")),
                _fmt_pair(d.get("memory_used_mb"), d.get("memory_total_mb")),
                str(d.get("bus_id") or "-"),
                str(len(d.get("processes") or [])),
            ]
        )
    widths = [len(h) for h in headers]
    for r in rows:
        for i, cell in enumerate(r):
            widths[i] = max(widths[i], len(cell))
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for r in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return "\n".join(lines)
