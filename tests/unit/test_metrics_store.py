"""metrics.msgpack in segments: damage skipped and counted, segments rolled at the cap and read
by every reader, old segments thinned by the documented rule, attempts kept apart."""

from __future__ import annotations

import io
import math
import os

import msgpack
import pytest

from mindpulse.aggregator.core import AggregatorCore
from mindpulse.reduction.reducer import reduce_step
from mindpulse.rundir import metrics_store as ms
from mindpulse.rundir.metrics_store import (
    ATTEMPT,
    REDUCED,
    THINNED,
    MetricsWriter,
    ReadStats,
    closed_segments,
    keep_when_thinned,
    read_records,
    read_wire,
    reduced_from_record,
    reduced_record,
    with_attempts,
)
from mindpulse.views.report import build_report, load_run
from mindpulse.views.run_reader import RunReader
from mindpulse.views.top import RunView
from mindpulse.wire.packet_stream import iter_stream
from mindpulse.wire.protocol import EventPacket, StepPacket, TelemetryPacket

WORLD = 2
COLLECT = 5
T0 = 1_700_000_000.0


def _loss(rank: int, step: int, attempt: int = 0) -> float:
    return 3.0 / (step + 1) + 0.1 * rank + 0.5 * attempt


def _step(rank: int, step: int, attempt: int = 0, **kw) -> StepPacket:
    kw.setdefault("loss", _loss(rank, step, attempt))
    if step % COLLECT == 0:
        kw.setdefault("fingerprint", f"fp-{step}")
    return StepPacket(rank=rank, step=step, lr=1e-4, grad_norm=2.0, grad_norm_local=1.0 + rank, step_time_s=0.1,
                      samples=4, ts=T0 + step, **kw)


def _settings(cap: int = 0, attempt: int = 0) -> dict:
    return {"tensorboard": False, "output": {"max_file_size": cap}, "monitor": {"collect_freq": COLLECT},
            "attempt": attempt}


def _run(run_dir, steps, cap: int = 0, attempt: int = 0, special=None, close: bool = True) -> AggregatorCore:
    """An aggregator fed real packets, step by step (`special`: step → packets replacing the step's)."""
    core = AggregatorCore(run_dir, world_size=WORLD, settings=_settings(cap, attempt))
    core.ingest([EventPacket(rank=r, kind="start", ts=T0, pid=100 + r, host="node-a").encode() for r in range(WORLD)])
    for s in steps:
        pkts = (special or {}).get(s) or [_step(r, s, attempt) for r in range(WORLD)]
        core.ingest([p.encode() for p in pkts])
        if s % 7 == 0:
            core.ingest([TelemetryPacket(node="node-a", ts=T0 + s, source="psutil",
                                         cards=[{"card": 0, "util_pct": 50.0 + s}]).encode()])
    if close:
        core.close()
    return core


def _records(run_dir) -> list[dict]:
    """Every record of the run: all its segments."""
    return list(read_records(run_dir / "metrics.msgpack"))


def _file(path) -> list[dict]:
    """The records of one file."""
    return list(iter_stream(path.read_bytes()))


# ------------------------------------------------------------------------------- damage


def _blob(n: int = 40) -> tuple[list[bytes], bytes]:
    pk = [_step(r, s).encode() for s in range(n // 2) for r in range(WORLD)]
    return pk, b"".join(pk)


@pytest.mark.parametrize("where", ["header", "key", "value type"])
def test_a_corrupt_byte_in_the_middle_is_skipped_and_counted(where):
    pk, blob = _blob()
    start = sum(len(p) for p in pk[:10])
    value = start + pk[10].index(b"\xa4loss") + 5  # the loss value's type byte (a float64's 0xcb)
    at = {"header": start, "key": start + 1, "value type": value}[where]
    bad = bytearray(blob)
    bad[at] = 0xC1 if where == "value type" else bad[at] ^ 0xFF  # 0xC1: never valid msgpack
    st: dict = {}
    out = list(iter_stream(io.BytesIO(bytes(bad)), st))
    steps = [(o["rank"], o["step"]) for o in out if o.get("t") == "step"]
    # only the damaged record is lost; everything after it is read
    assert steps == [(r, s) for s in range(20) for r in range(WORLD)][:10] + \
        [(r, s) for s in range(20) for r in range(WORLD)][11:]
    assert st["skipped_bytes"] == len(pk[10]) and st["skipped_stretches"] == 1 and st["torn_bytes"] == 0


def test_a_torn_record_followed_by_more_records_and_zeros():
    pk, _ = _blob()
    for cut in (1, 5, len(pk[10]) // 2, len(pk[10]) - 1):  # a crash mid-write, then a restarted writer
        data = b"".join(pk[:10]) + pk[10][:cut] + b"".join(pk[11:])
        st: dict = {}
        assert len(list(iter_stream(data, st))) == len(pk) - 1
        assert st["skipped_bytes"] == cut
    st = {}
    data = b"".join(pk[:10]) + b"\0" * 5000 + b"".join(pk[10:]) + pk[0][:9]  # zeroed blocks, a torn tail
    assert len(list(iter_stream(data, st))) == len(pk)
    assert (st["skipped_bytes"], st["skipped_stretches"], st["torn_bytes"]) == (5000, 1, 9)
    # a file still being written: the torn tail waits, unconsumed
    st = {}
    assert len(list(iter_stream(b"".join(pk) + pk[0][:9], st, final=False))) == len(pk)
    assert st["consumed"] == len(b"".join(pk)) and st["torn_bytes"] == 0


def test_damage_is_reported_by_report_top_and_replay(tmp_path):
    run = tmp_path / "run"
    _run(run, range(12))
    path = run / "metrics.msgpack"
    data = bytearray(path.read_bytes())
    recs = list(read_records(path))
    # damage the 6th step packet's map header
    offsets, pos = [], 0
    for rec in recs:
        n = len(msgpack.packb(rec, use_bin_type=True))
        offsets.append((pos, rec))
        pos += n
    at = [o for o, r in offsets if r.get("t") == "step"][6]
    data[at] = 0xC1  # never valid msgpack
    path.write_bytes(bytes(data))

    stats = ReadStats()
    assert len([o for o in read_records(path, stats) if o.get("t") == "step"]) == 2 * 12 - 1
    assert stats.skipped_bytes > 0 and stats.skipped_stretches == 1

    view = RunView(run)
    view.refresh()
    assert view.complete_step == 11  # the step behind the damage completes from its reduced record
    assert f"damaged bytes skipped {stats.skipped_bytes} (1 stretches)" in view.render().splitlines()[0]

    data_ = load_run(run)
    assert [r.step for r in data_.reduced] == list(range(12))
    assert any(f"{stats.skipped_bytes} damaged byte(s) skipped in 1 stretch(es)" in n for n in data_.notes)

    core = AggregatorCore(run, world_size=WORLD, settings=_settings(), replay=True)
    line = core.drain_console()[-1]
    assert f"{stats.skipped_bytes} damaged byte(s) skipped in 1 stretch(es)" in line
    assert core.reducer.reduced_through == 11 and core.replay_stats["skipped_bytes"] == stats.skipped_bytes
    core.close()


# ------------------------------------------------------------------------------ segments


def test_segments_roll_at_the_cap_and_every_reader_sees_every_record(tmp_path, monkeypatch):
    monkeypatch.setattr(ms, "KEEP_FULL_SEGMENTS", 1000)  # no thinning here
    run = tmp_path / "run"
    cap = 3000
    view = RunView(run)  # top follows the run while it is written, across every roll
    core = _run(run, [], cap=cap, close=False)
    for s in range(40):
        core.ingest([_step(r, s).encode() for r in range(WORLD)])
        if s % 3 == 0:
            view.refresh()
    core.close()
    view.refresh()

    closed = closed_segments(run)
    assert len(closed) >= 5 and [i for i, _ in closed] == list(range(1, len(closed) + 1))
    for _, p in closed:
        assert 0 < p.stat().st_size <= cap
        first = next(read_records(p))
        assert first["t"] == ATTEMPT and first["reason"] in ("start", "roll")
    assert (run / "metrics.msgpack").stat().st_size <= cap

    wire = [(o["rank"], o["step"]) for o in read_wire(run / "metrics.msgpack") if o["t"] == "step"]
    assert wire == [(r, s) for s in range(40) for r in range(WORLD)]  # every packet once, in order
    reduced = [o["step"] for o in _records(run) if o["t"] == REDUCED]
    assert reduced == list(range(40))

    assert view.complete_step == 39 and view.records == 2 + 2 * 40
    assert view.tail.segments_read == len(closed) and view.tail.errors == 0

    data = load_run(run)
    assert [r.step for r in data.reduced] == list(range(40))
    assert all([p.step for p in pkts] == list(range(40)) for pkts in data.per_rank.values())
    snap = core.snapshot()
    replayed = AggregatorCore(run, world_size=WORLD, settings=_settings(cap), replay=True)
    assert replayed.reducer.reduced_through == 39 and replayed.steps_reduced == 40
    assert replayed.totals.as_dict() == {k: snap[k] for k in replayed.totals.as_dict()}
    assert f"({len(closed) + 1} segment(s))" in replayed.drain_console()[-1]
    replayed.close()
    # the restarted writer went on numbering, behind a marker that says it restarted
    assert all(i <= len(closed_segments(run)) for i, _ in closed)
    markers = [o for o in _records(run) if o["t"] == ATTEMPT]
    assert markers[-1]["reason"] == "restart" and markers[0]["reason"] == "start"


def test_a_roll_cut_short_is_finished_and_read_once(tmp_path):
    run = tmp_path / "run"
    _run(run, range(6), cap=0)
    # a crash between the second name and the new file: the same file under both names
    os.link(run / "metrics.msgpack", run / "metrics.000001.msgpack")
    assert [o["step"] for o in read_wire(run / "metrics.msgpack") if o["t"] == "step"] == \
        [s for s in range(6) for _ in range(WORLD)]
    view = RunView(run)
    view.refresh()
    assert view.records == 2 + 2 * 6 + 1
    w = MetricsWriter(run / "metrics.msgpack", max_file_size=10_000, restart=True)
    w.close()
    assert (run / "metrics.msgpack").stat().st_ino != (run / "metrics.000001.msgpack").stat().st_ino
    assert [o["t"] for o in read_records(run / "metrics.msgpack")][-1] == ATTEMPT
    assert len([o for o in read_wire(run / "metrics.msgpack") if o["t"] == "step"]) == 12


def test_one_file_without_a_cap_and_records_bigger_than_the_cap(tmp_path):
    run = tmp_path / "run"
    _run(run, range(30), cap=0)
    assert closed_segments(run) == []
    w = MetricsWriter(run / "big" / "metrics.msgpack", max_file_size=100)
    big = _step(0, 1, weights={"norms": {f"layer{i}": 1.0 for i in range(50)}}).encode()
    w.append([big, big])
    w.close()
    files = [p for _, p in closed_segments(run / "big")] + [run / "big" / "metrics.msgpack"]
    assert len(files) == 2 and all(p.stat().st_size > 100 for p in files)  # one each, the cap notwithstanding
    assert [sum(o["t"] == "step" for o in iter_stream(p.read_bytes())) for p in files] == [1, 1]


# ------------------------------------------------------------------------------- thinning


def _special(attempt: int = 0) -> dict[int, list[StepPacket]]:
    return {
        13: [_step(0, 13, attempt), _step(1, 13, attempt, loss=math.nan, nan_count=3)],  # rank 1 non-finite
        17: [_step(r, 17, attempt, extra={"eval_loss": 1.5}) for r in range(WORLD)],  # an evaluation
    }


def test_thinning_keeps_what_it_promises(tmp_path, monkeypatch):
    monkeypatch.setattr(ms, "KEEP_FULL_SEGMENTS", 2)
    run, full = tmp_path / "run", tmp_path / "full"
    cap = 3200  # a few collect periods per segment: thinning has something to drop
    steps = range(50)
    core = _run(run, steps, cap=cap, special=_special())
    _run(full, steps, cap=0, special=_special())  # the same run in one file, never thinned

    closed = closed_segments(run)
    assert len(closed) > 4
    thinned = [p for _, p in closed[:-2]]
    whole = [p for _, p in closed[-2:]] + [run / "metrics.msgpack"]
    assert len(core.metrics.thinned) == len(thinned)
    for p in thinned:
        recs = list(read_records(p))
        assert recs[0]["t"] == THINNED and recs[0]["keep_every"] == COLLECT
        assert recs[0]["records_kept"] == len(recs) - 1 < recs[0]["records_before"]
        for o in recs[1:]:
            assert keep_when_thinned(o, COLLECT)
            if o["t"] == "step":  # the rule: collect steps, fingerprints, non-finite ranks, evaluations
                assert (o["step"] % COLLECT == 0 or o.get("fingerprint") or o.get("nan_count")
                        or "eval_loss" in o.get("extra", {}))
    for p in whole:
        assert _file(p)[0]["t"] != THINNED

    everything = [o for o in _records(full) if o["t"] != ATTEMPT]
    kept = [o for o in _records(run) if o["t"] not in (ATTEMPT, THINNED)]
    # every reduced record, event and telemetry sample is kept; step packets by the rule
    for t in (REDUCED, "event", "telemetry"):  # compared as bytes: NaN == NaN there
        assert [msgpack.packb(o) for o in kept if o["t"] == t] == [msgpack.packb(o) for o in everything if o["t"] == t]
    kept_steps = {(o["rank"], o["step"]) for o in kept if o["t"] == "step"}
    assert {(r, s) for s in range(0, 50, COLLECT) for r in range(WORLD)} <= kept_steps
    assert (1, 13) in kept_steps and (0, 13) not in kept_steps or 13 >= _first_whole_step(whole)
    assert {(0, 17), (1, 17)} <= kept_steps
    assert len(kept_steps) < 2 * 50

    # the report shows every step's cluster values (the reduced records) as before thinning
    data, ref = load_run(run), load_run(full)
    assert [r.step for r in data.reduced] == [r.step for r in ref.reduced] == list(range(50))
    for a, b in zip(data.reduced, ref.reduced):
        assert (a.loss_mean == b.loss_mean or (math.isnan(a.loss_mean) and math.isnan(b.loss_mean)))
        assert a.samples_per_s == b.samples_per_s and a.nonfinite_ranks == b.nonfinite_ranks
    assert data.derived_totals["best_loss"] == ref.derived_totals["best_loss"]
    assert data.derived_totals["steps_completed"] == 49
    assert data.derived_totals["packets"]["incomplete_steps_evicted"] == 0
    assert any("thinned" in n for n in data.notes)
    assert [p.step for p in data.per_rank[1] if p.step == 13] == [13]  # the non-finite rank's packet
    result = build_report(run)
    assert result["steps"] == 50

    # a restarted aggregator counts the thinned steps through their reduced records
    snap = core.snapshot()
    replayed = AggregatorCore(run, world_size=WORLD, settings=_settings(cap), replay=True)
    assert replayed.reducer.reduced_through == 49 and replayed.steps_reduced == 50
    assert replayed.totals.first_loss == snap["first_loss"] and replayed.totals.best_loss == (snap["best_loss"],
                                                                                              snap["best_loss_step"])
    assert "thinned step(s) from their reduced records" in replayed.drain_console()[-1]
    replayed.close()


def _first_whole_step(whole) -> int:
    return min(o["step"] for p in whole for o in _file(p) if o["t"] == "step")


def test_reduced_record_is_compact_and_reads_back():
    pk = {r: _step(r, 7, fingerprint="odd" if r == 5 else "same") for r in range(200)}
    red = reduce_step(7, pk, 200)
    red.straggler_scores = {r: 1.0 - r / 400 for r in range(200)}
    rec = reduced_record(red)
    blob = msgpack.packb(rec, use_bin_type=True)
    assert len(blob) < 2500
    assert rec["fingerprints"] == {"0": "same", "5": "odd"} and rec["fingerprints_total"] == 200
    assert len(rec["straggler_scores"]) == 64 and min(rec["straggler_scores"].values()) == 1.0 - 199 / 400
    back = reduced_from_record(msgpack.unpackb(blob, raw=False, strict_map_key=True))
    assert back.step == 7 and back.loss_mean == red.loss_mean and back.world_size == 200
    assert back.fingerprints == {0: "same", 5: "odd"} and back.per_rank == {}
    assert reduced_from_record({"v": 1, "t": "reduced", "step": "x"}) is None


# ------------------------------------------------------------------------------- attempts


def test_attempt_markers_separate_rerun_steps(tmp_path):
    run = tmp_path / "run"
    _run(run, range(0, 11), attempt=0)  # attempt 0 fails after step 10
    _run(run, range(6, 15), attempt=1)  # attempt 1 resumes from the checkpoint of step 6

    got = [(a, o["step"]) for a, o in with_attempts(_records(run)) if o["t"] == REDUCED]
    assert got == [(0, s) for s in range(11)] + [(1, s) for s in range(6, 15)]

    reader = RunReader(run, history=True)
    reader.poll()
    assert [r.step for r in reader.reduced] == list(range(15))
    assert {s: reader.attempt_of_step(s) for s in range(15)} == {s: 0 if s < 6 else 1 for s in range(15)}
    # the re-run steps show attempt 1's values, never attempt 0's
    for r in reader.reduced:
        a = 0 if r.step < 6 else 1
        assert r.loss_mean == pytest.approx((_loss(0, r.step, a) + _loss(1, r.step, a)) / 2)
    assert [p.step for p in reader.per_rank[0]] == list(range(15))
    assert all(p.loss == pytest.approx(_loss(0, p.step, 1 if p.step >= 6 else 0)) for p in reader.per_rank[0])
    a0, a1 = reader.attempts[0], reader.attempts[1]
    assert (a0.first_step, a0.steps, a0.superseded, a0.last_step) == (0, 6, 5, 5)
    assert (a1.first_step, a1.steps, a1.superseded, a1.last_step) == (6, 9, 0, 14)
    totals = reader.totals()
    assert totals["steps_completed"] == 14 and totals["packets"]["duplicates"] == 0
    assert totals["packets"]["late"] == 0 and totals["attempts"] == 2

    view = RunView(run)
    view.refresh()
    text = view.render()
    assert "step 14" in text.splitlines()[0] and "attempt 1" in text.splitlines()[0]
    assert "attempt 1 resumed at step 6" in text

    data = load_run(run)
    assert any("attempt 0: 5 complete step(s) from step 6 on were run again by attempt 1" in n for n in data.notes)
    page = open(build_report(run)["html"], encoding="utf-8").read()
    assert "<h2>Attempts</h2>" in page

    # a restarted aggregator of attempt 1 replays attempt 1 only (attempt 0's steps are no duplicates)
    core = AggregatorCore(run, world_size=WORLD, settings=_settings(attempt=1), replay=True)
    assert core.reducer.reduced_through == 14 and core.steps_reduced == 9
    assert core.reducer.duplicates == 0 and core.reducer.late == 0
    assert "of attempt 1" in core.drain_console()[-1]
    core.close()


def test_top_follows_the_new_attempt_and_never_shows_a_superseded_step(tmp_path):
    run = tmp_path / "run"
    _run(run, range(0, 9), attempt=0)
    view = RunView(run)
    view.refresh()
    assert view.complete_step == 8
    core = AggregatorCore(run, world_size=WORLD, settings=_settings(attempt=1))
    view.refresh()
    assert "attempt 1 starting" in view.render()
    core.ingest([_step(0, 4, 1).encode()])  # attempt 1 resumed at step 4: steps 4.. of attempt 0 are gone
    view.refresh()
    text = view.render()
    assert view.complete_step is None and "no complete step yet (newest step reported: 4)" in text
    assert "attempt 1 resumed at step 4" in text
    core.ingest([_step(1, 4, 1).encode()])
    view.refresh()
    assert view.complete_step == 4 and view.run.latest_attempt == 1
    core.close()
