"""The views' one run reader: real packets in a real run directory, reduced by the aggregator's reducer."""

from __future__ import annotations

import json
import math
from pathlib import Path

import yaml

from mindpulse.config import RunConfig
from mindpulse.reduction.reducer import ReducedStep, StragglerTracker, reduce_all
from mindpulse.views.report import load_run
from mindpulse.views.run_reader import RunReader
from mindpulse.wire.protocol import EventPacket, StepPacket

T0 = 1_700_000_000.0


def _loss(rank: int, step: int) -> float:
    return 3.0 / (step + 1) + 0.1 * rank


def _step(rank: int, step: int, **kw) -> StepPacket:
    kw.setdefault("loss", _loss(rank, step))
    kw.setdefault("step_time_s", 0.2 + 0.01 * rank)
    return StepPacket(rank=rank, step=step, lr=1e-4, grad_norm=2.0, grad_norm_local=1.0 + rank, samples=8,
                      ts=T0 + step, fingerprint=f"fp-{step // 4}" if step % 4 == 0 else None, **kw)


def _write(run_dir: Path, packets: list, config: RunConfig | None = None) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    if config is not None:  # as the launcher writes it: the resolved config, every section
        (run_dir / "config.yaml").write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
    path = run_dir / "metrics.msgpack"
    path.write_bytes(b"".join(p.encode() for p in packets))
    return path


def _records(steps: list[ReducedStep]) -> list[str]:
    """Comparable form of reduced steps: NaN == NaN here, and the packets of each step too."""
    return [json.dumps([r.to_record(), {k: p.to_wire() for k, p in r.per_rank.items()}], sort_keys=True)
            for r in steps]


def _messy_stream(steps: int = 12) -> list:
    """Three ranks out of order, rank 2 a step behind, duplicates with other values, a NaN loss."""
    out: list = [EventPacket(rank=r, kind="start", ts=T0, pid=100 + r, host="node-a") for r in range(3)]
    for s in range(steps + 1):
        out += [_step(r, s, loss=math.nan if (r, s) == (1, 5) else _loss(r, s)) for r in (1, 0)]
        if s > 0:
            out.append(_step(2, s - 1))
        if s in (3, 7):  # a pending step and a just-completed one reported again: the first report wins
            out += [_step(0, s, loss=99.0), _step(1, s - 1, loss=99.0)]
    out.append(_step(2, steps))
    return out


def test_reader_reduces_exactly_as_reduce_all(tmp_path):
    packets = _messy_stream()
    path = _write(tmp_path / "run", packets)
    steps = [p for p in packets if isinstance(p, StepPacket)]
    expected = reduce_all(steps, 3)
    cfg = RunConfig()  # no config.yaml: the config's default
    tracker = StragglerTracker(cfg.monitor.straggler_window, cfg.world.ranks_per_node)
    for red in expected:
        tracker.update(red)

    reader = RunReader(tmp_path / "run", history=True)
    reader.poll()
    assert reader.world_size == 3  # inferred: no config.yaml, no summary.json
    assert _records(reader.reduced) == _records(expected)  # same steps, same order, same values
    assert any(r.loss_mean is not None and math.isnan(r.loss_mean) for r in reader.reduced)
    assert reader.totals()["packets"]["duplicates"] == 4

    data = load_run(tmp_path / "run")
    assert _records(data.reduced) == _records(sorted(expected, key=lambda r: r.step))
    # each rank's packets are the reducer's accepted ones: the duplicates' 99.0 never shows
    assert all(p.loss != 99.0 for pkts in data.per_rank.values() for p in pkts)
    assert [p.step for p in data.per_rank[0]] == list(range(13))

    # read live, a few bytes at a time (torn records included), the newest complete step is the same
    live = RunReader(tmp_path / "run")
    blob = path.read_bytes()
    path.write_bytes(b"")
    for i in range(0, len(blob), 97):
        with open(path, "ab") as fh:
            fh.write(blob[i:i + 97])
        live.poll()
    newest = max(expected, key=lambda r: r.step)
    assert live.complete_step == newest.step
    assert _records([live.latest]) == _records([newest])


def _straggling(steps: int = 20) -> list:
    """Rank 1 computes three times as long for steps 1..16, then as fast as rank 0."""
    out = [StepPacket(rank=r, step=0, ts=T0) for r in range(2)]
    for s in range(1, steps + 1):
        for r in range(2):
            compute = 0.3 if (r == 1 and s <= 16) else 0.1
            out.append(_step(r, s, compute_s=compute, data_wait_s=0.0, step_time_s=0.35))
    return out


def _scores(packets: list, window: int) -> dict[int, dict[int, float]]:
    tracker = StragglerTracker(window)
    reduced = reduce_all([p for p in packets if isinstance(p, StepPacket)], 2)
    for red in reduced:
        tracker.update(red)
    return {r.step: r.straggler_scores for r in reduced}


def test_report_scores_stragglers_with_the_configs_window(tmp_path):
    cfg = RunConfig()
    cfg.monitor.straggler_window = 4
    cfg.monitor.straggler_threshold = 0.5
    packets = _straggling()
    _write(tmp_path / "run", packets, config=cfg)

    data = load_run(tmp_path / "run")
    assert data.config.monitor.straggler_window == 4 and data.config.monitor.straggler_threshold == 0.5
    assert data.world_size == 2  # the config's world (1 node × 2 ranks)
    got = {r.step: r.straggler_scores for r in data.reduced}
    assert got == _scores(packets, 4)
    # the sequence tells the windows apart: rank 1 has caught up over the last 4 steps, not over 10
    assert got[20][1] == 1.0
    assert _scores(packets, 10)[20][1] < 0.5
    assert not any("config.yaml" in n for n in data.notes)


def test_world_that_grows_is_reduced_again(tmp_path):
    path = _write(tmp_path / "run", [_step(r, s) for s in range(1, 4) for r in range(2)])
    reader = RunReader(tmp_path / "run")
    reader.poll()
    assert reader.world_size == 2 and reader.complete_step == 3
    # rank 2 appears: the steps completed by two ranks are not complete in a world of three
    with open(path, "ab") as fh:
        fh.write(_step(2, 3).encode() + b"".join(_step(r, 4).encode() for r in (0, 2)))
    reader.poll()
    assert reader.world_size == 3 and reader.complete_step == 3
    assert sorted(reader.latest.per_rank) == [0, 1, 2]
    assert reader.last_step_of_rank == {0: 4, 1: 3, 2: 4}
    with open(path, "ab") as fh:
        fh.write(_step(1, 4).encode())
    reader.poll()
    assert reader.complete_step == 4


def test_damaged_config_falls_back_to_defaults_with_a_note(tmp_path):
    run = tmp_path / "run"
    _write(run, _straggling(steps=3))
    (run / "config.yaml").write_text("world:\n  nodes: 1\n  ranks_per_node: 2\nmonitor:\n  straggler_window: many\n")
    data = load_run(run)
    assert data.config.monitor.straggler_window == RunConfig().monitor.straggler_window
    assert any("monitor.straggler_window" in n and "defaults of `monitor`" in n for n in data.notes)
    assert data.world_size == 2 and len(data.reduced) == 4  # the good section still counts

    (run / "config.yaml").write_text("monitor: [unclosed\n")
    data = load_run(run)
    assert data.config == RunConfig()
    assert any("config.yaml is not valid YAML" in n for n in data.notes)
    assert data.config_text == "monitor: [unclosed\n"  # still shown as is


def test_reader_follows_segments_closed_while_it_reads(tmp_path, monkeypatch):
    """The aggregator closes metrics.msgpack (a numbered name, a new file) under a live reader:
    every packet is read once, in order, and steps complete as the aggregator completed them."""
    from mindpulse.rundir import metrics_store as ms
    from mindpulse.rundir.metrics_store import MetricsWriter, closed_segments

    monkeypatch.setattr(ms, "KEEP_FULL_SEGMENTS", 1000)
    run = tmp_path / "run"
    packets = _messy_stream(steps=30)
    writer = MetricsWriter(run / "metrics.msgpack", max_file_size=1500)
    live = RunReader(run)
    for p in packets:
        writer.append([p.encode()])
        live.poll()
    writer.close()
    live.poll()
    assert len(closed_segments(run)) > 10
    expected = reduce_all([p for p in packets if isinstance(p, StepPacket)], 3)
    tracker = StragglerTracker(RunConfig().monitor.straggler_window, RunConfig().world.ranks_per_node)
    for red in expected:
        tracker.update(red)
    newest = max(expected, key=lambda r: r.step)
    assert live.records == len(packets) and live.rejected == 0
    assert live.complete_step == newest.step and _records([live.latest]) == _records([newest])
    assert live.totals()["packets"]["duplicates"] == 4
    assert live.tail.skipped_bytes == 0 and live.tail.segments_read == len(closed_segments(run))

    whole = RunReader(run, history=True)
    whole.poll()
    assert _records(whole.reduced) == _records(expected)


def test_damaged_bytes_in_the_middle_hide_nothing_after_them(tmp_path):
    packets = _messy_stream()
    path = _write(tmp_path / "run", packets)
    blob = bytearray(path.read_bytes())
    at = len(b"".join(p.encode() for p in packets[:9]))
    junk = b"\xc1\x00\xff garbage \x93"  # bytes that are no record, between two records
    blob[at:at] = junk
    path.write_bytes(bytes(blob))
    reader = RunReader(tmp_path / "run", history=True)
    reader.poll()
    assert reader.records == len(packets)  # every packet after the damage is read
    assert reader.tail.skipped_bytes == len(junk) and reader.tail.errors == 1
    assert reader.totals()["metrics"]["damaged_bytes_skipped"] == len(junk)
    expected = reduce_all([p for p in packets if isinstance(p, StepPacket)], 3)
    tracker = StragglerTracker(RunConfig().monitor.straggler_window, RunConfig().world.ranks_per_node)
    for red in expected:
        tracker.update(red)
    assert _records(reader.reduced) == _records(expected)
