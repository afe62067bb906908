"""mindpulse's Monitor as a MindFormers callback: `MindPulseMonitor`, registered in MindFormers'
callback registry (a YAML may name it: `callbacks: [{type: MindPulseMonitor}]`; a launch adds
it where the YAML does not), beside MindFormers' own `MFLossMonitor` and `CheckpointMonitor`.

It reads what MindFormers' train cell already returns each step (loss, overflow flag, loss
scale, learning rate, and the global norm MindFormers computes for gradient clipping when
`use_clip_grad` is on): no second pass over the gradients. What it cannot have from there (the
local norm before the all-reduce, NaN/Inf counts) is said in docs/monitoring.md. Importing this
module imports MindFormers (a rank only)."""

from __future__ import annotations

import logging
from typing import Any

from mindformers.tools.register import MindFormerModuleType, MindFormerRegister

from .monitor import Monitor

log = logging.getLogger(__name__)


@MindFormerRegister.register(MindFormerModuleType.CALLBACK)
class MindPulseMonitor(Monitor):
    """`Monitor` for MindFormers' Trainer. Every argument is `Monitor`'s (a YAML's
    `{type: MindPulseMonitor}` gives none: the launch's settings are used).

    `model_shape`: (layers, hidden size, sequence length) of the model, for the decoder's
    FLOPs per token (6N + 12·L·d·s); without it 6N."""

    attach_faults = False
    """Set in a rank a fault is injected into (`--inject`): the train cell MindFormers built gets
    the fault scalars, and with them the gradient statistics (workers/grad_probe.py), before its
    first step. Off otherwise: a normal run makes no second pass over the gradients."""

    def __init__(self, model_shape: tuple[int, int, int] | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.model_shape = model_shape

    def on_train_begin(self, run_context):
        if self.attach_faults:
            from .grad_probe import attach_grad_stats

            done = attach_grad_stats(run_context.original_args().train_network, self.session.rank)
            log.info("[rank %d] fault rehearsal: gradient statistics and fault scalars on MindFormers' train cell: "
                     "%s", self.session.rank, done)
        super().on_train_begin(run_context)
        s = self.session
        try:
            from .flops import decoder_flops_per_token
            from .model_params import model_parameters

            network = s.network
            n_params = sum(int(p.size) for p in network.trainable_params()) if network is not None else 0
            total = sum(int(p.size) for p in model_parameters(network)) if network is not None else 0
            log.info("[rank %d] MindFormers model %s: %d trainable parameters (%d in all)", s.rank,
                     _model_name(network), n_params, total)
            if self.model_shape is not None and s.flops_per_token is None and n_params:
                layers, hidden, seq = self.model_shape
                s.flops_per_token = decoder_flops_per_token(n_params, layers, hidden, seq)
        except Exception as exc:  # the monitor never breaks the training it watches
            s.monitor_error("counting the model's parameters", exc)


def _model_name(network: Any) -> str:
    """The model's class under the cells wrapped around it (MindFormers' DataOrderWrapperCell,
    a fault rehearsal's loss scalar): the innermost `.network`."""
    seen = 0
    while getattr(network, "network", None) is not None and seen < 8:
        network, seen = network.network, seen + 1
    return type(network).__name__
