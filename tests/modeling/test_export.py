"""torch.export: a prefill exports as the model, a one-token decode step with a cache through
`HybridIndexPoolDecodeStep`; the exported programs compute what the eager model computes, and eager inputs are still
refused with their clear errors."""

import copy

import pytest
import torch
from model_factory import KIMI_DELTA, MLA, tiny_model

from hybrid_indexpool import HybridIndexPoolCache
from hybrid_indexpool.modeling.export import HybridIndexPoolDecodeStep

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class Prefill(torch.nn.Module):
    """A prefill without a cache: logits of every token."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids, use_cache=False).logits


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "non-strict"])
def test_a_prefill_beyond_the_budget_exports_and_computes_the_eager_logits(strict):
    model = tiny_model(index_topk=8).eval()  # 30 tokens: 7 windows of 4 seen, 2 kept
    input_ids = torch.randint(1, 97, (1, 30))
    with torch.no_grad():
        program = torch.export.export(Prefill(model), (input_ids,), strict=strict)
        other = torch.randint(1, 97, (1, 30))
        torch.testing.assert_close(program.module()(other), model(other, use_cache=False).logits, atol=1e-5, rtol=0)
    # Outside the trace the checks that read values still refuse bad ids in one clear message.
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model(torch.full((1, 30), 500))


@pytest.mark.parametrize("variant", [dict(), dict(**KIMI_DELTA, **MLA)], ids=["gdn-gqa", "kda-mla"])
def test_a_decode_step_with_a_cache_exports_and_continues_as_the_eager_model(variant):
    """The step exports once (the mask's length dynamic) and then decodes several tokens for two left-padded rows,
    each equal to the eager step over a copy of the cache; the cache's own tensors are what the program updates."""
    model = tiny_model(index_topk=8, **variant).eval()
    input_ids = torch.randint(1, 97, (2, 30))
    mask = torch.ones(2, 30, dtype=torch.long)
    mask[1, :5] = 0
    cache = HybridIndexPoolCache(model.config, max_cache_len=40)
    new_tokens = torch.randint(1, 97, (2, 4))
    with torch.no_grad():
        model(input_ids, attention_mask=mask, cache=cache)
        reference = copy.deepcopy(cache)
        step = HybridIndexPoolDecodeStep(model, cache)
        columns = torch.export.Dim("columns", max=40)
        program = torch.export.export(step, (new_tokens[:, :1], torch.cat([mask, mask[:, :1]], dim=1)),
                                      dynamic_shapes=({}, {1: columns}), strict=True).module()
        for index in range(new_tokens.shape[1]):
            mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
            expected = model(new_tokens[:, index:index + 1], attention_mask=mask, cache=reference).logits
            torch.testing.assert_close(program(new_tokens[:, index:index + 1], mask), expected, atol=1e-5, rtol=0)
    assert cache.get_seq_length() == reference.get_seq_length() == 34
    torch.testing.assert_close(cache.index_layers[0].lengths, reference.index_layers[0].lengths, atol=0, rtol=0)


def test_the_decode_step_refuses_a_cache_it_cannot_export():
    model = tiny_model().eval()
    with pytest.raises(ValueError, match="max_cache_len=N"):
        HybridIndexPoolDecodeStep(model, HybridIndexPoolCache(model.config))
