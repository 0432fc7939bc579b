"""Tiny GLM-5.3-Flash text configs (transformers' `glm5_next`, no downloads) and the weight copies that the
block-level tests of the Sinkhorn streams and the GLM feed-forward variants share."""

import torch
from model_factory import tiny_config
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig

# Small enough that random weights cross it often: the clamp changes the result.
SWIGLU_LIMIT = 0.3


def glm_text_config(**overrides) -> Glm5NextTextConfig:
    """A tiny GLM-5.3-Flash text config (8 experts of width 16, two shared experts' worth of shared width)."""
    settings = dict(
        vocab_size=97, hidden_size=64, intermediate_size=96, moe_intermediate_size=16, num_hidden_layers=4,
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=2,
        routed_scaling_factor=2.5, norm_topk_prob=True, swiglu_limit=SWIGLU_LIMIT, hc_mult=3, rms_norm_eps=1e-5,
        pad_token_id=0,
    )
    settings.update(overrides)
    return Glm5NextTextConfig(**settings)


def our_config_of(source: Glm5NextTextConfig, **overrides):
    """The HybridIndexPool settings of a GLM text config's feed-forward blocks."""
    settings = dict(
        hidden_size=source.hidden_size, intermediate_size=source.intermediate_size,
        num_experts=source.n_routed_experts, num_experts_per_tok=source.num_experts_per_tok,
        moe_intermediate_size=source.moe_intermediate_size,
        shared_expert_intermediate_size=source.moe_intermediate_size * source.n_shared_experts,
        shared_expert_gate=False, norm_topk_prob=source.norm_topk_prob, moe_router_type="sigmoid_grouped",
        n_group=source.n_group, topk_group=source.topk_group, routed_scaling_factor=source.routed_scaling_factor,
        swiglu_limit=source.swiglu_limit, rms_norm_eps=source.rms_norm_eps,
    )
    settings.update(overrides)
    return tiny_config(**settings)


def randomize(module: torch.nn.Module, seed: int, std: float = 0.3) -> None:
    """Random values in every parameter and buffer (the router's correction bias included)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            tensor.copy_(torch.randn(tensor.shape, generator=generator) * std)


def glm_to_ours(state_dict: dict) -> dict:
    """GLM's MoE names to ours: the shared experts are `shared_expert` here; everything else keeps its name."""
    return {name.replace("shared_experts.", "shared_expert."): tensor for name, tensor in state_dict.items()}
