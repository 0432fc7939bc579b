"""Tiny random configs and models shared by the tests (no downloads)."""

import torch

from hybrid_indexpool import HybridIndexPoolConfig, HybridIndexPoolForCausalLM


def tiny_config(**overrides) -> HybridIndexPoolConfig:
    """A 4-layer model (3 Gated DeltaNet + 1 IndexPool) small enough for CPU tests; budget 8 tokens, r = 4."""
    settings = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        partial_rotary_factor=0.5,
        index_n_heads=3,
        index_head_dim=16,
        index_topk=8,
        index_pool_size=4,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        pad_token_id=0,
        eos_token_id=None,
    )
    settings.update(overrides)
    return HybridIndexPoolConfig(**settings)


def randomize_parameters(model: torch.nn.Module, selected, seed: int, std: float) -> None:
    """Replace every parameter whose name `selected(name)` accepts by seeded normal values of standard deviation
    `std` (for parts that start at constants, such as zero-centred norms and gates)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if selected(name):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * std)


def randomize_indexer(model: torch.nn.Module, seed: int = 0) -> None:
    """Give the pooling gates, slot biases and norms non-trivial values (they start at zero)."""
    randomize_parameters(model, lambda name: name.endswith(("pool_gate_proj.weight", "pool_slot_bias"))
                         or "norm" in name, seed, 0.5)


def tiny_model(seed: int = 0, **overrides) -> HybridIndexPoolForCausalLM:
    torch.manual_seed(seed)
    model = HybridIndexPoolForCausalLM(tiny_config(**overrides)).eval()
    randomize_indexer(model, seed)
    return model


# Kimi Delta Attention in the linear-attention layers (GLM-5.3-Flash's variant): as many value heads as key heads, of
# the same width, and GLM's forget-gate lower bound.
KIMI_DELTA = dict(linear_attention_type="kimi_delta", linear_num_value_heads=2, linear_gate_lower_bound=-5.0)

# MLA IndexPool attention (GLM-5.3-Flash's variant, NoPE) at toy ranks.
MLA = dict(attention_type="mla", q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16)


# The variants every drafting mode of generate() is checked on: r = 4, 1 and 16, fp8 pooled keys, GLM-5.3-Flash's style
# (KDA + MLA, a shared indexer) and Qwen4-Exp's (hyper-connections, PLE).
HC_PLE = dict(hc_count=3, hc_lowrank=8, ple_layers=[0, 2], ple_ngram_size=3, ple_heads_per_ngram=2, ple_embed_dim=12,
              eos_token_id=2)
GLM_STYLE = dict(**KIMI_DELTA, **MLA, indexer_types=["full", "full", "full", "shared"], layer_types=[
    "linear_attention", "indexpool_attention", "linear_attention", "indexpool_attention"])
DRAFTING_VARIANTS = {
    "gdn-r4": dict(),
    "r1": dict(index_pool_size=1, index_topk=4),
    "r16": dict(index_pool_size=16, index_topk=16),
    "fp8": dict(index_key_cache_dtype="float8_e4m3fn"),
    "glm-style": GLM_STYLE,
    "qwen4-exp-style": HC_PLE,
}


def repetitive_prompt(length: int, seed: int = 0) -> torch.Tensor:
    """A prompt that repeats a short phrase, so that prompt lookup finds n-gram matches to draft from."""
    generator = torch.Generator().manual_seed(seed)
    phrase = torch.randint(3, 97, (7,), generator=generator)
    return phrase.repeat(length // 7 + 1)[None, :length]
