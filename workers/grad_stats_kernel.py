"""The fused grad-statistics kernel (`grad_stats.cc`): built once per machine, loaded as a
MindSpore "aot" Custom op on CPU.

One call reads every gradient once, where it lies, and returns float32 [L2 norm, NaN count,
Inf count]; the counts cost a second read of a tensor only when its sum of squares is not
finite. It replaces, on CPU, the graph path of `train_cell.py` (a concatenation and a dot
product per group of gradients, and a branch for the counts) — see docs/monitoring.md for
the measurements.

The library is compiled with the machine's C++ compiler (`$CXX`, else `g++`, else `c++`)
into a cache directory (`$MINDPULSE_KERNEL_DIR`, else `$XDG_CACHE_HOME/mindpulse/kernels`,
else `~/.cache/mindpulse/kernels`), named by a hash of the source, the compiler and the
flags, so each machine (each node of a cluster) builds it once and a changed source builds
anew. The ranks of a node that start together take a file lock: one compiles, the others
load its result. Where there is no compiler, the build fails, the device is not a CPU, or
the library does not give the right answer on a known input, the cell uses its graph path
and says why once in the log: monitoring never stops because of this kernel.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("grad_stats.cc")
SYMBOL = "MindpulseGradStats"
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC")
"""No -ffast-math: it would let the compiler assume there is no NaN or Inf to find."""
FLOAT_DTYPES = ("Float32", "Float16", "BFloat16", "Float64")
"""MindSpore dtypes (`str(dtype)`) the kernel reads."""
COMPILE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class KernelBuild:
    """The outcome of building (or finding) the library: `path` when there is one, else
    `reason` says why not, in words a user can act on."""

    path: Path | None
    reason: str = ""


def cache_dir() -> Path:
    env = os.environ.get("MINDPULSE_KERNEL_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mindpulse" / "kernels"


def find_compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _compiler_identity(cxx: str) -> str:
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
        return out.stdout.splitlines()[0] if out.stdout else cxx
    except (OSError, subprocess.SubprocessError):
        return cxx


def build(source: Path = SOURCE, directory: Path | None = None) -> KernelBuild:
    """Compile `source` into the cache (or find it there). Never raises: a failure comes
    back as a `KernelBuild` without a path and with the reason."""
    cxx = find_compiler()
    if cxx is None:
        return KernelBuild(None, "no C++ compiler found (set CXX, or install g++)")
    try:
        text = source.read_bytes()
    except OSError as e:
        return KernelBuild(None, f"cannot read the kernel source {source}: {e}")
    key = hashlib.sha256(
        b"\0".join([text, _compiler_identity(cxx).encode(), " ".join(FLAGS).encode(), platform.machine().encode()])
    ).hexdigest()[:16]
    directory = directory or cache_dir()
    target = directory / f"grad_stats-{key}.so"
    if target.is_file():
        return KernelBuild(target)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with open(directory / f"grad_stats-{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # the node's other ranks wait for one build
            if target.is_file():
                return KernelBuild(target)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
            os.close(fd)
            try:
                out = subprocess.run([cxx, *FLAGS, "-o", tmp, str(source)], capture_output=True, text=True,
                                     timeout=COMPILE_TIMEOUT_S)
                if out.returncode != 0:
                    tail = (out.stderr or out.stdout).strip().splitlines()[-3:]
                    return KernelBuild(None, f"{cxx} failed on {source.name}: " + " | ".join(tail))
                os.replace(tmp, target)  # whole or not at all: a reader never sees half a library
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
    except (OSError, subprocess.SubprocessError) as e:
        return KernelBuild(None, f"cannot build the kernel in {directory}: {e}")
    return KernelBuild(target)


_lock = threading.Lock()
_made: tuple[object, str] | None = None
"""(the op or None, why it is None): made once per process."""


def fused_op_unavailable_reason() -> str:
    """Why `fused_grad_stats_op()` returned None in this process ('' when it did not)."""
    return _made[1] if _made is not None else ""


def fused_grad_stats_op():
    """The Custom op (one per process), or None where it cannot be used here (logged once,
    with the reason). Call with the gradients as positional inputs: `op(*grads)`."""
    global _made
    with _lock:
        if _made is None:
            _made = _make_op()
            if _made[0] is None:
                log.warning("the fused grad-statistics kernel is not used (%s): the cell computes the statistics "
                            "with MindSpore graph ops instead (same values; on CPU a few ms a step more on large "
                            "models)", _made[1])
        return _made[0]


def _make_op():
    import mindspore as ms
    import numpy as np
    from mindspore import ops

    target = ms.get_context("device_target")
    if target != "CPU":
        return None, f"the device is {target}: the kernel is built for the CPU"
    b = build()
    if b.path is None:
        return None, b.reason
    try:
        op = ops.Custom(f"{b.path}:{SYMBOL}", out_shape=lambda *shapes: (3,), out_dtype=lambda *types: ms.float32,
                        func_type="aot")
        # a known answer before it is trusted with a run's statistics: norm 13, one NaN, one Inf
        a = ms.Tensor(np.array([[3.0, 4.0], [12.0, 0.0]], np.float32))
        b16 = ms.Tensor(np.array([np.nan, np.inf, 1.0], np.float16))
        got = op(a).asnumpy().tolist()
        got_nan = op(a, b16).asnumpy().tolist()
    except Exception as e:  # noqa: BLE001 (any failure of a custom op means: use the graph path)
        return None, f"MindSpore could not run the kernel {b.path}: {type(e).__name__}: {e}"
    if got != [13.0, 0.0, 0.0] or not (np.isnan(got_nan[0]) and got_nan[1:] == [1.0, 1.0]):
        return None, f"the kernel {b.path} gave {got} / {got_nan} on a known input"
    return op, ""


def reads_dtypes(dtypes) -> bool:
    """Whether the kernel reads every one of these MindSpore dtypes."""
    return all(str(d) in FLOAT_DTYPES for d in dtypes)
