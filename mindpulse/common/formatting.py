"""Short display strings for numbers, sizes, durations, counts and dates: the one place every
table, console line and report page turns a value into text.

A missing value is `-` everywhere. A value that is not a finite number (NaN or Inf, or text
read back from JSON) is shown as it is rather than hidden, so a broken figure stays visible.
Where two views write the same kind of value differently, the difference is a parameter or a
second named function here, never a private copy in the view:

* `number`: a fixed format (`.4f`, `.1f`, `.3g`, ...), for console tables whose columns
  keep one format;
* `metric`: the same, but in scientific notation outside 1e-3..1e6 (a loss of 2e-7 or a grad
  norm of 3e9 stays readable in a fixed-decimal column);
* `cell`: floats as a `metric` (or a `number`), anything else (steps, ranks, exit codes,
  names) as it is.
"""

from __future__ import annotations

import datetime as _dt
import math
from typing import Any

MISSING = "-"
"""What every formatter shows for a value that is not there."""


def is_number(x: Any) -> bool:
    """A finite int or float (bools are flags, not numbers)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def finite_float(x: Any) -> float | None:
    """A plain finite float read from anything (a number, numpy scalar, numeric text), or None
    (None, bools, other text, NaN and Inf are all None): the one reader of values a sampler,
    a packet or a record may carry."""
    if x is None or isinstance(x, bool):
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _scientific(x: float) -> bool:
    return x != 0 and (abs(x) < 1e-3 or abs(x) >= 1e6)


def number(x: Any, spec: str = ".4f") -> str:
    """`format(x, spec)` for a finite number; `-` for None; anything else (NaN, Inf, a bool,
    text) as `str(x)`."""
    if x is None:
        return MISSING
    if not isinstance(x, (int, float)) or isinstance(x, bool) or not math.isfinite(x):
        return str(x)
    return format(x, spec)


def metric(x: Any, spec: str = ".4f") -> str:
    """A `number`, in scientific notation (`1.000e+06`) when it lies outside 1e-3..1e6."""
    if is_number(x) and _scientific(x):
        return f"{x:.3e}"
    return number(x, spec)


def general(x: Any) -> str:
    """A `number` in Python's general format to six significant digits (`.6g`): `0.000123`,
    `1e+06`; a rule's values and thresholds in its messages."""
    return number(x, ".6g")


def cell(x: Any, spec: str = ".4f", *, scientific: bool = True) -> str:
    """A table cell: a float as a `metric` (as a `number` with `scientific=False`), `-` for
    None, anything else (ints, bools, text) as `str(x)`."""
    if isinstance(x, float):
        return metric(x, spec) if scientific else number(x, spec)
    return MISSING if x is None else str(x)


def millis(seconds: float | None) -> str:
    """Seconds as whole milliseconds (`0.2034` → `203`); `-` for None."""
    return MISSING if seconds is None else f"{seconds * 1000:.0f}"


def rate(x: float | None) -> str:
    """A throughput: thousands separated from 100 up (`1,234`), one decimal below (`42.5`)."""
    if x is None:
        return MISSING
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def duration(s: Any) -> str:
    """Seconds in human units: `4.2 s`, `42 s`, `1 min 12 s`, `8 h 03 min`, `3 d 04 h`."""
    if not is_number(s) or s < 0:
        return MISSING
    if s < 10:
        return f"{s:.1f} s"
    if s < 60:
        return f"{s:.0f} s"
    m, sec = divmod(int(round(s)), 60)
    if m < 60:
        return f"{m} min {sec:02d} s"
    h, m = divmod(m, 60)
    if h < 48:
        return f"{h} h {m:02d} min"
    d, h = divmod(h, 24)
    return f"{d} d {h:02d} h"


def clock(seconds: float | None) -> str:
    """Seconds as a clock, `mm:ss` or `h:mm:ss` (an ETA); `--:--` when unknown."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "--:--"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def size(n: Any) -> str:
    """Bytes in binary units: `512 B`, `1.5 MiB`, `2.0 TiB`."""
    if not is_number(n) or n < 0:
        return MISSING
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return MISSING  # pragma: no cover


def plural(n: int, word: str, many: str | None = None) -> str:
    """A count with its noun: `1 rank`, `2 ranks` (`many`: an irregular plural)."""
    return f"{n} {word if n == 1 else (many or word + 's')}"


def _local(ts: float) -> _dt.datetime:
    return _dt.datetime.fromtimestamp(float(ts)).astimezone()


def _zone(t: _dt.datetime) -> str:
    off = t.utcoffset()
    if not off:
        return "UTC"
    z = t.strftime("%z")
    return f"UTC{z[:3]}:{z[3:]}"


def when(ts: Any) -> str:
    """An epoch time as a local date and time with its offset, e.g. `2026-12-01 11:13:36 UTC`."""
    if not is_number(ts) or ts <= 0:
        return MISSING
    t = _local(ts)
    return f"{t:%Y-%m-%d %H:%M:%S} {_zone(t)}"


def time_span(start: Any, end: Any) -> str:
    """`2026-12-01 11:13:36 → 11:14:48 UTC` (the end's date only when it differs)."""
    if not (is_number(start) and start > 0):
        return when(end)
    if not (is_number(end) and end > 0):
        return when(start)
    a, b = _local(start), _local(end)
    if _zone(a) != _zone(b):
        return f"{when(start)} → {when(end)}"
    tail = f"{b:%H:%M:%S}" if a.date() == b.date() else f"{b:%Y-%m-%d %H:%M:%S}"
    return f"{a:%Y-%m-%d %H:%M:%S} → {tail} {_zone(a)}"


__all__ = ["MISSING", "cell", "clock", "duration", "general", "is_number", "metric", "millis", "number", "plural",
           "rate", "size", "time_span", "when"]
