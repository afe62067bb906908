"""The fan-in benchmark's simulated nodes send what node agents send (bench/_node_sim.py,
bench/_agent_node.py), and its report says what it measured (bench/fanin.py, run_all.py).

No Ray here: the traffic's pieces are checked on their own; the benchmark itself is run by
`make bench`.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import msgpack
import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import _agent_node  # noqa: E402
import _node_sim  # noqa: E402
import fanin  # noqa: E402
import run_all  # noqa: E402

from mindpulse.node.telemetry import NpuSmiSampler  # noqa: E402
from mindpulse.reduction.partial import from_wire  # noqa: E402
from mindpulse.wire.directives import Lease  # noqa: E402
from mindpulse.wire.protocol import EventPacket, StepPacket, TelemetryPacket, decode  # noqa: E402


def _overrides(ranks: int, rpn: int = 8) -> list[str]:
    return fanin.overrides_of(ranks, rpn, True, 0, 0)


def test_node_batches_differ_by_step_and_rank_and_carry_what_a_default_run_sends():
    blobs = _node_sim.node_batches([1], _overrides(4096), 11, 2.0)[1]
    batches = [_node_sim.unpack_batch(b) for b in blobs]
    assert [len(b["steps"]) for b in batches] == [8] * 12
    assert all(not b["rejected"] for b in batches)
    parts = [from_wire(b["partials"][0]) for b in batches]
    assert [p.step for p in parts] == list(range(12))
    assert all(p.n == 8 for p in parts)
    packets = [[decode(raw) for raw in b["steps"]] for b in batches]
    assert {p.rank for p in packets[3]} == set(range(8, 16))
    losses = [[p.loss for p in step] for step in packets[1:]]
    assert all(len(set(step)) == 8 for step in losses), "every rank's loss differs within a step"
    assert len({tuple(step) for step in losses}) == len(losses), "and from step to step"
    assert len({p.values["loss_mean"][2] for p in parts[1:]}) == len(parts) - 1, "no partial is reused"
    assert all(p.fingerprint for p in packets[10]) and not any(p.fingerprint for p in packets[5])
    assert all(isinstance(p, StepPacket) and p.tflops and p.step_time_s for p in packets[5])


def test_rank_0_ships_weights_at_collect_steps_and_decides_at_candidates():
    batch = _node_sim.unpack_batch(_node_sim.node_batches([0], _overrides(4096), 10, 2.0)[0][10])
    first = next(decode(raw) for raw in batch["steps"] if decode(raw).rank == 0)
    assert first.decision and len(first.weights["norms"]) == _node_sim.LAYERS and set(first.weights["hist"]) == set(
        _node_sim.HIST_LAYERS)
    assert all(not decode(raw).weights for raw in batch["steps"] if decode(raw).rank != 0)


@pytest.mark.parametrize("rpn", [8, 16])
def test_a_node_sample_is_the_telemetry_packet_its_agent_ships(rpn):
    pkt = decode(_node_sim.telemetry_sample(3, rpn, 1000.0, 4242))
    assert isinstance(pkt, TelemetryPacket) and pkt.node == "node3-host3" and pkt.source == "npu-smi"
    assert [c["card"] for c in pkt.cards] == list(range(rpn))
    assert [c["ranks"] for c in pkt.cards] == [[3 * rpn + i] for i in range(rpn)]
    assert len(pkt.host["processes"]) == rpn
    if rpn == 16:  # an A3 node: two chips an NPU, the second without a power reading
        assert [c["power_w"] is None for c in pkt.cards] == [i % 2 == 1 for i in range(16)]


def test_heartbeats_come_once_per_rank_and_period():
    beats = _node_sim.Beats(list(range(100)), 5.0, 0.0, seed=1)
    got: list[int] = []
    t = 0.0
    while t < 15.0:
        t += 0.05
        got += beats.due(t)
    assert sorted(got) == sorted(list(range(100)) * 3)


def test_a_heartbeat_is_the_ranks_own_packet():
    from mindpulse.workers.heartbeat import Heartbeat

    beat = Heartbeat(None, 0, lambda: 41, lambda: 42)  # type: ignore[arg-type]
    beat.rank = 77
    pkt = decode(beat.packet().encode())
    assert isinstance(pkt, EventPacket) and pkt.kind == "heartbeat" and pkt.rank == 77 and pkt.state_step == 42


def test_lease_watch_waits_for_every_watched_node():
    watch = _node_sim.LeaseWatch()
    for n in (0, 1, 2):
        watch.watch(n, leader=n == 0)
    watch.saw(0, Lease(reduced_through=3))
    assert 3 in watch.leaders_at and 3 not in watch.seen_at
    assert watch.wait(1, timeout=0.01) >= 0.0 and watch.all_through == -1
    watch.saw(1, Lease(reduced_through=2))
    watch.saw(2, Lease(reduced_through=3))
    assert watch.all_through == 2 and sorted(watch.seen_at) == [0, 1, 2]
    watch.saw(1, Lease(reduced_through=5))
    assert watch.all_through == 3


@pytest.mark.parametrize("cards", [8, 16])
def test_the_recorded_npu_smi_feeds_the_real_sampler(tmp_path, cards):
    path = _agent_node.fake_npu_smi(tmp_path)
    _agent_node.use_cards(tmp_path, cards)
    sampler = NpuSmiSampler(str(path), lock_path=str(tmp_path / "lock"))
    records = sampler.sample()
    assert sampler.last_warnings == []
    assert [r["card"] for r in records] == list(range(cards))
    assert all(r["util_pct"] is not None and r["memory_total_mb"] == 65536.0 for r in records)
    assert {r["name"] for r in records} == ({"Ascend910"} if cards == 16 else {"910B3"})


def _run(ranks: int, **kw) -> dict:
    r = {"ranks": ranks, "nodes": ranks // 8, "ranks_per_node": 8, "cards_per_node": 8, "group_size": 64,
         "groups": max(1, ranks // 512), "hop_groups": 2, "hop_members": 126, "achieved_steps_per_s": 1.99,
         "reduce_p50_ms": 20.0, "reduce_p99_ms": 60.0, "reduce_n": 40, "aggregator_cpu_frac": 0.1,
         "rank_wait_p99_ms": 0.0, "end_to_end_p99_ms": 150.0, "end_to_end_n": 40, "decision_wait_max_ms": 30.0,
         "decisions": 4, "sender_cpu_frac": [0.2, 0.3], "heartbeats_per_s": ranks / 5, "telemetry_per_s": ranks / 40,
         "console_chars": 1000, "hang_check_max_ms": 12.0, "rejected": 0, "heartbeat_s": 5.0,
         "telemetry_interval_s": 5.0, "per_print_step": 10, "scrape_every_s": 15.0, "scrape_max_ms": 20.0}
    return {**r, **kw}


def _agent(cpu_frac: float, ranks: int = 16) -> dict:
    return {"ranks": ranks, "cards": ranks, "rate": 10.0, "steps": 200, "telemetry_interval_s": 5.0,
            "heartbeat_s": 5.0, "spread_ms": 1.0, "cpu_frac": cpu_frac, "cpu_ms_per_step": cpu_frac * 100,
            "idle_cpu_frac": 0.006, "npu_smi_children_cpu_frac": 0.004}


def test_the_report_says_what_was_simulated_and_every_verdict_its_n():
    out = {"targets": [fanin.judge(t, [_run(t["ranks"]), _run(t["ranks"], reduce_n=250)]) for t in fanin.TARGETS],
           "agent_target": fanin.AGENT_TARGET, "agent_a3": [_agent(0.031), _agent(0.052)],
           "agent_8": [_agent(0.03, ranks=8)]}
    text = fanin.render(out)
    assert "a heartbeat from every rank every 5 s" in text and "8 cards' telemetry" in text
    assert "the member-to-leader stream in 62 of 64 groups (their 3,906 members hand" in text
    assert "max over 40 steps" in text and "p99 over 250 steps" in text
    table, verdicts = run_all.targets_table({"fanin": out}, 600.0)
    assert "max over 40 steps" in table and "heartbeat from every rank every 5 s" in table
    assert "left out: the member-to-leader stream in 6 of 8 groups" in table
    agent = next(line for line in table.splitlines() if "Atlas A3" in line)
    assert "16 ranks" in agent and "worst of 2: 5.20% of a core" in agent and "missed" in agent
    assert "8 ranks at 10 steps/s" in agent


def test_results_stored_before_still_render():
    old = {"targets": [fanin.judge(t, [{k: v for k, v in _run(t["ranks"]).items()
                                        if k not in ("heartbeat_s", "end_to_end_p99_ms", "hop_groups")}])
                       for t in fanin.TARGETS],
           "agent": [{"ranks": 8, "rate": 20.0, "steps": 300, "cpu_ms_per_step": 1.4, "idle_cpu_ms_per_step": 0.4}]}
    table, _ = run_all.targets_table({"fanin": old}, 600.0)
    assert "node agent <= 1 ms of CPU per step for 8 ranks" in table
    assert "no card telemetry or heartbeats" in table
    fanin.render(old)


def test_node_batches_pack_as_the_uplink_sends_them():
    blob = _node_sim.node_batches([2], _overrides(1024), 1, 2.0)[2][1]
    batch = msgpack.unpackb(blob, raw=False, strict_map_key=False)
    assert from_wire(batch["partials"][0]).step == 1


@pytest.mark.parametrize("sink", ["mlflow", "swanlab"])
def test_a_tracker_sink_reaches_the_aggregator_through_the_launchers_settings(sink):
    settings = fanin.C.aggregator_settings(*fanin.overrides_of(4096, 8, True, 0, 0, sink))
    assert getattr(settings.config.sinks, sink).enabled
    other = {"mlflow": "swanlab", "swanlab": "mlflow"}[sink]
    assert not getattr(settings.config.sinks, other).enabled
    none = fanin.C.aggregator_settings(*fanin.overrides_of(4096, 8, True, 0, 0))
    assert not none.config.sinks.mlflow.enabled and not none.config.sinks.swanlab.enabled


def test_the_exporter_benchmark_takes_the_launchers_settings():
    import exporter

    for name in exporter.SINKS:
        cfg = fanin.C.aggregator_settings(*exporter.sink_overrides(name, 9400)).config
        assert cfg.world.world_size == 8 and cfg.output.tensorboard == (name == "tensorboard")
        assert cfg.exporters.prometheus.port == (9400 if name == "prometheus" else 0)
        assert cfg.sinks.mlflow.enabled == (name == "mlflow") and cfg.sinks.swanlab.enabled == (name == "swanlab")


def test_the_fanin_with_each_sink_reports_cpu_per_step_and_what_it_leaves_out():
    runs = {s: [_run(4096, sink=s, tensorboard=True, asked_steps_per_s=2.0, aggregator_cpu_ms_per_step=ms,
                     tracker_lines=lines)]
            for s, ms, lines in (("none", 50.0, []), ("mlflow", 58.5, ["MLflow run x (new) in file:///r/mlruns"]),
                                 ("swanlab", 61.0, ["SwanLabSink failed in on_reduced (TrackerFailed: ended)"]))}
    target = fanin.TARGETS[0]
    out = {"sink_runs": runs, "target": target, "judged": {s: fanin.judge(target, r) for s, r in runs.items()}}
    text = fanin.render(out)
    assert "| mlflow  | 1     |" in text and "+8.50" in text and "58.50" in text
    assert "left out: " in text and "an MLflow tracking server (no network round trip: a file store)" in text
    assert "SwanLab's upload (offline mode writes files only)" in text
    table, _ = run_all.targets_table({"fanin_sinks": out}, 600.0, 1140.0)
    rows = {s: next(line for line in table.splitlines() if f"tracker sink {s}:" in line) for s in runs}
    assert "worst of 1: 58.50 ms of CPU per reduced step (+8.50 ms over none)" in rows["mlflow"]
    assert "left out: the member-to-leader stream" in rows["mlflow"] and "an MLflow tracking server" in rows["mlflow"]
    assert "achieved >= 1.95" in rows["none"] and "| met " in rows["none"]
    assert "the tracker failed" in rows["swanlab"] and "| missed " in rows["swanlab"]
    skipped = {"sink_runs": {"swanlab": [{"sink": "swanlab", "skipped": "swanlab is not installed"}]},
               "target": target, "judged": {}}
    assert "not measured" in run_all.targets_table({"fanin_sinks": skipped}, 600.0, 1140.0)[0]
    fanin.render(skipped)


def test_the_sink_runs_section_is_rendered_by_the_fanin_module_under_the_exporters():
    assert run_all._module_of("fanin_sinks") == "fanin" and run_all._module_of("memory_tb") == "memory"
    assert "fanin_sinks" in run_all.RELATED["exporter"]
    piece = next(p for p in run_all.PIECES if p.name == "fanin_sinks")
    assert "none,mlflow,swanlab" in piece.args and "4096" in piece.args and "4096" in piece.reduced_args


def test_replayed_leader_frames_reduce_every_step_of_the_cycle_and_beyond(tmp_path):
    """bench/_replay.py: frames built once by the node pre-reducer and the real GroupLeader,
    replayed with their step written in past the cycle, over real uplinks to the aggregator
    actor's uplink server (no Ray: the actor class in a loop of this process); every step is
    reduced from every rank, nothing refused, each node's heartbeats one record."""
    import asyncio
    import threading

    import _replay

    from mindpulse.aggregator.core import AggregatorCore
    from mindpulse.rundir.metrics_store import read_wire
    from mindpulse.wire.uplink import UplinkServer

    ranks, rpn, steps = 64, 8, _replay.CYCLE + 5
    p = fanin.plan(ranks, rpn, 4, 0)
    ov = fanin.overrides_of(ranks, rpn, False, 0, 4)
    frames = _replay.group_frames(p["groups"], ov, _replay.cycle_steps(steps), 2.0)
    t = _replay.Template(*reversed(msgpack.unpackb(frames[0][3])))
    assert len(t.offsets) >= 4 * rpn, "every raw packet's step and the partial's can be written in"

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    run = lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(60)  # noqa: E731
    settings = fanin.C.aggregator_settings(*ov)

    core = AggregatorCore(tmp_path / "run", ranks, 10, None, settings)

    def ingest(entries):  # what the actor's ingest_nodes does: the lease pushed once a step is reduced
        if core.ingest_nodes(entries):
            server.push_lease()

    async def directive(step, timeout):
        return core.directive_for(step).encode()

    server = UplinkServer(ingest, directive, lambda: core.lease().encode())
    run(server.start("127.0.0.1"))
    rep = _replay.Replay(None, p["groups"], frames, rpn, 0.2, 0.3, 10.0, 0, address=server.address)
    try:
        deadline = time.time() + 20
        while rep.connected() < len(p["groups"]) and time.time() < deadline:
            time.sleep(0.05)
        rep.start()
        for s in range(steps + 1):
            rep.send_step(s, False)
            assert rep.wait(s, -1, 5.0)[1] < 5.0, \
                f"step {s} was not reduced: {core.snapshot()['packets']}, missing ranks {core.missing_for(s)}"
        time.sleep(0.5)  # heartbeats and samples of a few flush windows
        ends = rep.close()
    finally:
        run(server.close())
        snap = core.snapshot()
        core.close()
        loop.call_soon_threadsafe(loop.stop)
    assert ends["lost"] == 0 and ends["bad_leases"] == 0
    assert ends["heartbeats"] > 0 and ends["telemetry"] > 0
    assert snap["packets"]["rejected"] == 0, snap["packets"]
    stored = [(o["rank"], o["step"]) for o in read_wire(tmp_path / "run" / "metrics.msgpack") if o.get("t") == "step"]
    assert sorted(stored) == sorted((r, s) for s in range(steps + 1) for r in range(ranks)), \
        "every rank's packet of every step, the replayed ones with their own step"
