"""Several residual streams per layer: the hyper-connections of Qwen4-Exp."""

import torch
import torch.nn.functional as F
from torch import nn

from ..configuration.configuration_hybrid_indexpool import HybridIndexPoolConfig
from .layers import HybridIndexPoolLinear, HybridIndexPoolRMSNorm


class HybridIndexPoolHyperConnection(nn.Module):
    """Gated read from and write to `hc_count` residual streams (the hyper-connections of Qwen4-Exp).

    The streams `[..., hc_count * hidden]` are normed one by one; a low-rank projection of them gives a sigmoid gate
    per stream and channel, and the block's input is the mean of the gated normed streams. With `inject` the block's
    output is added back to each stream scaled by `2 * sigmoid(.)` of another projection of the normed streams.
    """

    def __init__(self, config: HybridIndexPoolConfig, inject: bool = True):
        super().__init__()
        self.hc_count = config.hc_count
        self.hidden_size = config.hidden_size
        streams_width = self.hc_count * self.hidden_size
        self.hc_norm = HybridIndexPoolRMSNorm(streams_width, eps=config.rms_norm_eps, group_size=self.hidden_size)
        self.input_mix_weight_down = HybridIndexPoolLinear(streams_width, config.hc_lowrank, bias=False)
        self.input_mix_weight_up = HybridIndexPoolLinear(config.hc_lowrank, streams_width, bias=False)
        self.block_inject_weight = HybridIndexPoolLinear(streams_width, self.hc_count, bias=False) if inject else None

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`streams [batch, seq, hc_count * hidden]` -> block input `[batch, seq, hidden]` and the write gates
        `[batch, seq, hc_count]` (None without `inject`)."""
        normed = self.hc_norm(streams)
        mix = F.silu(self.input_mix_weight_down(normed) / self.hc_count)
        mix = torch.sigmoid(self.input_mix_weight_up(mix)).unflatten(-1, (self.hc_count, self.hidden_size))
        block_input = (mix * normed.unflatten(-1, (self.hc_count, self.hidden_size))).mean(dim=-2)
        if self.block_inject_weight is None:
            return block_input, None
        return block_input, 2 * torch.sigmoid(self.block_inject_weight(normed) / self.hc_count)

    @staticmethod
    def inject(streams: torch.Tensor, block_output: torch.Tensor, write_gates: torch.Tensor) -> torch.Tensor:
        """Add `block_output [batch, seq, hidden]` to every stream, scaled by its gate."""
        return streams + (block_output.unsqueeze(-2) * write_gates.unsqueeze(-1)).flatten(-2)
