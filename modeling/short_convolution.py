"""The causal depthwise convolution that both linear-attention mixers (Gated DeltaNet, KDA) run before their rule."""

import torch
from torch import nn

from ..kernels.causal_conv1d import causal_conv1d
from .layers import last_real_entries


class HybridIndexPoolShortConvolution(nn.Conv1d):
    """Causal depthwise convolution over a few tokens (`kernel_size`, 4 in the released models), then an activation.

    The weight is `nn.Conv1d`'s `[channels, 1, kernel]`, so checkpoints keep the name `conv1d.weight`. A forward with a
    cache continues from its last `kernel - 1` inputs (the convolution state); without one it starts from zeros.
    """

    def __init__(self, channels: int, kernel_size: int, activation: str):
        super().__init__(channels, channels, kernel_size, groups=channels, bias=False, padding=kernel_size - 1)
        self.activation = activation

    def forward(
        self,
        mixed: torch.Tensor,
        conv_state: torch.Tensor | None = None,
        channels: torch.Tensor | None = None,
        compute_dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Convolve `mixed` `[batch, seq, channels]`; returns the activated output in `mixed`'s dtype, same shape, and
        the convolution input `[batch, channels, kernel - 1 + seq]` (state, then the new tokens) in `compute_dtype`
        (default `mixed`'s), from which `next_state` takes what the cache keeps.

        `channels` selects this rank's channels under tensor parallelism (their weights; `mixed` holds only those).
        """
        batch_size = mixed.shape[0]
        compute_dtype = compute_dtype or mixed.dtype
        weight = self.weight[:, 0] if channels is None else self.weight[channels, 0]  # [channels, kernel]
        weight = weight.to(compute_dtype)
        sequence = mixed.transpose(1, 2).to(compute_dtype)  # [batch, channels, seq]
        zero_state = conv_state is None
        if zero_state:
            conv_state = sequence.new_zeros(batch_size, sequence.shape[1], self.kernel_size[0] - 1)
        conv_input = torch.cat([conv_state.to(compute_dtype), sequence], dim=-1)
        output = causal_conv1d(conv_input, weight, self.activation, zero_state=zero_state)
        return output.to(mixed.dtype).transpose(1, 2), conv_input

    def next_state(self, conv_input: torch.Tensor, token_is_real: torch.Tensor) -> torch.Tensor:
        """The state to cache after these tokens: the last `kernel - 1` inputs up to each row's last real token."""
        return last_real_entries(conv_input, token_is_real.sum(dim=1), self.kernel_size[0] - 1)
