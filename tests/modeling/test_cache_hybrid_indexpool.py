"""HybridIndexPoolCache: equivalence with a full forward, sizes, and the batch operations generate() uses."""

import pytest
import torch

from hybrid_indexpool import HybridIndexPoolCache
from hybrid_indexpool.modeling.cache_hybrid_indexpool import IndexPoolLayerCache

from model_factory import tiny_model

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def incremental_logits(model, input_ids, chunk_sizes, attention_mask=None):
    cache = HybridIndexPoolCache(model.config)
    logits, start = [], 0
    with torch.no_grad():
        for size in chunk_sizes:
            end = start + size
            mask = None if attention_mask is None else attention_mask[:, :end]
            logits.append(model(input_ids[:, start:end], attention_mask=mask, cache=cache, use_cache=True).logits)
            start = end
    assert start == input_ids.shape[1]
    return torch.cat(logits, dim=1), cache


@pytest.mark.parametrize("pool_size", [1, 2, 4])
@pytest.mark.parametrize("chunk_sizes", [[5] + [1] * 40, [3, 7, 1, 9, 2, 13, 1, 1, 4]])
def test_prefill_then_decode_equals_one_full_forward(pool_size, chunk_sizes):
    model = tiny_model(index_pool_size=pool_size, index_topk=2 * pool_size, index_head_weights=pool_size == 2)
    input_ids = torch.randint(1, 97, (2, sum(chunk_sizes)))
    with torch.no_grad():
        full = model(input_ids).logits
    incremental, cache = incremental_logits(model, input_ids, chunk_sizes)
    torch.testing.assert_close(incremental, full, atol=1e-4, rtol=0)
    assert cache.get_seq_length() == input_ids.shape[1]
    layer = next(layer for layer in cache.layers if isinstance(layer, IndexPoolLayerCache))
    assert layer.num_pooled.tolist() == [input_ids.shape[1] // pool_size] * 2
    assert layer.num_open.tolist() == [input_ids.shape[1] % pool_size] * 2


def test_prefill_then_decode_with_left_padding_equals_full_forward():
    model = tiny_model()
    input_ids = torch.randint(1, 97, (3, 40))
    mask = torch.ones(3, 40, dtype=torch.long)
    mask[1, :5] = 0
    mask[2, :14] = 0
    with torch.no_grad():
        full = model(input_ids, attention_mask=mask).logits
    incremental, _ = incremental_logits(model, input_ids, [17] + [1] * 23, mask)
    real = mask.bool()
    torch.testing.assert_close(incremental[real], full[real], atol=1e-4, rtol=0)


@pytest.mark.parametrize("pool_size", [2, 4, 8])
def test_pooled_index_bytes_are_one_over_r_of_the_unpooled_indexer(pool_size):
    pooled = tiny_model(index_pool_size=pool_size, index_topk=2 * pool_size)
    unpooled = tiny_model(index_pool_size=1, index_topk=2 * pool_size)
    input_ids = torch.randint(1, 97, (2, 8 * pool_size))
    sizes = {}
    for name, model in (("pooled", pooled), ("unpooled", unpooled)):
        with torch.no_grad():
            sizes[name] = model(input_ids, use_cache=True).cache.memory_footprint()
    assert sizes["pooled"]["pooled_index_keys"] * pool_size == sizes["unpooled"]["pooled_index_keys"]
    assert sizes["pooled"]["unpooled_index_keys"] == sizes["unpooled"]["pooled_index_keys"]
    assert sizes["pooled"]["key_value"] == sizes["unpooled"]["key_value"]
    # rows x layers x (r - 1) open slots x head dim x 4 bytes (raw keys) + the same in float32 gate logits
    assert sizes["pooled"]["open_window"] == 2 * 1 * (pool_size - 1) * 16 * 4 * 2
    assert sizes["pooled"]["total"] == sum(
        value for key, value in sizes["pooled"].items() if key not in ("total", "unpooled_index_keys")
    )


def test_batch_operations_reorder_repeat_select_and_reset():
    model = tiny_model()
    input_ids = torch.randint(1, 97, (2, 21))
    with torch.no_grad():
        cache = model(input_ids, use_cache=True).cache
        reference = {i: model(input_ids[i:i + 1], use_cache=True).cache for i in range(2)}
        next_ids = torch.randint(1, 97, (2, 1))

        def step(cache, ids):
            return model(ids, cache=cache, use_cache=True).logits

        cache.reorder_cache(torch.tensor([1, 0]))
        swapped = step(cache, next_ids.flip(0))
        torch.testing.assert_close(swapped[0], step(reference[1], next_ids[1:])[0], atol=1e-5, rtol=0)

        cache = model(input_ids, use_cache=True).cache
        cache.batch_repeat_interleave(2)
        assert cache.batch_size == 4
        repeated = step(cache, next_ids.repeat_interleave(2, 0))
        torch.testing.assert_close(repeated[0], repeated[1])
        cache.batch_select_indices(torch.tensor([2]))
        selected = step(cache, next_ids[1:])
        # The kept row has seen its prompt and the next token twice; replay that on a fresh cache.
        reference_again = model(input_ids[1:], use_cache=True).cache
        step(reference_again, next_ids[1:])
        torch.testing.assert_close(selected, step(reference_again, next_ids[1:]), atol=1e-5, rtol=0)

        cache.reset()
        assert cache.get_seq_length() == 0 and cache.memory_footprint()["total"] == 0
        fresh = model(input_ids[:1], cache=cache, use_cache=True).logits
        torch.testing.assert_close(fresh, model(input_ids[:1]).logits, atol=1e-5, rtol=0)


def test_crop_rolls_back_an_attention_only_model_and_refuses_recurrent_layers():
    model = tiny_model(num_hidden_layers=2, layer_types=["indexpool_attention"] * 2)
    input_ids = torch.randint(1, 97, (1, 30))
    with torch.no_grad():
        cache = model(input_ids[:, :27], use_cache=True).cache
        cache.crop(2)  # 25 positions remain: inside the open window (24 pooled)
        cropped = model(input_ids[:, 25:], cache=cache, use_cache=True).logits
        torch.testing.assert_close(cropped, model(input_ids).logits[:, 25:], atol=1e-4, rtol=0)
        cache = model(input_ids[:, :27], use_cache=True).cache
        cache.crop(3)  # back to the window boundary at 24
        assert cache.get_seq_length() == 24
        with pytest.raises(ValueError, match="already pooled"):
            cache.crop(1)
    hybrid = tiny_model()
    with torch.no_grad():
        cache = hybrid(input_ids, use_cache=True).cache
    with pytest.raises(ValueError, match="recurrent state cannot be rolled back"):
        cache.crop(1)


def test_wrong_cache_type_is_rejected():
    from transformers import DynamicCache

    model = tiny_model()
    with pytest.raises(ValueError, match="needs a HybridIndexPoolCache"):
        model(torch.randint(1, 97, (1, 4)), cache=DynamicCache(), use_cache=True)
