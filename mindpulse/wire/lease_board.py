"""The node's lease board: the newest lease in a small shared-memory file that the node
agent writes and its ranks read.

A rank takes the lease before every step. Reading it from the board is a few bytes out of
mapped memory: no socket, no system call, and nothing for the agent to send per rank and
step (the agent writes each new lease once, whatever the number of ranks). A rank talks
to the relay about leases only when the board's lease does not let it start its next step
(it then asks and blocks until the relay answers) and at its first lease (the answer names
the board).

Layout (little-endian): magic u32, sequence u64, body length u32, crc32 of the body u32,
then the body (an encoded `Lease`). The writer makes the sequence odd, writes length, crc
and body, then makes the sequence even. A reader keeps a body only when the sequence was
even and unchanged around its read and the crc matches: a torn read (a write in progress,
or stores seen out of order on a weakly ordered CPU) is read again, never used. Every body
on the board is a whole lease the aggregator sent, and leases only move forward, so a
reader that sees an older one is held back at worst (and then asks the relay).

The file lives in /dev/shm (memory, not disk) where there is one, else the system's
temporary directory; it is created private (0600: the ranks run as the agent's user) and
removed when the relay stops. A node agent killed outright (SIGKILL, OOM) cannot remove
its board, but the lock it held on it goes with its process: the next board made in that
folder removes this user's boards that nobody holds. Where it cannot be made or mapped,
leases go over the relay's socket as answers (one round trip a step; the run is
unchanged otherwise).
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import re
import stat
import struct
import tempfile
import time
import zlib

MAGIC = 0x424C504D  # "MPLB"
_HEAD = struct.Struct("<IQII")
_SEQ = struct.Struct("<Q")
_BODY_HEAD = struct.Struct("<II")
SIZE = 4096
MAX_BODY = SIZE - _HEAD.size
READ_TRIES = 64
"""Reads of a board caught mid-write before the reader gives up for now (the writer holds
it for a few microseconds; the rank then asks the relay)."""


PREFIX = "mindpulse-lease-"
_NAME = re.compile(re.escape(PREFIX) + r"[A-Za-z0-9_-]+$")
STALE_AFTER_S = 60.0
"""A board is swept only when older than this, besides unlocked (it is locked the moment
after it is made)."""


def board_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def sweep_stale(directory: str, now: float | None = None) -> list[str]:
    """Remove the boards in `directory` that no writer holds: the writer keeps an exclusive
    lock on its board for as long as it lives (the kernel drops it with the process,
    however it ends), so a board nobody has locked is one a killed agent left. Only this
    user's regular files older than STALE_AFTER_S. A lock works across pid namespaces
    (containers sharing /dev/shm), where a pid would not. Returns the paths removed; never
    raises."""
    removed: list[str] = []
    try:
        now = time.time() if now is None else now
        uid = os.getuid()
        for name in os.listdir(directory):
            if _NAME.match(name) is None:
                continue
            path = os.path.join(directory, name)
            try:
                st = os.lstat(path)
                if not stat.S_ISREG(st.st_mode) or st.st_uid != uid or now - st.st_mtime <= STALE_AFTER_S:
                    continue
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held: its agent is alive
                    os.unlink(path)
                    removed.append(path)
                finally:
                    os.close(fd)
            except OSError:
                continue
    except Exception:  # sweeping stale pages is best effort: the directory unreadable leaves them, nothing else
        pass
    return removed


class LeaseBoard:
    """The writer: the node agent's relay, one per node."""

    def __init__(self, directory: str | None = None):
        directory = directory or board_dir()
        sweep_stale(directory)
        fd, self.path = tempfile.mkstemp(prefix=f"{PREFIX}{os.getpid()}-", dir=directory)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held while this writer lives: not stale
            os.fchmod(fd, 0o600)
            # the page is taken now: on a full /dev/shm this raises OSError here, where a
            # sparse file would raise SIGBUS (killing the agent) at the first write through it
            try:
                os.posix_fallocate(fd, 0, SIZE)
            except (AttributeError, OSError) as exc:
                if isinstance(exc, OSError) and exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                os.pwrite(fd, bytes(SIZE), 0)  # a file system without fallocate: write the page
            self._mm = mmap.mmap(fd, SIZE)
        except BaseException:
            os.close(fd)
            os.unlink(self.path)
            raise
        self._fd = fd
        self._seq = 0
        _HEAD.pack_into(self._mm, 0, MAGIC, 0, 0, 0)  # no reader yet (nobody knows the path)

    def publish(self, body: bytes) -> None:
        if len(body) > MAX_BODY:
            raise ValueError(f"a {len(body)}-byte lease does not fit the board ({MAX_BODY} bytes)")
        # bytes are copied in, never packed in place: struct's pack_into zero-fills its
        # target before it writes, and a reader catching the zeros would see sequence 0 and
        # an empty body whose crc (0) matches
        mm = self._mm
        self._seq += 1  # odd: a write in progress (from even, only the lowest bit changes)
        mm[4:12] = _SEQ.pack(self._seq)
        mm[12:_HEAD.size] = _BODY_HEAD.pack(len(body), zlib.crc32(body))
        mm[_HEAD.size:_HEAD.size + len(body)] = body
        self._seq += 1
        mm[4:12] = _SEQ.pack(self._seq)

    def close(self) -> None:
        """Unmap and remove the file (readers that mapped it keep their view of the last lease)."""
        try:
            self._mm.close()
        finally:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            if self._fd >= 0:
                os.close(self._fd)  # the lock goes with it
                self._fd = -1


class LeaseView:
    """A reader: one rank's view of its node's board."""

    def __init__(self, path: str):
        fd = os.open(path, os.O_RDONLY)
        try:
            if os.fstat(fd).st_size < SIZE:
                raise ValueError(f"{path} is not a lease board (too short)")
            self._mm = mmap.mmap(fd, SIZE, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        if _HEAD.unpack_from(self._mm, 0)[0] != MAGIC:
            self._mm.close()
            raise ValueError(f"{path} is not a lease board")
        self._seen = 0
        self.torn = 0
        """Reads caught mid-write (read again)."""

    def read(self) -> bytes | None:
        """The lease written since the last read, or None (nothing new, or a write still
        in progress after READ_TRIES reads)."""
        mm = self._mm
        for _ in range(READ_TRIES):
            _, seq, n, crc = _HEAD.unpack_from(mm, 0)
            if seq == self._seen:
                return None
            if seq & 1 or seq == 0 or n > MAX_BODY:
                self.torn += 1
                continue
            body = mm[_HEAD.size:_HEAD.size + n]
            if _HEAD.unpack_from(mm, 0)[1] != seq or zlib.crc32(body) != crc:
                self.torn += 1
                continue
            self._seen = seq
            return body
        return None

    def close(self) -> None:
        self._mm.close()
