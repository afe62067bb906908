"""The node's lease board (shared memory written by the agent, read by its ranks) and the
frame reader the relay and the ranks split their streams with."""

from __future__ import annotations

import multiprocessing as mp
import os
import struct
import subprocess
import sys
import time

import pytest

from mindpulse.wire.directives import Lease
from mindpulse.wire.frames import FrameReader, encode_frame
from mindpulse.wire.lease_board import PREFIX, SIZE, STALE_AFTER_S, LeaseBoard, LeaseView


def test_a_reader_sees_each_new_lease_once_and_nothing_in_between(tmp_path):
    board = LeaseBoard(str(tmp_path))
    view = LeaseView(board.path)
    assert view.read() is None, "a fresh board holds no lease"
    board.publish(Lease(reduced_through=3).encode())
    assert Lease.decode(view.read()).reduced_through == 3
    assert view.read() is None, "nothing new since the last read"
    board.publish(Lease(reduced_through=4, stop_after=5, reason="nan").encode())
    lease = Lease.decode(view.read())
    assert (lease.reduced_through, lease.stop_after, lease.reason) == (4, 5, "nan")
    assert oct(os.stat(board.path).st_mode & 0o777) == "0o600", "the board is private to the run's user"
    view.close()
    board.close()
    assert not os.path.exists(board.path), "the board is removed when the relay stops"


def test_a_new_board_removes_the_boards_of_agents_killed_outright(tmp_path):
    """An agent killed with SIGKILL leaves its board behind, unlocked: the next board made
    in that folder removes it, and nothing that is still held, young, or not a board."""
    old = time.time() - STALE_AFTER_S - 60

    def board_file(name: str, mtime: float) -> str:
        path = str(tmp_path / name)
        with open(path, "wb") as fh:
            fh.write(bytes(SIZE))
        os.utime(path, (mtime, mtime))
        return path

    # a board whose writer died: written by a process that is gone (its lock went with it)
    child = subprocess.run([sys.executable, "-c", "import sys; from mindpulse.wire.lease_board import LeaseBoard; "
                            "b = LeaseBoard(sys.argv[1]); print(b.path)", str(tmp_path)],
                           capture_output=True, text=True, check=True)
    stale = child.stdout.strip()
    os.utime(stale, (old, old))
    held = LeaseBoard(str(tmp_path))  # a live writer's, old as it may be
    os.utime(held.path, (old, old))
    young = board_file(f"{PREFIX}12345-young1", time.time())
    other = board_file("not-a-lease-board", old)
    board = LeaseBoard(str(tmp_path))
    assert not os.path.exists(stale), f"the board of a dead agent is removed: {sorted(os.listdir(tmp_path))}"
    assert all(os.path.exists(p) for p in (held.path, young, other, board.path)), sorted(os.listdir(tmp_path))
    assert os.path.basename(board.path).startswith(f"{PREFIX}{os.getpid()}-"), board.path
    held.close()
    board.close()


def test_a_torn_or_foreign_board_is_never_used(tmp_path):
    board = LeaseBoard(str(tmp_path))
    board.publish(Lease(reduced_through=7).encode())
    view = LeaseView(board.path)
    with open(board.path, "r+b") as fh:  # a body that does not match its checksum
        fh.seek(20)
        fh.write(b"\xff")
        fh.seek(4)
        fh.write(struct.pack("<Q", 10))
    assert view.read() is None and view.torn > 0
    with open(board.path, "r+b") as fh:  # a write in progress (odd sequence)
        fh.seek(4)
        fh.write(struct.pack("<Q", 11))
    assert view.read() is None
    board.publish(Lease(reduced_through=8).encode())  # the writer's next lease is read whole
    assert Lease.decode(view.read()).reduced_through == 8
    (tmp_path / "other").write_bytes(b"\0" * SIZE)
    with pytest.raises(ValueError, match="not a lease board"):
        LeaseView(str(tmp_path / "other"))
    (tmp_path / "short").write_bytes(b"x")
    with pytest.raises(ValueError, match="too short"):
        LeaseView(str(tmp_path / "short"))
    with pytest.raises(ValueError, match="does not fit"):
        board.publish(b"x" * SIZE)
    view.close()
    board.close()


def _write_many(folder: str, out: mp.Queue, done: mp.Queue, n: int) -> None:
    board = LeaseBoard(folder)
    out.put(board.path)
    for i in range(1, n + 1):
        board.publish(Lease(reduced_through=i, reason="x" * (i % 50)).encode())
    done.get(timeout=60)  # the reader is done
    board.close()


def test_a_reader_racing_a_writer_in_another_process_only_sees_whole_leases_in_order(tmp_path):
    import time

    ctx = mp.get_context("fork")
    out, done = ctx.Queue(), ctx.Queue()
    n = 20000
    writer = ctx.Process(target=_write_many, args=(str(tmp_path), out, done, n))
    writer.start()
    view = LeaseView(out.get(timeout=30))
    deadline = time.time() + 30
    last, seen = 0, 0
    while last < n and time.time() < deadline:
        raw = view.read()
        if raw is None:
            continue
        lease = Lease.decode(raw)  # raises on a torn body
        assert lease.reduced_through > last and lease.reason == "x" * (lease.reduced_through % 50)
        last, seen = lease.reduced_through, seen + 1
    done.put("done")
    writer.join(10)
    assert last == n and seen > 1, (last, seen)
    view.close()


def test_frame_reader_splits_a_stream_however_it_is_cut():
    frames = [encode_frame({"op": "send", "i": i, "pad": "y" * i}) for i in range(40)]
    stream = b"".join(frames)
    for cut in (1, 3, 7, 64, len(stream)):
        reader, got = FrameReader(), []
        for i in range(0, len(stream), cut):
            got += reader.feed(stream[i:i + cut])
        assert got == [f[4:] for f in frames] and not reader.buf, cut
    with pytest.raises(ValueError, match="limit"):
        FrameReader(limit=10).feed(encode_frame({"pad": "z" * 20}))
