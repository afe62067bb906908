"""`mindpulse top [RUN_DIR]`: a live cluster table of a running (or finished) run.

The run is read through `run_reader.RunReader`: only the bytes appended to
the run's metrics (`metrics.msgpack` and the segments closed before it) since the last
refresh are read, and steps complete in the aggregator's own reducer, so the table is the one
the aggregator prints. After a restart (`max_restarts`) the view follows the newest attempt and
says which attempt the step shown comes from; damaged bytes in the metrics are skipped and
counted in the header.

On a terminal the screen is redrawn in place every `interval` seconds and `q` (or
Ctrl-C) quits. A world larger than the table shows its ranks that matter (extremes,
non-finite ranks, stragglers) and counts the rest; `n` and `p` page through every rank
(`--page N` prints page N), `a` goes back. With `once`, or when stdout is not a terminal, plain frames are printed
instead: one frame with `once`; otherwise a frame whenever the view changed, until the
run's `summary.json` appears (then the final frame).
"""

from __future__ import annotations

import math
import os
import select
import sys
import time
from pathlib import Path
from typing import Any, TextIO

try:  # POSIX terminals; elsewhere the terminal view refreshes without keys
    import termios
    import tty
except ImportError:  # pragma: no cover
    termios = tty = None  # type: ignore[assignment]

from mindpulse.common.formatting import is_number
from mindpulse.reduction.reducer import ReducedStep
from mindpulse.reporting.tables import MAX_TABLE_RANKS, card_table, cluster_table
from mindpulse.rundir.metrics_store import closed_segments
from mindpulse.views.run_reader import CONFIG, METRICS, SUMMARY, MetricsTail, RunReader
from mindpulse.wire.protocol import EventPacket, Packet, StepPacket, TelemetryPacket

MAX_ERROR_LINES = 3
PAGE_RANKS = MAX_TABLE_RANKS
"""Ranks per page when paging through a large world (`n`/`p`, or `--page`)."""

_CLEAR = "\x1b[2J"
_HOME = "\x1b[H"
_EOL = "\x1b[K"
_EOS = "\x1b[J"
_HIDE_CURSOR = "\x1b[?25l"
_SHOW_CURSOR = "\x1b[?25h"


# ------------------------------------------------------------------------------ the view


def _card_tflops(red: ReducedStep):
    """A card's achieved TFLOPS at the shown step: the sum over its ranks the step kept whole
    (every rank at a collect step); None when no rank reported one (the column then says -)."""
    if not any(getattr(p, "tflops", None) is not None for p in red.per_rank.values()):
        return None

    def of(card: dict[str, Any]) -> float | None:
        vals = [p.tflops for r in card.get("ranks") or () if (p := red.per_rank.get(r)) is not None
                and p.tflops is not None]
        return sum(vals) if vals else None

    return of


class RunView:
    """What `top` shows of one run directory, updated by :meth:`refresh`.

    Steps, world size, completion and straggler scores are the reader's (the aggregator's
    reducer and tracker); the view itself keeps only what it draws besides: the newest
    sample per card, each rank's last error and the newest packet time.
    """

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.run = RunReader(self.run_dir)
        self._reset_data()

    def _reset_data(self) -> None:
        self.newest_ts = 0.0
        self.cards: dict[tuple[str, str], tuple[float, dict[str, Any]]] = {}
        self.errors: dict[int, str] = {}

    # ---- state
    @property
    def tail(self) -> MetricsTail:
        return self.run.tail

    @property
    def records(self) -> int:
        return self.run.records

    @property
    def rejected(self) -> int:
        return self.run.rejected

    @property
    def summary(self) -> dict[str, Any] | None:
        return self.run.summary

    @property
    def world_size(self) -> int:
        return self.run.world_size

    @property
    def complete_step(self) -> int | None:
        return self.run.complete_step

    @property
    def newest_step_seen(self) -> int:
        return self.run.newest_step_seen

    @property
    def total_steps(self) -> int | None:
        """train.steps of the run's config (None when 0: the run goes by epochs)."""
        return self.run.config.train.steps or None

    @property
    def status(self) -> str:
        if self.summary and self.summary.get("status"):
            return str(self.summary["status"])
        return "running"

    @property
    def finished(self) -> bool:
        return self.summary is not None

    def reduced(self) -> ReducedStep | None:
        """The reduction of the newest complete step."""
        return self.run.latest

    # ---- updating
    def refresh(self) -> int:
        """Read what was appended since the last refresh; returns the number of new records."""
        batch = self.run.poll()
        if batch.restarted:
            self._reset_data()
        for pkt in batch.packets:
            self._ingest(pkt)
        return batch.objects

    def _ingest(self, pkt: Packet) -> None:
        if isinstance(pkt, TelemetryPacket):
            for i, card in enumerate(pkt.cards):
                if not isinstance(card, dict):
                    continue
                cid = card.get("card")
                key = (pkt.node, str(i if cid is None else cid))
                old = self.cards.get(key)
                if old is None or pkt.ts >= old[0]:
                    self.cards[key] = (float(pkt.ts), dict(card, node=pkt.node))
            return
        if isinstance(pkt, EventPacket) and pkt.kind == "error":
            self.errors[pkt.rank] = pkt.message
        if isinstance(pkt, (StepPacket, EventPacket)) and is_number(pkt.ts):
            self.newest_ts = max(self.newest_ts, float(pkt.ts))

    # ---- rendering
    def card_rows(self) -> list[dict[str, Any]]:
        return [_clean_card(c) for _, c in self.cards.values()]

    def render(self, now: float | None = None) -> str:
        """One frame as plain text (no terminal codes)."""
        lines = [self._header(now)]
        red = self.reduced()
        lines.append("")
        if red is not None:
            lines.append(cluster_table(red, self.total_steps,
                                       straggler_threshold=self.run.config.monitor.straggler_threshold,
                                       ranks=self.page_ranks(red.world_size)))
            if red.world_size > MAX_TABLE_RANKS:
                pages = self.pages(red.world_size)
                where = "the ranks that matter" if self.page is None else f"page {self.page + 1}/{pages}"
                lines.append(f"{where}: n/p next/previous page of {PAGE_RANKS} ranks, a the ranks that matter")
        elif self.newest_step_seen >= 0:
            lines.append(f"no complete step yet (newest step reported: {self.newest_step_seen})")
        elif self.tail.offset == 0 and not (self.run_dir / METRICS).exists():
            lines.append(f"waiting for {METRICS}")
        else:
            lines.append("no step data yet")
        behind = self._behind()
        if behind:
            lines.append(behind)
        attempts = self._attempts()
        if attempts:
            lines.append(attempts)
        cards = self.card_rows()
        lines.append("")
        if cards:
            lines.append("cards (newest sample)")
            lines.append(card_table(cards, _card_tflops(red) if red is not None else None))
        else:
            lines.append("cards: no telemetry")
        for r, msg in sorted(self.errors.items())[:MAX_ERROR_LINES]:
            first = (msg.strip().splitlines() or [""])[-1]
            lines.append(f"rank {r} error: {first[:200]}")
        if self.summary and isinstance(self.summary.get("stop"), dict) and self.summary["stop"].get("message"):
            lines.append(f"stopped: {self.summary['stop']['message']}")
        return "\n".join(lines)

    # ---- paging through the ranks
    page: int | None = None
    """The page of ranks shown (None: the ranks that matter, as the aggregator's table)."""

    @staticmethod
    def pages(world: int) -> int:
        return max(1, math.ceil(world / PAGE_RANKS))

    def page_ranks(self, world: int) -> range | None:
        if self.page is None or world <= 0:
            return None
        self.page = min(max(self.page, 0), self.pages(world) - 1)
        return range(self.page * PAGE_RANKS, min(world, (self.page + 1) * PAGE_RANKS))

    def key(self, ch: str) -> None:
        """n / p: next / previous page of ranks; a: back to the ranks that matter."""
        world = max(self.world_size, 1)
        if ch in ("n", "]", " "):
            self.page = 0 if self.page is None else min(self.page + 1, self.pages(world) - 1)
        elif ch in ("p", "["):
            self.page = self.pages(world) - 1 if self.page is None else max(self.page - 1, 0)
        elif ch == "a":
            self.page = None

    def _header(self, now: float | None) -> str:
        now = time.time() if now is None else now
        step = "-" if self.complete_step is None else str(self.complete_step)
        if self.total_steps and self.complete_step is not None:
            step += f"/{self.total_steps}"
        ws = self.world_size
        parts = [f"run {self.run_dir}", f"status {self.status}", f"step {step}"]
        if self.run.multi_attempt and self.complete_step is not None:
            parts.append(f"attempt {self.run.latest_attempt}")
        parts += [f"world size {ws if ws > 0 else '-'}", f"records {self.records}"]
        if self.rejected:
            parts.append(f"rejected {self.rejected}")
        if self.tail.skipped_bytes:
            parts.append(f"damaged bytes skipped {self.tail.skipped_bytes} ({self.tail.errors} stretches)")
        if not self.finished and self.newest_ts > 0:
            parts.append(f"last packet {max(0.0, now - self.newest_ts):.0f}s ago")
        return "  ".join(parts)

    def _attempts(self) -> str:
        """Which attempt runs, where it resumed, and which attempt the step shown is from."""
        run = self.run
        if not run.multi_attempt:
            return ""
        cur = run.current_attempt
        info = run.attempts.get(cur)
        text = f"attempt {cur}"
        if info is not None and info.first_step is not None:
            text += f" resumed at step {info.first_step}" if cur else f" started at step {info.first_step}"
            if cur and any(a < cur for a in run.attempts):
                text += f" (its steps replace the earlier attempts' from step {info.first_step} on)"
        elif cur:
            text += " starting (no step reported yet)"
        if info is not None and info.restarts:
            text += f"; its aggregator restarted {info.restarts}x"
        if run.latest is not None and run.latest_attempt != cur:
            text += f"; the step shown is attempt {run.latest_attempt}'s"
        return text

    def _behind(self) -> str:
        """Ranks that reported beyond the newest complete step while others did not."""
        if self.complete_step is None or self.newest_step_seen <= self.complete_step:
            return ""
        last = self.run.last_step_of_rank
        lagging = [r for r in range(self.world_size) if last.get(r, -1) < self.newest_step_seen]
        if not lagging:
            return ""
        shown = ", ".join(f"{r}@{last.get(r, '-')}" for r in lagging[:16])
        more = f" (+{len(lagging) - 16})" if len(lagging) > 16 else ""
        return f"waiting for step {self.newest_step_seen} from rank@last step: {shown}{more}"


def _clean_card(card: dict[str, Any]) -> dict[str, Any]:
    """A card record safe for `card_table`: numbers or None, ranks a list of ints."""
    out = dict(card)
    for k in ("util_pct", "memory_used_mb", "memory_total_mb", "power_w", "temp_c"):
        v = card.get(k)
        out[k] = float(v) if is_number(v) else None
    ranks = card.get("ranks")
    out["ranks"] = [r for r in ranks if isinstance(r, int)] if isinstance(ranks, list) else []
    h = card.get("health")
    out["health"] = str(h) if h is not None else None
    return out


# ------------------------------------------------------------------------- run selection


def _is_run_dir(d: Path) -> bool:
    return (d / METRICS).is_file() or bool(closed_segments(d))


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
    if not _is_run_dir(run_dir) and not (run_dir / SUMMARY).exists() and not (run_dir / CONFIG).exists():
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


def _wait_key(fd: int | None, timeout: float) -> tuple[str | None, int | None]:
    """Wait up to `timeout` s for a key; ("q" to quit, another key, or None; fd still usable)."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None, fd
        if fd is None:
            time.sleep(left)
            return None, fd
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            return None, fd
        try:
            data = os.read(fd, 64)
        except OSError:
            data = b""
        if not data:
            fd = None  # stdin closed: keep refreshing, Ctrl-C still quits
            continue
        if b"q" in data.lower() or b"\x03" in data:
            return "q", fd
        return data[-1:].decode("latin-1").lower(), fd


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
            key, fd = _wait_key(fd, interval)
            if key == "q":
                return 0
            if key:
                view.key(key)
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
             out: TextIO | None = None, page: int | None = None) -> int:
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
    if page is not None and page < 1:
        print(f"mindpulse top: --page counts from 1, not {page}", file=sys.stderr)
        return 2
    view = RunView(path)
    view.page = None if page is None else page - 1
    if once:
        view.refresh()
        out.write(view.render() + "\n")
        out.flush()
        return 0
    if _isatty(out):
        return _run_terminal(view, out, interval)
    return _run_plain(view, out, interval)


__all__ = ["main_top", "RunView", "newest_run", "resolve_run_dir"]
