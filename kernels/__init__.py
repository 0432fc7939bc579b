"""Kernels of HybridIndexPool: one folder per operation, each with its PyTorch reference and one entry point."""

from .gated_delta_rule import gated_delta_rule
from .pooled_index_topk import pooled_index_topk
from .sparse_attention import sparse_attention
from .weighted_pool import weighted_pool

__all__ = ["gated_delta_rule", "pooled_index_topk", "sparse_attention", "weighted_pool"]
