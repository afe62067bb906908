"""Model FLOPs per token, for the achieved TFLOPS and MFU each rank reports.

Pure arithmetic (MindSpore is only touched to count a network's parameters), so the
formulas are unit-tested by hand.
"""

from __future__ import annotations

from typing import Any


def decoder_flops_per_token(n_params: int, num_layers: int, hidden_size: int, seq_length: int) -> int:
    """Training FLOPs per token of a decoder-only transformer: 6·N + 12·L·d·s.

    6·N: a forward and backward pass over N parameters costs 2 + 4 FLOPs per parameter and
    token (one multiply-add forward, two backward: for the activations and the weights);
    12·L·d·s: the attention scores and their weighted sum (QKᵀ and AV, 2·2·d·s per token and
    layer forward, 3x that with the backward) over a context of s tokens in each of L layers
    of width d. The estimate of PaLM (Chowdhery et al. 2022, appendix B, "6N + 12LHQT" with
    H·Q = d and T = s) and Chinchilla (Hoffmann et al. 2022, appendix F), the one torchtitan,
    Megatron-LM and nanoGPT report MFU with. N counts every parameter (the embedding and the
    output head included, as PaLM's N does); recomputed activations are not counted (model
    FLOPs, not hardware FLOPs).
    """
    return 6 * int(n_params) + 12 * int(num_layers) * int(hidden_size) * int(seq_length)


def params_flops_per_token(n_params: int) -> int:
    """6·N: the parameter term alone, for a model whose shape mindpulse does not know."""
    return 6 * int(n_params)


def trainable_parameters(network: Any) -> int:
    """The number of trainable parameters of a MindSpore cell."""
    return sum(int(p.size) for p in network.trainable_params())


def achieved_tflops(tokens: int, flops_per_token: float, seconds: float | None) -> float | None:
    """tokens x flops per token / seconds / 1e12; None when any is unknown or not positive."""
    if not tokens or not flops_per_token or seconds is None or not seconds > 0 or seconds == float("inf"):
        return None
    return tokens * flops_per_token / seconds / 1e12
