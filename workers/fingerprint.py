"""A parameter fingerprint that is equal on all ranks when their weights are equal.

Two numbers per parameter, its sum and its sum of squares in float32, gathered into one
small vector that is hashed. In data parallel the parameters are bit-identical across
ranks, and the same reduction over identical data on identical hardware is
deterministic, so equal weights give equal fingerprints to the last bit; a difference
that moves any parameter's float32 sum or sum of squares changes the hash.

Where the reductions run:

- on a CPU target the weights already live in host memory (`Tensor.asnumpy()` shares
  their storage), so numpy reduces them in place: pairwise summation, single-threaded,
  fixed by the array's length alone (never by its address or a thread count), about 2 ms
  for 2.75 M values here against 30 ms for the same reductions as MindSpore CPU kernels;
- on a device (Ascend, GPU) they stay there: one compiled graph of two reductions per
  parameter, and only the small vector is copied to the host.

Every rank of a job has the same device target, so every rank takes the same path.
"""

from __future__ import annotations

import hashlib
import math
import threading

import mindspore as ms
import numpy as np
from mindspore import ops

from .model_params import model_parameters

__all__ = ["model_parameters", "param_sums", "fingerprint_of", "param_fingerprint", "weights_on_host", "HostViews"]

HOST_DTYPES = (ms.float16, ms.float32, ms.float64)


@ms.jit
def _sums(params):
    # compiled once: eagerly, two reductions per parameter cost two op dispatches each
    parts = []
    for p in params:
        x = ops.cast(p, ms.float32)
        parts.append(ops.reduce_sum(x))
        parts.append(ops.reduce_sum(x * x))
    return ops.stack(parts)


def weights_on_host(params) -> bool:
    """Whether `params` are read on the host: a CPU target (their memory is the host's)
    and float weights numpy holds as they are."""
    try:
        if ms.get_context("device_target") != "CPU":
            return False
        return all(p.dtype in HOST_DTYPES for p in params)
    except Exception:  # anything unexpected: not on the host, read through MindSpore instead
        return False


def host_array(p) -> np.ndarray:
    """A CPU parameter's values as a flat numpy view of its storage (no copy)."""
    return p.asnumpy().reshape(-1)


class HostViews:
    """Flat numpy views of CPU parameters' storage (`host_array`), each kept while its
    parameter's storage stays where it was (checked by address and size at every read), so
    that `asnumpy()` runs once per parameter, not at every collect step. Why: `asnumpy()`
    builds its array through the buffer protocol, and numpy parses the buffer's format in
    Python (~20-60 us a parameter here; three reads a collect step of 21 parameters cost
    ~1.2 ms of the rank's step). A parameter given new storage (`set_data`, a checkpoint
    loaded in place of it) is read anew. Kept by the objects that hold the parameters, so a
    view never outlives them. Reading a view after the step's outputs were read shows the
    step's updated weights (checked in PYNATIVE and GRAPH mode)."""

    def __init__(self, params):
        self.params = list(params)
        self._kept: list[tuple[int, int, np.ndarray] | None] = [None] * len(self.params)

    def __getitem__(self, i: int) -> np.ndarray:
        p = self.params[i]
        try:
            addr, size = p.data_ptr(), p.size
        except Exception:  # no device pointer for this tensor: read it through MindSpore
            return host_array(p)
        kept = self._kept[i]
        if kept is not None and kept[0] == addr and kept[1] == size:
            return kept[2]
        view = host_array(p)
        # kept only where it is the parameter's own storage (not a copy)
        self._kept[i] = (addr, size, view) if view.size == size and view.ctypes.data == addr else None
        return view


CHUNK = 1 << 18
"""Values squared at a time into one reused buffer (no temporary the size of a parameter)."""
_local = threading.local()
"""Each thread's own buffer: the training thread and the rank's outbox may both reduce."""


def square_sum(x: np.ndarray, minus: np.ndarray | None = None) -> float:
    """Sum of squares of the float32 vector `x` (of `x - minus` when given), chunk by chunk
    through a reused buffer: each chunk summed pairwise in float32, the chunks' sums added
    in float64; fixed by the values and the length alone."""
    _buffer = getattr(_local, "buffer", None)
    if _buffer is None:
        _buffer = _local.buffer = np.empty(CHUNK, np.float32)
    total = 0.0
    for a in range(0, x.size, CHUNK):
        b = min(a + CHUNK, x.size)
        buf = _buffer[: b - a]
        if minus is None:
            np.multiply(x[a:b], x[a:b], out=buf)
        else:
            np.subtract(x[a:b], minus[a:b], out=buf)
            np.multiply(buf, buf, out=buf)
        total += float(np.add.reduce(buf))
    return total


def _host_sums(params, views: HostViews | None = None) -> np.ndarray:
    out = np.empty(2 * len(params), np.float32)
    for i, p in enumerate(params):
        x = views[i] if views is not None else host_array(p)
        if x.dtype != np.float32:
            x = x.astype(np.float32)
        out[2 * i] = np.add.reduce(x)
        out[2 * i + 1] = square_sum(x)
    return out


def param_sums(params, on_host: bool | None = None, views: HostViews | None = None) -> np.ndarray:
    """[sum, sum of squares] per parameter (float32) as one host vector; `on_host`: reduce
    on the host (None: where the weights live, `weights_on_host`); `views`: the kept host
    views of these same parameters (`HostViews(params)`), for a caller that reads them often."""
    if not params:
        return np.zeros(0, np.float32)
    if on_host is None:
        on_host = weights_on_host(params)
    if on_host:
        return _host_sums(params, views)
    return _sums(ms.mutable(tuple(p.value() for p in params))).asnumpy().astype(np.float32)


def fingerprint_of(vec: np.ndarray) -> tuple[str, float]:
    if vec.size == 0:
        return "0" * 16, 0.0
    digest = hashlib.blake2b(vec.tobytes(), digest_size=8).hexdigest()
    sq = float(np.sum(vec[1::2].astype(np.float64)))
    return digest, math.sqrt(sq) if sq >= 0 and math.isfinite(sq) else float("nan")


def param_fingerprint(params) -> tuple[str, float]:
    """(16-hex-digit hash, global L2 norm of the parameters)."""
    return fingerprint_of(param_sums(params))
