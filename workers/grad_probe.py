"""Gradient statistics for a train cell mindpulse did not build.

A script that lets `Model` build its train network (network + loss_fn + optimizer, with or
without `amp_level` or a loss-scale manager), or builds `nn.TrainOneStepCell` /
`nn.TrainOneStepWithLossScaleCell` itself, gets the same statistics as
`MonitoredTrainOneStepCell` without an edit: the cell's gradient reducer is wrapped.

Why the reducer: every MindSpore train cell (and MindFormers' derived ones) passes its
gradients through `self.grad_reducer` exactly once, after they are unscaled and before
the optimizer. So the local statistics are taken on its input (this rank's gradients,
before the all-reduce) and the global norm on its output (after it), and nothing else in
the cell changes: its outputs, the loss-scale overflow check and the update it skips all
stay MindSpore's. The statistics leave the graph through one 4-value parameter
(`mindpulse_grad_stats`: [global norm, local norm, NaN count, Inf count], written each
step, read by the Monitor after it), since a compiled graph has no other side channel;
it is not trainable and is the only thing the wrap adds to the cell's parameters (the
fault scalars only where a fault is injected into this rank).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from .faults import cell_faults_armed
from .grad_stats_kernel import fused_grad_stats_op, reads_dtypes
from .model_params import FAULT_PARAM_PREFIX
from .settings import rank_id
from .train_cell import (
    COUNT_EVERY_STEP_MAX_VALUES,
    STATS_LEN,
    _scale,
    local_grad_stats,
    square_sum,
    square_sum_groups,
)

log = logging.getLogger(__name__)

STATS_PARAM = "mindpulse_grad_stats"


class GradStatsReducer(nn.Cell):
    """The train cell's gradient reducer, with the statistics taken around it.

    `construct(grads)` returns what the wrapped reducer returns; as a side effect the
    parameter `stats` holds [global norm, local norm, NaN count, Inf count] of this step."""

    def __init__(self, reducer: nn.Cell, weights: Any, reducer_flag: bool, fault_armed: bool = False):
        super().__init__(auto_prefix=False)
        self.reducer = reducer
        self.reducer_flag = bool(reducer_flag)
        self.stats = Parameter(Tensor(np.zeros(STATS_LEN, np.float32)), name=STATS_PARAM, requires_grad=False)
        shapes = [tuple(w.shape) for w in weights]
        self.stat_groups = square_sum_groups(shapes)
        self.count_every_step = sum(math.prod(s) for s in shapes) <= COUNT_EVERY_STEP_MAX_VALUES
        dtypes = [w.dtype for w in weights]
        self.stats_op = fused_grad_stats_op() if dtypes and reads_dtypes(dtypes) else None
        self.fused_stats = self.stats_op is not None
        # a gradient fault scales the local gradients before the statistics (as in
        # MonitoredTrainOneStepCell); only in a rank a fault is injected into
        self.fault_armed = bool(fault_armed)
        self.hyper_map = ops.HyperMap()
        if self.fault_armed:
            self.fault_grad_scale = Parameter(Tensor(1.0, ms.float32), name=FAULT_PARAM_PREFIX + "grad_scale",
                                              requires_grad=False)

    def construct(self, grads):
        if self.fault_armed:
            grads = self.hyper_map(ops.partial(_scale, self.fault_grad_scale), grads)
        if self.fused_stats:
            local = self.stats_op(*grads)
            reduced = self.reducer(grads)
            global_norm = self.stats_op(*reduced)[0] if self.reducer_flag else local[0]
            stats = ops.stack([global_norm, local[0], local[1], local[2]])
        else:
            local = local_grad_stats(ms.mutable(grads), self.stat_groups, self.count_every_step)
            reduced = self.reducer(grads)
            global_sq = square_sum(ms.mutable(reduced), self.stat_groups) if self.reducer_flag else local[0]
            stats = ops.stack([ops.sqrt(global_sq), ops.sqrt(local[0]), local[1], local[2]])
        return ops.depend(reduced, ops.assign(self.stats, stats))


class LossFault(nn.Cell):
    """The train cell's loss network, its loss multiplied by a fault scalar (1.0 unless a
    `nan_loss` or `loss_spike` fault is injected): only in a rank a fault is injected into."""

    def __init__(self, network: nn.Cell):
        super().__init__(auto_prefix=False)
        self.network = network
        self.fault_loss_scale = Parameter(Tensor(1.0, ms.float32), name=FAULT_PARAM_PREFIX + "loss_scale",
                                          requires_grad=False)

    def construct(self, *inputs):
        out = self.network(*inputs)
        if isinstance(out, tuple):  # (loss, ...): MindFormers' per-token-loss networks
            return (out[0] * ops.cast(self.fault_loss_scale, out[0].dtype),) + out[1:]
        return out * ops.cast(self.fault_loss_scale, out.dtype)


def find_train_cell(net: Any) -> Any:
    """The cell that owns the gradient reducer and the optimizer (`net` itself, or the
    first such cell inside it); None when there is none (a network without an optimizer)."""
    if not isinstance(net, nn.Cell):
        return None
    if _is_train_cell(net):
        return net
    for _, cell in net.cells_and_names():
        if _is_train_cell(cell):
            return cell
    return None


def _is_train_cell(cell: Any) -> bool:
    return isinstance(getattr(cell, "grad_reducer", None), nn.Cell) and getattr(cell, "optimizer", None) is not None


def probe_of(net: Any) -> GradStatsReducer | None:
    """The statistics wrapper inside `net` (None where there is none)."""
    cell = find_train_cell(net)
    reducer = getattr(cell, "grad_reducer", None) if cell is not None else None
    return reducer if isinstance(reducer, GradStatsReducer) else None


def attach_grad_stats(net: Any, rank: int | None = None) -> str:
    """Wrap the gradient reducer of the train cell in `net` (before its first step); returns
    what was done, for the rank's log: "attached", "already" (our own cell, or wrapped
    before) or why not."""
    from .train_cell import MonitoredTrainOneStepCell

    cell = find_train_cell(net)
    if cell is None:
        return "no train cell (no optimizer and gradient reducer in the network)"
    if isinstance(cell, MonitoredTrainOneStepCell) or isinstance(cell.grad_reducer, GradStatsReducer):
        return "already"
    armed = cell_faults_armed(rank_id() if rank is None else rank)
    if type(cell).__module__.startswith("mindformers.") and not armed:
        # MindFormers' cells return their loss scale, overflow flag and global norm: the Monitor
        # reads those (docs/monitoring.md), a normal run pays no second pass over the gradients
        return f"{type(cell).__name__} is MindFormers' cell: its own outputs are read"
    weights = getattr(cell, "weights", None)
    if weights is None:
        return f"{type(cell).__name__} has no `weights` to take statistics of"
    cell.grad_reducer = GradStatsReducer(cell.grad_reducer, weights, bool(getattr(cell, "reducer_flag", False)),
                                         fault_armed=armed)
    if armed and isinstance(getattr(cell, "network", None), nn.Cell):
        cell.network = LossFault(cell.network)
    return "attached"


def read_stats(probe: GradStatsReducer) -> dict[str, float]:
    """The last step's statistics as the Monitor reports them."""
    v = probe.stats.tolist()
    return {
        "grad_norm": float(v[0]),
        "grad_norm_local": float(v[1]),
        "nan_count": int(v[2]) if math.isfinite(v[2]) else 0,
        "inf_count": int(v[3]) if math.isfinite(v[3]) else 0,
    }
