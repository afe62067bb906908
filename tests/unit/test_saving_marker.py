"""Rank 0's save-in-progress marker as the launcher reads it (through node 0's agent): a
write is in progress only while its writer lives."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from mindpulse.rundir.rundir_io import SAVING_MARKER, mark_saving, saving_now


def test_a_marker_whose_writer_lives_is_a_write_in_progress(tmp_path):
    path = mark_saving(tmp_path, 40)
    assert path == tmp_path / SAVING_MARKER
    now = saving_now(tmp_path)
    assert now is not None and now["alive"] and now["step"] == 40 and now["pid"] == os.getpid(), now
    assert path.stat().st_mode & 0o022 == 0  # the run directory's file mode: never group/other write
    assert [p.name for p in tmp_path.iterdir()] == [SAVING_MARKER]  # no temp file left


def test_a_marker_left_by_a_dead_writer_is_not(tmp_path):
    """A rank 0 killed mid-write leaves its marker: the launcher must not wait for it."""
    code = f"from mindpulse.rundir.rundir_io import mark_saving; mark_saving({str(tmp_path)!r}, 7)"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    note = saving_now(tmp_path)
    assert note is not None and note["step"] == 7 and not note["alive"], note


@pytest.mark.parametrize("change", [{"create_time": 1.0}, {"host": "another-host"}, {"boot_id": "another-kernel"},
                                    {"pid": 0}, {"pid": -1}])
def test_a_reused_pid_or_another_hosts_marker_is_not_a_live_writer(tmp_path, change):
    """The pid alone could name a new process (or, on a shared output root, one of another
    host): the marker names its writer by its process table, pid and the pid's creation time."""
    mark_saving(tmp_path, 5)
    note = json.loads((tmp_path / SAVING_MARKER).read_text())
    assert note["host"] == socket.gethostname() and note["create_time"] > 0
    (tmp_path / SAVING_MARKER).write_text(json.dumps({**note, **change}))
    assert saving_now(tmp_path)["alive"] is False


def test_no_marker_or_an_unreadable_one_is_no_write(tmp_path):
    assert saving_now(tmp_path) is None
    assert saving_now(tmp_path / "missing") is None
    for text in ("", "{", "[]", json.dumps({"step": "x", "pid": 1}), json.dumps({"pid": os.getpid()})):
        (tmp_path / SAVING_MARKER).write_text(text)
        assert saving_now(tmp_path) is None, text


def test_a_marker_that_cannot_be_written_is_no_error(tmp_path):
    assert mark_saving(tmp_path / "missing-folder", 3) is None


def test_slow_save_is_a_fault_of_rank_0_only():
    from mindpulse.config.fault_specs import FaultKind, parse_fault

    f = parse_fault("slow_save@0:4", world_size=2)
    assert f.kind is FaultKind.SLOW_SAVE and (f.rank, f.step) == (0, 4) and str(f) == "slow_save@0:4"
    with pytest.raises(ValueError, match=r"only rank 0 writes checkpoints; use slow_save@0:4"):
        parse_fault("slow_save@1:4", world_size=2)


def test_save_grace_must_be_a_finite_number_of_seconds():
    from mindpulse.config import ConfigError, from_dict

    for bad in (-1, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match=r"^checkpoint\.save_grace_s: "):
            from_dict({"checkpoint": {"save_grace_s": bad}})
    assert from_dict({"checkpoint": {"save_grace_s": 0}}).checkpoint.save_grace_s == 0


def test_slow_save_at_a_step_without_a_checkpoint_is_refused_with_the_steps_that_have_one():
    """Where rank 0 can write no periodic or best checkpoint the fault would silently never
    act; the error lists the steps that can save. Not checked where a `last` checkpoint may
    come at any step (save_and_stop) or the saving steps are not known before the run."""
    from mindpulse.config import ConfigError, from_dict

    base = {"train": {"steps": 20}, "checkpoint": {"save_checkpoint_steps": 4, "best_every_steps": 10}}
    for step in (4, 8, 10, 20):  # periodic, periodic, best, periodic and best
        from_dict(dict(base, faults=[f"slow_save@0:{step}"]))
    for step in (5, 6, 25):  # none; an evaluation does not judge a best on the loss; after the run
        with pytest.raises(ConfigError, match=rf"faults\[1\]: 'slow_save@0:{step}': rank 0 writes no checkpoint "
                                              rf"at step {step} of this 20-step run"):
            from_dict(dict(base, faults=["nan_grad@1:3", f"slow_save@0:{step}"], eval={"every_steps": 6}))
    with pytest.raises(ConfigError) as err:
        from_dict(dict(base, faults=["slow_save@0:5"]))
    assert "steps 4, 8, 10, 12, 16, 20 (periodic checkpoints every checkpoint.save_checkpoint_steps=4; best " \
           "checkpoints judged every checkpoint.best_every_steps=10)" in str(err.value), str(err.value)
    with pytest.raises(ConfigError, match=r"it may write one at no step \(periodic and best checkpoints are off\)"):
        from_dict({"train": {"steps": 20}, "faults": ["slow_save@0:5"],
                   "checkpoint": {"save_checkpoint_steps": 0, "save_best_ckpt": False}})
    # a best judged on an evaluation metric is written at evaluations
    ev = dict(base, eval={"every_steps": 6}, checkpoint=dict(base["checkpoint"], best_metric="eval_loss"))
    from_dict(dict(ev, faults=["slow_save@0:6"]))
    with pytest.raises(ConfigError, match="best checkpoints at evaluations"):
        from_dict(dict(ev, faults=["slow_save@0:10"]))
    # not known before the run: a `last` checkpoint (save_and_stop), the epochs deciding the length,
    # evaluations at epoch ends
    from_dict(dict(base, faults=["slow_save@0:5"], anomalies=[{"rule": "nonfinite", "action": "save_and_stop"}]))
    from_dict({"train": {"steps": 0}, "faults": ["slow_save@0:5"]})
    from_dict(dict(ev, faults=["slow_save@0:5"], eval={"every_steps": 6, "per_epoch": True}))


@pytest.mark.parametrize("checkpoint,evals", [
    ({"save_checkpoint_steps": 4, "best_every_steps": 10}, {}),
    ({"save_checkpoint_steps": 0, "best_every_steps": 3}, {"every_steps": 5}),
    ({"save_checkpoint_steps": 6, "best_metric": "eval_loss"}, {"every_steps": 4}),
    ({"save_checkpoint_steps": 5, "save_best_ckpt": False}, {}),
])
def test_the_slow_save_check_accepts_exactly_the_steps_the_aggregator_asks_a_save_at(tmp_path, checkpoint, evals):
    """The launch check and the aggregator's verdict share one rule (`CheckpointConfig.best_due`):
    with a metric that improves every step, the steps the aggregator asks rank 0 to save at
    are the steps `slow_save@0:S` is accepted at."""
    from mindpulse.aggregator.core import AggregatorCore
    from mindpulse.config import ConfigError, from_dict
    from mindpulse.wire.protocol import StepPacket

    total = 24
    base = {"train": {"steps": total}, "checkpoint": checkpoint, "eval": evals}
    core = AggregatorCore(tmp_path, world_size=1, settings={"checkpoint": checkpoint, "eval": evals,
                                                            "tensorboard": False})
    asked = set()
    for s in range(1, total + 1):
        extra = {"eval_loss": 10.0 - s / 10} if evals.get("every_steps") and s % evals["every_steps"] == 0 else {}
        core.ingest([StepPacket(rank=0, step=s, loss=10.0 - s / 10, decision=True, step_time_s=0.1, samples=4,
                                extra=extra).encode()])
        if core.directive_for(s).save:
            asked.add(s)
    accepted = set()
    for s in range(1, total + 1):
        try:
            from_dict(dict(base, faults=[f"slow_save@0:{s}"]))
            accepted.add(s)
        except ConfigError:
            pass
    assert asked == accepted, f"the aggregator asks saves at {sorted(asked)}, the check accepts {sorted(accepted)}"
    assert asked or not (checkpoint.get("save_checkpoint_steps") or checkpoint.get("save_best_ckpt", True))
