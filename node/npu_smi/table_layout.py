"""The box-drawn table of ``npu-smi info``.

Two-line records per chip (``NPU Name | Health | Power(W) Temp(C) Hugepages-Usage(page)``
over ``Chip [Phy-ID|Device] | Bus-Id | AICore(%) Memory-Usage(MB) [HBM-Usage(MB)]``),
followed by an optional process table
(``NPU Chip | Process id | Process name | Process memory(MB) [| Process id in container]``).

The table is parsed by structure: rows are split on ``|``, the header rows say what each
cell (and each whitespace-separated sub-column inside a cell) holds, and values are
mapped through the header, so wider or reordered columns of newer drivers still parse.
:class:`TableParser` is fed the table's lines one by one (``|`` and ``+`` lines) by
:func:`mindpulse.node.npu_smi.parse.parse_npu_smi`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .values import (
    HEALTH_BY_LOWER,
    HEALTH_VALUES,
    MAX_LINE_CHARS,
    Converter,
    NpuCard,
    WarningLog,
    excerpt,
    mb_per_unit,
)

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


class TableParser:
    """Reads the table's rows one by one (:meth:`feed`) into cards (:meth:`finish`)."""

    def __init__(self, warn: WarningLog) -> None:
        self.warn = warn
        self.conv = Converter(warn)
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
                        f"line {lineno}: unknown column {excerpt(col.raw)} ignored",
                    )

    # -- rows ----------------------------------------------------------------

    def feed(self, lineno: int, s: str) -> None:
        if s[0] == "+":
            if not s.strip("+-="):
                self.last_was_info_header = False
                if self.pending is not None and self.pending_next > 0:
                    self._flush_pending()
            else:
                self.warn.add(lambda: f"line {lineno}: not understood: {excerpt(s)}")
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
                if v in HEALTH_BY_LOWER:
                    score += 2
                elif ":" in v:
                    score -= 2
            ci = h.targets.get("bus_id")
            if ci is not None and ci < len(cells):
                v = cells[ci].strip().lower()
                if ":" in v:
                    score += 2
                elif v in HEALTH_BY_LOWER:
                    score -= 2
            scores.append(score)
        best = max(range(len(headers)), key=lambda i: scores[i])
        if scores[best] > scores[expected]:
            return best
        return expected

    def _map_row(
        self, hdr: _Header, cells: list[str], lineno: int, what: str, shown: str | None = None
    ) -> dict[str, tuple[str, _Col]] | None:
        """``cells`` mapped through ``hdr`` (a warning when their count differs from the
        header's), or ``None`` with a warning when the row is not an npu-smi row. ``what``
        names the row in the warnings; ``shown``, the row as printed, is quoted in them where
        given (card rows; the process rows' warnings give the line number only)."""

        def tail() -> str:
            return "" if shown is None else f": {excerpt(shown)}"

        if len(cells) != len(hdr.cells):
            self.warn.add(
                lambda: f"line {lineno}: {what} has {len(cells)} cells where the header has "
                f"{len(hdr.cells)}{tail()}"
            )
        raw = hdr.map_row(cells)
        if raw is None:
            self.warn.add(lambda: f"line {lineno}: {what} not understood; skipped{tail()}")
        return raw

    def _info_row(self, lineno: int, cells: list[str], s: str) -> None:
        headers = self._default_info_headers()
        idx = self._pick_header(headers, cells)
        hdr = headers[idx]
        raw = self._map_row(hdr, cells, lineno, "row", s)
        if raw is None:
            return
        values = self._convert_info(raw, lineno)
        if values.get("health") not in HEALTH_VALUES and not any(
            values.get(k) is not None for k in _NUMERIC_OR_ID
        ):
            # nothing that identifies a chip or measures it: not a record row
            self.warn.add(lambda: f"line {lineno}: row not understood; skipped: {excerpt(s)}")
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
                scale = mb_per_unit(col.unit or "mb")
                if scale is None:
                    self.warn.once(
                        "unit:" + col.raw, f"line {lineno}: unknown unit in {excerpt(col.raw)}"
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
        raw = self._map_row(hdr, cells, lineno, "process row")
        if raw is None:
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
                scale = mb_per_unit(col.unit or "mb") or 1.0
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

