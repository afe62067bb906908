"""The experiment trackers (MLflow with a local file store, SwanLab offline): one tracker run per
job whose series, read back with each tracker's own reader, are metrics.msgpack's reduced values
under TensorBoard's names; a resumed attempt continues the same tracker run; a tracker failing
at run time is counted and the training goes on; a missing package refuses the launch naming the
extra; an unknown option is a ConfigError naming the key."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from mindpulse.aggregator.core import AggregatorCore
from mindpulse.config import ConfigError, from_dict
from mindpulse.launcher.preflight import LaunchRefused, check_local, check_trackers
from mindpulse.registry.metrics import tb_scalars
from mindpulse.rundir.metrics_store import read_records
from mindpulse.wire.protocol import EventKind, EventPacket, StepPacket, TelemetryPacket

mlflow = pytest.importorskip("mlflow", reason="pip install 'mindpulse[mlflow]'")
swanlab = pytest.importorskip("swanlab", reason="pip install 'mindpulse[swanlab]'")


def make_core(run_dir: Path, sinks: dict, *, attempt: int = 0, start_step: int = 0,
              tensorboard: bool = False) -> AggregatorCore:
    core = AggregatorCore(run_dir, world_size=2, per_print_step=100, settings={
        "tensorboard": tensorboard, "sinks": sinks, "attempt": attempt, "start_step": start_step,
        "anomalies": [{"rule": "nonfinite", "action": "warn"}]})
    core.defer_sinks = True  # as the actor: the views of a step run after its lease and directive
    return core


def train(core: AggregatorCore, steps: range, nan_at: tuple[int, int] | None = None) -> None:
    core.ingest([TelemetryPacket(node="node0-hostA", ts=1.0, source="psutil", cards=[
        {"card": 3, "util_pct": 40.0, "memory_used_mb": 1024.0, "power_w": 90.0, "temp_c": 55.0}]).encode()])
    for s in steps:
        core.ingest([StepPacket(rank=r, step=s, loss=(math.nan if (s, r) == nan_at else 2.0 - 0.1 * s + r),
                                step_time_s=0.1 + 0.01 * r, samples=8, tokens=512, grad_norm=1.5,
                                grad_norm_local=1.0 + r, monitor_self_s=0.001, ts=100.0 + s).encode()
                     for r in range(2)])
    core.ingest([EventPacket(rank=0, step=steps[-1], kind=EventKind.CHECKPOINT, message="x").encode()])
    core.run_sinks()


def reduced(run_dir: Path) -> dict[int, dict]:
    return {rec["step"]: rec for rec in read_records(run_dir / "metrics.msgpack") if rec.get("t") == "reduced"}


def expected(records: dict[int, dict]) -> dict[str, dict[int, float]]:
    """The registry's cluster series TensorBoard writes, from the reduced records: {tag: {step: value}}."""
    out: dict[str, dict[int, float]] = {}
    for tag, attr, when in tb_scalars():
        for step, rec in records.items():
            v = rec.get(attr)
            if (when is None or rec.get(when) is not None) and isinstance(v, (int, float)) and math.isfinite(v):
                out.setdefault(tag, {})[step] = float(v)
    return out


def mlflow_series(run_dir: Path) -> tuple[str, dict[str, dict[int, float]]]:
    from mlflow.tracking import MlflowClient

    ids = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=ids["tracking_uri"])
    run = client.get_run(ids["run_id"])
    series = {key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
              for key in run.data.metrics}
    return ids["run_id"], series


def swanlab_records(logdir: Path) -> list:
    """Every record of every SwanLab run file under `logdir`, read with SwanLab's own reader."""
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    out = []
    for path in sorted(logdir.glob("run-*/run-*.swanlab")):
        reader = DataStoreReader()
        reader.open(path)
        try:
            for raw in reader:
                rec = Record()
                rec.ParseFromString(raw)
                out.append(rec)
        finally:
            reader.close()
    return out


def test_mlflow_run_holds_the_reduced_series_under_tensorboards_names(tmp_path):
    run_dir = tmp_path / "runs" / "run-x"
    core = make_core(run_dir, {"mlflow": {"enabled": True}}, tensorboard=True)
    try:
        console = "\n".join(core.drain_console())
        assert f"in {(tmp_path / 'runs' / 'mlruns').as_uri()}" in console  # <output.root>/mlruns by default
        train(core, range(1, 6), nan_at=(4, 1))
    finally:
        core.close()
    assert not core.sinks.output_errors
    run_id, series = mlflow_series(run_dir)
    want = expected(reduced(run_dir))
    assert want["loss/mean"] and 4 not in want["loss/mean"]  # the NaN step is no point, as in TensorBoard
    for tag, points in want.items():
        assert series[tag] == pytest.approx(points), tag
    assert series["rank_1/loss"][1] == pytest.approx(2.0 - 0.1 + 1)
    assert series["card_node0-hostA_3/util"] == {0: 40.0}
    # the same names as TensorBoard's scalars
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    assert set(series) == set(acc.Tags()["scalars"])
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(tmp_path / "runs" / "mlruns").as_uri())
    run = client.get_run(run_id)
    assert run.info.run_name == "run-x" and run.info.status == "FINISHED"
    assert run.data.params["world.nodes"] == "1" and run.data.params["sinks.mlflow.enabled"] == "true"
    assert run.data.tags["mindpulse.last_checkpoint_step"] == "5"
    assert "nonfinite" in run.data.tags["mindpulse.last_anomaly"]
    [anomaly] = [a.path for a in client.list_artifacts(run_id, "anomalies")]
    assert json.loads(Path(client.download_artifacts(run_id, anomaly, str(tmp_path))).read_text())["step"] == 4


def _tb_series(logdir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


@pytest.mark.parametrize("nodes, grain", [(1, "card"), (33, "node"), (129, "job")])
def test_a_jobs_card_samples_reach_tensorboard_and_mlflow_at_the_grain_its_size_sets(tmp_path, nodes, grain):
    """Up to 256 cards every card's scalars; up to 1,024 each node sample's extremes (4 tags a
    node); above, the job's extremes once a step (4 tags in all), the step's point written when a
    later step's sample arrives and the last at close. TensorBoard and MLflow (the real sinks) write
    the same tags and values, so a tracker's card cost follows steps, not nodes, in a big job."""
    from mindpulse.aggregator.card_series import CardGrain, card_grain
    from mindpulse.aggregator.mlflow_sink import MlflowSink
    from mindpulse.aggregator.tb_sink import TensorBoardSink

    config = from_dict({"world": {"nodes": nodes, "ranks_per_node": 8}, "sinks": {"mlflow": {"enabled": True}}})
    assert card_grain(config.world.world_size) is CardGrain(grain)

    def cards(hot: float) -> list[dict]:
        return [{"card": c, "util_pct": 0.0 if c == 3 else 95.0, "memory_used_mb": 1000.0 + c, "power_w": 300.0 + c,
                 "temp_c": float("nan") if c == 7 else hot + c} for c in range(8)]

    run_dir = tmp_path / "runs" / "run-x"
    tb = TensorBoardSink(run_dir, flush_secs=1.0, cards=config.world.world_size)
    ml = MlflowSink(config.sinks.mlflow, run_dir=run_dir, config=config, attempt=0)
    samples = [("node7-h7", cards(50.0), 5), ("node9-h9", cards(60.0), 5), ("node7-h7", cards(40.0), 6)]
    for node, cs, step in samples:
        for sink in (tb, ml):
            sink.on_telemetry(node, cs, 1.0, step)
    tb.close()
    ml.close()
    written = _tb_series(run_dir / "tb")
    assert mlflow_series(run_dir)[1] == written, "MLflow writes TensorBoard's card tags and values"
    if grain == "card":  # every card's, the NaN left out
        assert len(written) == 2 * (8 * 4) - 2 and written["card_node7-h7_3/util"] == {5: 0.0, 6: 0.0}
    elif grain == "node":
        assert written == {
            "cards_node7-h7/util_min": {5: 0.0, 6: 0.0}, "cards_node7-h7/memory_used_mb_max": {5: 1007.0, 6: 1007.0},
            "cards_node7-h7/power_w_max": {5: 307.0, 6: 307.0}, "cards_node7-h7/temp_c_max": {5: 56.0, 6: 46.0},
            "cards_node9-h9/util_min": {5: 0.0}, "cards_node9-h9/memory_used_mb_max": {5: 1007.0},
            "cards_node9-h9/power_w_max": {5: 307.0}, "cards_node9-h9/temp_c_max": {5: 66.0}}
    else:  # over every node's latest sample: node9's 66 C stays the job's hottest at step 6 (written at close)
        assert written == {"cards/util_min": {5: 0.0, 6: 0.0}, "cards/memory_used_mb_max": {5: 1007.0, 6: 1007.0},
                           "cards/power_w_max": {5: 307.0, 6: 307.0}, "cards/temp_c_max": {5: 66.0, 6: 66.0}}


def test_the_job_grain_is_every_nodes_latest_sample_once_a_step():
    """A point is the extremes over every node's latest sample (nodes report every few seconds,
    not every step), written when a later step's sample comes or every JOB_POINT_S while the step
    stands still (a hang); a late sample of an earlier step counts towards the point waiting; a
    node silent for STALE_S leaves the point."""
    from mindpulse.aggregator.card_series import JOB_EXTREMES_CARDS, JOB_POINT_S, STALE_S, CardSeries

    series = CardSeries(JOB_EXTREMES_CARDS + 16)

    def temp(c: float) -> list[dict]:
        return [{"card": 0, "temp_c": c}, {"card": 1, "temp_c": float("nan")}]

    assert series.sample("a", temp(50.0), 10, now=0.0) == []
    assert series.sample("b", temp(90.0), 9, now=1.0) == [], "a late sample waits with step 10's point"
    assert series.sample("c", temp(40.0), 11, now=2.0) == [(10, [("cards/temp_c_max", 90.0)])]
    assert series.sample("a", temp(45.0), 11, now=3.0) == [], "one point a step"
    # the step stands still (a hang): a point every JOB_POINT_S all the same, node b's 90 C still in it
    assert series.sample("a", temp(45.0), 11, now=2.0 + JOB_POINT_S) == [(11, [("cards/temp_c_max", 90.0)])]
    # b and c silent for over STALE_S: only a's latest remains
    later = 2.0 + JOB_POINT_S + STALE_S - 1.0
    assert series.sample("d", temp(30.0), 12, now=later) == [(11, [("cards/temp_c_max", 45.0)])]
    assert series.drain(now=later) == [(12, [("cards/temp_c_max", 45.0)])] and series.drain() == []


def test_a_resumed_attempt_continues_the_same_mlflow_run(tmp_path):
    run_dir = tmp_path / "run-x"
    first = make_core(run_dir, {"mlflow": {"enabled": True}})
    train(first, range(1, 4))
    first.close()
    second = make_core(run_dir, {"mlflow": {"enabled": True}}, attempt=1, start_step=3)
    assert any("(continued)" in line for line in second.drain_console())
    train(second, range(4, 7))
    second.close()
    run_id, series = mlflow_series(run_dir)
    assert run_id == json.loads((run_dir / "trackers.json").read_text())["mlflow"]["run_id"]
    assert series["loss/mean"] == pytest.approx(expected(reduced(run_dir))["loss/mean"])
    assert sorted(series["loss/mean"]) == [1, 2, 3, 4, 5, 6]
    from mlflow.tracking import MlflowClient

    run = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri()).get_run(run_id)
    assert run.data.tags["mindpulse.attempt"] == "1" and run.info.status == "FINISHED"
    assert len(MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri()).search_runs(
        [run.info.experiment_id])) == 1


def test_an_attempt_with_another_mlflow_experiment_starts_a_new_run_and_says_why(tmp_path):
    run_dir = tmp_path / "run-x"
    first = make_core(run_dir, {"mlflow": {"enabled": True}})
    train(first, range(1, 3))
    first.close()
    old = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    second = make_core(run_dir, {"mlflow": {"enabled": True, "experiment": "other"}}, attempt=1, start_step=2)
    said = "\n".join(second.drain_console())
    second.close()
    assert "sinks.mlflow.experiment changed" in said and "a new MLflow run" in said, said
    new = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    assert new["run_id"] != old["run_id"] and new["experiment"] == "other"


def test_an_mlflow_failure_at_run_time_is_counted_and_training_goes_on(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    core = make_core(tmp_path / "run-x", {"mlflow": {"enabled": True}})

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(MlflowClient, "log_batch", full)
    try:
        train(core, range(1, 6))
    finally:
        core.close()
    assert sum(n for key, n in core.sinks.output_errors.items() if key.startswith("MlflowSink.")) >= 1
    assert "No space left on device" in "\n".join(core.drain_console())
    assert core.last_reduced is not None and core.last_reduced.step == 5
    assert len(reduced(tmp_path / "run-x")) == 5


def test_a_swanlab_run_that_ends_under_the_job_is_counted_and_training_goes_on(tmp_path):
    """SwanLab ends its run on its own (at the process's exit, on a crash of its own): the sink's
    next write finds it ended, which is counted and said once; the steps go on being reduced and
    written, the other outputs keep logging."""
    core = make_core(tmp_path / "run-x", {"swanlab": {"enabled": True}, "mlflow": {"enabled": True}})
    try:
        train(core, range(1, 3))
        assert not core.sinks.output_errors
        swanlab.finish()  # SwanLab's own end of its current run, as at exit: the sink did not ask for it
        train(core, range(3, 6))
        console = "\n".join(core.drain_console())
    finally:
        core.close()
    errors = core.sinks.output_errors
    assert errors["SwanLabSink.on_reduced"] == 3 and errors["SwanLabSink.on_checkpoint"] == 1, errors
    assert not any(key.startswith("MlflowSink.") for key in errors), errors
    assert console.count("SwanLabSink failed in on_reduced (TrackerFailed: the SwanLab run") == 1, console
    assert f"ended before the job (SwanLab's log: {tmp_path / 'run-x' / 'swanlab'})" in console
    assert core.last_reduced is not None and core.last_reduced.step == 5
    assert sorted(reduced(tmp_path / "run-x")) == [1, 2, 3, 4, 5]
    _, series = mlflow_series(tmp_path / "run-x")
    assert sorted(series["loss/mean"]) == [1, 2, 3, 4, 5]  # the other tracker logged on
    logged = {r.scalar.step for r in swanlab_records(tmp_path / "run-x" / "swanlab")
              if r.HasField("scalar") and r.scalar.key == "loss/mean"}
    assert logged == {1, 2}


def test_swanlab_offline_run_holds_the_reduced_series_and_a_resumed_attempt_continues_it(tmp_path):
    run_dir = tmp_path / "run-x"
    first = make_core(run_dir, {"swanlab": {"enabled": True}})
    try:
        assert any("offline" in line and str(run_dir / "swanlab") in line for line in first.drain_console())
        train(first, range(1, 4), nan_at=(2, 0))
    finally:
        first.close()
    second = make_core(run_dir, {"swanlab": {"enabled": True}}, attempt=1, start_step=3)
    try:
        train(second, range(4, 7))
    finally:
        second.close()
    assert not first.sinks.output_errors and not second.sinks.output_errors
    records = swanlab_records(run_dir / "swanlab")
    run_id = json.loads((run_dir / "trackers.json").read_text())["swanlab"]["run_id"]
    starts = [r.start for r in records if r.HasField("start")]
    assert len(starts) == 2 and {s.id for s in starts} == {run_id} and {s.name for s in starts} == {"run-x"}
    series: dict[str, dict[int, float]] = {}
    for r in records:
        if r.HasField("scalar"):
            series.setdefault(r.scalar.key, {})[r.scalar.step] = r.scalar.value.number
    want = expected(reduced(run_dir))
    assert sorted(want["loss/mean"]) == [1, 3, 4, 5, 6]
    for tag, points in want.items():
        assert series[tag] == pytest.approx(points), tag
    assert series["rank_1/grad_norm_local"][5] == 2.0 and series["checkpoint/step"] == {3: 3, 6: 6}
    # a card sample is logged at the newest reduced step the aggregator knows (none yet: 0)
    assert series["card_node0-hostA_3/temp_c"] == {0: 55.0}
    texts = [r for r in records if r.HasField("media") and r.media.key == "anomalies/nonfinite"]
    assert [t.media.step for t in texts] == [2]


def test_a_missing_package_refuses_the_launch_naming_the_extra(tmp_path, monkeypatch):
    cfg = from_dict({"sinks": {"mlflow": {"enabled": True}, "swanlab": {"enabled": True}}})
    check_trackers(cfg)  # both installed here
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(LaunchRefused, match=r"sinks\.mlflow\.enabled .*pip install 'mindpulse\[mlflow\]'"):
        check_local(cfg)
    monkeypatch.setitem(sys.modules, "swanlab", None)
    with pytest.raises(LaunchRefused, match=r"pip install 'mindpulse\[swanlab\]'"):
        check_trackers(from_dict({"sinks": {"swanlab": {"enabled": True}}}))
    check_trackers(from_dict({}))  # none turned on: nothing needed
    # the aggregator says it too, and trains on without the tracker
    core = make_core(tmp_path / "run-x", {"mlflow": {"enabled": True}})
    console = "\n".join(core.drain_console())
    train(core, range(1, 3))
    core.close()
    assert "MLflow tracker did not start" in console and "pip install 'mindpulse[mlflow]'" in console
    assert core.sinks.outputs == [] and core.last_reduced.step == 2


@pytest.mark.parametrize("section,key", [("mlflow", "uri"), ("swanlab", "dir")])
def test_an_unknown_tracker_option_is_a_config_error_naming_it(section, key):
    with pytest.raises(ConfigError, match=rf"sinks\.{section}\.{key}"):
        from_dict({"sinks": {section: {"enabled": True, key: "x"}}})


def _resumable(run_dir: Path, cfg) -> None:
    """What `--resume RUN_DIR` reads of a run directory: its config.yaml and a checkpoint its
    manifest lists (step 3)."""
    from mindpulse.launcher.rundir import write_config
    from mindpulse.rundir.checkpoint_manifest import CkptEntry, sha256_of, write_manifest

    write_config(run_dir, cfg)
    ckpt = run_dir / "checkpoints" / "step_00000003-periodic.ckpt"
    ckpt.parent.mkdir(parents=True)
    ckpt.write_bytes(b"weights")
    write_manifest(ckpt.parent, [CkptEntry(path=ckpt.name, step=3, epoch=0, kind="periodic", metric=None,
                                           metric_name="", size=ckpt.stat().st_size, sha256=sha256_of(ckpt),
                                           time=1.0)])


def test_launch_resume_continues_the_tracker_runs_of_the_run_it_resumes(tmp_path, monkeypatch, capsys):
    """`mindpulse launch --resume RUN_DIR` makes a new run directory; RUN_DIR's trackers.json is in
    it before the aggregator starts, so the MLflow run and the SwanLab run go on (one run each)."""
    from mindpulse.launcher import launch as launch_mod
    from mindpulse.launcher.cli import main
    from mindpulse.launcher.preflight import LaunchRefused

    root = tmp_path / "runs"
    sinks = {"mlflow": {"enabled": True}, "swanlab": {"enabled": True}}
    first_dir = root / "job-1"
    first = make_core(first_dir, sinks)
    train(first, range(1, 4))
    first.close()
    _resumable(first_dir, from_dict({"output": {"root": str(root)}, "sinks": sinks}))
    ids = json.loads((first_dir / "trackers.json").read_text())

    # the CLI's launch up to where its Ray cluster would start (none starts here): what the new run directory holds
    seen: dict = {}

    class NoRay:  # stands where the Ray cluster (and the aggregator in it) would start
        def __init__(self, cfg):
            [new] = [d for d in root.iterdir() if d.name.startswith(cfg.name + "-")]
            seen.update(run_dir=new, trackers=json.loads((new / "trackers.json").read_text()))

        def __enter__(self):
            raise LaunchRefused("no Ray cluster in this test")

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(launch_mod, "RaySession", NoRay)
    assert main(["launch", "--resume", str(first_dir)]) == 2
    assert "no Ray cluster in this test" in capsys.readouterr().err
    assert seen["run_dir"] != first_dir and seen["trackers"] == ids

    # the resumed launch's aggregator, in the run directory the launch made, continues both runs
    launch = launch_mod.Launch(from_dict({"output": {"root": str(root)}, "sinks": sinks}), None,
                               resume={"path": "", "step": 3, "epoch": 0, "kind": "periodic"},
                               resumed_run=first_dir)
    [line] = launch.carried  # said after the run directory's line
    assert line.startswith(f"tracker runs continued from {first_dir / 'trackers.json'}: ")
    assert ids["mlflow"]["run_id"] in line and ids["swanlab"]["run_id"] in line
    second = make_core(launch.run_dir, sinks, start_step=3)
    try:
        console = "\n".join(second.drain_console())
        train(second, range(4, 7))
    finally:
        second.close()
    assert console.count("(continued") == 2, console
    assert not first.sinks.output_errors and not second.sinks.output_errors
    assert json.loads((launch.run_dir / "trackers.json").read_text()) == ids
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(root / "mlruns").as_uri())
    run = client.get_run(ids["mlflow"]["run_id"])
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss/mean")) == [1, 2, 3, 4, 5, 6]
    assert len(client.search_runs([run.info.experiment_id])) == 1 and run.info.status == "FINISHED"
    # SwanLab offline: each run directory holds its attempt's files, both under the one run id
    starts = [r.start for d in (first_dir, launch.run_dir) for r in swanlab_records(d / "swanlab")
              if r.HasField("start")]
    assert len(starts) == 2 and {s.id for s in starts} == {ids["swanlab"]["run_id"]}
    steps = {r.scalar.step for r in swanlab_records(launch.run_dir / "swanlab")
             if r.HasField("scalar") and r.scalar.key == "loss/mean"}
    assert steps == {4, 5, 6}


def test_a_resumed_run_without_trackers_or_with_a_damaged_file_carries_nothing(tmp_path):
    from mindpulse.launcher.resume import carry_tracker_runs

    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    new.mkdir()
    both = ["mlflow", "swanlab"]
    assert carry_tracker_runs(old, new, enabled=both) == [] and not (new / "trackers.json").exists()
    # a tracker this launch turns off is carried (a later launch may turn it on) but not said to continue
    (old / "trackers.json").write_text('{"mlflow": {"run_id": "m1"}, "swanlab": {"run_id": "s1"}}')
    assert carry_tracker_runs(old, new, enabled=["mlflow"]) == [
        f"tracker runs continued from {old / 'trackers.json'}: mlflow m1"]
    assert json.loads((new / "trackers.json").read_text())["swanlab"] == {"run_id": "s1"}
    assert carry_tracker_runs(old, new, enabled=[]) == []
    (new / "trackers.json").unlink()
    (old / "trackers.json").write_text("{")
    [line] = carry_tracker_runs(old, new, enabled=both)
    assert str(old / "trackers.json") in line and "new runs" in line and not (new / "trackers.json").exists()


def test_a_card_without_an_id_is_named_by_its_place_in_the_sample():
    """A card with no `card` field is named by its index in the node's sample, entries that are
    not cards counted (as the per-card tags were before the grains)."""
    from mindpulse.aggregator.card_series import CardSeries

    assert CardSeries(8).sample("n", ["not a card", {"util_pct": 5.0}], 1) == [(1, [("card_n_1/util", 5.0)])]
