"""Name the root cause of a failed run: the first rank to fail (not its victims), with
the last lines of its log and its traceback; identical errors shown once with their ranks
(after torch elastic's ChildFailedError and Ray Train's error grouping)."""

from __future__ import annotations

import enum
import re
import signal
from collections import OrderedDict
from pathlib import Path
from typing import Any

from .spec import RankOutcome

LOG_TAIL_LINES = 30
VICTIM = "stopped after another rank failed"


class FailureKind(str, enum.Enum):
    CRASH = "crash"
    HANG = "hang"
    LAUNCHER = "launcher"


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, 2)
            size = fh.tell()
            fh.seek(max(0, size - 64 * 1024))
            text = fh.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    keep = [ln for ln in text.splitlines() if ln.strip()]
    return "\n".join(keep[-lines:])


def traceback_from_log(text: str, first: bool = False) -> str:
    """The last (or `first`) Python traceback in a log excerpt (through its exception line)."""
    marker = "Traceback (most recent call last)"
    idx = text.find(marker) if first else text.rfind(marker)
    if idx < 0:
        return ""
    block = text[idx:].splitlines()
    out = [block[0]]
    for ln in block[1:]:
        out.append(ln)
        if ln and not ln.startswith((" ", "\t")):  # the exception line ends the block
            break
    return "\n".join(out)


FATAL_SIGNAL_LINES = {
    "Segmentation fault": "SIGSEGV",
    "Bus error": "SIGBUS",
    "Aborted": "SIGABRT",
    "Floating-point exception": "SIGFPE",
    "Floating point exception": "SIGFPE",
    "Illegal instruction": "SIGILL",
}
"""Python's faulthandler (on in every rank actor) writes `Fatal Python error: <name>` into
the rank's log when one of these signals kills it."""
_NAMED = re.compile(r"\b(?:killed|terminated|exited) (?:by|from|with) signal:? ?(SIG[A-Z0-9]+|\d+)\b", re.I)
_DIED = re.compile(r"\b(?:died|killed|lost|crashed)\b", re.I)


def signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def signal_of(error: str, exit_code: int | None = None, log_tail: str = "") -> str | None:
    """The signal that ended a rank: from its exit status where the process table gave one
    (a negative code, as `subprocess` reports a signal: msrun's ranks, msrun itself), from
    the error text when it names one explicitly, from faulthandler's last words in its log;
    "unknown" for a process that died and nothing says how (Ray reports an actor's death
    without its exit status); None when it exited on its own."""
    if exit_code is not None:
        return signal_name(-exit_code) if exit_code < 0 else None
    m = _NAMED.search(error or "")
    if m:
        sig = m.group(1)
        return signal_name(int(sig)) if sig.isdigit() else sig.upper()
    if not _DIED.search(error or ""):
        return None
    fatal = log_tail.rfind("Fatal Python error: ")
    if fatal >= 0:
        line = log_tail[fatal + len("Fatal Python error: "):].splitlines()[0]
        for text, name in FATAL_SIGNAL_LINES.items():
            if line.startswith(text):
                return name
    return "unknown"


def describe_failure(outcomes: dict[int, RankOutcome], order: list[int], logs_dir: Path,
                     last_steps: dict[int, int], kind: FailureKind = FailureKind.CRASH,
                     stuck: list[int] | None = None, message: str = "") -> dict[str, Any]:
    """`order`: ranks in the order their failure was seen (the first is the root cause)."""
    failed = [r for r in order if outcomes.get(r) and outcomes[r].error != VICTIM
              and (outcomes[r].exit_code not in (0,) or outcomes[r].error)]
    if kind is FailureKind.HANG:
        root = (stuck or [None])[0]
        ranks = sorted(stuck or [])
    else:
        root = failed[0] if failed else None
        ranks = sorted(r for r, o in outcomes.items() if o.exit_code != 0 or o.error)
    o = outcomes.get(root) if root is not None else None
    tail = log_tail(logs_dir / f"rank_{root}.log") if root is not None else ""
    tb = (o.traceback if o and o.traceback else "") or traceback_from_log(tail)
    groups: OrderedDict[str, list[int]] = OrderedDict()
    for r in failed:
        key = outcomes[r].error.splitlines()[0] if outcomes[r].error else f"exit code {outcomes[r].exit_code}"
        groups.setdefault(key, []).append(r)
    return {
        "kind": kind.value,
        "root_cause_rank": root,
        "ranks": ranks,
        "step": last_steps.get(root) if root is not None else None,
        "exit_code": o.exit_code if o else None,
        # None: Ray saw the process die; negative: msrun's exit status of a killed worker
        "signal": signal_of(o.error, o.exit_code, tail) if o else None,
        "error": (o.error if o else "") or message,
        "log_tail": tail,
        "traceback": tb,
        "errors": [{"error": e, "ranks": rs} for e, rs in groups.items()],
    }


def format_failure(f: dict[str, Any]) -> str:
    """The failure block as the terminal shows it (what came from the ranks is made printable)."""
    from .progress import printable

    lines = [f"FAILED ({f['kind']}): root cause rank {f['root_cause_rank']} at step {f['step']}"
             + (f", exit code {f['exit_code']}" if f.get("exit_code") not in (None,) else "")
             + (f", signal {f['signal']}" if f.get("signal") else "")]
    for g in f.get("errors", []):
        lines.append(f"  ranks {g['ranks']}: {g['error']}")
    if f.get("traceback"):
        lines.append("  traceback of the root cause:")
        lines += ["    " + ln for ln in f["traceback"].splitlines()[-15:]]
    elif f.get("log_tail"):
        lines.append(f"  last lines of logs/rank_{f['root_cause_rank']}.log:")
        lines += ["    " + ln for ln in f["log_tail"].splitlines()[-10:]]
    return printable("\n".join(lines))
