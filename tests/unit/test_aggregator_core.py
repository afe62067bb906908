"""The aggregator's state machine without Ray: store, reduce, decide, report."""

from __future__ import annotations

import json

import msgpack
import pytest

from mindpulse.aggregator.core import AggregatorCore
from mindpulse.aggregator.sink import Sink
from mindpulse.rundir.metrics_store import read_packets, read_wire
from mindpulse.wire.protocol import Action, EventPacket, StepPacket


def step(rank, s, loss=1.0, decision=True, **kw):
    return StepPacket(rank=rank, step=s, loss=loss, decision=decision, step_time_s=0.1, samples=4, **kw).encode()


def test_every_accepted_packet_is_stored_and_rejects_are_counted(tmp_path):
    core = AggregatorCore(tmp_path, world_size=2, per_print_step=2)
    core.ingest([step(0, 1), b"garbage", msgpack.packb({"v": 7, "t": "step"}), step(1, 1)])
    core.close()
    stored = list(read_wire(tmp_path / "metrics.msgpack"))
    assert [(o["rank"], o["step"]) for o in stored] == [(0, 1), (1, 1)]
    snap = core.snapshot()
    assert snap["packets"]["accepted"] == 2
    assert snap["packets"]["rejected_by_reason"] == {"malformed": 1, "version": 1}


def test_directive_only_after_every_rank_reported(tmp_path):
    core = AggregatorCore(tmp_path, world_size=2)
    core.ingest([step(0, 1)])
    assert core.directive_for(1) is None
    assert core.missing_for(1) == [1]
    core.ingest([step(1, 1)])
    assert core.directive_for(1).action is Action.CONTINUE


def test_stop_request_lands_max_lag_steps_after_the_next_reduced_step_for_all(tmp_path):
    core = AggregatorCore(tmp_path, world_size=2, settings={"monitor": {"max_lag_steps": 1}})
    core.ingest([step(0, 1), step(1, 1)])
    core.request_stop("user interrupt")
    assert not core.lease().stopping, "decided when the next step is reduced"
    core.ingest([step(0, 2, decision=False), step(1, 2, decision=False)])
    lease = core.lease()
    # ranks may already run step 3 (their lease allowed it): all stop after it
    assert (lease.reduced_through, lease.stop_after, lease.reason) == (2, 3, "user interrupt")
    assert core.directive_for(2).action is Action.CONTINUE
    core.ingest([step(0, 3), step(1, 3)])
    d = core.directive_for(3)
    assert d.action is Action.STOP and "user interrupt" in d.reason
    assert core.snapshot()["stop"]["step"] == 3 and core.snapshot()["stop"]["decided_at"] == 2
    # a straggling later step still says stop
    core.ingest([step(0, 4), step(1, 4)])
    assert core.directive_for(4).action is Action.STOP


def test_lockstep_stop_lands_on_the_step_it_was_decided(tmp_path):
    core = AggregatorCore(tmp_path, world_size=2, settings={"monitor": {"max_lag_steps": 0}})
    core.ingest([step(0, 1), step(1, 1)])
    core.request_stop("user interrupt", save=True)
    core.ingest([step(0, 2, decision=False), step(1, 2, decision=False)])
    lease = core.lease()
    assert (lease.stop_after, lease.save_last) == (2, True)
    assert core.directive_for(2).action is Action.STOP and "last" in core.directive_for(2).save_kinds


def test_tables_every_per_print_step(tmp_path):
    core = AggregatorCore(tmp_path, world_size=2, per_print_step=2)
    for s in range(1, 5):
        core.ingest([step(0, s, loss=3 - s * 0.1), step(1, s, loss=3 - s * 0.2)])
    lines = core.drain_console()
    assert len(lines) == 2
    assert "step 2" in lines[0] and "step 4" in lines[1]
    assert "all" in lines[1] and "rank" in lines[1]
    assert core.drain_console() == []


def test_deferred_views_come_after_the_decision_and_are_all_drawn(tmp_path):
    """The actor's core (`defer_sinks`): a reduced step's lease and directive are there at
    once, its TensorBoard event and console table only once `run_sinks` draws them (the
    actor does, after the lease and directive were written); the console, a snapshot and
    the close draw what is still waiting, oldest first."""
    core = AggregatorCore(tmp_path, world_size=2, per_print_step=2)
    core.defer_sinks = True
    drawn = []
    core.tb.on_reduced = lambda red, also, directive=None: drawn.append(red.step)
    for s in (1, 2):
        core.ingest([step(0, s), step(1, s)])
        assert core.directive_for(s) is not None and core.lease().reduced_through == s
    assert drawn == [] and list(core.console) == [], "a view was drawn before run_sinks"
    core.run_sinks()
    assert drawn == [1, 2] and len(core.console) == 1 and "step 2" in core.console[0]
    for s in (3, 4):
        core.ingest([step(0, s), step(1, s)])
    assert drawn == [1, 2]
    lines = core.drain_console()
    assert drawn == [1, 2, 3, 4] and len(lines) == 2 and "step 4" in lines[1], lines
    core.ingest([step(0, 5), step(1, 5)])
    core.close()
    assert drawn == [1, 2, 3, 4, 5], "the close draws the last views"


class RecordingSink(Sink):
    """A sink of its own: the base's hooks it overrides, each call written down in order."""

    def __init__(self):
        self.calls = []

    def on_reduced(self, red, also=(), directive=None):
        self.calls.append(("reduced", red.step, directive.action.value if directive else None))

    def on_anomaly(self, record):
        self.calls.append(("anomaly", record["step"], record["rule"]))

    def on_note(self, text):
        self.calls.append(("note", text.split(":")[0]))


def test_a_firing_is_recorded_at_once_and_drawn_by_every_sink_after_the_lease(tmp_path):
    """One pass: the step is reduced and decided (its lease and directive ready, the firing in
    anomalies.jsonl), and only when the views are drawn does every sink (one added here, the
    base's no-op hooks for the rest) get the anomaly, the stop note, then the step."""
    core = AggregatorCore(tmp_path, world_size=2, settings={
        "tensorboard": False, "monitor": {"max_lag_steps": 0},
        "anomalies": [{"rule": "threshold", "name": "loss_high", "metric": "loss", "threshold": 5.0,
                       "action": "stop"}]})
    core.defer_sinks = True
    mine = RecordingSink()
    core.sinks.outputs.append(mine)
    core.ingest([step(0, 1, loss=9.0), step(1, 1, loss=9.0)])
    recorded = [json.loads(x) for x in (tmp_path / "anomalies.jsonl").read_text().splitlines()]
    assert [(r["rule"], r["step"]) for r in recorded] == [("loss_high", 1)], recorded
    assert core.lease().stopping and core.directive_for(1).action is Action.STOP
    assert mine.calls == [] and list(core.console) == [], "a view was drawn before the lease went out"
    core.run_sinks()
    assert mine.calls == [("anomaly", 1, "loss_high"), ("note", "stopping every rank after step 1"),
                          ("reduced", 1, "stop")], mine.calls
    lines = core.drain_console()
    assert lines[0].startswith("ANOMALY loss_high -> stop") and lines[1].startswith("stopping every rank"), lines
    assert lines[2].startswith("step 1"), "the table of the stop step is drawn (a stop prints it)"
    core.close()


def test_the_decisions_return_their_findings_and_write_to_no_view(tmp_path):
    """`Decisions` gives its firings, rule errors and notes back in a `Verdict`; it holds no sink."""
    import inspect

    from mindpulse.aggregator import decisions

    source = inspect.getsource(decisions)
    assert "sinks" not in source.replace("to the sinks", ""), "decisions.py reaches a sink"
    core = AggregatorCore(tmp_path, world_size=1, settings={
        "tensorboard": False, "anomalies": [{"rule": "threshold", "name": "loss_high", "metric": "loss",
                                             "threshold": 5.0, "action": "warn"}]})
    core.ingest([step(0, 1, loss=1.0)])
    from mindpulse.reduction.reducer import reduce_step

    verdict = core.decisions.on_reduced(reduce_step(2, {0: StepPacket(rank=0, step=2, loss=7.0)}, 1), False)
    assert [a["rule"] for a in verdict.anomalies] == ["loss_high"] and verdict.directive.step == 2
    assert not (tmp_path / "anomalies.jsonl").exists(), "the decision wrote anomalies.jsonl itself"
    core.close()


def test_snapshot_fingerprints_losses_and_rank_info(tmp_path):
    core = AggregatorCore(tmp_path, world_size=2)
    core.ingest([EventPacket(rank=0, kind="start", pid=11, host="a").encode(),
                 EventPacket(rank=1, kind="start", pid=12, host="b").encode()])
    core.ingest([step(0, 0, loss=None, fingerprint="f0"), step(1, 0, loss=None, fingerprint="f0")])
    core.ingest([step(0, 1, loss=2.0), step(1, 1, loss=4.0)])
    core.ingest([step(0, 2, loss=1.0, fingerprint="f2"), step(1, 2, loss=1.0, fingerprint="f2")])
    snap = core.snapshot()
    assert snap["steps_completed"] == 2
    assert snap["first_loss"] == 3.0 and snap["last_loss"] == 1.0 and snap["best_loss_step"] == 2
    assert [r["param_fingerprint"] for r in snap["ranks"]] == ["f2", "f2"]
    assert snap["fingerprints_equal"] is True
    assert [(r["pid"], r["host"]) for r in snap["ranks"]] == [(11, "a"), (12, "b")]


def test_fingerprint_mismatch_names_the_odd_rank(tmp_path):
    core = AggregatorCore(tmp_path, world_size=3)
    core.ingest([step(r, 0, loss=None, fingerprint=fp) for r, fp in enumerate(["a", "b", "a"])])
    assert core.snapshot()["fingerprint_mismatches"] == [{"step": 0, "ranks": [1], "majority": "a"}]
    assert any("ranks [1] differ" in line for line in core.drain_console())


def test_metrics_file_is_readable_while_open(tmp_path):
    core = AggregatorCore(tmp_path, world_size=1)
    core.ingest([step(0, 1), step(0, 2)])
    assert [p.step for p in read_packets(tmp_path / "metrics.msgpack")] == [1, 2]


# ---- fuzzing the aggregator's input ---------------------------------------------------------
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


def _mutate(data: bytes, flips: list[tuple[int, int]]) -> bytes:
    b = bytearray(data)
    for i, v in flips:
        if b:
            b[i % len(b)] = v
    return bytes(b)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(
    st.binary(max_size=300),
    st.builds(_mutate, st.sampled_from([step(0, 1), step(1, 2, fingerprint="ab"),
                                        EventPacket(rank=0, kind="start", pid=1).encode()]),
              st.lists(st.tuples(st.integers(0, 400), st.integers(0, 255)), max_size=6)),
), max_size=20))
def test_fuzzed_batches_never_raise_and_rejects_are_counted(tmp_path_factory, batch):
    core = AggregatorCore(tmp_path_factory.mktemp("fz"), world_size=2, settings={"tensorboard": False})
    core.ingest(batch)  # must not raise
    snap = core.snapshot()
    assert snap["packets"]["accepted"] + snap["packets"]["rejected"] == len(batch)
    core.close()


def test_memory_stays_bounded_under_a_flood_of_incomplete_steps(tmp_path):
    core = AggregatorCore(tmp_path, world_size=4, settings={"tensorboard": False})
    for s in range(1, 5001):  # rank 3 never reports: nothing completes
        core.ingest([step(r, s, decision=False) for r in range(3)])
    assert len(core.reducer.pending_steps()) <= core.reducer.max_pending
    # what is neither pending nor evicted was refused: beyond the step window (no step reduced)
    window = core.STEP_WINDOW
    assert core.reducer.evicted_incomplete == window - core.reducer.max_pending
    assert core.rejected["step_out_of_window"] == 3 * (5000 - window)
    assert len(core.directives) == 0 and len(core.recent) == 0
    core.close()


def test_a_failed_checkpoint_save_stops_the_run_when_configured(tmp_path):
    core = AggregatorCore(tmp_path, world_size=1, settings={"tensorboard": False, "monitor": {"max_lag_steps": 0},
                                                            "checkpoint": {"on_save_error": "stop"}})
    core.ingest([step(0, 1)])
    core.ingest([EventPacket(rank=0, kind="error", step=1,
                             message="checkpoint save at step 1 failed: [Errno 28] No space left on device").encode()])
    core.ingest([step(0, 2)])
    d = core.directive_for(2)
    assert d.action is Action.STOP and "No space left" in d.reason
    assert core.snapshot()["stop"]["rule"] == "checkpoint_save"
    go_on = AggregatorCore(tmp_path / "b", world_size=1, settings={"tensorboard": False})
    go_on.ingest([EventPacket(rank=0, kind="error", step=1, message="checkpoint save at step 1 failed: x").encode(),
                  step(0, 1)])
    assert go_on.directive_for(1).action is Action.CONTINUE


def test_forged_ranks_and_future_steps_touch_no_clock_and_are_not_stored(tmp_path):
    core = AggregatorCore(tmp_path, world_size=2, settings={"tensorboard": False})
    core.ingest([step(0, 1), step(1, 1)])
    before = (core.last_progress, dict(core.heartbeat))
    core.ingest([step(0, (1 << 40) - 1), step(7, 2), EventPacket(rank=1, kind="heartbeat", step=1 << 39).encode()])
    assert core.rejected == {"step_out_of_window": 2, "rank_out_of_world": 1}, core.rejected
    assert (core.last_progress, dict(core.heartbeat)) == before, "a forged packet moved a clock"
    assert dict(core.reducer.last_step_of_rank) == {0: 1, 1: 1}
    for s in range(2, 300):  # 300 forged future steps cannot evict a live pending step
        core.ingest([step(0, s + 1000)])
    core.ingest([step(0, 2), step(1, 2)])
    assert core.reducer.reduced_through == 2
    core.close()
    stored = [o for o in read_wire(tmp_path / "metrics.msgpack") if o.get("t") == "step"]
    assert max(o["step"] for o in stored) == 2, "refused packets are not stored"


def test_bad_nested_content_is_refused_by_the_codec_and_a_bad_packet_costs_only_itself(tmp_path):
    from mindpulse.wire.protocol import PacketError, TelemetryPacket, decode

    for cards in ([{"card": 0, "util_pct": "x"}], [{"card": [1, 2]}], [{"ranks": ["a"]}], ["not a map"]):
        with pytest.raises(PacketError):
            decode(TelemetryPacket(node="n0", cards=cards).encode())
    core = AggregatorCore(tmp_path, world_size=1, settings={"tensorboard": False, "monitor": {"max_lag_steps": 0},
                                                             "anomalies": [{"rule": "threshold", "metric": "loss",
                                                                            "op": ">", "threshold": 5,
                                                                            "action": "stop"}]})
    bad_ckpt = EventPacket(rank=0, kind="checkpoint", message='[{"step": "x", "path": "a", "kind": "best"}, '
                           '{"step": 1e999, "path": "b", "kind": "best"}]').encode()
    core.ingest([bad_ckpt, TelemetryPacket(node="n0", cards=[{"card": 0, "util_pct": "x"}]).encode(),
                 step(0, 1, loss=9.0)])
    assert core.rejected["bad_checkpoint_entry"] == 2 and core.rejected["malformed"] == 1, core.rejected
    assert core.directive_for(1).action is Action.STOP, "the stop in the same batch was not lost"
    core.close()
    again = AggregatorCore(tmp_path, world_size=1, settings={"tensorboard": False}, replay=True)
    assert again.reducer.reduced_through == 1, "replay skips what it cannot apply and goes on"


def test_a_batch_completing_two_steps_settles_each(tmp_path):
    """The packet path's loop (`AggregatorCore._decide`): a node batch whose partials complete
    steps 3 and 4 (a node catching up) returns both, and step 3's NaN stops the run at
    3 + lag, as if it had arrived alone."""
    from mindpulse.reduction.partial import partial_of, to_wire

    core = AggregatorCore(tmp_path, world_size=2, settings={"tensorboard": False, "monitor": {"max_lag_steps": 1},
                                                             "world": {"nodes": 1, "ranks_per_node": 2}})

    def part(s, loss=1.0):
        return to_wire(partial_of(s, {r: StepPacket(rank=r, step=s, loss=loss, step_time_s=0.1, samples=4)
                                      for r in (0, 1)}))

    for s in (1, 2):
        core.ingest_node(0, {"steps": [], "other": [], "partials": [part(s)], "rejected": {}})
    done = core.ingest_node(0, {"steps": [], "other": [], "partials": [part(3, float("nan")), part(4)],
                                "rejected": {}})
    assert [r.step for r in done] == [3, 4]
    stop = core.snapshot()["stop"]
    assert stop is not None and stop["rule"] == "nonfinite", stop
    assert (stop["decided_at"], stop["step"]) == (3, 4), stop
    assert core.lease().stop_after == 4
    assert core.directive_for(4).action is Action.STOP and core.directive_for(3).action is Action.CONTINUE
    core.close()


def test_a_step_whose_settling_fails_is_counted_and_the_batch_goes_on(tmp_path, monkeypatch):
    """One step's consequences failing (a bug in a view, a rule) costs that step's settling
    only: counted as `apply_error`, the next step of the same batch is settled."""
    core = AggregatorCore(tmp_path, world_size=1, settings={"tensorboard": False})
    settled = []
    real = core._on_reduced

    def flaky(red):
        if red.step == 1:
            raise RuntimeError("a view broke")
        settled.append(red.step)
        real(red)

    monkeypatch.setattr(core, "_on_reduced", flaky)
    done = core.ingest([step(0, 1), step(0, 2)])
    assert [r.step for r in done] == [1, 2] and settled == [2]
    assert core.rejected["apply_error"] == 1
    assert core.directive_for(2).action is Action.CONTINUE
    core.close()
