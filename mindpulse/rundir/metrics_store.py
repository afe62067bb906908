"""`metrics.msgpack`: every accepted packet and the aggregator's own records, in segments.

The metrics are plain concatenations of msgpack maps (readable after a crash with any msgpack
streaming reader). Four kinds of record, each a map whose first keys are `v` (the schema
version) and `t` (its type):

* the packets the aggregator accepted (`t`: `step`, `event`, `telemetry`), byte for byte as
  they arrived;
* `attempt` markers, `{"v": 1, "t": "attempt", "attempt": k, "reason": "start" | "restart" |
  "roll", "ts", "pid"}`: the first record of every segment, and whenever an aggregator starts
  (`restart`: Ray restarted it within the same attempt). Every record after a marker belongs
  to that launcher attempt (records before any marker: attempt 0);
* `reduced` records, `{"v": 1, "t": "reduced", <ReducedStep cluster fields>}`: one per complete
  step, written by the aggregator right after the packet that completed it (`reduced_record`);
* `thinned` markers: the first record of an old segment whose per-rank detail was thinned.

Segments (`output.max_file_size`; 0: one file): the aggregator always writes
`metrics.msgpack`, the newest segment. Before a write would take it past the cap it is closed:
renamed `metrics.000001.msgpack`, `metrics.000002.msgpack`, ... (oldest first) and a new
`metrics.msgpack` begins with an `attempt` marker. Every reader here reads the closed segments
in their order, then `metrics.msgpack`.

Thinning: the newest `KEEP_FULL_SEGMENTS` closed segments (and `metrics.msgpack`) keep every
record. When a segment is closed, each older one is rewritten once (in a background thread,
atomically) keeping every record but the step packets, and of those the ones
`keep_when_thinned` names: steps that are multiples of `monitor.collect_freq` (every rank: such
a step still reduces), packets carrying a fingerprint or weight statistics, packets of a rank
that was non-finite (NaN/Inf loss, local gradients or counts), and packets carrying an `eval_*`
metric. The reduced records keep every step's cluster values. docs/run_directory.md has the
details.

Damage: readers resynchronise past damaged bytes (`packet_stream.iter_stream`) and count them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import re
import shutil
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import msgpack

from mindpulse.common.errors import MindpulseError
from mindpulse.config import MonitorConfig
from mindpulse.reduction.reducer import ReducedStep
from mindpulse.rundir.rundir_io import file_mode_in, fsync_dir
from mindpulse.wire.packet_stream import iter_stream
from mindpulse.wire.protocol import SCHEMA_VERSION, Packet, PacketError, from_wire

log = logging.getLogger(__name__)

METRICS = "metrics.msgpack"
"""The newest segment: the name users' scripts read."""
ATTEMPT = "attempt"
REDUCED = "reduced"
THINNED = "thinned"
META_TYPES = frozenset({ATTEMPT, REDUCED, THINNED})
"""Record types the aggregator writes itself (not packets: `from_wire` rejects them)."""
KEEP_FULL_SEGMENTS = 4
"""Closed segments (the newest ones) that keep every record; older ones are thinned."""
RECORD_RANKS_MAX = 64
"""Per-rank maps and lists in a reduced record are cut to this many entries (see
`reduced_record`), so a record stays small and readable at any world size."""
THIN_JOIN_S = 15.0
"""How long `close` waits for a thinning in progress before abandoning it (the segment then
stays whole, to be thinned by a later writer)."""

_SEGMENT_RE = re.compile(r"^metrics\.(\d+)\.msgpack$")
_TEMP_RE = re.compile(r"^\.metrics\.\d+\.msgpack\.thin(-body)?\.tmp$|^\.metrics\.msgpack\.new-\d+\.tmp$")
_SKIP_FIELDS = frozenset({"straggler_inputs"})
"""ReducedStep fields left out of a reduced record (the aggregator's working data)."""


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


# ------------------------------------------------------------------------------- segments


def segment_name(index: int) -> str:
    return f"metrics.{index:06d}.msgpack"


def closed_segments(run_dir: Path) -> list[tuple[int, Path]]:
    """(index, path) of the closed segments in `run_dir`, oldest first."""
    try:
        names = os.listdir(run_dir)
    except OSError:
        return []
    out = []
    for name in names:
        m = _SEGMENT_RE.match(name)
        if m:
            out.append((int(m.group(1)), Path(run_dir) / name))
    return sorted(out)


def segment_paths(path: Path | str) -> list[Path]:
    """The files that hold the records of `path`, in order: for `RUN_DIR/metrics.msgpack`, the
    closed segments then `metrics.msgpack` itself; any other file is read alone."""
    path = Path(path)
    if path.name != METRICS:
        return [path]
    return [p for _, p in closed_segments(path.parent)] + [path]


# -------------------------------------------------------------------------- reduced records


def _extremes(m: dict[Any, Any], low: int, high: int) -> list[tuple[Any, Any]]:
    """The entries with the `low` lowest and the `high` highest values, NaN ones first (what
    the user must see); plain C-level passes, no per-entry Python key (thousands of ranks)."""
    try:
        has_nan = any(map(math.isnan, m.values()))
        vals = sorted(v for v in m.values() if v == v) if has_nan else sorted(m.values())
    except TypeError:  # not numbers: the first entries
        return list(m.items())[:low + high]
    out = [(k, v) for k, v in m.items() if v != v][:low + high] if has_nan else []
    room = low + high - len(out)
    if vals and room > 0:
        n_low = min(low, room)
        if n_low:
            lo = vals[min(n_low, len(vals)) - 1]
            out += [(k, v) for k, v in m.items() if v <= lo][:n_low]
        n_high = min(high, room - n_low)
        if n_high:
            hi = vals[-min(n_high, len(vals))]
            seen = {k for k, _ in out}
            out += [(k, v) for k, v in m.items() if v >= hi and k not in seen][:n_high]
    return out


def _cap_rank_map(key: str, m: dict[Any, Any]) -> dict[str, Any]:
    """A per-rank map (str keys) of at most RECORD_RANKS_MAX entries: the ones that tell."""
    if len(m) <= RECORD_RANKS_MAX:
        return {str(k): v for k, v in m.items()}
    if key == "fingerprints":  # the ranks that differ from the majority, and one of the majority
        majority = Counter(m.values()).most_common(1)[0][0]
        odd = [(k, v) for k, v in m.items() if v != majority][:RECORD_RANKS_MAX - 1]
        kept = [next((k, v) for k, v in m.items() if v == majority)] + odd
    elif key == "straggler_scores":  # the slowest ranks
        kept = _extremes(m, RECORD_RANKS_MAX, 0)
    else:  # the lowest and the highest values
        kept = _extremes(m, RECORD_RANKS_MAX // 2, RECORD_RANKS_MAX // 2)
    return {str(k): v for k, v in sorted(kept, key=lambda kv: kv[0])}


def _scalar(x: Any) -> bool:
    return isinstance(x, (bool, int, float, str))


def reduced_record(red: ReducedStep) -> dict[str, Any]:
    """The reduced record of a step: the cluster fields of `red.to_record()`.

    Kept: scalar fields (None ones left out), `extra`, per-rank maps (`fingerprints`,
    `straggler_scores`, `param_norms`, ...: rank keys) and lists of numbers (`nonfinite_ranks`),
    empty ones left out. Maps and lists longer than RECORD_RANKS_MAX are cut to the entries
    that tell (the ranks whose fingerprint differs from the majority; the lowest straggler
    scores; the lowest and highest values of other maps; the first entries of a list), with
    `<field>_total` holding the full count. Nested working data (histograms, node straggler
    inputs) is left out: the record is a few hundred bytes at any world size (1.4 KB at 4,096
    ranks with every map full); building it costs ~30 us at 8 ranks, ~1 ms at 4,096 ranks when
    every per-rank map is full (a collect step of the flat reduction)."""
    rec: dict[str, Any] = {"v": SCHEMA_VERSION, "t": REDUCED}
    for key, value in vars(red).items():
        if key in _SKIP_FIELDS or key in ("v", "t", "per_rank") or value is None:
            continue
        if isinstance(value, dict):
            if not value:
                continue
            if key == "extra":
                rec[key] = {str(k): v for k, v in value.items() if _scalar(v)}
                continue
            k0, v0 = next(iter(value.items()))  # a per-rank map has rank keys and plain values
            if isinstance(k0, int) and not isinstance(k0, bool) and _scalar(v0):
                rec[key] = _cap_rank_map(key, value)
                if len(value) > len(rec[key]):
                    rec[f"{key}_total"] = len(value)
        elif isinstance(value, (list, tuple)):
            if value and _scalar(value[0]):
                rec[key] = [x for x in value[:RECORD_RANKS_MAX] if _scalar(x)]
                if len(value) > RECORD_RANKS_MAX:
                    rec[f"{key}_total"] = len(value)
        elif _scalar(value):
            rec[key] = value
    return rec


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def reduced_from_record(rec: dict[str, Any]) -> ReducedStep | None:
    """The `ReducedStep` a reduced record describes (no per-rank packets; maps keyed by rank
    again), or None when the record is not one. Fields it lacks take None, 0 or empty."""
    step = rec.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return None
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(ReducedStep):
        if f.name == "per_rank":
            continue
        kind = str(f.type)
        value = rec.get(f.name)
        if kind.startswith("dict"):
            if not isinstance(value, dict):
                value = {}
            elif f.name != "extra":  # per-rank maps: rank keys
                value = {int(k): v for k, v in value.items() if isinstance(k, str) and k.isdigit()}
        elif kind.startswith("list"):
            value = list(value) if isinstance(value, list) else []
        elif kind == "int":
            value = value if isinstance(value, int) and not isinstance(value, bool) else 0
        elif kind == "float":
            value = float(value) if _number(value) else 0.0
        elif "float" in kind or "int" in kind:  # X | None
            value = value if _number(value) else None
        elif kind == "str":
            value = value if isinstance(value, str) else ""
        kwargs[f.name] = value
    kwargs["step"] = step
    try:
        return ReducedStep(**kwargs)
    except TypeError:
        return None


def attempt_of(marker: dict[str, Any]) -> int | None:
    """The attempt an `attempt` marker names (None when it names none)."""
    a = marker.get("attempt")
    return a if isinstance(a, int) and not isinstance(a, bool) and a >= 0 else None


def drop_pending(reducer: Any, step: int) -> dict[int, Any]:
    """Forget `step`'s incomplete bucket in a `StepReducer` (its reduced record stands in for
    it: its other packets were thinned); returns the packets the bucket held."""
    pending = getattr(reducer, "_pending", None)
    bucket = pending.pop(step, None) if isinstance(pending, dict) else None
    packets = getattr(bucket, "packets", bucket)
    return dict(packets) if isinstance(packets, dict) else {}


# -------------------------------------------------------------------------------- thinning


def nonfinite_packet(obj: dict[str, Any]) -> bool:
    """The reducer's test of a non-finite rank, on a step packet's wire map."""
    for key in ("nan_count", "inf_count"):
        v = obj.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return True
    for key in ("loss", "grad_norm_local"):
        v = obj.get(key)
        if isinstance(v, float) and not math.isfinite(v):
            return True
    return False


def keep_when_thinned(obj: dict[str, Any], keep_every: int) -> bool:
    """Whether a record survives the thinning of an old segment (the documented rule)."""
    if obj.get("t") != "step":
        return True  # attempt markers, reduced records, events, telemetry, anything unknown
    step = obj.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step % max(1, keep_every) == 0:
        return True
    if obj.get("fingerprint") or obj.get("weights"):
        return True
    if nonfinite_packet(obj):
        return True
    extra = obj.get("extra")
    return isinstance(extra, dict) and any(isinstance(k, str) and k.startswith("eval_") for k in extra)


class _Aborted(MindpulseError):
    pass


def thin_segment(path: Path | str, keep_every: int, abort: threading.Event | None = None) -> dict[str, Any] | None:
    """Rewrite a closed segment keeping what `keep_when_thinned` keeps, behind a `thinned`
    marker; atomic (temporary files, fsync, rename). Returns the marker, or None when it was
    already thinned or `abort` was set (the segment is then left as it was)."""
    path = Path(path)
    first = _first_record(path)
    if first is not None and first.get("t") == THINNED:
        return None
    body = path.with_name(f".{path.name}.thin-body.tmp")
    out = path.with_name(f".{path.name}.thin.tmp")
    st: dict[str, int] = {}
    before = kept = 0
    try:
        size = path.stat().st_size
        with open(path, "rb") as src, open(body, "wb") as dst:
            for obj in iter_stream(src, st):
                before += 1
                if abort is not None and before % 4096 == 0 and abort.is_set():
                    raise _Aborted
                if keep_when_thinned(obj, keep_every):
                    dst.write(_pack(obj))
                    kept += 1
        marker = {"v": SCHEMA_VERSION, "t": THINNED, "keep_every": max(1, keep_every), "records_before": before,
                  "records_kept": kept, "bytes_before": size,
                  "damaged_bytes_dropped": st.get("skipped_bytes", 0) + st.get("torn_bytes", 0), "ts": time.time()}
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, file_mode_in(path.parent))
        with os.fdopen(fd, "wb") as dst, open(body, "rb") as src:
            dst.write(_pack(marker))
            shutil.copyfileobj(src, dst, 1 << 20)
            dst.flush()
            os.fsync(dst.fileno())
        if abort is not None and abort.is_set():
            raise _Aborted
        os.replace(out, path)
        fsync_dir(path.parent)
        marker["bytes_after"] = path.stat().st_size
        return marker
    except _Aborted:
        return None
    finally:
        for tmp in (body, out):
            try:
                tmp.unlink()
            except FileNotFoundError:
                pass


def _first_record(path: Path) -> dict[str, Any] | None:
    try:
        with open(path, "rb") as fh:
            head = fh.read(1 << 16)
    except OSError:
        return None
    return next(iter_stream(head, final=False), None)


# ---------------------------------------------------------------------------------- writer


class MetricsWriter:
    """The aggregator's one writer of the run's metrics segments.

    `max_file_size`: bytes a segment may reach before it is closed (0: one file); a record
    longer than that still gets a segment of its own. `attempt`: the launcher attempt this
    aggregator serves (the markers it writes). `collect_freq`: the thinning's step stride.
    `restart`: Ray restarted this aggregator (its marker says so)."""

    def __init__(self, path: Path, max_file_size: int = 0, attempt: int = 0,
                 collect_freq: int = MonitorConfig.collect_freq,
                 keep_full: int | None = None, restart: bool = False):
        self.path = Path(path)
        self.dir = self.path.parent
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_file_size = max(0, int(max_file_size or 0))
        self.attempt = attempt if isinstance(attempt, int) and not isinstance(attempt, bool) and attempt >= 0 else 0
        self.collect_freq = max(1, int(collect_freq or 1))
        self.keep_full = max(1, int(KEEP_FULL_SEGMENTS if keep_full is None else keep_full))
        self.records = 0
        """Packets appended by this writer."""
        self.meta_records = 0
        """Markers and reduced records appended by this writer."""
        self.bytes = 0
        self.segments_closed = 0
        self.thinned: list[dict[str, Any]] = []
        """The markers of the segments this writer thinned."""
        self.paused = False
        """While set (a replay), `append_reduced` writes nothing."""
        self._fd = -1
        self._held: list[bytes] | None = None
        """Writes waiting for the end of a `held()` block (None: outside one)."""
        self._size = 0
        self._floor = 0  # the active segment's size after its marker: below it, never close it
        self._lock = threading.Lock()
        self._thinner: threading.Thread | None = None
        self._abort = threading.Event()
        self._done: set[int] = set()  # closed segments known to be thinned (or that failed to be)
        self._clean_temps()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, file_mode_in(self.dir))
        self._size = os.fstat(self._fd).st_size
        reason = "restart" if restart else "start"
        if self._is_closed_segment(self._fd):  # a roll cut short: the file is closed already
            self._fresh_active(reason)
        elif self.max_file_size and self._size >= self.max_file_size:
            self._roll(reason)
        else:
            self._write(_pack(self._marker(reason)))
            self.meta_records += 1
            self._floor = self._size

    @classmethod
    def for_run(cls, run_dir: Path, cfg: Any, attempt: int, restart: bool = False) -> MetricsWriter:
        """The writer of a run's aggregator: `output.max_file_size` and `monitor.collect_freq`
        from its config, `attempt` from the launcher's settings."""
        return cls(Path(run_dir) / METRICS, max_file_size=cfg.output.max_file_size,
                   attempt=attempt, collect_freq=cfg.monitor.collect_freq, restart=restart)

    # ---- writing
    def _marker(self, reason: str) -> dict[str, Any]:
        return {"v": SCHEMA_VERSION, "t": ATTEMPT, "attempt": self.attempt, "reason": reason, "ts": time.time(),
                "pid": os.getpid()}

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """What is written inside goes out in one system call at the end (a node batch's raw
        packets and its reduced steps: one write, not two or more)."""
        if self._held is not None:  # nested: the outer one writes
            yield
            return
        self._held = []
        try:
            yield
        finally:
            self._flush_held()
            self._held = None

    def _flush_held(self) -> None:
        if self._held:
            blob, self._held = b"".join(self._held), []
            self._write_now(blob)

    def _write(self, blob: bytes) -> None:
        self._size += len(blob)
        self.bytes += len(blob)
        if self._held is not None:
            self._held.append(blob)
        else:
            self._write_now(blob)

    def _write_now(self, blob: bytes) -> None:
        view = memoryview(blob)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]

    def append(self, raw: list[bytes], count: int | None = None) -> None:
        """Append encoded packets (as they arrived), closing the segment at the cap. `count`:
        the packets in `raw` where an item holds several back to back (a group leader's
        steps: one bytes, written as it came; a segment closes before or after it, never
        inside)."""
        n = self._append(raw)
        self.records += n if count is None or not n else count

    def append_reduced(self, red: ReducedStep) -> None:
        """The reduced record of a complete step (nothing while `paused`)."""
        if self.paused or self._fd < 0:
            return
        self.meta_records += self._append([_pack(reduced_record(red))])

    def _append(self, raw: list[bytes]) -> int:
        if not raw:
            return 0
        cap = self.max_file_size
        blob = b"".join(raw)
        if not cap or self._size + len(blob) <= cap:  # the common case: no roll inside this batch
            self._write(blob)
            return len(raw)
        group: list[bytes] = []
        pending = 0
        for rec in raw:
            if self._size + pending + len(rec) > cap and self._size + pending > self._floor:
                if group:
                    self._write(b"".join(group))
                    group, pending = [], 0
                if self._size > self._floor:
                    self._roll("roll")
            group.append(rec)
            pending += len(rec)
        if group:
            self._write(b"".join(group))
        return len(raw)

    # ---- segments
    def _roll(self, reason: str) -> None:
        """Close metrics.msgpack as the next numbered segment; a new one begins with a marker.
        The name never disappears: the closed file gets a second name (a hard link) before a
        new file replaces `metrics.msgpack` (a rename)."""
        self._flush_held()
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = -1
        index = max((i for i, _ in closed_segments(self.dir)), default=0) + 1
        while True:
            closed = self.dir / segment_name(index)
            try:
                os.link(self.path, closed)
                break
            except FileExistsError:
                index += 1
            except OSError:  # no hard links here: a plain rename (the name is absent a moment)
                os.rename(self.path, closed)
                break
        self._fresh_active(reason)
        self.segments_closed += 1
        self._start_thinning()

    def _fresh_active(self, reason: str) -> None:
        """A new metrics.msgpack holding its marker replaces whatever has the name."""
        if self._fd >= 0:
            os.close(self._fd)
        tmp = self.dir / f".metrics.msgpack.new-{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, file_mode_in(self.dir))
        self._fd, self._size = fd, 0
        self._write(_pack(self._marker(reason)))
        self._flush_held()
        self.meta_records += 1
        os.fsync(fd)
        os.replace(tmp, self.path)
        fsync_dir(self.dir)
        self._floor = self._size

    def _is_closed_segment(self, fd: int) -> bool:
        st = os.fstat(fd)
        closed = closed_segments(self.dir)
        try:
            return bool(closed) and os.stat(closed[-1][1]).st_ino == st.st_ino
        except OSError:
            return False

    def _start_thinning(self) -> None:
        with self._lock:
            if self._thinner is not None and self._thinner.is_alive():
                return  # it looks for more work before it ends
            self._thinner = threading.Thread(target=self._thin_old, name="metrics-thinning", daemon=True)
            self._thinner.start()

    def thin_candidates(self) -> list[tuple[int, Path]]:
        """Closed segments older than the newest `keep_full` that are not thinned yet."""
        closed = closed_segments(self.dir)
        out = []
        for index, path in closed[:max(0, len(closed) - self.keep_full)]:
            if index in self._done:
                continue
            first = _first_record(path)
            if first is not None and first.get("t") == THINNED:
                self._done.add(index)
                continue
            out.append((index, path))
        return out

    def _thin_old(self) -> None:
        while not self._abort.is_set():
            todo = self.thin_candidates()
            if not todo:
                return
            for index, path in todo:
                if self._abort.is_set():
                    return
                try:
                    marker = thin_segment(path, self.collect_freq, self._abort)
                except OSError as exc:
                    log.warning("metrics: could not thin %s (%s); it stays whole", path.name, exc)
                    marker = None
                if marker is None and self._abort.is_set():
                    return
                self._done.add(index)
                if marker is not None:
                    self.thinned.append(dict(marker, segment=path.name))

    def wait_thinning(self, timeout: float | None = None) -> bool:
        """Wait for a thinning in progress; True when none is left running."""
        t = self._thinner
        if t is not None:
            t.join(timeout)
            return not t.is_alive()
        return True

    def _clean_temps(self) -> None:
        """Temporary files a killed writer left (its thinning or its roll)."""
        try:
            names = os.listdir(self.dir)
        except OSError:
            return
        for name in names:
            if _TEMP_RE.match(name):
                try:
                    os.unlink(self.dir / name)
                except OSError:
                    pass

    # ---- the end
    def sync(self) -> None:
        if self._fd >= 0:
            self._flush_held()
            os.fsync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            self._flush_held()
            try:
                os.fsync(self._fd)
            finally:
                os.close(self._fd)
                self._fd = -1
        if not self.wait_thinning(THIN_JOIN_S):
            self._abort.set()  # the segment being thinned stays whole
            self.wait_thinning(5.0)


# --------------------------------------------------------------------------------- reading


@dataclasses.dataclass
class ReadStats:
    """What reading the segments met."""

    segments: int = 0
    """Files read."""
    skipped_bytes: int = 0
    """Damaged bytes passed over (decoding resumed at the next record)."""
    skipped_stretches: int = 0
    torn_bytes: int = 0
    """Bytes of incomplete records at the end of a file (a crash mid-write)."""
    thinned_segments: int = 0
    """Segments whose per-rank detail was thinned."""

    def add(self, st: dict[str, int]) -> None:
        self.skipped_bytes += st.get("skipped_bytes", 0)
        self.skipped_stretches += st.get("skipped_stretches", 0)
        self.torn_bytes += st.get("torn_bytes", 0)

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def read_records(path: Path | str, stats: ReadStats | None = None) -> Iterator[dict[str, Any]]:
    """Every record of the run's metrics (`RUN_DIR/metrics.msgpack`: all its segments, oldest
    first), markers and reduced records included; damaged bytes are skipped and counted in
    `stats`, a torn last record of a file is ignored."""
    stats = stats if stats is not None else ReadStats()
    seen: set[tuple[int, int]] = set()
    for p in segment_paths(path):
        st: dict[str, int] = {}
        try:
            fh = open(p, "rb")
        except FileNotFoundError:
            continue
        with fh:
            fs = os.fstat(fh.fileno())
            if (fs.st_dev, fs.st_ino) in seen:
                continue  # one file under two names: a segment being closed (or a close cut short)
            seen.add((fs.st_dev, fs.st_ino))
            stats.segments += 1
            for obj in iter_stream(fh, st):
                if obj.get("t") == THINNED:
                    stats.thinned_segments += 1
                yield obj
        stats.add(st)


def read_wire(path: Path | str, stats: ReadStats | None = None) -> Iterator[dict]:
    """The raw wire maps of the packets in a run's metrics (all segments; the aggregator's own
    markers and reduced records left out); damaged bytes are skipped."""
    for obj in read_records(path, stats):
        if obj.get("t") not in META_TYPES:
            yield obj


def read_packets(path: Path | str, stats: ReadStats | None = None) -> Iterator[Packet]:
    """Yield validated packets; records that do not validate are skipped."""
    for obj in read_wire(path, stats):
        try:
            yield from_wire(obj)
        except PacketError:
            continue


def with_attempts(records: Iterable[dict[str, Any]]) -> Iterator[tuple[int, dict[str, Any]]]:
    """(attempt, record) for every record but the markers: each record belongs to the attempt
    of the marker before it (attempt 0 before any marker)."""
    attempt = 0
    for obj in records:
        if obj.get("t") == ATTEMPT:
            a = attempt_of(obj)
            if a is not None:
                attempt = a
            continue
        yield attempt, obj


__all__ = ["ATTEMPT", "KEEP_FULL_SEGMENTS", "METRICS", "META_TYPES", "REDUCED", "THINNED", "MetricsWriter",
           "ReadStats", "attempt_of", "closed_segments", "drop_pending", "keep_when_thinned", "read_packets",
           "read_records", "read_wire", "reduced_from_record", "reduced_record", "segment_name", "segment_paths",
           "thin_segment", "with_attempts"]
