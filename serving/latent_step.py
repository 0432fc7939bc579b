"""The IndexPool step of an MLA layer (GLM-5.3-Flash's sparse attention) over vLLM's paged caches, in plain tensors:
nothing here imports vLLM.

The vLLM layer (`vllm_mla.py`) wraps it; the main test suite runs it on CPU. An MLA layer caches one normed latent of
`kv_lora_rank` per token, the layout vLLM gives MLA (`[blocks, 1, block_size, kv_lora_rank]`, one "head"), and attends
in the absorbed form: every query head, with `W_k^h` folded in, scores the latents themselves, and the attended
latent goes through `W_v^h` afterwards (`vllm_mla.py`). The latents are both keys and values, so the step reads each
selected window once for all heads.

A layer with its own indexer also keeps the pooled-key cache and the open-window ring of the GQA layer
(`paged_step.py`), with GLM's indexer: every token's key is LayerNorm-ed before it enters the ring, and a window is
pooled from those normed keys with no norm and no RoPE after (GLM's indexer is NoPE). A shared-indexer layer keeps
neither: it attends to the windows the full layer before it selected for the same tokens in the same step.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kernels.fp8_index_keys import is_packed, quantize_pooled_keys
from ..kernels.pooled_key_write import gather_window_rows
from ..kernels.sparse_attention import paged_sparse_attention
from ..kernels.weighted_pool.reference import weighted_pool_torch
from .paged_step import PagedCacheMetadata, ring_windows, select_windows, write_rows


@dataclass
class LatentCaches:
    """One MLA IndexPool layer's paged caches: latents `[blocks, 1, block_size, kv_lora_rank]`; pooled keys and the
    open-window ring as in `paged_step.PagedCaches` (None in a shared-indexer layer)."""

    latent: torch.Tensor
    pooled_keys: torch.Tensor | None = None
    open_window: torch.Tensor | None = None


@dataclass
class LatentStepSettings:
    """The layer's sizes and the parameters its step reads besides the projections' outputs."""

    pool_size: int
    topk_windows: int  # windows selected per query
    sink_windows: int
    local_windows: int
    scaling: float  # of the attention's scores: `qk_head_dim ** -0.5`
    weighting: str  # the indexer's pooling: `learned`, `learned_scalar` or `mean` (None in a shared layer)
    pool_slot_bias: torch.Tensor | None  # [r, gate_width] with learned pooling


def write_prenormed_pooled_keys(pooled_key_cache: torch.Tensor, ring_rows: torch.Tensor, ring_cache: torch.Tensor,
                                ring: PagedCacheMetadata, pooled: PagedCacheMetadata, settings: LatentStepSettings,
                                head_dim: int) -> None:
    """Pool every token's window of already normed keys (`ring_rows [tokens, head_dim + gate_width]`: normed key,
    gate logits) and store it, with no norm and no RoPE after, at the token's pooled-key row; packed in fp8 when the
    cache is. The ring must be written after this call (its rows of earlier steps are read here). No host read."""
    windows, window_ring_block = ring_windows(ring_cache, settings.pool_size, ring.window_ring_row)
    rows = gather_window_rows(ring_rows, windows, ring.window_token, window_ring_block)
    logits = None
    if settings.pool_slot_bias is not None:
        logits = rows[..., head_dim:].float() + settings.pool_slot_bias.float()
    keys = weighted_pool_torch(rows[..., :head_dim], logits).to(ring_rows.dtype)
    new = keys[pooled.write_token]
    new = quantize_pooled_keys(new) if is_packed(pooled_key_cache) else new.to(pooled_key_cache.dtype)
    old = pooled_key_cache[pooled.write_block, pooled.write_row, 0]
    pooled_key_cache[pooled.write_block, pooled.write_row, 0] = torch.where(pooled.write_keep[:, None], new, old)


def latent_indexpool_step(absorbed_query: torch.Tensor, latent: torch.Tensor, index_queries: torch.Tensor | None,
                          ring_rows: torch.Tensor | None, head_weights: torch.Tensor | None, selection: torch.Tensor,
                          caches: LatentCaches, main: PagedCacheMetadata, pooled: PagedCacheMetadata | None,
                          ring: PagedCacheMetadata | None, settings: LatentStepSettings) -> torch.Tensor:
    """One MLA IndexPool step of every request at once: write the new latents; in a layer with its own indexer, pool
    every token's window into the pooled-key cache, keep the last `r` normed keys in the ring, select each query's
    windows and record them in `selection` (in place); in a shared layer, read the selection from `selection`; then
    attend to the selected windows and the open window.

    `absorbed_query [tokens, heads, kv_lora_rank]` (queries with `W_k^h` folded in), `latent [tokens, kv_lora_rank]`
    (normed), `index_queries [tokens, index_heads, index_head_dim]`, `ring_rows [tokens, index_head_dim +
    gate_width]` (LayerNorm-ed keys, gate logits), `head_weights [tokens, index_heads]` float32 or None (all three
    None in a shared layer), `selection [tokens, topk_windows]` int64 (ascending window ids, -1 after the last) ->
    the attended latents `[tokens, heads, kv_lora_rank]`.
    """
    write_rows(caches.latent[:, 0], main, latent)
    if index_queries is not None:
        head_dim = index_queries.shape[-1]
        write_prenormed_pooled_keys(caches.pooled_keys, ring_rows, caches.open_window, ring, pooled, settings,
                                    head_dim)
        write_rows(caches.open_window[:, :, 0], ring, ring_rows)  # after the pooling, which read its earlier rows
        selected = select_windows(index_queries, head_weights, caches, main, pooled, settings)
        # Within the budget the selection is every visible window, fewer columns than the budget: -1 after them.
        selection.copy_(F.pad(selected, (0, selection.shape[-1] - selected.shape[-1]), value=-1))
    return paged_sparse_attention(absorbed_query, caches.latent, caches.latent, main.block_table, main.token_request,
                                  selection, main.token_position, settings.pool_size, settings.scaling,
                                  request_tiles=main.request_tiles)
