"""Causal depthwise convolution (the short convolution before the delta rules) behind one entry point.

On CUDA tensors a prefill with no earlier state (the common case: a prompt's first chunk, training) runs the
`causal_conv1d` kernel, found by transformers' hub-kernel helper as transformers' own Qwen3-Next finds it: a kernel
from the Hub when kernels are requested, else the `causal-conv1d` package, else the reference (with transformers'
warning). Steps that continue from a cached state, and other devices, run the PyTorch reference.
"""

from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback

from ..dispatch import use_fast_path
from .reference import causal_conv1d_torch

# The activations the kernel applies itself.
KERNEL_ACTIVATIONS = ("silu", "swish")


@use_kernel_func_from_hub_with_fallback("causal_conv1d_fn", "causal_conv1d")
def causal_conv1d_fn(x, weight, bias=None, activation=None):
    """`causal_conv1d_fn` of the `causal-conv1d` kernel (zero initial state) where it is found, else the reference."""
    output = causal_conv1d_torch(x, weight, None, activation)
    return output if bias is None else output + bias[:, None]


def causal_conv1d(sequence, weight, state=None, activation=None):
    """The causal depthwise convolution of `sequence [batch, channels, seq]` with `weight [channels, kernel]`,
    continuing from `state [batch, channels, kernel - 1]` (None: zeros), then `activation`; see
    `causal_conv1d_torch`."""
    if state is None and activation in KERNEL_ACTIVATIONS and use_fast_path(sequence, weight):
        return causal_conv1d_fn(sequence, weight, activation=activation).to(sequence.dtype)
    return causal_conv1d_torch(sequence, weight, state, activation)


__all__ = ["causal_conv1d", "causal_conv1d_torch"]
