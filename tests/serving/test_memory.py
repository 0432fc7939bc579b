"""The KV-cache specs of an IndexPool layer in vLLM's accounting (marker `vllm`)."""

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")


def test_pooled_key_cache_costs_one_rth_of_a_per_token_indexer():
    """In vLLM's accounting (the specs the layer hands to vLLM) a pooled key costs 1/r of a per-token key, and the
    open window is one block of r rows per request, whatever the context."""
    from hybrid_indexpool.serving.memory import indexpool_cache_specs

    block_size = 256
    for pool_size in (1, 4, 16):
        specs = indexpool_cache_specs(index_head_dim=128, num_kv_heads=2, head_dim=128, pool_size=pool_size,
                                      gate_width=128, block_size=block_size)
        per_token_indexer = block_size * 128 * 2  # bytes of one bfloat16 key per token, per block
        assert specs["pooled_keys"].page_size_bytes * pool_size == per_token_indexer
        assert specs["open_window"].max_num_blocks_per_req(None, 10**6) == 1
        assert specs["open_window"].page_size_bytes == pool_size * (128 + 128) * 2


def test_fp8_pooled_keys_cost_132_bytes_per_window_at_head_dim_128():
    """With `index_key_cache_dtype = "float8_e4m3fn"` a pooled key is its 128 fp8 bytes and a float32 scale in vLLM's
    accounting too: 132 bytes per window of r tokens, against 256 in bfloat16."""
    from hybrid_indexpool.configuration import HybridIndexPoolConfig
    from hybrid_indexpool.serving.memory import bytes_per_token

    sizes = dict(index_head_dim=128, index_pool_size=4, num_key_value_heads=2, head_dim=128)
    fp8 = bytes_per_token(HybridIndexPoolConfig(**sizes, index_key_cache_dtype="float8_e4m3fn"), 256, 1024)
    bf16 = bytes_per_token(HybridIndexPoolConfig(**sizes), 256, 1024)
    assert fp8["pooled_keys"] == 132 / 4 and bf16["pooled_keys"] == 256 / 4
    assert fp8["main"] == bf16["main"] == 2 * 2 * 128 * 2
