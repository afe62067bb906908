"""What msrun says it did, and what each rank of a node says happened to it: the msrun
backend's per-rank outcomes, root cause first.

msrun (MindSpore 2.9, `parallel/cluster/process_entity/_api.py`) writes into its own output
(`logs/msrun_node<n>.log`, where the node agent sends it):

- `Start worker process with rank id:R, log file:PATH. Environment variable [RANK_ID=R] is
  exported. Execute command: CMD` for every worker it starts (and `Start scheduler
  process, log file:PATH. Execute command: CMD` on a master node);
- `Worker process PID exit with exception. Error code: C.` for the first worker it finds
  dead with a non-zero status (it polls its workers in local-rank order once a second),
  then `There's worker exits with exception, kill all other workers.` and SIGKILLs the
  rest; so a node's ranks all end "failed", and msrun's own verdict names the lowest
  failed local rank of that poll, not the first to fail.

Each rank's log (`logs/rank_<r>.log`, `--worker_log_name=rank`) has the entry point's
`[rank R] pid P starting` and, when the rank ended by itself, `[rank R] finished with exit
code C after Ns`, with its traceback before it. From both: a rank that wrote its own
non-zero exit, or that msrun saw die, failed by itself; one that msrun killed without
either is a victim; the ranks that failed by themselves are ordered by when they failed
(their log's last write; msrun's line for a rank that died without writing).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from mindpulse.frameworks.msrun_text import KILLED_OTHERS
from mindpulse.inputs.input_paths import INPUT_MISSING

from .failures import VICTIM, signal_name, traceback_from_log
from .spec import RankOutcome

_WORKER = re.compile(r"Start worker process with rank id:(\S+), log file:(.*?)\. Environment variable "
                     r"\[RANK_ID=\S*\] is exported\. Execute command: (.*)$", re.M)
_SCHEDULER = re.compile(r"Start scheduler process, log file:(.*?)\. Execute command: (.*)$", re.M)
_DIED = re.compile(r"^(?:\[ERROR\] ME\(\d+:\d+,\w+\):(\d{4}-\d\d-\d\d-\d\d:\d\d:\d\d)\.(\d{3})\.\d+ .*?)?"
                   r"Worker process (\d+) exit with exception\. Error code: (-?\d+)\.", re.M)
_PID = r"^\[rank {rank}\] pid (\d+) starting$"
_FINISHED = r"^\[rank {rank}\] finished with exit code (-?\d+) after [\d.]+s$"
_INPUT = r"^\[rank {rank}\] (" + INPUT_MISSING + r": .*)$"
"""A rank that stopped at its start on a missing input says so in one line, without a traceback."""


@dataclass
class MsrunWorker:
    """A worker msrun says it started."""

    rank: int
    log: str
    command: str


@dataclass
class MsrunLog:
    """What a node's msrun wrote about its own doing."""

    workers: dict[int, MsrunWorker] = field(default_factory=dict)
    scheduler_command: str | None = None
    died: list[tuple[int, int, float | None]] = field(default_factory=list)
    """(pid, exit status, when) of each worker msrun reported dead with an error, in its order."""
    killed_others: bool = False
    """msrun killed the node's other workers after one failed."""


@dataclass
class RankLog:
    """What one rank's log says about its end."""

    pid: int | None = None
    exit_code: int | None = None
    """The exit code it reported itself (None: it ended without saying, e.g. killed)."""
    error: str = ""
    """Its first error: the exception line of its first traceback."""
    traceback: str = ""


def parse_msrun_log(text: str) -> MsrunLog:
    out = MsrunLog()
    for m in _WORKER.finditer(text):
        try:
            rank = int(m.group(1))
        except ValueError:  # "None": no --node_rank on a multi-node job (mindpulse always passes it)
            continue
        out.workers[rank] = MsrunWorker(rank=rank, log=m.group(2), command=m.group(3).strip())
    m = _SCHEDULER.search(text)
    if m:
        out.scheduler_command = m.group(2).strip()
    for m in _DIED.finditer(text):
        when = None
        if m.group(1):
            try:  # MindSpore's log time is the host's local time
                when = time.mktime(time.strptime(m.group(1), "%Y-%m-%d-%H:%M:%S")) + int(m.group(2)) / 1000
            except (ValueError, OverflowError):
                when = None
        out.died.append((int(m.group(3)), int(m.group(4)), when))
    out.killed_others = KILLED_OTHERS in text
    return out


def parse_rank_log(text: str, rank: int) -> RankLog:
    out = RankLog()
    m = re.search(_PID.format(rank=rank), text, re.M)
    if m:
        out.pid = int(m.group(1))
    codes = re.findall(_FINISHED.format(rank=rank), text, re.M)
    if codes:
        out.exit_code = int(codes[-1])
    out.traceback = traceback_from_log(text, first=True)
    if out.traceback:
        out.error = out.traceback.splitlines()[-1].strip()
    elif m := re.search(_INPUT.format(rank=rank), text, re.M):
        out.error = m.group(1)
    return out


def node_outcomes(ranks: list[int], msrun_exit: int | None, msrun_text: str | None, rank_texts: dict[int, str],
                  rank_mtimes: dict[int, float] | None = None, node: int = 0,
                  hosts: dict[int, str] | None = None) -> list[RankOutcome]:
    """The outcome of each of a node's `ranks` once its msrun ended with `msrun_exit`, from
    msrun's output and the ranks' logs (texts; absent when not readable here). Ranks that
    failed by themselves come first, the first to fail first; then the rest in rank order."""
    hosts = hosts or {}
    mtimes = rank_mtimes or {}
    ms = parse_msrun_log(msrun_text or "")
    died = {pid: (code, when) for pid, code, when in ms.died}
    fallback = "" if msrun_exit == 0 else f"msrun on node {node} exited {msrun_exit}"
    own: list[tuple[float, int, RankOutcome]] = []
    rest: list[RankOutcome] = []
    for r in ranks:
        text = rank_texts.get(r)
        log = parse_rank_log(text, r) if text is not None else RankLog()
        seen = died.get(log.pid) if log.pid is not None else None
        if seen is not None:  # msrun saw this process exit with an error: its real exit status
            code, when = seen
            error = log.error if log.exit_code not in (None, 0) and log.error else (
                f"rank process died: {signal_name(-code)} (exit status {code}, reported by msrun)" if code < 0
                else log.error or f"exit code {code} (reported by msrun)")
            o = RankOutcome(rank=r, exit_code=code, error=error, traceback=log.traceback, pid=log.pid,
                            host=hosts.get(r))
            at = mtimes.get(r) if log.exit_code not in (None, 0) else None
            own.append((at if at is not None else when if when is not None else float("inf"), r, o))
        elif log.exit_code not in (None, 0):  # it wrote its own failure
            o = RankOutcome(rank=r, exit_code=log.exit_code, error=log.error or f"exit code {log.exit_code}",
                            traceback=log.traceback, pid=log.pid, host=hosts.get(r))
            own.append((mtimes.get(r, float("inf")), r, o))
        elif log.exit_code == 0:
            rest.append(RankOutcome(rank=r, exit_code=0, pid=log.pid, host=hosts.get(r)))
        elif ms.killed_others:  # alive when another rank of the node failed: msrun killed it
            rest.append(RankOutcome(rank=r, exit_code=None, error=VICTIM, pid=log.pid, host=hosts.get(r)))
        else:  # nothing to go on (logs elsewhere, or msrun itself was stopped): msrun's status
            rest.append(RankOutcome(rank=r, exit_code=msrun_exit, error=fallback, pid=log.pid, host=hosts.get(r)))
    own.sort(key=lambda x: (x[0], x[1]))
    return [o for _, _, o in own] + rest


def read_node_outcomes(logs_dir: Path, ranks: list[int], msrun_exit: int | None, node: int,
                       hosts: dict[int, str] | None = None) -> list[RankOutcome]:
    """`node_outcomes` from the files under `logs_dir` (the node's msrun log and rank logs)."""
    def read(path: Path) -> str | None:
        try:
            return path.read_text(errors="replace")
        except OSError:
            return None

    texts: dict[int, str] = {}
    mtimes: dict[int, float] = {}
    for r in ranks:
        path = logs_dir / f"rank_{r}.log"
        text = read(path)
        if text is not None:
            texts[r] = text
            try:
                mtimes[r] = path.stat().st_mtime
            except OSError:
                pass
    return node_outcomes(ranks, msrun_exit, read(logs_dir / f"msrun_node{node}.log"), texts, mtimes, node=node,
                         hosts=hosts)

