"""MonitoredTrainOneStepCell in PYNATIVE and GRAPH mode (single process): the loss, the
gradient norms and the NaN/Inf counts it returns, and the fault scalars."""

from __future__ import annotations

import math

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn

from mindpulse.workers.train_cell import MonitoredTrainOneStepCell, split_outputs


@pytest.fixture(params=["pynative", "graph"])
def mode(request):
    ms.set_context(mode=ms.PYNATIVE_MODE if request.param == "pynative" else ms.GRAPH_MODE, device_target="CPU")
    yield request.param
    ms.set_context(mode=ms.PYNATIVE_MODE)


def make(fault_armed=False):
    ms.set_seed(5)
    net = nn.Dense(6, 2)
    opt = nn.SGD(net.trainable_params(), 0.01)
    return net, MonitoredTrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), opt, fault_armed=fault_armed)


def data():
    rng = np.random.RandomState(0)
    return ms.Tensor(rng.randn(4, 6).astype(np.float32)), ms.Tensor(rng.randn(4, 2).astype(np.float32))


def test_stats_match_a_host_computation(mode):
    net, cell = make()
    x, y = data()
    w0, b0 = net.weight.asnumpy().copy(), net.bias.asnumpy().copy()
    loss, stats = split_outputs(cell(x, y))
    # MSE gradients by hand: d/dW mean((xW^T+b-y)^2)
    xn, yn = x.asnumpy(), y.asnumpy()
    err = xn @ w0.T + b0 - yn
    gw = 2 * err.T @ xn / err.size
    gb = 2 * err.sum(0) / err.size
    expected = math.sqrt((gw ** 2).sum() + (gb ** 2).sum())
    assert loss == pytest.approx(float((err ** 2).mean()), rel=1e-5)
    assert stats["grad_norm_local"] == pytest.approx(expected, rel=1e-4)
    assert stats["grad_norm"] == pytest.approx(stats["grad_norm_local"], rel=1e-6)  # one process: no reduction
    assert stats["nan_count"] == 0 and stats["inf_count"] == 0
    np.testing.assert_allclose(net.weight.asnumpy(), w0 - 0.01 * gw, rtol=1e-4, atol=1e-6)


def test_fault_scalars_corrupt_the_real_step(mode):
    net, cell = make(fault_armed=True)
    x, y = data()
    cell.fault_grad_scale.set_data(ms.Tensor(float("nan"), ms.float32))
    _, stats = split_outputs(cell(x, y))
    assert stats["nan_count"] == 14 and math.isnan(stats["grad_norm"])  # 12 weights + 2 biases
    cell.fault_grad_scale.set_data(ms.Tensor(1.0, ms.float32))
    cell.fault_loss_scale.set_data(ms.Tensor(5.0, ms.float32))
    loss5, s5 = split_outputs(cell(x, y))
    assert math.isnan(loss5)  # the weights already hold the NaN update: the corruption is real


def test_unarmed_cell_has_no_fault_ops_in_the_step(mode):
    _, cell = make(fault_armed=False)
    x, y = data()
    cell.fault_grad_scale.set_data(ms.Tensor(float("nan"), ms.float32))
    _, stats = split_outputs(cell(x, y))
    assert stats["nan_count"] == 0, "the fault scalars must not be in an unarmed cell's computation"
