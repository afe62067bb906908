"""The aggregator's Prometheus endpoint: a real HTTP server on a free loopback port, scraped
as Prometheus scrapes it, its text parsed with prometheus_client's own parser and checked with
`promtool check metrics` (Debian's prometheus package) where it is installed."""

from __future__ import annotations

import math
import shutil
import socket
import subprocess
import time
import urllib.request

import pytest

from mindpulse.aggregator.core import AggregatorCore
from mindpulse.config import ConfigError, from_dict
from mindpulse.wire.protocol import EventKind, EventPacket, StepPacket, TelemetryPacket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.status == 200
        return resp.read().decode()


def samples(text: str) -> dict[str, list]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


def one(got: dict[str, list], name: str, **labels) -> float:
    hits = [s.value for s in got.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(hits) == 1, (name, labels, got.get(name))
    return hits[0]


def test_the_endpoint_serves_the_registry_series_anomalies_and_cards(tmp_path):
    port = free_port()
    started = time.time()
    core = AggregatorCore(tmp_path / "run-1", world_size=2, per_print_step=100, settings={
        "tensorboard": False, "exporters": {"prometheus": {"port": port}},
        "anomalies": [{"rule": "nonfinite", "action": "warn"}]})
    try:
        assert f"metrics for Prometheus: http://127.0.0.1:{port}/metrics" in core.drain_console()
        core.ingest([TelemetryPacket(node="node0-hostA", ts=1.0, source="psutil", cards=[
            {"card": 3, "util_pct": 40.0, "memory_used_mb": 1024.0, "memory_total_mb": 2048.0, "power_w": 90.0,
             "temp_c": 55.0}]).encode()])
        for s in range(1, 6):
            core.ingest([StepPacket(rank=r, step=s, loss=(math.nan if (s, r) == (4, 1) else 2.0 - 0.1 * s + r),
                                    step_time_s=0.1 + 0.01 * r, samples=8, tokens=512, grad_norm=1.5,
                                    grad_norm_local=1.0 + r, monitor_self_s=0.001 * (r + 1), ts=100.0 + s).encode()
                         for r in range(2)])
        core.ingest([EventPacket(rank=0, step=5, kind=EventKind.CHECKPOINT, message="x").encode()])
        core.run_sinks()
        text = scrape(f"http://127.0.0.1:{port}/metrics")
    finally:
        core.close()
    got = samples(text)
    assert one(got, "mindpulse_run_info", run="run-1", world_size="2", backend="ray") == 1
    assert one(got, "mindpulse_step", run="run-1") == 5 and one(got, "mindpulse_steps_total") == 5
    assert one(got, "mindpulse_loss", stat="mean") == pytest.approx((1.5 + 2.5) / 2)
    assert one(got, "mindpulse_loss", stat="rank", rank="1", node="0") == pytest.approx(2.5)
    assert one(got, "mindpulse_grad_norm", stat="global") == 1.5
    assert one(got, "mindpulse_grad_norm", stat="local", rank="1") == 2.0
    assert one(got, "mindpulse_step_duration_seconds", stat="max") == pytest.approx(0.11)
    assert one(got, "mindpulse_monitor_self_seconds", stat="max") == pytest.approx(0.002)
    assert one(got, "mindpulse_tokens_per_second") == pytest.approx(1024 / 0.11)
    assert started <= one(got, "mindpulse_last_step_timestamp_seconds", rank="0") <= time.time()
    assert started <= one(got, "mindpulse_node_last_step_timestamp_seconds", node="0") <= time.time()
    # the NaN of rank 1 at step 4: counted, and the rule that fired
    assert one(got, "mindpulse_nonfinite_total", rank="", node="") == 1
    assert one(got, "mindpulse_nonfinite_total", rank="1") == 1
    assert one(got, "mindpulse_anomalies_total", rule="nonfinite", action="warn") == 1
    # the card, labelled to join the NPU Exporter's series of the same card (its id, the host)
    assert one(got, "mindpulse_card_utilization_ratio", host="hostA", id="3") == pytest.approx(0.4)
    assert one(got, "mindpulse_card_memory_used_bytes", id="3") == 1024.0 * 1024 * 1024
    assert one(got, "mindpulse_card_temperature_celsius", id="3") == 55.0
    assert one(got, "mindpulse_checkpoint_last_step") == 5
    assert not any("step" in s.labels for fam in got.values() for s in fam), "the step is never a label"
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (apt-get install prometheus): the text was parsed, not linted")
    lint = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert lint.returncode == 0, lint.stdout + lint.stderr


def test_the_endpoint_is_off_by_default_and_closes_with_the_aggregator(tmp_path):
    port = free_port()
    core = AggregatorCore(tmp_path, world_size=1, per_print_step=100,
                          settings={"tensorboard": False, "exporters": {"prometheus": {"port": port}}})
    core.close()
    with pytest.raises(OSError):
        scrape(f"http://127.0.0.1:{port}/metrics")
    off = AggregatorCore(tmp_path / "off", world_size=1, per_print_step=100, settings={"tensorboard": False})
    assert off.sinks.outputs == []
    off.close()


def test_a_taken_port_is_said_and_the_run_goes_on(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        core = AggregatorCore(tmp_path, world_size=1, per_print_step=100,
                              settings={"tensorboard": False, "exporters": {"prometheus": {"port": port}}})
        core.ingest([StepPacket(rank=0, step=1, loss=1.0).encode()])
        console = "\n".join(core.drain_console())
        core.close()
    assert f"prometheus endpoint 127.0.0.1:{port} did not start" in console
    assert core.last_reduced is not None and core.last_reduced.step == 1


@pytest.mark.parametrize("raw, needle", [
    ({"exporters": {"prometheus": {"port": 70000}}}, "exporters.prometheus.port"),
    ({"exporters": {"prometheus": {"port": 9400, "address": "localhost"}}}, "exporters.prometheus.address"),
    ({"exporters": {"prometheus": {"port": 9400, "adress": "0.0.0.0"}}}, "exporters.prometheus.adress"),
])
def test_bad_exporter_config_names_the_key(raw, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        from_dict(raw)


def test_a_port_in_use_refuses_the_launch_naming_the_key():
    from mindpulse.launcher.preflight import LaunchRefused, check_local

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(LaunchRefused, match=rf"exporters\.prometheus\.port: 127\.0\.0\.1:{port} cannot be served"):
            check_local(from_dict({"exporters": {"prometheus": {"port": port}}}))
    check_local(from_dict({"exporters": {"prometheus": {"port": free_port()}}}))  # a free one passes


def test_beyond_256_ranks_only_the_cards_and_ranks_that_matter_have_series(tmp_path):
    """A 1,024-rank job: every card's spread, the hot card by name, not 1,024 cards' series."""
    from prometheus_client import generate_latest

    from mindpulse.aggregator.prometheus_exporter import CARDS_THAT_MATTER, PrometheusExporter
    from mindpulse.config import PrometheusConfig
    from mindpulse.reduction.reducer import reduce_step

    exp = PrometheusExporter(PrometheusConfig(port=free_port()), run="big", world_size=1024, ranks_per_node=8)
    try:
        for n in range(128):
            exp.on_telemetry(f"node{n}-h{n}", [{"card": c, "util_pct": 50.0, "temp_c": 95.0 if (n, c) == (77, 5)
                                                else 60.0, "power_w": 300.0, "memory_used_mb": 100.0}
                                               for c in range(8)])
        packets = {r: StepPacket(rank=r, step=1, loss=1.0 + (5.0 if r == 700 else 0.0), step_time_s=0.5)
                   for r in range(1024)}
        exp.on_reduced(reduce_step(1, packets, 1024))
        got = samples(generate_latest(exp.registry).decode())
    finally:
        exp.close()
    temps = got["mindpulse_card_temperature_celsius"]
    assert len(temps) <= 4 * CARDS_THAT_MATTER
    assert any(s.labels["host"] == "h77" and s.labels["id"] == "5" and s.value == 95.0 for s in temps)
    assert one(got, "mindpulse_cards_temperature_celsius", stat="max") == 95.0
    assert one(got, "mindpulse_cards_utilization_ratio", stat="mean") == pytest.approx(0.5)
    rank_loss = {s.labels["rank"] for s in got["mindpulse_loss"] if s.labels["stat"] == "rank"}
    assert "700" in rank_loss and len(rank_loss) < 16, rank_loss  # the extremes, not 1,024 ranks


def test_beyond_256_ranks_a_hung_rank_and_a_failed_rank_keep_their_last_step_series(tmp_path):
    """A 1,024-rank job: rank 77 hangs after step 1 (the others reach step 2), rank 500 reports an
    error. Neither holds an extreme of a step, yet both keep `mindpulse_last_step_timestamp_seconds`
    (a hang alert reads its age), beside the few other ranks that matter, not 1,024 series."""
    from mindpulse.aggregator.prometheus_exporter import OLDEST_RANKS

    port = free_port()
    world, rpn = 1024, 8
    core = AggregatorCore(tmp_path / "big", world_size=world, per_print_step=100, settings={
        "tensorboard": False, "world": {"nodes": world // rpn, "ranks_per_node": rpn},
        "exporters": {"prometheus": {"port": port}}})
    try:
        for step in (0, 1, 2):  # step 0: the step each rank starts at (its clock runs from its next)
            core.ingest([StepPacket(rank=r, step=step, loss=1.0 + 1e-4 * r, step_time_s=0.5 + 1e-5 * r, samples=4,
                                    tokens=256, ts=100.0 + step).encode() for r in range(world)
                         if not (r == 77 and step == 2)])
            time.sleep(0.02)  # rank 77's last step is older than every other rank's
        core.ingest([EventPacket(rank=500, step=2, kind=EventKind.ERROR, message="data loader failed").encode()])
        core.run_sinks()
        assert core.last_reduced is not None and core.last_reduced.step == 1  # step 2 waits for rank 77
        got = samples(scrape(f"http://127.0.0.1:{port}/metrics"))
    finally:
        core.close()
    last = {s.labels["rank"]: s.value for s in got["mindpulse_last_step_timestamp_seconds"]}
    assert "77" in last and last["77"] == min(last.values()), last
    assert "500" in last, sorted(last)
    shown = {s.labels["rank"] for s in got["mindpulse_loss"] if s.labels["stat"] == "rank"}
    assert "77" not in shown and "500" not in shown  # they matter for their clock, not their values
    assert len(last) <= len(shown) + OLDEST_RANKS + 1, sorted(last)


def test_beyond_256_ranks_a_node_whose_partials_stopped_shows_its_ranks_last_step():
    """Through node agents a rank's clock is its node's partials: the node that stopped at step 1
    (its ranks hung or its agent gone) holds the oldest ranks, which keep their series."""
    from prometheus_client import generate_latest

    from mindpulse.aggregator.hang_clocks import HangClocks
    from mindpulse.aggregator.prometheus_exporter import OLDEST_RANKS, PrometheusExporter
    from mindpulse.config import PrometheusConfig

    clocks = HangClocks(4096, 8, 600.0, "cpu")
    exp = PrometheusExporter(PrometheusConfig(port=free_port()), run="big", world_size=4096, ranks_per_node=8)
    exp.watch_progress(clocks)
    try:
        for step in (0, 1, 2):
            clocks.on_node_step([n for n in range(512) if not (n == 9 and step == 2)], step)
            time.sleep(0.02)
        got = samples(generate_latest(exp.registry).decode())
    finally:
        exp.close()
    last = {int(s.labels["rank"]): s.value for s in got["mindpulse_last_step_timestamp_seconds"]}
    assert sorted(last) == list(range(72, 80)) and len(last) == OLDEST_RANKS
    assert one(got, "mindpulse_node_last_step_timestamp_seconds", node="9") == last[72] < one(
        got, "mindpulse_node_last_step_timestamp_seconds", node="10")


def test_a_big_jobs_card_view_is_the_plain_reading_of_every_nodes_newest_sample():
    """The arrays a big job's scrape reads (one row a node, rewritten by each sample) give what a
    plain pass over every node's newest sample gives: the job's min, mean and max of each value,
    and for hot, power-hungry, full and idle the extreme card of the most extreme nodes."""
    import random

    from mindpulse.aggregator.prometheus_exporter import (
        _CARD_SERIES,
        CARDS_THAT_MATTER,
        _NodeCards,
        _NodeSpreads,
    )
    from mindpulse.reporting.tables import CARD_EXTREMES

    rng = random.Random(7)
    spreads, nodes = _NodeSpreads(), {}
    for _ in range(600):  # 150 nodes, each sampled several times (a node's row is rewritten)
        node = f"node{rng.randrange(150)}-h"
        cards = [{"card": c, **{key: (None if rng.random() < 0.1 else round(rng.uniform(0, 500), 1))
                                for _, key, _, _ in _CARD_SERIES}} for c in range(rng.choice([0, 1, 8]))]
        nodes[node] = _NodeCards.of(cards)
        spreads.put(node, nodes[node].spread)
    shown, spread = spreads.view(nodes)
    for _, key, _, _ in _CARD_SERIES:
        every = [v for nc in nodes.values() for c in nc.cards.values() if (v := c.get(key)) is not None]
        assert spread[key][0] == min(every) and spread[key][3] == max(every), key
        assert spread[key][1] / spread[key][2] == pytest.approx(sum(every) / len(every)), key
    want = set()
    for key, biggest in CARD_EXTREMES:
        ends = [(nc.spread[key][3] if biggest else -nc.spread[key][0], n)
                for n, nc in nodes.items() if key in nc.spread]
        cut = sorted((v for v, _ in ends), reverse=True)[CARDS_THAT_MATTER - 1]
        top = [n for v, n in ends if v > cut]  # ties at the cut may go either way
        tied = {n for v, n in ends if v == cut}
        mine = {n for n, cid in shown if nodes[n].spread.get(key) and cid == nodes[n].spread[key][4 if biggest else 5]}
        assert set(top) <= mine, key
        want.update((n, nodes[n].spread[key][4 if biggest else 5]) for n in top)
        assert len({n for n in mine if n in tied or n in top}) >= CARDS_THAT_MATTER, key
    assert want <= shown and len(shown) <= len(CARD_EXTREMES) * CARDS_THAT_MATTER
