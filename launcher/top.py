"""`mindpulse top [RUN_DIR]`: a live cluster table of a running (or finished) run.

Reads `RUN_DIR/metrics.msgpack` incrementally: the file offset and a streaming msgpack
unpacker are kept between refreshes and only the bytes appended since the last refresh
are read, so a long run costs no more per refresh than a short one. A torn last record
(the aggregator is mid-write) stays in the unpacker until the rest of it arrives.

On a terminal the screen is redrawn in place every `interval` seconds and `q` (or
Ctrl-C) quits. With `once`, or when stdout is not a terminal, plain frames are printed
instead: one frame with `once`; otherwise a frame whenever the view changed, until the
run's `summary.json` appears (then the final frame).
"""

from __future__ import annotations

import json
import math
import os
import select
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import msgpack

try:  # POSIX terminals; elsewhere the terminal view refreshes without keys
    import termios
    import tty
except ImportError:  # pragma: no cover
    termios = tty = None  # type: ignore[assignment]

from mindpulse.aggregator.packets import (
    _UNPACK_LIMITS,
    MAX_PACKET_BYTES,
    EventPacket,
    PacketError,
    StepPacket,
    TelemetryPacket,
    from_wire,
)
from mindpulse.aggregator.reducer import ReducedStep, reduce_step
from mindpulse.aggregator.tables import card_table, cluster_table

METRICS = "metrics.msgpack"
SUMMARY = "summary.json"
READ_CHUNK = 1 << 20
"""Bytes read from the metrics file per read call (the unpacker is drained after each)."""
MAX_PENDING_STEPS = 512
"""Incomplete steps kept at most (a lost rank must not grow memory forever)."""
MAX_ERROR_LINES = 3

_CLEAR = "\x1b[2J"
_HOME = "\x1b[H"
_EOL = "\x1b[K"
_EOS = "\x1b[J"
_HIDE_CURSOR = "\x1b[?25l"
_SHOW_CURSOR = "\x1b[?25h"


# ------------------------------------------------------------------------------ reading


class MetricsTail:
    """Incremental reader of an append-only msgpack stream: feeds only new bytes."""

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


class RunView:
    """What `top` shows of one run directory, updated by :meth:`refresh`."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.tail = MetricsTail(self.run_dir / METRICS)
        self.summary: dict[str, Any] | None = None
        self._summary_mtime: float | None = None
        self.total_steps = _total_steps(self.run_dir)
        self._reset_data()

    def _reset_data(self) -> None:
        self.records = 0
        self.rejected = 0
        self.max_rank = -1
        self.newest_step_seen = -1
        self.newest_ts = 0.0
        self.last_step_of_rank: dict[int, int] = {}
        self.cards: dict[tuple[str, str], tuple[float, dict[str, Any]]] = {}
        self.errors: dict[int, str] = {}
        self._buckets: dict[int, dict[int, StepPacket]] = {}
        self.complete_step: int | None = None
        self._reduced: ReducedStep | None = None
        self._reduced_key: tuple[int, int] | None = None

    # ---- state
    @property
    def world_size(self) -> int:
        ws = (self.summary or {}).get("world_size")
        if isinstance(ws, int) and not isinstance(ws, bool) and ws > 0:
            return ws
        return self.max_rank + 1

    @property
    def status(self) -> str:
        if self.summary and self.summary.get("status"):
            return str(self.summary["status"])
        return "running"

    @property
    def finished(self) -> bool:
        return self.summary is not None

    def reduced(self) -> ReducedStep | None:
        """The reduction of the newest complete step (cached)."""
        if self.complete_step is None:
            return None
        key = (self.complete_step, self.world_size)
        if self._reduced_key != key:
            bucket = {r: p for r, p in self._buckets[self.complete_step].items() if r < self.world_size}
            self._reduced = reduce_step(self.complete_step, bucket, self.world_size)
            self._reduced_key = key
        return self._reduced

    # ---- updating
    def refresh(self) -> int:
        """Read what was appended since the last refresh; returns the number of new records."""
        self._read_summary()
        objs, restarted = self.tail.poll()
        if restarted:
            self._reset_data()
        for obj in objs:
            self._ingest(obj)
        self._update_complete()
        return len(objs)

    def _read_summary(self) -> None:
        path = self.run_dir / SUMMARY
        try:
            mtime = path.stat().st_mtime
        except OSError:
            return
        if mtime == self._summary_mtime:
            return
        try:
            obj = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return  # being written: the next refresh tries again
        if isinstance(obj, dict):
            self.summary = obj
            self._summary_mtime = mtime

    def _ingest(self, obj: Any) -> None:
        try:
            pkt = from_wire(obj)
        except PacketError:
            self.rejected += 1
            return
        self.records += 1
        if isinstance(pkt, StepPacket):
            self._add_step(pkt)
        elif isinstance(pkt, TelemetryPacket):
            for i, card in enumerate(pkt.cards):
                if not isinstance(card, dict):
                    continue
                cid = card.get("card")
                key = (pkt.node, str(i if cid is None else cid))
                old = self.cards.get(key)
                if old is None or pkt.ts >= old[0]:
                    self.cards[key] = (float(pkt.ts), dict(card, node=pkt.node))
        elif isinstance(pkt, EventPacket):
            self.max_rank = max(self.max_rank, pkt.rank)
            if pkt.kind == "error":
                self.errors[pkt.rank] = pkt.message
            if _finite(pkt.ts):
                self.newest_ts = max(self.newest_ts, float(pkt.ts))

    def _add_step(self, p: StepPacket) -> None:
        self.max_rank = max(self.max_rank, p.rank)
        self.newest_step_seen = max(self.newest_step_seen, p.step)
        if p.step >= self.last_step_of_rank.get(p.rank, -1):
            self.last_step_of_rank[p.rank] = p.step
        if _finite(p.ts):
            self.newest_ts = max(self.newest_ts, float(p.ts))
        if self.complete_step is not None and p.step < self.complete_step:
            return  # late: a newer step is already complete
        bucket = self._buckets.setdefault(p.step, {})
        bucket.setdefault(p.rank, p)  # the first report of a (rank, step) wins, as in the aggregator

    def _update_complete(self) -> None:
        ws = self.world_size
        if ws <= 0:
            return
        need = range(ws)
        newest = None
        for s in sorted(self._buckets, reverse=True):
            bucket = self._buckets[s]
            if all(r in bucket for r in need):
                newest = s
                break
        if newest is not None:
            for s in [s for s in self._buckets if s < newest]:
                del self._buckets[s]
            self.complete_step = newest
        elif self.complete_step is not None and self.complete_step not in self._buckets:
            self.complete_step = None  # the world grew and older steps are gone
        pending = sorted(s for s in self._buckets if s != self.complete_step)
        for s in pending[: max(0, len(pending) - MAX_PENDING_STEPS)]:
            del self._buckets[s]

    # ---- rendering
    def card_rows(self) -> list[dict[str, Any]]:
        return [_clean_card(c) for _, c in self.cards.values()]

    def render(self, now: float | None = None) -> str:
        """One frame as plain text (no terminal codes)."""
        lines = [self._header(now)]
        red = self.reduced()
        lines.append("")
        if red is not None:
            lines.append(cluster_table(red, self.total_steps))
        elif self.newest_step_seen >= 0:
            lines.append(f"no complete step yet (newest step reported: {self.newest_step_seen})")
        elif self.tail.offset == 0 and not (self.run_dir / METRICS).exists():
            lines.append(f"waiting for {METRICS}")
        else:
            lines.append("no step data yet")
        behind = self._behind()
        if behind:
            lines.append(behind)
        cards = self.card_rows()
        lines.append("")
        if cards:
            lines.append("cards (newest sample)")
            lines.append(card_table(cards))
        else:
            lines.append("cards: no telemetry")
        for r, msg in sorted(self.errors.items())[:MAX_ERROR_LINES]:
            first = (msg.strip().splitlines() or [""])[-1]
            lines.append(f"rank {r} error: {first[:200]}")
        if self.summary and isinstance(self.summary.get("stop"), dict) and self.summary["stop"].get("message"):
            lines.append(f"stopped: {self.summary['stop']['message']}")
        return "\n".join(lines)

    def _header(self, now: float | None) -> str:
        now = time.time() if now is None else now
        step = "-" if self.complete_step is None else str(self.complete_step)
        if self.total_steps and self.complete_step is not None:
            step += f"/{self.total_steps}"
        ws = self.world_size
        parts = [f"run {self.run_dir}", f"status {self.status}", f"step {step}",
                 f"world size {ws if ws > 0 else '-'}", f"records {self.records}"]
        if self.rejected:
            parts.append(f"rejected {self.rejected}")
        if self.tail.errors:
            parts.append(f"unreadable stretches {self.tail.errors}")
        if not self.finished and self.newest_ts > 0:
            parts.append(f"last packet {max(0.0, now - self.newest_ts):.0f}s ago")
        return "  ".join(parts)

    def _behind(self) -> str:
        """Ranks that reported beyond the newest complete step while others did not."""
        if self.complete_step is None or self.newest_step_seen <= self.complete_step:
            return ""
        ws = self.world_size
        lagging = [r for r in range(ws) if self.last_step_of_rank.get(r, -1) < self.newest_step_seen]
        if not lagging:
            return ""
        shown = ", ".join(f"{r}@{self.last_step_of_rank.get(r, '-')}" for r in lagging[:16])
        more = f" (+{len(lagging) - 16})" if len(lagging) > 16 else ""
        return f"waiting for step {self.newest_step_seen} from rank@last step: {shown}{more}"


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _clean_card(card: dict[str, Any]) -> dict[str, Any]:
    """A card record safe for `card_table`: numbers or None, ranks a list of ints."""
    out = dict(card)
    for k in ("util_pct", "memory_used_mb", "memory_total_mb", "power_w", "temp_c"):
        v = card.get(k)
        out[k] = float(v) if _finite(v) else None
    ranks = card.get("ranks")
    out["ranks"] = [r for r in ranks if isinstance(r, int)] if isinstance(ranks, list) else []
    h = card.get("health")
    out["health"] = str(h) if h is not None else None
    return out


def _total_steps(run_dir: Path) -> int | None:
    """train.steps of the run's config.yaml (None when absent or 0: the run goes by epochs)."""
    path = run_dir / "config.yaml"
    if not path.exists():
        return None
    try:
        import yaml

        cfg = yaml.safe_load(path.read_text(encoding="utf-8"))
        steps = cfg["train"]["steps"]
    except Exception:
        return None
    return steps if isinstance(steps, int) and not isinstance(steps, bool) and steps > 0 else None


# ------------------------------------------------------------------------- run selection


def _is_run_dir(d: Path) -> bool:
    return (d / METRICS).is_file()


def newest_run(root: Path) -> Path | None:
    """The run directory under `root` whose metrics file was written last."""
    try:
        cands = [d for d in Path(root).iterdir() if d.is_dir() and _is_run_dir(d)]
    except OSError:
        return None

    def key(d: Path) -> tuple[float, str]:
        try:
            return ((d / METRICS).stat().st_mtime, d.name)
        except OSError:
            return (0.0, d.name)

    return max(cands, key=key, default=None)


def resolve_run_dir(run_dir: Path | None, root: Path) -> tuple[Path | None, str]:
    """(run directory, error message)."""
    if run_dir is None:
        found = newest_run(root)
        if found is None:
            return None, (f"mindpulse top: no run directory (a folder with {METRICS}) under {root}; "
                          f"give RUN_DIR or --root")
        return found, ""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return None, f"mindpulse top: {run_dir} is not a directory"
    if not _is_run_dir(run_dir) and not (run_dir / SUMMARY).exists() and not (run_dir / "config.yaml").exists():
        found = newest_run(run_dir)  # a folder of runs: show its newest
        if found is None:
            return None, f"mindpulse top: {run_dir} has no {METRICS}; is it a run directory?"
        return found, ""
    return run_dir, ""


# --------------------------------------------------------------------------- the views


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def _term_size(out: TextIO) -> tuple[int, int]:
    try:
        size = os.get_terminal_size(out.fileno())
        return max(20, size.columns), max(5, size.lines)
    except (AttributeError, ValueError, OSError):
        return 120, 40


def _fit(frame: str, cols: int, rows: int) -> list[str]:
    lines = [ln[:cols] for ln in frame.splitlines()]
    if len(lines) > rows:
        hidden = len(lines) - (rows - 1)
        lines = lines[: rows - 1] + [f"... {hidden} more lines (enlarge the terminal)"[:cols]]
    return lines


def _draw(view: RunView, out: TextIO, interval: float, first: bool) -> None:
    cols, rows = _term_size(out)
    footer = f"q quits  refresh {interval:g}s  {time.strftime('%H:%M:%S')}"
    lines = _fit(view.render() + "\n\n" + footer, cols, rows)
    out.write((_CLEAR if first else "") + _HOME + "".join(ln + _EOL + "\r\n" for ln in lines[:-1])
              + lines[-1] + _EOL + _EOS)
    out.flush()


def _wait_key(fd: int | None, timeout: float) -> tuple[bool, int | None]:
    """Wait up to `timeout` s; (quit requested, fd still usable)."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False, fd
        if fd is None:
            time.sleep(left)
            return False, fd
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            return False, fd
        try:
            data = os.read(fd, 64)
        except OSError:
            data = b""
        if not data:
            fd = None  # stdin closed: keep refreshing, Ctrl-C still quits
            continue
        if b"q" in data.lower() or b"\x03" in data:
            return True, fd


def _run_terminal(view: RunView, out: TextIO, interval: float) -> int:
    tty_fd: int | None = None
    saved = None
    if termios is not None and _isatty(sys.stdin):
        tty_fd = sys.stdin.fileno()
        saved = termios.tcgetattr(tty_fd)
    fd = tty_fd
    try:
        if tty_fd is not None:
            tty.setcbreak(tty_fd)  # keys without Enter, no echo; Ctrl-C still interrupts
        out.write(_HIDE_CURSOR)
        first = True
        while True:
            view.refresh()
            _draw(view, out, interval, first)
            first = False
            quit_, fd = _wait_key(fd, interval)
            if quit_:
                return 0
    except KeyboardInterrupt:
        return 0
    finally:
        if saved is not None:
            termios.tcsetattr(tty_fd, termios.TCSADRAIN, saved)
        try:
            out.write(_SHOW_CURSOR + "\r\n")
            out.flush()
        except (OSError, ValueError):
            pass


def _run_plain(view: RunView, out: TextIO, interval: float) -> int:
    """Frames on a pipe or file: print when the view changed, stop once the run finished."""
    last = None
    try:
        while True:
            view.refresh()
            finished = view.finished
            if finished:
                view.refresh()  # the bytes written just before summary.json
            frame = view.render()
            # the "last packet Ns ago" clock alone is not a change worth a frame
            key = "\n".join(frame.splitlines()[1:]) + view._header(now=0.0)
            if key != last or finished:
                if last is not None:
                    out.write("\n")
                out.write(frame + "\n")
                out.flush()
                last = key
            if finished:
                return 0
            time.sleep(interval)
    except KeyboardInterrupt:
        return 0


def main_top(run_dir: Path | None, root: Path = Path("runs"), interval: float = 1.0, once: bool = False,
             out: TextIO | None = None) -> int:
    """The `mindpulse top` command; `out` defaults to sys.stdout. Returns the exit code."""
    out = sys.stdout if out is None else out
    path, err = resolve_run_dir(run_dir, Path(root))
    if path is None:
        print(err, file=sys.stderr)
        return 2
    if not (isinstance(interval, (int, float)) and math.isfinite(interval) and interval > 0):
        print(f"mindpulse top: --interval must be a positive number of seconds, not {interval}", file=sys.stderr)
        return 2
    interval = max(0.05, float(interval))
    view = RunView(path)
    if once:
        view.refresh()
        out.write(view.render() + "\n")
        out.flush()
        return 0
    if _isatty(out):
        return _run_terminal(view, out, interval)
    return _run_plain(view, out, interval)


__all__ = ["main_top", "RunView", "MetricsTail", "newest_run", "resolve_run_dir"]
