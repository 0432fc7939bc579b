"""Tiny random GLM-5.3-Flash (`Glm5NextForConditionalGeneration`) source checkpoints for the conversion tests, built
with transformers (no downloads): KDA and MLA layers, the pooled indexer, Sinkhorn streams, grouped MoE, the vision
tower."""

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
from qwen_sources import add_mtp_shard, perturb, save_source
from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration
from transformers.core_model_loading import revert_weight_conversion

TEXT_PREFIX = "model.language_model."

# Placeholder and delimiter tokens inside the tiny vocabulary.
VISION_TOKENS = dict(image_token_id=93, video_token_id=94, image_start_token_id=89, image_end_token_id=90,
                     video_start_token_id=91, video_end_token_id=92)
VISION = dict(depth=2, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=64,
              projection_intermediate_size=32, patch_size=14)
PATCH = 3 * 2 * 14 * 14  # channels x temporal patch x patch x patch of the tiny vision tower


@dataclass(frozen=True)
class GlmVariant:
    """One tiny GLM-5.3-Flash shape: `shared` gives the second of two adjacent MLA layers a shared indexer (GLM hands a
    selection only to the very next layer), `kpool` is the pool size (the budget is two pools), `moe` puts routed
    experts in three of the five layers, `hc_mult` is the number of residual streams."""

    shared: bool = True
    kpool: int = 4
    moe: bool = True
    hc_mult: int = 3

    @property
    def name(self) -> str:
        return (f"{'shared' if self.shared else 'full'}-r{self.kpool}-{'moe' if self.moe else 'dense'}"
                f"-hc{self.hc_mult}")

    def text_config(self) -> dict:
        return dict(
            vocab_size=97, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=5,
            layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention",
                         "indexed_attention"],
            indexer_types=["full", "full", "shared" if self.shared else "full", "full", "full"],
            mlp_layer_types=["dense", "sparse", "sparse", "dense", "sparse"] if self.moe else ["dense"] * 5,
            num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16,
            qk_rope_head_dim=0, v_head_dim=16,
            # GLM's 32 index heads: with few heads a score is often exactly 0 (every head's ReLU at 0), and such ties
            # make the selection arbitrary.
            index_n_heads=32, index_head_dim=16, index_topk=2 * self.kpool, index_kpool=self.kpool,
            linear_num_heads=4, linear_head_dim=8, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
            n_group=2, topk_group=1, routed_scaling_factor=2.5, swiglu_limit=0.5, hc_mult=self.hc_mult,
            hc_sinkhorn_iters=5, pad_token_id=0, eos_token_id=1,
        )


VARIANTS = (
    GlmVariant(shared=True, kpool=4, moe=True, hc_mult=3),
    GlmVariant(shared=False, kpool=16, moe=False, hc_mult=1),
    GlmVariant(shared=True, kpool=16, moe=True, hc_mult=1),
    GlmVariant(shared=False, kpool=4, moe=False, hc_mult=3),
)


def tiny_glm_source(variant: GlmVariant = VARIANTS[0], seed: int = 0, **overrides) -> Glm5NextForConditionalGeneration:
    """A random float32 `Glm5NextForConditionalGeneration` (text config fields in `overrides` replace the variant's);
    parameters that start at constants (norms, biases, the streams' base and scale, the pooling gate and slot bias,
    routers and their score correction) get random values."""
    torch.manual_seed(seed)
    config = Glm5NextConfig(text_config={**variant.text_config(), **overrides}, vision_config=VISION, **VISION_TOKENS)
    model = Glm5NextForConditionalGeneration(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() == 1 or name.endswith(("index_kpool_compress_gate", "mlp.gate.weight")):
                parameter.add_(torch.randn_like(parameter) * 0.3)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.1)
    return model.eval()


def glm_mtp_modules(model: Glm5NextForConditionalGeneration, seed: int = 1) -> tuple[dict, int]:
    """A random next-n (MTP) layer for `model`, of the source's own classes, as vLLM builds it: the attention (with its
    indexer) and norms of the first full-indexer MLA layer, the MLP of the last layer, its input norms and projection
    and its output norm (`shared_head.norm`), all perturbed. Returns `({name under the layer: module}, index of the
    MLA layer they were copied from)`."""
    text = model.config.text_config
    layers = model.model.language_model.layers
    source = next(index for index, (kind, indexer) in enumerate(zip(text.layer_types, text.indexer_types))
                  if kind == "indexed_attention" and indexer == "full")
    norm = type(layers[source].input_layernorm)
    modules = {
        "self_attn": copy.deepcopy(layers[source].self_attn), "mlp": copy.deepcopy(layers[-1].mlp),
        "input_layernorm": copy.deepcopy(layers[source].input_layernorm),
        "post_attention_layernorm": copy.deepcopy(layers[source].post_attention_layernorm),
        "enorm": norm(text.hidden_size, text.rms_norm_eps), "hnorm": norm(text.hidden_size, text.rms_norm_eps),
        "eh_proj": torch.nn.Linear(2 * text.hidden_size, text.hidden_size, bias=False),
        "shared_head.norm": norm(text.hidden_size, text.rms_norm_eps),
    }
    perturb(modules.values(), seed)
    return modules, source


def save_glm_source(model: Glm5NextForConditionalGeneration, folder: Path, mtp: bool = True, copies: bool = True,
                    max_shard_size: str = "60KB") -> tuple[Path, dict | None]:
    """Save `model` as a checkpoint (with a tokenizer); with `mtp`, one next-n layer after the decoder layers under
    GLM's names, in a shard of its own (transformers' class does not hold it), and with `copies` the copies of the
    embedding and of the head that DeepSeek-V3's layout keeps in it. Returns the folder and the MTP modules."""
    save_source(model, folder, max_shard_size=max_shard_size)
    if not mtp:
        return folder, None
    text = model.config.text_config
    modules, source = glm_mtp_modules(model)
    prefix, last = TEXT_PREFIX + "layers.", text.num_hidden_layers - 1
    state = {}
    for name, module in modules.items():
        owner = last if name == "mlp" else source  # where such a module sits in the decoder, for transformers' names
        state.update({f"{prefix}{owner}.{name}.{key}": tensor for key, tensor in module.state_dict().items()})
    saved = revert_weight_conversion(model, state)
    mtp_layer = f"{prefix}{text.num_hidden_layers}."
    tensors = {mtp_layer + name.split(".", 4)[4]: tensor.contiguous() for name, tensor in saved.items()}
    if copies:
        tensors[mtp_layer + "embed_tokens.weight"] = model.get_input_embeddings().weight.detach().clone()
        tensors[mtp_layer + "shared_head.head.weight"] = model.lm_head.weight.detach().clone()
    add_mtp_shard(folder, tensors, "num_nextn_predict_layers")
    return folder, modules
