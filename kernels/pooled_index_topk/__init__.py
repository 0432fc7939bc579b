"""Pooled index score + top-k window selection behind one entry point."""

from .reference import pooled_index_scores_torch, pooled_index_topk_torch


def pooled_index_topk(index_queries, pooled_index_keys, num_visible_windows, topk, head_weights=None):
    """Select each query's `topk` best visible windows; see `pooled_index_topk_torch` for shapes."""
    return pooled_index_topk_torch(index_queries, pooled_index_keys, num_visible_windows, topk, head_weights)


__all__ = ["pooled_index_topk", "pooled_index_topk_torch", "pooled_index_scores_torch"]
