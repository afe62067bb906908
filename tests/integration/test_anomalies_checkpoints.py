"""Global anomaly stops, rank-0 best checkpoints, resume and Ctrl-C, with 2 real CPU ranks."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from conftest import NO_REPORT, ROOT, last_steps, mindpulse_cmd

from mindpulse.reduction.reducer import reduce_all
from mindpulse.rundir.metrics_store import read_records, read_wire, with_attempts
from mindpulse.wire.protocol import from_wire

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

FAST = ["--set", "monitor.per_print_step=50"]


def reduced(run_dir: Path, world: int = 2):
    pk = [from_wire(o) for o in read_wire(run_dir / "metrics.msgpack") if o.get("t") == "step"]
    return reduce_all(pk, world)


def test_spikes_warn_then_a_nan_on_rank1_stops_every_rank_after_the_same_step(run_cli):
    """One launch, three rules: a loss spike on rank 1 at step 6 (loss_spike, warn: the run goes
    on), a gradient spike on rank 0 at step 8 (grad_explosion, warn), then NaN gradients on
    rank 1 at step 10 (nonfinite, stop): decided when step 10 is reduced, every rank stops
    after step 11 (monitor.max_lag_steps: 1)."""
    r = run_cli("launch", "--set", "train.steps=14", "--inject", "loss_spike@1:6", "--inject", "grad_spike@0:8",
                "--inject", "nan_grad@1:10",
                "--set", "anomalies=[{rule: loss_spike, action: warn, warmup: 1, window: 4, z: 6}, "
                         "{rule: grad_explosion, action: warn, warmup: 1, window: 4, factor: 20}]", *FAST, timeout=400)
    assert r.returncode == 3, r.output
    s = r.summary
    assert s["status"] == "anomaly_stop"
    recs = json.loads((r.run_dir / "anomalies.json").read_text())
    # the timing rules (straggler, compute_drop) may warn on a loaded machine: not the subject here
    fired = [(a["rule"], a["step"], a["action"]) for a in recs if a["rule"] not in ("straggler", "compute_drop")]
    assert ("loss_spike", 6, "warn") in fired and ("grad_explosion", 8, "warn") in fired, fired
    assert not any(step < 6 for _, step, _ in fired), f"a rule fired before any spike: {fired}"
    stop = s["stop"]
    assert stop["rule"] == "nonfinite" and stop["rank"] == 1 and stop["decided_at"] == 10 and stop["step"] == 11, stop
    assert "rank 1" in stop["message"] and "NaN" in stop["message"]
    steps = last_steps(r.run_dir)
    assert steps == {0: 11, 1: 11}, f"every rank must stop after step 11: {steps}"
    assert [x["last_step"] for x in s["ranks"]] == [steps[0]] * 2
    nan = [a for a in recs if a["rule"] == "nonfinite"]
    assert nan[0]["rank"] == 1 and nan[0]["step"] == 10, nan
    assert set(nan[0]) >= {"rule", "step", "rank", "value", "threshold", "action", "message"}
    assert r.stdout.count("ANOMALY nonfinite") == 1, "the anomaly must be printed once, not once per rank"


def test_a_loss_spike_rolls_back_to_the_checkpoint_before_it_and_the_run_finishes(run_cli):
    """Periodic checkpoints every 4 steps, a loss spike on rank 1 at step 9 and a rollback
    rule: every rank stops after step 10, the launch resumes from step 8 past the batch of
    step 9 with the learning rate halved, and finishes."""
    r = run_cli("launch", "--set", "train.steps=14", "--set", "checkpoint.save_checkpoint_steps=4",
                "--inject", "loss_spike@1:9",
                "--set", "anomalies=[{rule: loss_spike, action: rollback, warmup: 4, window: 4, z: 6}]", *FAST,
                timeout=500)
    assert r.returncode == 0, r.output
    s = r.summary
    assert s["status"] == "succeeded" and s["steps_completed"] == 14, s["status"]
    assert s["rollbacks"] == [{"rule": "loss_spike", "anomaly_step": 9, "from_step": 10, "to_step": 8,
                               "skipped_batches": 1, "lr_factor": 0.5}], s["rollbacks"]
    att = s["attempts"]
    assert len(att) == 2 and att[0]["rollback"]["anomaly_step"] == 9, att
    resumed = att[1]["resumed_from"]
    assert (resumed["step"], resumed["skip_batches"], resumed["lr_until_step"]) == (8, 1, 108), resumed
    assert "rollback 1 (loss_spike at step 9)" in r.stdout, r.output
    log1 = (r.run_dir / "logs" / "attempt_1" / "rank_0.log").read_text()
    assert "skipping 1 batch" in log1 and "learning rate x0.5" in log1, log1[-2000:]
    # the loss curve after the rollback: steps 9..14 of attempt 1, no spike (attempt 0's step 9 had one)
    recs = list(with_attempts(read_records(r.run_dir / "metrics.msgpack")))
    first = reduce_all([from_wire(o) for a, o in recs if a == 0 and o.get("t") == "step"], 2)
    after = reduce_all([from_wire(o) for a, o in recs if a == 1 and o.get("t") == "step" and o["step"] > 8], 2)
    spiked = {x.step: x.loss_mean for x in first}
    losses = {x.step: x.loss_mean for x in after}
    assert sorted(losses) == list(range(9, 15)), sorted(losses)
    assert spiked[9] > 2 * spiked[8], f"premise: the injected spike at step 9 ({spiked})"
    assert max(losses.values()) < 1.5 * spiked[8], f"a spike after the rollback: {losses} (step 8: {spiked[8]})"
    # goodput across both attempts: the redone steps 9, 10 and the rollback's downtime are badput
    g = s["goodput"]
    bad = g["badput_s"]
    assert bad["recomputed"] > 0 and bad["restart"] > 0 and bad["startup"] > 0 and 0 < g["ettr"] < 1, g
    accounted = g["productive_s"] + sum(bad.values())
    assert abs(accounted - g["wall_s"]) <= 0.05 * g["wall_s"], f"goodput leaves time unexplained: {g}"


@pytest.fixture(scope="module")
def ckpt_run(tmp_path_factory):
    """One 12-step run with periodic, best and eval; shared by the checkpoint tests."""
    out = tmp_path_factory.mktemp("ckpt") / "runs"
    proc = subprocess.run(mindpulse_cmd() + [
        "launch", "--set", "train.steps=12", "--set", "checkpoint.save_checkpoint_steps=3",
        "--set", "checkpoint.keep_checkpoint_max=2", "--set", "checkpoint.keep_best_max=1",
        "--set", "checkpoint.best_every_steps=1",
        "--set", "monitor.collect_freq=1", "--set", "eval.every_steps=6", "--set", "eval.max_batches=2",
        "--set", f"output.root={out}", *FAST, *NO_REPORT], cwd=ROOT, capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return next(out.iterdir())


def test_best_checkpoint_is_the_lowest_reduced_loss_and_reproduces_its_fingerprint(ckpt_run):
    import mindspore as ms

    from mindpulse.workers.fingerprint import model_parameters, param_fingerprint
    from mindpulse.workers.recipes.llama_finetune import ModelShape, build_model, set_mode

    summary = json.loads((ckpt_run / "summary.json").read_text())
    reds = [x for x in reduced(ckpt_run) if x.step > 0]
    best = min(reds, key=lambda x: x.loss_mean)
    bc = summary["best_checkpoint"]
    assert bc["step"] == best.step and bc["metric"] == pytest.approx(best.loss_mean, rel=1e-6), (bc, best.step)
    set_mode("pynative", "CPU")
    model = build_model(ModelShape(), 8)
    set_mode("pynative", "CPU")
    ms.load_param_into_net(model, ms.load_checkpoint(bc["path"]))
    fp, _ = param_fingerprint(model_parameters(model))
    assert fp == best.fingerprints[0] == best.fingerprints[1], "the best checkpoint does not hold that step's weights"
    # eval was reduced and shown
    ev = [x for x in reds if "eval_loss" in x.extra]
    assert [x.step for x in ev] == [6, 12] and all(x.extra["eval_ppl"] > 1 for x in ev)


def test_retention_limits(ckpt_run):
    man = json.loads((ckpt_run / "checkpoints" / "manifest.json").read_text())
    kinds = [f["kind"] for f in man["files"]]
    assert kinds.count("periodic") == 2 and kinds.count("best") == 1, man
    assert {f["step"] for f in man["files"] if f["kind"] == "periodic"} == {9, 12}
    on_disk = {p.name for p in (ckpt_run / "checkpoints").glob("step_*")}
    assert on_disk == {f["path"] for f in man["files"]}


def test_resume_continues_steps_and_loss_and_refuses_a_corrupt_file(ckpt_run, run_cli):
    reds = {x.step: x for x in reduced(ckpt_run)}
    # corrupt the newest checkpoint: resume must refuse it and use step 9
    newest = ckpt_run / "checkpoints" / "step_00000012-periodic.ckpt"
    backup = newest.read_bytes()
    newest.write_bytes(backup[:-64] + bytes(64))
    try:
        r = run_cli("launch", "--resume", str(ckpt_run), "--set", "train.steps=14", *FAST, timeout=400)
    finally:
        newest.write_bytes(backup)
    assert r.returncode == 0, r.output
    assert "refused step_00000012-periodic.ckpt" in r.stderr and "sha256" in r.stderr, r.output
    # the source run's manifest now means the resumed line: step 12 is superseded (kept on disk)
    man = json.loads((ckpt_run / "checkpoints" / "manifest.json").read_text())
    assert max(f["step"] for f in man["files"]) == 9, man
    assert [f["path"] for f in man["superseded"]] == ["step_00000012-periodic.ckpt"], man
    assert "superseded" in r.stdout and newest.exists()
    s = r.summary
    assert s["resumed_from"]["step"] == 9 and s["steps_completed"] == 14
    new = {x.step: x for x in reduced(r.run_dir)}
    assert min(new) == 9 and max(new) == 14
    # same weights at the resume point, and the loss curve continues where it was
    assert new[9].fingerprints[0] == reds[9].fingerprints[0]
    assert new[10].loss_mean == pytest.approx(reds[10].loss_mean, rel=1e-4)


def test_safetensors_survive_a_crash_restart_and_keep_the_better_best(run_cli):
    """checkpoint.format safetensors, a crash while rank 0 writes a checkpoint, a restart that
    resumes the newest checkpoint: the launcher lets the write finish before it stops the
    ranks (checkpoint.save_grace_s), the ranks verify and load the safetensors file, the
    restarted aggregator starts from the manifest's best (this run's loss is higher at the
    restart's candidates 6 and 8 than at step 4: the best of attempt 0 must stay best, not be
    replaced by step 6 and deleted by retention), and the files are private (0600 in a 0700
    folder)."""
    # rank 0's write of step 4 takes 8 s (slow_save); rank 1 crashes before step 5, 1.5 s into
    # that write (slow, then crash): without the grace the write would be killed and the
    # restart would resume from step 2
    r = run_cli("launch", "--set", "train.steps=8", "--inject", "slow_save@0:4", "--inject", "slow@1:5",
                "--inject", "crash@1:5", "--set", "max_restarts=1",
                "--set", "checkpoint.format=safetensors", "--set", "checkpoint.save_checkpoint_steps=2",
                "--set", "checkpoint.best_every_steps=2", "--set", "checkpoint.keep_best_max=1",
                "--set", "monitor.per_print_step=100", timeout=500)
    assert r.returncode == 0, r.output
    s = r.summary
    att = s["attempts"]
    assert [a["status"] for a in att] == ["failed", "succeeded"], att
    # max_restarts: the crash is the root cause, every rank restarts from the newest checkpoint,
    # each attempt's logs apart
    assert att[0]["failure"]["root_cause_rank"] == 1 and "injected crash" in att[0]["failure"]["error"]
    assert att[1]["resumed_from"]["step"] == 4 and att[1]["resumed_from"]["path"].endswith(".safetensors")
    assert "rank 0 is writing the checkpoint of step 4: letting it finish" in r.stdout, r.output
    assert "rank 0 finished writing the checkpoint of step 4" in r.stdout, r.output
    assert "injecting fault slow_save@0:4" in (r.run_dir / "logs" / "rank_0.log").read_text(errors="replace")
    assert (r.run_dir / "logs" / "rank_1.log").exists() and (r.run_dir / "logs" / "attempt_1" / "rank_1.log").exists()
    assert s["status"] == "succeeded" and s["steps_completed"] == 8, s
    ckpt_dir = r.run_dir / "checkpoints"
    man = json.loads((ckpt_dir / "manifest.json").read_text())
    assert man["files"] and all(f["path"].endswith(".safetensors") for f in man["files"]), man
    assert {f["step"] for f in man["files"] if f["kind"] == "periodic"} == {2, 4, 6, 8}
    # the best of both attempts: the lowest reduced loss among the candidates 2, 4, 6, 8
    losses = {x.step: x.loss_mean for x in reduced(r.run_dir) if x.step in (2, 4, 6, 8)}
    want = min(losses, key=losses.get)
    assert want in (2, 4), f"premise (seed 1234): attempt 0 holds the best, {losses}"
    bests = [f for f in man["files"] if f["kind"] == "best"]
    assert [f["step"] for f in bests] == [want] and man["best"]["step"] == want, (losses, man)
    assert s["best_checkpoint"]["step"] == want, s["best_checkpoint"]
    import hashlib

    best_file = ckpt_dir / bests[0]["path"]
    assert hashlib.sha256(best_file.read_bytes()).hexdigest() == bests[0]["sha256"]
    assert ckpt_dir.stat().st_mode & 0o777 == 0o700
    assert {oct(p.stat().st_mode & 0o777) for p in ckpt_dir.iterdir()} == {oct(0o600)}
    assert not (ckpt_dir / ".saving.json").exists()  # the save-in-progress marker goes with its write
