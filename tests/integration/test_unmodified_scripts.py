"""End to end: a user's MindSpore script with no mindpulse import, launched as it is
(`job.script`), two real ranks in data parallel on CPU (workers/auto_attach.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mindpulse.rundir.metrics_store import read_records

pytestmark = [pytest.mark.slow, pytest.mark.cluster]
SCRIPT = Path(__file__).resolve().parent / "scripts" / "plain_train.py"


def launch(run_cli, tmp_path: Path, *script_args: str, steps: int = 12, extra: tuple[str, ...] = (),
           ckpt_dir: str = "ckpt_{rank}"):
    """`ckpt_dir` with `{rank}`: a folder per rank, as the advice asks; one folder for every rank
    only where the advice itself is tested (MindSpore's own save races there)."""
    args = ", ".join(f"'{a}'" for a in ("--ckpt-dir", str(tmp_path / ckpt_dir), "--steps", str(steps), *script_args))
    return run_cli("launch", "--set", f"job.script={SCRIPT}", "--set", f"job.args=[{args}]",
                   "--set", "train.steps=0", "--set", "monitor.per_print_step=4", "--set", "output.report=false",
                   *extra, timeout=400)


def records(run_dir: Path) -> tuple[list[dict], list[dict]]:
    wire = list(read_records(run_dir / "metrics.msgpack"))
    return [o for o in wire if o.get("t") == "step"], [o for o in wire if o.get("t") == "reduced"]


def test_model_train_script_is_watched_without_an_edit(run_cli, tmp_path):
    """GRAPH mode, Model builds the train cell, sink mode on, MindSpore's own callbacks with a
    ModelCheckpoint every rank points at one directory. Rank 1 saves half a second after rank 0:
    MindSpore's own save races between ranks saving one file at the same instant, which is what
    the advice below warns of, not what this test judges."""
    r = launch(run_cli, tmp_path, "--mode", "graph", "--cell", "model", "--save-stagger", "0.5", ckpt_dir="ckpt")
    assert r.returncode == 0, r.output
    s = r.summary
    assert s["status"] == "succeeded" and s["steps_completed"] == 12, s
    assert s["no_steps_reason"] is None
    # the cluster table, with a reduced loss and global grad norm
    assert "step 12  epoch 1  ranks 2" in r.stdout and "\nall     12 " in r.stdout, r.output
    pk, red = records(r.run_dir)
    assert {(o["rank"], o["step"]) for o in pk} >= {(rk, st) for rk in (0, 1) for st in range(13)}
    assert s["packets"]["duplicates"] == 0, "the Monitor was doubled"
    assert all(o["grad_norm"] is not None and o["grad_norm_local"] is not None for o in pk if o["step"] > 0)
    # the global norm is taken after the all-reduce: equal on both ranks; the local ones differ
    by_step = {}
    for o in pk:
        if o["step"] > 0:
            by_step.setdefault(o["step"], {})[o["rank"]] = o
    for step, ranks in by_step.items():
        assert ranks[0]["grad_norm"] == pytest.approx(ranks[1]["grad_norm"], rel=1e-5), step
    assert any(ranks[0]["grad_norm_local"] != ranks[1]["grad_norm_local"] for ranks in by_step.values())
    assert all(o["overflow"] is None and o["loss_scale"] is None for o in pk), "no loss-scale cell runs here"
    red_steps = {o["step"]: o for o in red}
    assert red_steps[12]["loss_mean"] is not None and red_steps[12]["grad_norm"] is not None
    assert s["last_loss"] == pytest.approx(red_steps[12]["loss_mean"])
    assert s["last_grad_norm"] == pytest.approx(red_steps[12]["grad_norm"])
    # the Monitor was added once per rank, said so once; the statistics attached
    for rank in (0, 1):
        log = (r.run_dir / "logs" / f"rank_{rank}.log").read_text()
        assert log.count("mindpulse added its Monitor to Model.train's callbacks") == 1, log[-3000:]
        assert "gradient statistics around TrainOneStepCell's gradient reducer" in log
        assert "rank 1/2 done" in log or rank == 0
    # the script's own callbacks kept working: MindSpore's LossMonitor printed, ModelCheckpoint wrote
    assert "loss is" in (r.run_dir / "logs" / "rank_0.log").read_text()
    assert list((tmp_path / "ckpt").glob("plain*.ckpt")), "the script's ModelCheckpoint wrote nothing"
    # ... and writes one directory from both ranks: said on the console and in summary.json
    shared = [a for a in s["advice"] if a["kind"] == "shared_directory"]
    assert len(shared) == 1 and shared[0]["callback"] == "ModelCheckpoint", s["advice"]
    assert shared[0]["ranks"] == [0, 1] and shared[0]["directory"] == str(tmp_path / "ckpt")
    assert "advice: ModelCheckpoint of all 2 ranks writes the same directory" in r.stdout
    assert s["best_checkpoint"] and Path(s["best_checkpoint"]["path"]).exists()


def test_own_train_cell_nan_grad_stops_every_rank_after_one_step(run_cli, tmp_path):
    """PYNATIVE, the script's own nn.TrainOneStepCell handed to Model: an injected NaN
    gradient on rank 1 stops both ranks after the same step, though the script's own
    LossMonitor raises on the NaN loss of the step the stop ends."""
    r = launch(run_cli, tmp_path, "--mode", "pynative", "--cell", "own", extra=("--inject", "nan_grad@1:5"))
    assert r.returncode == 3, r.output
    s = r.summary
    assert s["status"] == "anomaly_stop" and s["stop"]["rule"] == "nonfinite", s["stop"]
    assert s["stop"]["rank"] == 1 and s["stop"]["decided_at"] == 5
    assert [x["last_step"] for x in s["ranks"]] == [s["stop"]["step"]] * 2, s["ranks"]
    assert [x["exit_code"] for x in s["ranks"]] == [0, 0]
    pk, _ = records(r.run_dir)
    bad = [o for o in pk if o["step"] == 5 and o["rank"] == 1][0]
    assert bad["nan_count"] > 0, bad
    # exit code 0 on both ranks (above): where the script's LossMonitor raised on the NaN loss of
    # the stop step, that error was taken as the stop (logged), not as a crash of the rank


def test_loss_scale_cell_reports_its_scale_and_skipped_steps(run_cli, tmp_path):
    """The script's own TrainOneStepWithLossScaleCell (dynamic scale) on CPU: its scale and
    overflow flag reach the aggregator; the step whose gradients overflow is skipped by the
    cell and is not an anomaly; a rule on `overflow` sees it."""
    rule = "[{rule: threshold, name: overflowing, metric: overflow, op: '>=', threshold: 1, action: warn}]"
    r = launch(run_cli, tmp_path, "--mode", "graph", "--cell", "loss_scale", "--overflow-at", "3",
               extra=("--set", f"anomalies={rule}"))
    assert r.returncode == 0, r.output
    s = r.summary
    pk, red = records(r.run_dir)
    assert all(o["loss_scale"] is not None and o["overflow"] is not None for o in pk if o["step"] > 0), r.output
    assert {o["rank"]: o["overflow"] for o in pk if o["step"] == 3} == {0: True, 1: True}, \
        "the overflow flag is all-reduced"
    assert s["overflow_steps"]["total"] == 1 and s["overflow_steps"]["per_rank"] == {"0": 1, "1": 1}, s
    red_steps = {o["step"]: o for o in red}
    assert red_steps[3]["overflow_ranks"] == 2 and red_steps[12]["overflow_steps"] == 1
    # the dynamic scale halves at the overflow (the cell reports it before or after its update)
    after = min(red_steps[k]["loss_scale_min"] for k in (3, 4))
    assert after == red_steps[2]["loss_scale_min"] / 2, [red_steps[k]["loss_scale_min"] for k in (2, 3, 4)]
    assert s["loss_scale"]["min"] == red_steps[12]["loss_scale_min"]
    fired = json.loads((r.run_dir / "anomalies.json").read_text())
    # the rule on `overflow` saw the skipped step; the skipped step's Inf gradients are no anomaly
    # (a default warn rule such as compute_drop may fire on this busy machine: not judged here)
    assert [(a["rule"], a["step"]) for a in fired if a["rule"] == "overflowing"] == [("overflowing", 3)], fired
    assert not [a for a in fired if a["rule"] == "nonfinite"], fired
    assert "loss scale" in r.stdout and "overflow steps 1" in r.stdout
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ev = EventAccumulator(str(r.run_dir / "tb"))
    ev.Reload()
    assert {"loss_scale/min", "loss_scale/max", "overflow/steps"} <= set(ev.Tags()["scalars"])


@pytest.mark.parametrize("auto, loop, why", [
    ("false", "model", "Model.train runs without mindpulse's Monitor (job.auto_monitor is false)"),
    ("true", "hand", "it trains (TrainOneStepCell called) without mindpulse's Monitor"),
])
def test_a_rank_without_a_monitor_is_named_at_once(run_cli, tmp_path, auto, loop, why):
    """auto-attach off (Model.train), or a hand loop mindpulse cannot watch: the console
    names the ranks at their first step, the run is not declared hung, summary.json says why
    no step was reduced and what to add."""
    r = launch(run_cli, tmp_path, "--mode", "pynative", "--loop", loop,
               extra=("--set", f"job.auto_monitor={auto}", "--set", "monitor.hang_timeout_s=5"))
    assert r.returncode == 0, r.output
    s = r.summary
    assert s["status"] == "succeeded" and s["steps_completed"] == 0 and s["failure"] is None
    first = r.stdout.index(why)
    assert first < r.stdout.index("run local-cpu:"), "named only at the end, not while it ran"
    assert "To fix: add `callbacks=[Monitor()]`" in r.stdout
    missing = [a for a in s["advice"] if a["kind"] == "no_monitor"]
    assert missing and missing[0]["ranks"] == [0, 1], s["advice"]
    assert why in s["no_steps_reason"] and "To fix" in s["no_steps_reason"]


MF_SCRIPT = Path(__file__).resolve().parent / "scripts" / "run_mindformer_style.py"
MF_YAML = Path(__file__).resolve().parents[2] / "workers" / "recipes" / "mindformers" / "llama_tiny_finetune.yaml"


def test_a_run_mindformer_style_script_gets_the_same(run_cli, tmp_path):
    """A user's own script running MindFormers' Trainer (no mindpulse import), on a YAML of
    theirs that reads a MindRecord: the Monitor is added to the Model.train MindFormers calls,
    MindFormers' own outputs are read (no second pass over the gradients)."""
    import yaml

    from mindpulse.config.mindformers_yaml import load_mf_config
    from mindpulse.workers.mindformers_job import byte_corpus_to_mindrecord

    cfg = load_mf_config(MF_YAML)
    record = byte_corpus_to_mindrecord(cfg.get("train_dataset.data_loader.dataset_dir"), 64, tmp_path / "data")
    values = cfg.with_values({"train_dataset.data_loader.dataset_dir": str(record),
                              "output_dir": str(tmp_path / "out"),
                              "callbacks": [{"type": "MFLossMonitor"}, {"type": "TrainCallBack", "stop_step": 6}],
                              "lr_schedule.total_steps": 6}).values
    user_yaml = tmp_path / "finetune_tiny.yaml"
    user_yaml.write_text(yaml.safe_dump(values))
    r = run_cli("launch", "--set", f"job.script={MF_SCRIPT}",
                "--set", f"job.args=[--config, '{user_yaml}', --use_parallel, 'True']", "--set", "train.steps=0",
                "--set", "monitor.per_print_step=3", "--set", "output.report=false", timeout=400)
    assert r.returncode == 0, r.output
    s = r.summary
    assert s["status"] == "succeeded" and s["steps_completed"] == 6, s
    pk, red = records(r.run_dir)
    steps = [o for o in pk if o["step"] > 0]
    assert {(o["rank"], o["step"]) for o in steps} == {(rk, st) for rk in (0, 1) for st in range(1, 7)}
    assert all(o["loss_scale"] == 1.0 and o["overflow"] is False and o["grad_norm"] > 0 for o in steps), steps[:2]
    assert all(o["grad_norm_local"] is None for o in steps), "MindFormers' cell got a second pass"
    for rank in (0, 1):
        log = (r.run_dir / "logs" / f"rank_{rank}.log").read_text()
        assert log.count("mindpulse added its Monitor to Model.train's callbacks") == 1, log[-3000:]
        assert "MindFormers' cell: its own outputs are read" in log


def test_a_rank_that_lives_on_after_its_training_is_named_and_ended(run_cli, tmp_path):
    """msrun ranks whose script left a thread that never joins (as MindSpore's SummaryRecord
    writer sometimes does): each process lives on after its training ended; past
    monitor.exit_timeout_s they are named with their stacks and ended, and the run succeeded."""
    r = launch(run_cli, tmp_path, "--mode", "pynative", "--linger-at-exit", "600", steps=6,
               extra=("--set", "backend=msrun", "--set", "monitor.exit_timeout_s=5"))
    assert r.returncode == 0, r.output
    s = r.summary
    assert s["status"] == "succeeded" and s["steps_completed"] == 6, s
    assert "did not exit within 5s after it" in s["message"] and "the training completed" in s["message"], s
    assert "did not exit within 5s after their training ended" in r.stdout
    lingered = [x["rank"] for x in s["ranks"] if "did not exit" in (x.get("error") or "")]
    assert lingered and all(x["exit_code"] == 0 for x in s["ranks"]), s["ranks"]
    for rank in lingered:  # py-spy's stacks show the thread that kept the process alive
        stacks = r.run_dir / "logs" / f"stacks_rank_{rank}.txt"
        assert stacks.exists(), [p.name for p in (r.run_dir / "logs").iterdir()]
        assert "summary-writer-join" in stacks.read_text(), stacks.read_text()[-2000:]
