"""`index_key_cache_dtype="float8_e4m3fn"`: the cache holds packed fp8 pooled keys (half of bfloat16), decoding
with it is one full forward through the same cache, the selection stays close to full precision, a checkpoint
switches to it by a config change, and training keeps full-precision keys."""

import pytest
import torch
from model_factory import tiny_model

from hybrid_indexpool import HybridIndexPoolCache, HybridIndexPoolConfig, HybridIndexPoolForCausalLM
from hybrid_indexpool.kernels.fp8_index_keys import dequantize_pooled_keys, packed_width, quantize_pooled_keys
from hybrid_indexpool.modeling.cache_hybrid_indexpool import IndexPoolLayerCache

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
FP8 = dict(index_key_cache_dtype="float8_e4m3fn")


def index_layer(cache: HybridIndexPoolCache) -> IndexPoolLayerCache:
    return next(layer for layer in cache.layers if isinstance(layer, IndexPoolLayerCache))


def test_the_config_refuses_unknown_dtypes_and_fp8_without_a_power_of_two_head_dim():
    with pytest.raises(ValueError, match="index_key_cache_dtype.*'bfloat8'.*one of"):
        tiny_model(index_key_cache_dtype="bfloat8")
    with pytest.raises(ValueError, match="power-of-two `index_head_dim` \\(got 24\\).*use e.g. 16"):
        tiny_model(index_head_dim=24, **FP8)


@pytest.mark.parametrize("chunk_sizes", [[5] + [1] * 35, [13, 2, 1, 9, 1, 1, 6, 7]])
def test_decoding_with_fp8_keys_equals_one_full_forward_through_the_same_cache(chunk_sizes):
    model = tiny_model(index_topk=8, index_head_weights=True, **FP8)
    input_ids = torch.randint(1, 97, (2, sum(chunk_sizes)))
    mask = torch.ones_like(input_ids)
    mask[1, :4] = 0
    with torch.no_grad():
        full = model(input_ids, attention_mask=mask, cache=HybridIndexPoolCache(model.config), use_cache=True).logits
        cache, pieces, start = HybridIndexPoolCache(model.config), [], 0
        for size in chunk_sizes:
            pieces.append(model(input_ids[:, start:start + size], attention_mask=mask[:, :start + size], cache=cache,
                                use_cache=True).logits)
            start += size
    torch.testing.assert_close(torch.cat(pieces, dim=1)[mask.bool()], full[mask.bool()], atol=1e-4, rtol=0)
    layer = index_layer(cache)
    assert layer.pooled_storage.dtype == torch.uint8 and layer.pooled_storage.shape[-1] == packed_width(16)


def test_the_cache_stores_each_completed_window_quantised_once_from_its_full_precision_key():
    model = tiny_model(index_topk=8, **FP8)
    reference = tiny_model(index_topk=8)  # same weights, full-precision cache
    input_ids = torch.randint(1, 97, (1, 23))
    caches = [HybridIndexPoolCache(model.config), HybridIndexPoolCache(reference.config)]
    with torch.no_grad():
        model(input_ids, cache=caches[0], use_cache=True)
        reference(input_ids, cache=caches[1], use_cache=True)
    fp8_layer, float_layer = index_layer(caches[0]), index_layer(caches[1])
    windows = 23 // 4
    expected = quantize_pooled_keys(float_layer.pooled_storage[:, :windows])
    assert torch.equal(fp8_layer.pooled_storage[:, :windows], expected)
    torch.testing.assert_close(fp8_layer.open_index_keys, float_layer.open_index_keys, atol=0, rtol=0)


def test_fp8_pooled_keys_cost_half_of_bfloat16_in_the_footprint():
    footprints = {}
    for dtype in ("auto", "float8_e4m3fn"):
        model = tiny_model(index_topk=8, index_head_dim=128, index_key_cache_dtype=dtype).to(torch.bfloat16)
        output = model.generate(torch.randint(1, 97, (2, 61)), max_new_tokens=3, do_sample=False,
                                return_dict_in_generate=True)
        footprints[dtype] = output.cache.memory_footprint()
    windows = 2 * ((61 + 3 - 1) // 4)  # the last new token is never fed back
    assert footprints["auto"]["pooled_index_keys"] == windows * 128 * 2  # 256 bytes per window
    assert footprints["float8_e4m3fn"]["pooled_index_keys"] == windows * (128 + 4)  # 132 bytes per window
    assert footprints["float8_e4m3fn"]["key_value"] == footprints["auto"]["key_value"]


def test_a_checkpoint_serves_with_fp8_keys_by_a_config_change(tmp_path):
    model = tiny_model(index_topk=8, index_head_dim=32)
    model.save_pretrained(tmp_path)
    served = HybridIndexPoolForCausalLM.from_pretrained(tmp_path, **FP8).eval()
    assert served.config.index_key_cache_dtype == "float8_e4m3fn"
    prompt = torch.randint(1, 97, (2, 50))
    output = served.generate(prompt, max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    assert index_layer(output.cache).pooled_storage.dtype == torch.uint8
    # Without a cache nothing is quantised: the same logits as the full-precision checkpoint.
    with torch.no_grad():
        torch.testing.assert_close(served(prompt, use_cache=False).logits, model(prompt, use_cache=False).logits)


def test_fp8_selections_agree_with_full_precision_ones_on_almost_every_window():
    torch.manual_seed(0)
    queries, keys = torch.randn(1, 64, 4, 128), torch.randn(1, 4000, 128)
    from hybrid_indexpool.kernels.pooled_index_topk import pooled_index_topk_torch

    visible = torch.full((1, 64), 4000)
    full = pooled_index_topk_torch(queries, keys, visible, 256)
    fp8 = pooled_index_topk_torch(queries, quantize_pooled_keys(keys), visible, 256)
    overlap = torch.tensor([len(set(a.tolist()) & set(b.tolist())) / 256 for a, b in zip(full[0], fp8[0])])
    assert overlap.mean() >= 0.9
    assert dequantize_pooled_keys(quantize_pooled_keys(keys)).shape == keys.shape


def test_indexer_training_refuses_an_fp8_cache_and_trains_without_one():
    model = tiny_model(index_topk=8, **FP8).train()
    input_ids = torch.randint(1, 97, (2, 40))
    with pytest.raises(ValueError, match="stores them in fp8.*use_cache=False"):
        model(input_ids, indexer_loss="dense", use_cache=True)
    loss = model(input_ids, indexer_loss="dense", use_cache=False).indexer_loss
    loss.backward()
    gate = model.model.layers[3].self_attn.indexer.pool_gate_proj.weight
    assert gate.grad is not None and gate.grad.abs().sum() > 0


def test_an_fp8_cache_is_not_shared_with_a_full_precision_model():
    cache = HybridIndexPoolCache(HybridIndexPoolConfig(**{**tiny_model().config.to_dict(), **FP8}))
    with pytest.raises(ValueError, match="index_key_cache_dtype"):
        tiny_model()(torch.randint(1, 97, (1, 5)), cache=cache, use_cache=True)
