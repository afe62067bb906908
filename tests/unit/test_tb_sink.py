"""TensorBoard sink: events written with tensorboardX read back with TensorBoard's own reader."""

from __future__ import annotations

import math
import time

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from mindpulse.aggregator.tb_sink import TensorBoardSink
from mindpulse.reduction.reducer import reduce_all
from mindpulse.wire.protocol import StepPacket, TelemetryPacket, decode

STEPS = 10
NAN_STEP = 7


def _loss(rank: int, step: int) -> float:
    if rank == 1 and step == NAN_STEP:
        return math.nan
    return 2.0 / step + 0.25 * rank


def _packets() -> list[StepPacket]:
    t0 = time.time() - 100
    out = [StepPacket(rank=r, step=0, fingerprint=f"fp{r}", ts=t0) for r in range(2)]
    for step in range(1, STEPS + 1):
        for rank in range(2):
            raw = StepPacket(
                rank=rank, step=step, loss=_loss(rank, step), lr=1e-4 * step, grad_norm=3.0 + step,
                grad_norm_local=1.0 + rank + 0.1 * step, step_time_s=0.1 + 0.05 * rank, samples=8,
                ts=t0 + step, extra={"accuracy": 0.5 + 0.1 * rank},
            ).encode()
            out.append(decode(raw))  # the packets as the aggregator sees them, off the wire
    return out


def _telemetry(step: int) -> TelemetryPacket:
    pkt = TelemetryPacket(node="node-a", ts=time.time(), source="npu-smi", cards=[
        {"card": 0, "util_pct": 40.0 + step, "memory_used_mb": 1000.0 + step, "memory_total_mb": 65536.0,
         "power_w": 90.0, "temp_c": 50.0},
        {"card": 1, "util_pct": None, "memory_used_mb": 2000.0, "memory_total_mb": None,
         "power_w": None, "temp_c": 55.0},
    ])
    return decode(pkt.encode())


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    reduced = reduce_all(_packets(), 2)
    sink = TensorBoardSink(run_dir, flush_secs=1.0, collect_freq=1)  # every step collects
    sink.on_text("config", "name: demo\ntrain:\n  steps: 10\n")
    for red in reduced:
        sink.on_reduced(red)
        if red.step and red.step % 2 == 0:
            tel = _telemetry(red.step)
            sink.on_telemetry(tel.node, tel.cards, tel.ts, red.step)
    sink.on_anomaly({"rule": "nan_loss", "step": NAN_STEP, "rank": 1, "value": math.nan, "threshold": None,
                     "action": "stop", "message": "loss is NaN on rank 1"})
    sink.on_text("milestones", "checkpoint saved", step=8)
    sink.flush()
    sink.close()
    acc = EventAccumulator(str(run_dir / "tb"),
                           size_guidance={"scalars": 0, "tensors": 0, "histograms": 0,
                                          "compressedHistograms": 0})
    acc.Reload()
    return run_dir, reduced, sink, acc


def _scalars(acc, tag) -> dict[int, float]:
    return {e.step: e.value for e in acc.Scalars(tag)}


def test_event_file_is_under_run_dir_tb(written):
    run_dir, _, sink, _ = written
    files = list((run_dir / "tb").glob("events.out.tfevents.*"))
    assert len(files) == 1 and files[0].stat().st_size > 0
    assert sink.error_count == 0 and sink.closed


def test_cluster_scalars_have_the_fed_steps_and_values(written):
    _, reduced, _, acc = written
    by_step = {r.step: r for r in reduced}
    loss_mean = _scalars(acc, "loss/mean")
    # step 0 (fingerprints only) is skipped and the NaN step is not a scalar
    assert sorted(loss_mean) == [s for s in range(1, STEPS + 1) if s != NAN_STEP]
    assert loss_mean[5] == pytest.approx((_loss(0, 5) + _loss(1, 5)) / 2, rel=1e-6)
    for tag, attr in [("loss/max", "loss_max"), ("loss/min", "loss_min"), ("grad_norm/global", "grad_norm"),
                      ("lr", "lr"), ("throughput/samples_per_s", "samples_per_s"),
                      ("step_time/max", "step_time_max")]:
        values = _scalars(acc, tag)
        assert 0 not in values, tag
        for step in (1, 5, STEPS):
            assert values[step] == pytest.approx(getattr(by_step[step], attr), rel=1e-6), (tag, step)
    assert _scalars(acc, "throughput/samples_per_s")[3] == pytest.approx(16 / 0.15, rel=1e-6)
    assert _scalars(acc, "extra/accuracy")[4] == pytest.approx(0.55, rel=1e-6)


def test_per_rank_scalars(written):
    _, _, _, acc = written
    for rank in range(2):
        loss = _scalars(acc, f"rank_{rank}/loss")
        assert loss[3] == pytest.approx(_loss(rank, 3), rel=1e-6)
        assert _scalars(acc, f"rank_{rank}/grad_norm_local")[6] == pytest.approx(1.0 + rank + 0.6, rel=1e-6)
        assert _scalars(acc, f"rank_{rank}/step_time")[2] == pytest.approx(0.1 + 0.05 * rank, rel=1e-6)
    assert NAN_STEP in _scalars(acc, "rank_0/loss")
    assert NAN_STEP not in _scalars(acc, "rank_1/loss")


def test_nan_loss_is_a_text_marker(written):
    _, _, _, acc = written
    events = acc.Tensors("loss/nonfinite/text_summary")
    assert [e.step for e in events] == [NAN_STEP]
    text = events[0].tensor_proto.string_val[0].decode()
    assert "nan" in text and "rank 1" in text


def test_card_scalars(written):
    _, _, _, acc = written
    util = _scalars(acc, "card_node-a_0/util")
    assert sorted(util) == [2, 4, 6, 8, 10]
    assert util[4] == pytest.approx(44.0)
    assert _scalars(acc, "card_node-a_0/memory_used_mb")[6] == pytest.approx(1006.0)
    assert _scalars(acc, "card_node-a_0/power_w")[2] == pytest.approx(90.0)
    assert _scalars(acc, "card_node-a_1/temp_c")[8] == pytest.approx(55.0)
    tags = acc.Tags()["scalars"]
    assert "card_node-a_1/util" not in tags and "card_node-a_1/power_w" not in tags


def test_text_tags(written):
    _, _, _, acc = written
    tensors = set(acc.Tags()["tensors"])
    assert {"anomalies/text_summary", "config/text_summary", "milestones/text_summary"} <= tensors
    anomaly = acc.Tensors("anomalies/text_summary")
    assert [e.step for e in anomaly] == [NAN_STEP]
    assert "nan_loss" in anomaly[0].tensor_proto.string_val[0].decode()
    config = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "steps: 10" in config


def test_histogram_of_local_grad_norms(written):
    _, _, _, acc = written
    assert "grad_norm_local/ranks" in acc.Tags()["histograms"]
    hist = {e.step: e.histogram_value for e in acc.Histograms("grad_norm_local/ranks")}
    assert 0 not in hist and 5 in hist
    assert hist[5].num == 2
    assert hist[5].min == pytest.approx(1.5) and hist[5].max == pytest.approx(2.5)


def test_bad_input_never_raises_and_is_counted(tmp_path):
    sink = TensorBoardSink(tmp_path, flush_secs=1.0)
    sink.on_reduced(object())  # not a ReducedStep
    sink.on_telemetry("n", [{"card": 0, "util_pct": "busy"}, "junk"], 0.0, 1)
    sink.on_anomaly({"rule": "x", "step": "later"})
    sink.on_text("milestones", "ok", step=3)
    assert sink.errors["reduced"] == 1
    sink.close()
    sink.close()
    sink.on_reduced(reduce_all([StepPacket(rank=0, step=1, loss=1.0)], 1)[0])  # after close: ignored
    sink.flush()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert "milestones/text_summary" in acc.Tags()["tensors"]
    assert acc.Tags()["scalars"] == []


def test_text_steps_never_go_back(tmp_path):
    sink = TensorBoardSink(tmp_path, flush_secs=1.0)
    sink.on_anomaly({"rule": "late_rule", "step": 9})
    sink.on_anomaly({"rule": "early_rule", "step": 4})
    sink.close()
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0})
    acc.Reload()
    events = acc.Tensors("anomalies/text_summary")
    assert [e.step for e in events] == [9, 9]
    assert "step 4" in events[1].tensor_proto.string_val[0].decode()


def test_flush_makes_events_readable_before_close(tmp_path):
    # a long flush period: only the explicit flush can have written the event
    sink = TensorBoardSink(tmp_path, flush_secs=600.0)
    for step in range(1, 4):
        sink.on_reduced(reduce_all([StepPacket(rank=0, step=step, loss=0.5 * step)], 1)[0])
    sink.flush()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert _scalars(acc, "loss/mean") == {1: 0.5, 2: 1.0, 3: 1.5}
    sink.close()


def test_periodic_flush_without_flush_or_close(tmp_path):
    sink = TensorBoardSink(tmp_path, flush_secs=0.3)
    sink.on_reduced(reduce_all([StepPacket(rank=0, step=1, loss=0.25)], 1)[0])
    deadline = time.monotonic() + 10
    seen = {}
    while time.monotonic() < deadline and not seen:
        time.sleep(0.1)
        acc = EventAccumulator(str(tmp_path / "tb"))
        acc.Reload()
        if "loss/mean" in acc.Tags()["scalars"]:
            seen = _scalars(acc, "loss/mean")
    assert seen == {1: 0.25}
    sink.close()


def test_a_second_sink_in_the_same_run_dir_keeps_the_first_file(tmp_path):
    for step in (1, 2):
        sink = TensorBoardSink(tmp_path, flush_secs=1.0)
        sink.on_reduced(reduce_all([StepPacket(rank=0, step=step, loss=float(step))], 1)[0])
        sink.close()
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 2
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert _scalars(acc, "loss/mean") == {1: 1.0, 2: 2.0}


def test_per_rank_scalars_every_collect_step_and_for_the_ranks_that_matter_between(tmp_path):
    """16 ranks: between collect steps only the extremes (and flagged ranks) get per-rank
    scalars; every collect step all of them; histograms over ranks every step."""
    packets = [StepPacket(rank=r, step=s, loss=1.0 + r / 100 + s, step_time_s=0.1 + r / 1000, samples=4)
               for s in range(1, 6) for r in range(16)]
    sink = TensorBoardSink(tmp_path, flush_secs=1.0, collect_freq=5)
    for red in reduce_all(packets, 16):
        sink.on_reduced(red)
    sink.close()
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    steps_of = {tag: [e.step for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    assert steps_of["rank_0/loss"] == [1, 2, 3, 4, 5], "rank 0 is an extreme (lowest loss, fastest)"
    assert steps_of["rank_15/loss"] == [1, 2, 3, 4, 5], "rank 15 is the other extreme"
    assert steps_of["rank_7/loss"] == [5], "an ordinary rank: only at the collect step"
    hist = {tag: [e.step for e in acc.Histograms(tag)] for tag in acc.Tags()["histograms"]}
    assert hist["ranks/loss"] == [1, 2, 3, 4, 5] and hist["ranks/step_time"] == [1, 2, 3, 4, 5]
    assert acc.Histograms("ranks/loss")[-1].histogram_value.num == 16


def test_a_failing_periodic_flush_is_counted_and_tried_again(tmp_path):
    sink = TensorBoardSink(tmp_path, flush_secs=0.2)
    events = sink._writer.file_writer.event_writer
    real = events._out.flush
    calls = []

    def broken():
        calls.append(1)
        raise OSError("disk full")

    events._out.flush = broken
    sink.on_reduced(reduce_all([StepPacket(rank=0, step=1, loss=0.25)], 1)[0])
    deadline = time.monotonic() + 5
    while not sink.errors["flush"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sink.errors["flush"] >= 1, "the flush thread's failure is counted, not lost"
    events._out.flush = real
    sink.on_reduced(reduce_all([StepPacket(rank=0, step=2, loss=0.5)], 1)[0])
    sink.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert _scalars(acc, "loss/mean") == {1: 0.25, 2: 0.5}
