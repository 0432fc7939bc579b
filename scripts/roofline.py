"""Roofline of one decode step of the full Qwen3.8-Flash-Next (or, `--preset glm-flash`, GLM-5.3-Flash) on a GPU: the
bytes the step must read from HBM over the HBM bandwidth, for unpooled (r = 1) bfloat16 indexer keys, pooled r = 4
(GLM: r = 16, its `index_kpool`) bfloat16 keys, and pooled packed fp8 keys (`kernels.fp8_index_keys`: d fp8 bytes and
a float32 scale per pooled key, 132 B at d = 128).

The widths come from a config, not typed-in numbers: transformers' `Qwen4ExpTextConfig` (its defaults: vocabulary,
experts, expert and shared-expert widths, the every-4th-layer indexed-attention pattern, hyper-connections) with
`bench_decode`'s `flash-next` preset over it (attention, Gated DeltaNet and indexer widths, budget) and 48 layers. The
weights are counted by building that model on the meta device (no memory): every parameter is read once per step,
except the routed experts, of which a step reads those its tokens chose, and the token embedding, one row per token.
GLM-5.3-Flash: transformers' `Glm5NextTextConfig` (its defaults: 45 layers, every 4th MLA, 288 experts, 3 dense
layers, 4 hyper-connection streams) with `bench_decode`'s `glm-flash` widths over it, its text model and LM head on
the meta device; an MLA layer caches one latent of `kv_lora_rank` per token, read once as both key and value.
Per sequence, each indexed layer reads the keys and values of the selected windows and the open tail (a budget of
`index_topk` tokens: `B // r` windows of r tokens, plus at most r - 1) and every pooled index key once; each linear
layer reads and writes its recurrent and convolution states (float32). Not counted: activations, the new token's
key/value writes, index queries, logits (all small against the rest at these sizes).

A batch shares the weights: B sequences read the weights once, their own caches each. Routed experts at batch B are
the expected number of distinct experts that B tokens choose when each picks `num_experts_per_tok` of `num_experts`
uniformly (`E (1 - (1 - k/E)^B)`), an assumption: real routing is skewed, which reads fewer.

    python -m hybrid_indexpool.scripts.roofline
    python -m hybrid_indexpool.scripts.roofline --contexts 131072,1048576 --batches 1,64 --json roofline.json
    python -m hybrid_indexpool.scripts.roofline --preset glm-flash --json docs/results/roofline_glm_flash.json
"""

import argparse
import json
from dataclasses import asdict, dataclass

# HBM bandwidths (bytes per second): H100 SXM 3.35 TB/s, H200 4.8 TB/s.
GPUS = {"H100": 3.35e12, "H200": 4.8e12}
CONTEXTS = (131072, 262144, 524288, 1048576, 2097152)
BATCHES = (1, 8, 64)
LAYERS = {"flash-next": 48, "glm-flash": 45}
POOL_SIZES = {"flash-next": 4, "glm-flash": 16}  # the pooled variants' r
STATE_BYTES = 4  # the cache's recurrent and convolution states are float32


@dataclass(frozen=True)
class Variant:
    """How the indexer's keys are stored: pool size r and bytes of one pooled key."""

    name: str
    pool_size: int
    index_key_bytes: int


def variants(index_head_dim: int, pool_size: int = 4) -> list[Variant]:
    """The three storages compared: unpooled bf16, pooled bf16 and pooled packed fp8, pooled at `pool_size`."""
    r = pool_size
    return [Variant("unpooled r=1 bf16", 1, 2 * index_head_dim), Variant(f"pooled r={r} bf16", r, 2 * index_head_dim),
            Variant(f"pooled r={r} fp8", r, index_head_dim + 4)]


@dataclass(frozen=True)
class DecodeWidths:
    """What a decode step's bytes depend on (parameter counts in parameters, not bytes)."""

    index_layers: int
    linear_layers: int
    kv_heads: int
    head_dim: int
    index_head_dim: int
    index_topk: int  # token budget of the selection
    linear_key_heads: int
    linear_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    conv_kernel: int
    shared_parameters: int  # read once per step whatever the batch: all but the routed experts and the embedding
    expert_parameters: int  # one routed expert of one layer
    moe_layers: int
    num_experts: int
    experts_per_token: int
    embedding_row_parameters: int  # read once per sequence
    key_value_tensors: int = 2  # per attended token and kv head: a key and a value (MLA: 1, the latent is both)


def flash_next_config(layers: int = LAYERS["flash-next"]):
    """`Qwen4ExpTextConfig` of Qwen3.8-Flash-Next: its defaults, `bench_decode`'s flash-next widths, `layers` layers."""
    from transformers import Qwen4ExpTextConfig

    from hybrid_indexpool.scripts.bench_decode import PRESETS

    preset = PRESETS["flash-next"]
    return Qwen4ExpTextConfig(
        num_hidden_layers=layers, hidden_size=preset["hidden_size"], num_attention_heads=preset["heads"],
        num_key_value_heads=preset["kv_heads"], head_dim=preset["head_dim"],
        linear_num_key_heads=preset["linear_key_heads"], linear_num_value_heads=preset["linear_value_heads"],
        linear_key_head_dim=preset["linear_head_dim"], linear_value_head_dim=preset["linear_head_dim"],
        indexer_n_heads=preset["index_heads"], indexer_kv_heads=1, indexer_head_dim=preset["index_head_dim"],
        indexer_budget=preset["topk"], indexer_compress_ratio=4,
        # Qwen3-Next's partial RoPE (a quarter of the head): the config requires the rotary part to fit the index head.
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
    )


def glm_flash_config(layers: int = LAYERS["glm-flash"]):
    """`Glm5NextTextConfig` of GLM-5.3-Flash: its defaults, `bench_decode`'s glm-flash widths, `layers` layers (the
    default schedules: every 4th layer MLA, the first 3 MLPs dense)."""
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig

    from hybrid_indexpool.scripts.bench_decode import PRESETS

    preset = PRESETS["glm-flash"]
    return Glm5NextTextConfig(
        num_hidden_layers=layers, hidden_size=preset["hidden_size"], num_attention_heads=preset["heads"],
        num_key_value_heads=preset["heads"], q_lora_rank=preset["q_lora_rank"], kv_lora_rank=preset["kv_lora_rank"],
        qk_nope_head_dim=preset["qk_nope_head_dim"], v_head_dim=preset["v_head_dim"],
        index_n_heads=preset["index_heads"], index_head_dim=preset["index_head_dim"], index_topk=preset["topk"],
        linear_num_heads=preset["linear_value_heads"], linear_head_dim=preset["linear_head_dim"])


def glm_widths_from_config(config) -> DecodeWidths:
    """`DecodeWidths` of a GLM-5.3-Flash text config, its text model and LM head counted on the meta device."""
    import torch
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextModel

    if "shared" in config.indexer_types:
        raise ValueError("shared indexer layers keep no index keys; glm_widths_from_config counts every MLA layer's")
    with torch.device("meta"):
        model = Glm5NextTextModel(config)
    experts = embedding = 0
    shared = config.hidden_size * config.vocab_size  # the LM head
    for name, parameter in model.named_parameters():
        if ".mlp.experts." in name:
            experts += parameter.numel()
        elif "embed_tokens" in name:
            embedding += parameter.numel()
        else:
            shared += parameter.numel()
    moe_layers = config.mlp_layer_types.count("sparse")
    types = config.layer_types
    return DecodeWidths(
        index_layers=types.count("indexed_attention"), linear_layers=types.count("linear_attention"),
        kv_heads=1, head_dim=config.kv_lora_rank + config.qk_rope_head_dim, key_value_tensors=1,
        index_head_dim=config.index_head_dim, index_topk=config.index_topk,
        linear_key_heads=config.linear_num_heads, linear_value_heads=config.linear_num_heads,
        linear_key_head_dim=config.linear_head_dim, linear_value_head_dim=config.linear_head_dim,
        conv_kernel=config.linear_conv_kernel_dim, shared_parameters=shared,
        expert_parameters=experts // (config.n_routed_experts * moe_layers), moe_layers=moe_layers,
        num_experts=config.n_routed_experts, experts_per_token=config.num_experts_per_tok,
        embedding_row_parameters=embedding // config.vocab_size)


def widths_from_config(config) -> DecodeWidths:
    """`DecodeWidths` of a Qwen4-Exp text config, its parameters counted on a model built on the meta device."""
    import torch
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpForCausalLM

    with torch.device("meta"):
        model = Qwen4ExpForCausalLM(config)
    experts = embedding = shared = 0
    for name, parameter in model.named_parameters():
        if ".mlp.experts." in name:
            experts += parameter.numel()
        elif "embed_tokens" in name:
            embedding += parameter.numel()
        else:
            shared += parameter.numel()
    if "ngram" in " ".join(name for name, _ in model.named_parameters()):
        raise ValueError("n-gram (PLE) embeddings are looked up per token; widths_from_config does not count them")
    moe_layers = config.num_hidden_layers
    types = config.layer_types
    return DecodeWidths(
        index_layers=types.count("indexed_attention"), linear_layers=types.count("linear_attention"),
        kv_heads=config.num_key_value_heads, head_dim=config.head_dim, index_head_dim=config.indexer_head_dim,
        index_topk=config.indexer_budget, linear_key_heads=config.linear_num_key_heads,
        linear_value_heads=config.linear_num_value_heads, linear_key_head_dim=config.linear_key_head_dim,
        linear_value_head_dim=config.linear_value_head_dim, conv_kernel=config.linear_conv_kernel_dim,
        shared_parameters=shared, expert_parameters=experts // (config.num_experts * moe_layers),
        moe_layers=moe_layers, num_experts=config.num_experts, experts_per_token=config.num_experts_per_tok,
        embedding_row_parameters=embedding // config.vocab_size)


def distinct_experts(widths: DecodeWidths, batch: int) -> float:
    """Expected routed experts per layer that `batch` tokens read (uniform routing; exactly k at batch 1)."""
    e, k = widths.num_experts, widths.experts_per_token
    return e * (1 - (1 - k / e) ** batch)


def step_bytes(widths: DecodeWidths, variant: Variant, context: int, batch: int, weight_bytes: int = 2,
               kv_bytes: int = 2) -> dict[str, float]:
    """Bytes one decode step of `batch` sequences of `context` tokens must read, per component, and their total."""
    r = variant.pool_size
    weights = (widths.shared_parameters
               + distinct_experts(widths, batch) * widths.expert_parameters * widths.moe_layers
               + batch * widths.embedding_row_parameters) * weight_bytes
    attended = min(context, widths.index_topk + r - 1)  # the selected windows' tokens and the open tail
    key_value = (batch * widths.index_layers * attended * widths.key_value_tensors * widths.kv_heads * widths.head_dim
                 * kv_bytes)
    index_keys = batch * widths.index_layers * (context // r) * variant.index_key_bytes
    key_dim = widths.linear_key_heads * widths.linear_key_head_dim
    value_dim = widths.linear_value_heads * widths.linear_value_head_dim
    recurrent = widths.linear_value_heads * widths.linear_key_head_dim * widths.linear_value_head_dim
    conv = (2 * key_dim + value_dim) * (widths.conv_kernel - 1)
    states = batch * widths.linear_layers * 2 * (recurrent + conv) * STATE_BYTES  # read and written
    parts = {"weights": weights, "key_value": key_value, "index_keys": index_keys, "linear_states": states}
    parts["total"] = sum(parts.values())
    return parts


def cache_bytes_held(widths: DecodeWidths, variant: Variant, context: int, batch: int, kv_bytes: int = 2) -> int:
    """Bytes the caches of `batch` sequences of `context` tokens hold (every token's keys and values, every pooled
    key, the states): what must fit in the GPUs' memory beside the weights."""
    key_value_bytes = widths.key_value_tensors * widths.kv_heads * widths.head_dim * kv_bytes
    per_sequence = widths.index_layers * (context * key_value_bytes
                                          + (context // variant.pool_size) * variant.index_key_bytes)
    states = step_bytes(widths, variant, context, 1)["linear_states"] // 2  # held once, moved twice
    return batch * per_sequence + batch * states


def roofline(widths: DecodeWidths, contexts=CONTEXTS, batches=BATCHES, gpus=None, pool_size: int = 4) -> list[dict]:
    """One row per (context, batch, variant, pooled at `pool_size`): bytes per component, ms per step on each GPU, and
    the time against the unpooled step's (the same for every GPU: both are bytes over the same bandwidth)."""
    gpus = gpus or GPUS
    rows = []
    for context in contexts:
        for batch in batches:
            unpooled = None
            for variant in variants(widths.index_head_dim, pool_size):
                parts = step_bytes(widths, variant, context, batch)
                unpooled = unpooled or parts["total"]
                row = {"context": context, "batch": batch, "variant": variant.name, "bytes": parts,
                       "over_unpooled": parts["total"] / unpooled,
                       "weights_fraction": parts["weights"] / parts["total"],
                       "cache_held": cache_bytes_held(widths, variant, context, batch)}
                row.update({f"{gpu}_ms": parts["total"] / bandwidth * 1e3 for gpu, bandwidth in gpus.items()})
                rows.append(row)
    return rows


def format_table(rows: list[dict], gpus=None) -> str:
    gpus = list(gpus or GPUS)
    header = (["context", "batch", "index keys", "weights GB", "KV GB", "index keys GB", "states GB", "total GB"]
              + [f"{gpu} ms" for gpu in gpus] + ["vs unpooled", "weights share", "cache held GB"])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        parts = row["bytes"]
        cells = ([f"{row['context'] // 1024:,}K", str(row["batch"]), row["variant"]]
                 + [f"{parts[key] / 1e9:.2f}" for key in ("weights", "key_value", "index_keys", "linear_states",
                                                          "total")]
                 + [f"{row[f'{gpu}_ms']:.2f}" for gpu in gpus]
                 + [f"{row['over_unpooled']:.2f}", f"{row['weights_fraction']:.0%}", f"{row['cache_held'] / 1e9:,.0f}"])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default=",".join(map(str, CONTEXTS)), help="comma-separated context lengths")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)), help="comma-separated batch sizes")
    parser.add_argument("--preset", choices=sorted(LAYERS), default="flash-next",
                        help="the model: Qwen3.8-Flash-Next or GLM-5.3-Flash (bench_decode's widths of that name)")
    parser.add_argument("--layers", type=int, help="decoder layers, every 4th indexed attention (default: the "
                        f"model's, {', '.join(f'{name} {count}' for name, count in LAYERS.items())})")
    parser.add_argument("--json", help="write the widths and rows to this file")
    args = parser.parse_args(argv)
    for name in ("contexts", "batches"):
        if any(int(value) <= 0 for value in getattr(args, name).split(",")):
            parser.error(f"--{name} must be positive integers")
    return args


def main(argv=None) -> dict:
    args = parse_arguments(argv)
    layers = args.layers or LAYERS[args.preset]
    if args.preset == "glm-flash":
        widths = glm_widths_from_config(glm_flash_config(layers))
    else:
        widths = widths_from_config(flash_next_config(layers))
    rows = roofline(widths, [int(c) for c in args.contexts.split(",")], [int(b) for b in args.batches.split(",")],
                    pool_size=POOL_SIZES[args.preset])
    print(format_table(rows))
    report = {"preset": args.preset, "widths": asdict(widths), "gpus_bytes_per_second": GPUS, "rows": rows}
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=1)
    return report


if __name__ == "__main__":
    main()
