"""Tiny random Qwen3-Next / Qwen3.5 source checkpoints for the conversion tests (built with transformers, no
downloads), saved in several shards."""

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
from transformers.core_model_loading import revert_weight_conversion
from transformers.models.qwen3_5 import (
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5TextConfig,
)
from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

from hybrid_indexpool.conversion import IndexerSettings
from hybrid_indexpool.tokenization import byte_level_tokenizer

# Within this budget (16 tokens, r = 4: any sequence of at most 19 tokens) the converted model is exact.
INDEXER = IndexerSettings(n_heads=2, head_dim=16, topk=16, pool_size=4)
TEXT = dict(
    vocab_size=97, hidden_size=64, num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
    pad_token_id=0, eos_token_id=None, bos_token_id=None,
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
# Text positions make the three multimodal RoPE streams equal; the sections must still cover the rotated half.
MROPE = {**ROPE, "mrope_section": [1, 1, 2], "mrope_interleaved": True}
VISION = dict(depth=2, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=64)
# Placeholder and delimiter tokens inside the tiny vocabulary.
VISION_TOKENS = dict(image_token_id=93, video_token_id=94, vision_start_token_id=95, vision_end_token_id=96)


def tiny_source_model(kind: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A random float32 source model: `qwen3_next` (MoE), `qwen3_5_text` (dense MLP), `qwen3_5_moe_text`, or the
    multimodal `qwen3_5`. Norm weights, time-step biases and routers get random values (they start at constants)."""
    torch.manual_seed(seed)
    dense = {**TEXT, "intermediate_size": 96, "rope_parameters": dict(MROPE), **overrides}
    moe = {**TEXT, **MOE, "rope_parameters": dict(MROPE), **overrides}
    if kind == "qwen3_next":
        model = Qwen3NextForCausalLM(Qwen3NextConfig(**{**moe, "rope_parameters": dict(ROPE), **overrides}))
    elif kind == "qwen3_5_text":
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**dense))
    elif kind == "qwen3_5_moe_text":
        model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**moe))
    elif kind == "qwen3_5":
        text = Qwen3_5TextConfig(**dense)
        model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text.to_dict(), vision_config=VISION))
    else:
        raise ValueError(kind)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() == 1 or name.endswith("mlp.gate.weight"):
                parameter.add_(torch.randn_like(parameter) * 0.3)
    return model.eval()


def save_source(model: torch.nn.Module, folder: Path, max_shard_size: str = "80KB") -> Path:
    """Save in several shards, with a tokenizer next to the weights."""
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    byte_level_tokenizer().save_pretrained(folder)
    return folder


def qwen3_next_mtp_modules(model: torch.nn.Module, seed: int = 1) -> tuple[dict, int]:
    """A random Qwen3-Next / Qwen3.5 MTP head for `model` as vLLM's `qwen3_next_mtp` builds it, of the source's own
    classes: the embedding and hidden-state norms (copies of the final norm), `fc` over both, one full-attention
    decoder layer (a copy of the last one) and a final norm, all perturbed. Returns `({name under mtp.: module},
    index of the layer the MTP layer was copied from)`."""
    text = model.config.get_text_config()
    language_model = model.model.language_model if hasattr(model.model, "language_model") else model.model
    attention = max(index for index, kind in enumerate(text.layer_types) if kind == "full_attention")
    modules = {
        "pre_fc_norm_embedding": copy.deepcopy(language_model.norm),
        "pre_fc_norm_hidden": copy.deepcopy(language_model.norm),
        "fc": torch.nn.Linear(2 * text.hidden_size, text.hidden_size, bias=False),
        "layers.0": copy.deepcopy(language_model.layers[attention]),
        "norm": copy.deepcopy(language_model.norm),
    }
    perturb(modules.values(), seed)
    return modules, attention


def save_source_with_mtp(model: torch.nn.Module, folder: Path, count_field: str) -> tuple[Path, dict]:
    """Save `model` as `save_source` does, plus a Qwen3-Next-style MTP head with one layer (`mtp.`, in a shard of its
    own: transformers' classes do not hold it), declared in the config's `count_field`. Returns the folder and the
    MTP modules."""
    save_source(model, folder)
    modules, source_layer = qwen3_next_mtp_modules(model)
    add_mtp_shard(folder, mtp_tensors(model, modules, source_layer), count_field)
    return folder, modules


def mtp_tensors(model: torch.nn.Module, modules: dict, source_layer: int) -> dict:
    """The tensors of an MTP head's `modules` under the checkpoint's names (`mtp.`): its decoder layer (`layers.0`,
    a copy of decoder layer `source_layer`) as `save_pretrained` writes that layer, the rest as they are."""
    text_prefix = "model.language_model." if hasattr(model.model, "language_model") else "model."
    layer = f"{text_prefix}layers.{source_layer}."
    state = {f"{layer}{key}": tensor for key, tensor in modules["layers.0"].state_dict().items()}
    tensors = {name.replace(layer, "mtp.layers.0.", 1): tensor.contiguous()
               for name, tensor in revert_weight_conversion(model, state).items()}
    for name, module in modules.items():
        if name != "layers.0":
            tensors.update({f"mtp.{name}.{key}": tensor.detach().clone()
                            for key, tensor in module.state_dict().items()})
    return tensors


# Qwen4-Exp with every feature on: hyper-connections (3 streams), PLE on two Gated DeltaNet layers (n-gram tables
# stored in 4 parts), MoE, and a QSA indexer with a budget of 8 tokens (r = 4), so 48-token inputs are sparse.
QWEN4_TEXT = dict(
    vocab_size=97, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
    **MOE, hc_count=3, hc_lowrank=8, ple_layer_ids=[1, 3], ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=60,
    make_ngram_vocab_size_divisible_by=8, split_ngram_parts=4, indexer_n_heads=4, indexer_kv_heads=1,
    indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4, pad_token_id=0, eos_token_id=1,
    rope_parameters=dict(MROPE),
)


def tiny_qwen4_source(multimodal: bool = False, seed: int = 0, **overrides) -> torch.nn.Module:
    """A random float32 `Qwen4ExpForCausalLM` (or the multimodal `Qwen4ExpForConditionalGeneration`); parameters
    that start at constants (norms, PLE convolutions, time-step biases) get random values."""
    from transformers import Qwen4ExpConfig, Qwen4ExpForCausalLM, Qwen4ExpForConditionalGeneration, Qwen4ExpTextConfig

    torch.manual_seed(seed)
    text = Qwen4ExpTextConfig(**{**QWEN4_TEXT, "rope_parameters": dict(MROPE), **overrides})
    if multimodal:
        model = Qwen4ExpForConditionalGeneration(Qwen4ExpConfig(text_config=text.to_dict(), vision_config=VISION,
                                                                 **VISION_TOKENS))
    else:
        model = Qwen4ExpForCausalLM(text)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() == 1 or name.endswith(("mlp.gate.weight", "ple.conv1d.weight")):
                parameter.add_(torch.randn_like(parameter) * 0.3)
    return model.eval()


def qwen4_mtp_modules(model: torch.nn.Module, seed: int = 1) -> tuple[dict, int]:
    """A random Qwen4-Exp MTP head for `model`, of the source's own classes, as vLLM builds it: the embedding and
    stream norms and projections, one decoder layer (a copy of the last attention layer, which has no PLE), and a
    final mix (a copy of the model's), all perturbed. Returns `({name under mtp.: module}, index of the layer the
    MTP layer was copied from)`."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextRMSNorm

    text = model.config.get_text_config()
    language_model = model.model.language_model if hasattr(model.model, "language_model") else model.model
    attention = max(index for index, kind in enumerate(text.layer_types) if kind != "linear_attention")
    hidden, streams = text.hidden_size, text.hc_count * text.hidden_size
    modules = {
        "pre_fc_norm_embedding": Qwen4ExpTextRMSNorm(hidden, eps=text.rms_norm_eps),
        "pre_fc_norm_hidden": Qwen4ExpTextRMSNorm(streams, eps=text.rms_norm_eps),  # one norm over all streams
        "fc_embedding": torch.nn.Linear(hidden, hidden, bias=False),
        "fc_hidden": torch.nn.Linear(hidden, hidden, bias=False),
        "layers.0": copy.deepcopy(language_model.layers[attention]),
        "hyper_connection_mixer": copy.deepcopy(language_model.hyper_connection_mixer),
    }
    perturb(modules.values(), seed)
    return modules, attention


def save_qwen4_source(model: torch.nn.Module, folder: Path, mtp: bool = True,
                      max_shard_size: str = "40KB") -> tuple[Path, dict | None]:
    """Save `model` as `save_source` does; with `mtp`, an MTP head with one layer under Qwen4-Exp's names (`mtp.`),
    in a shard of its own (transformers' classes do not hold it). Returns the folder and the MTP modules."""
    save_source(model, folder, max_shard_size=max_shard_size)
    if not mtp:
        return folder, None
    modules, source_layer = qwen4_mtp_modules(model)
    add_mtp_shard(folder, mtp_tensors(model, modules, source_layer), "mtp_num_hidden_layers")
    return folder, modules


def perturb(modules, seed: int, std: float = 0.1) -> None:
    """Add seeded noise to every floating-point parameter and buffer of `modules` (copies of a source's layers
    standing in for its MTP layers, so that they differ from the layers they copy)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in modules:
            for tensor in [*module.parameters(), *module.buffers()]:
                if tensor.is_floating_point():
                    tensor.add_(torch.randn(tensor.shape, generator=generator) * std)


def add_mtp_shard(folder: Path, tensors: dict, count_field: str) -> None:
    """Add one MTP layer's `tensors` to the checkpoint in `folder` as a shard of their own, and declare it in the
    text config's `count_field`."""
    add_shard(folder, tensors, "model-mtp.safetensors")
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    (config["text_config"] if "text_config" in config else config)[count_field] = 1
    config_path.write_text(json.dumps(config, indent=2))


def add_shard(folder: Path, tensors: dict, file_name: str) -> None:
    """Add `tensors` to the sharded checkpoint in `folder` as one more shard, listed in its index."""
    save_file(tensors, folder / file_name, metadata={"format": "pt"})
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"].update(dict.fromkeys(tensors, file_name))
    index_path.write_text(json.dumps(index, indent=2))
