"""Loss-spike and NaN rollback: the rule action, its cap, the launcher's resume point, the
data stream's offset and the lowered learning rate."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_policies import _steps

from mindpulse.aggregator.core import AggregatorCore
from mindpulse.config import ConfigError, from_dict
from mindpulse.config.rank_settings import ResumePoint
from mindpulse.launcher.controller import carry_rollbacks
from mindpulse.launcher.resume import rollback_point
from mindpulse.wire.protocol import Action
from mindpulse.workers.recipes.llama_finetune import ByteWindows

RULE = {"rule": "threshold", "name": "loss_high", "metric": "loss", "threshold": 4.0, "action": "rollback",
        "lr_factor": 0.25, "lr_steps": 7, "max_rollbacks": 1}


def test_a_rollback_rule_stops_every_rank_and_says_how_to_roll_back(tmp_path):
    core = AggregatorCore(tmp_path, world_size=2, settings={"monitor": {"max_lag_steps": 1}, "anomalies": [RULE]})
    _steps(core, 1, [1.0, 1.0])
    _steps(core, 2, [1.0, 9.0])
    _steps(core, 3, [1.0, 1.0])
    stop = core.snapshot()["stop"]
    assert (stop["rule"], stop["decided_at"], stop["step"]) == ("loss_high", 2, 3), stop
    assert stop["rollback"] == {"rule": "loss_high", "anomaly_step": 2, "skip_batches": True, "lr_factor": 0.25,
                                "lr_steps": 7}
    assert core.directive_for(3).action is Action.STOP
    assert json.loads((tmp_path / "anomalies.jsonl").read_text().splitlines()[0])["action"] == "rollback"


def test_past_max_rollbacks_the_rule_stops_as_stop_does(tmp_path):
    core = AggregatorCore(tmp_path, world_size=1, settings={"monitor": {"max_lag_steps": 0}, "anomalies": [RULE],
                                                             "rollbacks": {"loss_high": 1}})
    _steps(core, 1, [9.0])
    stop = core.snapshot()["stop"]
    assert stop["rule"] == "loss_high" and "rollback" not in stop, stop
    assert any("max_rollbacks 1" in line for line in core.drain_console())


@pytest.mark.parametrize("change, field", [({"rule": "desync"}, "action"), ({"lr_factor": 0.0}, "lr_factor"),
                                           ({"lr_factor": 2.0}, "lr_factor"), ({"max_rollbacks": -1}, "max_rollbacks")])
def test_rollback_settings_are_checked(change, field):
    with pytest.raises(ConfigError, match=rf"anomalies\[0\]\.{field}"):
        from_dict({"anomalies": [dict(RULE, **change)]})


def _manifest(ckpt_dir, steps):
    import hashlib

    ckpt_dir.mkdir(parents=True, exist_ok=True)
    files = []
    for s in steps:
        name = f"step_{s}.ckpt"
        data = f"weights {s}".encode()
        (ckpt_dir / name).write_bytes(data)
        files.append({"path": name, "step": s, "epoch": 0, "kind": "periodic", "time": float(s), "size": len(data),
                      "sha256": hashlib.sha256(data).hexdigest()})
    (ckpt_dir / "manifest.json").write_text(json.dumps({"version": 1, "files": files}))


def test_the_rollback_point_is_the_newest_valid_checkpoint_strictly_before_the_anomaly(tmp_path):
    ckpt = tmp_path / "checkpoints"
    _manifest(ckpt, [4, 8, 12])
    point, refused = rollback_point(ckpt, 12)
    assert point["step"] == 8 and point["path"].endswith("step_8.ckpt") and refused == []
    (ckpt / "step_8.ckpt").write_bytes(b"torn")
    point, refused = rollback_point(ckpt, 12)
    assert point["step"] == 4 and len(refused) == 1 and "step_8.ckpt" in refused[0]
    assert rollback_point(ckpt, 4) == (None, []), "nothing before the first checkpoint: back to the start"


def test_a_restart_after_a_rollback_keeps_its_offset_and_learning_rate_window():
    old = {"path": "/r/c/step_8.ckpt", "step": 8, "skip_batches": 1, "lr_factor": 0.5, "lr_until_step": 108,
           "rollbacks": {"loss_spike": 1}}
    new = carry_rollbacks({"path": "/r/c/step_12.ckpt", "step": 12}, old)
    assert new == {"path": "/r/c/step_12.ckpt", "step": 12, "skip_batches": 1, "lr_factor": 0.5,
                   "lr_until_step": 108, "rollbacks": {"loss_spike": 1}}
    assert carry_rollbacks({"path": "p", "step": 3}, {"path": "q", "step": 1}) == {"path": "p", "step": 3}


def test_the_data_stream_skips_the_rolled_back_batches_and_the_lr_is_lowered_for_lr_steps():
    tokens = np.random.RandomState(0).randint(0, 256, 20_000).astype(np.int32)
    plain = ByteWindows(tokens, 16, rank=0, world=2, seed=3, batch_size=4, start_step=0, stop_step=12)
    after = ByteWindows(tokens, 16, rank=0, world=2, seed=3, batch_size=4, start_step=8, stop_step=12, skip_batches=1)
    batches = [w for (w,) in plain]
    skipped = [w for (w,) in after]
    # step 9 after the rollback trains on the batch of step 10: step 9's batch (the bad one) is never seen
    assert len(skipped) == 4 * 4
    assert all((a == b).all() for a, b in zip(skipped, batches[9 * 4:]))
    assert not any((w == b).all() for w in skipped for b in batches[8 * 4:9 * 4])
    resume = ResumePoint(path="x", step=8, lr_factor=0.5, lr_until_step=10)
    assert resume.scaled_lrs([1.0] * 12) == [1.0] * 8 + [0.5, 0.5] + [1.0, 1.0]


def test_the_runs_first_and_best_loss_span_its_attempts(tmp_path):
    from mindpulse.launcher.summary import RunHistory

    h = RunHistory(logs_dir=tmp_path)
    h.add_losses({"first_loss": None, "best_loss": None})  # an attempt that never reduced a step
    h.add_losses({"first_loss": 2.1, "best_loss": 1.5, "best_loss_step": 4})
    h.add_losses({"first_loss": 2.3, "best_loss": 1.7, "best_loss_step": 9})
    assert h.losses == {"first_loss": 2.1, "best_loss": 1.5, "best_loss_step": 4}
    h.add_losses({"first_loss": 1.9, "best_loss": 1.2, "best_loss_step": 12})
    assert h.losses == {"first_loss": 2.1, "best_loss": 1.2, "best_loss_step": 12}
