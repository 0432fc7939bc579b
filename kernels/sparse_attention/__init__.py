"""IndexPool sparse attention (selected windows plus tail) behind one entry point per shape: GQA heads, MLA's
absorbed form (every query head over one latent that is both key and value), and GQA heads over keys and values in
vLLM's pages (a serving step's flattened tokens)."""

import torch

from ..dispatch import use_fast_path
from .cpu_impl import KERNEL as PAGED_CPU_KERNEL
from .cpu_impl import paged_attention_cpu_applies, paged_sparse_attention_cpu
from .reference import (
    RequestTiles,
    TileGroup,
    attention_slots,
    masked_softmax,
    paged_sparse_attention_torch,
    sparse_attention_torch,
    sparse_latent_attention_torch,
)

try:
    from .triton_impl import paged_sparse_attention_triton, sparse_attention_triton, sparse_latent_attention_triton
except ImportError:  # no Triton: the PyTorch path serves every device
    sparse_attention_triton = sparse_latent_attention_triton = paged_sparse_attention_triton = None


def sparse_attention(query, key, value, selected_windows, query_positions, pool_size, scaling, dropout=0.0,
                     training=False, return_weights=False):
    """Attention over each query's selected windows and tail; see `sparse_attention_torch` for shapes.

    Triton on CUDA (forward and backward); PyTorch elsewhere, and for attention dropout or returned weights.
    """
    needs_reference = return_weights or (training and dropout > 0.0)
    if sparse_attention_triton is not None and not needs_reference and use_fast_path(query, key, value):
        output = sparse_attention_triton(query, key, value, selected_windows, query_positions, pool_size, scaling)
        return output, None
    return sparse_attention_torch(query, key, value, selected_windows, query_positions, pool_size, scaling, dropout,
                                  training, return_weights)


def sparse_latent_attention(query, latents, selected_windows, query_positions, pool_size, scaling, dropout=0.0,
                            training=False, return_weights=False):
    """MLA's absorbed attention over each query's selected windows and tail of latents; see
    `sparse_latent_attention_torch` for shapes.

    Triton on CUDA for inference (the decode step and long prefills); PyTorch elsewhere, and when a gradient,
    attention dropout or the weights are needed.
    """
    needs_reference = return_weights or (training and dropout > 0.0) or (
        torch.is_grad_enabled() and (query.requires_grad or latents.requires_grad))
    if sparse_latent_attention_triton is not None and not needs_reference and use_fast_path(query, latents):
        return sparse_latent_attention_triton(query, latents, selected_windows, query_positions, pool_size,
                                              scaling), None
    return sparse_latent_attention_torch(query, latents, selected_windows, query_positions, pool_size, scaling,
                                         dropout, training, return_weights)


def paged_attention_reads_request_tiles(device) -> bool:
    """Whether `paged_sparse_attention` on `device` takes its PyTorch path, the only one that reads `request_tiles`
    (so that a caller builds them only then): not where Triton serves CUDA tensors, nor on a CPU where the compiled
    kernel serves (it reads every token's windows in place, prefill chunks included: 4x faster than the tiles)."""
    device = torch.device(device)
    if device.type == "cpu":
        return not PAGED_CPU_KERNEL.usable()
    return paged_sparse_attention_triton is None or not use_fast_path(torch.empty(0, device=device))


def paged_sparse_attention(query, key_cache, value_cache, block_table, token_request, selected_windows,
                           query_positions, pool_size, scaling, output_gate=None, num_splits=None, request_tiles=None):
    """Sparse attention of a step's flattened tokens over keys and values in vLLM's pages (the vLLM plugin's entry);
    see `paged_sparse_attention_torch` for shapes. Output `[tokens, heads, head_dim]`.

    Triton on CUDA (`num_splits` overrides its split count, for tests), the compiled CPU kernel on a CPU
    (`cpu_impl`), PyTorch elsewhere (`request_tiles`: its prefill form; the kernels read each query's positions
    straight from the pages and need none). Inference only; no path reads a value back to the host.
    """
    if paged_sparse_attention_triton is not None and use_fast_path(query, key_cache, value_cache):
        return paged_sparse_attention_triton(query, key_cache, value_cache, block_table, token_request,
                                             selected_windows, query_positions, pool_size, scaling, output_gate,
                                             num_splits)
    if paged_attention_cpu_applies(query, key_cache, value_cache):
        return paged_sparse_attention_cpu(query, key_cache, value_cache, block_table, token_request, selected_windows,
                                          query_positions, pool_size, scaling, output_gate)
    return paged_sparse_attention_torch(query, key_cache, value_cache, block_table, token_request, selected_windows,
                                        query_positions, pool_size, scaling, output_gate, request_tiles)


__all__ = ["sparse_attention", "sparse_attention_torch", "sparse_attention_triton", "sparse_latent_attention",
           "sparse_latent_attention_torch", "sparse_latent_attention_triton", "paged_sparse_attention",
           "paged_sparse_attention_torch", "paged_sparse_attention_triton", "paged_sparse_attention_cpu",
           "paged_attention_reads_request_tiles",
           "RequestTiles", "TileGroup", "attention_slots", "masked_softmax"]
