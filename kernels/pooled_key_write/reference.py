"""PyTorch reference of the pooled-key write: one step's pooled indexer keys into vLLM's paged pooled-key cache.

Each token of a step pools its window of `r` raw indexer keys (the window's rows come from this step's rows or, for
the window's tokens of earlier steps, from the open-window ring), normalises the pooled key, rotates it at the
window's first position and stores it, in the model's dtype or as packed fp8 (`fp8_index_keys`), at its row of the
pooled-key cache. What the serving layer computed inline (`IndexPoolAttention.attend`, `IndexPoolIndexer.pool`,
`write_rows`), in the same dtypes, step by step:

    rows   = step_rows[window_token] where window_token >= 0, else ring_cache[window_ring_block]   [tokens, r, d + g]
    pooled = norm(pool(rows[..., :d], rows[..., d:] + slot_bias))      (`prenorm_mean`: pool(norm(keys)))
    key    = neox_rotary(pooled, cos_sin_cache[window_start])
    cache[write_block, write_row] = key[write_token]                   (where write_keep)

Nothing here reads a device value on the host: a step's write can be captured in a CUDA graph.
"""

import torch

from ..fp8_index_keys import is_packed, quantize_pooled_keys
from ..weighted_pool.reference import weighted_pool_torch

WEIGHTINGS = ("learned", "learned_scalar", "mean", "prenorm_mean")


def gate_width_of(weighting: str, head_dim: int) -> int:
    """Pooling-gate logits per token: one per channel (`learned`), one per token (`learned_scalar`), none (means)."""
    if weighting not in WEIGHTINGS:
        raise ValueError(f"Unknown pooling weighting {weighting!r}; use one of {list(WEIGHTINGS)}.")
    return {"learned": head_dim, "learned_scalar": 1}.get(weighting, 0)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """vLLM's GemmaRMSNorm over the last dimension: `x * rsqrt(mean(x^2) + eps) * (1 + weight)` in float32, back in
    `x`'s dtype."""
    hidden = x.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return (hidden * (weight.float() + 1)).to(x.dtype)


def neox_rotary(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first `rotary_dim` channels of `x` `[tokens, ..., dim]` (non-interleaved halves); `cos_sin`
    `[tokens, rotary_dim]` is vLLM's cache row (cosines, then sines) at each token's position. Every product and sum
    in `x`'s dtype, as the serving layer's `apply_neox_rotary` computes them."""
    cos, sin = cos_sin.to(x.dtype).chunk(2, dim=-1)
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    rotary_dim = 2 * cos.shape[-1]
    first, second = x[..., : rotary_dim // 2], x[..., rotary_dim // 2: rotary_dim]
    rotated = torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
    return torch.cat([rotated, x[..., rotary_dim:]], dim=-1)


def pool_window_rows(window_rows: torch.Tensor, norm_weight: torch.Tensor, norm_eps: float,
                     slot_bias: torch.Tensor | None, weighting: str) -> torch.Tensor:
    """`[windows, r, d + gate_width]` rows (raw key, gate logits) -> pooled keys `[windows, d]`, normed, in the rows'
    dtype (before RoPE): the indexer's `pool`."""
    head_dim = norm_weight.shape[0]
    keys = window_rows[..., :head_dim]
    if weighting == "prenorm_mean":
        return weighted_pool_torch(gemma_rms_norm(keys, norm_weight, norm_eps), None).to(keys.dtype)
    logits = None
    if gate_width_of(weighting, head_dim):
        logits = window_rows[..., head_dim:].float() + slot_bias.float()
    return gemma_rms_norm(weighted_pool_torch(keys, logits).to(keys.dtype), norm_weight, norm_eps)


def gather_window_rows(step_rows: torch.Tensor, ring_cache: torch.Tensor, window_token: torch.Tensor,
                       window_ring_block: torch.Tensor) -> torch.Tensor:
    """`[tokens, r, d + gate_width]` the rows of every token's window in `step_rows`' dtype: this step's rows where
    `window_token >= 0`, else its request's ring rows (arguments as in `write_pooled_keys_torch`)."""
    from_step = window_token >= 0
    return torch.where(from_step[..., None], step_rows[window_token.clamp(min=0)],
                       ring_cache[window_ring_block, :, 0].to(step_rows.dtype))


def check_write_arguments(pooled_key_cache, step_rows, ring_cache, window_token, cos_sin_cache, norm_weight,
                          slot_bias, weighting) -> None:
    """Shapes and settings that must agree (host-side checks of shapes only)."""
    head_dim, pool_size = norm_weight.shape[0], window_token.shape[1]
    gate_width = gate_width_of(weighting, head_dim)
    if step_rows.shape[-1] != head_dim + gate_width or ring_cache.shape[-1] != head_dim + gate_width:
        raise ValueError(f"Rows of {step_rows.shape[-1]} (step) and {ring_cache.shape[-1]} (ring) channels, expected "
                         f"{head_dim} + {gate_width} for {weighting!r} pooling.")
    if ring_cache.shape[1] != pool_size:
        raise ValueError(f"The ring holds {ring_cache.shape[1]} rows per request, the windows {pool_size}.")
    if (slot_bias is None) != (gate_width == 0) or (slot_bias is not None and
                                                    tuple(slot_bias.shape) != (pool_size, gate_width)):
        raise ValueError(f"{weighting!r} pooling needs a slot bias of [{pool_size}, {gate_width}]"
                         if gate_width else f"{weighting!r} pooling has no slot bias.")
    rotary_dim = cos_sin_cache.shape[-1]
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"A rotary dimension of {rotary_dim} does not fit keys of {head_dim}.")
    width = pooled_key_cache.shape[-1]
    if width != (head_dim + 4 if is_packed(pooled_key_cache) else head_dim):
        raise ValueError(f"Pooled-key cache rows of {width} for keys of {head_dim}.")


def write_pooled_keys_torch(
    pooled_key_cache: torch.Tensor,
    step_rows: torch.Tensor,
    ring_cache: torch.Tensor,
    window_token: torch.Tensor,
    window_ring_block: torch.Tensor,
    window_start: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_eps: float,
    slot_bias: torch.Tensor | None,
    weighting: str,
    write_token: torch.Tensor,
    write_block: torch.Tensor,
    write_row: torch.Tensor,
    write_keep: torch.Tensor,
) -> None:
    """Pool every token's window and store the pooled keys in vLLM's paged pooled-key cache, in place.

    Args:
        pooled_key_cache: `[blocks, block_size // r, 1, d]` (any float dtype), or packed fp8 keys
            `uint8 [blocks, block_size // r, 1, d + 4]` (`quantize_pooled_keys` of the rotated key).
        step_rows: `[tokens, d + gate_width]` this step's raw indexer keys and gate logits (the model's dtype, in
            which everything is computed).
        ring_cache: `[blocks, r, 1, d + gate_width]` the open-window ring, token `p` at row `p % r` of its request's
            block; read only (its write for this step comes after, in the caller).
        window_token: `[tokens, r]` integer: this step's token holding each row of the token's window, or `-1`
            (the row comes from the ring).
        window_ring_block: `[tokens]` integer: the ring block of the token's request.
        window_start: `[tokens]` integer: the first position of the token's window (its RoPE position).
        cos_sin_cache: `[max_positions, rotary_dim]` vLLM's rotary cache, cosines then sines.
        norm_weight: `[d]` the key norm's weight (GemmaRMSNorm: scaled by `1 + weight`); `norm_eps` its epsilon.
        slot_bias: `[r, gate_width]` added to the gate logits, or None without gates.
        weighting: `learned` (a gate logit per channel), `learned_scalar` (one per token), `mean` or
            `prenorm_mean` (mean of the normed keys).
        write_token: `[tokens]` integer: whose pooled key token `t` writes (its window's last token in the step).
        write_block, write_row: `[tokens]` integer: the destination row of the cache.
        write_keep: `[tokens]` bool: False leaves the destination as it is.
    """
    check_write_arguments(pooled_key_cache, step_rows, ring_cache, window_token, cos_sin_cache, norm_weight,
                          slot_bias, weighting)
    rows = gather_window_rows(step_rows, ring_cache, window_token, window_ring_block)
    pooled = pool_window_rows(rows, norm_weight, norm_eps, slot_bias, weighting)
    keys = neox_rotary(pooled, cos_sin_cache[window_start])
    new = keys[write_token]
    new = quantize_pooled_keys(new) if is_packed(pooled_key_cache) else new.to(pooled_key_cache.dtype)
    old = pooled_key_cache[write_block, write_row, 0]
    pooled_key_cache[write_block, write_row, 0] = torch.where(write_keep[:, None], new, old)
