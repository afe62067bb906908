"""What the dashboards and trackers cost the aggregator: the Prometheus endpoint's scrape time
at 4,096 and 32,768 ranks, and the aggregator's CPU per reduced step with each sink on.

Both build the core's settings as a launch does, from the default config with `--set`-style
changes (`_common.aggregator_settings`, as the other benchmarks).

Scrape: a real `AggregatorCore` with its endpoint on (the aggregator's own code, in this
process), fed what a job of that size sends it: every node's card telemetry (8 cards a node,
as an Atlas 800 node; 16 with `--cards-per-node 16`, an A3-shaped node) and `--steps` reduced
steps from node partials (the ranks that matter kept whole, as node agents keep them); then
`--scrapes` GETs of /metrics over loopback, timed from the request to the last byte, and the
number of series in the answer. Target: a scrape answers in < 100 ms at 32,768 ranks.

Sinks: the same core at 8 ranks (one node, the flat path a 1-node job's relay feeds), fed
`--sink-steps` steps, once per configuration (nothing; TensorBoard; the Prometheus endpoint
scraped every 15 s; MLflow with its file store; SwanLab offline), the aggregator thread's CPU
(`time.thread_time`) per reduced step, the views drawn as the actor draws them (after each
step's lease). A tracker whose package is not installed is left out and said so.

Usage: bench/exporter.py [--json [PATH]] [--scrapes N] [--steps N] [--sink-steps N]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402

import _common as C  # noqa: E402

SCRAPE_TARGET_MS = 100.0
WORLDS = (4096, 32768)


def _partials(step: int, world: int, rpn: int):
    """One wire partial per node for `step`, as node agents send them (two packets kept whole
    each: the node's extremes)."""
    from mindpulse.reduction.partial import partial_of, to_wire
    from mindpulse.wire.protocol import StepPacket

    out = []
    for n in range(world // rpn):
        lo = n * rpn
        pk = {r: StepPacket(rank=r, step=step, loss=2.0 + 1e-4 * r, step_time_s=0.5 + 1e-6 * r, samples=4,
                            tokens=256, tflops=0.01, grad_norm=1.0, grad_norm_local=0.5, monitor_self_s=0.001,
                            ts=time.time()) for r in range(lo, lo + rpn)}
        out.append((n, {"steps": [], "other": [], "partials": [to_wire(partial_of(step, pk))], "rejected": {}}))
    return out


def _telemetry(world: int, rpn: int, cards_per_node: int) -> list[bytes]:
    from mindpulse.wire.protocol import TelemetryPacket

    nodes = world // rpn
    return [TelemetryPacket(node=f"node{n}-host{n}", ts=time.time(), source="npu-smi", cards=[
        {"card": c, "util_pct": 50.0, "memory_used_mb": 30000.0, "memory_total_mb": 65536.0, "power_w": 300.0,
         "temp_c": 60.0, "name": "910B3"} for c in range(cards_per_node)]).encode() for n in range(nodes)]


def scrape_cost(world: int, steps: int, scrapes: int, cards_per_node: int) -> dict:
    from mindpulse.aggregator.core import AggregatorCore

    rpn = 8
    port = C.free_port()
    tmp = Path(tempfile.mkdtemp(prefix="mp-exporter-"))
    settings = C.aggregator_settings("output.tensorboard=false", f"world.nodes={world // rpn}",
                                     f"world.ranks_per_node={rpn}", f"exporters.prometheus.port={port}")
    core = AggregatorCore(tmp / "run", world_size=world, per_print_step=10 ** 9, settings=settings)
    try:
        core.ingest(_telemetry(world, rpn, cards_per_node))
        for s in range(1, steps + 1):
            core.ingest_nodes(_partials(s, world, rpn))
        core.run_sinks()
        times, size, series = [], 0, 0
        for _ in range(scrapes):
            t = time.perf_counter()
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
                body = resp.read()
            times.append(time.perf_counter() - t)
            size = len(body)
            series = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
    finally:
        core.close()
        shutil.rmtree(tmp, ignore_errors=True)
    times.sort()
    return {"ranks": world, "cards": world // rpn * cards_per_node, "series": series, "bytes": size,
            "scrapes": len(times), "scrape_median_ms": round(C.quantile(times, 0.5) * 1000, 1),
            "scrape_max_ms": round(times[-1] * 1000, 1), "met": times[-1] * 1000 < SCRAPE_TARGET_MS}


SINKS = ("none", "tensorboard", "prometheus", "mlflow", "swanlab")
SINK_WORLD = ("world.nodes=1", "world.ranks_per_node=8")
"""The sink rows' job: one node of 8 ranks (the default config otherwise)."""


def sink_overrides(name: str, port: int = 0) -> list[str]:
    """The `--set` lines of sink row `name` (TensorBoard off but in its own row; the endpoint on
    `port` in the Prometheus row; the trackers as `C.TRACKER_SINKS` turns them on)."""
    out = [*SINK_WORLD, f"output.tensorboard={str(name == 'tensorboard').lower()}"]
    if name == "prometheus":
        out.append(f"exporters.prometheus.port={port}")
    return out + C.TRACKER_SINKS.get(name, [])


def sink_cost(name: str, steps: int) -> dict:
    from mindpulse.aggregator.core import AggregatorCore
    from mindpulse.wire.protocol import StepPacket

    missing = C.tracker_missing(name) if name in C.TRACKER_SINKS else None
    if missing:
        return {"sink": name, "skipped": missing}
    scraper = None
    port = C.free_port() if name == "prometheus" else 0
    settings = C.aggregator_settings(*sink_overrides(name, port))
    tmp = Path(tempfile.mkdtemp(prefix="mp-sinks-"))
    core = AggregatorCore(tmp / "run", world_size=8, per_print_step=10 ** 9, settings=settings)
    core.defer_sinks = True  # as the actor: the views after the step's lease
    try:
        if port:
            from fanin import Scraper

            scraper = Scraper(f"http://127.0.0.1:{port}/metrics", 15.0)
        batches = [[StepPacket(rank=r, step=s, loss=2.0 - 1e-3 * s + 1e-4 * r, step_time_s=0.2, samples=4,
                               tokens=256, tflops=0.01, grad_norm=1.0, grad_norm_local=0.5, monitor_self_s=0.001,
                               ts=time.time()).encode() for r in range(8)] for s in range(1, steps + 1)]
        t_cpu, t_wall = time.thread_time(), time.perf_counter()
        for b in batches:
            core.ingest(b)
            core.run_sinks()
        cpu = time.thread_time() - t_cpu
        wall = time.perf_counter() - t_wall
        errors = dict(core.sinks.output_errors)
    finally:
        if scraper is not None:
            scraper.close()
        core.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return {"sink": name, "steps": steps, "cpu_ms_per_step": round(cpu / steps * 1000, 3),
            "wall_ms_per_step": round(wall / steps * 1000, 3), "errors": errors}


def render(out: dict) -> str:
    """The Markdown section of docs/benchmarks.md (bench/run_all.py)."""
    rows = [[f"{s['ranks']:,}", f"{s['cards']:,}", f"{s['series']:,}", f"{s['bytes'] / 1024:.0f} KiB",
             f"{s['scrape_median_ms']:.1f}", f"{s['scrape_max_ms']:.1f}", str(s["scrapes"])] for s in out["scrape"]]
    text = C.table(["ranks", "cards", "series", "answer", "scrape median ms", "scrape max ms", "scrapes"], rows)
    sink_rows = []
    base = next((s["cpu_ms_per_step"] for s in out["sinks"] if s["sink"] == "none" and "cpu_ms_per_step" in s), None)
    for s in out["sinks"]:
        if "skipped" in s:
            sink_rows.append([s["sink"], "-", "-", s["skipped"]])
            continue
        extra = f"+{s['cpu_ms_per_step'] - base:.3f}" if base is not None and s["sink"] != "none" else ""
        sink_rows.append([s["sink"], f"{s['cpu_ms_per_step']:.3f}", extra,
                          ", ".join(f"{k}: {v}" for k, v in s["errors"].items()) or "none"])
    return (text + "\n\nThe aggregator's CPU per reduced step at 8 ranks (its thread, views drawn after each "
            f"step's lease, {out['sinks'][0].get('steps', '?')} steps each):\n\n"
            + C.table(["sink on", "CPU ms per step", "over none", "tracker errors"], sink_rows))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5, help="reduced steps before the scrapes")
    ap.add_argument("--scrapes", type=int, default=10)
    ap.add_argument("--cards-per-node", type=int, default=8)
    ap.add_argument("--sink-steps", type=int, default=300)
    ap.add_argument("--json", nargs="?", const="-", default=None)
    args = ap.parse_args(argv)
    t0 = time.time()
    out = {"scrape": [scrape_cost(w, args.steps, args.scrapes, args.cards_per_node) for w in WORLDS],
           "sinks": [sink_cost(n, args.sink_steps) for n in SINKS], "target_ms": SCRAPE_TARGET_MS,
           "machine": C.machine(), "threads": threading.active_count()}
    if args.json not in (None, "-"):
        C.write_result(args.json, "exporter", out, t0)
    else:
        print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
