"""A parameter fingerprint that is equal on all ranks when their weights are equal.

Computed on the device with two reductions per parameter (sum and sum of squares, in
float32 on the device, then gathered into one small vector); only that vector — two
numbers per parameter — is copied to the host and hashed. In data parallel the
parameters are bit-identical across ranks, and the same reduction over identical data on
identical hardware is deterministic, so equal weights give equal fingerprints to the last
bit; any difference, however small, changes the hash.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
from mindspore import nn, ops
import mindspore as ms

from .train_cell import FAULT_PARAM_PREFIX


def model_parameters(network: nn.Cell) -> list:
    """The weights that define the model (trainable and not, e.g. norms' statistics),
    without optimizer state and without the fault-injection scalars."""
    out = []
    seen = set()
    for p in network.get_parameters():
        if p.name in seen or p.name.startswith(FAULT_PARAM_PREFIX):
            continue
        seen.add(p.name)
        out.append(p)
    return out


@ms.jit
def _sums(params):
    # compiled once: eagerly, two reductions per parameter cost two op dispatches each
    parts = []
    for p in params:
        x = ops.cast(p, ms.float32)
        parts.append(ops.reduce_sum(x))
        parts.append(ops.reduce_sum(x * x))
    return ops.stack(parts)


def param_sums(params) -> np.ndarray:
    """[sum, sum of squares] per parameter, reduced on the device, as one host vector."""
    if not params:
        return np.zeros(0, np.float32)
    return _sums(ms.mutable(tuple(p.value() for p in params))).asnumpy().astype(np.float32)


def fingerprint_of(vec: np.ndarray) -> tuple[str, float]:
    if vec.size == 0:
        return "0" * 16, 0.0
    digest = hashlib.blake2b(vec.tobytes(), digest_size=8).hexdigest()
    sq = float(np.sum(vec[1::2].astype(np.float64)))
    return digest, math.sqrt(sq) if sq >= 0 and math.isfinite(sq) else float("nan")


def param_fingerprint(params) -> tuple[str, float]:
    """(16-hex-digit hash, global L2 norm of the parameters)."""
    if not params:
        return "0" * 16, 0.0
    vec = param_sums(params)
    digest = hashlib.blake2b(vec.tobytes(), digest_size=8).hexdigest()
    sq = float(np.sum(vec[1::2].astype(np.float64)))
    return digest, math.sqrt(sq) if sq >= 0 and math.isfinite(sq) else float("nan")
