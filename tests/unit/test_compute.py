"""Compute on every card: FLOPs per token, achieved TFLOPS, the peak, MFU and compute_drop."""

from __future__ import annotations

import json
import math

import pytest

from mindpulse.aggregator.card_peaks import card_peak, resolve_peak
from mindpulse.aggregator.core import AggregatorCore
from mindpulse.aggregator.policies import ComputeDropRule
from mindpulse.aggregator.reducer import StepReducer, finalize, reduce_step
from mindpulse.aggregator.tables import card_table, cluster_table
from mindpulse.partial import NodeComputeDrops, from_wire, merge, partial_of, to_wire
from mindpulse.protocol import StepPacket
from mindpulse.workers.flops import achieved_tflops, decoder_flops_per_token


# ---- FLOPs per token ---------------------------------------------------------------------------
def test_the_recipes_flops_per_token_by_hand():
    from mindpulse.workers.recipes.llama_finetune import ModelShape, flops_per_token, llama_parameters

    shape = ModelShape()  # seq 64, width 64, 2 layers, 4 heads, feed-forward 128; 256 byte tokens
    # embedding 256x64 and output head 64x256; per block wq wk wv wo 64x64, w1 w3 128x64, w2 64x128,
    # two RMSNorm weights of 64; the final norm 64 (the built model lists exactly these: 115,008)
    n = 256 * 64 + 64 * 256 + 2 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64
    assert n == 115_008 == llama_parameters(shape)
    # 6N + 12·L·d·s = 690,048 + 12·2·64·64 = 690,048 + 98,304
    assert flops_per_token(shape) == 6 * 115_008 + 12 * 2 * 64 * 64 == 788_352
    assert decoder_flops_per_token(115_008, 2, 64, 64) == 788_352
    # 8 windows of 64 tokens in 0.5 s: 512 x 788,352 / 0.5 / 1e12
    assert achieved_tflops(512, 788_352, 0.5) == pytest.approx(8.0724e-4, rel=1e-4)
    assert achieved_tflops(0, 788_352, 0.5) is None and achieved_tflops(512, 788_352, 0.0) is None


def test_the_rank_ships_tokens_and_tflops_over_its_own_time(tmp_path):
    from test_rank_session import Recording, settings

    from mindpulse.workers.session import RankSession

    ch = Recording()
    s = RankSession(settings(tmp_path), rank=1, channel=ch, tokens_per_step=512, flops_per_token=1e9)
    s.record(1.0, step_time_s=2.0, data_wait_s=0.5, compute_s=0.5)  # its own time: 0.5 + 0.5 s
    s.record(1.0, step_time_s=2.0)  # compute not measured: the step time
    s.record(1.0, step_time_s=2.0, tokens=0)
    a, b, c = [p for p in ch.packets if isinstance(p, StepPacket)]
    assert (a.tokens, a.tflops) == (512, pytest.approx(512 * 1e9 / 1.0 / 1e12))
    assert (b.tokens, b.tflops) == (512, pytest.approx(512 * 1e9 / 2.0 / 1e12))
    assert (c.tokens, c.tflops) == (0, None)
    s2 = RankSession(settings(tmp_path), rank=1, channel=Recording())  # nothing known: no figure
    s2.record(1.0, step_time_s=1.0)
    assert [(p.tokens, p.tflops) for p in s2.channel.packets if isinstance(p, StepPacket)] == [(0, None)]


# ---- reduction -----------------------------------------------------------------------------------
def _pk(rank, step, tflops, tokens=512, st=1.0):
    return StepPacket(rank=rank, step=step, loss=1.0, step_time_s=st, samples=8, tokens=tokens, tflops=tflops)


def test_tokens_and_tflops_reduce_exactly_with_their_ranks():
    packets = {r: _pk(r, 3, v, st=1.0 + r / 10) for r, v in enumerate([0.1, 0.3, 0.2, None])}
    red = reduce_step(3, packets, 4)
    assert red.tokens == 2048 and red.tokens_per_s == pytest.approx(2048 / 1.3)
    assert red.tflops_mean == 0.6 / 3 or red.tflops_mean == pytest.approx(0.2, abs=0)
    assert (red.tflops_min, red.tflops_min_rank, red.tflops_max, red.tflops_max_rank) == (0.1, 0, 0.3, 1)
    assert red.mfu_mean is None and red.metric("mfu") is None
    red.set_peak(0.5)
    assert red.metric("mfu") == red.tflops_mean / 0.5 and (red.mfu_min, red.mfu_min_rank) == (0.2, 0)
    assert (red.mfu_max, red.mfu_max_rank) == (0.6, 1) and red.metric("tflops") == red.tflops_mean
    # two nodes' partials, through the wire, merge to the same figures bit for bit
    a = from_wire(to_wire(partial_of(3, {0: packets[0], 1: packets[1]})))
    b = from_wire(to_wire(partial_of(3, {2: packets[2], 3: packets[3]})))
    merged = finalize(merge(a, b), 4)
    for k in ("tokens", "tokens_per_s", "tflops_mean", "tflops_min", "tflops_min_rank", "tflops_max",
              "tflops_max_rank"):
        assert getattr(merged, k) == getattr(reduce_step(3, packets, 4), k), k


@pytest.mark.parametrize("field, bad", [("tflops_min", [math.nan, 0]), ("tflops_max", [1.0, -1]),
                                        ("tflops_mean", [-1, b"\x00"]), ("tflops_mean", [1, 3]),
                                        ("compute_drops", [[0, 1.0]]), ("compute_drops", [[0, -1.0, 1.0]])])
def test_a_partial_with_bad_compute_fields_is_refused(field, bad):
    w = to_wire(partial_of(1, {0: _pk(0, 1, 0.1)}))
    if field == "compute_drops":
        w[field] = bad
    else:
        w["values"][field] = bad
    with pytest.raises(ValueError):
        from_wire(w)


def test_a_partial_of_an_older_node_without_compute_fields_still_reduces():
    w = to_wire(partial_of(1, {0: _pk(0, 1, 0.1)}))
    for k in ("tokens", "tflops_mean", "tflops_min", "tflops_max"):
        w["values"].pop(k)
    w.pop("compute_drops")
    red = finalize(from_wire(w), 1)
    assert red.tokens == 0 and red.tflops_mean is None and red.compute_flags is None


# ---- the peak --------------------------------------------------------------------------------------
def test_the_card_table_knows_the_cards_by_their_telemetry_names():
    assert card_peak("910B3") == ("Ascend 910B3", 313.0)
    assert card_peak("Ascend910B4") == ("Ascend 910B4", 280.0)
    assert card_peak("910B3", "float32") is None, "no float32 figure: no guess"
    assert card_peak("NVIDIA H100 80GB HBM3", "bfloat16") == ("NVIDIA H100", 989.0)
    assert card_peak("NVIDIA H100 PCIe", "float16") == ("NVIDIA H100 PCIe", 756.0)
    assert card_peak("NVIDIA H200", "float32") == ("NVIDIA H200", 67.0)
    assert card_peak("NVIDIA A100-SXM4-80GB") == ("NVIDIA A100", 312.0)
    assert card_peak("910") == ("Ascend 910A", 256.0) and card_peak("310P3") == ("Ascend 310P", 70.0)
    assert card_peak("910_9391") == ("Ascend 910_93 (A3)", 376.0)
    assert card_peak("cpu") is None and card_peak(None) is None


def test_the_peak_comes_from_the_config_then_the_preflight_then_the_table(tmp_path):
    assert resolve_peak(100.0, tmp_path, ["910B3"]) == (100.0, "config (world.peak_tflops)")
    peak, why = resolve_peak(0.0, tmp_path, ["cpu"])
    assert peak is None and "cpu is not in the table" in why and "world.peak_tflops" in why
    assert resolve_peak(0.0, tmp_path, ["910B3"], "float16") == (313.0, "table (Ascend 910B3, float16)")
    (tmp_path / "preflight.json").write_text(json.dumps({"median": {"matmul_gflops": 12.5}}))
    peak, why = resolve_peak(0.0, tmp_path, ["cpu"])
    assert peak == pytest.approx(0.0125) and why.startswith("preflight")
    peak, why = resolve_peak(0.0, None, ["910B3", "910B4"], "float16")
    assert peak == 280.0 and "lowest" in why


# ---- the compute_drop rule ---------------------------------------------------------------------------
def test_node_compute_drops_flag_only_the_rank_that_fell():
    drops = NodeComputeDrops(window=8)
    flagged = []
    for s in range(1, 21):
        flagged.append(drops.update(s, {0: _pk(0, s, 1.0), 1: _pk(1, s, 1.0 if s < 9 else 0.4)}))
    assert flagged[:8] == [[]] * 8
    # the drop stays out of the baseline (the bar does not sink with it) for a whole window...
    assert flagged[8:16] == [[[1, 0.4, 1.0]]] * 8
    # ...then it is the rank's new level
    assert flagged[16:] == [[]] * 4 and list(drops.history[1]) == [0.4] * 8


def test_compute_drop_fires_once_after_for_steps_naming_the_rank_and_its_card():
    rule = ComputeDropRule({"rule": "compute_drop"})  # defaults: factor 0.7, for_steps 3
    assert (rule.factor, rule.for_steps, rule.action.value) == (0.7, 3, "warn")
    red = reduce_step(5, {0: _pk(0, 5, 1.0), 1: _pk(1, 5, 0.4)}, 2)
    red.set_peak(2.0)
    red.rank_cards = {1: "node 0 card 1 (910B3)"}
    red.compute_flags = [[1, 0.4, 1.0]]
    fired = [rule.check(red) for _ in range(4)]
    assert fired[:2] == [None, None] and fired[3] is None, "once per excursion"
    f = fired[2]
    assert f.rank == 1 and f.value == pytest.approx(0.2) and f.threshold == pytest.approx(0.35)
    assert "rank 1 on node 0 card 1 (910B3)" in f.message and "MFU 0.2" in f.message
    red.compute_flags = [[1, 0.9, 1.0]]  # below 0.95, above the factor: no hit
    assert rule.check(red) is None and rule.hits == {}


def _run_core(tmp_path, slow_from=9, steps=14, settings=None):
    (tmp_path / "preflight.json").write_text(json.dumps({"median": {"matmul_gflops": 20.0}}))
    core = AggregatorCore(tmp_path, world_size=2, per_print_step=5, settings=settings or {"tensorboard": False})
    for s in range(1, steps + 1):
        core.ingest([_pk(0, s, 0.010).encode(), _pk(1, s, 0.010 if s < slow_from else 0.004).encode()])
    core.close()
    return core


def test_the_flat_path_sets_mfu_names_the_slow_rank_and_fills_the_summary(tmp_path):
    core = _run_core(tmp_path)
    red = core.last_reduced
    assert red.peak_tflops == pytest.approx(0.02) and red.mfu_max == pytest.approx(0.5)
    assert red.mfu_min == pytest.approx(0.2) and red.mfu_min_rank == 1
    recs = [json.loads(x) for x in (tmp_path / "anomalies.jsonl").read_text().splitlines()]
    drop = [r for r in recs if r["rule"] == "compute_drop"]
    assert len(drop) == 1 and drop[0]["rank"] == 1 and drop[0]["step"] == 11, recs
    comp = core.snapshot()["compute"]
    assert comp["peak_tflops"] == pytest.approx(0.02) and comp["peak_source"].startswith("preflight")
    assert 0 < comp["mfu"] <= 1 and comp["tokens_per_s"] == pytest.approx(1024.0)
    assert comp["tflops_per_card"] == pytest.approx(0.010)
    text = "\n".join(core.console)
    assert "tokens/s" in text and "MFU" in text and "0.350 (0.200 r1..0.500 r0)" in text
    assert "MFU: peak 0.02 TFLOPS per card from the preflight" in text


def test_mfu_and_tokens_per_s_are_metrics_of_threshold_rules(tmp_path):
    _run_core(tmp_path, settings={"tensorboard": False, "anomalies": [
        {"rule": "threshold", "metric": "mfu", "op": "<", "threshold": 0.4, "for_steps": 2},
        {"rule": "threshold", "metric": "tokens_per_s", "op": "<", "threshold": 2000},
        {"rule": "compute_drop", "enabled": False}]})
    rules = [json.loads(x)["rule"] for x in (tmp_path / "anomalies.jsonl").read_text().splitlines()]
    assert "mfu<0.4" in rules and "tokens_per_s<2000" in rules and "compute_drop" not in rules


def test_the_node_path_flags_on_the_node_and_the_aggregator_merges_the_flags():
    from mindpulse.node.relay import NodePreReducer

    nodes = [NodePreReducer(n, range(2 * n, 2 * n + 2), compute_window=8, world_size=4) for n in (0, 1)]
    red = StepReducer(4, ranks_per_node=2)
    flags = {}
    for s in range(1, 12):
        for r in range(4):
            nodes[r // 2].add(_pk(r, s, 0.3 if (r == 3 and s >= 9) else 1.0).encode())
        out = []
        for n, node in enumerate(nodes):
            for w in node.take()["partials"]:
                out += red.add_partial(n, from_wire(w))
        (done,) = out
        flags[s] = done.compute_flags
    assert flags[8] == [] and flags[9] == [[3, 0.3, 1.0]], flags


def test_the_tables_show_tokens_mfu_and_each_cards_tflops():
    red = reduce_step(4, {0: _pk(0, 4, 0.01), 1: _pk(1, 4, 0.005)}, 2)
    red.set_peak(0.02)
    text = cluster_table(red)
    head = text.splitlines()[1]
    assert "tokens/s" in head and "MFU" in head
    assert "1024" in text and "0.375 (0.250 r1..0.500 r0)" in text
    cards = [{"node": 0, "card": 0, "ranks": [0], "util_pct": 90.0}, {"node": 0, "card": 1, "ranks": [1]}]
    table = card_table(cards, lambda c: {0: 0.01, 1: None}[c["card"]])
    assert table.splitlines()[0].split()[:5] == ["node", "card", "ranks", "util", "TFLOPS"]
    assert "0.01" in table
    assert "TFLOPS" not in card_table(cards)


def test_tensorboard_has_tokens_per_s_mfu_and_each_ranks_mfu(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from mindpulse.aggregator.tb_sink import TensorBoardSink

    sink = TensorBoardSink(tmp_path, collect_freq=10)
    for s in (1, 2):
        red = reduce_step(s, {0: _pk(0, s, 0.01), 1: _pk(1, s, 0.005)}, 2)
        red.set_peak(0.02)
        sink.on_reduced(red)
    sink.close()
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"throughput/tokens_per_s", "compute/mfu/mean", "compute/mfu/min", "compute/mfu/max",
            "rank_0/mfu", "rank_1/mfu", "rank_1/tflops"} <= tags, tags
    assert acc.Scalars("compute/mfu/min")[-1].value == pytest.approx(0.25)
    assert acc.Scalars("rank_0/mfu")[-1].value == pytest.approx(0.5)


def test_top_shows_mfu_and_card_tflops_from_the_run_directory(tmp_path):
    from mindpulse.views.top import RunView

    _run_core(tmp_path)  # metrics.msgpack and preflight.json, as a run leaves them
    (tmp_path / "config.yaml").write_text("world: {ranks_per_node: 2}\n")
    view = RunView(tmp_path)
    view.refresh()
    text = view.render()
    assert "0.350 (0.200 r1..0.500 r0)" in text, text


def test_the_monitor_takes_tokens_per_step_from_the_datasets_first_column():
    from mindpulse.workers.monitor import _tokens_per_batch

    class Ds:
        def __init__(self, shapes):
            self.shapes = shapes

        def output_shapes(self):
            return self.shapes

    assert _tokens_per_batch(Ds([[8, 65], [8]])) == 8 * 65
    assert _tokens_per_batch(Ds([[8]])) is None and _tokens_per_batch(None) is None
    assert _tokens_per_batch(Ds("broken")) is None


def test_the_run_summary_line_of_compute():
    from mindpulse.views.report import compute_text

    comp = {"tokens_per_s": 544.0, "tflops_per_card": 0.000449, "mfu": 0.015, "peak_tflops": 0.0299,
            "peak_source": "preflight (median float32 matmul, preflight.json)", "steps": 22}
    assert compute_text(comp) == ("544 tokens/s, 0.000449 TFLOPS per card, MFU 0.015 of a 0.0299 TFLOPS peak "
                                  "(preflight); medians over steps")
    assert "MFU - (no peak" in compute_text(dict(comp, mfu=None, peak_tflops=None))
    assert compute_text({"tokens_per_s": None, "tflops_per_card": None}) == "" == compute_text(None)
