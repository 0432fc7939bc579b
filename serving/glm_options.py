"""Which checkpoints the vLLM plugin serves with its GLM-5.3-Flash decoder (`vllm_glm.GlmModel`), and what in them it
cannot serve. Nothing here imports vLLM: the engine-start checks (`vllm_config.py`) read it."""

# The settings that make a checkpoint a GLM-5.3-Flash variant: any of them (at the value given) selects GLM's decoder.
GLM_MARKERS = {
    "attention_type": "mla",
    "linear_attention_type": "kimi_delta",
    "hc_type": "sinkhorn",
    "moe_router_type": "sigmoid_grouped",
}
# What GLM's decoder implements: the value it serves for each setting (GLM-5.3-Flash's).
GLM_SERVED = {
    "attention_type": "mla",
    "linear_attention_type": "kimi_delta",
    "index_query_source": "q_lora",
    "index_key_norm": "layer_norm_before_pool",
    "index_rope": False,
    "index_key_cache_dtype": "auto",
    "linear_output_gate_act": "sigmoid",
    "hidden_act": "silu",
}


def serves_glm(config) -> bool:
    """Whether the vLLM plugin serves `config` with its GLM-5.3-Flash decoder (a conversion of GLM-5.3-Flash, or a
    model with any of its variants)."""
    return any(getattr(config, name) == value for name, value in GLM_MARKERS.items())


def glm_unsupported_options(config) -> list[str]:
    """Why the GLM decoder cannot serve `config` (empty when it can)."""
    problems = [f"{name} = {getattr(config, name)!r} with GLM-5.3-Flash's variants (the vLLM model serves {name} = "
                f"{served!r} there)" for name, served in GLM_SERVED.items() if getattr(config, name) != served]
    if config.hc_type != "sinkhorn" and config.hc_count > 1:
        problems.append(f"hyper-connections hc_type = {config.hc_type!r} with GLM-5.3-Flash's variants (the vLLM "
                        "model serves hc_type = 'sinkhorn', or hc_count = 1, there)")
    if "sparse" in config.mlp_types and config.moe_router_type != "sigmoid_grouped":
        problems.append(f"moe_router_type = {config.moe_router_type!r} with GLM-5.3-Flash's variants (the vLLM model "
                        "serves the 'sigmoid_grouped' router there)")
    if "sparse" in config.mlp_types and config.shared_expert_gate:
        problems.append("shared_expert_gate = True with GLM-5.3-Flash's variants (the vLLM model adds GLM's shared "
                        "expert ungated)")
    if config.ple_layers:
        problems.append(f"per-layer n-gram embeddings (ple_layers = {config.ple_layers}) with GLM-5.3-Flash's "
                        "variants")
    if "linear_attention" not in config.layer_types:
        problems.append("a model without Kimi Delta Attention layers (layer_types has no 'linear_attention')")
    return problems
