"""IndexPool sparse attention (selected windows plus tail, GQA) behind one entry point."""

from .reference import attention_slots, masked_softmax, sparse_attention_torch


def sparse_attention(query, key, value, selected_windows, window_slot_offset, query_slots, tail_length, pool_size,
                     scaling, dropout=0.0, training=False, return_weights=False):
    """Attention over each query's selected windows and tail; see `sparse_attention_torch` for shapes."""
    return sparse_attention_torch(query, key, value, selected_windows, window_slot_offset, query_slots, tail_length,
                                  pool_size, scaling, dropout, training, return_weights)


__all__ = ["sparse_attention", "sparse_attention_torch", "attention_slots", "masked_softmax"]
