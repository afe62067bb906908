"""One reader of a run directory for the offline views (`top`, `report`).

It reads `RUN_DIR/metrics.msgpack` incrementally, decodes every record with the protocol's
`from_wire`, reads the run's resolved config (`config.yaml`) and `summary.json`, and
completes steps with the aggregator's own `StepReducer` and scores stragglers with its
`StragglerTracker` built from the run's config. A view therefore shows what the aggregator
computed, not a second implementation of step completion, deduplication or totals.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import yaml

from mindpulse.aggregator.reducer import ReducedStep, RunTotals, StepReducer, StragglerTracker
from mindpulse.config import RunConfig, sections_of
from mindpulse.protocol import (
    _UNPACK_LIMITS,
    MAX_PACKET_BYTES,
    EventPacket,
    Packet,
    PacketError,
    StepPacket,
    from_wire,
)

METRICS = "metrics.msgpack"
SUMMARY = "summary.json"
CONFIG = "config.yaml"
READ_CHUNK = 1 << 20
"""Bytes read from the metrics file per read call (the unpacker is drained after each)."""


# ------------------------------------------------------------------------------ the stream


class MetricsTail:
    """Incremental reader of an append-only msgpack stream: feeds only new bytes.

    The file offset and a streaming unpacker are kept between polls, so a long run costs no
    more per poll than a short one. A torn last record (the aggregator is mid-write) stays in
    the unpacker until the rest of it arrives.
    """

    def __init__(self, path: Path, chunk: int = READ_CHUNK):
        self.path = Path(path)
        self.chunk = chunk
        self.offset = 0
        """Bytes of the file already fed to the unpacker."""
        self.bytes_read = 0
        """Bytes read over the reader's life (equals `offset` unless the file was replaced)."""
        self.errors = 0
        """Undecodable stretches met (the unpacker was restarted after each)."""
        self.restarts = 0
        """Times the file shrank (replaced or truncated) and was read again from the start."""
        self._unpacker = self._new_unpacker()

    @staticmethod
    def _new_unpacker() -> msgpack.Unpacker:
        return msgpack.Unpacker(raw=False, strict_map_key=True, max_buffer_size=MAX_PACKET_BYTES * 4,
                                **_UNPACK_LIMITS)

    def poll(self) -> tuple[list[Any], bool]:
        """(new wire objects, restarted): `restarted` means earlier objects are void."""
        try:
            size = os.stat(self.path).st_size
        except FileNotFoundError:
            return [], False
        restarted = False
        if size < self.offset:
            self.offset = 0
            self.restarts += 1
            self._unpacker = self._new_unpacker()
            restarted = True
        if size == self.offset:
            return [], restarted
        out: list[Any] = []
        try:
            fh = open(self.path, "rb")
        except FileNotFoundError:
            return [], restarted
        with fh:
            fh.seek(self.offset)
            while True:
                data = fh.read(self.chunk)
                if not data:
                    break
                self.offset += len(data)
                self.bytes_read += len(data)
                try:
                    self._unpacker.feed(data)
                except msgpack.BufferFull:
                    self._restart_unpacker()
                    continue
                self._drain(out)
        return out, restarted

    def _drain(self, out: list[Any]) -> None:
        while True:
            try:
                out.append(next(self._unpacker))
            except StopIteration:
                return  # nothing more, or a torn record waiting for its remaining bytes
            except Exception:  # corrupt bytes: msgpack raises several types
                self._restart_unpacker()
                return

    def _restart_unpacker(self) -> None:
        self.errors += 1
        self._unpacker = self._new_unpacker()


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


# ---------------------------------------------------------------------------- the totals


# ---------------------------------------------------------------------------- the reader


@dataclass
class Batch:
    """What one poll read."""

    objects: int
    """Records read (valid packets and rejected ones)."""
    packets: list[Packet]
    """The valid packets, in file order."""
    restarted: bool
    """The metrics file was replaced: everything read before is void (the reader reset)."""


class RunReader:
    """A run directory replayed through the aggregator's reducer, refreshed by :meth:`poll`.

    `history=False` (top) keeps only what the newest complete step needs; `history=True`
    (report) also keeps every reduced step and each rank's accepted step packets.
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
        self._reset()

    # ---- what is known
    @property
    def config(self) -> RunConfig:
        return self.config_file.config

    @property
    def world_size(self) -> int:
        """The config's world when config.yaml names it, else summary.json's, else the highest
        rank seen + 1 (0 before any rank reported)."""
        return (self.config_file.world_size or _positive_int((self.summary or {}).get("world_size"))
                or self.max_rank + 1)

    @property
    def complete_step(self) -> int | None:
        return self.latest.step if self.latest is not None else None

    @property
    def last_step_of_rank(self) -> dict[int, int]:
        return self.reducer.last_step_of_rank if self.reducer is not None else {}

    def totals(self) -> dict[str, Any]:
        """summary.json's totals derived from the packets read, as the aggregator derives them
        (complete only with `history`: a live reader forgets what it no longer needs)."""
        red = self.reducer
        return {
            "world_size": self.world_size,
            "steps_completed": max(0, red.reduced_through) if red else 0,
            **self.run_totals.as_dict(),
            "packets": {
                "accepted": self.records,
                "rejected": self.rejected,
                "duplicates": red.duplicates if red else 0,
                "late": red.late if red else 0,
                "incomplete_steps_evicted": red.evicted_incomplete if red else 0,
            },
        }

    # ---- reading
    def poll(self) -> Batch:
        """Re-read config.yaml and summary.json if they changed, then the appended records."""
        self._reload_files()
        objs, restarted = self.tail.poll()
        if restarted:
            self._reset()
        packets: list[Packet] = []
        for obj in objs:
            try:
                packets.append(from_wire(obj))
            except PacketError:
                self.rejected += 1
        self.records += len(packets)
        for p in packets:
            if isinstance(p, (StepPacket, EventPacket)):
                self.max_rank = max(self.max_rank, p.rank)
            if isinstance(p, StepPacket):
                self.newest_step_seen = max(self.newest_step_seen, p.step)
        # the whole batch names its ranks before any of it is reduced, so one read of a
        # finished run reduces with its final world and never needs a replay
        if self._built_for != self._wanted():
            self._rebuild()
        for p in packets:
            if isinstance(p, StepPacket):
                self._kept.append(p)
                self._feed(p)
        self._forget()
        return Batch(objects=len(objs), packets=packets, restarted=restarted)

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
        """Forget every packet (a new reader, or the metrics file was replaced)."""
        self.records = 0
        self.rejected = 0
        self.max_rank = -1
        self.newest_step_seen = -1
        self._kept: list[StepPacket] = []
        """Step packets a rebuild replays: all of them with `history`, else those of the
        reducer's pending steps and of the newest complete step."""
        self._rebuild()

    def _wanted(self) -> tuple[int, int]:
        return self.world_size, self.config.monitor.straggler_window

    def _rebuild(self) -> None:
        """A fresh reducer and straggler tracker for the current world size and window,
        replaying the packets kept: the world changed (a rank seen for the first time,
        summary.json or config.yaml appeared) and every completion so far may be wrong."""
        self._built_for = self._wanted()
        ws, window = self._built_for
        # built as the aggregator builds them (aggregator/core.py)
        self.reducer: StepReducer | None = StepReducer(ws) if ws > 0 else None
        self.stragglers = StragglerTracker(window)
        self.run_totals = RunTotals()
        self.latest: ReducedStep | None = None
        """The newest complete step."""
        self.reduced: list[ReducedStep] = []
        """With `history`: every reduced step, in the order the steps completed."""
        self.per_rank: dict[int, list[StepPacket]] = {}
        """With `history`: each rank's step packets the reducer accepted, in arrival order."""
        for p in self._kept:
            self._feed(p)

    def _feed(self, p: StepPacket) -> None:
        red = self.reducer
        if red is None:
            return
        dropped = red.duplicates + red.late + red.out_of_range
        done = red.add(p)
        # the reducer's own verdict: a packet it drops bumps one of these counters
        if self.history and red.duplicates + red.late + red.out_of_range == dropped:
            self.per_rank.setdefault(p.rank, []).append(p)
        for step in done:
            self.stragglers.update(step)  # fills step.straggler_scores, as the aggregator's tracker does
            self.run_totals.add(step)
            if self.latest is None or step.step > self.latest.step:
                self.latest = step
            if self.history:
                self.reduced.append(step)

    def _forget(self) -> None:
        """Without `history`, keep only the packets a rebuild could still complete a step with."""
        if self.history:
            return
        keep = set(self.reducer.pending_steps()) if self.reducer is not None else set()
        if self.latest is not None:
            keep.add(self.latest.step)
        self._kept = [p for p in self._kept if p.step in keep]


__all__ = ["Batch", "MetricsTail", "RunConfigFile", "RunReader", "RunTotals", "read_config", "read_json",
           "CONFIG", "METRICS", "SUMMARY"]
