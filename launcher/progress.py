"""A one-line progress display: step/total, ETA, loss, samples/s.

On a terminal it redraws in place; when stdout is a file or a pipe it prints a plain
line at most every 30 s, so log files are not flooded.
"""

from __future__ import annotations

import re
import time
from typing import Any, TextIO

from mindpulse.common.formatting import clock

PLAIN_EVERY_S = 30.0

_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
"""What a terminal would act on instead of showing: C0 controls but newline and tab (ESC
starts escape sequences that move the cursor, retitle the window or rewrite the screen),
DEL, C1 controls (0x9b is a one-byte CSI), and the bidirectional overrides that make
text read differently from what it holds."""


def printable(text: Any) -> str:
    """`text` as a terminal may show it: controls appear as `\\xNN`/`\\uNNNN` escapes, CR LF
    line ends become LF. Everything the launcher prints goes through here: rank errors, log
    tails, tracebacks, host names and the aggregator's console lines come from the ranks."""
    text = str(text).replace("\r\n", "\n")
    return _CONTROL.sub(lambda m: (f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100
                                   else f"\\u{ord(m.group()):04x}"), text)


def progress_text(progress: dict[str, Any], total: int | None, started: float, now: float | None = None,
                  first: tuple[int, float] | None = None) -> str:
    """`first` is (step, time) of the first step seen: the ETA uses the rate since then,
    not since launch, so start-up time does not inflate it."""
    now = time.time() if now is None else now
    step = progress.get("step") or 0
    eta = None
    if total and step:
        if first is not None and step > first[0]:
            eta = (now - first[1]) / (step - first[0]) * (total - step)
        elif first is None:
            eta = (now - started) / step * (total - step)
    loss = progress.get("loss")
    sps = progress.get("samples_per_s")
    parts = [f"step {step}/{total}" if total else f"step {step}", f"ETA {clock(eta)}" if total else ""]
    parts.append(f"loss {loss:.4f}" if isinstance(loss, float) else "loss -")
    parts.append(f"{sps:.1f} samples/s" if isinstance(sps, float) else "")
    return "  ".join(p for p in parts if p)


class ProgressLine:
    def __init__(self, out: TextIO):
        self.out = out
        self.tty = bool(getattr(out, "isatty", lambda: False)())
        self._shown = False
        self._last_plain = 0.0
        self._last_step = -1
        self._first: tuple[int, float] | None = None

    def update(self, progress: dict[str, Any], total: int | None, started: float) -> None:
        step = progress.get("step") or 0
        if step == 0:
            return
        if self._first is None:
            self._first = (step, time.time())
        text = printable(progress_text(progress, total, started, first=self._first))
        if self.tty:
            self.out.write("\r\x1b[2K" + text)
            self.out.flush()
            self._shown = True
        elif step != self._last_step and time.time() - self._last_plain >= PLAIN_EVERY_S:
            self.out.write(text + "\n")
            self.out.flush()
            self._last_plain = time.time()
        self._last_step = step

    def clear(self) -> None:
        if self.tty and self._shown:
            self.out.write("\r\x1b[2K")
            self.out.flush()
            self._shown = False


class Console:
    """The launcher's output: messages, and the progress line they never tear."""

    def __init__(self, out: TextIO):
        self.out = out
        self.progress = ProgressLine(out)

    def say(self, text: str) -> None:
        """Print one message (controls in it escaped: see `printable`)."""
        self.progress.clear()
        print(printable(text), file=self.out, flush=True)
