"""Tiny random checkpoints of the source families the converters read (Qwen4-Exp, GLM-5.3-Flash), built with
transformers' own classes and saved with the offline byte-level tokenizer: the conversion, training and export
recipe runs on them in seconds, as written for the real checkpoints. The weights are random, so only the plumbing
and the numerics of each step can be judged on them, not the text they generate."""

from pathlib import Path

import torch

from .tokenization import byte_level_tokenizer

FAMILIES = ("qwen4_exp", "glm5_next")
VOCAB_SIZE = 259  # the byte-level tokenizer's ids (pad 0, bos 1, eos 2): every id the model generates decodes
ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
        "mrope_section": [1, 1, 2], "mrope_interleaved": True}
VISION = dict(depth=2, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=64)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
# Qwen4-Exp with its features on: hyper-connections (3 streams), n-gram embeddings on two Gated DeltaNet layers,
# MoE, and a QSA indexer with a budget of 8 tokens (r = 4), so that inputs longer than 11 tokens are sparse.
QWEN4_EXP_TEXT = dict(
    vocab_size=VOCAB_SIZE, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
    **MOE, hc_count=3, hc_lowrank=8, ple_layer_ids=[1, 3], ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=60,
    make_ngram_vocab_size_divisible_by=8, split_ngram_parts=4, indexer_n_heads=4, indexer_kv_heads=1,
    indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
# GLM-5.3-Flash: KDA and MLA layers, a shared indexer, learned pooling of r = 4, grouped MoE, Sinkhorn streams and
# the vision tower (with its placeholder tokens among the tiny vocabulary's last ids).
GLM5_NEXT_TEXT = dict(
    vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=5,
    layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention",
                 "indexed_attention"],
    indexer_types=["full", "full", "shared", "full", "full"],
    mlp_layer_types=["dense", "sparse", "sparse", "dense", "sparse"],
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16,
    qk_rope_head_dim=0, v_head_dim=16, index_n_heads=32, index_head_dim=16, index_topk=8, index_kpool=4,
    linear_num_heads=4, linear_head_dim=8, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
    topk_group=1, routed_scaling_factor=2.5, swiglu_limit=0.5, hc_mult=3, hc_sinkhorn_iters=5, pad_token_id=0,
    bos_token_id=1, eos_token_id=2,
)
GLM5_NEXT_VISION = dict(VISION, projection_intermediate_size=32, patch_size=14)
GLM5_NEXT_VISION_TOKENS = dict(image_token_id=258, video_token_id=257, image_start_token_id=256,
                               image_end_token_id=255, video_start_token_id=254, video_end_token_id=253)


def tiny_source_model(family: str, seed: int = 0, **text_overrides) -> torch.nn.Module:
    """A random float32 source model of `family`: `qwen4_exp` (transformers' `Qwen4ExpForCausalLM`) or `glm5_next`
    (`Glm5NextForConditionalGeneration`, with its vision tower). Parameters that start at constants (norms, biases,
    routers, pooling gates) get random values, so that every converted weight matters. `text_overrides` change the
    text model's settings (e.g. the widths a serving engine's kernels take)."""
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration, Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    if family not in FAMILIES:
        raise ValueError(f"family {family!r} is not one of {list(FAMILIES)}.")
    torch.manual_seed(seed)
    if family == "qwen4_exp":
        model = Qwen4ExpForCausalLM(Qwen4ExpTextConfig(**QWEN4_EXP_TEXT | text_overrides,
                                                       rope_parameters=dict(ROPE)))
    else:
        config = Glm5NextConfig(text_config=GLM5_NEXT_TEXT | text_overrides, vision_config=GLM5_NEXT_VISION,
                                **GLM5_NEXT_VISION_TOKENS)
        model = Glm5NextForConditionalGeneration(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() == 1 or name.endswith(("mlp.gate.weight", "ple.conv1d.weight",
                                                      "index_kpool_compress_gate")):
                parameter.add_(torch.randn_like(parameter) * 0.3)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.1)
    return model.eval()


def save_tiny_source(family: str, folder, seed: int = 0) -> Path:
    """Write a tiny random checkpoint of `family` (see `tiny_source_model`) and the byte-level tokenizer into
    `folder`, in several shards as the released checkpoints are, and for GLM-5.3-Flash (a multimodal model) the
    image processor's settings its vision tower reads (patches of 14, merged 2 x 2) as its release ships them;
    FileExistsError if `folder` is a non-empty folder or a file."""
    folder = Path(folder)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise FileExistsError(f"{folder} already exists and is not an empty folder; choose a new output folder.")
    tiny_source_model(family, seed).save_pretrained(folder, max_shard_size="200KB")
    byte_level_tokenizer().save_pretrained(folder)
    if family == "glm5_next":
        from transformers import Glm5NextImageProcessorPil

        Glm5NextImageProcessorPil(patch_size=GLM5_NEXT_VISION["patch_size"], merge_size=2).save_pretrained(folder)
    return folder
