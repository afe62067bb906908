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

from mindpulse.inputs.input_paths import INPUT_MISSING

from .spec import RankOutcome

LOG_TAIL_LINES = 30
VICTIM = "stopped after another rank failed"


class FailureKind(str, enum.Enum):
    CRASH = "crash"
    HANG = "hang"
    LAUNCHER = "launcher"
    NODE_LOST = "node_lost"
    """A host's processes are gone (its node agent, raylet and ranks): launcher/node_health.py."""
    LINK_LOST = "link_lost"
    """A host stopped answering: a lost link or a network partition."""
    INPUT = "input"
    """A file the config names is missing on a rank's node (the rank's start checks them:
    mindpulse/inputs/input_paths.py); a restart would fail the same way."""


def failure_kind(result: Any) -> FailureKind:
    """The kind of a failed `RunResult`: a lost node or link, a hang, a crash; LAUNCHER when
    no rank has an outcome (the launcher itself failed)."""
    if result.lost:
        from .node_health import LossKind, loss_kind

        return FailureKind.NODE_LOST if loss_kind(result.lost) is LossKind.NODE else FailureKind.LINK_LOST
    if result.hang:
        return FailureKind.HANG
    if any(o.error.startswith(INPUT_MISSING) for o in result.outcomes.values()):
        return FailureKind.INPUT
    return FailureKind.CRASH if result.outcomes else FailureKind.LAUNCHER


COMMON_TAIL_BYTES = 256 * 1024
"""How much of each healthy rank's log is read to find the lines every rank prints."""
COMMON_PEERS = 4
"""How many healthy ranks' logs are read for it (the first ones)."""
_NUMBERS = re.compile(r"\d+")


def _shape(line: str) -> str:
    """A log line without its numbers (pids, times, ranks, addresses): how it is compared."""
    return _NUMBERS.sub("#", line.strip())


def _read_tail(path: Path, size: int) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, 2)
            fh.seek(max(0, fh.tell() - size))
            return fh.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


_OWN_LINE = re.compile(r"^\[rank \d+\] ")
"""mindpulse's own lines in a rank's log (`[rank 3] pid … starting`): the rank's timeline, kept."""


def without_common_lines(tail: str, peer_logs: list[Path]) -> str:
    """`tail` less the lines every one of `peer_logs` (healthy ranks' logs) holds too, numbers
    aside: what each rank prints at start (on CPU, MindSpore's `[ERROR] … CPU device is not
    supported`), never the failure's cause. mindpulse's own `[rank r]` lines stay (where the
    rank was). Unchanged without a peer log to compare with."""
    shapes = [{_shape(ln) for ln in _read_tail(p, COMMON_TAIL_BYTES).splitlines()} for p in peer_logs]
    shapes = [s for s in shapes if s]
    if not shapes:
        return tail
    common = set.intersection(*shapes)
    return "\n".join(ln for ln in tail.splitlines() if _OWN_LINE.match(ln) or _shape(ln) not in common)


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
                     stuck: list[int] | None = None, message: str = "",
                     lost: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """`order`: ranks in the order their failure was seen (the first is the root cause).
    `lost`: the nodes lost or cut off (node_lost, link_lost): they are the cause, their ranks
    the ones that went with them. The root's log tail leaves out the lines every healthy rank
    prints too."""
    failed = [r for r in order if outcomes.get(r) and outcomes[r].error != VICTIM
              and (outcomes[r].exit_code not in (0,) or outcomes[r].error)]
    if kind is FailureKind.HANG:
        root = (stuck or [None])[0]
        ranks = sorted(stuck or [])
    elif lost:
        ranks = sorted(r for x in lost for r in x["ranks"])
        root = ranks[0] if ranks else None
    else:
        root = failed[0] if failed else None
        ranks = sorted(r for r, o in outcomes.items() if o.exit_code != 0 or o.error)
    o = outcomes.get(root) if root is not None else None
    tail = log_tail(logs_dir / f"rank_{root}.log") if root is not None else ""
    out = set(failed) | {root} | (set(ranks) if lost or kind is FailureKind.HANG else set())
    healthy = [r for r, x in sorted(outcomes.items()) if r not in out
               and (x.error == VICTIM or x.exit_code == 0)][:COMMON_PEERS]
    tb = (o.traceback if o and o.traceback else "") or traceback_from_log(tail)
    tail = without_common_lines(tail, [logs_dir / f"rank_{r}.log" for r in healthy])
    groups: OrderedDict[str, list[int]] = OrderedDict()
    for r in failed:
        key = outcomes[r].error.splitlines()[0] if outcomes[r].error else f"exit code {outcomes[r].exit_code}"
        groups.setdefault(key, []).append(r)
    if lost:
        from .node_health import describe_loss

        return {
            "kind": kind.value,
            "root_cause_rank": None,
            "nodes": lost,
            "ranks": ranks,
            "step": max((last_steps.get(r) or 0 for r in ranks), default=None),
            "exit_code": None,
            "signal": None,
            "error": describe_loss(lost),
            "log_tail": tail,
            "log_of_rank": root,
            "traceback": "",
            "errors": [{"error": describe_loss([x]), "ranks": x["ranks"]} for x in lost],
        }
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

    if f.get("nodes"):
        return printable("\n".join(_format_loss(f)))
    if f["kind"] == FailureKind.INPUT.value:  # no crash to trace: the key, path and node are the cause
        return printable("\n".join([f"FAILED ({f['kind']}): a file the config names is missing where ranks "
                                     "run; they stopped before training"]
                                    + [f"  ranks {g['ranks']}: {g['error']}" for g in f.get("errors", [])]))
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


def _format_loss(f: dict[str, Any]) -> list[str]:
    what = "node lost" if f["kind"] == FailureKind.NODE_LOST.value else "link lost (network partition)"
    lines = [f"FAILED ({f['kind']}): {what} after step {f['step']}"]
    for x in f["nodes"]:
        lines.append(f"  node {x['node']} ({x['host']}, {x['address']}): ranks {x['ranks']} went with it; {x['how']}")
    lines.append("  the other ranks were stopped")
    if f.get("log_tail"):
        lines.append(f"  last lines of logs/rank_{f['log_of_rank']}.log (lines every healthy rank prints left out):")
        lines += ["    " + ln for ln in f["log_tail"].splitlines()[-10:]]
    return lines
