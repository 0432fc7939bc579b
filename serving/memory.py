"""The KV-cache specs of one IndexPool layer in vLLM's memory model, and what they cost per token.

The layer's cache owners return these specs to vLLM, so the numbers here are vLLM's own accounting: a pooled key costs
`1 / r` of a per-token key, and the open window is one block of `r` rows per request whatever its length.
"""

import torch
from vllm.v1.kv_cache_interface import CircularBufferSpec, FullAttentionSpec, MLAAttentionSpec

from .paged_step import pooled_key_width


def main_kv_spec(num_kv_heads: int, head_dim: int, block_size: int,
                 dtype: torch.dtype = torch.bfloat16) -> FullAttentionSpec:
    """Keys and values of every token, paged."""
    return FullAttentionSpec(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_dim, dtype=dtype)


def pooled_key_spec(width: int, pool_size: int, block_size: int,
                    dtype: torch.dtype = torch.bfloat16) -> MLAAttentionSpec:
    """One pooled indexer key per `pool_size` tokens, paged with the request's blocks (`block_size // pool_size` keys
    per block): `width` elements of `dtype` (the index head dim in the model's dtype, or a packed fp8 key's bytes in
    uint8)."""
    return MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=width, dtype=dtype,
                            tokens_per_state=pool_size)


def open_window_spec(index_head_dim: int, gate_width: int, rows: int,
                     dtype: torch.dtype = torch.bfloat16) -> CircularBufferSpec:
    """A ring of each request's last `rows` raw indexer keys and gate logits (`r`, or `paged_step.ring_capacity` with
    speculative decoding): one block per request."""
    return CircularBufferSpec(block_size=rows, num_kv_heads=1, head_size=index_head_dim + gate_width,
                              head_size_v=0, dtype=dtype)


def indexpool_cache_specs(index_head_dim: int, num_kv_heads: int, head_dim: int, pool_size: int, gate_width: int,
                          block_size: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    """The three specs of one IndexPool layer: `main`, `pooled_keys`, `open_window`."""
    return {
        "main": main_kv_spec(num_kv_heads, head_dim, block_size, dtype),
        "pooled_keys": pooled_key_spec(index_head_dim, pool_size, block_size, dtype),
        "open_window": open_window_spec(index_head_dim, gate_width, pool_size, dtype),
    }


def bytes_per_token(config, block_size: int, context: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, float]:
    """Cache bytes per token of context of one IndexPool layer of `config`, per component, for one request of
    `context` tokens (whole blocks, as vLLM allocates them); pooled keys packed in fp8 with
    `index_key_cache_dtype = "float8_e4m3fn"`."""
    gate_width = {"learned": config.index_head_dim, "learned_scalar": 1}.get(config.index_pool_weighting, 0)
    specs = indexpool_cache_specs(config.index_head_dim, config.num_key_value_heads, config.head_dim,
                                  config.index_pool_size, gate_width, block_size, dtype)
    width, pooled_dtype = pooled_key_width(config.index_head_dim, config.index_key_cache_dtype)
    specs["pooled_keys"] = pooled_key_spec(width, config.index_pool_size, block_size, pooled_dtype or dtype)
    blocks = -(-context // block_size)
    return {
        "main": blocks * specs["main"].page_size_bytes / context,
        "pooled_keys": blocks * specs["pooled_keys"].page_size_bytes / context,
        "open_window": specs["open_window"].page_size_bytes / context,
    }
