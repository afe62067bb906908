"""One card per (NPU, chip) out of several readings of the same chips (the per-card
listings of ``npu-smi info -t ...``, or a table and listings in one input)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .values import CARD_FIELDS, MAX_WARNINGS, NpuCard, ParseResult, WarningLog


def _iter_cards(source: Any, warn: WarningLog) -> Iterable[NpuCard]:
    if isinstance(source, ParseResult):
        for w in source.warnings:
            warn.add(w)
        return source.cards
    if isinstance(source, NpuCard):
        return [source]
    if isinstance(source, (str, bytes)) or source is None:
        warn.add(f"merge_cards: ignored a {type(source).__name__} argument (expected cards)")
        return []
    try:
        items = list(source)
    except TypeError:
        warn.add(f"merge_cards: ignored a {type(source).__name__} argument (expected cards)")
        return []
    out = []
    for item in items:
        if isinstance(item, NpuCard):
            out.append(item)
        elif isinstance(item, ParseResult):
            out.extend(_iter_cards(item, warn))
        else:
            warn.add(f"merge_cards: ignored a {type(item).__name__} item (expected NpuCard)")
    return out


def merge_cards(*sources: ParseResult | NpuCard | Iterable[NpuCard]) -> ParseResult:
    """Merge cards describing the same NPU chip into one card per (npu, chip).

    Each source may be a ``ParseResult``, an ``NpuCard`` or an iterable of them, e.g.
    ``merge_cards(parse_npu_smi(usages), parse_npu_smi(power), parse_npu_smi(temp))``.
    For each field the first non-``None`` value wins; a different later value is
    reported as a warning.  Processes are concatenated without duplicates.  A card
    whose chip is unknown joins the only card of the same NPU if there is exactly one.
    The input cards are not modified; warnings of ``ParseResult`` sources are carried.
    """
    warn = WarningLog(MAX_WARNINGS * 2)
    merged: list[NpuCard] = []
    try:
        index: dict[tuple[int | None, int | None], NpuCard] = {}
        loose: list[NpuCard] = []
        for source in sources:
            for card in _iter_cards(source, warn):
                if card.chip is None:
                    loose.append(card)
                    continue
                _merge_into(index, merged, (card.npu, card.chip), card, warn)
        for card in loose:
            same_npu = [k for k in index if k[0] == card.npu]
            key = same_npu[0] if len(same_npu) == 1 else (card.npu, None)
            _merge_into(index, merged, key, card, warn)
    except Exception as exc:  # noqa: BLE001 - never raise
        warn.add(f"merge_cards: internal error ({type(exc).__name__}); result may be partial")
    return ParseResult(merged, warn.result())


def _merge_into(
    index: dict[tuple[int | None, int | None], NpuCard],
    merged: list[NpuCard],
    key: tuple[int | None, int | None],
    card: NpuCard,
    warn: WarningLog,
) -> None:
    target = index.get(key)
    if target is None:
        target = NpuCard(npu=key[0], chip=key[1])
        index[key] = target
        merged.append(target)
    for f in CARD_FIELDS:
        v = getattr(card, f)
        if v is None:
            continue
        cur = getattr(target, f)
        if cur is None:
            setattr(target, f, v)
        elif cur != v and f not in ("npu", "chip"):
            warn.add(
                f"NPU {key[0]} chip {key[1]}: {f} is {cur!r} in one source and {v!r} in "
                "another; first kept"
            )
    have = {(p.get("pid"), p.get("name"), p.get("memory_mb")) for p in target.processes}
    for p in card.processes:
        k = (p.get("pid"), p.get("name"), p.get("memory_mb"))
        if k not in have:
            have.add(k)
            target.processes.append(
                {"pid": p.get("pid"), "name": p.get("name"), "memory_mb": p.get("memory_mb")}
            )
