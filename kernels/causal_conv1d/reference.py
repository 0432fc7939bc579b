"""PyTorch reference of the causal depthwise convolution: each channel convolved with its own short kernel over the
tokens, continuing from a state of the `kernel - 1` inputs before them."""

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

# Tokens up to which the convolution runs as dot products over a sliding view instead of `conv1d`.
FEW_TOKENS = 16


def causal_conv1d_torch(conv_input: torch.Tensor, weight: torch.Tensor, activation: str | None = None) -> torch.Tensor:
    """`conv_input [batch, channels, kernel - 1 + seq]` (the state, then the tokens), `weight [channels, kernel]` ->
    the activated output `[batch, channels, seq]`, in `conv_input`'s dtype."""
    num_tokens = conv_input.shape[-1] - weight.shape[-1] + 1
    if num_tokens <= FEW_TOKENS:
        # A decode step or a verify forward: one dot product per channel and token over a sliding view. CPU
        # backends run a depthwise `conv1d` channel by channel (each a tiny convolution), far slower for a few tokens.
        output = (conv_input.unfold(-1, weight.shape[-1], 1) * weight[:, None]).sum(dim=-1)
    else:
        output = F.conv1d(conv_input, weight[:, None], groups=weight.shape[0])
    return output if activation is None else ACT2FN[activation](output)
