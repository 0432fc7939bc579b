"""IndexPool sparse attention (selected windows plus tail, GQA) behind one entry point."""

from ..dispatch import use_fast_path
from .reference import attention_slots, masked_softmax, sparse_attention_torch

try:
    from .triton_impl import sparse_attention_triton
except ImportError:  # no Triton: the PyTorch path serves every device
    sparse_attention_triton = None


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


__all__ = ["sparse_attention", "sparse_attention_torch", "sparse_attention_triton", "attention_slots",
           "masked_softmax"]
