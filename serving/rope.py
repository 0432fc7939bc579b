"""The rotary embedding the vLLM model builds from a checkpoint's `rope_parameters`, and the positions it reads."""

import torch
from vllm.model_executor.models.interfaces import SupportsMRoPE

# Keys of multimodal RoPE (Qwen4-Exp's interleaved time/height/width sections).
MULTIMODAL_ROPE_KEYS = ("mrope_section", "mrope_interleaved")


def text_rope_parameters(config) -> dict:
    """`rope_parameters` for text positions: multimodal RoPE gives every frequency the same position when the three
    position streams are equal (text), which is plain RoPE over the same frequencies, so its sections are dropped and
    vLLM's plain rotary embedding reads one position per token."""
    return {key: value for key, value in config.rope_parameters.items() if key not in MULTIMODAL_ROPE_KEYS}


class TextMultimodalRoPE(SupportsMRoPE):
    """vLLM's multimodal-RoPE interface for a model served for text: vLLM gives a checkpoint whose config has
    `mrope_section` three position streams per token; for text all three are the token's position, so the model
    reads the first (`text_positions`)."""

    def get_mrope_input_positions(self, input_tokens: list[int], mm_features: list) -> tuple[torch.Tensor, int]:
        positions = torch.arange(len(input_tokens))
        return positions.unsqueeze(0).expand(3, -1), 0

    @staticmethod
    def text_positions(positions: torch.Tensor) -> torch.Tensor:
        """`positions [tokens]`, or `[3, tokens]` for multimodal RoPE -> `[tokens]`."""
        return positions[0] if positions.dim() == 2 else positions
