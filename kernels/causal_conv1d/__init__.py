"""Causal depthwise convolution (the short convolution before the delta rules) behind one entry point.

On CUDA tensors a prefill with no earlier state (the common case: a prompt's first chunk, training) runs the
`causal_conv1d` kernel, found by transformers' hub-kernel helper as transformers' own Qwen3-Next finds it: a kernel
from the Hub when kernels are requested, else the `causal-conv1d` package, else the reference (with transformers'
warning). Steps that continue from a cached state, and other devices, run the PyTorch reference.
"""

import torch
from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback

from ..dispatch import use_fast_path
from .reference import causal_conv1d_torch

# The activations the kernel applies itself.
KERNEL_ACTIVATIONS = ("silu", "swish")


@use_kernel_func_from_hub_with_fallback("causal_conv1d_fn", "causal_conv1d")
def causal_conv1d_fn(x, weight, bias=None, activation=None):
    """`causal_conv1d_fn` of the `causal-conv1d` kernel (zero initial state) where it is found, else the reference."""
    state = x.new_zeros(*x.shape[:2], weight.shape[-1] - 1)
    output = causal_conv1d_torch(torch.cat([state, x], dim=-1), weight, activation)
    return output if bias is None else output + bias[:, None]


def causal_conv1d(conv_input, weight, activation=None, zero_state=False):
    """The causal depthwise convolution of `conv_input [batch, channels, kernel - 1 + seq]` (the state, then the
    tokens) with `weight [channels, kernel]`, then `activation`; see `causal_conv1d_torch`. `zero_state`: the state is
    zeros (a prefill from the start), which the kernel starts from by itself."""
    if zero_state and activation in KERNEL_ACTIVATIONS and use_fast_path(conv_input, weight):
        tokens = conv_input[..., weight.shape[-1] - 1:]
        return causal_conv1d_fn(tokens, weight, activation=activation).to(conv_input.dtype)
    return causal_conv1d_torch(conv_input, weight, activation)


__all__ = ["causal_conv1d", "causal_conv1d_torch"]
