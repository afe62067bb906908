"""The pre-flight card check inside one rank (job.json `task: card_check`).

The rank joins MindSpore's cluster as for training (same variables, same `init()`, same
backend: mccl on CPU, HCCL on Ascend, NCCL on GPU), then:

1. multiplies float32 square matrices on its card for `preflight.matmul_seconds` after a
   warm-up, checks one block of the product against numpy, and reports the achieved
   GFLOP/s (2·n³ per product);
2. all-reduces (sum) a `preflight.allreduce_mb` MiB float32 buffer `preflight.allreduce_iters`
   times with every other rank, checks the sum, and reports the algorithm bandwidth
   (bytes / seconds per all-reduce, GB/s = 1e9 bytes/s) and the bus bandwidth
   (× 2(n-1)/n, as nccl-tests reports it).

The result goes to the aggregator as a `card_check` event after each part (JSON in the
event's message), so a rank that hangs in the all-reduce still leaves its matmul figure.
The ranks start each part together (a small all-reduce as a barrier), so ranks sharing a
host measure under the same contention. Judging slow or failed cards is the driver's
(launcher/card_check.py); the rank only measures. `slow_card@RANK` (workers/faults.py)
makes the rank repeat each product's work `SLOW_CARD_FACTOR` times: a real slowdown.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import time
from typing import Any

import numpy as np

from mindpulse.config import from_dict
from mindpulse.config.rank_settings import RankSettings
from mindpulse.wire.protocol import EventKind, EventPacket

from .faults import card_check_repeats
from .settings import rank_id

log = logging.getLogger(__name__)

DEFAULT_SIZE = {"CPU": 512, "Ascend": 4096, "GPU": 4096}
"""`preflight.matmul_size` 0: the side of the matrices per device target."""
CHUNK_S = 0.05
"""Products queued between two synchronisations (about this long of work)."""
MAX_REL_ERROR = 2e-2
"""Largest error of the checked block, relative to its largest entry (Ascend may compute
float32 products in reduced precision: a wrong card is far off, not 1e-3 off)."""
CHECK_ROWS = 8
BACKENDS = {"CPU": "mccl", "Ascend": "hccl", "GPU": "nccl"}


def _sync(t: Any) -> None:
    """Wait for everything queued before `t` (PYNATIVE queues ops asynchronously; one
    element back to the host waits for the stream without copying the whole tensor)."""
    t.reshape(-1)[0:1].asnumpy()


def matmul_benchmark(n: int, seconds: float, repeats: int = 1, barrier: Any = None) -> dict[str, Any]:
    """Float32 n×n products on this process's device for `seconds` after a warm-up;
    `repeats` > 1 does each product's work that many times (the slow_card fault)."""
    import mindspore as ms
    from mindspore import ops

    rng = np.random.default_rng(20261201 + n)
    a_np = rng.uniform(-1.0, 1.0, (n, n)).astype(np.float32)
    b_np = rng.uniform(-1.0, 1.0, (n, n)).astype(np.float32)
    a, b = ms.Tensor(a_np), ms.Tensor(b_np)
    c = ops.matmul(a, b)
    rows = min(CHECK_ROWS, n)
    got = c[:rows].asnumpy().astype(np.float64)
    ref = a_np[:rows].astype(np.float64) @ b_np.astype(np.float64)
    rel_error = float(np.max(np.abs(got - ref)) / max(float(np.max(np.abs(ref))), 1e-30))
    t = time.perf_counter()
    for _ in range(2):  # warm-up (kernel selection, allocation); also times one product
        c = ops.matmul(a, b)
    _sync(c)
    one = max((time.perf_counter() - t) / 2, 1e-6)
    chunk = max(1, min(64, int(CHUNK_S / one)))
    if barrier is not None:
        barrier()
    count = 0
    gflop = 2.0 * n ** 3 / 1e9  # one product
    rates: list[float] = []
    t0 = last = time.perf_counter()
    while True:
        for _ in range(chunk):
            for _ in range(repeats):
                c = ops.matmul(a, b)
            count += 1
        _sync(c)
        now = time.perf_counter()
        rates.append(gflop * chunk / max(now - last, 1e-9))
        last = now
        elapsed = now - t0
        if elapsed >= seconds:
            break
    # the median over the ~50 ms chunks: a card that is slow is slow in every chunk (the
    # slow_card fault too), while a rank that a shared host preempted for part of the window
    # is not called slow for it (the window's mean, kept as matmul_gflops_window, is)
    rates.sort()
    return {"matmul_size": n, "matmul_count": count, "matmul_s": elapsed,
            "matmul_gflops": rates[len(rates) // 2], "matmul_gflops_window": gflop * count / elapsed,
            "matmul_chunks": len(rates), "matmul_rel_error": rel_error, "matmul_ok": rel_error <= MAX_REL_ERROR}


def allreduce_benchmark(mib: float, iters: int, rank: int, size: int, barrier: Any = None) -> dict[str, Any]:
    """`iters` all-reduces (sum) of a float32 buffer of `mib` MiB over the world's group.
    Every rank must call it with the same arguments (a collective)."""
    import mindspore as ms
    from mindspore import ops

    n = max(1, int(mib * (1 << 20)) // 4)
    x = ms.Tensor(np.full((n,), float(rank + 1), np.float32))
    allreduce = ops.AllReduce(ops.ReduceOp.SUM)
    y = allreduce(x)  # warm-up: the connection, the buffers
    expect = size * (size + 1) / 2.0
    head = y[0:4].asnumpy()
    ok = bool(np.all(head == expect)) and float(y[n - 1:n].asnumpy()[0]) == expect
    y = allreduce(x)
    _sync(y)
    if barrier is not None:
        barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        y = allreduce(x)
    _sync(y)
    elapsed = time.perf_counter() - t0
    nbytes = 4 * n
    algbw = nbytes * iters / elapsed / 1e9
    return {"allreduce_bytes": nbytes, "allreduce_iters": iters, "allreduce_s": elapsed, "allreduce_gbps": algbw,
            "allreduce_busbw_gbps": algbw * (2.0 * (size - 1) / size if size > 1 else 1.0),
            "allreduce_ok": ok}


def _barrier() -> None:
    import mindspore as ms
    from mindspore import ops

    _sync(ops.AllReduce(ops.ReduceOp.SUM)(ms.Tensor(np.ones((1,), np.float32))))


class _Reporter:
    """Sends the rank's result as a `card_check` event through its channel (no channel
    outside a launch: the result is only logged)."""

    def __init__(self, settings: RankSettings, rank: int):
        from .channel import connect

        self.rank = rank
        self.channel = connect(settings, rank) if settings.relays or settings.aggregator else None

    def send(self, result: dict[str, Any]) -> None:
        if self.channel is None:
            return
        pkt = EventPacket(rank=self.rank, kind=EventKind.CARD_CHECK.value, ts=time.time(), pid=os.getpid(),
                          host=socket.gethostname(), message=json.dumps(result, allow_nan=False, default=str))
        self.channel.send(pkt.encode())
        self.channel.flush()

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()


def _finite(result: dict[str, Any]) -> dict[str, Any]:
    """JSON has no NaN: a non-finite figure travels as None (the driver fails the rank)."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in result.items()}


def main(settings: RankSettings) -> dict[str, Any]:
    """Run the check in this rank; returns (and reports) its result. Raises when the
    cluster cannot be joined or a collective fails: the rank then exits non-zero."""
    import mindspore as ms
    from mindspore.communication import get_group_size, get_rank, init

    pf = from_dict(settings.config, source="job.json config").preflight
    target = settings.device_target
    rank = rank_id()
    result: dict[str, Any] = {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(),
                              "device_target": target, "device_id": os.environ.get("DEVICE_ID", ""),
                              "phase": "start", "errors": []}
    reporter = _Reporter(settings, rank)
    try:
        ms.set_context(mode=ms.PYNATIVE_MODE, device_target=target)
        init()
        rank, size = get_rank(), get_group_size()
        from mindspore.communication.management import GlobalComm

        backend = getattr(GlobalComm, "BACKEND", "") if target != "CPU" else BACKENDS["CPU"]
        result.update(rank=rank, world_size=size, backend=str(getattr(backend, "value", backend))
                      or BACKENDS.get(target, ""))
        repeats = card_check_repeats(rank)
        result["matmul_repeats"] = repeats
        _barrier()
        result.update(matmul_benchmark(pf.matmul_size or DEFAULT_SIZE.get(target, 512), pf.matmul_seconds,
                                       repeats=repeats, barrier=_barrier))
        if not result["matmul_ok"]:
            result["errors"].append(f"matmul product wrong: largest relative error {result['matmul_rel_error']:.3g} "
                                    f"(allowed {MAX_REL_ERROR:g})")
        result["phase"] = "matmul"
        reporter.send(_finite(result))
        slowed = f", each product's work x{repeats} (slow_card)" if repeats > 1 else ""
        print(f"[rank {rank}] card check: matmul {result['matmul_size']}x{result['matmul_size']} float32 "
              f"{result['matmul_gflops']:.1f} GFLOP/s, median of {result['matmul_chunks']} chunks "
              f"({result['matmul_count']} products in {result['matmul_s']:.2f} s: "
              f"{result['matmul_gflops_window']:.1f} GFLOP/s over the window{slowed})", flush=True)
        result.update(allreduce_benchmark(pf.allreduce_mb, pf.allreduce_iters, rank, size, barrier=_barrier))
        if not result["allreduce_ok"]:
            result["errors"].append(f"all-reduce sum wrong: expected {size * (size + 1) / 2:g} in every element")
        result["phase"] = "done"
        print(f"[rank {rank}] card check: all-reduce {result['allreduce_bytes'] / (1 << 20):g} MiB over "
              f"{result['backend']} x{result['allreduce_iters']}: {result['allreduce_gbps']:.3f} GB/s "
              f"(bus {result['allreduce_busbw_gbps']:.3f} GB/s)", flush=True)
        reporter.send(_finite(result))
    except Exception as exc:
        result["errors"].append(f"{type(exc).__name__}: {exc}"[:500])
        reporter.send(_finite(result))
        raise
    finally:
        reporter.close()
    return result
