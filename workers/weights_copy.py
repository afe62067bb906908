"""Rank 0's copy of a checkpoint candidate's weights, so that it need not wait for the verdict.

A best checkpoint holds the weights of the step whose reduced metric was best, and only the
aggregator knows which step that is, once every rank's packet of the step is in. Rank 0 used
to block after each candidate step until the verdict came back (a round trip through the
relay and the aggregator), because the next step would change the weights. Instead it now
copies what a checkpoint holds (the train cell's parameters: the weights and the optimizer's
state, as `CheckpointManager` saves them) into host buffers at the candidate step, trains on,
and writes the copy if and when the verdict asks for it.

The copy goes into a block of the process's pool (workers/host_copies.py: allocated and touched
once, off the training thread, then refilled in place at each candidate) from views of the
parameters' storage kept between candidates (`HostViews`: on a CPU target `asnumpy()` is a
view, but building it costs tens of microseconds a parameter),
and a copy is only ever waited on by the next candidate, ~`checkpoint.best_every_steps` steps
later, by which time its verdict came long ago. Where a parameter cannot be copied to the
host (a dtype numpy lacks), `take` raises and the session falls back to waiting.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .fingerprint import HostViews
from .host_copies import MAX_COPY_BYTES, SHARED_BLOCKS, HostCopy, copy_bytes
from .model_params import is_model_param

# MAX_COPY_BYTES (workers/host_copies.py): above it a candidate waits for its verdict instead of
# copying. The wait is a round trip (a few ms); a copy costs host memory the size of the weights
# and the optimizer's state, and time that grows with it: a model of a few billion parameters
# would hold tens of GB on the host and spend seconds copying. 256 MiB copies in ~0.1 s or less.


def saved_bytes(train_cell: Any) -> int:
    """What a copy of `train_cell`'s saved parameters would hold, from their shapes and dtypes
    (nothing is copied or allocated)."""
    seen: set[str] = set()
    total = 0
    for _, p in train_cell.parameters_and_names():
        if not is_model_param(p.name) or p.name in seen:
            continue
        seen.add(p.name)
        total += int(np.prod(p.shape, dtype=np.int64)) * int(p.itemsize)
    return total


class CopyOrWait:
    """Rank 0's choice at each candidate: copy the weights and train on, or wait for the
    verdict, whichever costs the training thread less. Weights above `MAX_COPY_BYTES` always
    wait; below, the first candidate copies and the next waits, each measured, and the
    cheaper way is taken from then on (its measure updated each time it runs)."""

    def __init__(self, max_bytes: int = MAX_COPY_BYTES) -> None:
        self.max_bytes = max_bytes
        self.copy_s: float | None = None
        self.wait_s: float | None = None
        self._bytes: dict[int, int] = {}

    def copies(self, train_cell: Any) -> bool:
        key = id(train_cell)
        if key not in self._bytes:
            self._bytes[key] = saved_bytes(train_cell)
        if self._bytes[key] > self.max_bytes:
            return False
        if self.copy_s is None:
            return True  # measure the copy first: on small weights it is the cheaper way
        if self.wait_s is None:
            return False  # then one wait, to compare
        return self.copy_s <= self.wait_s

    def copied(self, seconds: float) -> None:
        self.copy_s = seconds

    def waited(self, seconds: float) -> None:
        self.wait_s = seconds


class WeightsCopy:
    """Rank 0's copy of one train cell's saved parameters, in a block of the process's pool
    (workers/host_copies.py), refilled at each candidate."""

    def __init__(self) -> None:
        self._cell: Any = None
        self._params: list[tuple[str, Any]] = []
        self._views: HostViews = HostViews([])
        self._at: dict[str, int] = {}
        """A parameter's name → its place in `_params` (and in the copy's arrays)."""
        self._copy: HostCopy | None = None
        self.step: int | None = None
        """The step the copy holds (None: nothing copied yet)."""

    def take(self, train_cell: Any, step: int) -> None:
        """Copy `train_cell`'s parameters as they are now (after `step`'s update)."""
        if train_cell is not self._cell:
            self._list(train_cell)
        views = [self._views[i] for i in range(len(self._params))]  # kept views on a CPU target, else host copies
        if self._copy is not None:  # the last candidate's verdict was taken before this one
            self._copy.release()
            self._copy = None
        self.step = None
        self._copy = SHARED_BLOCKS.copy(views)
        self.step = step

    def part_for(self, params: list[Any]) -> HostCopy | None:
        """A second holder of the copied arrays of `params` (Parameters of the copied cell, by
        name), in their order (workers/host_copies.py `HostCopy.part`); None without a copy or
        when one of them is not in it."""
        if self._copy is None:
            return None
        at, listed = self._at, self._params
        idx = [at.get(p.name, -1) for p in params]
        if -1 in idx or any(listed[i][1] is not p for i, p in zip(idx, params, strict=True)):
            return None  # not the same Parameters (two of one name): the statistics copy their own
        return self._copy.part(idx)

    def nbytes_needed(self, train_cell: Any) -> int:
        """The block a copy of `train_cell` takes (for `SHARED_BLOCKS.reserve`)."""
        if train_cell is not self._cell:
            self._list(train_cell)
        return copy_bytes([self._views[i] for i in range(len(self._params))])

    def _list(self, train_cell: Any) -> None:
        params = [(name, p) for name, p in train_cell.parameters_and_names() if is_model_param(p.name)]
        seen: set[str] = set()
        self._params = []
        for _, p in params:
            if p.name in seen:  # shared parameters are saved once
                continue
            seen.add(p.name)
            self._params.append((p.name, p))
        self._views = HostViews([p for _, p in self._params])
        self._at = {name: i for i, (name, _) in enumerate(self._params)}
        self._cell = train_cell
        self.step = None

    def save_list(self) -> list[dict[str, Any]]:
        """What `mindspore.save_checkpoint` takes in place of the train cell: the copied
        parameters by name."""
        from mindspore import Tensor

        assert self._copy is not None, "no weights copied"
        # the tensors share the block (no second copy of the weights): it is not written
        # again before the next candidate, and the checkpoint is written before then
        return [{"name": name, "data": Tensor.from_numpy(buf.reshape(p.shape))}
                for (name, p), buf in zip(self._params, self._copy.arrays, strict=True)]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._copy.arrays) if self._copy is not None else 0
