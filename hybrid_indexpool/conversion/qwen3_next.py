"""Qwen3-Next and Qwen3.5 text checkpoints to ours: every weight mapped, each full-attention layer an IndexPool layer
with the same attention weights and a freshly initialised indexer (`IndexerSettings`), and the multi-token-prediction
(MTP) head kept (`mtp.*`, which transformers leaves out at load and vLLM serves as `qwen3_next_mtp`). The command line
is `scripts/convert_qwen3_next.py`."""

import re
from dataclasses import dataclass
from functools import partial

import torch

from ..configuration import HybridIndexPoolConfig
from ..modeling.indexer import HybridIndexPoolIndexer
from .checkpoint_io import SourceCheckpoint
from .engine import (
    ConversionPlan,
    ConversionReport,
    WeightGroup,
    convert_checkpoint,
    count_mtp_layers,
    fresh_weights,
    rename,
)
from .errors import ConversionError
from .qwen import (
    qwen_attention_parts,
    qwen_hybrid_settings,
    qwen_moe_plan,
    qwen_outer_plan,
    qwen_source_configs,
    qwen_text_prefix,
)

# The command that converts these sources, named when a source of another model type is refused.
SCRIPT = "scripts/convert_qwen3_next.py"
TEXT_MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
MULTIMODAL_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")


@dataclass
class IndexerSettings:
    """The new indexer of each IndexPool layer (the source has none)."""

    n_heads: int = 16
    head_dim: int = 128
    topk: int = 2048
    pool_size: int = 4
    pool_weighting: str = "learned"
    head_weights: bool = False
    sink_windows: int = 0
    local_windows: int = 0


def build_config(source: SourceCheckpoint, indexer: IndexerSettings) -> HybridIndexPoolConfig:
    """Our config for the source: every architectural field mapped, full attention turned into IndexPool."""
    full, text = qwen_source_configs(source, multimodal=source.model_type in MULTIMODAL_MODEL_TYPES)
    layer_types = []
    for index, kind in enumerate(text.layer_types):
        if kind not in ("linear_attention", "full_attention"):
            raise ConversionError(f"Source layer {index} has type {kind!r}; only linear and full attention convert.")
        layer_types.append("indexpool_attention" if kind == "full_attention" else "linear_attention")
    num_experts = getattr(text, "num_experts", 0) or 0
    if num_experts and (getattr(text, "mlp_only_layers", None) or getattr(text, "decoder_sparse_step", 1) != 1):
        raise ConversionError(
            f"The source mixes dense-MLP layers (mlp_only_layers={text.mlp_only_layers}, decoder_sparse_step="
            f"{text.decoder_sparse_step}) with MoE layers; our model uses one MLP kind in every layer."
        )
    moe = {}
    if num_experts:
        moe = dict(
            num_experts=num_experts, num_experts_per_tok=text.num_experts_per_tok,
            moe_intermediate_size=text.moe_intermediate_size,
            shared_expert_intermediate_size=text.shared_expert_intermediate_size,
            # Qwen3.5-MoE always renormalises the top-k probabilities; Qwen3-Next says so in its config.
            norm_topk_prob=getattr(text, "norm_topk_prob", True),
        )
    try:
        return HybridIndexPoolConfig(
            **qwen_hybrid_settings(full, text),
            num_mtp_layers=mtp_layer_count(source, text),
            mtp_type="qwen3_next",
            # MoE sources have no dense MLP width; ours keeps its default there (no layer uses it).
            intermediate_size=getattr(text, "intermediate_size", None) or HybridIndexPoolConfig.intermediate_size,
            layer_types=layer_types,
            index_n_heads=indexer.n_heads,
            index_head_dim=indexer.head_dim,
            index_topk=indexer.topk,
            index_pool_size=indexer.pool_size,
            index_pool_weighting=indexer.pool_weighting,
            index_head_weights=indexer.head_weights,
            index_sink_windows=indexer.sink_windows,
            index_local_windows=indexer.local_windows,
            **moe,
        )
    except ValueError as error:
        raise ConversionError(f"{error} (the indexer comes from the --index_* options; adjust them).") from error


def split_qkvz(source: str, targets: tuple[str, str], config: HybridIndexPoolConfig) -> WeightGroup:
    """Qwen3-Next's fused `in_proj_qkvz` -> our `in_proj_qkv`, `in_proj_z`.

    Qwen3-Next stores the rows per key-head group: for each key head its query, its key, then the values and the
    output gates of the value heads that share it. We store all queries, all keys, all values (`in_proj_qkv`) and
    the gates separately (`in_proj_z`), heads in the same order.
    """
    num_groups, key_dim = config.linear_num_key_heads, config.linear_key_head_dim
    per_group = config.linear_num_value_heads // num_groups * config.linear_value_head_dim
    widths = [key_dim, key_dim, per_group, per_group]

    def build(tensors):
        weight = tensors[source]
        if weight.shape[0] != num_groups * sum(widths):
            raise ConversionError(f"{source} has {weight.shape[0]} rows; the config implies "
                                  f"{num_groups * sum(widths)}.")
        query, key, value, gate = weight.view(num_groups, sum(widths), -1).split(widths, dim=1)
        flat = [part.reshape(-1, weight.shape[1]) for part in (query, key, value, gate)]
        return {targets[0]: torch.cat(flat[:3]), targets[1]: flat[3]}

    return WeightGroup((source,), targets, build)


def split_ba(source: str, targets: tuple[str, str], config: HybridIndexPoolConfig) -> WeightGroup:
    """Qwen3-Next's fused `in_proj_ba` (per key-head group: the betas, then the decay inputs of its value heads)
    -> our `in_proj_b`, `in_proj_a`."""
    num_groups = config.linear_num_key_heads
    per_group = config.linear_num_value_heads // num_groups

    def build(tensors):
        weight = tensors[source]
        if weight.shape[0] != 2 * config.linear_num_value_heads:
            raise ConversionError(f"{source} has {weight.shape[0]} rows; the config implies "
                                  f"{2 * config.linear_num_value_heads}.")
        beta, decay = weight.view(num_groups, 2 * per_group, -1).split([per_group, per_group], dim=1)
        return {targets[0]: beta.reshape(-1, weight.shape[1]), targets[1]: decay.reshape(-1, weight.shape[1])}

    return WeightGroup((source,), targets, build)


# The source's MTP weights outside its decoder layers (`mtp.` at the top of the checkpoint, text or multimodal) -> ours
# in each MTP layer (`model.mtp.layers.N.`). The source shares them between its MTP layers (vLLM reuses them at every
# draft step); ours keeps them per layer, so a source with several MTP layers gets a copy in each.
MTP_SHARED_WEIGHTS = {
    "pre_fc_norm_embedding.weight": "embedding_norm.weight",
    "pre_fc_norm_hidden.weight": "hidden_norm.weight",
    "fc.weight": "input_proj.weight",
    "norm.weight": "output_norm.weight",
}
# How a Qwen3-Next / Qwen3.5 config declares its MTP layers (vLLM reads the same fields, 1 when absent).
MTP_COUNT_FIELDS = {"qwen3_next": "num_nextn_predict_layers"}
MTP_COUNT_FIELD = "mtp_num_hidden_layers"  # the Qwen3.5 family


def mtp_layer_count(source: SourceCheckpoint, text) -> int:
    """The source's MTP decoder layers (`mtp.layers.N.`); ConversionError when the config declares another count.

    transformers drops the declaration of some of these configs as it reads them; the count then comes from the
    weights alone."""
    pattern = re.compile(r"mtp\.layers\.(\d+)\.")
    found = (int(match.group(1)) for name in source.weight_names if (match := pattern.match(name)))
    field = MTP_COUNT_FIELDS.get(source.model_type, MTP_COUNT_FIELD)
    return count_mtp_layers(found, 0, getattr(text, field, None), field)


def shared_mtp_weight(source: str, target: str, num_mtp_layers: int) -> WeightGroup:
    """One MTP weight the source shares between its MTP layers -> a copy in each of ours (the same tensor: a layer
    the source never trained apart from the others starts equal)."""
    targets = tuple(f"model.mtp.layers.{depth}.{target}" for depth in range(num_mtp_layers))
    return WeightGroup((source,), targets, lambda tensors: dict.fromkeys(targets, tensors[source]),
                       lambda tensors: {source: tensors[targets[0]]})


def mtp_plan(config: HybridIndexPoolConfig, names) -> list[WeightGroup]:
    """The groups of the source's MTP head: its shared input norms, projection and final norm, and its decoder layers
    (full attention, which becomes an IndexPool layer with a fresh indexer, and the model's MLP kind)."""
    if not config.num_mtp_layers:
        return []
    groups = [shared_mtp_weight(f"mtp.{name}", ours, config.num_mtp_layers) for name, ours in
              MTP_SHARED_WEIGHTS.items()]
    for depth in range(config.num_mtp_layers):
        src, dst = f"mtp.layers.{depth}.", f"model.mtp.layers.{depth}.block."
        mlp_parts, mlp_groups = qwen_mlp_plan(src, dst, config, names)
        parts = ["input_layernorm.weight", "post_attention_layernorm.weight", *qwen_attention_parts(config), *mlp_parts]
        groups += mlp_groups + [rename(src + part, dst + part) for part in parts]
    return groups


def qwen_mlp_plan(src: str, dst: str, config: HybridIndexPoolConfig, weight_names) -> tuple[list[str], list]:
    """A decoder block's MLP: the dense gate/up/down projections, or the MoE block (`qwen_moe_plan`)."""
    if config.num_experts == 0:
        return [f"mlp.{name}.weight" for name in ("gate_proj", "up_proj", "down_proj")], []
    return qwen_moe_plan(src, dst, config, weight_names)


def build_plan(source: SourceCheckpoint, config: HybridIndexPoolConfig) -> ConversionPlan:
    """Which source weights become which of ours, and which are left out."""
    model_type = source.model_type
    multimodal = model_type in MULTIMODAL_MODEL_TYPES
    prefix = qwen_text_prefix(multimodal)
    names = set(source.weight_names)
    outer = qwen_outer_plan(config, multimodal)
    groups, ignore = outer.groups + [rename(f"{prefix}norm.weight", "model.norm.weight")], outer.ignore
    groups += mtp_plan(config, names)
    for index, kind in enumerate(config.layer_types):
        src, dst = f"{prefix}layers.{index}.", f"model.layers.{index}."
        parts = ["input_layernorm.weight", "post_attention_layernorm.weight"]
        if kind == "linear_attention":
            parts += [f"linear_attn.{name}" for name in ("conv1d.weight", "dt_bias", "A_log", "norm.weight",
                                                         "out_proj.weight")]
            if model_type == "qwen3_next":
                groups.append(split_qkvz(f"{src}linear_attn.in_proj_qkvz.weight", (
                    f"{dst}linear_attn.in_proj_qkv.weight", f"{dst}linear_attn.in_proj_z.weight"), config))
                groups.append(split_ba(f"{src}linear_attn.in_proj_ba.weight", (
                    f"{dst}linear_attn.in_proj_b.weight", f"{dst}linear_attn.in_proj_a.weight"), config))
            else:
                parts += [f"linear_attn.in_proj_{name}.weight" for name in ("qkv", "z", "b", "a")]
        else:
            parts += qwen_attention_parts(config)
        mlp_parts, mlp_groups = qwen_mlp_plan(src, dst, config, names)
        groups += mlp_groups + [rename(src + part, dst + part) for part in parts + mlp_parts]
    return ConversionPlan(groups, ignore)


def indexer_weights(config: HybridIndexPoolConfig, seed: int) -> dict[str, torch.Tensor]:
    """A freshly initialised indexer for every IndexPool layer and MTP layer (our `_init_weights`, deterministic for
    `seed`)."""
    layers = [index for index, kind in enumerate(config.layer_types) if kind == "indexpool_attention"]
    prefixes = [f"model.layers.{index}.self_attn.indexer" for index in layers]
    prefixes += [f"model.mtp.layers.{depth}.block.self_attn.indexer" for depth in range(config.num_mtp_layers)]
    return fresh_weights(config, {prefix: partial(HybridIndexPoolIndexer, config) for prefix in prefixes}, seed)


def convert_qwen3_next(
    source_dir, output_dir, indexer: IndexerSettings | None = None, *, seed: int = 0, overwrite: bool = False,
    max_shard_size: int | str = "5GB", progress: bool = True, log=print,
) -> ConversionReport:
    """Convert the Qwen3-Next / Qwen3.5 checkpoint in `source_dir` into ours in `output_dir`."""
    source = SourceCheckpoint.open(source_dir)
    source.require_model_type(TEXT_MODEL_TYPES + MULTIMODAL_MODEL_TYPES, SCRIPT)
    config = build_config(source, indexer or IndexerSettings())
    return convert_checkpoint(
        source, build_plan(source, config), config, output_dir, overwrite=overwrite, max_shard_size=max_shard_size,
        extra_tensors=partial(indexer_weights, config, seed), progress=progress, log=log,
    )
