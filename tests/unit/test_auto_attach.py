"""Auto-attach in one process (workers/auto_attach.py): the Monitor added to Model.train once,
never doubled, its steps numbered on across calls, the script's callback list untouched, a
hand loop's own train cell given the statistics, and every patch removed at the end."""

from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn
from mindspore.train import LossMonitor, Model, ModelCheckpoint

from mindpulse.workers.auto_attach import _callback_directory, install
from mindpulse.workers.monitor import Monitor


@pytest.fixture
def attached():
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    originals = {k: Model.__dict__[k] for k in ("train", "fit", "_build_train_network")}
    calls = {c: c.__dict__.get("__call__") for c in (nn.TrainOneStepCell, nn.Optimizer)}
    state = install(None, 0, True)
    yield state
    state.finish()
    state.uninstall()
    assert {k: Model.__dict__[k] for k in originals} == originals, "Model's methods were not restored"
    assert {c: c.__dict__.get("__call__") for c in calls} == calls, "__call__ was not restored"


def data(n=4):
    rng = np.random.RandomState(0)
    x = rng.randn(n * 4, 6).astype(np.float32)
    return ms.dataset.NumpySlicesDataset({"x": x, "y": x[:, :2] * 2}, shuffle=False).batch(4)


def test_the_monitor_is_added_once_and_numbers_its_steps_on(attached):
    net = nn.Dense(6, 2)
    model = Model(net, nn.MSELoss(), nn.SGD(net.trainable_params(), 0.01))
    mine = [LossMonitor()]
    model.train(1, data(), callbacks=mine, dataset_sink_mode=False)
    assert mine == mine[:1] and len(mine) == 1, "the script's callback list was changed"
    added = attached.monitor
    assert isinstance(added, Monitor) and added.session.step == 4
    model.train(1, data(), mine, dataset_sink_mode=False)  # positional callbacks, a second call
    assert attached.monitor is added and added.session.step == 8, "steps restarted at the second Model.train"
    assert not added.session.finished  # finished at the script's end
    attached.finish()
    assert added.session.finished


def test_a_monitor_the_script_added_is_never_doubled(attached):
    net = nn.Dense(6, 2)
    own = Monitor()
    Model(net, nn.MSELoss(), nn.SGD(net.trainable_params(), 0.01)).train(1, data(), callbacks=own,
                                                                         dataset_sink_mode=False)
    assert attached.monitor is None and own.session.step == 4


def test_a_hand_loops_own_cell_gets_the_statistics(attached):
    net = nn.Dense(6, 2)
    opt = nn.SGD(net.trainable_params(), 0.01)
    cell = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), opt)
    monitor = Monitor(network=net, batch_size=4)
    shipped = []
    monitor.session._ship = lambda pkt, later=None, copied=False: shipped.append(pkt)  # what would go to the aggregator
    x = ms.Tensor(np.ones((4, 6), np.float32))
    for _ in range(2):
        out = cell(x, ms.Tensor(np.zeros((4, 2), np.float32)))
        monitor.step(out, optimizer=opt, train_cell=cell)
    steps = [p for p in shipped if p.step > 0]
    assert [p.step for p in steps] == [1, 2]
    assert all(p.grad_norm_local > 0 and p.grad_norm == pytest.approx(p.grad_norm_local) for p in steps), steps
    assert all(p.nan_count == 0 and p.inf_count == 0 for p in steps)


def test_callback_directories_keep_the_file_prefix(tmp_path):
    a = ModelCheckpoint(prefix="rank0", directory=str(tmp_path / "ck"))
    assert _callback_directory(a) == (str(tmp_path / "ck"), "rank0")
    assert _callback_directory(LossMonitor()) is None
