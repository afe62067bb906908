"""Memory of the aggregator over a long run: 100,000 steps of 8 ranks, in one process.

Drives `AggregatorCore` directly (what the Ray actor wraps) with real encoded packets in
node batches of 8, one decision packet per rank and step, a fingerprint every 10 steps,
the default config's settings. The resident set size (RSS) of the process is sampled
along the way; the aggregator must plateau (bounded histories), not grow with the step
count. `metrics.msgpack` and the TensorBoard events grow on disk by design (every packet
is kept there); their sizes are reported too.

Usage: .venv/bin/python bench/memory.py [--steps 100000] [--world 8] [--tensorboard on|off] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import shutil
import sys
import tempfile
import time
from pathlib import Path

import _common as C
import msgpack
import psutil


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--samples", type=int, default=20, help="RSS samples along the run")
    ap.add_argument("--tensorboard", choices=["on", "off"], default="on")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    t0 = time.time()

    from mindpulse.aggregator.core import AggregatorCore
    from mindpulse.wire.directives import Directive
    from mindpulse.wire.protocol import StepPacket

    settings = C.aggregator_settings(f"output.tensorboard={str(args.tensorboard == 'on').lower()}")
    tmp = Path(tempfile.mkdtemp(prefix="mindpulse-bench-memory-"))
    proc = psutil.Process()
    core = AggregatorCore(tmp / "run", args.world, 10, args.steps, settings)

    # one wire template per rank; each packet is re-packed with its step's values
    tmpl = [StepPacket(rank=r, step=1, epoch=1, loss=2.0, lr=1e-3, grad_norm=0.5, grad_norm_local=0.45,
                       step_time_s=0.1, data_wait_s=0.001, samples=8, ts=0.0, decision=True).to_wire()
            for r in range(args.world)]
    pack = msgpack.Packer(use_bin_type=True).pack

    def batch(step: int) -> list[list[bytes]]:
        now = time.time()
        out = []
        for r, w in enumerate(tmpl):
            w["step"], w["ts"] = step, now
            w["loss"] = 2.0 + 0.01 * (r % 7) + 0.5 / (1 + step / 1000)
            fp = step % 10 == 0
            w["fingerprint"], w["param_norm"] = ("8a1c90e2f3b4", 41.5) if fp else (None, None)
            out.append(pack(w))
        return [out[i:i + 8] for i in range(0, len(out), 8)]

    every = max(1, args.steps // args.samples)
    samples = []
    gc.collect()
    rss0 = proc.memory_info().rss
    samples.append({"step": 0, "rss_mb": rss0 / 2**20, "t": 0.0})
    t_run = time.perf_counter()
    for s in range(1, args.steps + 1):
        for b in batch(s):
            core.ingest(b)
        d = core.directive_for(s)
        if d is None:
            raise RuntimeError(f"step {s} was not reduced")
        Directive.decode(d.encode())  # what decide() does for each call
        if s % 1000 == 0:
            core.drain_console()  # the driver polls the console (launch does every second)
        if s % every == 0:
            samples.append({"step": s, "rss_mb": proc.memory_info().rss / 2**20,
                            "t": time.perf_counter() - t_run})
            print(f"[memory] step {s}: RSS {samples[-1]['rss_mb']:.1f} MiB ({samples[-1]['t']:.0f}s)",
                  file=sys.stderr, flush=True)
    run_s = time.perf_counter() - t_run
    sizes = {
        "directives": len(core.directives), "recent": len(core.recent), "console": len(core.console),
        "pending_steps": len(core.reducer._pending), "reduced_ring": len(core.reducer._ring),
        "anomalies": core.anomalies.count,
    }
    core.close()
    disk = {p.name: p.stat().st_size for p in (tmp / "run").rglob("*") if p.is_file()}
    # every segment: metrics.msgpack and the closed metrics.NNNNNN.msgpack
    metrics_mb = sum(v for k, v in disk.items() if k.startswith("metrics") and k.endswith(".msgpack")) / 2**20
    tb_mb = sum(v for k, v in disk.items() if "tfevents" in k) / 2**20
    shutil.rmtree(tmp, ignore_errors=True)

    # plateau: growth over the second half of the run, against the first tenth
    first = next(x for x in samples if x["step"] >= args.steps // 10)
    half = next(x for x in samples if x["step"] >= args.steps // 2)
    last = samples[-1]
    out = {
        "steps": args.steps, "world": args.world, "tensorboard": args.tensorboard == "on",
        "packets": args.steps * args.world, "run_s": run_s, "steps_per_s": args.steps / run_s,
        "samples": samples, "rss_start_mb": samples[0]["rss_mb"], "rss_end_mb": last["rss_mb"],
        "growth_total_mb": last["rss_mb"] - samples[0]["rss_mb"],
        "growth_after_10pct_mb": last["rss_mb"] - first["rss_mb"],
        "growth_second_half_mb": last["rss_mb"] - half["rss_mb"],
        "peak_mb": max(x["rss_mb"] for x in samples), "bounded_sizes": sizes,
        "metrics_msgpack_mb": metrics_mb, "tensorboard_mb": tb_mb,
    }
    print(render(out))
    C.write_result(args.json, "memory", out, t0)


def render(out: dict) -> str:
    pts = [x for i, x in enumerate(out["samples"]) if i % max(1, len(out["samples"]) // 5) == 0 or x is out["samples"][-1]]
    lines = [f"aggregator core, {out['world']} ranks, {out['steps']} steps ({out['packets']} packets), TensorBoard "
             f"{'on' if out['tensorboard'] else 'off'}: {out['run_s']:.0f} s ({out['steps_per_s']:.0f} steps/s in one "
             f"process)",
             C.table(["step", "RSS MiB"], [[x["step"], f"{x['rss_mb']:.1f}"] for x in pts]),
             f"- growth: {out['growth_total_mb']:+.1f} MiB in all, {out['growth_after_10pct_mb']:+.1f} MiB after the "
             f"first 10% of the steps, {out['growth_second_half_mb']:+.1f} MiB over the second half; "
             f"peak {out['peak_mb']:.1f} MiB",
             f"- bounded structures at the end: {out['bounded_sizes']}",
             f"- on disk (by design): metrics.msgpack {out['metrics_msgpack_mb']:.1f} MiB, TensorBoard events "
             f"{out['tensorboard_mb']:.1f} MiB"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
