"""MindSpore and MindFormers training on CPU: the two Ascend-only operations they run, replaced.

1. The loss-scale train cell's overflow check (`enable_cpu_overflow_check`).
2. The communication barrier MindFormers runs between ranks (`enable_cpu_barrier`).

Overflow: IsFinite, not the NPU float status.

`nn.TrainOneStepWithLossScaleCell` (and every MindFormers train cell built on it:
`MFTrainOneStepCell`, `MFPipelineWithLossScaleCell`) picks its overflow check in
`get_overflow_status` from three flags it reads in `__init__`: GPU, Ascend 910B, and "else",
which it takes for Ascend 910A. On CPU all three flags are false, so the cell takes the 910A
branch: `NPUGetFloatStatusV2`/`NPUClearFloatStatusV2`, which have Ascend kernels only, and
graph compilation fails with "Unsupported op [NPUGetFloatStatusV2] on CPU".

`enable_cpu_overflow_check()` gives the cell, in a CPU process, the check MindSpore itself runs
on Ascend 910B in "infnan" mode when the fused AllFinite kernel is off: IsFinite on every
gradient, the per-gradient flags summed, that sum all-reduced over the data-parallel group when
the cell is distributed, overflow = sum >= 1 (MindSpore's own
`_get_distributed_overflow_status_on_infnan_mode` with its `_ascend_grad_overflow`). IsFinite,
AddN and AllReduce have CPU kernels. Nothing else changes: the cell still skips the optimizer
step on overflow and the loss-scale manager (e.g. `DynamicLossScaleUpdateCell`) still halves or
grows the scale from the same flag.

The patch is made on the base class, at its two documented overflow hooks
(`start_overflow_check`, `get_overflow_status`), so the cells derived from it get it too; it is
made only when MindSpore's device target is CPU, and a process's device target cannot change
once its runtime has started, so no Ascend or GPU cell ever sees it.

Barrier: MindFormers synchronises data-parallel ranks with MindSpore's
`communication.comm_func.barrier` (after preloading the checkpoint when use_parallel is on, and
around checkpoint conversion and resuming), which runs the `Barrier` primitive: it has no CPU
kernel ("Unsupported op [Barrier] on CPU"). `enable_cpu_barrier()` makes that function, in a
CPU process, an all-reduce of one number over the group, read back on the host: no rank
returns before every rank of the group has called it, which is what a barrier is. AllReduce
has a CPU kernel (MindSpore's mccl).
"""

from __future__ import annotations

import sys
from typing import Any

import mindspore as ms
from mindspore import nn, ops
from mindspore.common import dtype as mstype
from mindspore.communication import GlobalComm
from mindspore.communication import comm_func as _comm_func
from mindspore.nn.wrap import loss_scale as _loss_scale

# what the patch reuses from MindSpore's loss-scale module: the 910B infnan path's helper and
# its per-gradient IsFinite function (both private: checked before patching)
_INFNAN_HELPER = "_get_distributed_overflow_status_on_infnan_mode"
_ISFINITE_FUNC = "_ascend_grad_overflow"

_ascend_grad_overflow = getattr(_loss_scale, _ISFINITE_FUNC, None)


def _cpu_start_overflow_check(self: Any, pre_cond: Any, compute_input: Any) -> tuple[Any, Any]:
    """CPU: there is no float-status register to clear; the status is unused (IsFinite reads
    the gradients themselves). Same outputs as MindSpore's GPU/910B path."""
    status = ms.Tensor([0] * 8, mstype.int32)
    return status, compute_input


def _cpu_get_overflow_status(self: Any, status: Any, compute_output: Any) -> Any:
    """CPU: MindSpore's Ascend 910B infnan check without AllFinite: IsFinite over the
    gradients, flags summed, all-reduced over the group when distributed, overflow = sum >= 1."""
    return self._get_distributed_overflow_status_on_infnan_mode(_ascend_grad_overflow, compute_output)


def _device_target() -> str:
    return str(ms.get_context("device_target"))


def _check_mindspore_layout() -> None:
    """The patch calls MindSpore internals: say which one is missing instead of failing at graph
    compile time with a less clear message."""
    if _ascend_grad_overflow is None:
        raise RuntimeError(f"mindspore {ms.__version__}: mindspore.nn.wrap.loss_scale has no {_ISFINITE_FUNC}; "
                           "the CPU overflow check (mindpulse.workers.cpu_fallbacks) needs updating")
    if not hasattr(nn.TrainOneStepWithLossScaleCell, _INFNAN_HELPER):
        raise RuntimeError(f"mindspore {ms.__version__}: TrainOneStepWithLossScaleCell has no {_INFNAN_HELPER}; "
                           "the CPU overflow check (mindpulse.workers.cpu_fallbacks) needs updating")


def is_enabled() -> bool:
    """Whether this process's loss-scale cells use the CPU overflow check."""
    return nn.TrainOneStepWithLossScaleCell.__dict__.get("get_overflow_status") is _cpu_get_overflow_status


def enable_cpu_overflow_check() -> bool:
    """In a CPU process, make `nn.TrainOneStepWithLossScaleCell` and the cells derived from it
    detect overflow with IsFinite + all-reduce (module docstring). Call it once the device
    target is set (after MindFormers' `build_context`) and before the train cell is compiled;
    calling it again does nothing. Returns whether the CPU check is in place: False (and no
    change) when the device target is not CPU."""
    if _device_target() != "CPU":
        return False
    if is_enabled():
        return True
    _check_mindspore_layout()
    cell = nn.TrainOneStepWithLossScaleCell
    cell.start_overflow_check = _cpu_start_overflow_check
    cell.get_overflow_status = _cpu_get_overflow_status
    return True


def _cpu_barrier(group: str | None = None) -> None:
    """CPU: MindSpore's barrier as an all-reduce of one number over `group` (default: the
    world group), read back so that the call returns only once every rank has joined."""
    group = GlobalComm.WORLD_COMM_GROUP if group is None else group
    if not isinstance(group, str):
        raise TypeError(f"group must be type of string, but got {type(group)}")
    ops.AllReduce(group=group)(ms.Tensor([1.0], mstype.float32)).asnumpy()


_ORIGINAL_BARRIER = _comm_func.barrier


def enable_cpu_barrier() -> bool:
    """In a CPU process, make MindSpore's `comm_func.barrier` (and the modules that imported
    it by name: MindFormers' trainer utilities, callbacks, checkpoint loading) run the
    all-reduce barrier (module docstring). Modules imported later take the fallback by name;
    those imported before are rebound here. Calling it again does nothing. Returns whether the
    CPU barrier is in place: False (and no change) when the device target is not CPU."""
    if _device_target() != "CPU":
        return False
    _comm_func.barrier = _cpu_barrier
    for name, module in list(sys.modules.items()):
        if name.partition(".")[0] in ("mindformers", "mindspore") and \
                getattr(module, "barrier", None) is _ORIGINAL_BARRIER:
            module.barrier = _cpu_barrier
    return True


def enable_cpu_fallbacks(barrier: bool = True) -> None:
    """Both fallbacks (each does nothing unless the device target is CPU): the loss-scale
    overflow check, and with `barrier` the barrier. Call before MindFormers is imported or after:
    modules that take `barrier` by name later get the fallback, those that took it before are
    rebound."""
    enable_cpu_overflow_check()
    if barrier:
        enable_cpu_barrier()
