"""Gated DeltaNet, the linear-attention token mixer of Qwen3-Next / Qwen3.5."""

import torch
import torch.nn.functional as F
from torch import nn

from ..configuration.configuration_hybrid_indexpool import HybridIndexPoolConfig
from ..kernels.gated_delta_rule import gated_delta_rule
from .cache_layers import LinearAttentionLayerCache
from .delta_rule import continue_delta_rule
from .layers import HybridIndexPoolLinear, HybridIndexPoolRMSNormGated, tensor_parallel_rank
from .short_convolution import HybridIndexPoolShortConvolution


class HybridIndexPoolGatedDeltaNet(nn.Module):
    """Gated DeltaNet token mixer (the linear-attention layer of Qwen3-Next / Qwen3.5), Qwen3.5 weight layout.

    Causal depthwise convolution over the fused q/k/v projection, then the gated delta rule (chunked for prefill,
    recurrent for decode), then a gated RMSNorm and the output projection. Each row's real tokens come first (the
    model lays them out so); padding after them is zeroed, neither decays nor writes the recurrent state, and the
    convolution state kept is that of the last real tokens. Under tensor parallelism a rank runs its own heads.
    """

    def __init__(self, config: HybridIndexPoolConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_key_heads = config.linear_num_key_heads
        self.num_value_heads = config.linear_num_value_heads
        self.key_head_dim = config.linear_key_head_dim
        self.value_head_dim = config.linear_value_head_dim
        self.key_dim = self.num_key_heads * self.key_head_dim
        self.value_dim = self.num_value_heads * self.value_head_dim
        self.conv_kernel_size = config.linear_conv_kernel_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim

        self.in_proj_qkv = HybridIndexPoolLinear(config.hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = HybridIndexPoolLinear(config.hidden_size, self.value_dim, bias=False)
        self.in_proj_b = HybridIndexPoolLinear(config.hidden_size, self.num_value_heads, bias=False)
        self.in_proj_a = HybridIndexPoolLinear(config.hidden_size, self.num_value_heads, bias=False)
        self.conv1d = HybridIndexPoolShortConvolution(self.conv_dim, self.conv_kernel_size, config.hidden_act)
        # float32 whatever the default dtype: `_keep_in_fp32_modules_strict` keeps them so when loading, and a model
        # built directly (e.g. under a half-precision default dtype) must agree.
        self.dt_bias = nn.Parameter(torch.ones(self.num_value_heads, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.empty(self.num_value_heads, dtype=torch.float32).uniform_(1, 16).log_())
        self.norm = HybridIndexPoolRMSNormGated(
            self.value_head_dim, eps=config.rms_norm_eps, activation=config.linear_output_gate_act
        )
        self.out_proj = HybridIndexPoolLinear(self.value_dim, config.hidden_size, bias=False)
        self._rank_channels = None  # under tensor parallelism, this rank's channels of the fused q/k/v projection

    def forward(
        self,
        hidden_states: torch.Tensor,
        token_is_real: torch.Tensor,
        layer_cache: LinearAttentionLayerCache | None = None,
    ) -> torch.Tensor:
        batch_size, seq_len, _ = hidden_states.shape
        real = token_is_real[..., None].to(hidden_states.dtype)
        hidden_states = torch.where(token_is_real[..., None], hidden_states, 0.0)  # whatever a pad holds, even NaN
        channels, key_dim, A_log, dt_bias = self._rank_share()

        mixed = self.in_proj_qkv(hidden_states)
        if channels is not None:
            mixed = mixed.index_select(-1, channels)  # this rank's heads
        conv_state = None if layer_cache is None else layer_cache.conv_states[0]
        mixed, conv_input = self.conv1d(mixed, conv_state, channels)  # [batch, seq, conv_dim (this rank's)]

        query, key, value = mixed.split([key_dim, key_dim, mixed.shape[-1] - 2 * key_dim], dim=-1)
        query = query.reshape(batch_size, seq_len, -1, self.key_head_dim)
        key = key.reshape(batch_size, seq_len, -1, self.key_head_dim)
        value = value.reshape(batch_size, seq_len, -1, self.value_head_dim)
        beta = self.in_proj_b(hidden_states).sigmoid() * real
        log_decay = -A_log.float().exp() * F.softplus(self.in_proj_a(hidden_states).float() + dt_bias)
        log_decay = log_decay * real

        core = continue_delta_rule(gated_delta_rule, (query, key, value, log_decay, beta), token_is_real, layer_cache,
                                   None if layer_cache is None else self.conv1d.next_state(conv_input, token_is_real),
                                   conv_input)

        gate = self.in_proj_z(hidden_states).reshape(batch_size, seq_len, -1, self.value_head_dim)
        core = self.norm(core, gate).reshape(batch_size, seq_len, -1)
        return self.out_proj(core)

    def _rank_share(self):
        """This rank's share of the layer under transformers' tensor parallelism (all of it otherwise): the index of
        its heads' channels in the fused q/k/v projection (None: every channel), its query/key width, and the
        `A_log` and `dt_bias` of its heads.

        The rank follows `in_proj_z`, which the plan splits by value heads; each rank then owns the key heads those
        value heads read (`linear_num_key_heads` divide evenly, see `check_tensor_parallel_size`).
        """
        rank, ranks = tensor_parallel_rank(self.in_proj_z.weight)
        if ranks == 1:
            return None, self.key_dim, self.A_log, self.dt_bias
        key_dim, value_dim = self.key_dim // ranks, self.value_dim // ranks
        if self._rank_channels is None:
            self._rank_channels = torch.cat([
                torch.arange(rank * key_dim, (rank + 1) * key_dim),  # query
                torch.arange(self.key_dim + rank * key_dim, self.key_dim + (rank + 1) * key_dim),  # key
                torch.arange(2 * self.key_dim + rank * value_dim, 2 * self.key_dim + (rank + 1) * value_dim),  # value
            ]).to(self.conv1d.weight.device)
        heads = slice(rank * self.num_value_heads // ranks, (rank + 1) * self.num_value_heads // ranks)
        return self._rank_channels, key_dim, self.A_log[heads], self.dt_bias[heads]
