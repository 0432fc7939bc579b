"""The two halves of a plugin layer that runs as a vLLM custom op: registering the layer in vLLM's forward context
when it is built, and finding it and its step's metadata inside the op."""

import torch
from vllm.forward_context import get_forward_context
from vllm.utils.torch_utils import LayerNameType, _resolve_layer_name


def register_step_layer(vllm_config, prefix: str, layer: torch.nn.Module) -> None:
    """Register `layer` under `prefix` in vLLM's static forward context, where its custom op finds it."""
    context = vllm_config.compilation_config.static_forward_context
    if prefix in context:
        raise ValueError(f"Duplicate layer name: {prefix}")
    context[prefix] = layer


def step_layer_and_metadata(layer_name: LayerNameType):
    """The layer registered as `layer_name` and its metadata for this step (by its prefix), or None as metadata in
    vLLM's memory-profiling run, which has no caches yet."""
    forward_context = get_forward_context()
    layer = forward_context.no_compile_layers[_resolve_layer_name(layer_name)]
    metadata = forward_context.attn_metadata
    if isinstance(metadata, list):
        metadata = metadata[0]
    return layer, (metadata[layer.prefix] if isinstance(metadata, dict) else None)
