"""The decode step's linear layers behind one entry point: the compiled CPU matrix-vector product for a few rows
on CPU without autograd, `F.linear` otherwise (on CUDA the BLAS already runs the batch-1 product at the bandwidth)."""

from .cpu_impl import decode_linear_applies, decode_linear_cpu
from .reference import decode_linear_torch


def decode_linear(hidden_states, weight, bias=None):
    """`F.linear(hidden_states, weight, bias)`; see `decode_linear_torch` for shapes."""
    if decode_linear_applies(hidden_states, weight):
        return decode_linear_cpu(hidden_states, weight, bias)
    return decode_linear_torch(hidden_states, weight, bias)


__all__ = ["decode_linear", "decode_linear_cpu", "decode_linear_torch"]
