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


class _Held:
    """A block out of the pool and how many `HostCopy` holders still read it."""

    __slots__ = ("block", "holders")

    def __init__(self, block: np.ndarray):
        self.block = block
        self.holders = 1


class HostCopy:
    """One copy of a list of arrays: `arrays[i]` holds `views[i]`'s values as they were. A
    second holder of some of them (`part`) keeps the block out of the pool until both are
    released: a step that is both a collect step and rank 0's checkpoint candidate copies
    the weights once, for the candidate, and the statistics read the weights' part of it."""

    def __init__(self, pool: HostBlocks, held: _Held, arrays: list[np.ndarray]):
        self._pool = pool
        self._held: _Held | None = held
        self.arrays = arrays

    @property
    def released(self) -> bool:
        return self._held is None

    def part(self, indices: list[int]) -> HostCopy:
        """A holder of `arrays[i]` for each i in `indices`, in that order, released on its own."""
        if self._held is None:
            raise ValueError("a released copy has no part to hand out")
        self._pool.hold(self._held)
        return HostCopy(self._pool, self._held, [self.arrays[i] for i in indices])

    def release(self) -> None:
        """This holder is done (its arrays must not be read after this); the block goes back
        to the pool once every holder is."""
        held, self._held = self._held, None
        if held is not None:
            self.arrays = []
            self._pool.let_go(held)


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
        return HostCopy(self, _Held(block), arrays)

    def hold(self, held: _Held) -> None:
        with self._lock:
            held.holders += 1

    def let_go(self, held: _Held) -> None:
        with self._lock:  # holders let go from the training thread and the outbox's
            held.holders -= 1
            if held.holders == 0:
                self._free.append(held.block)

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
