"""Aggregator fan-in: simulated ranks send real packets to a real `AggregatorActor`.

No MindSpore. A few Ray actors (`RankSim`) each simulate many ranks: every rank builds
and encodes a real `StepPacket` per step (loss, lr, grad norms, step time, samples, a
fingerprint every 10 steps) with `decision=True`, and waits for the directive through
the actor's `decide()`, as a rank with `monitor.decision_every=1` does. The aggregator
answers once every rank reported the step. Steps are paced at the requested rate
(closed loop: a rank never starts step s+1 before it has the directive of step s, so a
saturated aggregator shows up as a lower achieved rate, not as an unbounded backlog).

  batched    one `decide()` call carries a node's 8 ranks' packets (per-node batching)
  unbatched  one `decide()` call per rank and step

The aggregator is started as `mindpulse launch` starts it (same actor options, the
settings of the default config: TensorBoard on, default anomaly rules) unless
`--tensorboard off`. Measured per configuration:

  decision latency   time from a rank's `decide()` call for step s to its directive
  reduce latency     per step: from the last packet of step s leaving its sender to the
                     last directive of step s arriving (the cluster-wide turn-around)
  packets/s          packets accepted per second of the measured window
  achieved steps/s   against the requested rate

Beside it, in the same run, the raw Ray actor-call rate: the same sender actors calling a
no-op async actor with the same options, as fast as they can.

Usage: .venv/bin/python bench/fanin.py [--quick] [--json out.json]
"""

from __future__ import annotations

import os

os.environ.setdefault("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION", "python")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import argparse  # noqa: E402
import asyncio  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import _common as C  # noqa: E402
import ray  # noqa: E402

NODE = 8  # ranks per node (per-node batching groups this many packets in one call)
RANKS = [8, 64, 512, 4096]
RATES = [1, 5, 10]
TARGET = {"ranks": 4096, "rate": 2, "p99_s": 0.200}


class RankSim:
    """Simulates the ranks of some nodes: real packets, real `decide()` calls."""

    def __init__(self, idx: int):
        self.idx = idx
        self.agg = None
        self.groups: list[list[int]] = []

    async def setup(self, agg_handle_list, groups: list[list[int]]) -> int:
        self.agg = agg_handle_list[0]
        self.groups = groups
        return len(groups)

    def _batch(self, ranks: list[int], step: int, rate: float) -> list[bytes]:
        from mindpulse.protocol import StepPacket

        now = time.time()
        out = []
        for r in ranks:
            if step == 0:  # what Monitor.start() sends: the fingerprint of the initial weights
                p = StepPacket(rank=r, step=0, ts=now, fingerprint="8a1c90e2f3b4", param_norm=41.5, decision=True)
            else:
                p = StepPacket(rank=r, step=step, epoch=1, loss=2.0 + 0.01 * (r % 7) - 0.001 * step, lr=1e-3,
                               grad_norm=0.5, grad_norm_local=0.45 + 0.001 * (r % 5), step_time_s=1.0 / rate,
                               data_wait_s=0.001, samples=8, ts=now,
                               fingerprint="8a1c90e2f3b4" if step % 10 == 0 else None,
                               param_norm=41.5 if step % 10 == 0 else None, decision=True)
            out.append(p.encode())
        return out

    async def warm(self, timeout_s: float) -> int:
        """Step 0 for every simulated rank (connections, worker leases), not measured."""
        refs = [self.agg.decide.remote(self._batch(g, 0, 1.0), 0, timeout_s) for g in self.groups]
        await asyncio.gather(*refs)
        return len(refs)

    async def run(self, t0: float, rate: float, n_steps: int, timeout_s: float) -> dict:
        from mindpulse.protocol import Directive

        sends: list[float] = []
        recvs: list[float] = []
        steps: list[int] = []
        timeouts = 0

        async def loop(g: list[int]) -> None:
            nonlocal timeouts
            for s in range(1, n_steps + 1):
                delay = t0 + (s - 1) / rate - time.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                batch = self._batch(g, s, rate)
                ts = time.time()
                raw = await self.agg.decide.remote(batch, s, timeout_s)
                tr = time.time()
                d = Directive.decode(raw)
                if d.reason.startswith("timeout"):
                    timeouts += 1
                sends.append(ts)
                recvs.append(tr)
                steps.append(s)

        await asyncio.gather(*(loop(g) for g in self.groups))
        return {"send": sends, "recv": recvs, "step": steps, "timeouts": timeouts}

    async def blast(self, handle_list, n_packets: int, duration_s: float, window: int) -> dict:
        """As many calls as possible to `handle.ingest` with `window` in flight."""
        handle = handle_list[0]
        payload = self._batch(list(range(n_packets)), 1, 1.0)
        end = time.time() + duration_s
        n = 0

        async def worker() -> None:
            nonlocal n
            while time.time() < end:
                await handle.ingest.remote(payload)
                n += 1

        t = time.time()
        await asyncio.gather(*(worker() for _ in range(window)))
        return {"calls": n, "elapsed": time.time() - t}


class Noop:
    """An async actor that does nothing with what it is sent (the raw call rate)."""

    async def ingest(self, batch: list[bytes]) -> int:
        return len(batch)

    async def ping(self) -> bool:
        return True


def _aggregator_class():
    from mindpulse.aggregator.actor import AggregatorActor

    class BenchAggregator(AggregatorActor):
        """The real actor plus one method: the CPU seconds its process has used."""

        async def cpu_seconds(self) -> float:
            t = os.times()
            return t.user + t.system

    return BenchAggregator


def raw_rate(sims, n_packets: int, duration_s: float = 2.0, window: int = 256) -> dict:
    from mindpulse.aggregator.actor import AggregatorActor  # noqa: F401  (same import cost as the real one)

    noop = ray.remote(Noop).options(num_cpus=0, max_concurrency=4096).remote()
    ray.get(noop.ping.remote())
    ray.get([s.blast.remote([noop], n_packets, 0.3, 16) for s in sims])  # warm
    res = ray.get([s.blast.remote([noop], n_packets, duration_s, window) for s in sims])
    ray.kill(noop)
    calls = sum(r["calls"] for r in res)
    elapsed = max(r["elapsed"] for r in res)
    return {"packets_per_call": n_packets, "calls_per_s": calls / elapsed, "packets_per_s": calls * n_packets / elapsed,
            "senders": len(sims), "window_per_sender": window}


def run_config(sims, tmp: Path, settings: dict, ranks: int, rate: float, batched: bool, n_steps: int,
               seq: int, timeout_s: float = 30.0) -> dict:
    from mindpulse.aggregator.actor import actor_name

    run_dir = tmp / f"cfg{seq}"
    # the options `start_aggregator` uses (named, async, max_concurrency 4096, no CPU slot)
    agg = ray.remote(_aggregator_class()).options(
        name=actor_name(f"bench{seq}"), namespace="mindpulse-bench", num_cpus=0, max_concurrency=4096,
    ).remote(str(run_dir), ranks, 10, None, settings)
    ray.get(agg.ping.remote(), timeout=60)
    g = NODE if batched else 1
    groups = [list(range(i, min(i + g, ranks))) for i in range(0, ranks, g)]
    active = sims[: max(1, min(len(sims), len(groups)))]
    ray.get([s.setup.remote([agg], groups[k:: len(active)]) for k, s in enumerate(active)])
    ray.get([s.warm.remote(timeout_s) for s in active])
    t0 = time.time() + 0.3
    tc = time.time()
    cpu0 = ray.get(agg.cpu_seconds.remote())
    res = ray.get([s.run.remote(t0, rate, n_steps, timeout_s) for s in active])
    cpu1 = ray.get(agg.cpu_seconds.remote())
    wall = time.time() - tc
    snap = ray.get(agg.close.remote())
    ray.kill(agg)
    shutil.rmtree(run_dir, ignore_errors=True)

    sends = [x for r in res for x in r["send"]]
    recvs = [x for r in res for x in r["recv"]]
    steps = [x for r in res for x in r["step"]]
    lat = [b - a for a, b in zip(sends, recvs)]
    last_send: dict[int, float] = {}
    last_recv: dict[int, float] = {}
    for s, a, b in zip(steps, sends, recvs):
        last_send[s] = max(last_send.get(s, 0.0), a)
        last_recv[s] = max(last_recv.get(s, 0.0), b)
    reduce_lat = [last_recv[s] - last_send[s] for s in last_send]
    # completion rate between the first and the last step (the schedule's start is not counted)
    elapsed = last_recv[n_steps] - last_recv[1]
    achieved = (n_steps - 1) / elapsed
    return {
        "ranks": ranks, "rate": rate, "batched": batched, "steps": n_steps, "calls": len(lat),
        "elapsed_s": elapsed, "achieved_steps_per_s": achieved, "packets_per_s": ranks * (n_steps - 1) / elapsed,
        "decision_latency_s": C.summary(lat), "reduce_latency_s": C.summary(reduce_lat),
        "timeouts": sum(r["timeouts"] for r in res), "kept_up": achieved >= 0.9 * rate,
        "aggregator_cpu_pct": 100 * (cpu1 - cpu0) / wall, "aggregator_cpu_ms_per_step": 1000 * (cpu1 - cpu0) / n_steps,
        "accepted": snap["packets"]["accepted"], "rejected": snap["packets"]["rejected"],
        "steps_completed": snap["steps_completed"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a short smoke run (small grid)")
    ap.add_argument("--duration", type=float, default=4.0, help="target seconds per configuration")
    ap.add_argument("--max-config-s", type=float, default=8.0, help="planned seconds at most per configuration")
    ap.add_argument("--senders", type=int, default=2)
    ap.add_argument("--target-repeats", type=int, default=3)
    ap.add_argument("--tensorboard", choices=["on", "off", "both"], default="both",
                    help="grid with the default settings (on); 'both' adds the batched grid and the target with it off")
    ap.add_argument("--max-seconds", type=float, default=420.0,
                    help="time after which disturbed configurations are no longer run again")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    t_start = time.time()
    ranks_list, rates = (RANKS[:2] + RANKS[-1:], [1, 10]) if args.quick else (RANKS, RATES)
    if args.quick:
        args.duration, args.target_repeats = 2.0, 1

    logging.basicConfig(level=logging.WARNING)
    load = C.ForeignLoad(interval_s=1.0).start()
    deadline = t_start + args.max_seconds
    waited = 0.0
    ray.init(num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1", namespace="mindpulse-bench",
             log_to_driver=False, logging_level=logging.WARNING,
             runtime_env={"env_vars": {"PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": "python"}})
    tmp = Path(tempfile.mkdtemp(prefix="mindpulse-bench-fanin-"))
    sims = [ray.remote(RankSim).options(num_cpus=0, max_concurrency=8192).remote(i) for i in range(args.senders)]

    base = C.aggregator_settings()
    variants = {"tb_on": dict(base, tensorboard=True)}
    if args.tensorboard == "off":
        variants = {"tb_off": dict(base, tensorboard=False)}
    elif args.tensorboard == "both":
        variants["tb_off"] = dict(base, tensorboard=False)

    raw = {"before": [raw_rate(sims, 1), raw_rate(sims, NODE)]}
    print(f"[fanin] raw call rate: {raw['before'][0]['calls_per_s']:.0f} calls/s (1 packet), "
          f"{raw['before'][1]['calls_per_s']:.0f} calls/s ({NODE} packets)", file=sys.stderr, flush=True)

    configs: list[dict] = []
    seq = 0
    capacity: dict[tuple, float] = {}  # (variant, batched, ranks) -> achieved steps/s when saturated
    turnaround: dict[tuple, float] = {}  # (variant, batched, ranks) -> median reduce latency seen

    def plan_steps(key: tuple, rate: float) -> int:
        want = rate * args.duration
        cap = capacity.get(key)
        if cap is None and key in turnaround:  # not saturated yet: a step cannot be faster than its turn-around
            cap = 1.0 / max(1e-3, turnaround[key])
        if cap is not None and cap < 0.9 * rate:  # saturated (or will be): bound the time this takes
            want = min(want, cap * args.max_config_s)
        return max(3, int(math.ceil(want)))

    grid = [(v, b, n, r) for v in variants for b in (True, False) for n in ranks_list for r in rates
            if not (v == "tb_off" and (not b or (n < 512 and not args.quick)))]
    n_configs = len(grid) + len(variants) * args.target_repeats
    spent: list[float] = []  # seconds per configuration run so far

    def one(variant: str, ranks: int, rate: float, batched: bool, role: str = "grid") -> dict:
        nonlocal seq, waited
        key = (variant, batched, ranks)
        n = plan_steps(key, rate)
        for attempt in range(2):  # a configuration run beside other processes' load runs again once
            waited += C.wait_quiet(load, max(0.0, min(3.0, deadline - time.time())))
            seq += 1
            tc = time.time()
            r = run_config(sims, tmp, variants[variant], ranks, rate, batched, n, seq)
            spent.append(time.time() - tc)
            f = load.window(tc, time.time())
            r.update(variant=variant, role=role, foreign_cores=f["mean_cores"], attempt=attempt + 1)
            left_cfgs = n_configs - len(configs)  # this one included
            fits = time.time() + spent[-1] + (left_cfgs - 1) * statistics.mean(spent) < deadline
            if f["mean_cores"] <= C.QUIET_CORES or not fits:
                break
            print(f"[fanin] other processes used {f['mean_cores']:.2f} cores meanwhile: running it again",
                  file=sys.stderr, flush=True)
        if not r["kept_up"]:
            capacity[key] = min(capacity.get(key, r["achieved_steps_per_s"]), r["achieved_steps_per_s"])
        turnaround[key] = r["reduce_latency_s"]["median"]
        dl = r["decision_latency_s"]
        print(f"[fanin] {variant} {'batched' if batched else 'unbatched':9s} ranks {ranks:5d} rate {rate:>4}/s: "
              f"{r['achieved_steps_per_s']:.2f} steps/s, {r['packets_per_s']:.0f} pkt/s, "
              f"p50 {dl['median'] * 1000:.1f} ms p99 {dl['p99'] * 1000:.1f} ms ({time.time() - t_start:.0f}s)",
              file=sys.stderr, flush=True)
        configs.append(r)
        return r

    # TensorBoard off: batched only, and (the full grid) only where its share matters: 512+ ranks
    for variant, batched, ranks, rate in grid:
        one(variant, ranks, rate, batched)
    targets = []
    for variant in variants:
        reps = [one(variant, TARGET["ranks"], TARGET["rate"], True, role="target")
                for _ in range(args.target_repeats)]
        p99s = [r["decision_latency_s"]["p99"] for r in reps]
        ach = [r["achieved_steps_per_s"] for r in reps]
        targets.append({"variant": variant, "p99_s": C.summary(p99s), "achieved_steps_per_s": C.summary(ach),
                        "met": C.summary(p99s)["median"] < TARGET["p99_s"] and min(ach) >= 0.9 * TARGET["rate"]})
    raw["after"] = [raw_rate(sims, 1), raw_rate(sims, NODE)]
    ray.shutdown()
    load.stop()
    shutil.rmtree(tmp, ignore_errors=True)
    out = {"node_size": NODE, "senders": args.senders, "duration_s": args.duration, "raw": raw,
           "configs": configs, "targets": targets, "target_spec": TARGET, "waited_s": waited,
           "disturbed": sum(1 for c in configs if c["foreign_cores"] > C.QUIET_CORES),
           "rerun": sum(1 for c in configs if c["attempt"] > 1)}
    print(render(out))
    C.write_result(args.json, "fanin", out, t_start)


def render(out: dict) -> str:
    lines = []
    rb, ra = out["raw"]["before"], out["raw"].get("after", out["raw"]["before"])
    lines.append("raw Ray actor-call rate (no-op async actor, same senders; before / after the grid):")
    lines.append(C.table(["packets per call", "calls/s", "packets/s"], [
        [b["packets_per_call"], f"{b['calls_per_s']:.0f} / {a['calls_per_s']:.0f}",
         f"{b['packets_per_s']:.0f} / {a['packets_per_s']:.0f}"] for b, a in zip(rb, ra)]))
    for variant in dict.fromkeys(c["variant"] for c in out["configs"]):
        for batched in (True, False):
            rows = []
            for c in out["configs"]:
                if c["variant"] != variant or c["batched"] != batched or c["role"] != "grid":
                    continue
                dl, rl = c["decision_latency_s"], c["reduce_latency_s"]
                mark = " ~" if c.get("foreign_cores", 0) > C.QUIET_CORES else ""
                rows.append([f"{c['ranks']}{mark}", c["rate"],
                             f"{c['achieved_steps_per_s']:.2f}" + ("" if c["kept_up"] else " *"),
                             f"{c['packets_per_s']:.0f}", f"{dl['median'] * 1000:.1f}", f"{dl['p99'] * 1000:.1f}",
                             f"{rl['median'] * 1000:.1f}", f"{rl['p99'] * 1000:.1f}",
                             f"{c['aggregator_cpu_ms_per_step']:.0f} ({c['aggregator_cpu_pct']:.0f}%)", c["steps"],
                             c["timeouts"]])
            if rows:
                tb = "TensorBoard on (default)" if variant == "tb_on" else "TensorBoard off"
                lines.append(f"\n{tb}, {'per-node batching (8 ranks per call)' if batched else 'no batching (1 call per rank)'}:")
                lines.append(C.table(["ranks", "steps/s asked", "steps/s achieved", "packets/s", "decision p50 ms",
                                      "decision p99 ms", "reduce p50 ms", "reduce p99 ms",
                                      "aggregator CPU ms/step (% of a core)", "steps", "timeouts"], rows))
    lines.append("\n- a `*` after the achieved rate: under 90% of the asked rate, i.e. the aggregator's limit on this "
                 "machine at that size (with the simulated ranks on the same 2 cores)")
    if out.get("rerun") or out.get("disturbed"):
        lines.append(f"- {C.plural(out.get('rerun', 0), 'configuration')} run again because other processes used "
                     f"the CPU meanwhile; {out.get('disturbed', 0)} kept figures still taken beside such load "
                     "(marked `~`).")
    t = out["target_spec"]
    by_var: dict[str, list[dict]] = {}
    for c in out["configs"]:
        if c["role"] == "target":
            by_var.setdefault(c["variant"], []).append(c)
    if by_var:
        calls = t["ranks"] // out["node_size"]
        raw8 = max(r["calls_per_s"] for r in out["raw"]["before"] + out["raw"].get("after", [])
                   if r["packets_per_call"] == out["node_size"])
        parts = [f"{'TensorBoard on' if v == 'tb_on' else 'TensorBoard off'} "
                 f"{C.summary([c['aggregator_cpu_ms_per_step'] for c in cs])['median']:.0f} ms"
                 for v, cs in by_var.items()]
        lines.append(f"- at {t['ranks']} ranks, batched ({calls} calls a step), the aggregator process used per step: "
                     f"{', '.join(parts)} of CPU; the raw actor-call rate here ({raw8:.0f} calls/s of "
                     f"{out['node_size']} packets) alone allows at most {raw8 / calls:.1f} steps/s")
    for x in out["targets"]:
        p, a = x["p99_s"], x["achieved_steps_per_s"]
        lines.append(f"- target: {t['ranks']} ranks at {t['rate']} steps/s, batched, {x['variant']}: p99 decision latency "
                     f"median {p['median'] * 1000:.0f} ms (range {p['min'] * 1000:.0f}-{p['max'] * 1000:.0f}) over "
                     f"{C.plural(p['n'], 'run')}, achieved {a['median']:.2f} steps/s -> {'met' if x['met'] else 'MISSED'}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
