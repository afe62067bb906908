"""A TrainOneStepCell that also returns the gradient statistics the monitor needs.

Exact signals come from the graph: the global grad norm is computed after the
data-parallel all-reduce (so it is identical on every rank), the local norm and the
NaN/Inf counts before it (so they name the rank that produced a bad gradient).
Works in PYNATIVE and GRAPH mode, in one process and in data parallel.

The statistics cost passes over the gradients and kernel launches, not arithmetic, so
they are built to make as few of both as possible (measured on this repo's 2-core CPU
machine, MindSpore 2.9; see docs/monitoring.md). On CPU one fused kernel of our own
(`grad_stats.cc`, built and loaded by `grad_stats_kernel.py`) does all of it: every
gradient read once where it lies, the counts taken only for a tensor whose sum of squares
is not finite. Elsewhere (Ascend, or where the kernel cannot be built) the graph path:

- a norm is one sum of squares over a few concatenations: the gradients are grouped by
  their trailing shape, each group is concatenated along its first axis (one copy, no
  per-tensor kernels) and reduced with one dot product (one read, no squared temporary);
- a finite sum of squares proves that no gradient element is NaN or Inf, so on large
  gradients the NaN/Inf counts are taken only when the local sum is not finite (a
  data-dependent branch); on small gradients, where counting costs less than the branch
  (~3 ms a step on CPU), they are counted on the concatenated vector every step;
- in one process the reducer is the identity and the global norm is the local one; in
  data parallel it takes a second sum of squares over the reduced gradients.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

from .faults import cell_faults_armed
from .grad_stats_kernel import fused_grad_stats_op, fused_op_unavailable_reason, reads_dtypes
from .model_params import FAULT_PARAM_PREFIX
from .settings import rank_id

# indices into the stats vector returned next to the loss
STAT_GRAD_NORM = 0
STAT_GRAD_NORM_LOCAL = 1
STAT_NAN = 2
STAT_INF = 3
STATS_LEN = 4


_scale = ops.MultitypeFuncGraph("scale")


@_scale.register("Tensor", "Tensor")
def _tensor_scale(s, g):
    return g * ops.cast(s, g.dtype)


COUNT_EVERY_STEP_MAX_VALUES = 400_000
"""Up to this many gradient values the NaN/Inf counts are taken every step (on the
concatenated gradients: measured +0.1 ms at 115 k values, +0.6 ms at 250 k); above it
only when the local sum of squares is not finite, behind a branch that costs ~3 ms a
step in MindSpore 2.9's CPU runtime (its control flow runs without switch inlining
there): about even with counting at 0.5-1 M values, 11 ms saved at 2.75 M."""


def square_sum_groups(shapes: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    """Indices of the gradients (in parameter order) that are concatenated together for
    the sum of squares: tensors of rank 2 and more by their shape past the first axis
    (they concatenate along axis 0 without a reshape each), tensors of rank 0 and 1 in one
    group (flattened). Measured on the larger bench model (39 tensors, 2.75 M values),
    one sum of squares: 3 groups 2.9-3.8 ms, one flat concatenation 4.8-6.1 ms, a dot
    product per tensor 7.4-8.1 ms, per-tensor `reduce_sum(square)` 17 ms."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, shape in enumerate(shapes):
        key = tuple(int(d) for d in shape[1:]) if len(shape) > 1 else ()
        groups.setdefault(key, []).append(i)
    return tuple(tuple(v) for v in groups.values())


def _group_vectors(grads, groups):
    """One float32 vector per group (a concatenation, or a reshape for a lone tensor)."""
    out = []
    for idx in groups:
        if len(idx) == 1:
            v = ops.reshape(ops.cast(grads[idx[0]], ms.float32), (-1,))
        elif len(grads[idx[0]].shape) > 1:
            v = ops.reshape(ops.cat([ops.cast(grads[i], ms.float32) for i in idx]), (-1,))
        else:
            v = ops.cat([ops.reshape(ops.cast(grads[i], ms.float32), (-1,)) for i in idx])
        out.append(v)
    return out


def _square_sum(grads, groups):
    parts = [ops.tensor_dot(v, v, 1) for v in _group_vectors(grads, groups)]
    if not parts:
        return ops.zeros((), ms.float32)
    if len(parts) == 1:
        return parts[0]
    return ops.addn(parts)


def _count(mask):
    return ops.reduce_sum(ops.cast(mask, ms.float32))


def _nan_inf_counts(grads):
    return ops.addn([_count(ops.isnan(g)) for g in grads]), ops.addn([_count(ops.isinf(g)) for g in grads])


# Compiled once, even in PYNATIVE mode: eagerly every kernel costs a host dispatch
# (measured: ~0.3 s a step for 20 parameters on CPU with per-parameter reductions).
# `groups` and `count_every_step` are constants (from the weights' shapes): in GRAPH mode
# these functions are inlined into the step's graph.
@ms.jit
def local_grad_stats(grads, groups, count_every_step):
    """[sum of squares, NaN count, Inf count] over all gradients. With `count_every_step`
    the counts are taken on the concatenated gradients; otherwise only when the sum of
    squares is not finite (a finite sum proves there is nothing to count)."""
    if not groups:  # nothing to train
        return ops.zeros((3,), ms.float32)
    if count_every_step:
        vs = _group_vectors(grads, groups)
        v = vs[0] if len(vs) == 1 else ops.cat(vs)
        sq = ops.tensor_dot(v, v, 1)
        return ops.stack([sq, _count(ops.isnan(v)), _count(ops.isinf(v))])
    sq = _square_sum(grads, groups)
    nan = ops.zeros((), ms.float32)
    inf = ops.zeros((), ms.float32)
    if not ops.isfinite(sq):
        nan, inf = _nan_inf_counts(grads)
    return ops.stack([sq, nan, inf])


@ms.jit
def square_sum(grads, groups):
    """Sum of squares over all gradients."""
    return _square_sum(grads, groups)


class MonitoredTrainOneStepCell(nn.TrainOneStepCell):
    """`TrainOneStepCell` returning `(loss, stats)`.

    `stats` is a float32 vector: [global grad norm (after the all-reduce), local grad
    norm (before it), NaN count, Inf count] of this rank's gradients. Keeping the
    statistics in one tensor costs one device-to-host copy per step.

    Two scalar parameters (not trainable, not saved) let the fault injector corrupt the
    real computation in the real rank: `mindpulse_fault_loss_scale` multiplies the loss
    and its gradients, `mindpulse_fault_grad_scale` multiplies the local gradients
    before the reduction. Both are 1.0 unless a fault is injected.

    `stats_kernel`: "auto" (the default) computes the statistics with the fused kernel
    where it runs (CPU, a C++ compiler to build it once, floating-point gradients) and with
    graph ops otherwise; "fused" insists on the kernel (an error says why it cannot run);
    "graph" always uses graph ops. The same statistics either way, except that the fused
    kernel sums squares in double: finite gradients whose squares overflow float32 give a
    finite norm there and an Inf norm (with zero counts) on the graph path.

    `count_every_step` (graph path): take the NaN/Inf counts every step (True) or only when
    the local sum of squares is not finite (False); None, the default, decides by the
    number of gradient values (`COUNT_EVERY_STEP_MAX_VALUES`). Both give the same statistics.
    """

    def __init__(self, network: nn.Cell, optimizer: nn.Optimizer, sens: float | None = None,
                 fault_armed: bool | None = None, count_every_step: bool | None = None,
                 stats_kernel: str = "auto"):
        super().__init__(network, optimizer, sens)
        # the scaling ops are only in the graph when a fault may be injected in this rank
        # (known at launch, from the run's settings): a normal run pays nothing for them
        if fault_armed is None:
            fault_armed = cell_faults_armed(rank_id())
        self.fault_armed = bool(fault_armed)
        self.hyper_map = ops.HyperMap()
        self.fault_loss_scale = Parameter(
            Tensor(1.0, ms.float32), name=FAULT_PARAM_PREFIX + "loss_scale", requires_grad=False
        )
        self.fault_grad_scale = Parameter(
            Tensor(1.0, ms.float32), name=FAULT_PARAM_PREFIX + "grad_scale", requires_grad=False
        )
        # constants of the statistics: which gradients are concatenated together for the sums
        # of squares, and whether the NaN/Inf counts are cheap enough to take every step
        shapes = [tuple(w.shape) for w in self.weights]
        self.stat_groups = square_sum_groups(shapes)
        if count_every_step is None:
            count_every_step = sum(math.prod(s) for s in shapes) <= COUNT_EVERY_STEP_MAX_VALUES
        self.count_every_step = bool(count_every_step)
        self.stats_op = self._choose_stats_op(stats_kernel)
        self.fused_stats = self.stats_op is not None

    def _choose_stats_op(self, stats_kernel: str):
        if stats_kernel not in ("auto", "fused", "graph"):
            raise ValueError(f"stats_kernel must be 'auto', 'fused' or 'graph', not {stats_kernel!r}")
        if stats_kernel == "graph":
            return None
        dtypes = [w.dtype for w in self.weights]
        if not dtypes or not reads_dtypes(dtypes):
            why = "nothing to train" if not dtypes else f"gradient dtypes {sorted({str(d) for d in dtypes})}"
            if stats_kernel == "fused":
                raise ValueError(f"stats_kernel='fused' cannot read these gradients ({why}); use 'auto' or 'graph'")
            return None
        op = fused_grad_stats_op()
        if op is None and stats_kernel == "fused":
            why = fused_op_unavailable_reason()
            raise RuntimeError(f"stats_kernel='fused': the fused kernel cannot run here ({why}); use 'auto' or 'graph'")
        return op

    def enable_pre_reduce_timing(self) -> bool:
        """PYNATIVE only: time-stamp the moment the local gradients are ready, just before
        the all-reduce (a forward pre-hook on the gradient reducer, after a device sync).
        `pre_reduce_ts` then holds that `time.perf_counter()` value for the last step.
        GRAPH mode compiles the whole step, so there is no such point to observe."""
        import time

        if ms.get_context("mode") != ms.PYNATIVE_MODE or getattr(self, "_timing_on", False):
            return getattr(self, "_timing_on", False)
        self.pre_reduce_ts = None

        self.capture_grads = None
        self.captured_grads = None
        names = [w.name for w in self.weights]

        def _mark(cell, inputs):
            try:
                ms.runtime.synchronize()
            except Exception:  # best effort: without the sync the timing only includes queued work
                pass
            self.pre_reduce_ts = time.perf_counter()
            wanted = self.capture_grads
            if wanted:  # histograms of a few layers' local gradients (collect steps only)
                try:
                    grads = inputs[0]
                    self.captured_grads = {n: g.asnumpy() for n, g in zip(names, grads) if n in wanted}
                except Exception:  # histograms are optional: none this step rather than a failed step
                    self.captured_grads = None
                self.capture_grads = None

        try:
            self.grad_reducer.register_forward_pre_hook(_mark)
        except Exception:  # no hook on this reducer: no reduce timing, training unchanged
            return False
        self._timing_on = True
        return True

    def construct(self, *inputs):
        loss = self.network(*inputs)
        sens = ops.fill(loss.dtype, loss.shape, self.sens)
        if self.fault_armed:
            scale = ops.cast(self.fault_loss_scale, loss.dtype)
            sens = sens * scale
            loss = loss * scale
        grads = self.grad(self.network, self.weights)(*inputs, sens)
        if self.fault_armed:
            grads = self.hyper_map(ops.partial(_scale, self.fault_grad_scale), grads)
        if self.fused_stats:  # one kernel: [norm, NaN count, Inf count] of the local gradients
            local = self.stats_op(*grads)
            grads = self.grad_reducer(grads)
            # data parallel: the norm of the all-reduced gradients; else the reducer is the identity
            global_norm = self.stats_op(*grads)[0] if self.reducer_flag else local[0]
            stats = ops.stack([global_norm, local[0], local[1], local[2]])
        else:
            # mutable: without it the tuple is a compile-time constant and recompiles every step
            local = local_grad_stats(ms.mutable(grads), self.stat_groups, self.count_every_step)
            grads = self.grad_reducer(grads)
            if self.reducer_flag:  # data parallel: the norm of the all-reduced gradients
                global_sq = square_sum(ms.mutable(grads), self.stat_groups)
            else:  # the reducer is the identity: the global norm is the local one
                global_sq = local[0]
            stats = ops.stack([ops.sqrt(global_sq), ops.sqrt(local[0]), local[1], local[2]])
        loss = ops.depend(loss, self.optimizer(grads))
        return loss, stats


def _scalar(x) -> float | None:
    """A one-value tensor (or number) as a float; None for anything else."""
    if isinstance(x, Tensor):
        return float(x.item()) if x.size == 1 else None
    if isinstance(x, (int, float, bool)):
        return float(x)
    return None


def _loss_scale_outputs(outputs) -> dict[str, float | bool]:
    """A loss-scale cell's outputs: MindSpore's `TrainOneStepWithLossScaleCell` returns
    (loss, overflow flag, loss scale); MindFormers' train cells (loss, overflow, loss scale,
    learning rate[, global norm]) — the norm MindFormers computes for its gradient clipping,
    after the all-reduce. Anything else: nothing."""
    if len(outputs) < 3:
        return {}
    flag, scale = outputs[1], outputs[2]
    if not (isinstance(flag, Tensor) and flag.dtype == ms.bool_ and flag.size == 1):
        return {}
    scale_v = _scalar(scale)
    if scale_v is None:
        return {}
    out: dict[str, float | bool] = {"overflow": bool(flag.item()), "loss_scale": scale_v}
    if len(outputs) >= 4 and (lr := _scalar(outputs[3])) is not None:
        out["lr"] = lr
    if len(outputs) >= 5 and (gn := _scalar(outputs[4])) is not None:
        out["grad_norm"] = gn
    return out


def split_outputs(outputs) -> tuple[float | None, dict[str, float]]:
    """Network outputs of one step → (loss, stats dict). Accepts our cell's output,
    a plain loss tensor, or a tuple whose first element is the loss (MindSpore's
    convention), with the overflow flag and loss scale of a loss-scale cell."""
    stats: dict[str, float] = {}
    loss_t = outputs
    if isinstance(outputs, (tuple, list)):
        loss_t = outputs[0] if outputs else None
        stats.update(_loss_scale_outputs(outputs))
        if len(outputs) == 2 and isinstance(outputs[1], Tensor) and outputs[1].shape == (STATS_LEN,):
            # tolist(), not asnumpy(): the same float32 values as Python floats, without the
            # buffer-format parsing asnumpy() pays in numpy (~4 us a call, every step)
            v = outputs[1].tolist()
            stats = {
                "grad_norm": float(v[STAT_GRAD_NORM]),
                "grad_norm_local": float(v[STAT_GRAD_NORM_LOCAL]),
                "nan_count": int(v[STAT_NAN]) if math.isfinite(v[STAT_NAN]) else 0,
                "inf_count": int(v[STAT_INF]) if math.isfinite(v[STAT_INF]) else 0,
            }
    loss = None
    if isinstance(loss_t, Tensor):
        if loss_t.size == 1:  # the usual scalar loss: one value, read without an array
            return float(loss_t.item()), stats
        arr = loss_t.asnumpy()
        loss = float(arr.reshape(-1).mean()) if arr.size else None
    elif isinstance(loss_t, (int, float)):
        loss = float(loss_t)
    return loss, stats
