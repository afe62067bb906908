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

import mindspore as ms
import numpy as np
from mindspore import ops

from .model_params import model_parameters

__all__ = ["model_parameters", "param_sums", "fingerprint_of", "param_fingerprint"]


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
    return fingerprint_of(param_sums(params))
