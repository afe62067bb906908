"""Parser for the text printed by Huawei's ``npu-smi`` tool.

Two kinds of output are understood, and may even be mixed in one input:

* the full table of ``npu-smi info``: two-line records per chip
  (``NPU Name | Health | Power(W) Temp(C) Hugepages-Usage(page)`` over
  ``Chip [Phy-ID|Device] | Bus-Id | AICore(%) Memory-Usage(MB) [HBM-Usage(MB)]``)
  followed by an optional process table
  (``NPU Chip | Process id | Process name | Process memory(MB) [| Process id in container]``);
* the per-card ``key : value`` listings of ``npu-smi info -t usages|power|temp|memory|
  board|common|health -i N [-c CHIP]``.  These give usage *rates*; used memory is derived
  as capacity * rate / 100, so it has whole-percent resolution.  Several listings of one
  card are combined with :func:`merge_cards`.

The table is parsed by structure: rows are split on ``|``, the header rows say what
each cell (and each whitespace-separated sub-column inside a cell) holds, and values are
mapped through the header, so wider or reordered columns of newer drivers still parse.
``-``, ``NA``, ``N/A`` and masked values (``0000:xx:00.0``, ``***``) become ``None``.

Nothing here raises on bad input: every public function returns what could be read,
plus human-readable warnings for what could not.  Only the standard library is used.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = [
    "HEALTH_VALUES",
    "MAX_WARNINGS",
    "NpuCard",
    "ParseResult",
    "parse_npu_smi",
    "merge_cards",
    "format_cards_table",
]

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
        d: dict[str, Any] = {f: getattr(self, f) for f in _CARD_FIELDS}
        d["processes"] = [
            {"pid": p.get("pid"), "name": p.get("name"), "memory_mb": p.get("memory_mb")}
            for p in self.processes
        ]
        return d


#: The value fields of an :class:`NpuCard` (all but ``processes``), in order.
_CARD_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(NpuCard) if f.name != "processes")


@dataclass
class ParseResult:
    """Cards that could be read, and warnings about everything that could not."""

    cards: list[NpuCard] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"cards": [c.to_dict() for c in self.cards], "warnings": list(self.warnings)}


class _Warnings:
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


def _excerpt(s: str) -> str:
    if len(s) > _EXCERPT_CHARS:
        s = s[:_EXCERPT_CHARS] + "..."
    return repr(s)


# ------------------------------------------------------------------ value parsing

_NUMBER_RE = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)", re.ASCII)
_BUS_RE = re.compile(r"[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9A-Fa-f]")
_NULLS = frozenset({"", "-", "--", "---", "na", "n/a"})
_MASK_CHARS = frozenset("xX*#?")
_HEALTH_CANON = {h.lower(): h for h in HEALTH_VALUES}


def _is_masked(s: str) -> bool:
    """True for values hidden by whoever captured the output (``xx``, ``***``...)."""
    return any(c in _MASK_CHARS for c in s) and not any(
        c.isalpha() and c not in _MASK_CHARS and c.lower() not in "abcdef" for c in s
    )


class _Conv:
    """Value converters that report problems through a warnings collector."""

    def __init__(self, warn: _Warnings) -> None:
        self.warn = warn

    def _bad(self, lineno: int, what: str, raw: str) -> None:
        self.warn.add(
            lambda: f"line {lineno}: {what}: value {_excerpt(raw)} not understood; left empty"
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
        canon = _HEALTH_CANON.get(s.lower())
        if canon is not None:
            return canon
        if len(s) <= 32 and s.isascii() and s.isprintable():
            self.warn.add(
                lambda: f"line {lineno}: unexpected health value {_excerpt(s)} (kept as printed)"
            )
            return s
        self._bad(lineno, "health", raw)
        return None


_TO_MB = {"mb": 1.0, "mib": 1.0, "gb": 1024.0, "gib": 1024.0, "kb": 1 / 1024, "kib": 1 / 1024}


def _scale_for_unit(unit: str) -> float | None:
    """Factor turning a memory value in ``unit`` into MB (None: unknown unit)."""
    return _TO_MB.get(unit)


# ------------------------------------------------------------------ table parsing

# Normalised header name (lower case, no spaces, unit removed) -> field.  ``None``
# marks columns we know and deliberately ignore.
_INFO_COLUMNS: dict[str, str | None] = {
    "npu": "npu",
    "npuid": "npu",
    "name": "name",
    "health": "health",
    "power": "power_w",
    "temp": "temp_c",
    "hugepages-usage": None,
    "chip": "chip",
    "chipid": "chip",
    "phy-id": "phy_id",
    "phyid": "phy_id",
    "device": None,  # 310P: logical device id, not a physical id
    "bus-id": "bus_id",
    "busid": "bus_id",
    "aicore": "aicore_pct",
    "memory-usage": "memory",
    "hbm-usage": "hbm",
}

_PROC_COLUMNS: dict[str, str | None] = {
    "npu": "npu",
    "npuid": "npu",
    "chip": "chip",
    "chipid": "chip",
    "processid": "pid",
    "processidincontainer": None,  # container-side pid; the contract keeps the host pid
    "processname": "name",
    "processmemory": "memory_mb",
}

# Header names that only appear in header rows; two different ones mark a header row.
_HEADER_MARKERS = frozenset(
    {"name", "health", "power", "temp", "bus-id", "aicore", "memory-usage", "hbm-usage",
     "hugepages-usage", "phy-id", "processid", "processname", "processmemory"}
)

# Case-sensitive substrings, at least one of which every header row contains.
_HEADER_HINTS = ("Name", "Health", "Bus", "Power", "Temp", "AICore", "Usage", "Process", "Phy")
#: More consecutive header rows than this are not a real header.
_MAX_HEADER_ROWS = 4

_NO_PROC_RE = re.compile(r"no running processes? found in npu\s*(\d{1,9})", re.IGNORECASE)


@dataclass
class _Col:
    start: int  # offset of the sub-column inside its cell
    raw: str  # header text as printed
    base: str  # normalised name without unit
    unit: str  # normalised unit ('' if none)
    target: str | None  # field it maps to, None = ignored


def _norm_header(raw: str) -> tuple[str, str]:
    """``'Memory-Usage(MB)'`` -> (``'memory-usage'``, ``'mb'``)."""
    s = "".join(raw.lower().split())
    unit = ""
    p = s.find("(")
    if p >= 0:
        q = s.find(")", p)
        unit = s[p + 1 : q if q >= 0 else len(s)]
        s = s[:p]
    return s, unit


_SUBCOL_RE = re.compile(r"\S+(?: \S+)*")
_TOKEN_RE = re.compile(r"\S+")


def _split_header_cell(cell: str, columns: dict[str, str | None]) -> list[_Col]:
    cols: list[_Col] = []
    for m in _SUBCOL_RE.finditer(cell):
        raw = m.group(0)
        base, unit = _norm_header(raw)
        if base not in columns and " " in raw:
            # sub-columns separated by a single space: split them if every part is known
            parts = list(_TOKEN_RE.finditer(raw))
            if all(_norm_header(p.group(0))[0] in columns for p in parts):
                for p in parts:
                    b, u = _norm_header(p.group(0))
                    cols.append(_Col(m.start() + p.start(), p.group(0), b, u, columns[b]))
                continue
        cols.append(_Col(m.start(), raw, base, unit, columns.get(base)))
    return cols


def _value_tokens(cell: str) -> list[tuple[int, str]]:
    """Whitespace tokens of a data cell; ``a / b`` style pairs become one ``a/b`` token."""
    out: list[tuple[int, str]] = []
    for m in _TOKEN_RE.finditer(cell):
        tok = m.group(0)
        if out and (tok.startswith("/") or out[-1][1].endswith("/")):
            start, prev = out[-1]
            out[-1] = (start, prev + tok)
        else:
            out.append((m.start(), tok))
    return out


class _Header:
    """One header row: for each ``|`` cell, its sub-columns."""

    def __init__(self, cells: list[str], columns: dict[str, str | None]) -> None:
        self.cells = [_split_header_cell(c, columns) for c in cells]
        self.targets = {
            col.target: ci for ci, cols in enumerate(self.cells) for col in cols if col.target
        }

    def map_row(self, cells: list[str]) -> dict[str, tuple[str, _Col]] | None:
        """Raw value strings per target field (ignored columns left out).

        ``None`` when a cell holds far more values than its header has sub-columns
        (not an npu-smi row)."""
        out: dict[str, tuple[str, _Col]] = {}
        for ci in range(min(len(cells), len(self.cells))):
            cols = self.cells[ci]
            if not cols:
                continue
            cell = cells[ci]
            if len(cols) == 1:
                col = cols[0]
                if col.target and col.target not in out:
                    out[col.target] = (cell.strip(), col)
                continue
            if len(cell.split()) > 3 * len(cols) + 4:
                return None
            tokens = _value_tokens(cell)
            if len(tokens) == len(cols):
                values = [t for _, t in tokens]
            else:
                # a blank or split value: give each token to the header sub-column
                # it sits under (header and data cells share their column offsets)
                buckets: list[list[str]] = [[] for _ in cols]
                for start, tok in tokens:
                    j = 0
                    for k, col in enumerate(cols):
                        if col.start <= start + 1:
                            j = k
                    buckets[j].append(tok)
                values = [" ".join(b) for b in buckets]
            for col, val in zip(cols, values):
                if col.target and col.target not in out:
                    out[col.target] = (val, col)
        return out


_NUMERIC_OR_ID = (
    "npu", "chip", "phy_id", "power_w", "temp_c", "aicore_pct", "hbm_used_mb", "hbm_total_mb",
    "memory_used_mb", "memory_total_mb", "bus_id",
)

_DEFAULT_INFO_HEADERS = (
    "| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|",
    "| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |",
)
_DEFAULT_PROC_HEADER = (
    "| NPU     Chip              | Process id    | Process name             | Process memory(MB)      |"
)


def _split_row(s: str) -> tuple[list[str], bool]:
    """Cells of a ``|`` row and whether the row was closed by a final ``|``."""
    body = s[1:]
    closed = body.endswith("|")
    if closed:
        body = body[:-1]
    return body.split("|"), closed


class _TableParser:
    def __init__(self, warn: _Warnings) -> None:
        self.warn = warn
        self.conv = _Conv(warn)
        self.cards: list[NpuCard] = []
        self.info_headers: list[_Header] = []
        self.proc_header: _Header | None = None
        self.section: str | None = None  # 'info' or 'proc'
        self.last_was_info_header = False
        self.pending: NpuCard | None = None
        self.pending_line = 0
        self.pending_next = 0  # index of the header row expected next
        self.processes: list[tuple[int, int | None, int | None, dict[str, Any]]] = []
        self._header_cache: dict[tuple[str, str], _Header] = {}
        self._kind_cache: dict[str, str | None] = {}
        # latest card read per (npu, chip): a process row belongs to the card table
        # printed just above it (matters when several snapshots are concatenated)
        self._latest: dict[tuple[int | None, int | None], NpuCard] = {}

    # -- headers -------------------------------------------------------------

    def _default_info_headers(self) -> list[_Header]:
        if not self.info_headers:
            self.warn.once(
                "noinfohdr",
                "table rows found before any header row; assuming the standard column layout",
            )
            self.info_headers = [
                _Header(_split_row(h)[0], _INFO_COLUMNS) for h in _DEFAULT_INFO_HEADERS
            ]
        return self.info_headers

    def _default_proc_header(self) -> _Header:
        if self.proc_header is None:
            self.warn.once(
                "noprochdr",
                "process rows found before the process table header; assuming the standard layout",
            )
            self.proc_header = _Header(_split_row(_DEFAULT_PROC_HEADER)[0], _PROC_COLUMNS)
        return self.proc_header

    @staticmethod
    def _header_kind(s: str, cells: list[str]) -> str | None:
        first = cells[0].strip() if cells else ""
        if first[:1].isdigit():
            return None  # data rows start with the NPU number
        if not any(word in s for word in _HEADER_HINTS):
            return None  # cheap pre-check before the real one
        names = []
        for cell in cells:
            for m in _SUBCOL_RE.finditer(cell):
                names.append(_norm_header(m.group(0))[0])
                names.extend(_norm_header(t)[0] for t in m.group(0).split(" ") if t)
        if len({n for n in names if n in _HEADER_MARKERS}) < 2:
            return None
        if any(n.startswith("process") for n in names):
            return "proc"
        return "info"

    def _header(self, s: str, kind: str, cells: list[str]) -> tuple[_Header, bool]:
        hdr = self._header_cache.get((kind, s))
        if hdr is not None:
            return hdr, False
        hdr = _Header(cells, _PROC_COLUMNS if kind == "proc" else _INFO_COLUMNS)
        if len(self._header_cache) < 64:
            self._header_cache[(kind, s)] = hdr
        return hdr, True

    def _add_header(self, kind: str, s: str, cells: list[str], lineno: int) -> None:
        hdr, new = self._header(s, kind, cells)
        if kind == "proc":
            self.proc_header = hdr
            self.section = "proc"
            self.last_was_info_header = False
            self._flush_pending()
            columns = _PROC_COLUMNS
        else:
            if not self.last_was_info_header:
                self._flush_pending()
                self.info_headers = []
            if len(self.info_headers) >= _MAX_HEADER_ROWS:
                self.warn.add(
                    lambda: f"line {lineno}: too many header rows in a row; this one is ignored"
                )
                return
            self.info_headers.append(hdr)
            self.section = "info"
            self.last_was_info_header = True
            columns = _INFO_COLUMNS
        if not new:
            return
        for cols in hdr.cells:
            for col in cols:
                if col.base not in columns:
                    self.warn.once(
                        "col:" + col.base,
                        f"line {lineno}: unknown column {_excerpt(col.raw)} ignored",
                    )

    # -- rows ----------------------------------------------------------------

    def feed(self, lineno: int, s: str) -> None:
        if s[0] == "+":
            if not s.strip("+-="):
                self.last_was_info_header = False
                if self.pending is not None and self.pending_next > 0:
                    self._flush_pending()
            else:
                self.warn.add(lambda: f"line {lineno}: not understood: {_excerpt(s)}")
            return
        if len(s) > MAX_LINE_CHARS:
            self.warn.add(
                lambda: f"line {lineno}: {len(s)} characters long, not an npu-smi row; skipped"
            )
            return

        cells, closed = _split_row(s)
        if "unning" in s and _NO_PROC_RE.search(" ".join(cells)):
            self.last_was_info_header = False
            self._flush_pending()
            self.section = "proc"
            return
        if not closed:
            self.warn.add(
                lambda: f"line {lineno}: row is cut short (no closing '|'); "
                "its last cell is ignored"
            )
            cells = cells[:-1]
            if not any(c.strip() for c in cells):
                return
        if len(cells) == 1 and ("npu-smi" in s or "ersion" in s):
            self.last_was_info_header = False
            return  # version banner
        if not any(c.strip() for c in cells):
            return  # blank row

        kind = self._kind_cache.get(s, "?")
        if kind == "?":
            kind = self._header_kind(s, cells)
            if len(self._kind_cache) < 256:
                self._kind_cache[s] = kind
        if kind is not None:
            self._add_header(kind, s, cells, lineno)
            return
        self.last_was_info_header = False

        section = self.section
        if section is None:
            section = "proc" if len(cells) >= 4 else "info"
        if section == "proc":
            self._proc_row(lineno, cells)
        else:
            self._info_row(lineno, cells, s)

    def _pick_header(self, headers: list[_Header], cells: list[str]) -> int:
        expected = self.pending_next if self.pending is not None else 0
        if expected >= len(headers):
            expected = 0
        scores = []
        for h in headers:
            score = 0
            ci = h.targets.get("health")
            if ci is not None and ci < len(cells):
                v = cells[ci].strip().lower()
                if v in _HEALTH_CANON:
                    score += 2
                elif ":" in v:
                    score -= 2
            ci = h.targets.get("bus_id")
            if ci is not None and ci < len(cells):
                v = cells[ci].strip().lower()
                if ":" in v:
                    score += 2
                elif v in _HEALTH_CANON:
                    score -= 2
            scores.append(score)
        best = max(range(len(headers)), key=lambda i: scores[i])
        if scores[best] > scores[expected]:
            return best
        return expected

    def _info_row(self, lineno: int, cells: list[str], s: str) -> None:
        headers = self._default_info_headers()
        idx = self._pick_header(headers, cells)
        hdr = headers[idx]
        if len(cells) != len(hdr.cells):
            self.warn.add(
                lambda: f"line {lineno}: row has {len(cells)} cells where the header has "
                f"{len(hdr.cells)}: {_excerpt(s)}"
            )
        raw = hdr.map_row(cells)
        if raw is None:
            self.warn.add(lambda: f"line {lineno}: row not understood; skipped: {_excerpt(s)}")
            return
        values = self._convert_info(raw, lineno)
        if values.get("health") not in HEALTH_VALUES and not any(
            values.get(k) is not None for k in _NUMERIC_OR_ID
        ):
            # nothing that identifies a chip or measures it: not a record row
            self.warn.add(lambda: f"line {lineno}: row not understood; skipped: {_excerpt(s)}")
            return

        if idx == 0 or self.pending is None:
            if self.pending is not None:
                self._flush_pending()
            if idx != 0:
                self.warn.add(
                    f"line {lineno}: second row of a chip record without its first row "
                    "(NPU id, name, health, power, temperature unknown)"
                )
            card = NpuCard()
            self.pending = card
            self.pending_line = lineno
        card = self.pending
        for k, v in values.items():
            if v is not None and getattr(card, k) is None:
                setattr(card, k, v)
        self.pending_next = idx + 1
        if self.pending_next >= len(headers):
            self._emit(card)
            self.pending = None
            self.pending_next = 0

    def _convert_info(self, raw: dict[str, tuple[str, _Col]], lineno: int) -> dict[str, Any]:
        c = self.conv
        out: dict[str, Any] = {}
        for target, (val, col) in raw.items():
            what = col.raw
            if target in ("npu", "chip", "phy_id"):
                out[target] = c.integer(val, lineno, what)
            elif target == "name":
                out[target] = c.text(val)
            elif target == "health":
                out[target] = c.health(val, lineno)
            elif target == "bus_id":
                out[target] = c.bus_id(val, lineno)
            elif target in ("memory", "hbm"):
                used, total = c.pair(val, lineno, what)
                scale = _scale_for_unit(col.unit or "mb")
                if scale is None:
                    self.warn.once(
                        "unit:" + col.raw, f"line {lineno}: unknown unit in {_excerpt(col.raw)}"
                    )
                    used = total = None
                elif scale != 1.0:
                    used = None if used is None else used * scale
                    total = None if total is None else total * scale
                out[target + "_used_mb"] = used
                out[target + "_total_mb"] = total
            elif target == "power_w":
                v = c.number(val, lineno, what)
                if v is not None and col.unit == "mw":
                    v /= 1000.0
                out[target] = v
            else:
                out[target] = c.number(val, lineno, what)
        return out

    def _proc_row(self, lineno: int, cells: list[str]) -> None:
        hdr = self.proc_header or self._default_proc_header()
        if len(cells) != len(hdr.cells):
            self.warn.add(
                lambda: f"line {lineno}: process row has {len(cells)} cells where the header "
                f"has {len(hdr.cells)}"
            )
        raw = hdr.map_row(cells)
        if raw is None:
            self.warn.add(lambda: f"line {lineno}: process row not understood; skipped")
            return
        c = self.conv
        npu = chip = None
        proc: dict[str, Any] = {"pid": None, "name": None, "memory_mb": None}
        for target, (val, col) in raw.items():
            if target == "npu":
                npu = c.integer(val, lineno, col.raw)
            elif target == "chip":
                chip = c.integer(val, lineno, col.raw)
            elif target == "pid":
                proc["pid"] = c.integer(val, lineno, col.raw)
            elif target == "name":
                proc["name"] = c.text(val, maskable=False)
            elif target == "memory_mb":
                v = c.number(val, lineno, col.raw)
                scale = _scale_for_unit(col.unit or "mb") or 1.0
                proc["memory_mb"] = None if v is None else v * scale
        if npu is None and proc["pid"] is None:
            self.warn.add(
                lambda: f"line {lineno}: process row without NPU or process id; skipped"
            )
            return
        card = self._latest.get((npu, chip))
        if card is not None:
            card.processes.append(proc)
        else:  # resolved at the end (e.g. rows out of order)
            self.processes.append((lineno, npu, chip, proc))

    def _flush_pending(self) -> None:
        if self.pending is None:
            return
        card = self.pending
        self.pending = None
        self.pending_next = 0
        who = f"NPU {card.npu}" if card.npu is not None else "a chip"
        self.warn.add(
            f"line {self.pending_line}: record of {who} is incomplete (its second row is "
            "missing); chip id, bus id, AICore and memory are unknown"
        )
        self._emit(card)

    def _emit(self, card: NpuCard) -> None:
        self.cards.append(card)
        self._latest[(card.npu, card.chip)] = card

    def finish(self) -> list[NpuCard]:
        self._flush_pending()
        index: dict[tuple[int | None, int | None], NpuCard] = {}
        by_npu: dict[int | None, list[NpuCard]] = {}
        seen_dupes: set[tuple[int | None, int | None]] = set()
        for card in self.cards:
            key = (card.npu, card.chip)
            if key in index:
                if key not in seen_dupes and card.npu is not None:
                    seen_dupes.add(key)
                    self.warn.add(f"NPU {card.npu} chip {card.chip} is listed more than once")
            else:
                index[key] = card
            by_npu.setdefault(card.npu, []).append(card)
        for lineno, npu, chip, proc in self.processes:
            card = index.get((npu, chip))
            if card is None:
                candidates = by_npu.get(npu, [])
                if len(candidates) == 1 and (chip is None or candidates[0].chip is None):
                    card = candidates[0]
            if card is None:
                self.warn.add(
                    f"line {lineno}: process {proc['pid']} is on NPU {npu} chip {chip}, "
                    "which is not in the card table; a card was added for it"
                )
                card = NpuCard(npu=npu, chip=chip)
                self.cards.append(card)
                index[(npu, chip)] = card
                by_npu.setdefault(npu, []).append(card)
            card.processes.append(proc)
        return self.cards


# ------------------------------------------------------------- key:value parsing

# Normalised key (lower case, no whitespace) -> internal slot.  Slots starting with
# ``_`` are combined into card fields after a block has been read.
_KV_FIELDS: dict[str, str] = {
    "hbmcapacity(mb)": "hbm_total_mb",
    "hbmusagerate(%)": "_hbm_rate",
    "ddrcapacity(mb)": "memory_total_mb",
    "ddrusagerate(%)": "_mem_rate",
    "memorycapacity(mb)": "memory_total_mb",
    "memoryusagerate(%)": "_mem_rate",
    # -t memory on DDR boards: "Capacity(MB)" is what applications can use and matches
    # "Memory Capacity(MB)" of -t usages; "Total Capacity(MB)" (physical, incl. what the
    # OS reserves) is ignored.
    "capacity(mb)": "memory_total_mb",
    "aicoreusagerate(%)": "aicore_pct",
    "npureal-timepower(w)": "power_w",
    "real-timepower(w)": "power_w",
    "power(w)": "power_w",
    "nputemperature(c)": "temp_c",
    "temperature(c)": "temp_c",
    "chiptemperature(c)": "temp_c",
    "pciebusinfo": "bus_id",
    "productname": "_product_name",
    "chipname": "_chip_name",
    "healthstatus": "health",
    "health": "health",
    "phy-id": "phy_id",
    "phyid": "phy_id",
    "chipphy-id": "phy_id",
    "chipphyid": "phy_id",
}

# Keys that are understood and deliberately not used.
_KV_IGNORED = frozenset(
    {
        "chipcount", "model", "manufacturer", "serialnumber", "softwareversion",
        "firmwareversion", "compatibility", "boardid", "pcbid", "bomid", "slotid",
        "classid", "pcivendorid", "pcideviceid", "subsystemvendorid", "subsystemdeviceid",
        "chiptype", "chipversion", "chippositionid", "vdieid", "ndieid",
        "ddrhugepagestotal(page)", "ddrhugepagesusagerate(%)", "hugepagestotal(page)",
        "hugepagesusagerate(%)", "aivectorusagerate(%)", "aicpuusagerate(%)",
        "ctrlcpuusagerate(%)", "ddrbandwidthusagerate(%)", "hbmbandwidthusagerate(%)",
        "memorybandwidthusagerate(%)", "npuutilization(%)", "aicubeusagerate(%)",
        "vectorcoreusagerate(%)", "powerdissipation(w)", "ratedpower(w)", "lm75a_te(c)",
        "lm75b_te(c)", "lm75c_te(c)", "tec_temp(c)", "ntc_te(c)", "clockspeed(mhz)",
        "ddrclockspeed(mhz)", "hbmclockspeed(mhz)", "hbmtemperature(c)",
        "hbmmanufacturerid", "ddrmanufacturerid", "aicorefreq(mhz)", "aicorecurfreq(mhz)",
        "aicorecount", "aicpucount", "ctrlcpucount", "voltage(v)", "healthstatusdetail",
        "errorcode", "errorinformation", "totalcapacity(mb)",
    }
)

_KV_FLOAT_SLOTS = frozenset(
    {"hbm_total_mb", "_hbm_rate", "memory_total_mb", "_mem_rate", "aicore_pct", "power_w",
     "temp_c"}
)


def _norm_key(key: str) -> str:
    return "".join(key.lower().split())


class _KvGroup:
    def __init__(self, lineno: int, npu: int | None) -> None:
        self.lineno = lineno
        self.npu = npu
        self.entries: list[tuple[int, str, str, str]] = []  # lineno, normkey, rawkey, value


def _parse_kv(lines: list[tuple[int, str]], warn: _Warnings) -> list[NpuCard]:
    conv = _Conv(warn)
    groups: list[_KvGroup] = []
    cur: _KvGroup | None = None
    for lineno, s in lines:
        key, _, value = s.partition(":")
        nk = _norm_key(key)
        if not nk or len(nk) > 80:
            warn.add(lambda lineno=lineno, s=s: f"line {lineno}: not understood: {_excerpt(s)}")
            continue
        if nk == "npuid":
            cur = _KvGroup(lineno, conv.integer(value, lineno, "NPU ID"))
            groups.append(cur)
            continue
        if nk not in _KV_FIELDS and nk not in _KV_IGNORED and nk != "chipid":
            warn.add(lambda lineno=lineno, key=key:
                     f"line {lineno}: key {_excerpt(key.strip())} not recognised; ignored")
            continue
        if cur is None:
            warn.add(
                f"line {lineno}: key:value lines before any 'NPU ID' line; NPU id unknown"
            )
            cur = _KvGroup(lineno, None)
            groups.append(cur)
        cur.entries.append((lineno, nk, key.strip(), value.strip()))

    cards: list[NpuCard] = []
    for g in groups:
        cards.extend(_kv_group_cards(g, conv, warn))
    return cards


def _kv_group_cards(g: _KvGroup, conv: _Conv, warn: _Warnings) -> list[NpuCard]:
    entries = g.entries
    chip_pos = [i for i, e in enumerate(entries) if e[1] == "chipid"]
    metric_pos = [i for i, e in enumerate(entries) if e[1] in _KV_FIELDS]
    chip_count: int | None = None
    for lineno, nk, _, value in entries:
        if nk == "chipcount":
            chip_count = conv.integer(value, lineno, "Chip Count")
            break

    # Which chip block does each entry belong to?  Real output puts "Chip ID" either
    # before the chip's values (310B) or after them (910B, 25.x), so look at the order.
    owner: list[int] = [0] * len(entries)  # index into chip_pos, -1 = no chip id at all
    if not chip_pos:
        owner = [-1] * len(entries)
    else:
        trailing = bool(metric_pos) and metric_pos[0] < chip_pos[0]
        j = 0
        if trailing:
            for i in range(len(entries)):
                while j < len(chip_pos) - 1 and chip_pos[j] < i:
                    j += 1
                owner[i] = j
        else:
            for i in range(len(entries)):
                while j < len(chip_pos) - 1 and chip_pos[j + 1] <= i:
                    j += 1
                owner[i] = j

    blocks: dict[int, dict[str, Any]] = {}
    order: list[int] = []
    chips: dict[int, int | None] = {}
    mcu = False
    for i, (lineno, nk, rawkey, value) in enumerate(entries):
        b = owner[i]
        if b not in blocks:
            blocks[b] = {}
            order.append(b)
        slots = blocks[b]
        if nk == "chipid":
            chips[b] = conv.integer(value, lineno, "Chip ID")
            mcu = False
            continue
        slot = _KV_FIELDS.get(nk)
        if slot is None:
            continue
        if slot == "_chip_name" and value.strip().lower() == "mcu":
            # values after "Chip Name : MCU" belong to the board's MCU, not the NPU chip
            mcu = True
            continue
        if mcu:
            continue
        if slot in _KV_FLOAT_SLOTS:
            v: Any = conv.number(value, lineno, rawkey)
        elif slot == "phy_id":
            v = conv.integer(value, lineno, rawkey)
        elif slot == "bus_id":
            v = conv.bus_id(value, lineno)
        elif slot == "health":
            v = conv.health(value, lineno)
        else:
            v = conv.text(value)
        if slot in slots:
            if v is not None and slots[slot] is not None and slots[slot] != v:
                warn.add(
                    f"line {lineno}: {rawkey} given twice for NPU {g.npu}; first value kept"
                )
            if slots[slot] is None:
                slots[slot] = v
            continue
        slots[slot] = v

    if not blocks:
        blocks[-1] = {}
        order.append(-1)
    cards: list[NpuCard] = []
    for b in order:
        slots = blocks[b]
        if b == -1:
            chip = 0 if chip_count == 1 else None
        else:
            chip = chips.get(b)
        card = NpuCard(npu=g.npu, chip=chip)
        for slot, v in slots.items():
            if not slot.startswith("_"):
                setattr(card, slot, v)
        # usages/common only give a rate: used = capacity * rate / 100 (whole-percent
        # resolution, so accurate to about 1% of capacity)
        rate = slots.get("_hbm_rate")
        if rate is not None and card.hbm_total_mb is not None:
            card.hbm_used_mb = card.hbm_total_mb * rate / 100.0
        rate = slots.get("_mem_rate")
        if rate is not None and card.memory_total_mb is not None:
            card.memory_used_mb = card.memory_total_mb * rate / 100.0
        card.name = slots.get("_chip_name") or slots.get("_product_name")
        if not slots:
            warn.add(f"line {g.lineno}: NPU {g.npu}: no values recognised")
        cards.append(card)
    return cards


# ------------------------------------------------------------------- entry points


def _coerce_text(text: Any, warn: _Warnings) -> str:
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
    warn = _Warnings(max_warnings)
    cards: list[NpuCard] = []
    try:
        text = _coerce_text(text, warn)
        if not text.strip():
            warn.add("empty input: no npu-smi output to parse")
            return ParseResult([], warn.result())

        table = _TableParser(warn)
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
                warn.add(lambda lineno=lineno, s=s: f"line {lineno}: not understood: {_excerpt(s)}")

        if saw_table:
            cards.extend(table.finish())
        if kv_lines:
            kv_cards = _parse_kv(kv_lines, warn)
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


def _iter_cards(source: Any, warn: _Warnings) -> Iterable[NpuCard]:
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
    warn = _Warnings(MAX_WARNINGS * 2)
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
    warn: _Warnings,
) -> None:
    target = index.get(key)
    if target is None:
        target = NpuCard(npu=key[0], chip=key[1])
        index[key] = target
        merged.append(target)
    for f in _CARD_FIELDS:
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


# ------------------------------------------------------------------- formatting


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
