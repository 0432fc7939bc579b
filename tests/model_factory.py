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
