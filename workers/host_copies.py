"""Copies of a CPU target's weights in reused host blocks, for work done after the step.

On a CPU target a collect step's statistics (the fingerprint's sums, the per-layer norms,
the update ratios, the histograms) read every weight several times: ~2 ms of numpy for
2.75 M values here, and more on a loaded machine, all of it on the training thread, which
could not go on before it was done because the next step changes the weights in place.
One copy (one pass of memcpy, about half the cost of the fingerprint's sums alone) lets the
training thread go on at once while the rank's outbox thread (workers/outbox.py) computes
the statistics from the copy. The copy of the step before a collect step (the update
ratio's) lives in the same kind of block.

Blocks are kept and reused, in one pool for the process (`SHARED_BLOCKS`): a fresh block pays
its page faults at its first copy, and here that cost ~25 ms for 11 MB against ~2 ms for the
copy into a block already used. A block goes back to the pool when the work that read it is
done (`HostCopy.release`); at most a few are ever out at once (a collect step's copy and the
step before's while the outbox works on them, rank 0's copy of a checkpoint candidate). The
session has the outbox thread make and touch the blocks it will need when training starts
(`reserve`), so that no step pays the page faults.
"""

from __future__ import annotations

import threading

import numpy as np

ALIGN = 8
"""Each array in a block starts at a multiple of this many bytes."""
PAGE = 4096
MAX_COPY_BYTES = 256 * 2**20
"""Above this the weights are not copied: a collect step measures them in place on the training
thread, and rank 0 waits for a checkpoint candidate's verdict (host memory the size of the
weights, and a copy whose time grows with them, against a few milliseconds of waiting)."""


def _room(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def copy_bytes(views: list[np.ndarray]) -> int:
    """The block size a copy of `views` takes."""
    return sum(_room(v.nbytes) for v in views)


class HostCopy:
    """One copy of a list of arrays: `arrays[i]` holds `views[i]`'s values as they were."""

    def __init__(self, pool: HostBlocks, block: np.ndarray, arrays: list[np.ndarray]):
        self._pool = pool
        self._block: np.ndarray | None = block
        self.arrays = arrays

    @property
    def released(self) -> bool:
        return self._block is None

    def release(self) -> None:
        """Hand the block back (the arrays must not be read after this)."""
        if self._block is not None:
            self._pool.give_back(self._block)
            self._block = None
            self.arrays = []


class HostBlocks:
    """A pool of host blocks, each one copy of a set of arrays."""

    def __init__(self) -> None:
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()  # blocks go back from the outbox thread

    def copy(self, views: list[np.ndarray]) -> HostCopy:
        """Copy `views` (flat numpy arrays) into a block of the pool."""
        room = [_room(v.nbytes) for v in views]
        need = sum(room)
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.nbytes >= need]
            # by place, never `list.remove`: it compares arrays with ==, value by value
            block = self._free.pop(min(fits, key=lambda i: self._free[i].nbytes)) if fits else None
        if block is None:  # the first copy, or the weights grew
            block = np.empty(max(need, ALIGN), np.uint8)
        arrays, at = [], 0
        for v, n in zip(views, room, strict=True):
            kept = block[at:at + v.nbytes].view(v.dtype)
            np.copyto(kept, v)
            arrays.append(kept)
            at += n
        return HostCopy(self, block, arrays)

    def give_back(self, block: np.ndarray) -> None:
        with self._lock:
            self._free.append(block)

    def reserve(self, need: int, count: int) -> None:
        """Have `count` free blocks of at least `need` bytes, their pages touched (a block's
        first write pays its page faults: done here, off the training thread)."""
        with self._lock:
            have = sum(1 for b in self._free if b.nbytes >= need)
        for _ in range(max(0, count - have)):
            block = np.empty(max(need, ALIGN), np.uint8)
            block[::PAGE] = 0
            self.give_back(block)


SHARED_BLOCKS = HostBlocks()
"""The process's pool: every Monitor of a process (a script's several `Model.train` calls, a
benchmark's many runs) reuses the same blocks."""
