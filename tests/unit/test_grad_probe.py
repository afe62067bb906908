"""Gradient statistics attached to train cells mindpulse did not build (workers/grad_probe.py),
single process, PYNATIVE and GRAPH: the same statistics as a host computation, the cell's own
outputs and update untouched, and the fault scalars. The loss-scale cell's overflow path and
the data-parallel global norm run in tests/integration/test_unmodified_scripts.py."""

from __future__ import annotations

import math

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn

from mindpulse.workers.faults import FaultInjector
from mindpulse.workers.grad_probe import attach_grad_stats, find_train_cell, probe_of, read_stats


@pytest.fixture(params=["pynative", "graph"])
def mode(request):
    ms.set_context(mode=ms.PYNATIVE_MODE if request.param == "pynative" else ms.GRAPH_MODE, device_target="CPU")
    yield request.param
    ms.set_context(mode=ms.PYNATIVE_MODE)


def data():
    rng = np.random.RandomState(0)
    return ms.Tensor(rng.randn(4, 6).astype(np.float32)), ms.Tensor(rng.randn(4, 2).astype(np.float32))


def host_grads(w, b, x, y):
    err = x @ w.T + b - y
    return 2 * err.T @ x / err.size, 2 * err.sum(0) / err.size, float((err ** 2).mean())


def test_a_plain_train_cell_reports_the_statistics_and_trains_as_before(mode):
    ms.set_seed(5)
    net = nn.Dense(6, 2)
    cell = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), nn.SGD(net.trainable_params(), 0.01))
    assert attach_grad_stats(cell, rank=0) == "attached"
    assert attach_grad_stats(cell, rank=0) == "already", "attached twice"
    x, y = data()
    w0, b0 = net.weight.asnumpy().copy(), net.bias.asnumpy().copy()
    out = cell(x, y)
    gw, gb, loss = host_grads(w0, b0, x.asnumpy(), y.asnumpy())
    # the cell's outputs are MindSpore's: the loss alone
    assert isinstance(out, ms.Tensor) and out.shape == () and float(out.asnumpy()) == pytest.approx(loss, rel=1e-5)
    stats = read_stats(probe_of(cell))
    assert stats["grad_norm_local"] == pytest.approx(math.sqrt((gw ** 2).sum() + (gb ** 2).sum()), rel=1e-4)
    assert stats["grad_norm"] == pytest.approx(stats["grad_norm_local"], rel=1e-6)  # one process: no all-reduce
    assert (stats["nan_count"], stats["inf_count"]) == (0, 0)
    np.testing.assert_allclose(net.weight.asnumpy(), w0 - 0.01 * gw, rtol=1e-4, atol=1e-6)
    # no fault injected into rank 0 of this process: nothing but the statistics was added
    assert [p.name for p in cell.get_parameters() if "mindpulse" in p.name] == ["mindpulse_grad_stats"]


def test_injected_faults_reach_an_attached_cell(mode, monkeypatch):
    monkeypatch.setattr("mindpulse.workers.grad_probe.cell_faults_armed", lambda rank: True)
    ms.set_seed(5)
    net = nn.Dense(6, 2)
    cell = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), nn.SGD(net.trainable_params(), 0.01))
    attach_grad_stats(cell, rank=1)
    x, y = data()
    inj = FaultInjector(1, [])
    inj.bind(cell, net)
    inj._set("fault_grad_scale", float("nan"))
    cell(x, y)
    stats = read_stats(probe_of(cell))
    assert stats["nan_count"] == 14 and math.isnan(stats["grad_norm"])  # 12 weights + 2 biases
    inj._set("fault_grad_scale", 1.0)
    inj._set("fault_loss_scale", float("nan"))
    assert math.isnan(float(cell(x, y).asnumpy()))


def test_model_builds_the_cell_the_probe_finds_it():
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    net = nn.Dense(6, 2)
    model = ms.train.Model(net, nn.MSELoss(), nn.SGD(net.trainable_params(), 0.01))
    cell = find_train_cell(model.train_network)
    assert isinstance(cell, nn.TrainOneStepCell)
    assert find_train_cell(net) is None and attach_grad_stats(net).startswith("no train cell")
