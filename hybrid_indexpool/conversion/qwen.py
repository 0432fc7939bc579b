"""What every Qwen hybrid (Qwen3-Next, Qwen3.5, Qwen4-Exp) maps the same way: config fields, where the text model's
weights live, the plan outside the layers, gated attention and MoE blocks."""

from ..configuration import HybridIndexPoolConfig
from .checkpoint_io import SourceCheckpoint
from .engine import ConversionPlan, IgnoreRule, fuse_experts, rename

# For text, the position streams of the Qwen multimodal RoPE are equal, which makes it plain RoPE.
MULTIMODAL_ROPE_KEYS = ("mrope_section", "mrope_interleaved")


def qwen_hybrid_settings(full_config, text_config, multimodal_rope: bool = False) -> dict:
    """Our config fields that every Qwen hybrid (Qwen3-Next, Qwen3.5, Qwen4-Exp) maps the same way: widths, gated
    attention with partial RoPE (multimodal-RoPE sections dropped unless `multimodal_rope`), Gated DeltaNet, norms,
    special tokens, dtype. `full_config` is the checkpoint's config, `text_config` its text part (the same object
    for text checkpoints)."""
    text = text_config
    rope = {key: value for key, value in text.rope_parameters.items()
            if multimodal_rope or key not in MULTIMODAL_ROPE_KEYS}
    return dict(
        vocab_size=text.vocab_size,
        hidden_size=text.hidden_size,
        num_hidden_layers=text.num_hidden_layers,
        num_attention_heads=text.num_attention_heads,
        num_key_value_heads=text.num_key_value_heads,
        head_dim=text.head_dim,
        partial_rotary_factor=rope.get("partial_rotary_factor", 1.0),
        rope_parameters=rope,
        attention_output_gate=True,
        attention_bias=text.attention_bias,
        attention_dropout=text.attention_dropout,
        linear_num_key_heads=text.linear_num_key_heads,
        linear_num_value_heads=text.linear_num_value_heads,
        linear_key_head_dim=text.linear_key_head_dim,
        linear_value_head_dim=text.linear_value_head_dim,
        linear_conv_kernel_dim=text.linear_conv_kernel_dim,
        hidden_act=text.hidden_act,
        rms_norm_eps=text.rms_norm_eps,
        max_position_embeddings=text.max_position_embeddings,
        initializer_range=text.initializer_range,
        tie_word_embeddings=bool(full_config.tie_word_embeddings),
        pad_token_id=text.pad_token_id,
        bos_token_id=text.bos_token_id,
        eos_token_id=text.eos_token_id,
        dtype=full_config.dtype or text.dtype,
    )


def qwen_source_configs(source: SourceCheckpoint, multimodal: bool):
    """A Qwen source's full config, read by transformers (which fills defaults and old field names), and its text
    part (the same object for a text-only checkpoint)."""
    full = source.transformers_config()
    return full, (full.get_text_config() if multimodal else full)


def qwen_text_prefix(multimodal: bool) -> str:
    """Where a Qwen checkpoint keeps its text model's weights."""
    return "model.language_model." if multimodal else "model."


def qwen_outer_plan(config: HybridIndexPoolConfig, multimodal: bool, keep_vision: bool = False) -> ConversionPlan:
    """The part of a Qwen hybrid's plan outside the layers: the embedding, the head (or its tie), and what is left
    out (a multimodal checkpoint's vision tower unless `keep_vision`). The MTP head is each family's to map."""
    groups = [rename(f"{qwen_text_prefix(multimodal)}embed_tokens.weight", "model.embed_tokens.weight")]
    ignore = []
    if multimodal and not keep_vision:
        ignore.append(IgnoreRule(r"model\.visual\.", "vision tower: the converted model reads text only"))
    if config.tie_word_embeddings:
        ignore.append(IgnoreRule(r"lm_head\.weight$", "tied to the input embeddings"))
    else:
        groups.append(rename("lm_head.weight", "lm_head.weight"))
    return ConversionPlan(groups, ignore)


def qwen_attention_parts(config: HybridIndexPoolConfig) -> list[str]:
    """Gated attention weights named alike in every Qwen hybrid and in ours (relative to the layer)."""
    projections = ("q_proj", "k_proj", "v_proj", "o_proj")
    parts = [f"self_attn.{name}.weight" for name in projections + ("q_norm", "k_norm")]
    if config.attention_bias:
        parts += [f"self_attn.{name}.bias" for name in projections]
    return parts


def qwen_moe_plan(src: str, dst: str, config: HybridIndexPoolConfig, weight_names,
                  fused_like: str | None = None) -> tuple[list[str], list]:
    """A Qwen MoE block: the parts renamed as they are (router, shared expert) and the groups that fuse per-expert
    weights (none when the experts are already fused on disk, in our layout; as those of the layer prefix
    `fused_like` when given)."""
    parts, groups = ["mlp.gate.weight"], []
    if config.shared_expert_intermediate_size:
        parts += [f"mlp.shared_expert.{name}.weight" for name in ("gate_proj", "up_proj", "down_proj")]
        parts += ["mlp.shared_expert_gate.weight"]
    if f"{fused_like or src}mlp.experts.gate_up_proj" in weight_names:
        parts += ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    else:
        groups = fuse_experts(f"{src}mlp.experts", f"{dst}mlp.experts", config.num_experts)
    return parts, groups


