"""Which parameters are the model's: every weight but the fault-injection scalars.

A leaf module (no mindpulse import, no MindSpore import) so that the train cell, the
fingerprint, the fault injector and the checkpoint writer all agree on it without
importing each other.
"""

from __future__ import annotations

from typing import Any

FAULT_PARAM_PREFIX = "mindpulse_fault_"
"""Names of the train cell's fault-injection scalars; they are not model weights and never saved."""


def is_model_param(name: str) -> bool:
    return not name.startswith(FAULT_PARAM_PREFIX)


def model_parameters(network: Any) -> list:
    """The weights that define the model (trainable and not, e.g. norms' statistics),
    without optimizer state and without the fault-injection scalars."""
    out = []
    seen = set()
    for p in network.get_parameters():
        if p.name in seen or not is_model_param(p.name):
            continue
        seen.add(p.name)
        out.append(p)
    return out
