"""`torch.export` of the decode step: one token per row over a filled [`HybridIndexPoolCache`], as a module whose
buffers are the cache's tensors, so that the exported program updates them in place (transformers' executorch
wrappers do the same for their static caches, which cannot hold pooled windows).

A prefill exports as the model itself: `torch.export.export(model, (input_ids,), {"use_cache": False})`. Checks that
read tensor values (token ids within the vocabulary, packed positions) are skipped while tracing, and the layers then
bound what they would read from the device by the shapes (see `inputs.tracing`): the exported program computes what
the eager model computes.
"""

import torch
from torch import nn

from .cache_hybrid_indexpool import HybridIndexPoolCache


class HybridIndexPoolDecodeStep(nn.Module):
    """One decode step of `model` (a `HybridIndexPoolForCausalLM`) over `cache`, for `torch.export.export`.

    The cache must have been filled (a prompt's forward) with storage reserved for every token to come
    (`HybridIndexPoolCache(config, max_cache_len=N)`), so that the step's shapes are fixed; it must not be recording
    (`activate_past_recording`). Export under `torch.no_grad()`, so that the states are written in place.

    `forward(input_ids [batch, 1], attention_mask [batch, past + 1])` returns the logits `[batch, 1, vocab]` and
    advances the cache (the exported program's buffers are the cache's tensors, updated in place).
    """

    def __init__(self, model: nn.Module, cache: HybridIndexPoolCache):
        super().__init__()
        if not cache.is_initialized or not cache.is_compileable:
            raise ValueError(
                "HybridIndexPoolDecodeStep needs a filled cache with reserved storage and no recording: build it with "
                "HybridIndexPoolCache(config, max_cache_len=N), run the prompt's forward with it, and deactivate "
                "past recording."
            )
        self.model = model
        self.cache = cache
        self.register_buffer("seen_tokens", cache.seen_tokens, persistent=False)
        for index, layer in enumerate(cache.layers):
            for name in layer._batch_tensors:
                if isinstance(tensor := getattr(layer, name), torch.Tensor):
                    self.register_buffer(f"cache_{index}_{name.strip('_')}", tensor, persistent=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, attention_mask=attention_mask, cache=self.cache, use_cache=True).logits


__all__ = ["HybridIndexPoolDecodeStep"]
