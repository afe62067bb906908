"""Per-node telemetry: read every card of a node on an interval (never per training step).

A *sampler* reads all cards of one machine from one source:

* :class:`DcmiSampler` - Huawei's ``libdcmi.so`` through ctypes (Ascend; used only when the
  library loads, ``dcmi_init`` returns 0 and a trial read returns values);
* :class:`NpuSmiSampler` - the ``npu-smi`` tool (Ascend), parsed by :mod:`.npu_smi`;
* :class:`NvmlSampler` - NVIDIA's NVML through ``pynvml`` (GPUs);
* :class:`PsutilSampler` - the host CPU and memory (CPU runs), plus per-rank process stats.

Each returns *card records*: plain dicts with exactly the keys of :data:`CARD_KEYS`
(``None`` where the source has no value). A :class:`NodeSampler` puts the node name and
the ranks of each card into the records, adds host and per-rank process statistics, and
either samples once (:meth:`NodeSampler.sample_once`) or on a daemon thread
(:meth:`NodeSampler.start`). Its sample dict has the fields of
:class:`~.packets.TelemetryPacket` (``node``, ``ts``, ``source``, ``cards``, ``host``) plus
``warnings``; :func:`telemetry_packet` turns it into a packet.

Nothing here raises while sampling: failures become ``None`` values and warnings.
"""

from __future__ import annotations

import abc
import ctypes
import ctypes.util
import errno
import fcntl
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import psutil

from .npu_smi import NpuCard, ParseResult, merge_cards, parse_npu_smi

log = logging.getLogger(__name__)

__all__ = [
    "CARD_KEYS",
    "HOST_KEYS",
    "PROCESS_KEYS",
    "TelemetryUnavailable",
    "Sampler",
    "NpuSmiSampler",
    "DcmiSampler",
    "NvmlSampler",
    "PsutilSampler",
    "NodeSampler",
    "card_record",
    "find_npu_smi",
    "pick_sampler",
    "sample_this_machine",
    "telemetry_packet",
]

#: Keys of a card record, in this order.
CARD_KEYS: tuple[str, ...] = (
    "node",
    "card",
    "chip",
    "name",
    "health",
    "util_pct",
    "memory_used_mb",
    "memory_total_mb",
    "power_w",
    "temp_c",
    "ranks",
    "source",
)
#: Keys of the ``host`` dict of a sample.
HOST_KEYS: tuple[str, ...] = ("cpu_pct", "mem_used_mb", "mem_total_mb", "processes")
#: Keys of one entry of ``host["processes"]``.
PROCESS_KEYS: tuple[str, ...] = ("rank", "pid", "cpu_pct", "rss_mb")

_MB = float(1 << 20)
#: At most this many warnings per sample.
MAX_SAMPLE_WARNINGS = 50
_EXCERPT = 200


class TelemetryUnavailable(RuntimeError):
    """No telemetry source for the requested device on this machine; the message says why."""


def card_record(**values: Any) -> dict[str, Any]:
    """A card record with every key of :data:`CARD_KEYS` (``None``/``[]`` where not given)."""
    rec: dict[str, Any] = {k: None for k in CARD_KEYS}
    rec["ranks"] = []
    for k, v in values.items():
        if k not in rec:
            raise KeyError(f"not a card record key: {k!r}")
        rec[k] = v
    return rec


def _num(v: Any) -> float | None:
    """Float, or ``None`` for missing / non-numeric / non-finite values."""
    if v is None or isinstance(v, bool):
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if f == f and f not in (float("inf"), float("-inf")) else None


def _mb(nbytes: Any) -> float | None:
    f = _num(nbytes)
    return None if f is None else round(f / _MB, 1)


def _excerpt(text: str | bytes | None) -> str:
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode("utf-8", errors="replace")
    s = " ".join((text or "").split())
    return s if len(s) <= _EXCERPT else s[:_EXCERPT] + "..."


# ---------------------------------------------------------------------------- samplers


class Sampler(abc.ABC):
    """Reads every card of this machine from one source.

    :meth:`sample` returns card records without ``node`` and ``ranks`` (the
    :class:`NodeSampler` fills them) and leaves what went wrong in :attr:`last_warnings`.
    """

    name: str = ""

    def __init__(self) -> None:
        self.last_warnings: list[str] = []
        #: Set to abandon a sample in progress (a :class:`NodeSampler` sets it on stop).
        self.cancel_event = threading.Event()

    @classmethod
    def available(cls) -> bool:
        """Whether this source can be used on this machine."""
        return True

    @abc.abstractmethod
    def sample(self) -> list[dict[str, Any]]:
        """One reading of all cards; never raises for a failing source."""

    def close(self) -> None:
        """Release what the source holds (library handles); the sampler is not used after."""


# ------------------------------------------------------------------------------ npu-smi

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
            why = res.problem or f"`npu-smi info` exited with status {res.rc}: {_excerpt(res.stderr or res.stdout)}"
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
        chips: dict[int | None, int] = {}
        for c in cards:
            chips[c.npu] = chips.get(c.npu, 0) + 1
        if any(n > 1 for n in chips.values()) and any(c.phy_id is None for c in cards):
            res = self._run(["info", "-m"], warnings)
            if res.problem is None and res.rc == 0:
                self._logic_ids = _parse_logic_ids(res.stdout.decode("utf-8", errors="replace"))
            if not self._logic_ids:
                warnings.append("NPUs with several chips and no physical ids, and "
                                "`npu-smi info -m` gave no logic ids: card ids left empty")
            if res.problem is not None:
                return False
        return True

    def _card_id(self, card: NpuCard, chips_of_npu: int) -> int | None:
        if card.phy_id is not None:
            return card.phy_id
        if card.npu is not None and card.chip is not None and (card.npu, card.chip) in self._logic_ids:
            return self._logic_ids[(card.npu, card.chip)]
        if chips_of_npu <= 1:
            return card.npu
        return None

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
                                    f"{_excerpt(res.stderr or res.stdout)}")
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
        chips_of: dict[int | None, int] = {}
        for c in known:
            chips_of[c.npu] = chips_of.get(c.npu, 0) + 1

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
        v = m or NpuCard()
        if v.hbm_total_mb:  # HBM boards (910 class); DDR boards (310 class) report memory
            used, total = v.hbm_used_mb, v.hbm_total_mb
        elif v.memory_total_mb is not None:
            used, total = v.memory_used_mb, v.memory_total_mb
        else:
            used, total = v.hbm_used_mb, v.hbm_total_mb
        chip = ident.chip if ident.chip is not None else v.chip
        ident_full = NpuCard(npu=ident.npu, chip=chip, phy_id=ident.phy_id if ident.phy_id is not None else v.phy_id)
        return card_record(
            card=self._card_id(ident_full, chips_of_npu),
            chip=chip,
            name=ident.name or v.name,
            # a fresh value when a query reports health (e.g. queries with "health"),
            # else the one of the last discovery
            health=v.health or ident.health,
            util_pct=v.aicore_pct,
            memory_used_mb=used,
            memory_total_mb=total,
            power_w=v.power_w,
            temp_c=v.temp_c,
            source=self.name,
        )

    def close(self) -> None:
        self.cancel_event.set()
        self._reap()


def _identity(known: NpuCard, found: NpuCard) -> NpuCard:
    return NpuCard(npu=known.npu, chip=found.chip, phy_id=found.phy_id, name=known.name,
                   health=known.health)


# --------------------------------------------------------------------------------- DCMI


class _DcmiHbmInfo(ctypes.Structure):
    _fields_ = [
        ("memory_size", ctypes.c_ulonglong),  # MB
        ("freq", ctypes.c_uint),
        ("memory_usage", ctypes.c_ulonglong),  # MB
        ("temp", ctypes.c_int),
        ("bandwith_util_rate", ctypes.c_uint),
        ("_pad", ctypes.c_ubyte * 256),  # room in case a driver's struct is larger
    ]


class _DcmiMemoryInfoV3(ctypes.Structure):
    _fields_ = [
        ("memory_size", ctypes.c_ulonglong),  # MB
        ("memory_available", ctypes.c_ulonglong),
        ("freq", ctypes.c_uint),
        ("hugepagesize", ctypes.c_ulong),
        ("hugepages_total", ctypes.c_ulong),
        ("hugepages_free", ctypes.c_ulong),
        ("utiliza", ctypes.c_uint),  # %
        ("reserve", ctypes.c_ubyte * 60),
        ("_pad", ctypes.c_ubyte * 256),
    ]


class _DcmiChipInfo(ctypes.Structure):
    _fields_ = [
        ("chip_type", ctypes.c_ubyte * 32),
        ("chip_name", ctypes.c_ubyte * 32),
        ("chip_ver", ctypes.c_ubyte * 32),
        ("aicore_cnt", ctypes.c_uint),
        ("_pad", ctypes.c_ubyte * 256),
    ]


_DCMI_HEALTH = {0: "OK", 1: "Warning", 2: "Alarm", 3: "Critical"}
_DCMI_UTIL_AICORE = 2
_DCMI_MAX_CARDS = 64

_INT_P = ctypes.POINTER(ctypes.c_int)
_UINT_P = ctypes.POINTER(ctypes.c_uint)
_DCMI_SIGNATURES: dict[str, tuple[Any, ...]] = {
    "dcmi_init": (),
    "dcmi_get_card_list": (_INT_P, _INT_P, ctypes.c_int),
    "dcmi_get_card_num_list": (_INT_P, _INT_P, ctypes.c_int),
    "dcmi_get_device_num_in_card": (ctypes.c_int, _INT_P),
    "dcmi_get_device_id_in_card": (ctypes.c_int, _INT_P, _INT_P, _INT_P),
    "dcmi_get_device_logic_id": (_INT_P, ctypes.c_int, ctypes.c_int),
    "dcmi_get_device_phyid_from_logicid": (ctypes.c_uint, _UINT_P),
    "dcmi_get_device_utilization_rate": (ctypes.c_int, ctypes.c_int, ctypes.c_int, _UINT_P),
    "dcmi_get_device_power_info": (ctypes.c_int, ctypes.c_int, _INT_P),
    "dcmi_get_device_temperature": (ctypes.c_int, ctypes.c_int, _INT_P),
    "dcmi_get_device_health": (ctypes.c_int, ctypes.c_int, _UINT_P),
    "dcmi_get_device_hbm_info": (ctypes.c_int, ctypes.c_int, ctypes.POINTER(_DcmiHbmInfo)),
    "dcmi_get_device_memory_info_v3": (ctypes.c_int, ctypes.c_int, ctypes.POINTER(_DcmiMemoryInfoV3)),
    "dcmi_get_device_chip_info": (ctypes.c_int, ctypes.c_int, ctypes.POINTER(_DcmiChipInfo)),
}


def _c_text(arr: Any) -> str | None:
    s = bytes(arr).split(b"\0", 1)[0].decode("utf-8", errors="replace").strip()
    return s or None


class DcmiSampler(Sampler):
    """Ascend cards through ``libdcmi.so`` (the library ``npu-smi`` itself uses), via ctypes.

    Opt-in by construction: :meth:`available` is true only when the library loads and
    ``dcmi_init()`` returns 0, and :func:`pick_sampler` keeps it only when a trial read
    returns values. Signatures follow the DCMI API reference (power in 0.1 W, memory in
    MB, utilisation type 2 = AI Core); a call that fails leaves its value ``None``.
    ``lib`` replaces the loaded library (tests).
    """

    name = "dcmi"
    LIBRARY_PATHS: tuple[str, ...] = (
        "/usr/local/Ascend/driver/lib64/driver/libdcmi.so",
        "/usr/local/dcmi/libdcmi.so",
        "/usr/local/Ascend/driver/lib64/libdcmi.so",
    )
    _class_lock = threading.Lock()
    _loaded: Any = None
    _load_tried = False
    #: Why the library is not usable (after :meth:`available` returned False).
    load_error: str | None = None

    def __init__(self, lib: Any = None) -> None:
        super().__init__()
        if lib is None:
            lib = self._load()
            if lib is None:
                raise TelemetryUnavailable(f"DCMI is not usable: {self.load_error}")
        self._lib = lib

    @classmethod
    def _library_candidates(cls) -> list[str]:
        out = [p for p in cls.LIBRARY_PATHS if os.path.exists(p)]
        found = ctypes.util.find_library("dcmi")
        if found:
            out.append(found)
        return out

    @classmethod
    def _load(cls) -> Any:
        with cls._class_lock:
            if cls._load_tried:
                return cls._loaded
            cls._load_tried = True
            candidates = cls._library_candidates()
            if not candidates:
                cls.load_error = ("libdcmi.so not found (looked in " + ", ".join(cls.LIBRARY_PATHS)
                                  + " and the linker's search path)")
                return None
            errors = []
            for path in candidates:
                try:
                    lib = ctypes.CDLL(path)
                except OSError as exc:
                    errors.append(f"{path}: {exc}")
                    continue
                for fn, argtypes in _DCMI_SIGNATURES.items():
                    f = getattr(lib, fn, None)
                    if f is not None:
                        f.argtypes = list(argtypes)
                        f.restype = ctypes.c_int
                if getattr(lib, "dcmi_init", None) is None:
                    errors.append(f"{path}: no dcmi_init")
                    continue
                try:
                    rc = lib.dcmi_init()
                except Exception as exc:  # noqa: BLE001
                    errors.append(f"{path}: dcmi_init failed ({exc})")
                    continue
                if rc != 0:
                    errors.append(f"{path}: dcmi_init returned {rc}")
                    continue
                cls._loaded = lib
                cls.load_error = None
                return lib
            cls.load_error = "; ".join(errors)
            return None

    @classmethod
    def available(cls) -> bool:
        return cls._load() is not None

    def _call(self, fn: str, *args: Any, errors: dict[str, int]) -> bool:
        f = getattr(self._lib, fn, None)
        if f is None:
            errors.setdefault(fn, -1)
            return False
        try:
            rc = f(*args)
        except Exception:  # noqa: BLE001 - wrong argument types and the like
            errors.setdefault(fn, -2)
            return False
        if rc != 0:
            errors.setdefault(fn, int(rc))
            return False
        return True

    def sample(self) -> list[dict[str, Any]]:
        warnings: list[str] = []
        try:
            with self._class_lock:
                return self._sample(warnings)
        except Exception as exc:  # noqa: BLE001
            log.exception("DCMI sampler failed")
            warnings.append(f"DCMI sampler failed: {type(exc).__name__}: {exc}")
            return []
        finally:
            self.last_warnings = warnings[:MAX_SAMPLE_WARNINGS]

    def _card_ids(self, errors: dict[str, int]) -> list[int]:
        num = ctypes.c_int(0)
        ids = (ctypes.c_int * _DCMI_MAX_CARDS)()
        for fn in ("dcmi_get_card_list", "dcmi_get_card_num_list"):
            if getattr(self._lib, fn, None) is None:
                continue
            if self._call(fn, ctypes.byref(num), ids, _DCMI_MAX_CARDS, errors=errors):
                errors.pop("dcmi_get_card_list", None)
                n = max(0, min(num.value, _DCMI_MAX_CARDS))
                return [ids[i] for i in range(n)]
        return []

    def _chip_ids(self, card: int, errors: dict[str, int]) -> list[int]:
        # device_id_max NPU chips (0..max-1); the MCU and CPU have their own ids
        dmax, mcu, cpu = ctypes.c_int(0), ctypes.c_int(-1), ctypes.c_int(-1)
        if getattr(self._lib, "dcmi_get_device_id_in_card", None) is not None and self._call(
            "dcmi_get_device_id_in_card", card, ctypes.byref(dmax), ctypes.byref(mcu),
            ctypes.byref(cpu), errors=errors
        ):
            skip = {mcu.value, cpu.value}
            return [d for d in range(max(0, min(dmax.value, 64))) if d not in skip]
        errors.pop("dcmi_get_device_id_in_card", None)
        num = ctypes.c_int(0)
        if self._call("dcmi_get_device_num_in_card", card, ctypes.byref(num), errors=errors):
            return list(range(max(0, min(num.value, 64))))
        return []

    def _sample(self, warnings: list[str]) -> list[dict[str, Any]]:
        errors: dict[str, int] = {}
        records = []
        for card in self._card_ids(errors):
            for dev in self._chip_ids(card, errors):
                records.append(self._read_chip(card, dev, errors))
        for fn, rc in errors.items():
            what = {-1: "missing from the library", -2: "could not be called"}.get(rc, f"returned {rc}")
            warnings.append(f"DCMI {fn} {what}; its values are empty")
        if not records and not errors:
            warnings.append("DCMI lists no NPU cards")
        return records

    def _read_chip(self, card: int, dev: int, errors: dict[str, int]) -> dict[str, Any]:
        logic, phy = ctypes.c_int(-1), ctypes.c_uint(0)
        card_id: int | None = None
        if self._call("dcmi_get_device_logic_id", ctypes.byref(logic), card, dev, errors=errors):
            card_id = logic.value
            if self._call("dcmi_get_device_phyid_from_logicid", ctypes.c_uint(logic.value),
                          ctypes.byref(phy), errors=errors):
                card_id = int(phy.value)
        u = ctypes.c_uint(0)
        util = float(u.value) if self._call("dcmi_get_device_utilization_rate", card, dev,
                                            _DCMI_UTIL_AICORE, ctypes.byref(u), errors=errors) else None
        p = ctypes.c_int(0)
        power = p.value / 10.0 if self._call("dcmi_get_device_power_info", card, dev,
                                             ctypes.byref(p), errors=errors) else None
        t = ctypes.c_int(0)
        temp = float(t.value) if self._call("dcmi_get_device_temperature", card, dev,
                                            ctypes.byref(t), errors=errors) else None
        h = ctypes.c_uint(0)
        health = (_DCMI_HEALTH.get(h.value, "UNKNOWN")
                  if self._call("dcmi_get_device_health", card, dev, ctypes.byref(h), errors=errors)
                  else None)
        used = total = None
        hbm = _DcmiHbmInfo()
        if self._call("dcmi_get_device_hbm_info", card, dev, ctypes.byref(hbm), errors=errors) \
                and hbm.memory_size > 0:
            total, used = float(hbm.memory_size), float(hbm.memory_usage)
        else:
            errors.pop("dcmi_get_device_hbm_info", None)  # DDR boards have no HBM
            mem = _DcmiMemoryInfoV3()
            if self._call("dcmi_get_device_memory_info_v3", card, dev, ctypes.byref(mem),
                          errors=errors) and mem.memory_size > 0:
                total = float(mem.memory_size)
                used = round(total * min(mem.utiliza, 100) / 100.0, 1)
        chip = _DcmiChipInfo()
        name = None
        if self._call("dcmi_get_device_chip_info", card, dev, ctypes.byref(chip), errors=errors):
            name = _c_text(chip.chip_name)
        return card_record(card=card_id, chip=dev, name=name, health=health, util_pct=util,
                           memory_used_mb=used, memory_total_mb=total, power_w=power,
                           temp_c=temp, source=self.name)


# --------------------------------------------------------------------------------- NVML


class NvmlSampler(Sampler):
    """NVIDIA GPUs through NVML (``pynvml``); card ids are NVML indexes (not affected by
    ``CUDA_VISIBLE_DEVICES``)."""

    name = "nvml"
    #: Why NVML is not usable (after :meth:`available` returned False).
    load_error: str | None = None

    def __init__(self) -> None:
        super().__init__()
        try:
            import pynvml
        except ImportError as exc:
            raise TelemetryUnavailable(f"pynvml (nvidia-ml-py) is not installed ({exc})") from None
        self._nv = pynvml
        try:
            pynvml.nvmlInit()
        except Exception as exc:  # noqa: BLE001 - NVMLError subclasses
            raise TelemetryUnavailable(f"NVML could not be initialised: {exc}") from None
        self._open = True
        self._lock = threading.Lock()

    @classmethod
    def available(cls) -> bool:
        try:
            import pynvml
        except ImportError as exc:
            cls.load_error = f"pynvml (nvidia-ml-py) is not installed ({exc})"
            return False
        try:
            pynvml.nvmlInit()
        except Exception as exc:  # noqa: BLE001
            cls.load_error = f"NVML could not be initialised ({exc}); no NVIDIA driver?"
            return False
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass
        cls.load_error = None
        return True

    def sample(self) -> list[dict[str, Any]]:
        warnings: list[str] = []
        failed: dict[str, str] = {}
        try:
            with self._lock:
                if not self._open:
                    warnings.append("NVML sampler is closed")
                    return []
                nv = self._nv
                count = nv.nvmlDeviceGetCount()
                records = []
                for i in range(count):
                    records.append(self._read(i, failed))
                return records
        except Exception as exc:  # noqa: BLE001
            warnings.append(f"NVML sampler failed: {type(exc).__name__}: {exc}")
            return []
        finally:
            for what, err in failed.items():
                warnings.append(f"NVML {what} failed ({err}); its values are empty")
            self.last_warnings = warnings[:MAX_SAMPLE_WARNINGS]

    def _read(self, index: int, failed: dict[str, str]) -> dict[str, Any]:
        nv = self._nv

        def get(what: str, fn: Callable[[], Any]) -> Any:
            try:
                return fn()
            except Exception as exc:  # noqa: BLE001 - NVMLError_NotSupported etc.
                failed.setdefault(what, str(exc))
                return None

        h = get("handle", lambda: nv.nvmlDeviceGetHandleByIndex(index))
        if h is None:
            return card_record(card=index, source=self.name)
        name = get("name", lambda: nv.nvmlDeviceGetName(h))
        if isinstance(name, bytes):
            name = name.decode("utf-8", errors="replace")
        util = get("utilization", lambda: nv.nvmlDeviceGetUtilizationRates(h))
        mem = get("memory", lambda: nv.nvmlDeviceGetMemoryInfo(h))
        power = get("power", lambda: nv.nvmlDeviceGetPowerUsage(h))
        temp = get("temperature", lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))
        return card_record(
            card=index,
            name=name,
            util_pct=_num(getattr(util, "gpu", None)),
            memory_used_mb=_mb(getattr(mem, "used", None)),
            memory_total_mb=_mb(getattr(mem, "total", None)),
            power_w=None if _num(power) is None else _num(power) / 1000.0,
            temp_c=_num(temp),
            source=self.name,
        )

    def close(self) -> None:
        with self._lock:
            if self._open:
                self._open = False
                try:
                    self._nv.nvmlShutdown()
                except Exception:  # noqa: BLE001
                    pass


# ------------------------------------------------------------------------------- psutil


class _CpuMeter:
    """Host CPU % between two readings, private to its owner (``psutil.cpu_percent``
    keeps one process-wide baseline that every caller resets)."""

    MIN_INTERVAL_S = 0.1

    def __init__(self) -> None:
        self._last = self._read()

    @staticmethod
    def _read() -> tuple[float, float, float]:
        t = psutil.cpu_times()
        total = sum(t)
        # guest time is already counted in user time on Linux
        total -= getattr(t, "guest", 0.0) + getattr(t, "guest_nice", 0.0)
        idle = t.idle + getattr(t, "iowait", 0.0)
        return time.monotonic(), total, idle

    def percent(self) -> float | None:
        wait = self.MIN_INTERVAL_S - (time.monotonic() - self._last[0])
        if wait > 0:  # right after the baseline: measure over a short interval instead
            time.sleep(wait)
        now = self._read()
        d_total = now[1] - self._last[1]
        d_busy = d_total - (now[2] - self._last[2])
        self._last = now
        if d_total <= 0:
            return None
        return round(max(0.0, min(100.0, 100.0 * d_busy / d_total)), 1)


class PsutilSampler(Sampler):
    """The host as one card (``card=-1``, name ``cpu``) and per-rank process statistics.

    ``util_pct`` is the host CPU % since the previous sample (the first sample measures
    over 0.1 s); memory is host memory in use (total - available) and total, in MB.
    """

    name = "psutil"

    def __init__(self) -> None:
        super().__init__()
        self._cpu = _CpuMeter()
        self._procs: dict[int, psutil.Process] = {}
        self._lock = threading.Lock()

    def host_stats(self) -> dict[str, Any]:
        """``{"cpu_pct", "mem_used_mb", "mem_total_mb"}`` of this host."""
        with self._lock:
            cpu = self._cpu.percent()
        vm = psutil.virtual_memory()
        return {
            "cpu_pct": cpu,
            "mem_used_mb": _mb(vm.total - vm.available),
            "mem_total_mb": _mb(vm.total),
        }

    def sample(self) -> list[dict[str, Any]]:
        warnings: list[str] = []
        try:
            h = self.host_stats()
            return [card_record(card=-1, name="cpu", util_pct=h["cpu_pct"],
                                memory_used_mb=h["mem_used_mb"], memory_total_mb=h["mem_total_mb"],
                                source=self.name)]
        except Exception as exc:  # noqa: BLE001
            warnings.append(f"psutil sampler failed: {type(exc).__name__}: {exc}")
            return []
        finally:
            self.last_warnings = warnings

    def process_stats(self, pids: dict[int, int]) -> list[dict[str, Any]]:
        """Per rank ``{"rank", "pid", "cpu_pct", "rss_mb"}`` for ``{rank: pid}``, by rank.

        ``cpu_pct`` is the process's CPU % since the previous call (can exceed 100 with
        several threads busy; ``None`` the first time a pid is seen). A pid that is gone,
        a zombie, or not readable gives ``None`` values.
        """
        out: list[dict[str, Any]] = []
        with self._lock:
            wanted = set()
            for rank, pid in sorted((pids or {}).items(), key=lambda kv: kv[0]):
                entry = {"rank": rank, "pid": pid, "cpu_pct": None, "rss_mb": None}
                out.append(entry)
                if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
                    continue
                wanted.add(pid)
                proc = self._procs.get(pid)
                first = False
                try:
                    if proc is None or not proc.is_running():  # is_running also catches pid reuse
                        proc = psutil.Process(pid)
                        self._procs[pid] = proc
                        first = True
                    with proc.oneshot():
                        if proc.status() == psutil.STATUS_ZOMBIE:
                            continue
                        cpu = proc.cpu_percent(interval=None)
                        entry["rss_mb"] = _mb(proc.memory_info().rss)
                    entry["cpu_pct"] = None if first else round(cpu, 1)
                except (psutil.NoSuchProcess, psutil.ZombieProcess):
                    self._procs.pop(pid, None)
                except psutil.AccessDenied:
                    pass
            for pid in list(self._procs):
                if pid not in wanted:
                    del self._procs[pid]
        return out


# -------------------------------------------------------------------------- choosing one

_DEVICE_ALIASES = {
    "ascend": "ascend", "npu": "ascend",
    "gpu": "gpu", "cuda": "gpu", "nvidia": "gpu",
    "cpu": "cpu",
    "auto": "auto",
}
_SOURCES_OF = {"ascend": ("dcmi", "npu-smi"), "gpu": ("nvml",), "cpu": ("psutil",)}


def _has_values(records: list[dict[str, Any]]) -> bool:
    keys = ("util_pct", "memory_total_mb", "power_w", "temp_c")
    return any(any(r.get(k) is not None for k in keys) for r in records)


def _pick(device: str, prefer: str, notes: list[str]) -> Sampler:
    dev = _DEVICE_ALIASES.get(str(device).lower())
    if dev is None:
        raise ValueError(f"unknown device {device!r} (expected ascend, gpu, cpu or auto)")
    prefer = str(prefer).lower()
    all_sources = {s for v in _SOURCES_OF.values() for s in v}
    if prefer != "auto" and prefer not in all_sources:
        raise ValueError(f"unknown telemetry source {prefer!r} (expected auto, "
                         + ", ".join(sorted(all_sources)) + ")")
    if dev == "auto":
        for d in ("ascend", "gpu"):
            if prefer != "auto" and prefer not in _SOURCES_OF[d]:
                continue
            try:
                return _pick(d, prefer, notes)
            except TelemetryUnavailable as exc:
                notes.append(str(exc))
        if prefer not in ("auto", "psutil"):
            raise TelemetryUnavailable("; ".join(notes))
        return PsutilSampler()
    if prefer != "auto" and prefer not in _SOURCES_OF[dev]:
        raise ValueError(f"source {prefer!r} does not read {dev} devices "
                         f"(it has: {', '.join(_SOURCES_OF[dev])})")
    if dev == "cpu":
        return PsutilSampler()
    if dev == "gpu":
        if NvmlSampler.available():
            return NvmlSampler()
        raise TelemetryUnavailable(f"no GPU telemetry on this machine: {NvmlSampler.load_error}")
    # ascend
    missing = []
    if prefer in ("auto", "dcmi"):
        if DcmiSampler.available():
            s = DcmiSampler()
            trial = s.sample()
            if _has_values(trial):
                return s
            missing.append("DCMI loads but a trial read returned no values ("
                           + "; ".join(s.last_warnings[:3]) + ")")
            s.close()
        else:
            missing.append(f"DCMI is not usable: {DcmiSampler.load_error}")
    if prefer in ("auto", "npu-smi"):
        path = find_npu_smi()
        if path is not None:
            notes.extend(missing)
            return NpuSmiSampler(path)
        missing.append("`npu-smi` is not on PATH (" + os.environ.get("PATH", "")
                       + ") nor in " + ", ".join(NPU_SMI_DIRS))
    raise TelemetryUnavailable("no Ascend telemetry on this machine: " + "; ".join(missing)
                               + ". Install the Ascend driver (it ships npu-smi and libdcmi.so)"
                               " or run with device cpu")


def pick_sampler(device: str, prefer: str = "auto") -> Sampler:
    """The sampler for ``device`` on this machine.

    ``ascend``: :class:`DcmiSampler` if DCMI works, else :class:`NpuSmiSampler` if
    ``npu-smi`` is found; ``gpu``: :class:`NvmlSampler`; ``cpu``: :class:`PsutilSampler`;
    ``auto``: the first of Ascend, GPU that works, else psutil. ``prefer`` names one source
    (``dcmi``, ``npu-smi``, ``nvml``, ``psutil``) to use only that one. Raises
    :class:`TelemetryUnavailable` saying what is missing, ``ValueError`` for unknown names.
    """
    return _pick(device, prefer, [])


# ------------------------------------------------------------------------------ per node


class NodeSampler:
    """All cards of one node, with the ranks on each card and the ranks' processes.

    ``rank_devices`` maps each global rank on this node to its physical card id (the
    ``card`` of the records); with the psutil source (one ``card=-1`` record for the host)
    every rank is on that record. ``rank_pids`` maps ranks to process ids for
    ``host["processes"]``. Host CPU and memory are read with psutil whatever the source.
    """

    def __init__(
        self,
        node: str,
        sampler: Sampler,
        rank_devices: dict[int, int],
        rank_pids: dict[int, int] | None = None,
        interval_s: float = 5.0,
    ) -> None:
        self.node = str(node)
        self.sampler = sampler
        self.rank_devices = dict(rank_devices or {})
        self.rank_pids = dict(rank_pids or {})
        self.interval_s = float(interval_s)
        self._host = sampler if isinstance(sampler, PsutilSampler) else PsutilSampler()
        self._sample_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.samples_taken = 0
        self.callback_errors = 0

    def sample_once(self) -> dict[str, Any]:
        """One sample: ``{"node", "ts", "source", "cards", "host", "warnings"}``; never raises."""
        with self._sample_lock:
            try:
                return self._sample()
            except Exception as exc:  # noqa: BLE001 - last line of defence
                log.exception("telemetry sample failed")
                return {"node": self.node, "ts": time.time(), "source": self.sampler.name,
                        "cards": [], "host": {}, "warnings": [f"sample failed: {type(exc).__name__}: {exc}"]}
            finally:
                self.samples_taken += 1

    def _sample(self) -> dict[str, Any]:
        ts = time.time()
        warnings: list[str] = []
        try:
            raw = self.sampler.sample()
            warnings.extend(str(w) for w in (getattr(self.sampler, "last_warnings", None) or []))
        except Exception as exc:  # noqa: BLE001 - a sampler that breaks its promise
            raw = []
            warnings.append(f"{self.sampler.name or type(self.sampler).__name__} sampler failed: "
                            f"{type(exc).__name__}: {exc}")
        cards = []
        for rec in raw if isinstance(raw, list) else []:
            if not isinstance(rec, dict):
                continue
            card = card_record(**{k: rec.get(k) for k in CARD_KEYS if k not in ("node", "ranks")})
            card["node"] = self.node
            if card["source"] is None:
                card["source"] = self.sampler.name
            cards.append(card)

        all_ranks = sorted(set(self.rank_devices) | set(self.rank_pids))
        host_card = [c for c in cards if c["card"] == -1]
        seen: set[Any] = set()
        for c in cards:
            if c["card"] == -1:
                c["ranks"] = list(all_ranks)
            elif c["card"] is not None:
                c["ranks"] = sorted(r for r, d in self.rank_devices.items() if d == c["card"])
            seen.add(c["card"])
        if cards and not host_card:
            lost = sorted(r for r, d in self.rank_devices.items() if d not in seen)
            if lost:
                warnings.append("ranks " + ", ".join(f"{r} (card {self.rank_devices[r]})" for r in lost)
                                + f" are on cards that {self.sampler.name} did not report")

        host: dict[str, Any] = {"cpu_pct": None, "mem_used_mb": None, "mem_total_mb": None,
                                "processes": []}
        try:
            if host_card:  # the psutil source just read the host
                h = host_card[0]
                host.update(cpu_pct=h["util_pct"], mem_used_mb=h["memory_used_mb"],
                            mem_total_mb=h["memory_total_mb"])
            else:
                host.update(self._host.host_stats())
            host["processes"] = self._host.process_stats(self.rank_pids)
        except Exception as exc:  # noqa: BLE001
            warnings.append(f"host statistics failed: {type(exc).__name__}: {exc}")
        return {
            "node": self.node,
            "ts": ts,
            "source": self.sampler.name,
            "cards": cards,
            "host": host,
            "warnings": warnings[:MAX_SAMPLE_WARNINGS],
        }

    # -- background thread ---------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, callback: Callable[[dict[str, Any]], Any]) -> None:
        """Call ``callback(sample)`` now and then every ``interval_s`` on a daemon thread.

        A sample that takes longer than the interval is followed by a pause of a fifth of
        the interval, so a slow source is never run back to back. Exceptions of the
        callback are logged and counted, never stop the thread.
        """
        if self.running:
            raise RuntimeError(f"telemetry of node {self.node} is already running")
        self._stop.clear()
        self.sampler.cancel_event.clear()
        self._thread = threading.Thread(target=self._loop, args=(callback,), daemon=True,
                                        name=f"mindpulse-telemetry-{self.node}")
        self._thread.start()

    def _loop(self, callback: Callable[[dict[str, Any]], Any]) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            sample = self.sample_once()
            if self._stop.is_set():
                break
            try:
                callback(sample)
            except Exception:  # noqa: BLE001
                self.callback_errors += 1
                if self.callback_errors == 1 or self.callback_errors % 100 == 0:
                    log.exception("telemetry callback failed (%d times)", self.callback_errors)
            elapsed = time.monotonic() - t0
            self._stop.wait(max(self.interval_s - elapsed, 0.2 * self.interval_s))

    def stop(self, timeout_s: float = 2.0) -> bool:
        """Stop the thread (a sample in progress is abandoned); True if it has ended."""
        self._stop.set()
        self.sampler.cancel_event.set()
        t = self._thread
        if t is not None:
            t.join(timeout_s)
            if t.is_alive():
                return False
        self.sampler.cancel_event.clear()  # sample_once works again after a stop
        return True

    def close(self) -> None:
        """Stop and release the sampler."""
        self.stop()
        self.sampler.close()


def telemetry_packet(sample: dict[str, Any]):
    """The :class:`~.packets.TelemetryPacket` of a :meth:`NodeSampler.sample_once` dict;
    its warnings travel in ``host["warnings"]``."""
    from .packets import TelemetryPacket

    host = dict(sample.get("host") or {})
    if sample.get("warnings"):
        host["warnings"] = list(sample["warnings"])
    return TelemetryPacket(node=str(sample.get("node", "")), ts=float(sample.get("ts") or 0.0),
                           source=str(sample.get("source") or ""), cards=list(sample.get("cards") or []),
                           host=host)


def sample_this_machine(device: str = "auto") -> dict[str, Any]:
    """One sample of this machine with whatever source is present.

    ``auto``: DCMI or ``npu-smi`` if present, else NVML if there is a GPU, else psutil (the
    sources that were not usable are listed in the warnings). A named device without a
    source raises :class:`TelemetryUnavailable`.
    """
    notes: list[str] = []
    sampler = _pick(device, "auto", notes)
    try:
        sample = NodeSampler(socket.gethostname(), sampler, {}, interval_s=0.0).sample_once()
    finally:
        sampler.close()
    sample["warnings"] = [f"not used: {n}" for n in notes] + sample["warnings"]
    return sample
