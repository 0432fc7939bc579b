"""Qwen4-Exp checkpoints (text `qwen4_exp_text` and multimodal `qwen4_exp`) to ours and back, computing the same: QSA
becomes IndexPool with learned pooling starting at the mean, everything else maps one to one. `export_qwen4_exp` runs
the same plan backwards. The command lines are `scripts/convert_qwen4_exp.py` and `scripts/export_qwen4_exp.py`."""

import re

import torch
from transformers import Qwen4ExpConfig, Qwen4ExpForCausalLM, Qwen4ExpForConditionalGeneration, Qwen4ExpTextConfig

from ..configuration import HybridIndexPoolConfig, HybridIndexPoolMultimodalConfig
from ..modeling.per_layer_embedding import HybridIndexPoolNGramEmbedding
from .checkpoint_io import SourceCheckpoint
from .engine import (
    ConcatenatedWeight,
    ConversionPlan,
    ConversionReport,
    IgnoreRule,
    WeightGroup,
    convert_checkpoint,
    count_mtp_layers,
    rename,
    to_multimodal_name,
)
from .errors import ConversionError
from .export import check_converted_from, export_checkpoint, open_our_checkpoint
from .qwen import (
    qwen_attention_parts,
    qwen_hybrid_settings,
    qwen_moe_plan,
    qwen_outer_plan,
    qwen_source_configs,
    qwen_text_prefix,
)

# The command that converts these sources, named when a source of another model type is refused.
SCRIPT = "scripts/convert_qwen4_exp.py"
TEXT_MODEL_TYPE, MULTIMODAL_MODEL_TYPE = "qwen4_exp_text", "qwen4_exp"
VISION_PREFIX = "model.visual."
QSA_FIELDS = ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")


def build_config(source: SourceCheckpoint, pool_weighting: str = "learned", text_only: bool = False):
    """Our config for the source: every field mapped; QSA becomes IndexPool with the same budget and pool size. A
    multimodal source gives a `HybridIndexPoolMultimodalConfig` (the vision tower's config as it is) unless
    `text_only`."""
    multimodal = source.model_type == MULTIMODAL_MODEL_TYPE
    keep_vision = multimodal and not text_only
    full, text = qwen_source_configs(source, multimodal=multimodal)
    missing = [name for name in QSA_FIELDS if getattr(text, name, None) is None]
    if missing:
        raise ConversionError(
            f"The source config lacks the QSA indexer settings {missing}; this converter reads Qwen4-Exp checkpoints "
            "with an indexer (for full-attention checkpoints without one, use scripts/convert_qwen3_next.py)."
        )
    layer_types = ["indexpool_attention" if kind == "indexed_attention" else kind for kind in text.layer_types]
    try:
        text_config = HybridIndexPoolConfig(
            **qwen_hybrid_settings(full, text, multimodal_rope=keep_vision),
            layer_types=layer_types,
            index_n_heads=text.indexer_n_heads,
            index_head_dim=text.indexer_head_dim,
            index_topk=text.indexer_budget,
            index_pool_size=text.indexer_compress_ratio,
            index_pool_weighting=pool_weighting,
            index_head_weights=False,
            linear_output_gate_act=text.output_gate_type or text.hidden_act,
            num_experts=text.num_experts,
            num_experts_per_tok=text.num_experts_per_tok,
            moe_intermediate_size=text.moe_intermediate_size,
            shared_expert_intermediate_size=text.shared_expert_intermediate_size,
            norm_topk_prob=text.norm_topk_prob,
            hc_count=text.hc_count,
            hc_lowrank=text.hc_lowrank,
            ple_layers=[layer_id - 1 for layer_id in text.ple_layer_ids],  # Qwen4-Exp counts layers from 1
            ple_embed_dim=text.ple_embed_dim,
            ple_conv_kernel_size=text.ple_conv_kernel_size,
            ple_ngram_size=text.ngram_size,
            ple_heads_per_ngram=text.heads_per_ngram,
            ple_ngram_vocab_size_base=text.ngram_vocab_size_base,
            ple_vocab_size_multiple=text.make_ngram_vocab_size_divisible_by,
            ple_hash_seed=text.seed,
            num_mtp_layers=mtp_layer_count(source, text),
            mtp_type="qwen4_exp",
            source_config=full.to_dict(),
        )
        if not keep_vision:
            return text_config
        return HybridIndexPoolMultimodalConfig(
            text_config=text_config, vision_config=full.vision_config.to_dict(), image_token_id=full.image_token_id,
            video_token_id=full.video_token_id, vision_start_token_id=full.vision_start_token_id,
            vision_end_token_id=full.vision_end_token_id, tie_word_embeddings=bool(full.tie_word_embeddings),
            dtype=text_config.dtype,
        )
    except ValueError as error:
        raise ConversionError(f"The source config does not map to ours: {error}") from error


def split_index_projection(source: str, target_prefix: str, config: HybridIndexPoolConfig) -> WeightGroup:
    """Qwen4-Exp's fused `index_qk_proj` (the query heads' rows, then the one key head's) -> our indexer's
    `q_proj` and `k_proj`."""
    query_rows = config.index_n_heads * config.index_head_dim
    targets = (f"{target_prefix}.q_proj.weight", f"{target_prefix}.k_proj.weight")

    def build(tensors):
        weight = tensors[source]
        if weight.shape[0] != query_rows + config.index_head_dim:
            raise ConversionError(
                f"{source} has {weight.shape[0]} rows; indexer_n_heads + 1 key head of indexer_head_dim imply "
                f"{query_rows + config.index_head_dim}. Only one indexer key head converts."
            )
        return {targets[0]: weight[:query_rows], targets[1]: weight[query_rows:]}

    return WeightGroup((source,), targets, build,
                       lambda tensors: {source: torch.cat([tensors[targets[0]], tensors[targets[1]]])})


def check_hash_tables(sources: tuple[str, ...], embedding: HybridIndexPoolNGramEmbedding) -> WeightGroup:
    """A group that writes nothing: it checks that the source's stored n-gram hash multipliers, table sizes and
    offsets are the ones our model computes from the config (else the converted embeddings would be looked up in the
    wrong rows)."""
    ours = (embedding.multiplier_values, embedding.table_sizes, embedding.table_offsets)

    def build(tensors):
        for name, expected in zip(sources, ours):
            if tensors[name].tolist() != expected:
                raise ConversionError(
                    f"{name} is {tensors[name].tolist()}, but the config's hashing gives {expected}; the checkpoint's "
                    "n-gram tables do not follow its config.json (seed, vocabulary or n-gram settings)."
                )
        return {}

    return WeightGroup(sources, (), build,
                       lambda tensors: {name: torch.tensor(values) for name, values in zip(sources, ours)})


def build_plan(source: SourceCheckpoint, config) -> ConversionPlan:
    """Which source weights become which of ours, and which are left out. For a multimodal target the text model's
    weights go under `model.language_model.` and the vision tower's keep their names."""
    keep_vision = isinstance(config, HybridIndexPoolMultimodalConfig)
    text_plan = build_text_plan(source, config.get_text_config(), keep_vision)
    if not keep_vision:
        return text_plan
    plan = text_plan.with_renamed_targets(to_multimodal_name)
    plan.groups += [rename(name, name) for name in source.weight_names if name.startswith(VISION_PREFIX)]
    return plan



def build_text_plan(source: SourceCheckpoint, config: HybridIndexPoolConfig, keep_vision: bool) -> ConversionPlan:
    """The plan of our causal LM's weights (the vision tower left out unless `keep_vision`, which another part of
    the plan then covers)."""
    multimodal = source.model_type == MULTIMODAL_MODEL_TYPE
    prefix = qwen_text_prefix(multimodal)
    names = source.weight_names
    outer = qwen_outer_plan(config, multimodal, keep_vision)
    groups, ignore, concatenations = list(outer.groups), outer.ignore, []
    # A final mix writes nothing back; vLLM drops such weights where a checkpoint stores them, and so do we.
    ignore.append(IgnoreRule(rf"(mtp\.|{re.escape(prefix)})hyper_connection_mixer\.block_inject_weight$",
                             "write-back weights of a final mix, which nothing reads"))
    groups += [rename(f"{prefix}hyper_connection_mixer.{part}", f"model.hyper_connection_mixer.{part}")
               for part in MIXER]

    for index, kind in enumerate(config.layer_types):
        layer_groups, layer_concatenations = decoder_layer_plan(f"{prefix}layers.{index}.", f"model.layers.{index}.",
                                                                kind, config, names, index in config.ple_layers,
                                                                index)
        groups, concatenations = groups + layer_groups, concatenations + layer_concatenations
    groups += mtp_plan(config, names, prefix)
    return ConversionPlan(groups, ignore, concatenations)


HYPER_CONNECTION = ("hc_norm.weight", "input_mix_weight_down.weight", "input_mix_weight_up.weight",
                    "block_inject_weight.weight")
MIXER = HYPER_CONNECTION[:3]  # a final mix writes nothing back
# Qwen4-Exp's MTP head (`mtp.` at the top of the checkpoint) -> ours (`model.mtp.`), besides its decoder layers.
MTP_WEIGHTS = {
    "pre_fc_norm_embedding.weight": "embedding_norm.weight",
    "pre_fc_norm_hidden.weight": "streams_norm.weight",
    "fc_embedding.weight": "embedding_proj.weight",
    "fc_hidden.weight": "stream_proj.weight",
    **{f"hyper_connection_mixer.{part}": f"hyper_connection_mixer.{part}" for part in MIXER},
}


def decoder_layer_plan(src: str, dst: str, kind: str, config: HybridIndexPoolConfig, names, ple: bool, index: int,
                       experts_like: str | None = None) -> tuple[list[WeightGroup], list[ConcatenatedWeight]]:
    """The groups (and the concatenated n-gram table of a PLE layer) of one Qwen4-Exp decoder layer, source prefix
    `src`, ours `dst`; an MTP layer's experts are stored as those of the decoder layer prefix `experts_like`."""
    groups, concatenations = [], []
    parts = [f"{block}_hyper_connection.{part}" for block in ("attn", "mlp") for part in HYPER_CONNECTION]
    if kind == "linear_attention":
        parts += [f"linear_attn.{name}" for name in (
            "in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight", "conv1d.weight",
            "dt_bias", "A_log", "norm.weight", "out_proj.weight")]
    else:
        parts += qwen_attention_parts(config)
        groups.append(split_index_projection(f"{src}self_attn.indexer.index_qk_proj.weight",
                                             f"{dst}self_attn.indexer", config))
        groups.append(rename(f"{src}self_attn.indexer.q_layernorm.weight", f"{dst}self_attn.indexer.q_norm.weight"))
        groups.append(rename(f"{src}self_attn.indexer.k_layernorm.weight", f"{dst}self_attn.indexer.k_norm.weight"))
    moe_parts, moe_groups = qwen_moe_plan(src, dst, config, names, fused_like=experts_like)
    parts, groups = parts + moe_parts, groups + moe_groups
    if ple:
        parts += [f"ple.{name}.weight" for name in (
            "conv1d", "key_proj", "value_proj", "norm_key", "norm_query", "norm_conv")]
        table = f"{src}ple.ple_embedding.ngram_embedding"
        part_pattern = re.compile(re.escape(table) + r"\.shard_(\d+)\.weight$")
        table_parts = sorted((name for name in names if part_pattern.match(name)),
                             key=lambda name: int(part_pattern.match(name).group(1)))
        if f"{table}.weight" in names:
            table_parts = [f"{table}.weight"]
        if not table_parts:
            raise ConversionError(f"The source has no n-gram table for PLE layer {index + 1} ({table}.shard_*); "
                                  "the checkpoint is incomplete.")
        concatenations.append(ConcatenatedWeight(tuple(table_parts), f"{dst}ple.ple_embedding.ngram_embedding.weight"))
        buffers = tuple(f"{src}ple.ple_embedding.{name}"
                        for name in ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets"))
        if all(name in names for name in buffers):
            groups.append(check_hash_tables(
                buffers, HybridIndexPoolNGramEmbedding(config, config.ple_layers.index(index))
            ))
    return groups + [rename(src + part, dst + part) for part in parts], concatenations


def mtp_plan(config: HybridIndexPoolConfig, names, prefix: str) -> list[WeightGroup]:
    """The groups of Qwen4-Exp's MTP head: its input norms and projections, its final mix, and its decoder layers
    (QSA attention, MoE, hyper-connections, no PLE)."""
    if not config.num_mtp_layers:
        return []
    groups = [rename(f"mtp.{name}", f"model.mtp.{ours}") for name, ours in MTP_WEIGHTS.items()]
    for depth in range(config.num_mtp_layers):
        layer_groups, _ = decoder_layer_plan(f"mtp.layers.{depth}.", f"model.mtp.layers.{depth}.",
                                             "indexed_attention", config, names, False, depth,
                                             experts_like=f"{prefix}layers.0.")
        groups += layer_groups
    return groups


def mtp_layer_count(source: SourceCheckpoint, text) -> int:
    """The source's MTP decoder layers (`mtp.layers.N.`); ConversionError when `mtp_num_hidden_layers` disagrees."""
    pattern = re.compile(r"mtp\.layers\.(\d+)\.")
    found = (int(match.group(1)) for name in source.weight_names if (match := pattern.match(name)))
    return count_mtp_layers(found, 0, getattr(text, "mtp_num_hidden_layers", None), "mtp_num_hidden_layers")


def indexer_prefixes(config: HybridIndexPoolConfig) -> list[str]:
    """Where our text model keeps each indexer: every IndexPool layer's, then every MTP layer's."""
    return ([f"model.layers.{index}.self_attn.indexer" for index, kind in enumerate(config.layer_types)
             if kind == "indexpool_attention"]
            + [f"model.mtp.layers.{depth}.self_attn.indexer" for depth in range(config.num_mtp_layers)])


def pooling_weights(config) -> dict[str, torch.Tensor]:
    """Learned pooling at exactly the mean: a zero gate projection and zero slot biases in every IndexPool layer."""
    if isinstance(config, HybridIndexPoolMultimodalConfig):
        return {to_multimodal_name(name): tensor for name, tensor in pooling_weights(config.text_config).items()}
    if config.index_pool_weighting != "learned":
        return {}
    dtype = config.dtype if isinstance(config.dtype, torch.dtype) else getattr(torch, str(config.dtype or "float32"))
    weights = {}
    for indexer in indexer_prefixes(config):
        weights[f"{indexer}.pool_gate_proj.weight"] = torch.zeros(config.index_head_dim, config.hidden_size,
                                                                  dtype=dtype)
        weights[f"{indexer}.pool_slot_bias"] = torch.zeros(config.index_pool_size, config.index_head_dim,
                                                           dtype=dtype)
    return weights


def convert_qwen4_exp(
    source_dir, output_dir, *, pool_weighting: str = "learned", text_only: bool = False, overwrite: bool = False,
    max_shard_size: int | str = "5GB", progress: bool = True, log=print,
) -> ConversionReport:
    """Convert the Qwen4-Exp checkpoint in `source_dir` into ours in `output_dir` (a multimodal one with its vision
    tower, unless `text_only`)."""
    source = SourceCheckpoint.open(source_dir)
    source.require_model_type((TEXT_MODEL_TYPE, MULTIMODAL_MODEL_TYPE), SCRIPT)
    if source.model_type == MULTIMODAL_MODEL_TYPE:
        log("multimodal checkpoint: converting its language model; the vision tower is left out" if text_only else
            "multimodal checkpoint: converting the language model and keeping the vision tower")
    config = build_config(source, pool_weighting, text_only)
    return convert_checkpoint(
        source, build_plan(source, config), config, output_dir, overwrite=overwrite, max_shard_size=max_shard_size,
        extra_tensors=pooling_weights(config), progress=progress, log=log,
    )


# Our settings Qwen4-Exp's format fixes: the Qwen variant of each (GQA with an output gate, a QSA indexer reading the
# hidden state with RMSNorm after mean pooling and RoPE, Gated DeltaNet, gated hyper-connections, softmax routing).
QWEN4_VARIANT = dict(
    attention_type="gqa", attention_output_gate=True, index_head_weights=False, index_query_source="hidden",
    index_key_norm="rms_after_pool", index_rope=True, index_sink_windows=0, index_local_windows=0,
    linear_attention_type="gated_deltanet", hc_type="qwen4_exp", moe_router_type="softmax", shared_expert_gate=True,
    swiglu_limit=None, rms_norm_unit_offset=True,
)
# Qwen4-Exp text config fields that are one field of ours each, Qwen's name -> ours.
SAME_FIELDS = {
    **{name: name for name in (
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
        "attention_bias", "attention_dropout", "linear_num_key_heads", "linear_num_value_heads",
        "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", "hidden_act", "rms_norm_eps",
        "max_position_embeddings", "initializer_range", "pad_token_id", "bos_token_id", "eos_token_id",
        "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
        "norm_topk_prob", "hc_count", "hc_lowrank", "ple_embed_dim", "ple_conv_kernel_size")},
    "indexer_n_heads": "index_n_heads",
    "indexer_head_dim": "index_head_dim",
    "indexer_budget": "index_topk",
    "indexer_compress_ratio": "index_pool_size",
    "ngram_size": "ple_ngram_size",
    "heads_per_ngram": "ple_heads_per_ngram",
    "ngram_vocab_size_base": "ple_ngram_vocab_size_base",
    "make_ngram_vocab_size_divisible_by": "ple_vocab_size_multiple",
    "seed": "ple_hash_seed",
}


def qwen4_config_from_ours(config):
    """Qwen4-Exp's config (`Qwen4ExpConfig` with our vision tower, or `Qwen4ExpTextConfig`) for ours: the source
    config stored at conversion with every field ours maps taken from ours. ConversionError naming each setting of
    ours that Qwen4-Exp's format cannot express."""
    text = config.get_text_config()
    different = [f"{name} = {getattr(text, name)!r} (Qwen4-Exp: {value!r})" for name, value in QWEN4_VARIANT.items()
                 if getattr(text, name) != value]
    if text.index_pool_weighting not in ("mean", "learned", "learned_scalar"):
        different.append(f"index_pool_weighting = {text.index_pool_weighting!r} (Qwen4-Exp: mean pooling)")
    if text.indexer_types is not None and "shared" in text.indexer_types:
        different.append("indexer_types with 'shared' layers (Qwen4-Exp: every indexed layer has its indexer)")
    if len(set(text.mlp_types)) > 1:
        different.append("mlp_layer_types mixing dense and MoE layers (Qwen4-Exp: one kind in every layer)")
    if different:
        raise ConversionError(f"Qwen4-Exp's format cannot express {', '.join(different)}; only models of Qwen4-Exp's "
                              "variant export to it.")
    stored = dict(text.source_config or {})
    # The stored config is the whole source's: a multimodal one holds the text config inside.
    stored_multimodal = stored if stored.get("model_type") == MULTIMODAL_MODEL_TYPE else {}
    stored_text = dict(stored_multimodal.get("text_config", {}) if stored_multimodal else stored)
    rope = {**stored_text.get("rope_parameters", {}), **text.rope_parameters}
    mapped = {qwen: getattr(text, ours) for qwen, ours in SAME_FIELDS.items()}
    mapped.update(
        layer_types=["indexed_attention" if kind == "indexpool_attention" else kind for kind in text.layer_types],
        rope_parameters=rope,
        indexer_kv_heads=1,
        ple_layer_ids=[index + 1 for index in text.ple_layers],  # Qwen4-Exp counts layers from 1
        tie_word_embeddings=text.tie_word_embeddings,
    )
    if text.num_mtp_layers or "mtp_num_hidden_layers" in stored_text:
        mapped["mtp_num_hidden_layers"] = text.num_mtp_layers
    if text.num_mtp_layers and text.mtp_type != "qwen4_exp":
        raise ConversionError(f"Qwen4-Exp's format cannot express mtp_type = {text.mtp_type!r} (Qwen4-Exp: "
                              "'qwen4_exp'); only models of Qwen4-Exp's variant export to it.")
    if (stored_text.get("output_gate_type") or text.hidden_act) != text.linear_output_gate_act:
        mapped["output_gate_type"] = text.linear_output_gate_act
    if not isinstance(config, HybridIndexPoolMultimodalConfig):
        return Qwen4ExpTextConfig.from_dict({**stored_text, **mapped, "model_type": TEXT_MODEL_TYPE,
                                             "dtype": text.dtype})
    return Qwen4ExpConfig.from_dict({
        **stored_multimodal,
        "text_config": {**stored_text, **mapped},
        "vision_config": config.vision_config.to_dict(),
        "image_token_id": config.image_token_id,
        "video_token_id": config.video_token_id,
        "vision_start_token_id": config.vision_start_token_id,
        "vision_end_token_id": config.vision_end_token_id,
        "tie_word_embeddings": config.tie_word_embeddings,
        "dtype": text.dtype,
    })


def mean_pooling_checks(config) -> list[WeightGroup]:
    """Groups that write nothing and refuse a learned pooling gate that is not exactly the mean (zero gate
    projection and slot biases), which Qwen4-Exp's mean pooling cannot express."""
    text = config.get_text_config()
    if text.index_pool_weighting == "mean":
        return []
    name_in_model = to_multimodal_name if isinstance(config, HybridIndexPoolMultimodalConfig) else str
    checks = []
    for indexer in indexer_prefixes(text):
        names = tuple(name_in_model(f"{indexer}.{part}") for part in ("pool_gate_proj.weight", "pool_slot_bias"))

        def refuse_unless_mean(tensors, indexer=indexer, names=names):
            if any(bool(tensors[name].any()) for name in names):
                raise ConversionError(
                    f"The learned pooling of {indexer} (index_pool_weighting = {text.index_pool_weighting!r}, "
                    "pool_gate_proj / pool_slot_bias) has moved from the mean; Qwen4-Exp's QSA pools by the mean and "
                    "cannot express it. Train from the converted checkpoint with the pooling weights frozen "
                    "(--freeze_pooling of scripts/train_indexer.py and scripts/finetune.py: the warm-up trains them "
                    "otherwise), or keep this model in our format, which has learned pools."
                )
            return {}

        checks.append(WeightGroup(names, (), refuse_unless_mean))
    return checks


def export_qwen4_exp(
    folder, output_dir, *, overwrite: bool = False, max_shard_size: int | str = "5GB", progress: bool = True,
    log=print,
) -> ConversionReport:
    """Write our checkpoint in `folder` (converted from Qwen4-Exp, perhaps fine-tuned since) as a Qwen4-Exp
    checkpoint in `output_dir` (multimodal with our vision tower, or text-only), loadable by transformers'
    `Qwen4ExpForConditionalGeneration` / `Qwen4ExpForCausalLM` and the engines that serve Qwen4-Exp: the same weight
    names, shapes and values as the converted source."""
    checkpoint, config = open_our_checkpoint(folder)
    check_converted_from(folder, config, "Qwen4-Exp")
    source_config = qwen4_config_from_ours(config)
    model_class = (Qwen4ExpForConditionalGeneration if isinstance(config, HybridIndexPoolMultimodalConfig)
                   else Qwen4ExpForCausalLM)
    return export_checkpoint(checkpoint, config, source_config, model_class, build_plan, output_dir,
                             checks=mean_pooling_checks(config), overwrite=overwrite, max_shard_size=max_shard_size,
                             progress=progress, log=log)
