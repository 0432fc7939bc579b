"""PyTorch reference of the causal depthwise convolution: each channel convolved with its own short kernel over the
tokens, continuing from a state of the `kernel - 1` inputs before them."""

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN


def causal_conv1d_torch(conv_input: torch.Tensor, weight: torch.Tensor, activation: str | None = None) -> torch.Tensor:
    """`conv_input [batch, channels, kernel - 1 + seq]` (the state, then the tokens), `weight [channels, kernel]` ->
    the activated output `[batch, channels, seq]`, in `conv_input`'s dtype."""
    if conv_input.shape[-1] == weight.shape[-1]:  # decode: one dot product per channel, cheaper than a convolution
        output = (conv_input * weight).sum(dim=-1, keepdim=True)
    else:
        output = F.conv1d(conv_input, weight[:, None], groups=weight.shape[0])
    return output if activation is None else ACT2FN[activation](output)
