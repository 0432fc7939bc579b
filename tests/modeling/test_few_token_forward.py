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
