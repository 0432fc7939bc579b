"""Several residual streams per layer: the hyper-connections of Qwen4-Exp and the Sinkhorn ones of GLM-5.3-Flash."""

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
        self.hc_norm = HybridIndexPoolRMSNorm.from_config(config, streams_width, group_size=self.hidden_size)
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


class HybridIndexPoolSinkhornHyperConnection(nn.Module):
    """Read from and write to `hc_count` residual streams through a doubly stochastic mixing matrix: the
    manifold-constrained hyper-connections (mHC) of GLM-5.3-Flash.

    One projection `fn` of the flattened streams, RMS-normed without a weight, gives per token the read weights
    `pre = sigmoid(.) + eps`, the write weights `post = 2 * sigmoid(.)` and the mixing logits `comb`, each affine
    (`scale` per kind, `base` per entry); `comb` goes through a softmax, then Sinkhorn iterations towards rows and
    columns summing to one, so that mixing the streams keeps their scale over many layers. The block reads
    `sum_n pre_n * stream_n`; `inject` writes `post_n * output + sum_m comb_mn * stream_m` into stream `n`.
    The mixing is computed in float32.
    """

    def __init__(self, config: HybridIndexPoolConfig):
        super().__init__()
        self.hc_count = config.hc_count
        self.hidden_size = config.hidden_size
        self.sinkhorn_iters = config.hc_sinkhorn_iters
        self.hc_eps = config.hc_eps
        self.norm_eps = config.rms_norm_eps
        mixes = (2 + self.hc_count) * self.hc_count  # pre, post, then comb row by row
        self.fn = nn.Parameter(torch.empty(mixes, self.hc_count * self.hidden_size))
        self.base = nn.Parameter(torch.empty(mixes))
        self.scale = nn.Parameter(torch.empty(3))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """`streams [batch, seq, hc_count * hidden]` -> block input `[batch, seq, hidden]` and the write weights:
        `post [batch, seq, hc_count]` and `comb [batch, seq, hc_count, hc_count]` (float32)."""
        count = self.hc_count
        flat = streams.float()
        normed = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.norm_eps)
        sizes = [count, count, count * count]
        pre, post, comb = F.linear(normed, self.fn.float()).split(sizes, dim=-1)
        pre_base, post_base, comb_base = self.base.float().split(sizes)
        pre_scale, post_scale, comb_scale = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre * pre_scale + pre_base) + self.hc_eps  # [batch, seq, hc_count]
        post = 2 * torch.sigmoid(post * post_scale + post_base)  # [batch, seq, hc_count]
        comb = torch.softmax((comb * comb_scale + comb_base).unflatten(-1, (count, count)), dim=-1) + self.hc_eps
        # Sinkhorn-Knopp: columns first, then rows and columns in turn.
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        per_stream = streams.unflatten(-1, (count, self.hidden_size))  # [batch, seq, hc_count, hidden]
        block_input = (pre.unsqueeze(-1) * per_stream).sum(dim=-2).to(streams.dtype)
        return block_input, (post, comb)

    @staticmethod
    def inject(streams: torch.Tensor, block_output: torch.Tensor,
               write_weights: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """New streams `[batch, seq, hc_count * hidden]`: `post * block_output + comb^T @ streams`, in the streams'
        dtype."""
        post, comb = (weights.to(streams.dtype) for weights in write_weights)
        per_stream = streams.unflatten(-1, (post.shape[-1], -1))  # [batch, seq, hc_count, hidden]
        mixed = post.unsqueeze(-1) * block_output.unsqueeze(-2) + comb.transpose(-1, -2) @ per_stream
        return mixed.flatten(-2)

    @staticmethod
    def collapse(streams: torch.Tensor, hc_count: int) -> torch.Tensor:
        """The model's last read of the streams, `[batch, seq, hc_count * hidden]` -> `[batch, seq, hidden]`: their
        mean (the final norm follows)."""
        return streams.unflatten(-1, (hc_count, -1)).mean(dim=-2)
