"""GLM-5.3-Flash's feed-forward variants against transformers' `glm5_next`, in float32: the SwiGLU clamp, the
group-limited sigmoid router and the MoE block with ungated shared experts, in every experts implementation."""

import pytest
import torch
from glm_blocks import SWIGLU_LIMIT, glm_text_config, glm_to_ours, our_config_of, randomize
from model_factory import tiny_config
from transformers.models.glm5_next import modeling_glm5_next as glm

from hybrid_indexpool.modeling.moe import HybridIndexPoolExperts, HybridIndexPoolMLP, HybridIndexPoolSparseMoeBlock

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

ATOL = 1e-5


def hidden_states(tokens: int = 37, hidden: int = 64, seed: int = 1) -> torch.Tensor:
    return torch.randn(2, tokens, hidden, generator=torch.Generator().manual_seed(seed))


def test_mlp_with_the_clamp_equals_glm():
    source = glm_text_config()
    theirs = glm.Glm5NextTextMLP(source)
    randomize(theirs, seed=0)
    ours = HybridIndexPoolMLP(our_config_of(source), source.intermediate_size)
    ours.load_state_dict(theirs.state_dict())
    inputs = hidden_states()
    torch.testing.assert_close(ours(inputs), theirs(inputs), atol=ATOL, rtol=ATOL)
    # The clamp was hit: without it the result differs.
    ours.swiglu_limit = None
    assert not torch.allclose(ours(inputs), theirs(inputs), atol=1e-3)


@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm", "eager"])
def test_the_clamp_applies_in_every_experts_implementation(implementation):
    config = tiny_config(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16, swiglu_limit=SWIGLU_LIMIT)
    experts = HybridIndexPoolExperts(config)
    randomize(experts, seed=0)
    generator = torch.Generator().manual_seed(2)
    inputs = torch.randn(29, 64, generator=generator)
    weights, index = torch.rand(29, 6, generator=generator).softmax(-1).topk(2, dim=-1)
    experts.config._experts_implementation = "eager"
    expected = experts(inputs, index, weights)
    experts.config._experts_implementation = implementation
    torch.testing.assert_close(experts(inputs, index, weights), expected, atol=ATOL, rtol=ATOL)
    experts.swiglu_limit = None
    assert not torch.allclose(experts(inputs, index, weights), expected, atol=1e-3)


@pytest.mark.parametrize("n_group, topk_group", [(1, 1), (2, 1), (4, 2), (4, 4)])
@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm", "eager"])
def test_moe_block_equals_glm(n_group, topk_group, implementation):
    source = glm_text_config(n_group=n_group, topk_group=topk_group)
    theirs = glm.Glm5NextTextMoE(source)
    theirs.experts.config._experts_implementation = "eager"
    randomize(theirs, seed=n_group + topk_group)
    ours = HybridIndexPoolSparseMoeBlock(our_config_of(source))
    ours.load_state_dict(glm_to_ours(theirs.state_dict()))
    ours.experts.config._experts_implementation = implementation
    inputs = hidden_states(seed=n_group)
    output, router_logits = ours(inputs)
    torch.testing.assert_close(output, theirs(inputs), atol=ATOL, rtol=ATOL)
    # The router logits (for the load-balancing loss) are GLM's: before the sigmoid.
    their_logits, their_weights, their_ids = theirs.gate(inputs)
    torch.testing.assert_close(router_logits.reshape(-1, 8), their_logits, atol=ATOL, rtol=ATOL)
    _, our_weights, our_ids = ours.gate(inputs.reshape(-1, 64))
    order, their_order = our_ids.argsort(-1), their_ids.argsort(-1)
    assert torch.equal(our_ids.gather(-1, order), their_ids.gather(-1, their_order))
    torch.testing.assert_close(our_weights.gather(-1, order), their_weights.gather(-1, their_order))


def test_the_router_picks_only_inside_its_best_groups_and_the_bias_steers_only_the_choice():
    source = glm_text_config(n_group=4, topk_group=1)
    block = HybridIndexPoolSparseMoeBlock(our_config_of(source, norm_topk_prob=False))
    randomize(block, seed=3)
    inputs = hidden_states().reshape(-1, 64)
    logits, weights, ids = block.gate(inputs)
    assert bool((ids // 2 == ids[:, :1] // 2).all())  # one group of 2 experts: both picks in it
    # Weights are the sigmoid scores of the chosen experts (not the biased ones), times the scaling factor.
    torch.testing.assert_close(weights, logits.sigmoid().gather(-1, ids) * 2.5)
    with torch.no_grad():
        block.gate.e_score_correction_bias.fill_(-10.0)
        block.gate.e_score_correction_bias[5] = 10.0
    assert bool((block.gate(inputs)[2] == 5).any(dim=-1).all())


def test_grouped_router_is_saved_under_glms_names():
    block = HybridIndexPoolSparseMoeBlock(our_config_of(glm_text_config()))
    names = set(block.state_dict())
    assert {"gate.weight", "gate.e_score_correction_bias", "shared_expert.gate_proj.weight"} <= names
    assert not any(name.startswith("shared_expert_gate") for name in names)
