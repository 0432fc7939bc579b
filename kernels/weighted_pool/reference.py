"""PyTorch reference of weighted pooling: one key per window of `r` raw indexer keys.

`learned`: per channel, `w_j = softmax_j(gate_logits_j)` over the window's tokens, pooled key `sum_j w_j k_j`
(gate logits of width 1 give one weight per token for all channels). `mean`: `w_j = 1 / r`.
Both in float32; with all-zero gate logits the two agree exactly for power-of-two `r`.
Norm and RoPE of the pooled key belong to the indexer module (they use its parameters).
"""

import torch


def weighted_pool_torch(window_keys: torch.Tensor, window_gate_logits: torch.Tensor | None) -> torch.Tensor:
    """Pool `[..., r, d]` raw keys into `[..., d]` float32 keys; `window_gate_logits` `[..., r, d]` or `[..., r, 1]`
    (one weight per token), or None (mean)."""
    if window_gate_logits is None:
        return window_keys.float().mean(dim=-2)
    weights = window_gate_logits.float().softmax(dim=-2)
    return (weights * window_keys.float()).sum(dim=-2)
