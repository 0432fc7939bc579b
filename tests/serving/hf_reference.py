"""The transformers side of the vLLM tests, run with the main environment's Python (transformers 5.24).

    python hf_reference.py checkpoint OUT [experts|fp8|narrow|mtp]  # the tiny bfloat16 checkpoint the vLLM tests serve
    python hf_reference.py qwen4_exp OUT [multimodal]    # a tiny Qwen4-Exp source converted, pooling trained off
    python hf_reference.py score CKPT IN.json OUT.json

`score` reads `[{"prompt": [ids], "output": [ids]}, ...]` and writes, per request and generated token, the
log-probability our `HybridIndexPoolForCausalLM` gives that token when teacher-forced along the same tokens, in
bfloat16 and in float32: `[{"bfloat16": [...], "float32": [...]}, ...]`. A checkpoint with fp8 pooled index keys is
scored through its cache (which is where they are packed in fp8).
"""

import json
import sys

import torch


def tiny_checkpoint(output_dir: str, variant: str = "") -> None:
    """Two Gated DeltaNet and two IndexPool layers, linear head dim 64 (vLLM's CPU GDN needs 64 or 128), budget 16
    tokens at r = 4, learned pooling with non-zero gates, the byte-level tokenizer; saved in bfloat16. With
    `experts`, a mixture of 4 experts (2 per token) and a shared expert in place of the dense MLPs, with a decisive
    router (its weights scaled up), so that no expert choice ties within bfloat16 noise, and one MTP layer (which the
    plugin skips unless it drafts with it). With `fp8`, pooled index keys cached packed in fp8. With `narrow`,
    Gated DeltaNet heads of 32 (which vLLM's CPU kernels do not take). With `mtp`, one (random) MTP layer of
    DeepSeek's kind, for speculative decoding."""
    from hybrid_indexpool import HybridIndexPoolConfig, HybridIndexPoolForCausalLM
    from hybrid_indexpool.tokenization import byte_level_tokenizer

    torch.manual_seed(0)
    tokenizer = byte_level_tokenizer()
    config = HybridIndexPoolConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        layer_types=["linear_attention", "indexpool_attention"] * 2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, partial_rotary_factor=0.25,
        index_n_heads=2, index_head_dim=32, index_topk=16, index_pool_size=4, index_pool_weighting="learned",
        linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=32 if variant == "narrow" else 64, linear_value_head_dim=32 if variant == "narrow" else 64,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        max_position_embeddings=4096, initializer_range=0.05,
        **(dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=96)
           if variant == "experts" else {}),
        index_key_cache_dtype="float8_e4m3fn" if variant == "fp8" else "auto",
        num_mtp_layers=1 if variant in ("experts", "mtp") else 0,
    )
    model = HybridIndexPoolForCausalLM(config)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # pooling gates, slot biases and norms start at zero: give them values that matter
        for name, parameter in model.named_parameters():
            if name.endswith(("pool_gate_proj.weight", "pool_slot_bias")) or name.endswith("norm.weight"):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
            if name.endswith(".mlp.gate.weight"):
                parameter.mul_(40.0)
    model.to(torch.bfloat16).save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)


# The tiny Qwen4-Exp source at widths vLLM's CPU Gated DeltaNet takes (head size 64), with weights large enough that
# every layer moves the output; hyper-connections, PLE layers, MoE and the QSA indexer (budget 8 tokens, r = 4) as
# `tiny_sources` has them.
QWEN4_EXP_SERVED_WIDTHS = dict(linear_key_head_dim=64, linear_value_head_dim=64, initializer_range=0.1)


def qwen4_exp_checkpoint(output_dir: str, variant: str = "") -> None:
    """A tiny Qwen4-Exp source (`tiny_sources`, Gated DeltaNet heads of 64) converted with `convert_qwen4_exp`, its
    pooling moved off the mean as training here would (gates and slot biases given values), saved in bfloat16 with
    the tokenizer; its output head scaled up (next-token distributions far from uniform, so that log-probabilities
    tell models apart) and its router made decisive (no expert choice ties within bfloat16 noise). `multimodal`: the
    source is Qwen4-Exp's multimodal model (a vision tower, multimodal RoPE), so that
    the conversion keeps both (`HybridIndexPoolForConditionalGeneration`)."""
    import tempfile

    from transformers import AutoModelForCausalLM, Qwen4ExpConfig, Qwen4ExpForConditionalGeneration

    from hybrid_indexpool import HybridIndexPoolForConditionalGeneration
    from hybrid_indexpool.conversion.qwen4_exp import convert_qwen4_exp
    from hybrid_indexpool.tiny_sources import QWEN4_EXP_TEXT, ROPE, VISION, tiny_source_model
    from hybrid_indexpool.tokenization import byte_level_tokenizer

    with tempfile.TemporaryDirectory() as scratch:
        if variant == "multimodal":
            torch.manual_seed(0)
            text = dict(QWEN4_EXP_TEXT | QWEN4_EXP_SERVED_WIDTHS, rope_parameters=dict(ROPE))
            source = Qwen4ExpForConditionalGeneration(Qwen4ExpConfig(
                text_config=text, vision_config=VISION, image_token_id=258, video_token_id=257,
                vision_start_token_id=256, vision_end_token_id=255))  # within the byte-level vocabulary
        else:
            source = tiny_source_model("qwen4_exp", **QWEN4_EXP_SERVED_WIDTHS)
        source.save_pretrained(f"{scratch}/source")
        convert_qwen4_exp(f"{scratch}/source", f"{scratch}/converted", progress=False, log=lambda *_: None)
        model_class = HybridIndexPoolForConditionalGeneration if variant == "multimodal" else AutoModelForCausalLM
        model = model_class.from_pretrained(f"{scratch}/converted", trust_remote_code=True)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("pool_gate_proj.weight", "pool_slot_bias")):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
            if name.endswith(".mlp.gate.weight"):
                parameter.mul_(40.0)
            if name == "lm_head.weight":
                parameter.mul_(5.0)
    model.to(torch.bfloat16).save_pretrained(output_dir)
    byte_level_tokenizer().save_pretrained(output_dir)


def score(checkpoint: str, requests_path: str, output_path: str) -> None:
    from transformers import AutoConfig

    from hybrid_indexpool import HybridIndexPoolForCausalLM, HybridIndexPoolForConditionalGeneration

    with open(requests_path) as file:
        requests = json.load(file)
    results = [{} for _ in requests]
    multimodal = "ForConditionalGeneration" in AutoConfig.from_pretrained(checkpoint).architectures[0]
    model_class = HybridIndexPoolForConditionalGeneration if multimodal else HybridIndexPoolForCausalLM
    for dtype in (torch.bfloat16, torch.float32):
        model = model_class.from_pretrained(checkpoint, dtype=dtype).eval()
        with torch.no_grad():
            for request, result in zip(requests, results):
                prompt, output = request["prompt"], request["output"]
                fp8_index_keys = model.config.get_text_config().index_key_cache_dtype != "auto"
                logits = model(torch.tensor([prompt + output[:-1]]),
                               use_cache=fp8_index_keys).logits[0, len(prompt) - 1:]
                logprobs = logits.float().log_softmax(dim=-1)
                chosen = logprobs.gather(-1, torch.tensor(output)[:, None])[:, 0]
                result[str(dtype).removeprefix("torch.")] = chosen.tolist()
    with open(output_path, "w") as file:
        json.dump(results, file)


if __name__ == "__main__":
    command, *arguments = sys.argv[1:]
    {"checkpoint": tiny_checkpoint, "qwen4_exp": qwen4_exp_checkpoint, "score": score}[command](*arguments)
