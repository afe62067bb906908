"""One reader of a run directory for the offline views (`top`, `report`).

It reads the run's metrics incrementally (every segment: `metrics.000001.msgpack`, ... then
`metrics.msgpack`, see mindpulse/rundir/metrics_store.py), skipping and counting damaged bytes,
tells its records apart with the aggregator's own replay (mindpulse/rundir/replay.py), reads the run's resolved config
(`config.yaml`) and `summary.json`, and completes steps with the aggregator's own
`StepReducer` and scores stragglers with its `StragglerTracker` built from the run's config. A
view therefore shows what the aggregator computed, not a second implementation of step
completion, deduplication or totals. The aggregator's own records tell the attempt behind
every step (`attempt` markers) and the cluster values of steps whose per-rank packets were
thinned (`reduced` records).
"""

from __future__ import annotations

import json
import os
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mindpulse.config import RunConfig, sections_of
from mindpulse.reduction.reducer import ReducedStep, RunTotals, StepReducer, StragglerTracker
from mindpulse.rundir.metrics_store import METRICS, closed_segments
from mindpulse.rundir.replay import RecordReplay, step_from_record
from mindpulse.wire.packet_stream import iter_stream
from mindpulse.wire.protocol import EventPacket, Packet, StepPacket

SUMMARY = "summary.json"
CONFIG = "config.yaml"
READ_CHUNK = 1 << 20
"""Bytes read from the metrics file per read call (the unpacker is drained after each)."""


# ------------------------------------------------------------------------------ the stream


class MetricsTail:
    """Incremental reader of a run's metrics segments: feeds only new bytes.

    The closed segments (`metrics.000001.msgpack`, ...) are read once each, oldest first; then
    `metrics.msgpack` is followed through an open file and an offset, so a long run costs no more
    per poll than a short one. When the aggregator closes the followed file (it gets a numbered
    name, a new `metrics.msgpack` begins), the rest of it is read through the open file and the
    new one is followed from its start. A torn last record (the aggregator is mid-write) waits
    until the rest of it arrives; damaged bytes are skipped (`packet_stream.iter_stream`) and counted.
    """

    def __init__(self, path: Path, chunk: int = READ_CHUNK):
        self.path = Path(path)
        self.dir = self.path.parent
        self.chunk = chunk
        self.offset = 0
        """Bytes of the followed file (`metrics.msgpack`) already read."""
        self.bytes_read = 0
        """Bytes read over the reader's life, every segment (equals `offset` for one file unless
        the file was replaced)."""
        self.errors = 0
        """Stretches of damaged bytes skipped (decoding resumed at the next record)."""
        self.skipped_bytes = 0
        """Damaged bytes skipped."""
        self.torn_bytes = 0
        """Bytes of an incomplete record at the end of a closed segment (a crash mid-write)."""
        self.restarts = 0
        """Times the file shrank or was replaced, and every segment was read again from the start."""
        self.segments_read = 0
        """Closed segments read to their end."""
        self._next = 1  # the index of the next closed segment to read
        self._fh: Any = None
        self._ino: int | None = None
        self._pending = b""  # bytes of the followed file not decoded yet (a record being written)

    def poll(self) -> tuple[list[Any], bool]:
        """(new records, restarted): `restarted` means earlier records are void."""
        out: list[Any] = []
        restarted = False
        for _ in range(64):  # each turn reads a segment the aggregator closed meanwhile
            if self._fh is None and not self._open_active(out):
                return out, restarted
            try:
                st: os.stat_result | None = os.stat(self.path)
            except FileNotFoundError:
                st = None
            if st is not None and st.st_ino == self._ino:
                if st.st_size < self.offset:  # truncated or rewritten in place
                    self._restart()
                    out.clear()
                    restarted = True
                    continue
                self._read_followed(out, final=False)
                return out, restarted
            # the followed file is no longer metrics.msgpack: closed as a segment, or replaced
            index = self._closed_index_of(self._ino)
            if index is None:
                if st is None:  # gone for now (a roll without hard links, or a removal)
                    self._read_followed(out, final=False)
                    return out, restarted
                self._restart()
                out.clear()
                restarted = True
                continue
            self._read_followed(out, final=True)
            self._close()
            self._next = index + 1
            self.segments_read += 1
        return out, restarted

    def _open_active(self, out: list[Any]) -> bool:
        """Read the closed segments not read yet, then open metrics.msgpack to follow it."""
        for index, path in closed_segments(self.dir):
            if index >= self._next:
                self._read_whole(path, out)
                self._next = index + 1
        try:
            fh = open(self.path, "rb")
        except FileNotFoundError:
            return False
        ino = os.fstat(fh.fileno()).st_ino
        closed = closed_segments(self.dir)
        if closed and (closed[-1][0] >= self._next or _inode(closed[-1][1]) == ino):
            fh.close()  # a segment is being closed this moment: the next poll reads it
            return False
        self._fh, self._ino, self.offset, self._pending = fh, ino, 0, b""
        return True

    def _read_whole(self, path: Path, out: list[Any]) -> None:
        try:
            fh = open(path, "rb")
        except FileNotFoundError:
            return
        with fh:
            self._pending = b""
            while data := fh.read(self.chunk):
                self.bytes_read += len(data)
                self._scan(data, out, final=False)
            self._scan(b"", out, final=True)
        self.segments_read += 1

    def _read_followed(self, out: list[Any], final: bool) -> None:
        while data := self._fh.read(self.chunk):
            self.offset += len(data)
            self.bytes_read += len(data)
            self._scan(data, out, final=False)
        if final:
            self._scan(b"", out, final=True)

    def _scan(self, data: bytes, out: list[Any], final: bool) -> None:
        buf = self._pending + data if self._pending else data
        st: dict[str, int] = {}
        out.extend(iter_stream(buf, st, final=final))
        self._pending = b"" if final else bytes(buf[st["consumed"]:])
        self.skipped_bytes += st["skipped_bytes"]
        self.errors += st["skipped_stretches"]
        self.torn_bytes += st["torn_bytes"]

    def _closed_index_of(self, ino: int | None) -> int | None:
        for index, path in reversed(closed_segments(self.dir)):  # the newest, most likely
            if _inode(path) == ino:
                return index
        return None

    def _close(self) -> None:
        if self._fh is not None:
            self._fh.close()
        self._fh, self._ino, self.offset, self._pending = None, None, 0, b""

    def _restart(self) -> None:
        """Every segment is read again from the start (the file was replaced)."""
        self._close()
        self._next = 1
        self.restarts += 1
        self.errors = self.skipped_bytes = self.torn_bytes = self.segments_read = 0

    @property
    def pending_bytes(self) -> int:
        """Bytes at the end of metrics.msgpack that are no whole record yet (being written, or
        torn by a crash)."""
        return len(self._pending) if self._fh is not None else 0

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def _inode(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


# ------------------------------------------------------------------------- the side files


class _FileWatch:
    """Tells when a file appeared or changed, so a poll re-reads it only then."""

    def __init__(self, path: Path):
        self.path = path
        self._seen: tuple[int, int] | None = None

    def changed(self) -> bool:
        try:
            st = self.path.stat()
        except OSError:
            return False  # absent (or gone): what was read before stands
        key = (st.st_mtime_ns, st.st_size)
        if key == self._seen:
            return False
        self._seen = key
        return True

    def retry(self) -> None:
        """Read the file again at the next poll (it was caught mid-write)."""
        self._seen = None


def read_json(path: Path) -> tuple[Any, str | None]:
    """(object, None); (None, None) when the file is absent; (None, why) when it cannot be read."""
    try:
        return json.loads(path.read_text(encoding="utf-8")), None
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError) as exc:
        return None, str(exc)


@dataclass
class RunConfigFile:
    """The run's resolved config as read from config.yaml, with every default filled in."""

    config: RunConfig = field(default_factory=RunConfig)
    text: str | None = None
    """config.yaml as written (None when absent or unreadable)."""
    world_size: int | None = None
    """nodes × ranks_per_node when the file names its world. The launcher's resolved config
    always does; a hand-written one without `world` says nothing about the run's world, so
    the world default is not taken for a fact."""
    notes: list[str] = field(default_factory=list)
    """Why some of the file was not used (its sections' defaults stand in)."""


def read_config(path: Path) -> RunConfigFile:
    """Tolerant: a missing file gives the defaults; a damaged section gives that section's
    defaults and a note, so one bad section does not cost the others (monitor's window)."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return RunConfigFile()
    except OSError as exc:
        return RunConfigFile(notes=[_defaults_used(f"could not be read: {exc}")])
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        return RunConfigFile(text=text, notes=[_defaults_used(f"is not valid YAML ({exc})")])
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        return RunConfigFile(text=text, notes=[_defaults_used("is not a mapping of sections")])
    usable: dict[str, Any] = {}
    notes: list[str] = []
    for name, section in raw.items():
        try:
            sections_of({name: section})
        except (ValueError, TypeError) as exc:  # ConfigError is a ValueError; junk may raise TypeError
            notes.append(f"{CONFIG}: {exc}; the defaults of `{name}` are used")
            continue
        usable[name] = section
    cfg = sections_of(usable)
    ws = cfg.world.world_size if "world" in usable and cfg.world.world_size > 0 else None
    return RunConfigFile(config=cfg, text=text, world_size=ws, notes=notes)


def _defaults_used(why: str) -> str:
    return f"{CONFIG} {why}; the config's defaults are used"


def _positive_int(x: Any) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) and x > 0 else None


# ---------------------------------------------------------------------------- the reader


@dataclass
class Batch:
    """What one poll read."""

    objects: int
    """Records read (valid packets, the aggregator's own records and rejected ones)."""
    packets: list[Packet]
    """The valid packets, in file order."""
    restarted: bool
    """The metrics file was replaced: everything read before is void (the reader reset)."""


@dataclass
class AttemptInfo:
    """One launcher attempt as the metrics tell it (its `attempt` markers and its packets)."""

    attempt: int
    started: float | None = None
    """When its aggregator first started (its first marker's time)."""
    restarts: int = 0
    """Times Ray restarted its aggregator."""
    first_step: int | None = None
    """The first step its ranks reported: where it started (0, or the step it resumed from)."""
    steps: int = 0
    """Its complete steps the views show."""
    last_step: int | None = None
    """Its newest complete step the views show."""
    superseded: int = 0
    """Its complete steps a later attempt ran again (from that attempt's first step on): not shown."""
    from_records: int = 0
    """Its complete steps known only from their reduced records (per-rank packets thinned)."""

    def _reset_derived(self) -> None:
        self.steps, self.last_step, self.superseded, self.from_records = 0, None, 0, 0


class RunReader:
    """A run directory replayed through the aggregator's reducer, refreshed by :meth:`poll`.

    `history=False` (top) keeps only what the newest complete step needs; `history=True`
    (report) also keeps every reduced step and each rank's accepted step packets.

    Attempts: every record belongs to the launcher attempt of the `attempt` marker before it
    (0 before any). Each attempt is reduced by a reducer of its own, as each attempt had its
    own aggregator; once an attempt reports its first step F (where it resumed), the steps F
    and later of every earlier attempt are superseded: the views show one timeline, each step
    from the newest attempt that ran it. A step whose per-rank packets were thinned (old
    segments) is taken from the aggregator's reduced record of it.
    """

    def __init__(self, run_dir: Path, history: bool = False):
        self.run_dir = Path(run_dir)
        self.history = history
        self.tail = MetricsTail(self.run_dir / METRICS)
        self.config_file = RunConfigFile()
        self.summary: dict[str, Any] | None = None
        self.summary_problem: str | None = None
        """Why summary.json could not be used, while it cannot."""
        self._config_watch = _FileWatch(self.run_dir / CONFIG)
        self._summary_watch = _FileWatch(self.run_dir / SUMMARY)
        self._peak_found: float | None = None
        self._reset()

    # ---- what is known
    @property
    def config(self) -> RunConfig:
        return self.config_file.config

    @property
    def world_size(self) -> int:
        """The config's world when config.yaml names it, else summary.json's, else the larger of
        the reduced records' world and the highest rank seen + 1 (0 before any rank reported)."""
        return (self.config_file.world_size or _positive_int((self.summary or {}).get("world_size"))
                or max(self.record_world, self.max_rank + 1))

    @property
    def complete_step(self) -> int | None:
        return self.latest.step if self.latest is not None else None

    @property
    def last_step_of_rank(self) -> Mapping[int, int]:
        """Each rank's newest reported step in the current attempt."""
        return self.reducer.last_step_of_rank if self.reducer is not None else {}

    @property
    def current_attempt(self) -> int:
        """The newest attempt the metrics name."""
        return self._cur

    @property
    def multi_attempt(self) -> bool:
        """Whether the run had more than one attempt (the views then name them)."""
        return len(self.attempts) > 1 or self._cur > 0

    @property
    def per_rank(self) -> dict[int, list[StepPacket]]:
        """With `history`: each rank's step packets the reducers accepted, in arrival order
        (superseded attempts' packets left out)."""
        return {r: [p for _, p in lst] for r, lst in self._per_rank.items()}

    def attempt_of_step(self, step: int) -> int | None:
        """The attempt behind a complete step the views show (with `history`; else the newest)."""
        if self.latest is not None and step == self.latest.step:
            return self.latest_attempt
        return self.step_attempt.get(step)

    def metrics_info(self) -> dict[str, Any]:
        """What reading the metrics met: segments, damage, thinning, records."""
        t = self.tail
        return {"segments": t.segments_read + (1 if t.offset or (self.run_dir / METRICS).exists() else 0),
                "damaged_bytes_skipped": t.skipped_bytes, "damaged_stretches": t.errors,
                "torn_bytes": t.torn_bytes, "incomplete_tail_bytes": t.pending_bytes,
                "thinned_segments": self.thinned_segments, "aggregator_records": self.meta_records}

    def totals(self) -> dict[str, Any]:
        """summary.json's totals derived from the packets read, as the aggregator derives them
        (complete only with `history`: a live reader forgets what it no longer needs)."""
        counts = self._counts()
        return {
            "world_size": self.world_size,
            "steps_completed": max(0, self.steps_through),
            **self.run_totals.as_dict(),
            "packets": {
                "accepted": self.records,
                "rejected": self.rejected,
                "duplicates": counts["duplicates"],
                "late": counts["late"],
                "incomplete_steps_evicted": counts["evicted_incomplete"],
            },
            "attempts": len(self.attempts) or 1,
            "metrics": self.metrics_info(),
        }

    def _counts(self) -> Counter[str]:
        out = Counter(self._retired)
        red = self.reducer
        if red is not None:
            out.update({"duplicates": red.duplicates, "late": red.late, "evicted_incomplete": red.evicted_incomplete})
        return out

    # ---- reading
    def poll(self) -> Batch:
        """Re-read config.yaml and summary.json if they changed, then the appended records."""
        self._reload_files()
        objs, restarted = self.tail.poll()
        if restarted:
            self._reset()
        packets: list[Packet] = []
        items: list[tuple[str, int, Any]] = []
        for rec in self._records.read(objs):
            self._cur = rec.attempt
            if rec.packet is None:
                self._meta(rec.marker, rec.reduced, items)
                continue
            p = rec.packet
            packets.append(p)
            if isinstance(p, (StepPacket, EventPacket)):
                self.max_rank = max(self.max_rank, p.rank)
            if isinstance(p, StepPacket):
                info = self._info(self._cur)
                info.first_step = p.step if info.first_step is None else min(info.first_step, p.step)
                if self._seen_for != self._cur:  # a new attempt: its own steps
                    self._seen_for, self.newest_step_seen = self._cur, -1
                self.newest_step_seen = max(self.newest_step_seen, p.step)
                items.append(("step", self._cur, p))
        self.records += len(packets)
        # the whole batch names its ranks before any of it is reduced, so one read of a
        # finished run reduces with its final world and never needs a replay
        if self._built_for != self._wanted():
            self._rebuild()
        for item in items:
            self._kept.append(item)
            self._apply(*item)
        self._forget()
        return Batch(objects=len(objs), packets=packets, restarted=restarted)

    def _meta(self, marker: dict[str, Any] | None, red: ReducedStep | None,
              items: list[tuple[str, int, Any]]) -> None:
        """The aggregator's own records: attempt markers, reduced steps (thinning markers are
        only counted, by the replay)."""
        if marker is not None:
            info = self._info(self._cur)
            ts = marker.get("ts")
            if info.started is None and isinstance(ts, (int, float)) and not isinstance(ts, bool):
                info.started = float(ts)
            if marker.get("reason") == "restart":
                info.restarts += 1
        elif red is not None:
            self.record_world = max(self.record_world, red.world_size)
            items.append(("reduced", self._cur, red))

    @property
    def rejected(self) -> int:
        """Records that were neither a valid packet nor a valid record of the aggregator's."""
        return self._records.rejected

    @property
    def meta_records(self) -> int:
        """The aggregator's own records read (attempt markers, reduced steps, thinning markers)."""
        return self._records.meta_records

    @property
    def thinned_segments(self) -> int:
        return self._records.thinned_segments

    def _info(self, attempt: int) -> AttemptInfo:
        info = self.attempts.get(attempt)
        if info is None:
            info = self.attempts[attempt] = AttemptInfo(attempt)
        return info

    def _reload_files(self) -> None:
        if self._config_watch.changed():
            self.config_file = read_config(self._config_watch.path)
        if self._summary_watch.changed():
            obj, err = read_json(self._summary_watch.path)
            if err is not None:
                self.summary_problem = f"{SUMMARY} could not be read: {err}"
                self._summary_watch.retry()  # perhaps caught mid-write: the next poll tries again
            elif isinstance(obj, dict):
                self.summary, self.summary_problem = obj, None
            else:
                self.summary_problem = f"{SUMMARY} is not a JSON object"

    # ---- reduction
    def _reset(self) -> None:
        """Forget every record (a new reader, or the metrics file was replaced)."""
        self.records = 0
        self._records = RecordReplay()
        self.max_rank = -1
        self.record_world = 0
        self.newest_step_seen = -1
        """The newest step reported in the newest attempt."""
        self._seen_for = 0
        self._cur = 0  # the attempt of the newest marker read
        self.attempts: dict[int, AttemptInfo] = {}
        """Every attempt the metrics name, by number."""
        self._kept: list[tuple[str, int, Any]] = []
        """(kind, attempt, step packet or reduced step) a rebuild replays: all of them with
        `history`, else those of the current attempt's pending steps and newest complete step."""
        self._base = 0  # the attempt of the first item kept
        self._rebuild()

    def _wanted(self) -> tuple[int, int, int]:
        return self.world_size, self.config.monitor.straggler_window, self.config.world.ranks_per_node

    def _rebuild(self) -> None:
        """A fresh reducer and straggler tracker for the current world size and window,
        replaying the records kept: the world changed (a rank seen for the first time,
        summary.json or config.yaml appeared) and every completion so far may be wrong."""
        self._built_for = self._wanted()
        self._retired: Counter[str] = Counter()
        """The reducer counters of the attempts before the current one."""
        self.reducer: StepReducer | None = None
        self._begin_attempt(self._base)
        self.run_totals = RunTotals()
        self.latest: ReducedStep | None = None
        """The newest complete step of the timeline."""
        self.latest_attempt = self._base
        """The attempt behind `latest`."""
        self.steps_through = -1
        """The highest complete step of the timeline."""
        self.reduced: list[ReducedStep] = []
        """With `history`: every reduced step of the timeline, in the order the steps completed."""
        self.step_attempt: dict[int, int] = {}
        """With `history`: the attempt behind each step in `reduced`."""
        self._per_rank: dict[int, list[tuple[int, StepPacket]]] = {}
        self._first_fed: dict[int, int] = {}
        for info in self.attempts.values():
            info._reset_derived()
        for item in self._kept:
            self._apply(*item)

    def _begin_attempt(self, attempt: int) -> None:
        """A new attempt had a new aggregator: a fresh reducer and straggler tracker."""
        red = self.reducer
        if red is not None:
            self._retired.update({"duplicates": red.duplicates, "late": red.late,
                                  "evicted_incomplete": red.evicted_incomplete})
        ws, window, ranks_per_node = self._built_for
        # built as the aggregator builds them (aggregator/core.py)
        self.reducer = StepReducer(ws) if ws > 0 else None
        self.stragglers = StragglerTracker(window, ranks_per_node)
        self.attempt = attempt
        self._done: set[int] = set()  # steps this attempt's reducer completed (recent ones)
        self._done_order: deque[int] = deque()

    def _apply(self, kind: str, attempt: int, obj: Any) -> None:
        if attempt != self.attempt:
            self._begin_attempt(attempt)
        if kind == "step":
            first = self._first_fed.get(attempt)
            if first is None or obj.step < first:
                self._first_fed[attempt] = obj.step
                self._supersede(attempt, obj.step)
            self._feed(obj, attempt)
        else:
            self._on_record(obj, attempt)

    def _supersede(self, attempt: int, first: int) -> None:
        """Attempt `attempt` runs from step `first`: earlier attempts' steps from there on go."""
        if self.history:
            keep = []
            for red in self.reduced:
                a = self.step_attempt.get(red.step, attempt)
                if a < attempt and red.step >= first:
                    self._info(a).superseded += 1
                    self._info(a).steps -= 1
                    del self.step_attempt[red.step]
                else:
                    keep.append(red)
            if len(keep) != len(self.reduced):
                self.reduced = keep
                self.run_totals = RunTotals()  # the totals of the timeline that stands
                for red in sorted(keep, key=lambda r: r.step):
                    self.run_totals.add(red)
                for a, info in self.attempts.items():
                    info.last_step = max((r.step for r in keep if self.step_attempt[r.step] == a), default=None)
            for r, lst in self._per_rank.items():
                self._per_rank[r] = [(a, p) for a, p in lst if not (a < attempt and p.step >= first)]
        if self.latest is not None and self.latest_attempt < attempt and self.latest.step >= first:
            older = [r for r in self.reduced if r.step < first] if self.history else []
            self.latest = max(older, key=lambda r: r.step) if older else None
            self.latest_attempt = self.step_attempt.get(self.latest.step, 0) if self.latest else attempt
        self.steps_through = min(self.steps_through, first - 1)
        if self.latest is not None:
            self.steps_through = max(self.steps_through, self.latest.step)

    def _feed(self, p: StepPacket, attempt: int) -> None:
        red = self.reducer
        if red is None:
            return
        dropped = red.duplicates + red.late + red.out_of_range
        done = red.add(p)
        # the reducer's own verdict: a packet it drops bumps one of these counters
        if self.history and red.duplicates + red.late + red.out_of_range == dropped:
            self._per_rank.setdefault(p.rank, []).append((attempt, p))
        for step in done:
            self.stragglers.update(step)  # fills step.straggler_scores, as the aggregator's tracker does
            self._take(step, attempt)

    def _on_record(self, red: ReducedStep, attempt: int) -> None:
        """The aggregator's reduced record of a step: only used when the packets read cannot
        complete the step (their per-rank detail was thinned); its scores are the aggregator's."""
        packets = step_from_record(self.reducer, red, self._done)
        if packets is None:
            return
        red.per_rank = dict(sorted(packets.items()))  # the packets thinning kept (non-finite ranks)
        self._info(attempt).from_records += 1
        self._take(red, attempt)

    def _peak(self) -> float | None:
        """The peak TFLOPS the run's MFU is measured against: summary.json's, else the config's
        world.peak_tflops or the pre-flight check's figure (a running run: docs/compute.md)."""
        peak = ((self.summary or {}).get("compute") or {}).get("peak_tflops")
        if isinstance(peak, (int, float)) and not isinstance(peak, bool) and peak > 0:
            return float(peak)
        if self._peak_found is None:
            from mindpulse.reporting.card_peaks import resolve_peak

            self._peak_found = resolve_peak(self.config.world.peak_tflops, self.run_dir, [])[0] or 0.0
        return self._peak_found or None

    def _take(self, red: ReducedStep, attempt: int) -> None:
        if red.peak_tflops is None and red.tflops_mean is not None:
            red.set_peak(self._peak())  # MFU, as the aggregator showed it
        self._done.add(red.step)
        self._done_order.append(red.step)
        if len(self._done_order) > 4096:
            self._done.discard(self._done_order.popleft())
        self.run_totals.add(red)
        if self.latest is None or red.step > self.latest.step or attempt > self.latest_attempt:
            self.latest, self.latest_attempt = red, attempt
        self.steps_through = max(self.steps_through, red.step)
        info = self._info(attempt)
        info.steps += 1
        info.last_step = red.step if info.last_step is None else max(info.last_step, red.step)
        if self.history:
            self.reduced.append(red)
            self.step_attempt[red.step] = attempt

    def _forget(self) -> None:
        """Without `history`, keep only the packets a rebuild could still complete a step with."""
        if self.history:
            return
        keep = set(self.reducer.pending_steps()) if self.reducer is not None else set()
        if self.latest is not None and self.latest_attempt == self.attempt:
            keep.add(self.latest.step)
        self._kept = [it for it in self._kept if it[1] == self.attempt and it[2].step in keep]
        self._base = self.attempt


__all__ = ["AttemptInfo", "Batch", "MetricsTail", "RunConfigFile", "RunReader", "RunTotals", "read_config", "read_json",
           "CONFIG", "METRICS", "SUMMARY"]
