"""Aggregator fan-in: simulated nodes send a real `AggregatorActor` what node agents send it.

No MindSpore. The aggregator is started as `mindpulse launch` starts it (same actor
options, the settings the launcher builds from the default config: TensorBoard on unless
`--no-tensorboard`, default rules, `monitor.max_lag_steps` 1, the console table every
`monitor.per_print_step` steps), with its Prometheus endpoint on and scraped every
`--scrape-s` seconds (15, a common scrape interval; 0: the endpoint off). A driver thread
does what the launcher's supervisor does while ranks run: it polls the aggregator every
0.5 s (the console lines, tables included, and the progress) and asks its hang check every
2 s.

What every node sends (bench/_node_sim.py says how each is made): its ranks' real step
packets of every step reduced by the real `NodePreReducer` (values that differ by rank and
step; fingerprints, rank 0's weight statistics and decisions as a default run sends
them), every rank's heartbeat every `monitor.heartbeat_s`, its card telemetry every
`monitor.telemetry_interval_s` (8 cards; 16 with `--ranks-per-node 16`, an Atlas A3 node)
and START events as the ranks begin. Groups of `monitor.group_size` nodes (64 by default
beyond 64 nodes): each leader is the real node agent's code (`GroupLeader`, its
`UplinkServer` for the members, its `Uplink` to the aggregator, the lease pushed down); the
members of the first `--hop-groups` groups (2) reach their leader over a real
uplink of their own (frames acknowledged once acknowledged above, the lease pushed to
them), the other groups' members hand their batches to their leader in-process. Two Ray
actors hold the nodes. A simulated rank starts step k only once every node has the lease
of step k-1-max_lag_steps, and after a checkpoint candidate only once rank 0 has its
directive; steps are paced at the asked rate, so a saturated aggregator shows as a lower
achieved rate and as rank wait.

`--sink mlflow` or `--sink swanlab` turns that tracker on as a launch does
(`sinks.<name>.enabled=true` through the launcher's settings: MLflow with a file store in the
run's `<output.root>/mlruns`, SwanLab offline under the run directory); `--sink
none,mlflow,swanlab` runs the configuration with each in turn (`--repeats` rounds; the nodes'
batches made once), for the aggregator's cost of each tracker at that scale.

Measured over the timed steps: achieved steps/s; reduce latency per step (the target's: the
step's last group partial leaving its leader, to every leader holding the lease that says
the step is reduced) and end to end (every node's batch handed over, to every leader and
streaming member holding that lease); the aggregator's CPU as a fraction of one core and in
ms per reduced step (its process: a tracker's own threads in it included); the rank wait for the lease (how long after a
step's end the last node had the lease it needs, 0 when every node had it before), and rank 0's wait for its directive (with how long
after the step's lease the directive came down the same stream); the senders' CPU; what
the driver's polls, hang checks and the scrapes took; packets the aggregator refused.
Senders and aggregator share this machine's cores (on a cluster the nodes' work runs on
the nodes).

Separately (`--targets`), the node agent's whole process as a launch runs it
(bench/_agent_node.py): an Atlas A3-shaped node (16 ranks, 16 cards, 10 steps/s,
telemetry on), and 8 ranks at 20 steps/s for context.

By default the senders replay pre-encoded frames (`--senders replay`, bench/_replay.py): each group
leader's frame of a step built before the run by the same node pre-reducer and `GroupLeader`,
replayed over one real uplink per leader with its step written in, heartbeats as one record per
node, each node's telemetry sample encoded once, so the harness takes little of the aggregator's
core; `--senders live` runs the leaders, their merging and the member streams described above.

Usage: bench/fanin.py --ranks N --ranks-per-node 8 --rate R --seconds S [--group-size G]
                      [--senders replay|live] [--hop-groups H] [--no-tensorboard]
                      [--sink none|mlflow|swanlab[,...]]
                      [--json [PATH]]
Prints one JSON object (with --json) with at least: ranks, nodes, sink, asked_steps_per_s,
achieved_steps_per_s, reduce_p50_ms, reduce_p99_ms, reduce_n, aggregator_cpu_frac,
aggregator_cpu_ms_per_step, rank_wait_p99_ms (several sinks: {"sink_runs": {sink: [runs]}, ...}).
`--targets [--repeats K]` runs the issue's fan-in targets K times each, in turn (each judged
on its worst repeat), and the node-agent measurements (bench/run_all.py uses it).
"""

from __future__ import annotations

import os

os.environ.setdefault("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION", "python")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import ray  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
from _fanin_driver import Driver, Scraper  # noqa: E402
from _fanin_report import render, simulated, tracker_failures  # noqa: E402
from _fanin_targets import AGENT_CONTEXT, AGENT_TARGET, P99_MIN_STEPS, TARGETS, judge, p99_label  # noqa: E402

# what other code reads here: bench/exporter.py the scraper, bench/run_all.py and the tests the
# targets, their judgement and the report
__all__ = ["AGENT_TARGET", "TARGETS", "Scraper", "judge", "main", "overrides_of", "p99_label", "plan", "render",
           "run", "simulated", "tracker_failures"]

SENDERS = 2
HOP_GROUPS = 2
"""Groups whose members reach their leader over an uplink of their own: one per sender
process, so each plays one leader with its 63 members' streams, as one leader's machine
runs them. Measured at 4,096 ranks on 6 December (this 2-core machine): every group's members
streaming (504 streams, their acknowledgements and lease pushes) took the two sender
processes to ~38% of a core each, and with four leaders and their members in one event loop
per process the end-to-end latency grew ~3x over what one leader's loop sees."""


def overrides_of(ranks: int, rpn: int, tensorboard: bool, port: int, group_size: int,
                 sink: str = "none") -> list[str]:
    """The `--set` lines of the simulated job (the default config otherwise); `sink`: the
    tracker turned on (`C.TRACKER_SINKS`)."""
    nodes = math.ceil(ranks / rpn)
    out = [f"world.nodes={nodes}", f"world.ranks_per_node={rpn}", f"output.tensorboard={str(tensorboard).lower()}",
           f"exporters.prometheus.port={port}", "train.steps=1000000"]  # no "last step" inside the run
    if group_size:
        out.append(f"monitor.group_size={group_size}")
    return out + C.TRACKER_SINKS[sink]


def plan(ranks: int, rpn: int, group_size: int, hop_groups: int) -> dict:
    """Nodes, groups (as the launcher forms them) and which groups' members have their hop."""
    from mindpulse.config import load_config

    cfg, _ = load_config(None, overrides_of(ranks, rpn, True, 0, group_size))
    nodes = cfg.world.nodes
    g = cfg.monitor.groups_of(nodes)
    groups = [list(range(i, min(i + g, nodes))) for i in range(0, nodes, g)]
    hop_groups = min(len(groups), hop_groups) if g > 1 else 0
    return {"cfg": cfg, "nodes": nodes, "group_size": g, "groups": groups,
            "hop": [i < hop_groups for i in range(len(groups))]}


def sender_groups(p: dict, i: int) -> tuple[list[list[int]], list[bool]]:
    """Sender `i`'s groups (every SENDERS-th, so each holds half the hops)."""
    return p["groups"][i::SENDERS], p["hop"][i::SENDERS]


def generate(p: dict, rpn: int, rate: float, steps: int, senders: str = "replay") -> list:
    """Every node's batches of steps 0..`steps` (live senders), or every group leader's frames
    of a cycle of steps (replayed senders: bench/_replay.py), built by two Ray tasks (the nodes'
    own work, before the timed run); one object per sender, owned by this process, reused by
    every repeat."""
    ov = overrides_of(p["nodes"] * rpn, rpn, True, 0, p["group_size"])
    if senders == "replay":
        from _replay import cycle_steps, group_frames

        task = ray.remote(group_frames).options(num_cpus=1)
        return [task.remote(sender_groups(p, i)[0], ov, cycle_steps(steps), rate) for i in range(SENDERS)]
    from _node_sim import node_batches

    task = ray.remote(node_batches).options(num_cpus=1)
    return [task.remote(sorted(n for g in sender_groups(p, i)[0] for n in g), ov, steps, rate) for i in range(SENDERS)]


def run(args: argparse.Namespace, blobs: list | None = None) -> dict:
    """One run of one configuration (Ray initialised by the caller); `blobs`: the nodes'
    batches from `generate` (made here when not given)."""
    import psutil
    from _node_sim import Nodes

    from mindpulse.aggregator.core import start_aggregator
    from mindpulse.config.derived import AUTO_HANG_MIN_S, monitor_settings_of, schedule_of

    sink = getattr(args, "sink", "none")
    senders = getattr(args, "senders", "replay")
    missing = C.tracker_missing(sink)
    if missing:
        return {"sink": sink, "skipped": missing}
    rpn = args.ranks_per_node
    p = plan(args.ranks, rpn, args.group_size, 0 if senders == "replay" else args.hop_groups)
    cfg = p["cfg"]
    nodes, ranks = p["nodes"], p["nodes"] * rpn
    sched = schedule_of(cfg)
    lag = cfg.monitor.max_lag_steps
    max_steps = int(math.ceil(args.rate * args.seconds)) + 2
    if blobs is None:
        blobs = generate(p, rpn, args.rate, max_steps, senders)
    tmp = Path(tempfile.mkdtemp(prefix="mp-fanin-"))
    run_dir = tmp / "run"  # in a folder of its own: MLflow's file store goes beside it (<output.root>/mlruns)
    run_dir.mkdir()
    actors, agg = [], None
    t_setup = time.time()
    try:
        port = C.free_port() if args.scrape_s > 0 else 0
        settings = C.aggregator_settings(*overrides_of(ranks, rpn, not args.no_tensorboard, port, args.group_size,
                                                       sink))
        agg = start_aggregator(f"fanin-{os.getpid()}-{time.time_ns()}", "mindpulse-bench", run_dir, ranks,
                               cfg.monitor.per_print_step, None, settings=settings)
        agg_pid = ray.get(agg.ping.remote(), timeout=120)
        ms = monitor_settings_of(cfg)
        actors = []
        if senders == "replay":
            from _replay import Replay

            cls = ray.remote(Replay).options(num_cpus=0, max_concurrency=2)
            for i in range(SENDERS):
                actors.append(cls.remote(agg, sender_groups(p, i)[0], blobs[i], rpn, ms.heartbeat_s,
                                         cfg.monitor.telemetry_interval_s, ms.decision_timeout_s, 1000 * i))
        else:
            cls = ray.remote(Nodes).options(num_cpus=0, max_concurrency=2)
            for i in range(SENDERS):
                groups, hop = sender_groups(p, i)
                actors.append(cls.remote(agg, groups, hop, blobs[i], rpn, ms.heartbeat_s,
                                         cfg.monitor.telemetry_interval_s, ms.decision_timeout_s, 1000 * i))
        want = [ray.get(a.agents_count.remote(), timeout=300) for a in actors]
        deadline = time.time() + 60
        while sum(ray.get([a.connected.remote() for a in actors])) < sum(want) and time.time() < deadline:
            time.sleep(0.2)
        ray.get([a.start.remote() for a in actors])  # the ranks start: START events, heartbeats, samples
        ray.get([a.send_step.remote(0, False) for a in actors])
        ray.get([a.wait.remote(0, -1) for a in actors])  # step 0 reduced on every node
        time.sleep(1.0)
        sender_procs = [psutil.Process(ray.get(a.pid.remote())) for a in actors]
        proc = psutil.Process(agg_pid)
        driver = Driver(agg, max(3.0, min(15.0, (cfg.monitor.hang_timeout_s or AUTO_HANG_MIN_S) / 2)))
        scraper = Scraper(f"http://127.0.0.1:{port}/metrics", args.scrape_s) if port else None
        cpu0 = sum(proc.cpu_times()[:2])
        scpu0 = [sum(sp.cpu_times()[:2]) for sp in sender_procs]
        c0 = ray.get([a.counters.remote() for a in actors])
        t0 = time.time()
        setup_s = t0 - t_setup
        lease_waits: list[float] = []
        decision_waits: list[float] = []
        step = 0
        period = 1.0 / args.rate
        end = t0  # step k runs one period from its start and sends its packets at its end; it starts
        while step < max_steps:  # once step k-1 ended, step k-1-lag is reduced on every node, and
            step += 1  # (after a checkpoint candidate) rank 0 has its directive
            prev = step - 1
            candidate = prev > 0 and sched.is_candidate(prev)
            waits = ray.get([a.wait.remote(step - 1 - lag, prev if candidate else -1) for a in actors])
            d, w = max(x[0] for x in waits), max(x[1] for x in waits)
            if candidate:
                decision_waits.append(d)
            lease_waits.append(w)
            if max(x[0] + x[1] for x in waits) > 0.001:  # held: the step starts now
                end = max(end, time.time())
            end += period
            if end - t0 > args.seconds:
                step -= 1
                break
            if time.time() < end:
                time.sleep(end - time.time())
            ray.get([a.send_step.remote(step, sched.is_candidate(step)) for a in actors])
        # the last step reduced on every node (and its directive, at a candidate)
        ray.get([a.wait.remote(step, step if step and sched.is_candidate(step) else -1, 30.0) for a in actors])
        wall = time.time() - t0
        cpu = sum(proc.cpu_times()[:2]) - cpu0
        scpu = [sum(sp.cpu_times()[:2]) - c for sp, c in zip(sender_procs, scpu0)]
        scrapes = scraper.close() if scraper is not None else []
        polled = driver.close()
        records = ray.get([a.record.remote() for a in actors])
        c1 = ray.get([a.counters.remote() for a in actors])
        ends = ray.get([a.close.remote() for a in actors], timeout=120)
        snap = ray.get(agg.close.remote(), timeout=120)
        teardown_s = time.time() - t0 - wall
    finally:
        for a in actors:
            ray.kill(a)
        if agg is not None:
            ray.kill(agg)
        shutil.rmtree(tmp, ignore_errors=True)
    def when(key: str, s: int) -> float:  # the latest over both senders (inf: not every node got there)
        return max(r[key].get(s, math.inf) for r in records)

    # reduce latency (the target's): a step's last group partial leaving its leader for the
    # aggregator, to every leader holding the lease that says it is reduced
    done = [s for s in range(1, step + 1) if math.isfinite(when("leaders_at", s) + when("up_at", s))]
    lat = sorted(max(0.0, when("leaders_at", s) - when("up_at", s)) * 1000 for s in done)
    # end to end, as the ranks see it: every node's batch of the step handed over (to its
    # uplink or its leader) to every watched node (members with a hop included) holding the lease
    ends_ok = [s for s in range(1, step + 1) if math.isfinite(when("seen_at", s) + when("sent_at", s))]
    e2e = sorted(max(0.0, when("seen_at", s) - when("sent_at", s)) * 1000 for s in ends_ok)
    # rank 0's directive at a candidate against the lease of the same step on node 0's own uplink
    # (both come down the same stream): what the directive waits for beyond the reduction
    dec = [r for r in records if r["decided_at"]]
    after = [round((dec[0]["decided_at"][s] - dec[0]["lease0_at"][s]) * 1000, 1)
             for s in sorted(dec[0]["decided_at"]) if s in dec[0]["lease0_at"]] if dec else []
    achieved = (len(done) - 1) / max(when("leaders_at", done[-1]) - when("leaders_at", done[0]), 1e-9) \
        if len(done) > 1 else 0.0
    pk = snap.get("packets") or {}
    counts = {k: sum(e.get(k, 0) for e in ends) for k in ("member_frames", "leader_frames", "lost", "dropped",
                                                          "bad_leases")}
    counts.update({k: sum(b.get(k, 0) - a.get(k, 0) for a, b in zip(c0, c1))
                   for k in ("heartbeats", "telemetry", "member_frames", "leader_frames")})
    return {
        "ranks": ranks, "nodes": nodes, "ranks_per_node": rpn, "cards_per_node": rpn, "group_size": p["group_size"],
        "groups": len(p["groups"]), "hop_groups": sum(p["hop"]),
        "hop_members": sum(len(g) - 1 for g, h in zip(p["groups"], p["hop"]) if h),
        "tensorboard": not args.no_tensorboard, "sink": sink, "senders": senders, "asked_steps_per_s": args.rate,
        "seconds": round(wall, 2),
        "setup_s": round(setup_s, 1), "teardown_s": round(teardown_s, 1),
        "per_print_step": cfg.monitor.per_print_step, "heartbeat_s": ms.heartbeat_s,
        "telemetry_interval_s": cfg.monitor.telemetry_interval_s,
        "scrape_every_s": args.scrape_s, "scrapes": len(scrapes),
        "scrape_max_ms": round(max(scrapes) * 1000, 1) if scrapes else None,
        "steps": step, "achieved_steps_per_s": round(achieved, 3),
        "reduce_p50_ms": round(C.quantile(lat, 0.5), 1) if lat else None,
        # a p99 means something over P99_MIN_STEPS reduced steps or more; over fewer it is the
        # slowest step, and says so ("max over n")
        "reduce_p99_ms": round(C.quantile(lat, 0.99) if len(lat) >= P99_MIN_STEPS else lat[-1], 1) if lat else None,
        "reduce_max_ms": round(lat[-1], 1) if lat else None,
        "end_to_end_p50_ms": round(C.quantile(e2e, 0.5), 1) if e2e else None,
        "end_to_end_p99_ms": round(C.quantile(e2e, 0.99) if len(e2e) >= P99_MIN_STEPS else e2e[-1], 1) if e2e else None,
        "end_to_end_n": len(e2e),
        "by_step_ms": [[s, round((when("leaders_at", s) - when("up_at", s)) * 1000, 1),
                        round((when("seen_at", s) - when("sent_at", s)) * 1000, 1)] for s in done if s in ends_ok],
        "reduce_n": len(lat),
        "aggregator_cpu_frac": round(cpu / max(wall, 1e-9), 3),
        # steps 1..step were reduced inside the timed window (the run waits for the last one)
        "aggregator_cpu_ms_per_step": round(cpu / max(step, 1) * 1000, 2),
        "sender_cpu_frac": [round(c / max(wall, 1e-9), 3) for c in scpu],
        "rank_wait_p99_ms": round(C.quantile(sorted(w * 1000 for w in lease_waits), 0.99), 1) if lease_waits else None,
        "decision_wait_max_ms": round(max(decision_waits) * 1000, 1) if decision_waits else None,
        "decision_wait_median_ms": round(C.quantile(decision_waits, 0.5) * 1000, 1) if decision_waits else None,
        "decisions": len(decision_waits),
        "directive_after_lease_ms": after,
        "heartbeats_per_s": round(counts["heartbeats"] / max(wall, 1e-9), 1),
        "telemetry_per_s": round(counts["telemetry"] / max(wall, 1e-9), 1),
        "member_frames": counts["member_frames"], "leader_frames": counts["leader_frames"],
        "lost": counts["lost"] + counts["dropped"], "bad_leases": counts["bad_leases"],
        "stopped": next((r["stopping"] for r in records if r["stopping"]), ""),
        "accepted": pk.get("accepted"), "rejected": pk.get("rejected"),
        "rejected_by_reason": pk.get("rejected_by_reason"), "anomalies": snap.get("anomalies"),
        **polled,
        "machine": C.machine(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }


def sink_runs(args: argparse.Namespace, sinks: list[str]) -> dict:
    """The configuration once per sink, `args.repeats` rounds (the sinks in turn each round, so a
    disturbance hits them alike), on one set of node batches; judged against the fan-in target
    of the same ranks and rate where there is one."""
    p = plan(args.ranks, args.ranks_per_node, args.group_size, 0 if args.senders == "replay" else args.hop_groups)
    blobs = generate(p, args.ranks_per_node, args.rate, int(math.ceil(args.rate * args.seconds)) + 2, args.senders)
    runs: dict[str, list[dict]] = {s: [] for s in sinks}
    for _ in range(args.repeats):
        for s in sinks:
            r = run(argparse.Namespace(**dict(vars(args), sink=s)), blobs)
            runs[s].append(r)
            if "skipped" in r:
                sinks = [x for x in sinks if x != s]  # not installed: said once
    target = next((t for t in TARGETS if t["ranks"] == args.ranks and t["rate"] == args.rate), None)
    return {"sink_runs": runs, "target": target,
            "judged": {s: judge(target, rs) for s, rs in runs.items() if target and rs and "skipped" not in rs[0]},
            "repeats": args.repeats, "seconds_per_run": args.seconds, "machine": C.machine()}


def agent_runs(repeats: int, seconds: float, fake_dir: Path) -> tuple[list[dict], list[dict]]:
    """The node-agent measurements: the A3-shaped node `repeats` times, and 8 ranks once."""
    from _agent_node import agent_process_cost

    a3 = [agent_process_cost(AGENT_TARGET["ranks"], AGENT_TARGET["rate"], seconds, fake_dir) for _ in range(repeats)]
    eight = [agent_process_cost(AGENT_CONTEXT["ranks"], AGENT_CONTEXT["rate"], max(5.0, seconds / 2), fake_dir)]
    return a3, eight


def ray_session(fake_dir: Path) -> None:
    """One local Ray cluster for every run of this invocation: "NPU" resources for the
    node-agent runs' placement (`world.device: ascend`), and the recorded-output npu-smi
    (bench/_agent_node.py) first on PATH: every worker inherits it."""
    from _agent_node import fake_npu_smi

    path = fake_npu_smi(fake_dir)
    logging.getLogger("ray._private.accelerators.npu").setLevel(logging.CRITICAL)  # no Ascend runtime here: said once below
    os.environ["PATH"] = f"{path.parent}{os.pathsep}{os.environ.get('PATH', '')}"
    ray.init(num_cpus=4, resources={"NPU": 16}, include_dashboard=False, log_to_driver=False,
             logging_level=logging.ERROR, _node_ip_address="127.0.0.1",
             runtime_env={"env_vars": {"PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": "python"}})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4096)
    ap.add_argument("--ranks-per-node", type=int, default=8, help="and cards per node (16: an Atlas A3 node)")
    ap.add_argument("--rate", type=float, default=2.0, help="asked steps per second")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--group-size", type=int, default=0, help="nodes per group leader (0: the config's, 64 beyond 64)")
    ap.add_argument("--hop-groups", type=int, default=HOP_GROUPS,
                    help="groups whose members stream to their leader; the others' members hand over in-process")
    ap.add_argument("--senders", choices=["replay", "live"], default="replay",
                    help="replay: each group leader's frames built before the run and replayed (bench/_replay.py); "
                         "live: the nodes' batches merged by the leaders and streamed at run time (bench/_node_sim.py)")
    ap.add_argument("--no-tensorboard", action="store_true")
    ap.add_argument("--scrape-s", type=float, default=15.0,
                    help="the Prometheus endpoint on, scraped every this many seconds (0: endpoint off)")
    ap.add_argument("--sink", default="none", metavar="none|mlflow|swanlab[,...]",
                    help="the tracker sink turned on (MLflow: a file store; SwanLab: offline); several, "
                         "comma-separated: the run once with each, --repeats rounds")
    ap.add_argument("--json", nargs="?", const="-", default=None,
                    help="print one JSON object (or write it to the given path)")
    ap.add_argument("--targets", action="store_true", help="the target configurations, judged on the worst repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--agent-seconds", type=float, default=20.0, help="timed steps of each node-agent measurement")
    ap.add_argument("--agent-repeats", type=int, default=0, help="A3 node-agent repeats (0: --repeats)")
    ap.add_argument("--agent-only", action="store_true", help="only the node-agent measurements")
    args = ap.parse_args(argv)
    sinks = [x.strip() for x in args.sink.split(",") if x.strip()] or ["none"]
    unknown = [x for x in sinks if x not in C.TRACKER_SINKS]
    if unknown:
        ap.error(f"--sink: {', '.join(unknown)} is none of {', '.join(C.TRACKER_SINKS)}")
    if len(sinks) > 1 and (args.targets or args.agent_only):
        ap.error("--sink: one sink with --targets or --agent-only")
    args.sink = sinks[0]
    t0 = time.time()
    fake_dir = Path(tempfile.mkdtemp(prefix="mp-npu-smi-"))
    ray_session(fake_dir)
    try:
        if args.targets or args.agent_only:
            results: dict[int, list[dict]] = {i: [] for i in range(len(TARGETS))}
            if not args.agent_only:
                blobs = {}
                for i, t in enumerate(TARGETS):
                    p = plan(t["ranks"], args.ranks_per_node, args.group_size,
                             0 if args.senders == "replay" else args.hop_groups)
                    blobs[i] = generate(p, args.ranks_per_node, t["rate"], int(math.ceil(t["rate"] * args.seconds)) + 2,
                                        args.senders)
                ray.wait([b for bs in blobs.values() for b in bs], num_returns=SENDERS * len(TARGETS), timeout=600)
                for _ in range(args.repeats):  # the targets in turn, so a disturbance hits both alike
                    for i, t in enumerate(TARGETS):
                        a = argparse.Namespace(**dict(vars(args), ranks=t["ranks"], rate=t["rate"]))
                        results[i].append(run(a, blobs[i]))
                del blobs
            a3, eight = agent_runs(args.agent_repeats or args.repeats, args.agent_seconds, fake_dir)
            out = {"targets": [judge(t, results[i]) for i, t in enumerate(TARGETS) if results[i]],
                   "repeats": args.repeats, "seconds_per_run": args.seconds, "machine": C.machine(),
                   "agent_target": AGENT_TARGET, "agent_a3": a3, "agent_8": eight}
        elif len(sinks) > 1:
            out = sink_runs(args, sinks)
        else:
            out = run(args)
    finally:
        ray.shutdown()
        shutil.rmtree(fake_dir, ignore_errors=True)
    if args.json not in (None, "-"):
        C.write_result(args.json, "fanin", out, t0)
    elif args.json == "-":
        print(json.dumps(out))
    else:
        for k, v in out.items():
            if k != "machine":
                print(f"{k:32s} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
