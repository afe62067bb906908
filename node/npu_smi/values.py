"""What ``npu-smi`` output is read into, and how one printed value is read.

:class:`NpuCard` (one chip) and :class:`ParseResult` (cards and warnings) are what every
layout parser returns; :class:`WarningLog` collects the warnings with a cap, and
:class:`Converter` turns one printed value (a number, an id, a ``used/total`` pair, a
bus id, a health state) into its type, or ``None`` with a warning. ``-``, ``NA``,
``N/A`` and masked values (``0000:xx:00.0``, ``***``) become ``None``;
:func:`mb_per_unit` turns a memory unit into megabytes.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

#: Health states documented for ``npu-smi``; other values are kept as printed.
HEALTH_VALUES: tuple[str, ...] = ("OK", "Warning", "Alarm", "Critical", "UNKNOWN")

#: At most this many warnings are kept per result; the rest are counted in one summary.
MAX_WARNINGS = 100

_EXCERPT_CHARS = 60
_MAX_NUMBER_CHARS = 32
#: Real rows are 100-200 characters; far longer lines are not npu-smi output.
MAX_LINE_CHARS = 4096

# --------------------------------------------------------------------------- data


@dataclass
class NpuCard:
    """One NPU chip as reported by ``npu-smi`` (``None`` = not reported or unreadable).

    The fields, in this order, are the keys of :meth:`to_dict`. This is what ``npu-smi``
    prints, not a telemetry card record: the npu-smi sampler turns it into one
    (:class:`mindpulse.node.samplers.base.CardRecord`) in one place,
    ``NpuSmiSampler._record`` of :mod:`mindpulse.node.samplers.npu_smi`.
    """

    npu: int | None = None
    chip: int | None = None
    phy_id: int | None = None
    name: str | None = None
    health: str | None = None
    power_w: float | None = None
    temp_c: float | None = None
    aicore_pct: float | None = None
    hbm_used_mb: float | None = None
    hbm_total_mb: float | None = None
    memory_used_mb: float | None = None
    memory_total_mb: float | None = None
    bus_id: str | None = None
    #: dicts with exactly the keys ``pid`` (int|None), ``name`` (str|None),
    #: ``memory_mb`` (float|None)
    processes: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict with exactly the contract keys (the fields, in their order)."""
        d: dict[str, Any] = {f: getattr(self, f) for f in CARD_FIELDS}
        d["processes"] = [
            {"pid": p.get("pid"), "name": p.get("name"), "memory_mb": p.get("memory_mb")}
            for p in self.processes
        ]
        return d


#: The value fields of an :class:`NpuCard` (all but ``processes``), in order.
CARD_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(NpuCard) if f.name != "processes")


@dataclass
class ParseResult:
    """Cards that could be read, and warnings about everything that could not."""

    cards: list[NpuCard] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"cards": [c.to_dict() for c in self.cards], "warnings": list(self.warnings)}


class WarningLog:
    """Collects warnings, keeping at most ``limit`` of them."""

    def __init__(self, limit: int = MAX_WARNINGS) -> None:
        self.limit = limit if isinstance(limit, int) and limit > 0 else MAX_WARNINGS
        self.items: list[str] = []
        self.dropped = 0
        self._once: set[str] = set()

    def add(self, msg: str | Callable[[], str]) -> None:
        """Record a warning; ``msg`` may be a callable, only called if it is kept."""
        if len(self.items) < self.limit:
            self.items.append(msg() if callable(msg) else msg)
        else:
            self.dropped += 1

    def once(self, key: str, msg: str) -> None:
        if key not in self._once:
            self._once.add(key)
            self.add(msg)

    def result(self) -> list[str]:
        out = list(self.items)
        if self.dropped:
            out.append(f"{self.dropped} more warnings not shown")
        return out


def excerpt(s: str) -> str:
    """``s`` quoted for a warning, cut to its first characters."""
    if len(s) > _EXCERPT_CHARS:
        s = s[:_EXCERPT_CHARS] + "..."
    return repr(s)


# ------------------------------------------------------------------ value parsing

_NUMBER_RE = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)", re.ASCII)
_BUS_RE = re.compile(r"[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9A-Fa-f]")
_NULLS = frozenset({"", "-", "--", "---", "na", "n/a"})
_MASK_CHARS = frozenset("xX*#?")
#: A health state as printed in any case -> its documented spelling.
HEALTH_BY_LOWER = {h.lower(): h for h in HEALTH_VALUES}


def _is_masked(s: str) -> bool:
    """True for values hidden by whoever captured the output (``xx``, ``***``...)."""
    return any(c in _MASK_CHARS for c in s) and not any(
        c.isalpha() and c not in _MASK_CHARS and c.lower() not in "abcdef" for c in s
    )


class Converter:
    """Value converters that report problems through a warnings collector."""

    def __init__(self, warn: WarningLog) -> None:
        self.warn = warn

    def _bad(self, lineno: int, what: str, raw: str) -> None:
        self.warn.add(
            lambda: f"line {lineno}: {what}: value {excerpt(raw)} not understood; left empty"
        )

    def number(self, raw: str, lineno: int, what: str) -> float | None:
        s = raw.strip()
        if len(s) <= _MAX_NUMBER_CHARS and _NUMBER_RE.fullmatch(s):
            return float(s)
        if s.lower() in _NULLS or _is_masked(s):
            return None
        self._bad(lineno, what, raw)
        return None

    def integer(self, raw: str, lineno: int, what: str) -> int | None:
        s = raw.strip()
        if len(s) <= 18 and s.isdigit() and s.isascii():
            return int(s)
        if s.lower() in _NULLS or _is_masked(s):
            return None
        self._bad(lineno, what, raw)
        return None

    def pair(self, raw: str, lineno: int, what: str) -> tuple[float | None, float | None]:
        """``'62810/ 65536'`` -> (62810.0, 65536.0)."""
        s = raw.strip()
        if s.lower() in _NULLS:
            return None, None
        used, sep, total = s.partition("/")
        if not sep:
            self._bad(lineno, what, raw)
            return None, None
        return (
            self.number(used, lineno, what + " (used)"),
            self.number(total, lineno, what + " (total)"),
        )

    def text(self, raw: str, maskable: bool = True) -> str | None:
        s = raw.strip()
        if s.lower() in _NULLS or (maskable and all(c in _MASK_CHARS for c in s)):
            return None  # placeholder, or masked entirely (``xxx``)
        return s

    def bus_id(self, raw: str, lineno: int) -> str | None:
        s = raw.strip()
        if s.lower() in _NULLS:
            return None
        if _BUS_RE.fullmatch(s):
            return s
        masked = "".join("0" if c in _MASK_CHARS else c for c in s)
        if masked != s and _BUS_RE.fullmatch(masked):
            return None  # masked by the reporter, e.g. 0000:xx:00.0
        self._bad(lineno, "bus id", raw)
        return None

    def health(self, raw: str, lineno: int) -> str | None:
        s = raw.strip()
        if s.lower() in _NULLS:
            return None
        canon = HEALTH_BY_LOWER.get(s.lower())
        if canon is not None:
            return canon
        if len(s) <= 32 and s.isascii() and s.isprintable():
            self.warn.add(
                lambda: f"line {lineno}: unexpected health value {excerpt(s)} (kept as printed)"
            )
            return s
        self._bad(lineno, "health", raw)
        return None


_TO_MB = {"mb": 1.0, "mib": 1.0, "gb": 1024.0, "gib": 1024.0, "kb": 1 / 1024, "kib": 1 / 1024}


def mb_per_unit(unit: str) -> float | None:
    """Factor turning a memory value in ``unit`` into MB (None: unknown unit)."""
    return _TO_MB.get(unit)
