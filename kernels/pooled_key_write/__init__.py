"""The pooled-key write of a serving step (pool each token's window from the step's rows and the open-window ring,
norm, RoPE, optional fp8 packing, store in vLLM's paged pooled-key cache) behind one entry point: Triton on CUDA, the
PyTorch reference otherwise."""

from ..dispatch import use_fast_path
from .reference import (
    WEIGHTINGS,
    gather_window_rows,
    gemma_rms_norm,
    neox_rotary,
    pool_window_rows,
    write_pooled_keys_torch,
)

try:
    from .triton_impl import write_pooled_keys_triton
except ImportError:  # no Triton: the PyTorch path serves every device
    write_pooled_keys_triton = None


def write_pooled_keys(pooled_key_cache, step_rows, ring_cache, window_token, window_ring_block, window_start,
                      cos_sin_cache, norm_weight, norm_eps, slot_bias, weighting, write_token, write_block, write_row,
                      write_keep) -> None:
    """Write every token's pooled key into the paged pooled-key cache, in place; see `write_pooled_keys_torch`. The
    ring must be written after this call (its rows of earlier steps are read here)."""
    args = (pooled_key_cache, step_rows, ring_cache, window_token, window_ring_block, window_start, cos_sin_cache,
            norm_weight, norm_eps, slot_bias, weighting, write_token, write_block, write_row, write_keep)
    if write_pooled_keys_triton is not None and use_fast_path(pooled_key_cache, step_rows, ring_cache):
        return write_pooled_keys_triton(*args)
    return write_pooled_keys_torch(*args)


__all__ = ["WEIGHTINGS", "gather_window_rows", "gemma_rms_norm", "neox_rotary", "pool_window_rows", "write_pooled_keys",
           "write_pooled_keys_torch", "write_pooled_keys_triton"]
