"""HybridIndexPoolCache: equivalence with a full forward, sizes, and the batch operations generate() uses."""

import pytest
import torch
from model_factory import KIMI_DELTA, MLA, tiny_model

from hybrid_indexpool import HybridIndexPoolCache
from hybrid_indexpool.modeling.cache_hybrid_indexpool import IndexPoolLayerCache
from hybrid_indexpool.modeling.generation import recording_bytes

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
    assert layer.lengths.tolist() == [input_ids.shape[1]] * 2 and layer.pool_size == pool_size


@pytest.mark.parametrize("weighting", ["learned_scalar", "prenorm_mean"])
def test_every_pooling_weighting_decodes_as_one_full_forward(weighting):
    model = tiny_model(index_pool_size=4, index_topk=8, index_pool_weighting=weighting)
    input_ids = torch.randint(1, 97, (2, 38))
    with torch.no_grad():
        full = model(input_ids).logits
    incremental, cache = incremental_logits(model, input_ids, [6, 3, 1, 1, 9] + [1] * 18)
    torch.testing.assert_close(incremental, full, atol=1e-4, rtol=0)
    layer = next(layer for layer in cache.layers if isinstance(layer, IndexPoolLayerCache))
    gate_width = None if layer.open_gate_logits is None else layer.open_gate_logits.shape[-1]
    assert gate_width == (1 if weighting == "learned_scalar" else None)


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
    # Every window is complete: nothing is open, but rows x layers x (r - 1) open slots x head dim x 4 bytes (raw
    # keys) + the same in float32 gate logits are reserved.
    assert sizes["pooled"]["open_window"] == 0
    assert sizes["pooled"]["open_window_reserved"] == 2 * 1 * (pool_size - 1) * 16 * 4 * 2
    components = ("key_value", "pooled_index_keys", "open_window", "conv_state", "recurrent_state", "ple_state",
                  "bookkeeping")
    assert sizes["pooled"]["total"] == sum(sizes["pooled"][name] for name in components)
    assert sizes["pooled"]["reserved"] == sum(sizes["pooled"][f"{name}_reserved"] for name in components)


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


def test_crop_without_recording_rolls_back_attention_only_and_refuses_recurrent_layers():
    model = tiny_model(num_hidden_layers=2, layer_types=["indexpool_attention"] * 2)
    input_ids = torch.randint(1, 97, (1, 30))
    with torch.no_grad():
        cache = model(input_ids[:, :27], use_cache=True).cache
        cache.crop(-2)  # 25 positions remain: inside the open window (24 pooled)
        cropped = model(input_ids[:, 25:], cache=cache, use_cache=True).logits
        torch.testing.assert_close(cropped, model(input_ids).logits[:, 25:], atol=1e-4, rtol=0)
        cache = model(input_ids[:, :27], use_cache=True).cache
        cache.crop(0)  # nothing to do (generate's deferred stop check calls this)
        cache.crop(-3)  # back to the window boundary at 24
        assert cache.get_seq_length() == 24
        with pytest.raises(ValueError, match="already pooled"):
            cache.crop(-1)
        with pytest.raises(ValueError, match="pass a negative number"):
            cache.crop(1)
    hybrid = tiny_model(layer_types=["indexpool_attention", "linear_attention", "indexpool_attention",
                                     "linear_attention"])
    with torch.no_grad():
        cache = hybrid(input_ids, use_cache=True).cache
    lengths = [layer.lengths.clone() for layer in cache.index_layers]
    with pytest.raises(ValueError, match="activate_past_recording"):
        cache.crop(-2)
    # Refused before any layer changed, the IndexPool layers before the first Gated DeltaNet layer included.
    assert all(torch.equal(layer.lengths, before) for layer, before in zip(cache.index_layers, lengths))
    assert cache.get_seq_length() == 30


def test_wrong_cache_type_is_rejected():
    from transformers import DynamicCache

    model = tiny_model()
    with pytest.raises(ValueError, match="needs a HybridIndexPoolCache"):
        model(torch.randint(1, 97, (1, 4)), cache=DynamicCache(), use_cache=True)


def index_layer(cache):
    return next(layer for layer in cache.layers if isinstance(layer, IndexPoolLayerCache))


def tensor_bytes(cache) -> int:
    """Bytes of every distinct tensor the cache object holds, found by walking its attributes (and the dicts of
    states keyed by index that linear-attention layers keep)."""
    seen, total = set(), 0
    for holder in [cache, *cache.layers]:
        for value in vars(holder).values():
            for tensor in value.values() if isinstance(value, dict) else [value]:
                if isinstance(tensor, torch.Tensor) and id(tensor) not in seen:
                    seen.add(id(tensor))
                    total += tensor.numel() * tensor.element_size()
    return total


@pytest.mark.parametrize("prompt_length", [3000, 4097, 9000])
def test_reserved_bytes_stay_within_ten_percent_of_used_after_prefill_and_decode(prompt_length):
    model = tiny_model(index_topk=64)
    input_ids = torch.randint(1, 97, (2, prompt_length + 40))
    with torch.no_grad():
        cache = model(input_ids[:, :prompt_length], use_cache=True).cache
        for step in range(40):
            model(input_ids[:, prompt_length + step:][:, :1], cache=cache, use_cache=True)
    footprint = cache.memory_footprint()
    assert footprint["reserved"] == tensor_bytes(cache)
    assert footprint["reserved"] <= 1.10 * footprint["total"]
    assert index_layer(cache).lengths.tolist() == [prompt_length + 40] * 2


def test_generate_reserves_exactly_prompt_plus_new_tokens_once():
    model = tiny_model(index_topk=64)
    input_ids = torch.randint(1, 97, (2, 5000))
    output = model.generate(input_ids, max_new_tokens=30, min_new_tokens=30, do_sample=False,
                            return_dict_in_generate=True)
    cache = output.cache
    footprint = cache.memory_footprint()
    assert footprint["reserved"] == tensor_bytes(cache)
    assert footprint["reserved"] <= 1.10 * footprint["total"]
    layer = index_layer(cache)
    # Prompt + new tokens - 1 (the last generated token is never fed back), in whole windows.
    assert layer.capacity == -(-(5000 + 30 - 1) // 4) * 4
    assert layer.lengths.tolist() == [5029, 5029]


def test_padding_is_never_stored_and_costs_nothing():
    model = tiny_model(index_topk=8)
    input_ids = torch.randint(1, 97, (2, 40))
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, :15] = 0  # row 1: 25 real tokens
    extra = torch.zeros(2, 10, dtype=torch.long)  # ten more padding columns in front of both rows
    with torch.no_grad():
        cache = model(input_ids, attention_mask=mask, use_cache=True).cache
        padded = model(torch.cat([extra, input_ids], 1), attention_mask=torch.cat([extra, mask], 1),
                       use_cache=True).cache
        alone = model(input_ids[1:, 15:], use_cache=True).cache
    assert padded.memory_footprint()["reserved"] == cache.memory_footprint()["reserved"]
    layer, layer_alone = index_layer(cache), index_layer(alone)
    assert layer.lengths.tolist() == [40, 25]
    # Row 1 holds its 25 tokens at positions 0..24, exactly as the row alone does.
    torch.testing.assert_close(layer.key_storage[1, :25], layer_alone.key_storage[0, :25], atol=1e-6, rtol=0)
    torch.testing.assert_close(layer.pooled_storage[1, :6], layer_alone.pooled_storage[0, :6], atol=1e-6, rtol=0)
    with torch.no_grad():
        generated = model.generate(input_ids, attention_mask=mask, max_new_tokens=5, return_dict_in_generate=True)
    assert index_layer(generated.cache).capacity == 40 + 4  # the longest row's real tokens + new ones - 1, in windows


class SyncCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts operators that make the host wait for the device: reading a value, or a data-dependent shape."""

    SYNCING = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "item", "equal")

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if any(name.startswith(syncing) for syncing in self.SYNCING):
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("reserved, experts", [(False, 0), (True, 0), (True, 4)])
def test_a_decode_step_makes_no_host_synchronisation(reserved, experts):
    moe = dict(num_experts=experts, num_experts_per_tok=2, moe_intermediate_size=32) if experts else {}
    model = tiny_model(index_topk=8, index_head_weights=True, **moe)
    input_ids = torch.randint(1, 97, (2, 60))
    mask = torch.ones(2, 60, dtype=torch.long)
    mask[0, :7] = 0
    cache = HybridIndexPoolCache(model.config, max_cache_len=80 if reserved else None)
    with torch.no_grad():
        model(input_ids[:, :50], attention_mask=mask[:, :50], cache=cache, use_cache=True)
        with SyncCounter() as counter:
            for step in range(50, 60):  # past the budget, windows completing on the way
                model(input_ids[:, step:step + 1], attention_mask=mask[:, :step + 1], cache=cache, use_cache=True)
    assert counter.calls == []
    # ... and the prefill does read the device (the counter can see it).
    with torch.no_grad(), SyncCounter() as counter:
        model(input_ids[:, :50], attention_mask=mask[:, :50], use_cache=True)
    assert counter.calls


def test_a_cache_used_without_generate_grows_in_bounded_steps():
    model = tiny_model(num_hidden_layers=1, layer_types=["indexpool_attention"])
    cache = HybridIndexPoolCache(model.config)
    capacities = []
    with torch.no_grad():
        model(torch.randint(1, 97, (1, 3000)), cache=cache, use_cache=True)
        for _ in range(300):
            model(torch.randint(1, 97, (1, 1)), cache=cache, use_cache=True)
            capacities.append(index_layer(cache).capacity)
    grown = sorted(set(capacities))
    assert grown[0] == 3072 and len(grown) > 1
    for before, after in zip(grown, grown[1:]):
        assert after - before <= max(256, before // 16 + 256)


def test_a_reserved_cache_grows_past_its_reservation_outside_compiled_code():
    model = tiny_model()
    input_ids = torch.randint(1, 97, (1, 40))
    cache = HybridIndexPoolCache(model.config, max_cache_len=20)
    with torch.no_grad():
        model(input_ids[:, :12], cache=cache)
        assert index_layer(cache).capacity == 20
        logits = model(input_ids[:, 12:], cache=cache).logits
        torch.testing.assert_close(logits, model(input_ids).logits[:, 12:], atol=1e-4, rtol=0)
    assert index_layer(cache).capacity >= 40
    with pytest.raises(ValueError, match="max_cache_len"):
        HybridIndexPoolCache(model.config, max_cache_len=0)


def test_the_cache_only_stores_what_the_indexer_pooled_for_the_windows_it_reported():
    """`place_windows` hands back the raw keys of the windows the new tokens touch and which of them they complete;
    the pooled keys stored are the ones given to `update`, at those windows, and nothing is pooled inside the cache."""
    layer = IndexPoolLayerCache(pool_size=4)
    token_is_real = torch.tensor([[True] * 10, [False] * 3 + [True] * 7])
    keys = torch.randn(2, 1, 10, 8)
    raw_index_keys = torch.randn(2, 10, 6)
    positions = (token_is_real.long().cumsum(1) - 1).clamp(min=0)[None]
    windows = layer.place_windows(raw_index_keys, None, token_is_real, positions)
    # Room for the open window and every new token: 4 windows; 10 real tokens complete 2, 7 complete 1.
    assert windows.complete.tolist() == [[True, True, False, False], [True, False, False, False]]
    torch.testing.assert_close(windows.keys[0, 1], raw_index_keys[0, 4:8])
    torch.testing.assert_close(windows.keys[1, 0], raw_index_keys[1, 3:7])
    assert windows.first_positions[0, 0].tolist()[:2] == [0, 4]
    marked = torch.arange(windows.keys.shape[1], dtype=torch.float)[None, :, None].expand(2, -1, 6) + 1
    _, _, pooled = layer.update(keys, keys, token_is_real, windows, marked)
    assert pooled[0, :2, 0].tolist() == [1.0, 2.0] and pooled[1, :1, 0].tolist() == [1.0]
    assert layer.lengths.tolist() == [2 * 4 + 2, 1 * 4 + 3]  # 2 and 1 windows pooled, 2 and 3 tokens open
    # A decode step gives one window per row: only the row whose window it completes is written.
    step_real = torch.ones(2, 1, dtype=torch.bool)
    step = layer.place_windows(raw_index_keys[:, :1], None, step_real, torch.tensor([[[10], [7]]]))
    assert step.complete.tolist() == [[False], [True]]
    layer.update(keys[:, :, :1], keys[:, :, :1], step_real, step, torch.full((2, 1, 6), 9.0))
    assert layer.pooled_storage[1, 1, 0] == 9.0 and layer.pooled_storage[0, 2, 0] != 9.0


def test_an_fp8_cache_refuses_pooled_keys_that_are_not_packed():
    layer = IndexPoolLayerCache(pool_size=2, fp8_index_keys=True)
    token_is_real = torch.ones(1, 4, dtype=torch.bool)
    windows = layer.place_windows(torch.randn(1, 4, 16), None, token_is_real, torch.arange(4)[None, None])
    with pytest.raises(ValueError, match="packed fp8"):
        layer.update(torch.randn(1, 1, 4, 8), None, token_is_real, windows, torch.randn(1, 2, 16))


HC_PLE = dict(hc_count=3, hc_lowrank=8, ple_layers=[0, 2], ple_ngram_size=3, ple_heads_per_ngram=2, ple_embed_dim=12,
              ple_ngram_vocab_size_base=40, ple_vocab_size_multiple=8, eos_token_id=2)  # small n-gram tables


@pytest.mark.parametrize("variant", [
    dict(),  # Gated DeltaNet + GQA, r = 4
    dict(index_pool_size=1, index_topk=4),
    dict(index_pool_size=16, index_topk=16),
    dict(index_key_cache_dtype="float8_e4m3fn"),
    dict(**KIMI_DELTA, **MLA, indexer_types=["full", "full", "full", "shared"], layer_types=[
        "linear_attention", "indexpool_attention", "linear_attention", "indexpool_attention"]),
    HC_PLE,
], ids=["gdn-r4", "r1", "r16", "fp8", "kda-mla-shared", "hc-ple"])
def test_crop_after_a_recorded_forward_leaves_the_cache_as_if_only_the_kept_tokens_were_fed(variant):
    """Every layer type rolls back: a verify forward of k + 1 tokens (k = 5, crossing window boundaries), a long
    forward (prompt and drafts at once, as generate's first iteration) and a draft model's one-token steps; each then
    continues exactly as a fresh forward over the kept tokens."""
    model = tiny_model(**variant)
    input_ids = torch.randint(3, 97, (1, 48))
    with torch.no_grad():
        reference = model(input_ids).logits
        for removed in (0, 1, 3, 6):
            for pieces in ([21, 6], [27], [19, 2, 1, 1, 1, 1, 1]):
                cache = HybridIndexPoolCache(model.config)
                cache.activate_past_recording(recurrent_states_to_keep=5)
                start = 0
                for index, size in enumerate(pieces):
                    model(input_ids[:, start:start + size], cache=cache, use_cache=True)
                    start += size
                    if index == 0 and len(pieces) > 1:
                        cache.crop(0)  # the prompt is kept for good
                cache.crop(-removed)
                kept = start - removed
                assert cache.get_seq_length() == kept
                assert all(int(layer.lengths[0]) == kept for layer in cache.index_layers)
                continued = model(input_ids[:, kept:], cache=cache, use_cache=True).logits
                torch.testing.assert_close(continued, reference[:, kept:], atol=1e-4, rtol=0)


def test_crop_refuses_more_than_was_recorded_and_changes_nothing():
    model = tiny_model()
    input_ids = torch.randint(3, 97, (1, 30))
    with torch.no_grad():
        cache = HybridIndexPoolCache(model.config)
        cache.activate_past_recording(recurrent_states_to_keep=2)
        model(input_ids, cache=cache, use_cache=True)  # a long forward records its last 3 tokens
        linear = [layer for layer in cache.layers if getattr(layer, "recurrent_state", None) is not None]
        states = [layer.recurrent_states[0].clone() for layer in linear]
        with pytest.raises(ValueError, match="recorded only 3"):
            cache.crop(-4)
        assert cache.get_seq_length() == 30 and all(int(layer.lengths[0]) == 30 for layer in cache.index_layers)
        assert all(torch.equal(layer.recurrent_states[0], before) for layer, before in zip(linear, states))
        cache.crop(-3)
        assert cache.get_seq_length() == 27
        with pytest.raises(ValueError, match="activate_past_recording"):
            cache.crop(-1)  # a crop commits the recording


def test_recording_makes_the_cache_non_compileable_and_reports_its_bytes():
    model = tiny_model()
    cache = HybridIndexPoolCache(model.config, max_cache_len=40)
    with torch.no_grad():
        model(torch.randint(3, 97, (1, 20)), cache=cache, use_cache=True)
        assert cache.is_compileable and cache.memory_footprint()["rollback"] == 0
        cache.activate_past_recording(recurrent_states_to_keep=3)
        assert not cache.is_compileable and cache.get_recurrent_states_to_keep() == 3
        model(torch.randint(3, 97, (1, 4)), cache=cache, use_cache=True)
        assert cache.memory_footprint()["rollback"] > 0
        cache.crop(-2)
        assert cache.memory_footprint()["rollback"] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("variant", [
    dict(),
    dict(index_pool_size=1, index_topk=4),
    dict(index_pool_size=16, index_topk=16),
    dict(index_key_cache_dtype="float8_e4m3fn"),
    dict(index_pool_weighting="learned_scalar"),
    dict(index_pool_weighting="mean"),
    dict(**KIMI_DELTA, **MLA, indexer_types=["full", "full", "full", "shared"], layer_types=[
        "linear_attention", "indexpool_attention", "linear_attention", "indexpool_attention"]),
    HC_PLE,
], ids=["gdn-r4", "r1", "r16", "fp8", "learned-scalar", "mean", "kda-mla-shared", "hc-ple"])
def test_recording_bytes_gives_what_each_layer_records_for_a_verify_forward(variant, dtype):
    """The formula (which docs/speculative_decoding.md evaluates at Qwen3.8-Flash-Next's widths) against what every
    layer's recording holds after verify forwards of 1 and 6 tokens over a 2-row cache."""
    model = tiny_model(**variant).to(dtype)
    for tokens in (1, 6):
        cache = HybridIndexPoolCache(model.config)
        with torch.no_grad():
            model(torch.randint(3, 97, (2, 13)), cache=cache, use_cache=True)
            cache.activate_past_recording(recurrent_states_to_keep=tokens - 1)
            model(torch.randint(3, 97, (2, tokens)), cache=cache, use_cache=True)
        recorded = [cache.memory_footprint(index)["rollback"] for index in range(len(cache.layers))]
        assert recorded == recording_bytes(model.config, tokens, dtype, batch_size=2)
        assert cache.memory_footprint()["rollback"] == sum(recorded) > 0


def test_a_long_recorded_forward_holds_only_what_it_reports():
    """A prompt forward while recording (generate's first iteration) keeps copies of its last tokens' inputs, not
    slices that would keep the whole prompt's projections alive until the crop."""
    model = tiny_model()
    cache = HybridIndexPoolCache(model.config)
    cache.activate_past_recording(recurrent_states_to_keep=3)
    with torch.no_grad():
        model(torch.randint(3, 97, (1, 500)), cache=cache, use_cache=True)
    held = {}

    def collect(value):  # every tensor reachable from a layer's recordings (not its states and storage)
        if isinstance(value, torch.Tensor):
            held[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
        elif isinstance(value, (list, tuple, dict)):
            for item in value.values() if isinstance(value, dict) else value:
                collect(item)
        elif hasattr(value, "__dict__"):
            collect(list(vars(value).values()))

    for layer in cache.layers:
        collect([value for name, value in vars(layer).items()
                 if name not in layer._batch_tensors and name != "seen_tokens"])
    assert sum(held.values()) == cache.memory_footprint()["rollback"]


def test_a_long_recorded_forward_of_left_padded_rows_rolls_back_each_row():
    """The layers see each row's real tokens first, so a long forward's last columns may be padding: the recording
    keeps every row's last real tokens wherever they lie, and a crop then continues each row as a fresh forward."""
    model = tiny_model(**HC_PLE)
    input_ids = torch.randint(3, 97, (2, 30))
    mask = torch.ones(2, 30, dtype=torch.long)
    mask[1, :9] = 0
    with torch.no_grad():
        cache = HybridIndexPoolCache(model.config)
        cache.activate_past_recording(recurrent_states_to_keep=3)
        model(input_ids[:, :26], attention_mask=mask[:, :26], cache=cache, use_cache=True)
        cache.crop(-4)
        continued = model(input_ids[:, 22:], attention_mask=mask, cache=cache, use_cache=True).logits
        for row, first in ((0, 0), (1, 9)):
            alone = model(input_ids[row:row + 1, first:]).logits
            torch.testing.assert_close(continued[row], alone[0, 22 - first:], atol=1e-4, rtol=0)


@pytest.mark.parametrize("variant", [dict(), KIMI_DELTA], ids=["gated-deltanet", "kimi-delta"])
def test_a_crop_replays_a_verify_rounds_few_tokens_token_by_token(variant):
    """After a crop of a verify forward of up to FEW_TOKENS tokens, the next forward replays the kept tokens' delta rule
    in its recurrent form (the chunked form pads to 64 tokens: a replay would then cost about a whole decode step at
    2048 hidden); a long recording still replays in chunks. Either way the cache continues exactly."""
    from hybrid_indexpool.modeling import linear_attention_gdn, linear_attention_kda
    from hybrid_indexpool.modeling.layers import FEW_TOKENS

    model = tiny_model(**variant)
    input_ids = torch.randint(3, 97, (1, 30 + FEW_TOKENS))
    with torch.no_grad():
        reference = model(input_ids).logits
        for width, expected_mode in ((FEW_TOKENS, "recurrent"), (FEW_TOKENS + 1, "chunk")):
            cache = HybridIndexPoolCache(model.config)
            model(input_ids[:, :29], cache=cache, use_cache=True)
            cache.activate_past_recording(recurrent_states_to_keep=width)
            model(input_ids[:, 29:29 + width], cache=cache, use_cache=True)
            modes = []
            module = linear_attention_kda if variant else linear_attention_gdn
            name = "kimi_delta_rule" if variant else "gated_delta_rule"
            original = getattr(module, name)
            cache.crop(-2)
            # The replay runs at the next forward, before the new tokens: the first call of each layer's rule.
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(module, name, lambda *args, **kwargs: modes.append(kwargs["mode"]) or original(
                    *args, **kwargs))
                kept = 29 + width - 2
                continued = model(input_ids[:, kept:], cache=cache, use_cache=True).logits
            modes = modes[::2]  # each linear layer: the replay, then the new tokens
            assert modes and set(modes) == {expected_mode}
            torch.testing.assert_close(continued, reference[:, kept:], atol=1e-4, rtol=0)
