"""Convert a Qwen3-Next or Qwen3.5 text checkpoint into a HybridIndexPool checkpoint.

Every weight is mapped; each full-attention layer becomes an IndexPool layer with the same attention weights and a
freshly initialised indexer (learned pooling starts at the mean). Within the token budget (`--index_topk`) the
converted model computes exactly what the source does; beyond it the indexer chooses the attended windows and needs
the indexer training first (see the README).

Reads `Qwen3NextForCausalLM` (`qwen3_next`), `Qwen3_5ForCausalLM` (`qwen3_5_text`), `Qwen3_5MoeForCausalLM`
(`qwen3_5_moe_text`) and the multimodal `Qwen3_5ForConditionalGeneration` / `Qwen3_5MoeForConditionalGeneration`
folders (their vision tower is left out). It streams shard by shard, so memory stays near the largest shard.

    python -m hybrid_indexpool.scripts.convert_qwen3_next --source Qwen3-Next-80B-A3B-Instruct \\
        --output Qwen3-Next-80B-A3B-IndexPool --index_topk 2048 --index_pool_size 4
"""

from dataclasses import dataclass
from functools import partial

import torch

from hybrid_indexpool import HybridIndexPoolConfig
from hybrid_indexpool.configuration.configuration_hybrid_indexpool import POOL_WEIGHTINGS
from hybrid_indexpool.conversion import (
    ConversionError,
    ConversionPlan,
    ConversionReport,
    SourceCheckpoint,
    WeightGroup,
    conversion_argument_parser,
    convert_checkpoint,
    fresh_weights,
    qwen_attention_parts,
    qwen_hybrid_settings,
    qwen_moe_plan,
    qwen_outer_plan,
    qwen_source_configs,
    qwen_text_prefix,
    rename,
    run_conversion_command,
)
from hybrid_indexpool.modeling.indexer import HybridIndexPoolIndexer

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


def build_plan(source: SourceCheckpoint, config: HybridIndexPoolConfig) -> ConversionPlan:
    """Which source weights become which of ours, and which are left out."""
    model_type = source.model_type
    multimodal = model_type in MULTIMODAL_MODEL_TYPES
    prefix = qwen_text_prefix(multimodal)
    names = set(source.weight_names)
    outer = qwen_outer_plan(config, multimodal)
    groups, ignore = outer.groups + [rename(f"{prefix}norm.weight", "model.norm.weight")], outer.ignore
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
        if config.num_experts == 0:
            parts += [f"mlp.{name}.weight" for name in ("gate_proj", "up_proj", "down_proj")]
        else:
            moe_parts, moe_groups = qwen_moe_plan(src, dst, config, names)
            parts, groups = parts + moe_parts, groups + moe_groups
        groups += [rename(src + part, dst + part) for part in parts]
    return ConversionPlan(groups, ignore)


def indexer_weights(config: HybridIndexPoolConfig, seed: int) -> dict[str, torch.Tensor]:
    """A freshly initialised indexer for every IndexPool layer (our `_init_weights`, deterministic for `seed`)."""
    layers = [index for index, kind in enumerate(config.layer_types) if kind == "indexpool_attention"]
    return fresh_weights(
        config,
        {f"model.layers.{index}.self_attn.indexer": partial(HybridIndexPoolIndexer, config) for index in layers},
        seed,
    )


def convert(
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


def main(argv=None) -> ConversionReport:
    defaults = IndexerSettings()
    parser = conversion_argument_parser(__doc__, "folder of the Qwen3-Next / Qwen3.5 checkpoint")
    parser.add_argument("--index_n_heads", type=int, default=defaults.n_heads,
                        help=f"indexer query heads (default {defaults.n_heads})")
    parser.add_argument("--index_head_dim", type=int, default=defaults.head_dim,
                        help=f"indexer head width (default {defaults.head_dim})")
    parser.add_argument("--index_topk", type=int, default=defaults.topk,
                        help=f"token budget per query (default {defaults.topk}); within it, outputs equal the source's")
    parser.add_argument("--index_pool_size", type=int, default=defaults.pool_size,
                        help=f"tokens per pooled indexer key (default {defaults.pool_size})")
    parser.add_argument("--index_pool_weighting", choices=POOL_WEIGHTINGS, default=defaults.pool_weighting,
                        help="pooling of the indexer keys (default learned, starting at the mean; see "
                             "HybridIndexPoolConfig.index_pool_weighting)")
    parser.add_argument("--index_head_weights", action="store_true",
                        help="learned per-head indexer weights (DeepSeek style) instead of a plain sum")
    parser.add_argument("--index_sink_windows", type=int, default=defaults.sink_windows,
                        help="first windows always selected, inside the budget (default 0)")
    parser.add_argument("--index_local_windows", type=int, default=defaults.local_windows,
                        help="most recent windows always selected, inside the budget (default 0)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the new indexer's initialisation (default 0)")
    args = parser.parse_args(argv)
    indexer = IndexerSettings(
        n_heads=args.index_n_heads, head_dim=args.index_head_dim, topk=args.index_topk,
        pool_size=args.index_pool_size, pool_weighting=args.index_pool_weighting, head_weights=args.index_head_weights,
        sink_windows=args.index_sink_windows, local_windows=args.index_local_windows,
    )
    return run_conversion_command(parser, lambda: convert(
        args.source, args.output, indexer, seed=args.seed, overwrite=args.overwrite,
        max_shard_size=args.max_shard_size, progress=not args.no_progress,
    ))


if __name__ == "__main__":
    main()
