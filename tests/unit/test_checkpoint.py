"""Rank-0 checkpoint files: atomic, a manifest that always names whole files, retention."""

from __future__ import annotations

import json

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn

import mindpulse.rundir.checkpoint_manifest as manifest
from mindpulse.rundir.checkpoint_manifest import choose_resume, read_manifest, verify
from mindpulse.workers import checkpoint as ck
from mindpulse.workers.checkpoint import CheckpointManager


@pytest.fixture(scope="module")
def cell():
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    net = nn.Dense(4, 2)
    opt = nn.Adam(net.trainable_params(), 1e-3)
    return nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), opt)


def test_save_writes_manifest_with_sha_and_links_kinds(tmp_path, cell):
    m = CheckpointManager(tmp_path, keep_periodic=2, keep_best=1)
    entries = m.save(cell, step=4, epoch=1, kinds=["periodic", "best"], metric=1.5, metric_name="loss")
    assert [e.kind for e in entries] == ["periodic", "best"]
    man = json.loads((tmp_path / "manifest.json").read_text())
    assert {f["path"] for f in man["files"]} == {"step_00000004-periodic.ckpt", "step_00000004-best.ckpt"}
    assert man["best"]["step"] == 4 and man["best"]["metric"] == 1.5
    for e in read_manifest(tmp_path):
        assert verify(tmp_path, e) is None
    params = ms.load_checkpoint(str(tmp_path / "step_00000004-best.ckpt"))
    assert int(params["step"].asnumpy()) == 4
    assert not any(k.startswith("mindpulse_fault_") for k in params)


def test_retention_never_exceeds_limits_and_keeps_newest(tmp_path, cell):
    m = CheckpointManager(tmp_path, keep_periodic=2, keep_best=1)
    for s in range(1, 8):
        kinds = ["periodic"] + (["best"] if s % 3 == 0 else [])
        m.save(cell, step=s, epoch=1, kinds=kinds, metric=10.0 - s)
        entries = read_manifest(tmp_path)
        assert sum(e.kind == "periodic" for e in entries) <= 2
        assert sum(e.kind == "best" for e in entries) <= 1
        files = {p.name for p in tmp_path.glob("step_*")}
        assert files == {e.path for e in entries}, "files on disk and the manifest disagree"
    names = {e.path for e in read_manifest(tmp_path)}
    assert "step_00000007-periodic.ckpt" in names and "step_00000006-best.ckpt" in names


def test_manifest_is_written_before_old_files_are_deleted(tmp_path, cell, monkeypatch):
    m = CheckpointManager(tmp_path, keep_periodic=1)
    m.save(cell, step=1, epoch=1, kinds=["periodic"])
    seen = []
    real = manifest.write_manifest

    def spy(d, entries, *args, **kwargs):
        seen.append((tmp_path / "step_00000001-periodic.ckpt").exists())
        real(d, entries, *args, **kwargs)

    monkeypatch.setattr(ck, "write_manifest", spy)
    m.save(cell, step=2, epoch=1, kinds=["periodic"])
    assert seen == [True], "the old file was deleted before the manifest stopped listing it"
    assert not (tmp_path / "step_00000001-periodic.ckpt").exists()


def test_killed_in_the_middle_of_a_save_leaves_a_valid_manifest(tmp_path, cell, monkeypatch):
    m = CheckpointManager(tmp_path, keep_periodic=3)
    m.save(cell, step=1, epoch=1, kinds=["periodic"])

    real_replace = ck.os.replace

    def die(src, dst, *a, **k):  # killed as the checkpoint file is renamed into place
        if ".tmp-" in str(src):
            raise KeyboardInterrupt("killed mid-save")
        return real_replace(src, dst, *a, **k)

    monkeypatch.setattr(ck.os, "replace", die)
    with pytest.raises(KeyboardInterrupt):
        m.save(cell, step=2, epoch=1, kinds=["periodic"])
    monkeypatch.undo()
    entries = read_manifest(tmp_path)
    assert [e.step for e in entries] == [1]
    assert all(verify(tmp_path, e) is None for e in entries)
    assert list(tmp_path.glob(".tmp-*")), "the torn temp file should still be there before restart"
    CheckpointManager(tmp_path)  # a restarted writer removes torn temp files
    assert not list(tmp_path.glob(".tmp-*"))


def test_corrupted_checkpoint_is_refused_and_the_next_valid_one_used(tmp_path, cell):
    m = CheckpointManager(tmp_path, keep_periodic=3)
    for s in (1, 2, 3):
        m.save(cell, step=s, epoch=1, kinds=["periodic"])
    p = tmp_path / "step_00000003-periodic.ckpt"
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))
    entry, refused = choose_resume(tmp_path, "latest")
    assert entry.step == 2
    assert len(refused) == 1 and "sha256" in refused[0] and "step_00000003" in refused[0]


def _swap_for_a_file(folder):
    """Put a plain file where `folder` must be (the folder moves aside); returns the undo."""
    aside = folder.with_name(folder.name + ".aside")
    folder.rename(aside)
    folder.write_text("not a folder")

    def undo():
        folder.unlink()
        aside.rename(folder)

    return undo


@pytest.mark.parametrize("obstacle", ["folder_is_a_file", "target_name_is_a_folder"])
def test_an_unwritable_checkpoint_fails_clearly_and_keeps_the_manifest(tmp_path, cell, obstacle):
    """Real failures of the real save path (no permission bits: they hold for root too)."""
    ckpt_dir = tmp_path / "checkpoints"
    m = CheckpointManager(ckpt_dir)
    m.save(cell, step=1, epoch=1, kinds=["best"])
    if obstacle == "folder_is_a_file":
        undo = _swap_for_a_file(ckpt_dir)
        with pytest.raises(OSError):
            m.save(cell, step=2, epoch=1, kinds=["best"])
        undo()
    else:  # MindSpore writes the whole temp file; the rename onto the final name fails
        (ckpt_dir / "step_00000002-best.ckpt").mkdir()
        with pytest.raises(OSError, match="step_00000002-best"):
            m.save(cell, step=2, epoch=1, kinds=["best"])
    entries = read_manifest(ckpt_dir)
    assert [e.step for e in entries] == [1] and verify(ckpt_dir, entries[0]) is None
    assert m.entries == entries


def test_safetensors_format(tmp_path, cell):
    m = CheckpointManager(tmp_path, fmt="safetensors")
    (e,) = m.save(cell, step=3, epoch=1, kinds=["last"])
    assert e.path.endswith(".safetensors") and verify(tmp_path, e) is None
    params = ms.load_checkpoint(str(tmp_path / e.path), format="safetensors")
    assert any("weight" in k for k in params)
    np.testing.assert_allclose(params[[k for k in params if k.endswith("weight")][0]].asnumpy().shape, (2, 4))


def _settings(run_dir, **config):
    from mindpulse.config import from_dict
    from mindpulse.launcher.spec import rank_settings

    cfg = from_dict({"checkpoint": {"best_every_steps": 1}, "world": {"ranks_per_node": 1}, **config})
    return rank_settings(cfg, run_dir=str(run_dir), run_id="t", attempt=0, aggregator="t", ray_address="",
                         relays={}, resume=None)


def _saving_channel():
    """A channel whose every decision says "save the best", the metric falling."""
    from mindpulse.wire.directives import Directive, Lease
    from mindpulse.wire.protocol import decode
    from mindpulse.workers.channel import Channel

    class SavingChannel(Channel):
        def __init__(self):
            super().__init__()
            self.packets = []

        def _ship(self, batch, step=None):
            self.packets.extend(map(decode, batch))

        def _decide(self, batch, step, expect=None):
            self._ship(batch)
            return Directive(step=step, save="best", metric=3.0 - step, metric_name="loss")

        def _fetch_lease(self, need):
            return Lease(reduced_through=need), 0.0

    return SavingChannel()


def _events(channel):
    return [p for p in channel.packets if hasattr(p, "kind")]


def test_a_failing_save_is_reported_and_training_goes_on(tmp_path, cell):
    """The checkpoints folder is gone (a file stands in its place) when rank 0 saves: the
    real save fails, a clear error goes to the aggregator, the previous best and the
    manifest stay valid, and no exception reaches the training loop."""
    from mindpulse.wire.protocol import EventKind
    from mindpulse.workers.monitor import Monitor

    channel = _saving_channel()
    mon = Monitor(client=channel, rank=0, train_cell=cell, settings=_settings(tmp_path))
    ckpt_dir = tmp_path / "checkpoints"
    assert not mon.record(2.0, step=1).stop
    assert [e.step for e in read_manifest(ckpt_dir)] == [1]

    undo = _swap_for_a_file(ckpt_dir)
    try:
        assert not mon.record(1.0, step=2).stop
    finally:
        undo()
    writer = mon.session.checkpoints
    assert writer.failures == 1
    events = _events(channel)
    assert [p.kind for p in events] == [EventKind.CHECKPOINT, EventKind.ERROR]
    assert "step 2" in events[1].message and "checkpoint save" in events[1].message
    entries = read_manifest(ckpt_dir)
    assert [e.step for e in entries] == [1] and verify(ckpt_dir, entries[0]) is None
    assert not mon.record(0.5, step=3).stop  # the next save works again
    assert [e.step for e in read_manifest(ckpt_dir)] == [3]


def test_a_checkpoints_folder_that_cannot_be_made_does_not_kill_the_rank(tmp_path, cell):
    from mindpulse.wire.protocol import EventKind
    from mindpulse.workers.monitor import Monitor

    (tmp_path / "checkpoints").write_text("a file where the folder must be")
    channel = _saving_channel()
    mon = Monitor(client=channel, rank=0, train_cell=cell, settings=_settings(tmp_path))
    assert not mon.record(2.0, step=1).stop
    (err,) = _events(channel)
    assert err.kind == EventKind.ERROR and "checkpoints" in err.message and "not a folder" in err.message


# ---- 15: file modes follow output.mode ---------------------------------------------------------------
@pytest.mark.parametrize("mode, file_mode, dir_mode", [(None, 0o600, 0o700), ("private", 0o600, 0o700),
                                                       ("shared", 0o644, 0o755)])
def test_checkpoint_files_follow_the_output_mode(tmp_path, cell, mode, file_mode, dir_mode):
    from mindpulse.workers.checkpoint_writer import CheckpointWriter

    st = _settings(tmp_path, **({"output": {"mode": mode}} if mode else {}))
    events = []
    writer = CheckpointWriter.for_run(st, lambda kind, msg: events.append((kind, msg)))
    from mindpulse.wire.directives import Directive

    writer.write(Directive(step=2, save="periodic,best", metric=1.0, metric_name="loss"), 2, 1, cell)
    ckpt_dir = tmp_path / "checkpoints"
    assert writer.failures == 0, events
    assert ckpt_dir.stat().st_mode & 0o777 == dir_mode
    files = sorted(ckpt_dir.iterdir())
    assert {p.name for p in files} == {"manifest.json", "step_00000002-periodic.ckpt", "step_00000002-best.ckpt"}
    assert {oct(p.stat().st_mode & 0o777) for p in files} == {oct(file_mode)}


def test_the_mode_is_the_resolved_configs():
    st = _settings("/r")
    assert st.config["output"].get("mode", "private") == "private"


# ---- 19: manifests name bare files; malformed ones are refused, naming the file ------------------------
def _manifest(ckpt_dir, files, **extra):
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    (ckpt_dir / "manifest.json").write_text(json.dumps({"version": 1, "files": files, **extra}))


def _record(path, step=1, kind="periodic", sha="0" * 64, size=7):
    return {"path": path, "step": step, "epoch": 0, "kind": kind, "metric": None, "metric_name": "",
            "size": size, "sha256": sha, "time": 1.0}


@pytest.mark.parametrize("text, why", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "not a mapping"),
    (json.dumps({"files": {"a": 1}}), "`files` is not a list"),
    (json.dumps({"files": ["x"]}), "files[0]"),
    (json.dumps({"files": [_record("../victim.ckpt")]}), "'../victim.ckpt' is not a bare file name"),
    (json.dumps({"files": [_record("/etc/passwd")]}), "'/etc/passwd' is not a bare file name"),
    (json.dumps({"files": [_record("sub/x.ckpt")]}), "is not a bare file name"),
    (json.dumps({"files": [_record("manifest.json")]}), "is not a bare file name"),
    (json.dumps({"files": [_record("x.ckpt", step="3")]}), "step '3'"),
    (json.dumps({"files": [_record("x.ckpt", kind="evil")]}), "kind 'evil'"),
    (json.dumps({"files": [_record("x.ckpt", sha="zz")]}), "sha256 'zz'"),
])
def test_a_malformed_manifest_is_refused_naming_the_file(tmp_path, text, why):
    (tmp_path / "manifest.json").write_text(text)
    for call in (lambda: read_manifest(tmp_path), lambda: choose_resume(tmp_path, "latest")):
        with pytest.raises(manifest.ManifestError) as info:
            call()
        assert str(tmp_path / "manifest.json") in str(info.value) and why in str(info.value)


def test_retention_never_deletes_outside_the_checkpoints_folder(tmp_path, cell):
    """A tampered manifest that names a file elsewhere: the writer refuses to save (the
    error is the manifest's), deletes nothing, and leaves the manifest as it found it."""
    victim = tmp_path / "victim.ckpt"
    victim.write_bytes(b"someone else's file")
    ckpt_dir = tmp_path / "checkpoints"
    _manifest(ckpt_dir, [_record("../victim.ckpt", kind="periodic")])
    before = (ckpt_dir / "manifest.json").read_text()
    m = CheckpointManager(ckpt_dir, keep_periodic=1)  # not fatal to the rank
    for step in (2, 3):
        with pytest.raises(manifest.ManifestError, match="victim"):
            m.save(cell, step=step, epoch=1, kinds=["periodic"])
    assert victim.exists() and (ckpt_dir / "manifest.json").read_text() == before
    # and the deletion itself only ever takes bare names, whatever the entries say
    m2 = CheckpointManager(tmp_path / "other", keep_periodic=1)
    m2.entries = [manifest.CkptEntry("../victim.ckpt", 1, 0, "periodic", None, "", 1, "0" * 64, 0.0)]
    m2.save(cell, step=2, epoch=1, kinds=["periodic"])
    assert victim.exists()


def test_verify_refuses_a_path_outside_the_folder(tmp_path):
    (tmp_path / "victim").write_bytes(b"x")
    entry = manifest.CkptEntry("../victim", 1, 0, "periodic", None, "", 1, "0" * 64, 0.0)
    assert "not a file name inside" in verify(tmp_path / "checkpoints", entry)


def test_a_rank_checks_the_sha256_before_it_loads(tmp_path, cell):
    m = CheckpointManager(tmp_path, fmt="safetensors")
    (e,) = m.save(cell, step=2, epoch=1, kinds=["periodic"])
    path = tmp_path / e.path
    manifest.verify_for_load(path, "periodic")  # whole: passes
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(manifest.CheckpointRefused, match=f"refused {path}.*sha256"):
        manifest.verify_for_load(path, "periodic")
    # the recipe's loader refuses it before MindSpore reads anything
    from mindpulse.workers.recipes.llama_finetune import load_resume

    with pytest.raises(manifest.CheckpointRefused):
        load_resume(cell, str(path), "periodic")
    stray = tmp_path / "step_00000009-periodic.ckpt"
    stray.write_bytes(b"unlisted")
    with pytest.raises(manifest.CheckpointRefused, match="does not list it"):
        manifest.verify_for_load(stray, "periodic")
    manifest.verify_for_load(stray, "file")  # given by path, in no manifest: nothing to check against
    (tmp_path / "manifest.json").write_text("{")
    with pytest.raises(manifest.CheckpointRefused, match="not valid JSON"):
        manifest.verify_for_load(stray, "file")


# ---- 16: resume loads either format --------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["ckpt", "safetensors"])
def test_the_recipe_resumes_from_either_format(tmp_path, fmt):
    from mindpulse.workers.recipes.llama_finetune import load_resume

    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")

    def make():
        net = nn.Dense(4, 2)
        return nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), nn.Adam(net.trainable_params(), 1e-3))

    src, dst = make(), make()
    src(ms.Tensor(np.ones((3, 4), np.float32)), ms.Tensor(np.zeros((3, 2), np.float32)))
    (e,) = CheckpointManager(tmp_path, fmt=fmt).save(src, step=5, epoch=1, kinds=["periodic"])
    load_resume(dst, str(tmp_path / e.path), e.kind)
    for a, b in zip(src.get_parameters(), dst.get_parameters(), strict=True):
        if a.name != "learning_rate":
            np.testing.assert_array_equal(a.asnumpy(), b.asnumpy(), err_msg=a.name)


# ---- 18: a resume makes the resumed line the manifest's --------------------------------------------------
def _line(ckpt_dir, cell, fmt="ckpt"):
    """periodic 2, 4, 6 and bests at 3 and 5 (metric falling)."""
    m = CheckpointManager(ckpt_dir, keep_periodic=5, keep_best=1, fmt=fmt)
    for s, kinds in ((2, ["periodic"]), (3, ["best"]), (4, ["periodic"]), (5, ["best"]), (6, ["periodic"])):
        m.save(cell, step=s, epoch=1, kinds=kinds, metric=10.0 - s, metric_name="loss")
    return m


def test_resuming_an_older_checkpoint_supersedes_the_newer_entries(tmp_path, cell):
    from mindpulse.launcher.resume import best_seed, supersede_newer

    ckpt_dir = tmp_path / "checkpoints"
    _line(ckpt_dir, cell)
    assert best_seed(ckpt_dir)["step"] == 5
    resume = {"path": str(ckpt_dir / "step_00000004-periodic.ckpt"), "step": 4, "epoch": 1, "kind": "periodic"}
    (line,) = supersede_newer(resume)
    assert "step_00000005-best.ckpt" in line and "step_00000006-periodic.ckpt" in line
    assert [e.step for e in read_manifest(ckpt_dir)] == [2, 4]
    assert choose_resume(ckpt_dir, "latest")[0].step == 4
    assert choose_resume(ckpt_dir, "best")[0] is None, "the best of another line is not the resumed line's"
    assert best_seed(ckpt_dir) is None
    man = json.loads((ckpt_dir / "manifest.json").read_text())
    assert "best" not in man
    assert {f["path"] for f in man["superseded"]} == {"step_00000005-best.ckpt", "step_00000006-periodic.ckpt"}
    assert all((ckpt_dir / f["path"]).exists() for f in man["superseded"]), "superseded files are kept"
    assert supersede_newer(resume) == [], "idempotent: a second attempt from there changes nothing"
    # the resumed line writes on: a name written again is no longer superseded; retention
    # never deletes a superseded file
    m = CheckpointManager(ckpt_dir, keep_periodic=1, keep_best=1)
    m.save(cell, step=6, epoch=1, kinds=["periodic"], metric=1.0, metric_name="loss")
    man = json.loads((ckpt_dir / "manifest.json").read_text())
    assert [f["path"] for f in man["files"]] == ["step_00000006-periodic.ckpt"]
    assert [f["path"] for f in man["superseded"]] == ["step_00000005-best.ckpt"]
    assert (ckpt_dir / "step_00000005-best.ckpt").exists()


def test_a_restart_supersedes_only_refused_newer_files(tmp_path, cell):
    from mindpulse.launcher.failure_policy import FailurePolicy
    from mindpulse.launcher.resume import supersede_newer
    from mindpulse.launcher.spec import RankOutcome, RunResult, RunStatus

    ckpt_dir = tmp_path / "checkpoints"
    _line(ckpt_dir, cell)
    failed = RunResult(status=RunStatus.FAILED, outcomes={0: RankOutcome(rank=0, exit_code=1, error="x")},
                       message="boom", order=[0])
    resume = FailurePolicy(1, ckpt_dir).decide(failed, 0, False, None).resume
    assert resume["step"] == 6
    assert supersede_newer(resume) == [] and len(read_manifest(ckpt_dir)) == 4
    # the newest file is corrupt: the restart resumes from the best at 5 and step 6 leaves the line
    p = ckpt_dir / "step_00000006-periodic.ckpt"
    p.write_bytes(p.read_bytes()[:-1] + b"\0")
    d = FailurePolicy(1, ckpt_dir).decide(failed, 0, False, None)
    assert d.resume["step"] == 5 and "step_00000006" in d.notes[0]
    (line,) = supersede_newer(d.resume)
    assert "step_00000006-periodic.ckpt" in line and max(e.step for e in read_manifest(ckpt_dir)) == 5
    # nothing to cut: a start from scratch, a file given by path that no manifest lists
    assert supersede_newer(None) == []
    assert supersede_newer({"path": str(tmp_path / "elsewhere.ckpt"), "step": 1, "kind": "file"}) == []


def test_every_attempt_of_the_controller_starts_on_the_resumed_line(tmp_path, cell, monkeypatch):
    import sys

    from mindpulse.config import from_dict
    from mindpulse.launcher import controller as controller_mod
    from mindpulse.launcher.controller import Controller
    from mindpulse.launcher.progress import Console
    from mindpulse.launcher.rundir import PidFile
    from mindpulse.launcher.supervision import Interrupts

    src = tmp_path / "older" / "checkpoints"
    _line(src, cell)
    seen = []

    class Stub:
        def __init__(self, cfg, *, index, resume, **kw):
            seen.append([e.step for e in read_manifest(src)])  # what its ranks will read

        def start(self):
            return {}

    monkeypatch.setattr(controller_mod, "Attempt", Stub)
    monkeypatch.setattr(controller_mod, "AttemptWatch", lambda *a: None)
    resume = {"path": str(src / "step_00000002-periodic.ckpt"), "step": 2, "epoch": 1, "kind": "periodic"}
    ctl = Controller(from_dict({}), run_dir=tmp_path / "new", run_id="r", session=None, resume=resume,
                     pids=PidFile(tmp_path), console=Console(sys.stdout), interrupts=Interrupts(), started=0.0)
    ctl._start()
    assert seen == [[2]], "the attempt must start on the resumed line"


# ---- 19: --resume with a malformed manifest exits 2 naming the file -------------------------------------
def test_resume_with_a_malformed_manifest_is_a_usage_error(tmp_path, capsys):
    from mindpulse.launcher.cli import main

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("name: t\n")
    _manifest(run / "checkpoints", [_record("/etc/passwd")])
    assert main(["launch", "--resume", str(run)]) == 2
    err = capsys.readouterr().err
    assert str(run / "checkpoints" / "manifest.json") in err and "/etc/passwd" in err
    (run / "checkpoints" / "manifest.json").write_text("{")
    assert main(["launch", "--resume", str(run), "--resume-from", "best"]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    # --resume-from PATH: the manifest of the file's folder is checked too
    (run / "checkpoints" / "step_00000003-periodic.ckpt").write_bytes(b"x")
    assert main(["launch", "--resume", str(run), "--resume-from",
                 str(run / "checkpoints" / "step_00000003-periodic.ckpt")]) == 2
    assert "manifest.json" in capsys.readouterr().err


def test_a_restart_after_a_malformed_manifest_notes_it_and_keeps_its_resume_point(tmp_path):
    from mindpulse.launcher.failure_policy import Decision, FailurePolicy
    from mindpulse.launcher.spec import RankOutcome, RunResult, RunStatus

    failed = RunResult(status=RunStatus.FAILED, outcomes={0: RankOutcome(rank=0, exit_code=1, error="x")},
                       message="boom", order=[0])
    (tmp_path / "manifest.json").write_text("[]")
    d = FailurePolicy(1, tmp_path).decide(failed, 0, False, {"path": "/given", "step": 3})
    assert d.decision is Decision.RESTART and d.resume == {"path": "/given", "step": 3}
    assert len(d.notes) == 1 and "manifest.json" in d.notes[0]


# ---- 17: a restarted aggregator starts from the manifest's best ----------------------------------------
def test_a_restarted_aggregator_keeps_the_earlier_better_best(tmp_path, cell):
    from mindpulse.aggregator.core import AggregatorCore
    from mindpulse.launcher.resume import best_seed
    from mindpulse.wire.protocol import StepPacket

    ckpt_dir = tmp_path / "checkpoints"
    _line(ckpt_dir, cell)
    seed = best_seed(ckpt_dir)
    assert seed == {"metric": 5.0, "metric_name": "loss", "step": 5, "path": str(ckpt_dir / "step_00000005-best.ckpt")}
    core = AggregatorCore(tmp_path, world_size=1, settings={"checkpoint": {"best_every_steps": 1},
                                                            "tensorboard": False, "best": seed})
    assert core.snapshot()["best_checkpoint"]["step"] == 5

    def step(s, loss):
        core.ingest([StepPacket(rank=0, step=s, loss=loss, decision=True, step_time_s=0.1, samples=4).encode()])
        return core.directive_for(s)

    assert "best" not in step(6, 7.0).save, "a worse first step of the restart must not become the best"
    assert core.best == (5.0, 5)
    d = step(7, 4.0)
    assert "best" in d.save and d.metric == 4.0
    # a seed of another metric (best_metric changed between attempts) is not comparable
    other = AggregatorCore(tmp_path / "o", world_size=1,
                           settings={"checkpoint": {"best_metric": "eval_loss"}, "tensorboard": False, "best": seed})
    assert other.best is None and other.best_checkpoint is None
    # a corrupt best file seeds nothing
    p = ckpt_dir / "step_00000005-best.ckpt"
    p.write_bytes(p.read_bytes()[:-1] + b"\0")
    assert best_seed(ckpt_dir) is None


def test_a_write_in_progress_is_marked_for_the_launcher_and_unmarked_when_it_ends(tmp_path, cell):
    """While rank 0 writes, its checkpoints folder says so (step and writer): the launcher
    lets the write finish before it stops the ranks after another rank failed. The marker
    goes when the write ends, whole or failed."""
    from mindpulse.rundir.rundir_io import SAVING_MARKER, saving_now

    m = CheckpointManager(tmp_path, keep_periodic=3)
    seen = []
    m.save(cell, step=3, epoch=1, kinds=["periodic"], before_write=lambda step: seen.append(saving_now(tmp_path)))
    assert seen[0]["alive"] and seen[0]["step"] == 3 and seen[0]["pid"] == __import__("os").getpid(), seen
    assert saving_now(tmp_path) is None and not (tmp_path / SAVING_MARKER).exists()
    assert [e.step for e in read_manifest(tmp_path)] == [3]

    def fail(step):
        raise OSError("disk full")

    with pytest.raises(OSError):
        m.save(cell, step=4, epoch=1, kinds=["periodic"], before_write=fail)
    assert not (tmp_path / SAVING_MARKER).exists()
    # a marker left by a writer killed mid-write goes when the next writer opens the folder
    (tmp_path / SAVING_MARKER).write_text('{"step": 9, "pid": 1}')
    (tmp_path / (SAVING_MARKER + ".abc")).write_text("torn")
    CheckpointManager(tmp_path).save(cell, step=5, epoch=1, kinds=["periodic"])
    assert not list(tmp_path.glob(SAVING_MARKER + "*"))
