"""GLM-5.3-Flash checkpoints (`Glm5NextForConditionalGeneration`) to ours and back, computing the same: every part
maps to the GLM variants of ours (KDA, MLA without RoPE, the pooled indexer, Sinkhorn streams, group-routed MoE), the
vision tower is kept unless `text_only`. `export_glm5_next` runs the same plan backwards. The command lines are
`scripts/convert_glm5_next.py` and `scripts/export_glm5_next.py`."""

import re

import torch
from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

from ..configuration import HybridIndexPoolConfig, HybridIndexPoolMultimodalConfig
from .checkpoint_io import SourceCheckpoint
from .engine import (
    ConversionPlan,
    ConversionReport,
    IgnoreRule,
    WeightGroup,
    concatenated,
    convert_checkpoint,
    count_mtp_layers,
    fuse_experts,
    rename,
    to_multimodal_name,
)
from .errors import ConversionError, names_preview
from .export import check_converted_from, export_checkpoint, open_our_checkpoint

# The command that converts these sources, named when a source of another model type is refused.
SCRIPT = "scripts/convert_glm5_next.py"
MODEL_TYPE = "glm5_next"
TEXT_PREFIX = "model.language_model."
VISION_PREFIX = "model.visual."
LAYER_TYPES = {"linear_attention": "linear_attention", "indexed_attention": "indexpool_attention"}
GLM_LAYER_TYPES = {ours: glm for glm, ours in LAYER_TYPES.items()}

# Source -> our names inside a layer. RMSNorms (GLM: `w * x / rms`) are listed apart: they are shifted by one.
KDA_WEIGHTS = {
    **{f"self_attn.{name}": f"linear_attn.{name}" for name in (
        "q_proj.weight", "k_proj.weight", "v_proj.weight", "b_proj.weight", "g_a_proj.weight", "g_b_proj.weight",
        "o_norm.weight", "o_proj.weight")},
    **{f"self_attn.{name}": f"linear_attn.forget_gate.{name}"
       for name in ("f_a_proj.weight", "f_b_proj.weight", "dt_bias", "A_log")},
}
KDA_CONVOLUTIONS = tuple(f"self_attn.{part}_conv1d.weight" for part in "qkv")  # one convolution of ours, q|k|v
MLA_WEIGHTS = {
    f"self_attn.{name}": f"self_attn.{name}" for name in (
        "q_a_proj.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight", "kv_b_proj.weight", "o_proj.weight")
}
MLA_NORMS = {f"self_attn.{name}.weight": f"self_attn.{name}.weight" for name in ("q_a_layernorm", "kv_a_layernorm")}
INDEXER_WEIGHTS = {
    "self_attn.indexer.wq_b.weight": "self_attn.indexer.q_proj.weight",
    "self_attn.indexer.wk.weight": "self_attn.indexer.k_proj.weight",
    "self_attn.indexer.k_norm.weight": "self_attn.indexer.k_norm.weight",
    "self_attn.indexer.k_norm.bias": "self_attn.indexer.k_norm.bias",
    "self_attn.indexer.weights_proj.weight": "self_attn.indexer.head_weights_proj.weight",
    "self_attn.indexer.index_kpool_compress_gate": "self_attn.indexer.pool_gate_proj.weight",
    "self_attn.indexer.index_kpool_compress_ape": "self_attn.indexer.pool_slot_bias",
}
STREAM_WEIGHTS = {
    f"hc_{source}_{part}": f"{ours}_hyper_connection.{part}"
    for source, ours in (("attn", "attn"), ("ffn", "mlp")) for part in ("fn", "base", "scale")
}
LAYER_NORMS = {name: name for name in ("input_layernorm.weight", "post_attention_layernorm.weight")}
DENSE_MLP_WEIGHTS = {f"mlp.{name}.weight": f"mlp.{name}.weight" for name in ("gate_proj", "up_proj", "down_proj")}
MOE_WEIGHTS = {
    "mlp.gate.weight": "mlp.gate.weight",
    "mlp.gate.e_score_correction_bias": "mlp.gate.e_score_correction_bias",
    **{f"mlp.shared_experts.{name}.weight": f"mlp.shared_expert.{name}.weight"
       for name in ("gate_proj", "up_proj", "down_proj")},
}


# GLM-5.3-Flash text config fields that are one field of ours each, GLM's name -> ours.
SAME_FIELDS = {
    **{name: name for name in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
        "attention_bias", "attention_dropout", "index_n_heads", "index_head_dim", "index_topk",
        "linear_conv_kernel_dim", "hc_sinkhorn_iters", "hc_eps", "num_experts_per_tok", "moe_intermediate_size",
        "norm_topk_prob", "n_group", "topk_group", "routed_scaling_factor", "swiglu_limit", "router_aux_loss_coef",
        "hidden_act", "rms_norm_eps", "max_position_embeddings", "initializer_range", "pad_token_id", "bos_token_id",
        "eos_token_id")},
    "index_kpool": "index_pool_size",
    "linear_head_dim": "linear_key_head_dim",
    "linear_num_heads": "linear_num_key_heads",
    "linear_lower_bound": "linear_gate_lower_bound",
    "hc_mult": "hc_count",
}
# The GLM variant of each of our settings: MLA without RoPE, the pooled indexer with head weights reading the query
# latent, KDA, Sinkhorn streams, group-routed MoE with an ungated shared expert, no sinks, local windows or PLE.
GLM_VARIANT = dict(
    attention_type="mla", index_pool_weighting="learned", index_head_weights=True, index_query_source="q_lora",
    index_key_norm="layer_norm_before_pool", index_rope=False, index_sink_windows=0, index_local_windows=0,
    linear_attention_type="kimi_delta", linear_output_gate_act="sigmoid", hc_type="sinkhorn",
    shared_expert_gate=False, moe_router_type="sigmoid_grouped", ple_layers=[],
)


def glm_text_config_to_ours(text, tie_word_embeddings: bool, dtype, source_config: dict | None = None,
                            num_mtp_layers: int = 0):
    """Our text config for GLM-5.3-Flash's text config (`Glm5NextTextConfig`): every field mapped to the GLM variants
    of ours, RMSNorm weights as GLM stores them, `num_mtp_layers` next-n layers of DeepSeek's kind. ConversionError
    for a setting ours cannot reproduce."""
    unknown = sorted(set(text.layer_types) - set(LAYER_TYPES))
    if unknown:
        raise ConversionError(f"The source has layer types {unknown}; only {list(LAYER_TYPES)} convert.")
    if not text.index_kpool_always_select_tail:
        raise ConversionError("The source's index_kpool_always_select_tail is False; IndexPool always attends the "
                              "open window's tokens, so only checkpoints that select the tail convert.")
    mlp_layer_types = list(text.mlp_layer_types)
    try:
        return HybridIndexPoolConfig(
            **{ours: getattr(text, glm) for glm, ours in SAME_FIELDS.items()},
            **GLM_VARIANT,
            layer_types=[LAYER_TYPES[kind] for kind in text.layer_types],
            head_dim=text.index_head_dim,  # with MLA only the RoPE width of a RoPE indexer: unused here
            indexer_types=list(text.indexer_types),
            linear_num_value_heads=text.linear_num_heads,
            linear_value_head_dim=text.linear_head_dim,
            mlp_layer_types=mlp_layer_types,
            num_experts=text.n_routed_experts if "sparse" in mlp_layer_types else 0,
            shared_expert_intermediate_size=text.moe_intermediate_size * text.n_shared_experts,
            rms_norm_unit_offset=False,
            num_mtp_layers=num_mtp_layers,
            mtp_type="deepseek",
            tie_word_embeddings=tie_word_embeddings,
            dtype=dtype,
            source_config=source_config,
        )
    except ValueError as error:
        raise ConversionError(f"The source config does not map to ours: {error}") from error


def build_config(source: SourceCheckpoint, text_only: bool = False):
    """Our config for the source: a `HybridIndexPoolMultimodalConfig` with GLM's vision tower as it is, or the text
    config alone with `text_only`."""
    full = source.transformers_config()
    num_mtp_layers, copies = mtp_layout(source, full.text_config)
    source_config = full.to_dict()
    if copies:  # which shared weights the next-n layers repeat on disk, to write them back on export
        source_config[MTP_COPIES_KEY] = copies
    text_config = glm_text_config_to_ours(full.text_config, bool(full.tie_word_embeddings),
                                          full.dtype or full.text_config.dtype, source_config=source_config,
                                          num_mtp_layers=num_mtp_layers)
    if text_only:
        return text_config
    try:
        return HybridIndexPoolMultimodalConfig(
            text_config=text_config, vision_config=full.vision_config.to_dict(), image_token_id=full.image_token_id,
            video_token_id=full.video_token_id, vision_start_token_id=full.image_start_token_id,
            vision_end_token_id=full.image_end_token_id, video_start_token_id=full.video_start_token_id,
            video_end_token_id=full.video_end_token_id, tie_word_embeddings=bool(full.tie_word_embeddings),
            dtype=text_config.dtype,
        )
    except ValueError as error:
        raise ConversionError(f"The source config does not map to ours: {error}") from error


# The weights a next-n layer may repeat from the main model (DeepSeek-V3's checkpoint layout), under the layer.
MTP_COPIES = ("embed_tokens.weight", "shared_head.head.weight")
# Where our config's `source_config` records which of them the source repeats (the export writes them back).
MTP_COPIES_KEY = "hybrid_indexpool_mtp_copies"


def mtp_layout(source: SourceCheckpoint, text) -> tuple[int, list[str]]:
    """The source's next-n (MTP) layers after its decoder layers, and which of `MTP_COPIES` they hold.
    ConversionError when `num_nextn_predict_layers` disagrees with the weights."""
    layers = re.compile(rf"{re.escape(TEXT_PREFIX)}layers\.(\d+)\.(.*)")
    found = [(int(match.group(1)), match.group(2)) for name in source.weight_names if (match := layers.match(name))]
    extra = [(index, name) for index, name in found if index >= text.num_hidden_layers]
    count = count_mtp_layers((index for index, _ in extra), text.num_hidden_layers,
                             getattr(text, "num_nextn_predict_layers", None), "num_nextn_predict_layers")
    return count, sorted({name for _, name in extra if name in MTP_COPIES})


def shared_with_copies(main: str, copies: list[str], target: str) -> WeightGroup:
    """Our weight `target` from the source's `main` and the `copies` of it the next-n layers hold, which must be
    equal (ConversionError otherwise); the inverse writes it to all of them."""

    def build(tensors):
        different = [name for name in copies if not torch.equal(tensors[name], tensors[main])]
        if different:
            raise ConversionError(f"The source's {names_preview(different)} differ from {main}; our MTP layers share "
                                  "the model's embedding and head, so only checkpoints whose copies are equal convert.")
        return {target: tensors[main]}

    return WeightGroup((main, *copies), (target,), build,
                       lambda tensors: {main: tensors[target], **{name: tensors[target].clone() for name in copies}})


def layer_groups(src: str, dst: str, kind: str, mlp_kind: str, full_indexer: bool, streams: bool, norm, num_experts):
    """The groups of one source decoder layer (prefix `src`) into ours (prefix `dst`)."""
    renamed = dict(STREAM_WEIGHTS) if streams else {}
    norms = dict(LAYER_NORMS)
    groups = []
    if kind == "linear_attention":
        renamed.update(KDA_WEIGHTS)
        groups.append(concatenated(tuple(src + name for name in KDA_CONVOLUTIONS), f"{dst}linear_attn.conv1d.weight"))
    else:
        renamed.update(MLA_WEIGHTS)
        norms.update(MLA_NORMS)
        if full_indexer:
            renamed.update(INDEXER_WEIGHTS)
    if mlp_kind == "sparse":
        renamed.update(MOE_WEIGHTS)
        groups += fuse_experts(f"{src}mlp.experts", f"{dst}mlp.experts", num_experts)
    else:
        renamed.update(DENSE_MLP_WEIGHTS)
    groups += [rename(src + name, dst + ours) for name, ours in renamed.items()]
    return groups + [norm(src + name, dst + ours) for name, ours in norms.items()]


def zero_centred_norm(source: str, target: str) -> WeightGroup:
    """A GLM RMSNorm weight `w` (scaling by `w`) as ours zero-centred (`rms_norm_unit_offset`, scaling by `1 + w`):
    `w - 1`. Exact both ways only for weights in [0.5, 2], where the subtraction does not round: conversions now keep
    GLM's convention instead, and this reads the checkpoints converted before."""
    return WeightGroup((source,), (target,), lambda tensors: {target: tensors[source] - 1},
                       lambda tensors: {source: tensors[target] + 1})


def build_plan(source: SourceCheckpoint, config) -> ConversionPlan:
    """Which source weights become which of ours, and which are left out. For a multimodal target the text model's
    weights go under `model.language_model.` and the vision tower's keep their names."""
    keep_vision = isinstance(config, HybridIndexPoolMultimodalConfig)
    text = config.get_text_config()
    norm = zero_centred_norm if text.rms_norm_unit_offset else rename
    mtp_layers = [f"{TEXT_PREFIX}layers.{text.num_hidden_layers + depth}." for depth in range(text.num_mtp_layers)]
    copies = (text.source_config or {}).get(MTP_COPIES_KEY, [])
    embedding_copy, head_copy = MTP_COPIES
    embedding_copies = [layer + embedding_copy for layer in mtp_layers if embedding_copy in copies]
    head_copies = [layer + head_copy for layer in mtp_layers if head_copy in copies]
    ignore = []
    if text.tie_word_embeddings:  # the head is the embedding, and so are its copies
        embedding_copies += head_copies
        ignore.append(IgnoreRule(r"lm_head\.weight$", "tied to the input embeddings"))
    groups = [shared_with_copies(f"{TEXT_PREFIX}embed_tokens.weight", embedding_copies, "model.embed_tokens.weight"),
              norm(f"{TEXT_PREFIX}norm.weight", "model.norm.weight")]
    if not text.tie_word_embeddings:
        groups.append(shared_with_copies("lm_head.weight", head_copies, "lm_head.weight"))
    if not keep_vision:
        ignore.append(IgnoreRule(re.escape(VISION_PREFIX), "vision tower: the converted model reads text only"))

    for index, (kind, mlp_kind) in enumerate(zip(text.layer_types, text.mlp_types)):
        groups += layer_groups(f"{TEXT_PREFIX}layers.{index}.", f"model.layers.{index}.", kind, mlp_kind,
                               text.indexer_types[index] == "full", True, norm, text.num_experts)
    # Each next-n layer: its input norms and projection, a plain MLA block with its own indexer, its output norm.
    for depth, src in enumerate(mtp_layers):
        dst = f"model.mtp.layers.{depth}."
        groups += [norm(f"{src}enorm.weight", f"{dst}embedding_norm.weight"),
                   norm(f"{src}hnorm.weight", f"{dst}hidden_norm.weight"),
                   rename(f"{src}eh_proj.weight", f"{dst}input_proj.weight"),
                   norm(f"{src}shared_head.norm.weight", f"{dst}output_norm.weight")]
        groups += layer_groups(src, f"{dst}block.", "indexed_attention", text.mtp_mlp_type, True, False, norm,
                               text.num_experts)
    plan = ConversionPlan(groups, ignore)
    if not keep_vision:
        return plan
    plan = plan.with_renamed_targets(to_multimodal_name)
    plan.groups += [rename(name, name) for name in source.weight_names if name.startswith(VISION_PREFIX)]
    return plan


def convert_glm5_next(
    source_dir, output_dir, *, text_only: bool = False, overwrite: bool = False, max_shard_size: int | str = "5GB",
    progress: bool = True, log=print,
) -> ConversionReport:
    """Convert the GLM-5.3-Flash checkpoint in `source_dir` into ours in `output_dir` (with its vision tower, unless
    `text_only`)."""
    source = SourceCheckpoint.open(source_dir)
    source.require_model_type((MODEL_TYPE,), SCRIPT)
    log("converting the language model; the vision tower is left out" if text_only else
        "converting the language model and keeping the vision tower")
    config = build_config(source, text_only)
    return convert_checkpoint(source, build_plan(source, config), config, output_dir, overwrite=overwrite,
                              max_shard_size=max_shard_size, progress=progress, log=log)


def glm_config_from_ours(config) -> Glm5NextConfig:
    """GLM-5.3-Flash's config for our multimodal config: the source config stored at conversion with every field
    ours maps taken from ours (so that settings changed here carry over). ConversionError naming each setting of
    ours that GLM's format cannot express."""
    text = config.get_text_config()
    if not isinstance(config, HybridIndexPoolMultimodalConfig):
        raise ConversionError("GLM-5.3-Flash checkpoints hold a vision tower (Glm5NextForConditionalGeneration) and "
                              "this model has none; export a model converted without --text_only.")
    different = [f"{name} = {getattr(text, name)!r} (GLM: {value!r})" for name, value in GLM_VARIANT.items()
                 if getattr(text, name) != value]
    if text.num_mtp_layers and text.mtp_type != "deepseek":
        different.append(f"mtp_type = {text.mtp_type!r} (GLM: 'deepseek', next-n layers)")
    if text.shared_expert_intermediate_size % text.moe_intermediate_size:
        different.append(f"shared_expert_intermediate_size = {text.shared_expert_intermediate_size} (GLM: a "
                         f"multiple of moe_intermediate_size, {text.moe_intermediate_size})")
    if different:
        raise ConversionError(f"GLM-5.3-Flash's format cannot express {', '.join(different)}; only models of GLM's "
                              "variant export to it.")
    stored = dict(text.source_config or {})
    stored.pop(MTP_COPIES_KEY, None)
    mapped = {glm: getattr(text, ours) for glm, ours in SAME_FIELDS.items()}
    mapped.update(
        layer_types=[GLM_LAYER_TYPES[kind] for kind in text.layer_types],
        indexer_types=list(text.indexer_types or ["full"] * text.num_hidden_layers),
        mlp_layer_types=text.mlp_types,
        n_shared_experts=text.shared_expert_intermediate_size // text.moe_intermediate_size,
        num_nextn_predict_layers=text.num_mtp_layers,
        index_kpool_always_select_tail=True,
        tie_word_embeddings=text.tie_word_embeddings,
    )
    if text.num_experts:
        mapped["n_routed_experts"] = text.num_experts
    return Glm5NextConfig.from_dict({
        **stored,
        "text_config": {**stored.get("text_config", {}), **mapped},
        "vision_config": config.vision_config.to_dict(),
        "image_token_id": config.image_token_id,
        "video_token_id": config.video_token_id,
        "image_start_token_id": config.vision_start_token_id,
        "image_end_token_id": config.vision_end_token_id,
        "video_start_token_id": config.video_start_token_id,
        "video_end_token_id": config.video_end_token_id,
        "tie_word_embeddings": config.tie_word_embeddings,
        "dtype": text.dtype,
    })



def export_glm5_next(
    folder, output_dir, *, overwrite: bool = False, max_shard_size: int | str = "5GB", progress: bool = True,
    log=print,
) -> ConversionReport:
    """Write our checkpoint in `folder` (converted from GLM-5.3-Flash, perhaps fine-tuned since) as a GLM-5.3-Flash
    checkpoint in `output_dir`, loadable by transformers' `Glm5NextForConditionalGeneration` and the engines that
    serve GLM-5.3-Flash: the same weight names, shapes and values as the converted source."""
    checkpoint, config = open_our_checkpoint(folder)
    check_converted_from(folder, config, "GLM-5.3-Flash")
    source_config = glm_config_from_ours(config)
    return export_checkpoint(checkpoint, config, source_config, Glm5NextForConditionalGeneration, build_plan,
                             output_dir, overwrite=overwrite, max_shard_size=max_shard_size, progress=progress,
                             log=log)
