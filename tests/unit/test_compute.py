"""Compute on every card: FLOPs per token, achieved TFLOPS, the peak, MFU and compute_drop."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from mindpulse.aggregator.core import AggregatorCore
from mindpulse.aggregator.policies import ComputeDropRule
from mindpulse.reduction.baselines import NodeComputeDrops
from mindpulse.reduction.partial import from_wire, merge, partial_of, to_wire
from mindpulse.reduction.reducer import StepReducer, finalize, reduce_step
from mindpulse.reporting.card_peaks import (
    CARD_PEAKS,
    DTYPES,
    NO_PUBLIC_PEAK,
    NoPublicPeak,
    card_peak,
    identify,
    peak_dtype,
    resolve_peak,
)
from mindpulse.reporting.tables import card_table, cluster_table
from mindpulse.wire.protocol import StepPacket
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
def _pk(rank, step, tflops, tokens=512, st=1.0, compute_s=0.5):
    """compute_s: measured (PYNATIVE), so compute_drop judges the rank."""
    return StepPacket(rank=rank, step=step, loss=1.0, step_time_s=st, samples=8, tokens=tokens, tflops=tflops,
                      compute_s=compute_s)


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
    assert card_peak("NVIDIA H100 80GB HBM3", "bfloat16") == ("NVIDIA H100 SXM", 989.5)
    assert card_peak("NVIDIA H100 PCIe", "float16") == ("NVIDIA H100 PCIe", 756.5)
    assert card_peak("NVIDIA H100 NVL", "float32") == ("NVIDIA H100 NVL", 60.0)
    assert card_peak("NVIDIA H200", "float32") == ("NVIDIA H200 SXM", 67.0)
    assert card_peak("NVIDIA H200 NVL", "tf32") == ("NVIDIA H200 NVL", 417.5)
    assert card_peak("NVIDIA A100-SXM4-80GB") == ("NVIDIA A100", 312.0)
    assert card_peak("NVIDIA A100 80GB PCIe", "float32") == ("NVIDIA A100", 19.5)
    assert card_peak("910") == ("Ascend 910", 256.0) and card_peak("Ascend910A") == ("Ascend 910", 256.0)
    assert card_peak("310") == ("Ascend 310", 8.0)
    assert card_peak("cpu") is None and card_peak(None) is None and card_peak("") is None


def test_a_name_that_merely_contains_a_cards_is_not_that_card():
    for name in ("NVIDIA GH200 480GB", "NVIDIA RTX A1000", "NVIDIA A100X", "NVIDIA H100L 94GB", "NVIDIA H800"):
        assert identify(name) is None, name


def test_no_figure_is_guessed_for_a_dtype_the_source_does_not_print():
    assert card_peak("910", "float32") is None and card_peak("910", "bfloat16") is None
    assert card_peak("310", "bfloat16") is None


def test_cards_without_a_vendor_figure_are_recognised_but_have_no_peak():
    for name in ("910B1", "910B2", "910B2C", "Ascend910B3", "910B4", "910B4-1", "910_9391", "Ascend910_9392",
                 "910ProB", "910PremiumA", "310P3", "310B1"):
        entry = identify(name)
        assert isinstance(entry, NoPublicPeak) and entry.why, name
        assert all(card_peak(name, d) is None for d in DTYPES), name


def test_every_table_entry_cites_its_source_and_keeps_only_known_dtypes():
    labels = [e.label for e in (*CARD_PEAKS, *NO_PUBLIC_PEAK)]
    assert len(labels) == len(set(labels))
    for entry in CARD_PEAKS:
        assert entry.peaks and set(entry.peaks) <= set(DTYPES), entry.label
        assert all(isinstance(v, float) and math.isfinite(v) and v > 0 for v in entry.peaks.values()), entry.label
        src = entry.source
        assert src.title and src.prints and src.url.startswith(("https://", "http://")), entry.label
        assert identify(entry.label) is entry, entry.label
        for dtype, peak in entry.peaks.items():  # each figure (or, for NVIDIA's sparse rows, twice it) is printed
            shown = {f"{peak:g}", f"{2 * peak:,g}"}
            assert any(x in src.prints for x in shown), (entry.label, dtype, peak)


def test_the_docs_table_lists_the_same_figures_as_the_code():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "compute.md").read_text()
    section = doc[doc.index("### The table of known cards"):doc.index("## Where it shows")]
    for entry in CARD_PEAKS:
        row = next((line for line in section.splitlines() if line.startswith(f"| {entry.label}")), None)
        assert row is not None, entry.label
        cells = [c.strip() for c in row.split(" | ")[1:5]]
        expected = [f"{entry.peaks[d]:g}" if d in entry.peaks else "-" for d in ("float32", "tf32", "float16",
                                                                                 "bfloat16")]
        assert cells == expected, (entry.label, cells, expected)
    for entry in NO_PUBLIC_PEAK:
        assert entry.label.split(" (")[0].split("/")[0] in section, entry.label


def test_the_peak_comes_from_the_config_then_the_preflight_then_the_table(tmp_path):
    assert resolve_peak(100.0, tmp_path, ["910B3"]) == (100.0, "config (world.peak_tflops)")
    peak, why = resolve_peak(0.0, tmp_path, ["cpu"])
    assert peak is None and "cpu is not in the table" in why and "world.peak_tflops" in why
    assert resolve_peak(0.0, tmp_path, ["NVIDIA H100 80GB HBM3"], "bfloat16") == (
        989.5, "table (NVIDIA H100 SXM, bfloat16)")
    (tmp_path / "preflight.json").write_text(json.dumps({"median": {"matmul_gflops": 12.5}}))
    peak, why = resolve_peak(0.0, tmp_path, ["cpu"])
    assert peak == pytest.approx(0.0125) and why.startswith("preflight")
    peak, why = resolve_peak(0.0, None, ["NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe"], "float16")
    assert peak == 756.5 and "lowest" in why


def test_without_a_peak_the_reason_names_the_card_and_what_is_missing(tmp_path):
    peak, why = resolve_peak(0.0, tmp_path, ["910B3"], "float16")
    assert peak is None and "card 910B3 (Ascend 910B) has no vendor-published peak" in why
    assert "world.peak_tflops" in why and "preflight.enabled=true" in why
    peak, why = resolve_peak(0.0, tmp_path, ["910"], "float32")
    assert peak is None and "card 910 (Ascend 910) has no float32 figure in its source (it has float16)" in why
    peak, why = resolve_peak(0.0, tmp_path, [], "float16")
    assert peak is None and "no card name reported yet" in why


def test_an_unknown_card_gives_no_mfu_and_says_why_once(tmp_path):
    from mindpulse.aggregator.compute import ComputeWatch

    said: list[str] = []
    watch = ComputeWatch(tmp_path, 0.0, "bfloat16", say=said.append)
    watch.on_cards([{"node": 0, "card": 0, "name": "910B3", "ranks": [0, 1]}])
    assert watch.peak is None and "910B3" in watch.source
    for s in (1, 2):
        red = reduce_step(s, {0: _pk(0, s, 1.0), 1: _pk(1, s, 1.0)}, 2)
        watch.on_step(red)
        assert red.peak_tflops is None and red.mfu_mean is None and red.tflops_mean == pytest.approx(1.0)
    assert said == [f"MFU: - ({watch.source})"]
    summary = watch.summary()
    assert summary["mfu"] is None and summary["peak_tflops"] is None and "910B3" in summary["peak_source"]
    watch.on_cards([{"node": 0, "card": 0, "name": "NVIDIA H200", "ranks": [0, 1]}])
    assert watch.peak == 989.5
    assert said[-1] == "MFU: peak 989.5 TFLOPS per card from the table (NVIDIA H200 SXM, bfloat16)"


def test_the_peak_dtype_is_the_one_the_job_computes_in():
    assert peak_dtype() == "float32", "the built-in recipe computes in float32"
    assert peak_dtype("train.py") == "float16", "a script: half precision assumed"
    assert peak_dtype("", "bfloat16") == "bfloat16" and peak_dtype("", "float32") == "float32"
    assert peak_dtype("", " BFloat16 ") == "bfloat16"
    assert peak_dtype("", "") == "float16", "MindFormers' default compute dtype"
    assert peak_dtype("", "int8") == "float16"


# ---- the compute_drop rule ---------------------------------------------------------------------------
def test_node_compute_drops_flag_only_the_rank_that_fell():
    drops = NodeComputeDrops(window=8, warmup=2)
    flagged = []
    for s in range(1, 31):
        # steps 1-2 warm up (rank 1 compiles slowly: not judged, not in its baseline), 3-10 fill the window
        # (a figure joins the baseline once the 2 steps after it showed no drop: full at step 12)
        v1 = 0.1 if s <= 2 else (1.0 + 0.01 * (s % 2) if s < 14 else 0.4)
        flagged.append(drops.update(s, {0: _pk(0, s, 1.0), 1: _pk(1, s, v1)}))
    # judged on the median of the last 3 steps: the first low step alone (step 14) is not a drop
    assert flagged[:14] == [[]] * 14
    # the drop stays out of the baseline (the bar does not sink with it) for a whole window...
    assert all(f == [[1, 0.4, pytest.approx(1.005), pytest.approx(0.005), 8]] for f in flagged[14:22]), flagged
    # ...then it is the rank's new level
    assert flagged[22:] == [[]] * 8 and list(drops.history[1].values) == [0.4] * 8


def test_a_drop_within_the_windows_noise_is_not_flagged():
    """A shared host's noise: a rank whose TFLOPS swing by +-30% from step to step is not
    flagged for a 30% dip; the same dip on a steady rank is. One slow step is no drop."""
    noisy, steady = NodeComputeDrops(window=10, warmup=0), NodeComputeDrops(window=10, warmup=0)
    for s in range(1, 13):
        noisy.update(s, {0: _pk(0, s, 1.0 + (0.3 if s % 2 else -0.3))})
        steady.update(s, {0: _pk(0, s, 1.0 + (0.01 if s % 2 else -0.01))})
    assert [noisy.update(s, {0: _pk(0, s, 0.65)}) for s in (13, 14, 15)] == [[], [], []]
    assert steady.update(13, {0: _pk(0, 13, 0.65)}) == [], "one slow step"
    assert steady.update(14, {0: _pk(0, 14, 0.65)})[0][:2] == [0, 0.65]


def test_a_rank_whose_compute_is_not_measured_is_not_judged():
    """GRAPH mode (or dataset sinking): TFLOPS from the step time the all-reduce makes everyone's."""
    drops = NodeComputeDrops(window=4, warmup=0)
    flagged = [drops.update(s, {0: _pk(0, s, 1.0 if s < 10 else 0.1, compute_s=None)}) for s in range(1, 16)]
    assert flagged == [[]] * 15 and not drops.history


def test_a_drop_every_rank_shares_is_not_one_cards_fault():
    rule = ComputeDropRule({"rule": "compute_drop", "for_steps": 2})
    red = reduce_step(5, {r: _pk(r, 5, 0.5) for r in range(4)}, 4)
    red.compute_flags = [[r, 0.5, 1.0, 0.01, 10] for r in range(4)]  # the host slowed: all ranks at half
    assert [rule.check(red) for _ in range(4)] == [None] * 4
    red.compute_flags = [[0, 0.5, 1.0, 0.01, 10], [2, 0.9, 1.0, 0.01, 10]]  # the others hold
    fired = [rule.check(red) for _ in range(2)]
    assert fired[0] is None and fired[1].rank == 0, fired
    assert "while the other ranks hold 1.00 x theirs" in fired[1].message
    assert "baseline: its median over 10 steps after a 5-step warm-up, MAD 0.01 TFLOPS" in fired[1].message


def test_compute_drop_fires_once_after_for_steps_naming_the_rank_and_its_card():
    rule = ComputeDropRule({"rule": "compute_drop"})  # defaults: factor 0.7, for_steps 3
    assert (rule.factor, rule.for_steps, rule.action.value) == (0.7, 3, "warn")
    red = reduce_step(5, {0: _pk(0, 5, 1.0), 1: _pk(1, 5, 0.4)}, 2)
    red.set_peak(2.0)
    red.rank_cards = {1: "node 0 card 1 (910B3)"}
    red.compute_flags = [[1, 0.4, 1.0, 0.02, 10]]
    fired = [rule.check(red) for _ in range(4)]
    assert fired[:2] == [None, None] and fired[3] is None, "once per excursion"
    f = fired[2]
    assert f.rank == 1 and f.value == pytest.approx(0.2) and f.threshold == pytest.approx(0.35)
    assert "rank 1 on node 0 card 1 (910B3)" in f.message and "MFU 0.2" in f.message
    red.compute_flags = [[1, 0.9, 1.0, 0.02, 10]]  # below 0.95, above the factor: no hit
    assert rule.check(red) is None and rule.hits == {}


def _run_core(tmp_path, slow_from=17, steps=22, settings=None):
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
    # 5 warm-up steps, a full window of 10 (steps 6-15), the drop from step 17
    # (judged on 3-step medians: low from step 18) for 3 steps
    assert len(drop) == 1 and drop[0]["rank"] == 1 and drop[0]["step"] == 20, recs
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
    for s in range(1, 18):
        for r in range(4):
            nodes[r // 2].add(_pk(r, s, 0.3 if (r == 3 and s >= 14) else 1.0).encode())
        out = []
        for n, node in enumerate(nodes):
            for w in node.take()["partials"]:
                out += red.add_partial(n, from_wire(w))
        (done,) = out
        flags[s] = done.compute_flags
    # 5 warm-up steps; the figures of steps 6-13 make the baseline, full at step 15 (each joins it
    # once the 2 steps after it showed no drop): judged from step 16, on the last 3 steps' median
    assert flags[15] == [] and flags[16] == [[3, 0.3, 1.0, 0.0, 8]], flags


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
