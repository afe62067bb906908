"""Rank-0 checkpoint files: atomic, a manifest that always names whole files, retention."""

from __future__ import annotations

import json
import os

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn

from mindpulse.workers import checkpoint as ck
from mindpulse.workers.checkpoint import CheckpointManager, choose_resume, read_manifest, verify


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
    real = ck.write_manifest

    def spy(d, entries):
        seen.append((tmp_path / "step_00000001-periodic.ckpt").exists())
        real(d, entries)

    monkeypatch.setattr(ck, "write_manifest", spy)
    m.save(cell, step=2, epoch=1, kinds=["periodic"])
    assert seen == [True], "the old file was deleted before the manifest stopped listing it"
    assert not (tmp_path / "step_00000001-periodic.ckpt").exists()


def test_killed_in_the_middle_of_a_save_leaves_a_valid_manifest(tmp_path, cell, monkeypatch):
    m = CheckpointManager(tmp_path, keep_periodic=3)
    m.save(cell, step=1, epoch=1, kinds=["periodic"])

    def die(*a, **k):
        raise KeyboardInterrupt("killed mid-save")

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


def test_readonly_directory_fails_clearly_and_keeps_the_manifest(tmp_path, cell):
    if os.geteuid() == 0:
        pytest.skip("root ignores directory permissions; the full-disk path is covered by the save error test")
    m = CheckpointManager(tmp_path)
    m.save(cell, step=1, epoch=1, kinds=["best"])
    os.chmod(tmp_path, 0o500)
    try:
        with pytest.raises(OSError):
            m.save(cell, step=2, epoch=1, kinds=["best"])
    finally:
        os.chmod(tmp_path, 0o700)
    assert [e.step for e in read_manifest(tmp_path)] == [1]


def test_safetensors_format(tmp_path, cell):
    m = CheckpointManager(tmp_path, fmt="safetensors")
    (e,) = m.save(cell, step=3, epoch=1, kinds=["last"])
    assert e.path.endswith(".safetensors") and verify(tmp_path, e) is None
    params = ms.load_checkpoint(str(tmp_path / e.path), format="safetensors")
    assert any("weight" in k for k in params)
    np.testing.assert_allclose(params[[k for k in params if k.endswith("weight")][0]].asnumpy().shape, (2, 4))


def _settings(run_dir):
    from mindpulse.protocol import (
        CheckpointSettings,
        MonitorSettings,
        ProfileSettings,
        RankSettings,
        Schedule,
    )

    return RankSettings(
        run_id="t", run_dir=str(run_dir), attempt=0, namespace="t", aggregator="t", ray_address="", world_size=1,
        ranks_per_node=1, device_target="CPU", relays={}, batch_size=4,
        schedule=Schedule(total_steps=0, collect_freq=10, decision_every=1, save_every=0, best_every=1,
                          eval_every=0, eval_per_epoch=False),
        monitor=MonitorSettings(decision_timeout_s=5.0, heartbeat_s=1.0, weight_stats=False, histogram_regex=""),
        checkpoint=CheckpointSettings(keep_periodic=5, keep_best=1, format="ckpt"),
        profile=ProfileSettings(steps=(), ranks=(0,)), faults=(), resume=None, config={},
    )


def test_a_failing_save_is_reported_and_training_goes_on(tmp_path, cell, monkeypatch):
    """Disk full (ENOSPC) on rank 0: a clear error to the aggregator, the previous best
    and the manifest stay valid, and no exception reaches the training loop."""
    import errno

    from mindpulse.protocol import Directive, EventKind, decode
    from mindpulse.workers.channel import Channel
    from mindpulse.workers.monitor import Monitor

    class SavingChannel(Channel):
        """Answers every decision with "save the best", metric falling."""

        def __init__(self):
            super().__init__()
            self.packets = []

        def _ship(self, batch):
            self.packets.extend(map(decode, batch))

        def _decide(self, batch, step):
            self._ship(batch)
            return Directive(step=step, save="best", metric=3.0 - step, metric_name="loss")

    channel = SavingChannel()
    mon = Monitor(client=channel, rank=0, train_cell=cell, settings=_settings(tmp_path))
    ckpt_dir = tmp_path / "checkpoints"
    assert not mon.record(2.0, step=1).stop
    assert [e.step for e in read_manifest(ckpt_dir)] == [1]

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    writer = mon.session.checkpoints
    monkeypatch.setattr(writer.manager, "save", full)
    assert not mon.record(1.0, step=2).stop
    assert writer.failures == 1
    events = [p for p in channel.packets if hasattr(p, "kind")]
    assert [p.kind for p in events] == [EventKind.CHECKPOINT, EventKind.ERROR]
    assert "No space left on device" in events[1].message and "step 2" in events[1].message
    entries = read_manifest(ckpt_dir)
    assert [e.step for e in entries] == [1] and verify(ckpt_dir, entries[0]) is None
