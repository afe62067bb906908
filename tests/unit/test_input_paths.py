"""The files a rank opens, checked where the rank runs: `input_problems` names the key, the
path and the node; a rank whose node lacks one stops at its start (before MindSpore's cluster)
with that message, and the driver names the failure `input` and does not restart it."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from mindpulse.config import from_dict
from mindpulse.inputs.input_paths import INPUT_MISSING, InputPath, Want, input_problems, path_problem, rank_inputs
from mindpulse.launcher.failure_policy import Decision, FailurePolicy
from mindpulse.launcher.failures import VICTIM, FailureKind, describe_failure, failure_kind, format_failure
from mindpulse.launcher.spec import RankOutcome, RunResult, RunStatus, rank_settings
from mindpulse.workers.rank_main import run_job


def _files(tmp: Path) -> dict[str, Path]:
    out = {name: tmp / name for name in ("train.py", "base.ckpt", "train.txt", "valid.txt", "mf.yaml")}
    for p in out.values():
        p.write_text("x = 1\n")
    (tmp / "ckpts").mkdir()
    return out


def test_every_file_a_rank_opens_is_listed_with_its_key(tmp_path):
    f = _files(tmp_path)
    recipe = from_dict({"job": {"recipe": {"init_from": str(f["base.ckpt"]), "train_file": str(f["train.txt"]),
                                           "valid_file": str(f["valid.txt"])}}, "eval": {"every_steps": 5}})
    assert [(i.key, i.path) for i in rank_inputs(recipe)] == [
        ("job.recipe.init_from", str(f["base.ckpt"])), ("job.recipe.train_file", str(f["train.txt"])),
        ("job.recipe.valid_file", str(f["valid.txt"]))]
    no_eval = from_dict({"job": {"recipe": {"valid_file": str(tmp_path / "nope.txt")}}})
    assert rank_inputs(no_eval) == [], "the validation text is read only when evaluation is on"
    mf = from_dict({"job": {"mindformers": {"config": str(f["mf.yaml"]), "load_checkpoint": str(tmp_path / "ckpts")}}})
    assert [(i.key, i.want) for i in rank_inputs(mf)] == [("job.mindformers.config", Want.FILE),
                                                        ("job.mindformers.load_checkpoint", Want.FILE_OR_DIR)]
    script = from_dict({"job": {"script": str(f["train.py"])}})
    assert [i.key for i in rank_inputs(script)] == ["job.script"]
    for cfg in (recipe, mf, script):
        assert input_problems(cfg) == []


def test_each_problem_names_the_key_the_path_and_where(tmp_path):
    cfg = from_dict({"job": {"recipe": {"init_from": str(tmp_path / "base.ckpt"),
                                        "train_file": str(tmp_path / "train.txt")}}})
    assert input_problems(cfg, where="on node 1 (host-b)") == [
        f"job.recipe.init_from: {tmp_path / 'base.ckpt'} does not exist on node 1 (host-b); make it with "
        "`mindpulse pretrain --out PATH`, or leave job.recipe.init_from empty (random weights)",
        f"job.recipe.train_file: {tmp_path / 'train.txt'} does not exist on node 1 (host-b)"]


def test_folders_links_and_permissions(tmp_path):
    (tmp_path / "pkg").mkdir()
    assert path_problem(InputPath("job.script", str(tmp_path / "pkg"), Want.SCRIPT)) == \
        f"job.script: {tmp_path / 'pkg'} is a folder without a __main__.py; give the Python file to run"
    (tmp_path / "pkg" / "__main__.py").write_text("")
    assert path_problem(InputPath("job.script", str(tmp_path / "pkg"), Want.SCRIPT)) is None
    assert path_problem(InputPath("job.recipe.train_file", str(tmp_path), Want.FILE)) == \
        f"job.recipe.train_file: {tmp_path} is a folder; give a file"
    assert path_problem(InputPath("job.mindformers.load_checkpoint", str(tmp_path), Want.FILE_OR_DIR)) is None
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    assert path_problem(InputPath("job.script", str(tmp_path / "gone"), Want.SCRIPT)) == \
        f"job.script: {tmp_path / 'gone'} is a broken link"
    if os.geteuid() != 0:  # root reads any file
        locked = tmp_path / "locked.py"
        locked.write_text("")
        locked.chmod(0)
        assert path_problem(InputPath("job.script", str(locked), Want.SCRIPT)) == \
            f"job.script: {locked} cannot be read (permission denied)"


def _settings(tmp_path, job: dict):
    cfg = from_dict({"world": {"ranks_per_node": 2, "nodes": 2}, "ray": {"address": "auto"}, "job": job})
    return rank_settings(cfg, run_dir=str(tmp_path), run_id="t", attempt=0, aggregator="t", ray_address="",
                         relays={}, resume=None)


def test_a_rank_whose_node_lacks_a_file_stops_at_its_start_naming_key_and_node(tmp_path, capsys):
    """The head had the script; this node does not: rank 3 (node 1) fails before it imports the
    script or MindSpore joins a cluster, with no traceback to read through."""
    missing = tmp_path / "train.py"
    out = run_job(_settings(tmp_path, {"script": str(missing)}), rank=3)
    assert out["exit_code"] == 1
    assert out["error"] == (f"{INPUT_MISSING}: job.script: {missing} does not exist on node 1 "
                            f"({socket.gethostname()}): every node must see the job's files at the same path "
                            "(a shared filesystem, or a copy on each host)")
    assert out["traceback"] == ""
    assert f"[rank 3] {out['error']}" in capsys.readouterr().err


def test_the_driver_names_an_input_failure_and_does_not_restart_it(tmp_path):
    err = f"{INPUT_MISSING}: job.script: /data/train.py does not exist on node 1 (host-b): every node must see ..."
    outcomes = {0: RankOutcome(0, 0, VICTIM), 1: RankOutcome(1, 0, VICTIM), 2: RankOutcome(2, 1, err),
                3: RankOutcome(3, 1, err)}
    result = RunResult(status=RunStatus.FAILED, outcomes=outcomes, order=[2, 3])
    assert failure_kind(result) is FailureKind.INPUT
    f = describe_failure(outcomes, [2, 3], tmp_path, {}, failure_kind(result))
    assert f["kind"] == "input" and f["errors"] == [{"error": err, "ranks": [2, 3]}]
    text = format_failure(f)
    assert text.splitlines()[0].startswith("FAILED (input): a file the config names is missing where ranks run")
    assert f"ranks [2, 3]: {err}" in text
    decision = FailurePolicy(max_restarts=3, checkpoints_dir=tmp_path).decide(result, 0, False, None)
    assert decision.decision is Decision.STOP, "a restart would find the same file missing"
    crash = RunResult(status=RunStatus.FAILED, outcomes={2: RankOutcome(2, 1, "FileNotFoundError: data.bin")},
                      order=[2])
    assert failure_kind(crash) is FailureKind.CRASH
    assert FailurePolicy(max_restarts=3, checkpoints_dir=tmp_path).decide(crash, 0, False, None).decision \
        is Decision.RESTART


@pytest.mark.parametrize("size, ok", [(64 * 2 * 8 + 1, True), (64 * 2 * 8, False)])
def test_the_corpus_rule_is_the_data_streams(size, ok):
    """The launch refuses by the arithmetic the ranks' data stream applies: `ByteWindows` raises
    exactly where `too_small` says so."""
    np = pytest.importorskip("numpy")
    from mindpulse.inputs.recipe_corpus import too_small
    from mindpulse.workers.recipes.llama_finetune import ByteWindows

    tokens = np.zeros(size, np.int32)
    assert (too_small(size, 64, 2, 8) is None) is ok
    if ok:
        assert ByteWindows(tokens, 64, 0, 2, 1, 8).steps_per_epoch == 1
    else:
        with pytest.raises(ValueError, match="corpus too small: 15 windows of 64 tokens for 2 ranks x batch 8"):
            ByteWindows(tokens, 64, 0, 2, 1, 8)


def test_an_msrun_rank_log_gives_the_input_error_as_the_ranks_error(tmp_path, capsys):
    """With msrun the driver reads each rank's error from its log: the one line the rank printed."""
    from mindpulse.launcher.msrun_logs import parse_rank_log

    out = run_job(_settings(tmp_path, {"script": str(tmp_path / "train.py")}), rank=2)
    log = capsys.readouterr()
    parsed = parse_rank_log(log.out + log.err, 2)
    assert (parsed.exit_code, parsed.error, parsed.traceback) == (1, out["error"], "")
