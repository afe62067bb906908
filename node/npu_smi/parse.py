"""The entry point: any ``npu-smi`` output, each line given to the layout it belongs to.

``|`` and ``+`` lines go to the table parser (:mod:`.table_layout`), ``key : value``
lines to :mod:`.key_value_layout`; cards of both kinds in one input are merged.
Nothing here raises on bad input: what could not be read becomes a warning.
"""

from __future__ import annotations

from typing import Any

from .key_value_layout import parse_key_values
from .merge import merge_cards
from .table_layout import TableParser
from .values import MAX_LINE_CHARS, MAX_WARNINGS, NpuCard, ParseResult, WarningLog, excerpt


def _coerce_text(text: Any, warn: WarningLog) -> str:
    if text is None:
        return ""
    if isinstance(text, str):
        return text
    if isinstance(text, (bytes, bytearray, memoryview)):
        return bytes(text).decode("utf-8", errors="replace")
    warn.add(f"input of type {type(text).__name__} is not text; converted with str()")
    try:
        return str(text)
    except Exception:  # noqa: BLE001 - nothing may escape
        return ""


def parse_npu_smi(text: str, *, max_warnings: int = MAX_WARNINGS) -> ParseResult:
    """Parse ``npu-smi info`` or ``npu-smi info -t ... -i N`` output.

    The kind of output is detected line by line: ``|``/``+`` lines are table rows,
    ``key : value`` lines are the per-card form.  Never raises; whatever could not be
    read is described in ``ParseResult.warnings`` (with line numbers).
    """
    warn = WarningLog(max_warnings)
    cards: list[NpuCard] = []
    try:
        text = _coerce_text(text, warn)
        if not text.strip():
            warn.add("empty input: no npu-smi output to parse")
            return ParseResult([], warn.result())

        table = TableParser(warn)
        kv_lines: list[tuple[int, str]] = []
        saw_table = False
        for lineno, line in enumerate(text.splitlines(), 1):
            s = line.strip()
            if not s:
                continue
            if len(s) > MAX_LINE_CHARS:
                warn.add(
                    lambda lineno=lineno, s=s: f"line {lineno}: {len(s)} characters long, not npu-smi output; "
                    "skipped"
                )
                continue
            c = s[0]
            if c == "|" or c == "+":
                saw_table = True
                try:
                    table.feed(lineno, s)
                except Exception as exc:  # noqa: BLE001 - keep going with the next line
                    warn.add(f"line {lineno}: internal parser error ({type(exc).__name__}); line skipped")
            elif ":" in s:
                kv_lines.append((lineno, s))
            else:
                warn.add(lambda lineno=lineno, s=s: f"line {lineno}: not understood: {excerpt(s)}")

        if saw_table:
            cards.extend(table.finish())
        if kv_lines:
            kv_cards = parse_key_values(kv_lines, warn)
            if cards and kv_cards:
                merged = merge_cards(cards, kv_cards)
                for w in merged.warnings:
                    warn.add(w)
                cards = merged.cards
            else:
                cards.extend(kv_cards)
        if not cards:
            warn.add("no NPU cards found in the input")
    except Exception as exc:  # noqa: BLE001 - last line of defence: never raise
        warn.add(f"internal parser error ({type(exc).__name__}: {exc}); result may be partial")
    return ParseResult(cards, warn.result())
