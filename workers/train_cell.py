"""A TrainOneStepCell that also returns the gradient statistics the monitor needs.

Exact signals come from the graph: the global grad norm is computed after the
data-parallel all-reduce (so it is identical on every rank), the local norm and the
NaN/Inf counts before it (so they name the rank that produced a bad gradient).
Works in PYNATIVE and GRAPH mode, in one process and in data parallel.
"""

from __future__ import annotations

import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

# indices into the stats vector returned next to the loss
STAT_GRAD_NORM = 0
STAT_GRAD_NORM_LOCAL = 1
STAT_NAN = 2
STAT_INF = 3
STATS_LEN = 4

FAULT_PARAM_PREFIX = "mindpulse_fault_"
"""Names of the fault-injection scalars; they are not model weights and never saved."""

_square_sum = ops.MultitypeFuncGraph("square_sum")


@_square_sum.register("Tensor")
def _tensor_square_sum(x):
    x = ops.cast(x, ms.float32)
    return ops.reduce_sum(x * x)


_count_nan = ops.MultitypeFuncGraph("count_nan")


@_count_nan.register("Tensor")
def _tensor_count_nan(x):
    return ops.reduce_sum(ops.cast(ops.isnan(x), ms.float32))


_count_inf = ops.MultitypeFuncGraph("count_inf")


@_count_inf.register("Tensor")
def _tensor_count_inf(x):
    return ops.reduce_sum(ops.cast(ops.isinf(x), ms.float32))


_scale = ops.MultitypeFuncGraph("scale")


@_scale.register("Tensor", "Tensor")
def _tensor_scale(s, g):
    return g * ops.cast(s, g.dtype)


class MonitoredTrainOneStepCell(nn.TrainOneStepCell):
    """`TrainOneStepCell` returning `(loss, stats)`.

    `stats` is a float32 vector: [global grad norm (after the all-reduce), local grad
    norm (before it), NaN count, Inf count] of this rank's gradients. Keeping the
    statistics in one tensor costs one device-to-host copy per step.

    Two scalar parameters (not trainable, not saved) let the fault injector corrupt the
    real computation in the real rank: `mindpulse_fault_loss_scale` multiplies the loss
    and its gradients, `mindpulse_fault_grad_scale` multiplies the local gradients
    before the reduction. Both are 1.0 unless a fault is injected.
    """

    def __init__(self, network: nn.Cell, optimizer: nn.Optimizer, sens: float | None = None):
        super().__init__(network, optimizer, sens)
        self.hyper_map = ops.HyperMap()
        self.fault_loss_scale = Parameter(
            Tensor(1.0, ms.float32), name=FAULT_PARAM_PREFIX + "loss_scale", requires_grad=False
        )
        self.fault_grad_scale = Parameter(
            Tensor(1.0, ms.float32), name=FAULT_PARAM_PREFIX + "grad_scale", requires_grad=False
        )

    def construct(self, *inputs):
        loss = self.network(*inputs)
        scale = self.fault_loss_scale
        sens = ops.fill(loss.dtype, loss.shape, self.sens) * ops.cast(scale, loss.dtype)
        grads = self.grad(self.network, self.weights)(*inputs, sens)
        loss = loss * ops.cast(scale, loss.dtype)
        grads = self.hyper_map(ops.partial(_scale, self.fault_grad_scale), grads)
        local_sq = ops.addn(self.hyper_map(_square_sum, grads))
        nan = ops.addn(self.hyper_map(_count_nan, grads))
        inf = ops.addn(self.hyper_map(_count_inf, grads))
        grads = self.grad_reducer(grads)
        global_sq = ops.addn(self.hyper_map(_square_sum, grads))
        stats = ops.stack([ops.sqrt(global_sq), ops.sqrt(local_sq), nan, inf])
        loss = ops.depend(loss, self.optimizer(grads))
        return loss, stats


def split_outputs(outputs) -> tuple[float | None, dict[str, float]]:
    """Network outputs of one step → (loss, stats dict). Accepts our cell's output,
    a plain loss tensor, or a tuple whose first element is the loss (MindSpore's
    convention, e.g. loss-scale cells)."""
    import numpy as np

    stats: dict[str, float] = {}
    loss_t = outputs
    if isinstance(outputs, (tuple, list)):
        loss_t = outputs[0] if outputs else None
        if len(outputs) == 2 and isinstance(outputs[1], Tensor) and outputs[1].shape == (STATS_LEN,):
            v = outputs[1].asnumpy().astype(np.float64)
            stats = {
                "grad_norm": float(v[STAT_GRAD_NORM]),
                "grad_norm_local": float(v[STAT_GRAD_NORM_LOCAL]),
                "nan_count": int(v[STAT_NAN]) if np.isfinite(v[STAT_NAN]) else 0,
                "inf_count": int(v[STAT_INF]) if np.isfinite(v[STAT_INF]) else 0,
            }
    loss = None
    if isinstance(loss_t, Tensor):
        arr = loss_t.asnumpy()
        loss = float(arr.reshape(-1).mean()) if arr.size else None
    elif isinstance(loss_t, (int, float)):
        loss = float(loss_t)
    return loss, stats
