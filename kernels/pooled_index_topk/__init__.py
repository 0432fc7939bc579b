"""Pooled index score + top-k window selection behind one entry point: Triton on CUDA, the compiled CPU kernel
for decode-sized selections on CPU, the PyTorch reference otherwise. `paged_pooled_index_topk` is the same selection
for a serving step over vLLM's paged pooled-key cache (Triton on CUDA, the same CPU kernel reading the pages in place
on CPU)."""

from ..dispatch import use_fast_path
from .cpu_impl import fused_topk_applies, paged_pooled_index_topk_cpu, paged_topk_applies, pooled_index_topk_cpu
from .reference import paged_pooled_index_topk_torch, pooled_index_scores_torch, pooled_index_topk_torch

try:
    from .triton_impl import paged_pooled_index_topk_triton, pooled_index_topk_triton
except ImportError:  # no Triton: the PyTorch path serves every device
    pooled_index_topk_triton = paged_pooled_index_topk_triton = None


def _check_forced(sink_windows, local_windows, topk):
    if sink_windows < 0 or local_windows < 0 or sink_windows + local_windows > topk:
        raise ValueError(f"sink_windows ({sink_windows}) and local_windows ({local_windows}) must be >= 0 and fit in "
                         f"topk ({topk}) together.")


def pooled_index_topk(index_queries, pooled_index_keys, num_visible_windows, topk, head_weights=None,
                      window_limit=None, sink_windows=0, local_windows=0):
    """Select each query's `topk` best visible windows (Triton on CUDA; on CPU the compiled kernel for a few
    queries without `window_limit`, PyTorch otherwise); see
    `pooled_index_topk_torch` for shapes, `window_limit` and the always-selected sink and local windows."""
    _check_forced(sink_windows, local_windows, topk)
    if pooled_index_topk_triton is not None and use_fast_path(index_queries, pooled_index_keys):
        return pooled_index_topk_triton(index_queries, pooled_index_keys, num_visible_windows, topk, head_weights,
                                        window_limit=window_limit, sink_windows=sink_windows,
                                        local_windows=local_windows)
    if window_limit is None and fused_topk_applies(index_queries.shape[1] * index_queries.shape[2], pooled_index_keys):
        return pooled_index_topk_cpu(index_queries, pooled_index_keys, num_visible_windows, topk, head_weights,
                                     sink_windows, local_windows)
    return pooled_index_topk_torch(index_queries, pooled_index_keys, num_visible_windows, topk, head_weights,
                                   window_limit, sink_windows, local_windows)


def paged_pooled_index_topk(index_queries, pooled_key_cache, block_table, tile_tokens, tile_request, token_tile,
                            num_visible_windows, window_bound, topk, head_weights=None, sink_windows=0,
                            local_windows=0):
    """Select each token's `topk` best visible windows over vLLM's paged pooled-key cache (Triton on CUDA, the compiled
    kernel on CPU, PyTorch otherwise); see `paged_pooled_index_topk_torch` for shapes. No host reads, shapes fixed
    by the arguments' shapes and `window_bound`, `topk`: capturable in a CUDA graph."""
    _check_forced(sink_windows, local_windows, topk)
    if paged_pooled_index_topk_triton is not None and use_fast_path(index_queries, pooled_key_cache):
        return paged_pooled_index_topk_triton(index_queries, pooled_key_cache, block_table, tile_tokens,
                                              tile_request, token_tile, num_visible_windows, window_bound, topk,
                                              head_weights, sink_windows, local_windows)
    if paged_topk_applies(index_queries, pooled_key_cache):
        return paged_pooled_index_topk_cpu(index_queries, pooled_key_cache, block_table, tile_tokens, tile_request,
                                           token_tile, num_visible_windows, window_bound, topk, head_weights,
                                           sink_windows, local_windows)
    return paged_pooled_index_topk_torch(index_queries, pooled_key_cache, block_table, tile_tokens, tile_request,
                                         token_tile, num_visible_windows, window_bound, topk, head_weights,
                                         sink_windows, local_windows)


__all__ = ["paged_pooled_index_topk", "paged_pooled_index_topk_cpu", "paged_pooled_index_topk_torch",
           "paged_pooled_index_topk_triton",
           "pooled_index_topk", "pooled_index_topk_cpu", "pooled_index_topk_torch", "pooled_index_topk_triton",
           "pooled_index_scores_torch"]
