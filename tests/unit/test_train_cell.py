"""MonitoredTrainOneStepCell in PYNATIVE and GRAPH mode (single process): the loss, the
gradient norms and the NaN/Inf counts it returns (taken only when a sum of squares is not
finite), and the fault scalars."""

from __future__ import annotations

import math

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn, ops

from mindpulse.workers.train_cell import MonitoredTrainOneStepCell, split_outputs, square_sum_groups


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


# ---- the NaN/Inf counts, taken only when the sum of squares is not finite ---------------
# A network whose gradients are its inputs: loss = sum_p <p, t_p>, so each parameter's
# gradient is exactly t_p, and non-finite values land where the test puts them. The shapes
# make several concatenation groups: two matrices sharing a trailing shape, a vector and a
# scalar (flattened together), a 3-D tensor, a matrix of its own.
SHAPES = [(3, 4), (4,), (2, 4), (), (2, 3, 4), (5, 2)]


class _GradIsInput(nn.Cell):
    def __init__(self):
        super().__init__()
        self.ps = ms.ParameterTuple(
            [ms.Parameter(ms.Tensor(np.zeros(s, np.float32)), name=f"p{i}") for i, s in enumerate(SHAPES)]
        )

    def construct(self, *ts):
        loss = ops.zeros((), ms.float32)
        for p, t in zip(self.ps, ts):
            loss = loss + ops.reduce_sum(p * t)
        return loss


@pytest.fixture(params=[("pynative", "fused"), ("graph", "fused"),
                        # the graph path compiles a graph per test and shape: the full suite only
                        pytest.param(("graph", "graph:count_if_not_finite"), marks=pytest.mark.slow),
                        pytest.param(("graph", "graph:count_every_step"), marks=pytest.mark.slow)],
                ids=lambda p: "-".join(p))
def counting(request):
    """Every way the cell takes the statistics: the fused kernel (CPU; in both modes), and
    the graph path with the counts behind a branch on the sum of squares (large gradients)
    or taken every step on the concatenated gradients (small ones). The graph path's
    statistics are one `ms.jit` function, compiled as a graph in either mode: GRAPH only."""
    mode, how = request.param
    ms.set_context(mode=ms.PYNATIVE_MODE if mode == "pynative" else ms.GRAPH_MODE, device_target="CPU")
    yield how
    ms.set_context(mode=ms.PYNATIVE_MODE)


def _grad_cell(counting, fault_armed=False):
    net = _GradIsInput()
    kernel = "fused" if counting == "fused" else "graph"
    cell = MonitoredTrainOneStepCell(net, nn.SGD(net.trainable_params(), 0.01), fault_armed=fault_armed,
                                     count_every_step=counting == "graph:count_every_step", stats_kernel=kernel)
    assert cell.fused_stats is (kernel == "fused")
    return cell


def _grads(seed=1):
    rng = np.random.RandomState(seed)
    return [rng.randn(*s).astype(np.float32) if s else np.float32(rng.randn()) for s in SHAPES]


def _step(cell, grads):
    return split_outputs(cell(*[ms.Tensor(np.asarray(g, np.float32)) for g in grads]))


def test_square_sum_groups_concatenate_by_trailing_shape():
    assert square_sum_groups(SHAPES) == ((0, 2), (1, 3), (4,), (5,))
    assert square_sum_groups([(7,), (8, 2), (9, 2)]) == ((0,), (1, 2))
    net = _GradIsInput()
    cell = MonitoredTrainOneStepCell(net, nn.SGD(net.trainable_params(), 0.01), fault_armed=False)
    assert cell.stat_groups == ((0, 2), (1, 3), (4,), (5,))
    assert cell.count_every_step  # 67 values: counting costs less than the branch


def test_counts_every_step_only_on_small_gradients():
    big = nn.Dense(800, 600)  # 480,600 values
    small = nn.Dense(400, 600)  # 240,600 values
    for net, every in ((big, False), (small, True)):
        cell = MonitoredTrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), nn.SGD(net.trainable_params(), 0.01),
                                         fault_armed=False)
        assert cell.count_every_step is every


def test_finite_gradients_give_zero_counts_and_the_host_norm(counting):
    cell = _grad_cell(counting)
    grads = _grads()
    expected = math.sqrt(sum(float((np.asarray(g, np.float64) ** 2).sum()) for g in grads))
    for _ in range(2):  # the same graph twice: the branch is taken at run time, not compiled away
        _, stats = _step(cell, grads)
        assert stats["grad_norm_local"] == pytest.approx(expected, rel=1e-5)
        assert stats["grad_norm"] == pytest.approx(expected, rel=1e-5)
        assert math.isfinite(stats["grad_norm"]) and math.isfinite(stats["grad_norm_local"])
        assert stats["nan_count"] == 0 and stats["inf_count"] == 0


def test_nan_and_inf_counts_when_a_gradient_is_not_finite(counting):
    cell = _grad_cell(counting)
    finite = _grads()
    _, stats = _step(cell, finite)  # a healthy step first: the same compiled step must count afterwards
    assert stats["nan_count"] == 0 and stats["inf_count"] == 0

    grads = _grads()
    grads[0][1, 2] = np.nan
    grads[4][1, 0, 3] = np.nan
    grads[3] = np.float32(np.inf)  # the scalar parameter
    grads[2][0, 0] = -np.inf  # -inf counts as Inf too
    grads[5][4, 1] = np.inf
    _, stats = _step(cell, grads)
    assert (stats["nan_count"], stats["inf_count"]) == (2, 3)
    assert math.isnan(stats["grad_norm"]) and math.isnan(stats["grad_norm_local"])

    cell = _grad_cell(counting)
    grads = _grads()
    grads[1][3] = np.inf
    grads[4][0, 2, 1] = -np.inf
    _, stats = _step(cell, grads)
    assert (stats["nan_count"], stats["inf_count"]) == (0, 2)
    assert stats["grad_norm"] == math.inf and stats["grad_norm_local"] == math.inf

    cell = _grad_cell(counting)
    _, stats = _step(cell, finite)  # and back to finite gradients: nothing counted
    assert stats["nan_count"] == 0 and stats["inf_count"] == 0 and math.isfinite(stats["grad_norm"])


def test_an_overflowing_sum_of_squares_is_counted_not_guessed(counting):
    """Finite gradients whose squares overflow float32: the counts, taken because the
    float32 sum is not finite, say that no element is NaN or Inf. The fused kernel then
    sums the squares in double (the norm is exact); the graph path reports Inf."""
    cell = _grad_cell(counting)
    grads = _grads()
    grads[0][0, 0] = 3e19
    _, stats = _step(cell, grads)
    if counting == "fused":
        assert stats["grad_norm_local"] == pytest.approx(3e19, rel=1e-6)
        assert stats["grad_norm"] == stats["grad_norm_local"]
    else:
        assert stats["grad_norm_local"] == math.inf
    assert stats["nan_count"] == 0 and stats["inf_count"] == 0


def test_fault_grad_scale_counts_every_element(counting):
    cell = _grad_cell(counting, fault_armed=True)
    cell.fault_grad_scale.set_data(ms.Tensor(float("inf"), ms.float32))
    grads = [np.abs(np.asarray(g)) + np.float32(0.5) for g in _grads()]  # no zero: inf * 0 would be NaN
    _, stats = _step(cell, grads)
    assert (stats["nan_count"], stats["inf_count"]) == (0, sum(int(np.prod(s)) for s in SHAPES))


def test_split_outputs_reads_every_output_shape_a_cell_returns():
    """Scalar, one-element and multi-element losses, MindSpore's (loss, ...) tuples, our
    (loss, stats) pair (non-finite counts read as 0), and a plain number."""
    f32 = ms.float32
    assert split_outputs(ms.Tensor(2.5, f32)) == (2.5, {})
    assert split_outputs(ms.Tensor([[2.5]], f32)) == (2.5, {})
    assert split_outputs(ms.Tensor([1.0, 2.0, 4.5], f32)) == (2.5, {})  # the mean over the elements
    assert split_outputs(ms.Tensor(np.zeros((0,), np.float32))) == (None, {})
    # a loss-scale cell's (loss, overflow flag, scale), and MindFormers' (..., learning rate, global norm)
    assert split_outputs((ms.Tensor(1.5, ms.float16), ms.Tensor(False), ms.Tensor(1024.0, f32))) == (
        1.5, {"overflow": False, "loss_scale": 1024.0})
    assert split_outputs((ms.Tensor(1.5, f32), ms.Tensor(True), ms.Tensor(512.0, f32), ms.Tensor(1e-4, f32),
                          ms.Tensor(7.0, f32))) == (1.5, {"overflow": True, "loss_scale": 512.0,
                                                          "lr": pytest.approx(1e-4), "grad_norm": 7.0})
    # a (loss, something) tuple that is not a loss-scale cell's adds nothing
    assert split_outputs((ms.Tensor(1.5, f32), ms.Tensor(1.0, f32), ms.Tensor(2.0, f32))) == (1.5, {})
    stats = ms.Tensor([3.0, float("inf"), float("nan"), 2.0], f32)
    loss, s = split_outputs((ms.Tensor(0.25, ms.bfloat16), stats))
    assert loss == 0.25 and s["grad_norm"] == 3.0 and math.isinf(s["grad_norm_local"])
    assert (s["nan_count"], s["inf_count"]) == (0, 2), "a non-finite count is read as 0, a finite one as is"
    assert split_outputs(3.0) == (3.0, {}) and split_outputs(()) == (None, {})
