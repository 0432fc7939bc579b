"""The GLM-5.3-Flash checkpoint the vLLM tests serve (`test_vllm_glm.py`), made with the main environment's Python
(transformers 5.24+, as `hf_reference.py`):

    python glm_reference.py checkpoint OUT

A tiny random `glm5_next` source (`make_tiny_source`'s: KDA and MLA layers, a shared indexer, dense layers among
grouped-MoE ones, the SwiGLU clamp, Sinkhorn streams), converted with `convert_glm5_next --text_only` as a user runs
it, its pooling gate and slot bias moved off their converted values as indexer training here moves them, its head
scaled up (decisive logits), saved in bfloat16 with the byte-level tokenizer. `hf_reference.py score` scores it.
"""

import sys
import tempfile
from pathlib import Path

import torch


def tiny_glm_checkpoint(output_dir: str) -> None:
    from hybrid_indexpool import HybridIndexPoolForCausalLM
    from hybrid_indexpool.scripts.convert_glm5_next import main as convert_glm5_next
    from hybrid_indexpool.tiny_sources import save_tiny_source
    from hybrid_indexpool.tokenization import byte_level_tokenizer

    with tempfile.TemporaryDirectory() as scratch:
        source = save_tiny_source("glm5_next", Path(scratch) / "source")
        converted = Path(scratch) / "converted"
        convert_glm5_next(["--source", str(source), "--output", str(converted), "--text_only", "--no_progress"])
        model = HybridIndexPoolForCausalLM.from_pretrained(converted, dtype=torch.float32)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("pool_gate_proj.weight", "pool_slot_bias")):
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.5)
        # The random source's logits spread by ~0.15 nat (every token ~equally likely), which would hide any
        # difference in the comparisons: a head 10x as large spreads them by ~1.5 nat.
        model.lm_head.weight.mul_(10.0)
    model.to(torch.bfloat16).save_pretrained(output_dir)
    byte_level_tokenizer().save_pretrained(output_dir)


if __name__ == "__main__":
    command, *arguments = sys.argv[1:]
    {"checkpoint": tiny_glm_checkpoint}[command](*arguments)
