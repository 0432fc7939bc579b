"""Weighted pooling of completed indexer windows behind one entry point (PyTorch: it is not on the hot path)."""

from .reference import weighted_pool_torch


def weighted_pool(window_keys, window_gate_logits=None):
    """Pool each window's raw keys; see `weighted_pool_torch`."""
    return weighted_pool_torch(window_keys, window_gate_logits)


__all__ = ["weighted_pool", "weighted_pool_torch"]
