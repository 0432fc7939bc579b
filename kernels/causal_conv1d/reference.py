"""PyTorch reference of the causal depthwise convolution: each channel convolved with its own short kernel over the
tokens, continuing from a state of the `kernel - 1` inputs before them."""

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN


def causal_conv1d_torch(sequence: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None = None,
                        activation: str | None = None) -> torch.Tensor:
    """`sequence [batch, channels, seq]`, `weight [channels, kernel]`, `state [batch, channels, kernel - 1]` (None:
    zeros) -> the activated output `[batch, channels, seq]`, in `sequence`'s dtype."""
    kernel = weight.shape[-1]
    if state is None:
        state = sequence.new_zeros(*sequence.shape[:2], kernel - 1)
    conv_input = torch.cat([state.to(sequence.dtype), sequence], dim=-1)
    if sequence.shape[-1] == 1:  # decode: one dot product per channel, cheaper than setting up a convolution
        output = (conv_input * weight).sum(dim=-1, keepdim=True)
    else:
        output = F.conv1d(conv_input, weight[:, None], groups=weight.shape[0])
    return output if activation is None else ACT2FN[activation](output)
