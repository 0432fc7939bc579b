"""Text-only serving of multimodal checkpoints (`HybridIndexPoolForConditionalGeneration`, e.g. a Qwen3.8-Flash-Next
conversion that kept its vision tower): vLLM serves the language model; the vision tower's weights are not loaded
and requests with images are refused by vLLM (the served model takes no multimodal inputs).

Text tokens get the same position in each of multimodal RoPE's three streams, which is plain RoPE over the same
frequencies (`rope.text_rope_parameters`), so the language model runs as `HybridIndexPoolForCausalLM` does. vLLM reads
the checkpoint's config as `multimodal_config.MultimodalTextConfig`.
"""

from collections.abc import Iterable

import torch

from .vllm_model import HybridIndexPoolForCausalLM

LANGUAGE_MODEL_PREFIX, VISION_PREFIX = "model.language_model.", "model.visual."


class HybridIndexPoolForConditionalGeneration(HybridIndexPoolForCausalLM):
    """The language model of a multimodal checkpoint, served for text: loads `model.language_model.*` and the head,
    leaves `model.visual.*` out."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def language_model_weights():
            for name, tensor in weights:
                if name.startswith(VISION_PREFIX):
                    continue
                yield name.replace(LANGUAGE_MODEL_PREFIX, "model.", 1), tensor

        return super().load_weights(language_model_weights())
