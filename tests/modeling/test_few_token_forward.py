"""A forward of a few tokens over a cache (a speculative verify forward: the last accepted token and up to 7 drafts)
takes every layer's decode path (recurrent delta rules, convolution as dot products, the streaming linear product of
up to 8 rows). Its logits and the cache it leaves must be those of the prefill path over the same tokens, in float32,
for every variant of the model."""

import pytest
import torch
from model_factory import KIMI_DELTA, MLA, tiny_model

from hybrid_indexpool import HybridIndexPoolCache
from hybrid_indexpool.kernels.causal_conv1d import causal_conv1d_torch
from hybrid_indexpool.modeling.layers import FEW_TOKENS

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

HC_PLE = dict(hc_count=3, hc_lowrank=8, ple_layers=[0, 2], ple_ngram_size=3, ple_heads_per_ngram=2,
              ple_ngram_vocab_size_base=40, ple_vocab_size_multiple=8, eos_token_id=1)

VARIANTS = {
    "gated_deltanet": {},
    "kimi_delta": KIMI_DELTA,
    "mla": MLA,
    "glm_style": dict(**KIMI_DELTA, **MLA, indexer_types=["full", "full", "full", "shared"]),
    "learned_r1": dict(index_pool_size=1, index_pool_weighting="learned", index_topk=4),
    "learned_r16": dict(index_pool_size=16, index_pool_weighting="learned", index_topk=16),
    "fp8_index_keys": dict(index_key_cache_dtype="float8_e4m3fn"),
    "hyper_connections_ple": HC_PLE,
}


def _prompt(length: int, vocab_size: int, seed: int) -> torch.Tensor:
    return torch.randint(2, vocab_size, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("variant", VARIANTS)
def test_few_tokens_over_a_cache_equal_the_prefill_path(variant):
    overrides = dict(VARIANTS[variant])
    if overrides.get("indexer_types"):  # a shared indexer needs a full IndexPool layer before it
        overrides["layer_types"] = ["linear_attention", "indexpool_attention"] * 2
    model = tiny_model(seed=3, **overrides)
    # Beyond the budget (8 tokens, or 16 at r = 16): the IndexPool layers select windows; the drafts cross windows.
    ids = _prompt(45, model.config.vocab_size, seed=len(variant))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        for width in (2, 5, FEW_TOKENS):
            prompt_length = ids.shape[1] - width - 3
            cache = HybridIndexPoolCache(model.config)
            model(ids[:, :prompt_length], cache=cache, use_cache=True)
            verify = model(ids[:, prompt_length:prompt_length + width], cache=cache, use_cache=True).logits
            torch.testing.assert_close(verify, full[:, prompt_length:prompt_length + width], rtol=1e-4, atol=1e-4)
            # The cache it leaves continues like the prefill path's.
            for offset in range(prompt_length + width, ids.shape[1]):
                step = model(ids[:, offset:offset + 1], cache=cache, use_cache=True).logits
                torch.testing.assert_close(step[:, 0], full[:, offset], rtol=1e-4, atol=1e-4)


def test_few_tokens_with_left_padding_equal_each_row_alone():
    model = tiny_model(seed=5)
    ids = _prompt(40, model.config.vocab_size, seed=9)
    short = ids[:, 3:]
    batch = torch.cat([ids, torch.cat([torch.zeros(1, 3, dtype=torch.long), short], dim=1)])
    mask = torch.ones_like(batch)
    mask[1, :3] = 0
    with torch.no_grad():
        cache = HybridIndexPoolCache(model.config)
        model(batch[:, :34], attention_mask=mask[:, :34], cache=cache, use_cache=True)
        verify = model(batch[:, 34:], attention_mask=mask, cache=cache, use_cache=True).logits
        alone = [model(ids, use_cache=False).logits[:, 34:], model(short, use_cache=False).logits[:, 31:]]
    torch.testing.assert_close(verify, torch.cat(alone), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 3, 8, 17])
def test_short_convolution_as_dot_products_equals_conv1d(num_tokens, dtype):
    generator = torch.Generator().manual_seed(num_tokens)
    conv_input = torch.randn(2, 24, 3 + num_tokens, generator=generator).to(dtype)
    weight = torch.randn(24, 4, generator=generator).to(dtype)
    expected = torch.nn.functional.silu(torch.nn.functional.conv1d(conv_input.float(), weight.float()[:, None],
                                                                   groups=24))
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(causal_conv1d_torch(conv_input, weight, "silu").float(), expected,
                               rtol=tolerance, atol=tolerance)


def _indexpool_contents(cache) -> list[dict]:
    """What each IndexPool layer of `cache` holds that a reader can see: every row's entries below its length."""
    contents = []
    for layer in cache.layers:
        if not hasattr(layer, "pooled_storage"):
            continue
        rows = []
        for row, length in enumerate(layer.lengths.tolist()):
            r = layer.pool_size
            held = {"length": length, "keys": layer.key_storage[row, :length]}
            if layer.value_storage is not None:
                held["values"] = layer.value_storage[row, :length]
            if layer.pooled_storage is not None:
                held["pooled"] = layer.pooled_storage[row, : length // r]
                held["open_keys"] = layer.open_index_keys[row, : length % r]
                if layer.open_gate_logits is not None:
                    held["open_gate_logits"] = layer.open_gate_logits[row, : length % r]
                if length % r:
                    held["open_position"] = layer.open_window_position[row]
            rows.append(held)
        contents.append(rows)
    return contents


@pytest.mark.parametrize("variant", ["gated_deltanet", "mla", "glm_style", "learned_r1", "learned_r16",
                                     "fp8_index_keys"])
def test_the_cache_writes_a_few_tokens_as_the_general_path_does(variant, monkeypatch):
    """A decode step or a verify forward writes its tokens into the IndexPool layers with fixed shapes (no host
    synchronisation); the cache it leaves and the logits equal the general path's, bit for bit, with padding rows,
    across window boundaries, after a crop."""
    from hybrid_indexpool.modeling import cache_layers

    overrides = dict(VARIANTS[variant])
    if overrides.get("indexer_types"):
        overrides["layer_types"] = ["linear_attention", "indexpool_attention"] * 2
    model = tiny_model(seed=4, **overrides)
    ids = _prompt(46, model.config.vocab_size, seed=7).repeat(2, 1)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # the second row is left-padded: its few-token forwards have padding columns too
    mask[1, 33] = 0

    def run(few_tokens: int):
        monkeypatch.setattr(cache_layers, "FEW_TOKENS", few_tokens)
        logits, states = [], []
        with torch.no_grad():
            cache = HybridIndexPoolCache(model.config)
            cache.activate_past_recording(recurrent_states_to_keep=FEW_TOKENS)
            model(ids[:, :29], attention_mask=mask[:, :29], cache=cache, use_cache=True)
            for start, end, removed in ((29, 31, 1), (30, 35, 3), (32, 33, 0), (33, 41, 0), (41, 46, 2)):
                logits.append(model(ids[:, start:end], attention_mask=mask[:, :end], cache=cache,
                                    use_cache=True).logits)
                cache.crop(-removed)
                states.append(_indexpool_contents(cache))
        return logits, states

    general_logits, general_states = run(0)
    few_logits, few_states = run(FEW_TOKENS)
    for general, few in zip(general_logits, few_logits):
        assert torch.equal(general, few)
    for general_layers, few_layers in zip(general_states, few_states):
        for general_rows, few_rows in zip(general_layers, few_layers):
            for general, few in zip(general_rows, few_rows):
                assert general.keys() == few.keys()
                for name in general:
                    assert torch.equal(torch.as_tensor(general[name]), torch.as_tensor(few[name])), name
