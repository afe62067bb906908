"""`mindpulse top`: real packets in a real run directory, read incrementally."""

from __future__ import annotations

import io
import json
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from mindpulse.views import top
from mindpulse.views.top import RunView, main_top, newest_run
from mindpulse.wire.protocol import EventPacket, StepPacket, TelemetryPacket

ROOT = Path(__file__).resolve().parents[2]
WORLD = 2
T0 = 1_700_000_000.0


def _loss(rank: int, step: int) -> float:
    return round(3.0 / step + 0.125 * rank, 6)


def _step(rank: int, step: int, **kw) -> StepPacket:
    kw.setdefault("loss", _loss(rank, step))
    return StepPacket(rank=rank, step=step, lr=1e-4, grad_norm=2.0, grad_norm_local=1.0 + rank,
                      step_time_s=0.25, samples=16, ts=T0 + step, **kw)


def _telemetry(ts: float, util: float, node: str = "node-a") -> TelemetryPacket:
    return TelemetryPacket(node=node, ts=ts, source="npu-smi", cards=[
        {"card": c, "name": "910B", "health": "OK", "util_pct": util + c, "memory_used_mb": 20000.0 + c,
         "memory_total_mb": 65536.0, "power_w": 200.0 + c, "temp_c": 60.0 + c, "ranks": [c]}
        for c in range(2)])


def _packets(first: int, last: int, world: int = WORLD) -> list:
    out: list = []
    for s in range(first, last + 1):
        out += [_step(r, s) for r in range(world)]
    return out


def _start(world: int = WORLD) -> list:
    return [EventPacket(rank=r, kind="start", ts=T0, pid=100 + r, host="node-a") for r in range(world)]


def _write(run_dir: Path, packets: list, tail: bytes = b"") -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "metrics.msgpack"
    path.write_bytes(b"".join(p.encode() for p in packets) + tail)
    return path


def _append(path: Path, data: bytes) -> None:
    with open(path, "ab") as fh:
        fh.write(data)


def _rows(text: str) -> dict[str, list[str]]:
    """Table rows of a frame keyed by their first cell (rank number or 'all')."""
    rows = {}
    for line in text.splitlines():
        cells = line.split()
        if cells and (cells[0].isdigit() or cells[0] == "all") and len(cells) > 2:
            rows.setdefault(cells[0], cells)
    return rows


@pytest.fixture
def run_dir(tmp_path) -> Path:
    d = tmp_path / "runs" / "demo-20260101-000000"
    _write(d, _start() + _packets(1, 5) + [_telemetry(T0 + 2, 40.0), _telemetry(T0 + 4, 75.0)])
    return d


def _once(run_dir: Path | None, **kw) -> tuple[int, str]:
    buf = io.StringIO()
    rc = main_top(run_dir, once=True, out=buf, **kw)
    return rc, buf.getvalue()


def test_once_shows_newest_step_losses_and_cards(run_dir):
    rc, text = _once(run_dir)
    assert rc == 0
    header = text.splitlines()[0]
    assert str(run_dir) in header and "status running" in header
    assert "step 5" in header and "world size 2" in header
    rows = _rows(text)
    assert rows["0"][1] == "5" and rows["0"][2] == f"{_loss(0, 5):.4f}"
    assert rows["1"][1] == "5" and rows["1"][2] == f"{_loss(1, 5):.4f}"
    mean = (_loss(0, 5) + _loss(1, 5)) / 2
    assert rows["all"][2] == f"{mean:.4f}"
    # the newest telemetry sample per card (util 75/76, not 40/41)
    cards = [ln.split() for ln in text.splitlines() if ln.startswith("node-a")]
    assert len(cards) == 2
    assert cards[0][:4] == ["node-a", "0", "0", "75%"] and cards[1][:4] == ["node-a", "1", "1", "76%"]
    assert "20000/65536" in cards[0][4] and cards[0][-1] == "OK"
    assert "\x1b[" not in text  # plain text when not on a terminal


def test_summary_gives_status_world_size_and_total(run_dir):
    (run_dir / "summary.json").write_text(json.dumps({"status": "anomaly_stop", "world_size": 3,
                                                      "stop": {"message": "grad norm too large"}}))
    (run_dir / "config.yaml").write_text("train:\n  steps: 40\n")
    rc, text = _once(run_dir)
    assert rc == 0
    header = text.splitlines()[0]
    assert "status anomaly_stop" in header and "world size 3" in header
    # with 3 ranks no step is complete: rank 2 never reported
    assert "no complete step yet" in text
    assert "stopped: grad norm too large" in text
    (run_dir / "summary.json").write_text(json.dumps({"status": "succeeded", "world_size": 2}))
    rc, text = _once(run_dir)
    assert "status succeeded" in text and "step 5/40" in text.splitlines()[0]


def test_incremental_reading_with_torn_record(run_dir):
    path = run_dir / "metrics.msgpack"
    view = RunView(run_dir)
    assert view.refresh() > 0
    assert view.complete_step == 5
    size = path.stat().st_size
    assert view.tail.offset == size and view.tail.bytes_read == size

    # nothing new: nothing is read
    assert view.refresh() == 0
    assert view.tail.bytes_read == size

    # two more steps, a newer telemetry sample, and half of rank 0's step 8
    more = b"".join(p.encode() for p in _packets(6, 7) + [_telemetry(T0 + 7, 90.0)])
    torn = _step(0, 8).encode()
    _append(path, more + torn[: len(torn) // 2])
    assert view.refresh() == 5
    assert view.complete_step == 7
    assert view.tail.bytes_read == path.stat().st_size  # only the appended bytes were read
    assert view.tail.errors == 0
    text = view.render()
    assert "step 7" in text.splitlines()[0]
    assert _rows(text)["0"][2] == f"{_loss(0, 7):.4f}"
    assert "90%" in text and "75%" not in text

    # still torn: waits
    assert view.refresh() == 0 and view.complete_step == 7

    # the rest of the record arrives, then rank 1's step 8
    _append(path, torn[len(torn) // 2:])
    assert view.refresh() == 1
    assert view.complete_step == 7 and view.newest_step_seen == 8
    assert "waiting for step 8 from rank@last step: 1@7" in view.render()
    _append(path, _step(1, 8).encode())
    assert view.refresh() == 1 and view.complete_step == 8
    assert view.tail.bytes_read == path.stat().st_size
    assert view.records == 2 + 2 * 8 + 3


def test_incremental_reading_tolerates_junk_and_a_replaced_file(run_dir):
    path = run_dir / "metrics.msgpack"
    view = RunView(run_dir)
    view.refresh()
    # a record that is msgpack but not a packet is counted, not fatal
    _append(path, b"\x81\xa1x\x01" + b"".join(p.encode() for p in _packets(6, 6)))
    view.refresh()
    assert view.rejected == 1 and view.complete_step == 6
    # the file is replaced by a shorter one: read again from the start
    _write(run_dir, _packets(1, 2))
    view.refresh()
    assert view.tail.restarts == 1 and view.complete_step == 2 and view.records == 4


def test_world_size_inferred_and_duplicates_ignored(tmp_path):
    d = tmp_path / "r"
    pkts = _packets(1, 3, world=3) + [_step(2, 3, loss=99.0)]  # a duplicate report is ignored
    _write(d, pkts)
    view = RunView(d)
    view.refresh()
    assert view.world_size == 3 and view.complete_step == 3
    assert _rows(view.render())["2"][2] == f"{_loss(2, 3):.4f}"


def test_newest_run_selection(tmp_path):
    root = tmp_path / "runs"
    old = root / "b-old"
    new = root / "a-new"
    _write(old, _packets(1, 2))
    _write(new, _packets(1, 3))
    (root / "not-a-run").mkdir()
    now = time.time()
    os.utime(old / "metrics.msgpack", (now - 100, now - 100))
    os.utime(new / "metrics.msgpack", (now, now))
    assert newest_run(root) == new
    rc, text = _once(None, root=root)
    assert rc == 0 and str(new) in text.splitlines()[0] and "step 3" in text
    # a folder of runs given as RUN_DIR shows its newest run too
    rc, text = _once(root)
    assert rc == 0 and str(new) in text.splitlines()[0]


def test_missing_run_returns_2(tmp_path, capsys):
    assert main_top(tmp_path / "nope", once=True, out=io.StringIO()) == 2
    assert "not a directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main_top(None, root=tmp_path / "empty", once=True, out=io.StringIO()) == 2
    assert "no run directory" in capsys.readouterr().err
    assert main_top(None, root=tmp_path / "missing-root", once=True, out=io.StringIO()) == 2
    assert main_top(tmp_path / "empty", once=True, out=io.StringIO()) == 2
    assert "no metrics.msgpack" in capsys.readouterr().err


def test_not_a_tty_prints_frames_until_the_summary_appears(run_dir):
    out = io.StringIO()
    path = run_dir / "metrics.msgpack"

    def finish():
        # each change only after the previous frame was printed
        _wait_for(lambda: "status running" in out.getvalue(), 20, 0.02)
        _append(path, b"".join(p.encode() for p in _packets(6, 9)))
        _wait_for(lambda: "step 9" in out.getvalue(), 20, 0.02)
        (run_dir / "summary.json").write_text(json.dumps({"status": "succeeded", "world_size": 2}))

    t = threading.Thread(target=finish)
    t.start()
    try:
        rc = main_top(run_dir, interval=0.05, out=out)
    finally:
        t.join()
    assert rc == 0
    frames = [f for f in out.getvalue().split("\n\n") if f.startswith("run ")]
    assert len(frames) >= 2
    assert "status running" in frames[0] and "step 5" in frames[0]
    assert "status succeeded" in frames[-1] and "step 9" in frames[-1]
    # identical frames are not repeated while nothing changes
    assert len(frames) < 12


# ------------------------------------------------------------------------ a real terminal


def _tmux(sock: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TMUX"}  # works inside a tmux session too
    return subprocess.run(["tmux", "-L", sock, *args], capture_output=True, text=True, timeout=10,
                          check=check, env=env)


def _wait_for(pred, timeout: float, step: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(step)
    return pred()


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (apt-get install tmux)")
@pytest.mark.parametrize("key", ["q", "C-c"])
def test_terminal_view_in_tmux(run_dir, tmp_path, key):
    sock = f"mindpulse-test-{uuid.uuid4().hex[:8]}"
    rc_file = tmp_path / "rc"
    stty_file = tmp_path / "stty"
    code = ("import sys; from pathlib import Path; from mindpulse.views.top import main_top; "
            "sys.exit(main_top(Path(sys.argv[1]), interval=0.2))")
    cmd = (f"cd {shlex.quote(str(ROOT))} && {shlex.quote(sys.executable)} -c {shlex.quote(code)} "
           f"{shlex.quote(str(run_dir))}; echo $? > {shlex.quote(str(rc_file))}; "
           f"stty -a > {shlex.quote(str(stty_file))}; sleep 30")
    _tmux(sock, "new-session", "-d", "-s", "top", "-x", "250", "-y", "50", cmd)
    try:
        def pane() -> str:
            return _tmux(sock, "capture-pane", "-p", "-t", "top", check=False).stdout

        screen = _wait_for(lambda: (lambda s: s if "cards (newest sample)" in s else "")(pane()), 15)
        assert screen, f"the table never showed up:\n{pane()}"
        assert "status running" in screen and "step 5" in screen
        rows = _rows(screen)
        assert rows["0"][2] == f"{_loss(0, 5):.4f}" and rows["1"][2] == f"{_loss(1, 5):.4f}"
        assert "q quits" in screen

        # the view follows the run
        _append(run_dir / "metrics.msgpack", b"".join(p.encode() for p in _packets(6, 6)))
        screen = _wait_for(lambda: (lambda s: s if "step 6" in s.splitlines()[0] else "")(pane()), 10)
        assert screen, f"the view did not advance:\n{pane()}"
        assert _rows(screen)["0"][1] == "6"

        _tmux(sock, "send-keys", "-t", "top", key)
        assert _wait_for(rc_file.exists, 5), f"top did not exit after {key}:\n{pane()}"
        assert _wait_for(lambda: rc_file.read_text().strip(), 2) == "0"
        # the terminal is back in canonical mode with echo
        stty = _wait_for(lambda: stty_file.exists() and stty_file.read_text(), 3)
        assert stty and "-icanon" not in stty.split() and "-echo" not in stty.split()
    finally:
        _tmux(sock, "kill-server", check=False)


def test_terminal_frame_fits_the_screen(run_dir):
    view = RunView(run_dir)
    view.refresh()
    lines = top._fit(view.render(), 40, 8)
    assert len(lines) == 8 and all(len(ln) <= 40 for ln in lines)
    assert lines[-1].startswith("...")


def test_a_damaged_record_is_skipped_counted_and_hides_nothing(run_dir):
    path = run_dir / "metrics.msgpack"
    view = RunView(run_dir)
    view.refresh()
    torn = _step(0, 6).encode()
    # a record torn by a crash, then the restarted aggregator's records
    _append(path, torn[:20] + b"".join(p.encode() for p in _packets(6, 7)))
    view.refresh()
    assert view.complete_step == 7
    assert view.tail.skipped_bytes == 20 and view.tail.errors == 1
    assert "damaged bytes skipped 20 (1 stretches)" in view.render().splitlines()[0]


def test_a_large_world_shows_the_ranks_that_matter_and_pages_through_all(tmp_path):
    world = 40
    d = tmp_path / "runs" / "big-20260101-000000"
    _write(d, _start(world) + _packets(1, 3, world=world))
    rc, text = _once(d)
    assert rc == 0
    rows = _rows(text)
    # the extremes (lowest loss rank 0, highest loss and grad norm rank 39) and a count of the rest
    assert "0" in rows and "39" in rows and "20" not in rows, text
    assert f"+{world - len([r for r in rows if r.isdigit()])}" in text and "n/p next/previous page" in text
    seen: set[int] = set()
    for page in (1, 2, 3):
        rc, text = _once(d, page=page)
        assert rc == 0 and f"page {page}/3" in text, text
        ranks = {int(r) for r in _rows(text) if r.isdigit()}
        assert ranks == set(range((page - 1) * 16, min(world, page * 16))), (page, sorted(ranks))
        assert all(_rows(text)[str(r)][2] == f"{_loss(r, 3):.4f}" for r in ranks)
        seen |= ranks
    assert seen == set(range(world)), "paging shows every rank once"
    rc, text = _once(d, page=9)  # past the end: the last page
    assert rc == 0 and "page 3/3" in text
    buf = io.StringIO()
    assert main_top(d, once=True, out=buf, page=0) == 2


def test_page_keys_move_through_the_ranks_and_back(tmp_path):
    world = 40
    d = tmp_path / "runs" / "big-20260101-000000"
    _write(d, _start(world) + _packets(1, 2, world=world))
    view = RunView(d)
    view.refresh()
    assert view.page is None and view.page_ranks(world) is None
    view.key("n")
    assert view.page_ranks(world) == range(0, 16)
    view.key("n")
    view.key("n")
    view.key("n")
    assert view.page_ranks(world) == range(32, 40), "the last page holds the rest and paging stops there"
    view.key("p")
    assert view.page_ranks(world) == range(16, 32)
    view.key("a")
    assert view.page is None
    view.key("p")
    assert view.page_ranks(world) == range(32, 40), "p from the overview goes to the last page"
