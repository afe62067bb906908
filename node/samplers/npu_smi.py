"""Ascend cards through the ``npu-smi`` tool, parsed by :mod:`mindpulse.node.npu_smi`.

Every ``npu-smi`` run of this process holds one process lock and, by default, a host-wide
``flock`` (:data:`DEFAULT_NPU_SMI_LOCK_PATH`), so samplers never run it concurrently.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..npu_smi import NpuCard, ParseResult, merge_cards, parse_npu_smi
from .base import MAX_SAMPLE_WARNINGS, Sampler, card_record, excerpt

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_NPU_SMI_LOCK_PATH",
    "NPU_SMI_DIRS",
    "NpuSmiSampler",
    "find_npu_smi",
    "npu_smi_not_found",
]

#: Host-wide lock file shared by every sampler that runs ``npu-smi`` on this machine.
DEFAULT_NPU_SMI_LOCK_PATH = "/tmp/mindpulse-npu-smi.lock"
#: Where ``npu-smi`` is installed when it is not on ``PATH`` (non-root shells).
NPU_SMI_DIRS: tuple[str, ...] = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin")

# One npu-smi at a time in this process, whichever sampler runs it.
_NPU_SMI_PROCESS_LOCK = threading.Lock()


def find_npu_smi(npu_smi: str = "npu-smi") -> str | None:
    """Path of the ``npu-smi`` executable: ``npu_smi`` itself if it is a path, else looked
    up on ``PATH`` and then in :data:`NPU_SMI_DIRS`; ``None`` if there is none."""
    if os.sep in npu_smi:
        return npu_smi if os.path.isfile(npu_smi) and os.access(npu_smi, os.X_OK) else None
    found = shutil.which(npu_smi)
    if found:
        return found
    for d in NPU_SMI_DIRS:
        p = os.path.join(d, npu_smi)
        if os.path.isfile(p) and os.access(p, os.X_OK):
            return p
    return None


def npu_smi_not_found(npu_smi: str = "npu-smi") -> str:
    """Where :func:`find_npu_smi` looked, for the message when it found nothing."""
    return (f"`{npu_smi}` is not on PATH (" + os.environ.get("PATH", "")
            + ") nor in " + ", ".join(NPU_SMI_DIRS))


@dataclass
class _RunResult:
    rc: int | None
    stdout: bytes = b""
    stderr: bytes = b""
    problem: str | None = None  # why no output: timeout, busy, cannot start, cancelled
    timed_out: bool = False


_LOGIC_LINE_RE = re.compile(r"^\s*(\d{1,6})\s+(\d{1,4})\s+(\d{1,6}|-)(?:\s|$)")


def _parse_logic_ids(text: str) -> dict[tuple[int, int], int]:
    """``npu-smi info -m`` -> {(npu, chip): chip logic id}; MCU rows (logic id ``-``) skipped.

    The listing has a header ``NPU ID  Chip ID  Chip Logic ID  Chip Name`` and one row of
    numbers per chip.
    """
    out: dict[tuple[int, int], int] = {}
    for line in (text or "").splitlines():
        m = _LOGIC_LINE_RE.match(line)
        if m and m.group(3) != "-":
            out[(int(m.group(1)), int(m.group(2)))] = int(m.group(3))
    return out


class NpuSmiSampler(Sampler):
    """Ascend cards through the ``npu-smi`` tool.

    The first sample runs ``npu-smi info`` to find the cards (NPU id, chip, name, health,
    physical id), again every ``rediscover_s`` seconds to refresh name and health. Every
    sample then runs ``npu-smi info -t Q -i N`` for each query ``Q`` of ``queries`` and each
    NPU id ``N`` and merges the listings per chip. ``card_ids`` limits the NPU ids queried
    (if discovery fails they are queried anyway).

    ``npu-smi`` is slow and misbehaves when run concurrently, so every invocation holds a
    process-wide lock and a host-wide ``flock`` on ``lock_path`` (``None``: process lock
    only). An invocation that outlives ``timeout_s`` is killed (with its process group) and
    the rest of that sample is skipped: the cards come back with ``None`` values and a
    warning. Waiting for the locks is bounded by ``lock_wait_s`` (default:
    ``timeout_s + 5``).

    The card id of a record is the chip's physical id when ``npu-smi`` prints one (A3
    boards), else its logic id from ``npu-smi info -m`` for NPUs with several chips, else
    the NPU id.
    """

    name = "npu-smi"
    QUERIES: tuple[str, ...] = ("usages", "power", "temp", "memory")

    def __init__(
        self,
        npu_smi: str = "npu-smi",
        timeout_s: float = 10.0,
        card_ids: list[int] | None = None,
        *,
        queries: Iterable[str] = QUERIES,
        lock_path: str | None = DEFAULT_NPU_SMI_LOCK_PATH,
        lock_wait_s: float | None = None,
        rediscover_s: float | None = 300.0,
    ) -> None:
        super().__init__()
        self.npu_smi = npu_smi
        self.timeout_s = float(timeout_s)
        self.card_ids = None if card_ids is None else [int(i) for i in card_ids]
        self.queries = tuple(queries)
        self.lock_path = lock_path
        self.lock_wait_s = self.timeout_s + 5.0 if lock_wait_s is None else float(lock_wait_s)
        self.rediscover_s = rediscover_s
        self._known: list[NpuCard] | None = None  # cards found by discovery
        self._discovered_at: float | None = None
        self._logic_ids: dict[tuple[int, int], int] = {}
        self._seen_parser_warnings: set[str] = set()
        self._unreaped: list[subprocess.Popen] = []
        self._lock = threading.Lock()  # one sample at a time per sampler

    @classmethod
    def available(cls, npu_smi: str = "npu-smi") -> bool:
        return find_npu_smi(npu_smi) is not None

    # -- running npu-smi -----------------------------------------------------------------

    def _command(self, args: list[str]) -> str:
        return " ".join(["npu-smi", *args])

    def _open_lock_file(self) -> tuple[int | None, str | None]:
        assert self.lock_path is not None
        flags = os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
        try:
            fd = os.open(self.lock_path, flags | os.O_RDWR | os.O_CREAT, 0o666)
        except OSError:
            try:  # made by another user without write access for us: a read-only fd locks too
                fd = os.open(self.lock_path, flags | os.O_RDONLY)
            except OSError as exc:
                return None, (
                    f"cannot open the npu-smi lock file {self.lock_path} ({exc.strerror}); "
                    "npu-smi runs are serialized in this process only"
                )
        try:
            os.fchmod(fd, 0o666)  # let other users' samplers lock it too
        except OSError:
            pass
        return fd, None

    def _run(self, args: list[str], warnings: list[str]) -> _RunResult:
        """Run ``npu-smi ARGS`` under both locks, with the timeout; never raises."""
        self._reap()
        cmd = self._command(args)
        deadline = time.monotonic() + self.lock_wait_s
        if not _NPU_SMI_PROCESS_LOCK.acquire(timeout=max(self.lock_wait_s, 0.0)):
            return _RunResult(None, problem=f"`{cmd}` not run: another npu-smi run in this "
                              f"process did not finish within {self.lock_wait_s:g} s")
        fd: int | None = None
        try:
            if self.lock_path is not None:
                fd, problem = self._open_lock_file()
                if problem is not None and problem not in warnings:
                    warnings.append(problem)
                if fd is not None:
                    while True:
                        try:
                            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                            break
                        except OSError as exc:
                            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EINTR):
                                warnings.append(f"cannot lock {self.lock_path} ({exc.strerror}); "
                                                "npu-smi runs are serialized in this process only")
                                break
                        if self.cancel_event.is_set():
                            return _RunResult(None, problem=f"`{cmd}` not run: sampling stopped")
                        if time.monotonic() >= deadline:
                            return _RunResult(None, problem=(
                                f"`{cmd}` not run: npu-smi is busy on this host (another "
                                f"process held {self.lock_path} for over {self.lock_wait_s:g} s)"))
                        time.sleep(0.02)
            return self._spawn(args, cmd)
        finally:
            if fd is not None:
                os.close(fd)  # releases the flock
            _NPU_SMI_PROCESS_LOCK.release()

    def _spawn(self, args: list[str], cmd: str) -> _RunResult:
        exe = find_npu_smi(self.npu_smi) or self.npu_smi
        if self.cancel_event.is_set():
            return _RunResult(None, problem=f"`{cmd}` not run: sampling stopped")
        try:
            proc = subprocess.Popen(
                [exe, *args],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,  # its own process group: a timeout kills all of it
            )
        except OSError as exc:
            return _RunResult(None, problem=f"`{cmd}` could not be started ({exc.strerror or exc})")
        deadline = time.monotonic() + self.timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self.cancel_event.is_set():
                cancelled = remaining > 0
                self._kill(proc)
                if cancelled:
                    return _RunResult(None, problem=f"`{cmd}` stopped: sampling stopped")
                return _RunResult(None, timed_out=True, problem=(
                    f"`{cmd}` timed out after {self.timeout_s:g} s and was killed"))
            try:
                out, err = proc.communicate(timeout=min(remaining, 0.1))
                return _RunResult(proc.returncode, out or b"", err or b"")
            except subprocess.TimeoutExpired:
                continue
            except OSError as exc:  # pipe trouble
                self._kill(proc)
                return _RunResult(None, problem=f"`{cmd}` failed ({exc})")

    def _kill(self, proc: subprocess.Popen) -> None:
        """A timed-out npu-smi: killed at once, no grace (mindpulse/lifetime/processes.py's
        `end_processes` waits a grace for a clean exit, which a hung query never makes), and one
        stuck in the driver is left to reap later instead of blocking the sampling thread."""
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError, OSError):
            try:
                proc.kill()
            except OSError:
                pass
        try:
            proc.communicate(timeout=2.0)
        except (subprocess.TimeoutExpired, OSError, ValueError):
            # stuck in the driver (uninterruptible): stop reading it, reap it later
            for pipe in (proc.stdout, proc.stderr):
                try:
                    if pipe is not None:
                        pipe.close()
                except OSError:
                    pass
            self._unreaped.append(proc)

    def _reap(self) -> None:
        if self._unreaped:
            self._unreaped = [p for p in self._unreaped if p.poll() is None]

    # -- discovery -----------------------------------------------------------------------

    def _parser_warnings(self, where: str, result: ParseResult, warnings: list[str]) -> None:
        # parser remarks repeat every sample: report each one once per sampler
        for w in result.warnings:
            if w not in self._seen_parser_warnings and len(self._seen_parser_warnings) < 500:
                self._seen_parser_warnings.add(w)
                warnings.append(f"{where}: {w}")

    def _discover(self, warnings: list[str]) -> bool:
        """Find the cards; False when npu-smi timed out, is busy or sampling stopped."""
        res = self._run(["info"], warnings)
        now = time.monotonic()
        if res.problem or res.rc != 0:
            why = res.problem or f"`npu-smi info` exited with status {res.rc}: {excerpt(res.stderr or res.stdout)}"
            if self._known is None and self.card_ids is not None:
                warnings.append(f"{why}; querying NPU ids {self.card_ids} without card details")
                self._known = [NpuCard(npu=i) for i in self.card_ids]
            else:
                warnings.append(why if self._known is None else f"{why}; keeping the cards found before")
            return res.problem is None
        parsed = parse_npu_smi(res.stdout)
        self._parser_warnings("npu-smi info", parsed, warnings)
        cards = [c for c in parsed.cards if c.npu is not None]
        if self.card_ids is not None:
            cards = [c for c in cards if c.npu in self.card_ids]
            missing = sorted(set(self.card_ids) - {c.npu for c in cards})
            if missing:
                warnings.append(f"NPU ids {missing} are not listed by `npu-smi info`")
                cards += [NpuCard(npu=i) for i in missing]
        if not cards:
            warnings.append("`npu-smi info` lists no NPU cards")
        self._known = cards
        self._discovered_at = now if cards else None  # no cards yet: look again next sample
        if any(n > 1 for n in chips_per_npu(cards).values()) and any(c.phy_id is None for c in cards):
            res = self._run(["info", "-m"], warnings)
            if res.problem is None and res.rc == 0:
                self._logic_ids = _parse_logic_ids(res.stdout.decode("utf-8", errors="replace"))
            if not self._logic_ids:
                warnings.append("NPUs with several chips and no physical ids, and "
                                "`npu-smi info -m` gave no logic ids: card ids left empty")
            if res.problem is not None:
                return False
        return True

    # -- sampling ------------------------------------------------------------------------

    def sample(self) -> list[dict[str, Any]]:
        warnings: list[str] = []
        try:
            with self._lock:
                return self._sample(warnings)
        except Exception as exc:  # noqa: BLE001 - a sampler never raises
            log.exception("npu-smi sampler failed")
            warnings.append(f"npu-smi sampler failed: {type(exc).__name__}: {exc}")
            return []
        finally:
            self.last_warnings = warnings[:MAX_SAMPLE_WARNINGS]

    def _sample(self, warnings: list[str]) -> list[dict[str, Any]]:
        due = (
            self._discovered_at is None
            or (self.rediscover_s is not None
                and time.monotonic() - self._discovered_at >= self.rediscover_s)
        )
        go_on = self._discover(warnings) if due else True
        known = self._known or []
        if not known:
            return []
        npus: list[int] = []
        for c in known:
            if c.npu is not None and c.npu not in npus:
                npus.append(c.npu)

        parts: list[list[NpuCard]] = []
        aborted = not go_on  # npu-smi hangs: the known cards come back without values
        if aborted:
            warnings.append("npu-smi queries of this sample skipped (their values are empty)")
        for npu in npus:
            for q in self.queries:
                if aborted:
                    break
                args = ["info", "-t", q, "-i", str(npu)]
                res = self._run(args, warnings)
                if res.problem is not None:
                    warnings.append(res.problem + "; the remaining npu-smi queries of this sample "
                                    "were skipped (their values are empty)")
                    aborted = True
                    break
                if res.rc != 0:
                    warnings.append(f"`{self._command(args)}` exited with status {res.rc}: "
                                    f"{excerpt(res.stderr or res.stdout)}")
                    continue
                parsed = parse_npu_smi(res.stdout)
                self._parser_warnings(self._command(args), parsed, warnings)
                mine = []
                for c in parsed.cards:
                    if c.npu is None:
                        c.npu = npu
                    if c.npu != npu:
                        warnings.append(f"`{self._command(args)}` reported NPU {c.npu}; ignored")
                        continue
                    mine.append(c)
                parts.append(mine)
        merged = merge_cards(*parts)
        self._parser_warnings("merging npu-smi listings", merged, warnings)

        by_key = {(c.npu, c.chip): c for c in merged.cards}
        by_npu: dict[int | None, list[NpuCard]] = {}
        for c in merged.cards:
            by_npu.setdefault(c.npu, []).append(c)
        chips_of = chips_per_npu(known)

        records: list[dict[str, Any]] = []
        used: set[int] = set()
        for k in known:
            m = by_key.get((k.npu, k.chip))
            if m is None and (k.chip is None or chips_of.get(k.npu, 0) == 1):
                # discovery without chip ids, or -t listings without a Chip ID line
                cands = [c for c in by_npu.get(k.npu, []) if id(c) not in used]
                if k.chip is None and len(cands) > 1:
                    for c in cands:  # several chips behind one NPU id found only now
                        used.add(id(c))
                        records.append(self._record(_identity(k, c), c, len(cands)))
                    continue
                m = cands[0] if cands else None
            if m is not None:
                used.add(id(m))
            records.append(self._record(k, m, chips_of.get(k.npu, 1)))
        return records

    def _record(self, ident: NpuCard, m: NpuCard | None, chips_of_npu: int) -> dict[str, Any]:
        chip = ident.chip if ident.chip is not None else (m.chip if m else None)
        phy = ident.phy_id if ident.phy_id is not None else (m.phy_id if m else None)
        card_id = card_id_of(NpuCard(npu=ident.npu, chip=chip, phy_id=phy), chips_of_npu, self._logic_ids)
        return record_of(ident, m, card_id, self.name)

    def close(self) -> None:
        self.cancel_event.set()
        self._reap()


def _identity(known: NpuCard, found: NpuCard) -> NpuCard:
    return NpuCard(npu=known.npu, chip=found.chip, phy_id=found.phy_id, name=known.name,
                   health=known.health)


def chips_per_npu(cards: list[NpuCard]) -> Counter[int | None]:
    """How many chips each NPU id has among `cards`."""
    return Counter(c.npu for c in cards)


def card_id_of(card: NpuCard, chips_of_npu: int, logic_ids: Mapping[tuple[int, int], int]) -> int | None:
    """A card's id: its physical id; else its logic id (`npu-smi info -m`); else its NPU id
    where the NPU has one chip; else none."""
    if card.phy_id is not None:
        return card.phy_id
    if card.npu is not None and card.chip is not None and (card.npu, card.chip) in logic_ids:
        return logic_ids[(card.npu, card.chip)]
    if chips_of_npu <= 1:
        return card.npu
    return None


def record_of(ident: NpuCard, m: NpuCard | None, card_id: int | None, source: str) -> dict[str, Any]:
    """The card record of a card (`ident`: what discovery found) with the values one sample's
    listings gave it (`m`, None: none)."""
    v = m or NpuCard()
    if v.hbm_total_mb:  # HBM boards (910 class); DDR boards (310 class) report memory
        used, total = v.hbm_used_mb, v.hbm_total_mb
    elif v.memory_total_mb is not None:
        used, total = v.memory_used_mb, v.memory_total_mb
    else:
        used, total = v.hbm_used_mb, v.hbm_total_mb
    return card_record(
        card=card_id,
        chip=ident.chip if ident.chip is not None else v.chip,
        name=ident.name or v.name,
        # a fresh value when a query reports health (e.g. queries with "health"),
        # else the one of the last discovery
        health=v.health or ident.health,
        util_pct=v.aicore_pct,
        memory_used_mb=used,
        memory_total_mb=total,
        power_w=v.power_w,
        temp_c=v.temp_c,
        source=source,
    )


def records_of_listing(cards: list[NpuCard], source: str = "npu-smi") -> list[dict[str, Any]]:
    """The card records one saved npu-smi listing gives (`mindpulse telemetry parse-npu-smi`):
    each card's id as `card_id_of` gives it without logic ids (a live sampler also asks
    `npu-smi info -m` for those of multi-chip NPUs)."""
    chips = chips_per_npu(cards)
    return [record_of(c, c, card_id_of(c, chips[c.npu], {}), source) for c in cards]
