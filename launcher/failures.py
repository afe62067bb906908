"""Name the root cause of a failed run: the first rank to fail (not its victims), with
the last lines of its log and its traceback; identical errors shown once with their ranks
(after torch elastic's ChildFailedError and Ray Train's error grouping)."""

from __future__ import annotations

import enum
import re
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


def traceback_from_log(text: str) -> str:
    """The last Python traceback in a log excerpt (through its exception line)."""
    idx = text.rfind("Traceback (most recent call last)")
    if idx < 0:
        return ""
    block = text[idx:].splitlines()
    out = [block[0]]
    for ln in block[1:]:
        out.append(ln)
        if ln and not ln.startswith((" ", "\t")):  # the exception line ends the block
            break
    return "\n".join(out)


def signal_of(error: str) -> str | None:
    m = re.search(r"\b(SIG[A-Z]+)\b", error or "")
    if m:
        return m.group(1)
    if "killed" in (error or "").lower() or "died" in (error or "").lower():
        return "SIGKILL?"  # Ray reports an actor's death without the signal; -9 is the usual cause
    return None


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
        "signal": signal_of(o.error) if o and o.exit_code is None else None,
        "error": (o.error if o else "") or message,
        "log_tail": tail,
        "traceback": tb,
        "errors": [{"error": e, "ranks": rs} for e, rs in groups.items()],
    }


def format_failure(f: dict[str, Any]) -> str:
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
    return "\n".join(lines)
