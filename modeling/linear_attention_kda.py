"""Kimi Delta Attention (KDA), the linear-attention token mixer of Kimi Linear and GLM-5.3-Flash."""

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from ..configuration.configuration_hybrid_indexpool import HybridIndexPoolConfig
from ..kernels.kimi_delta_rule import kimi_delta_rule
from .cache_layers import LinearAttentionLayerCache
from .delta_rule import continue_delta_rule
from .layers import HybridIndexPoolLinear, tensor_parallel_rank
from .short_convolution import HybridIndexPoolShortConvolution


class HybridIndexPoolKimiForgetGate(nn.Module):
    """KDA's forget gate: one log decay per key channel, from a low-rank projection of the input.

    `x = f_b_proj(f_a_proj(h)) + dt_bias`; with a lower bound `lb` the log decay is `lb * sigmoid(exp(A_log) * x)`,
    in `[lb, 0)` (the "safe gate", which fla's chunk kernel exploits), otherwise `-exp(A_log) * softplus(x)`.
    """

    def __init__(self, config: HybridIndexPoolConfig):
        super().__init__()
        self.num_heads = config.linear_num_key_heads
        self.head_dim = config.linear_key_head_dim
        self.lower_bound = config.linear_gate_lower_bound
        self.f_a_proj = HybridIndexPoolLinear(config.hidden_size, self.head_dim, bias=False)
        self.f_b_proj = HybridIndexPoolLinear(self.head_dim, self.num_heads * self.head_dim, bias=False)
        # float32 whatever the default dtype (`_keep_in_fp32_modules_strict` keeps them so when loading).
        self.dt_bias = nn.Parameter(torch.zeros(self.num_heads * self.head_dim, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """`[batch, seq, hidden]` -> log decays `[batch, seq, heads, head_dim]` in float32 (this rank's heads under
        tensor parallelism: `f_b_proj` is split by heads, `dt_bias` and `A_log` are sliced to match)."""
        rank, ranks = tensor_parallel_rank(self.f_b_proj.weight)
        heads = slice(rank * self.num_heads // ranks, (rank + 1) * self.num_heads // ranks)
        channels = slice(heads.start * self.head_dim, heads.stop * self.head_dim)
        gate = self.f_b_proj(self.f_a_proj(hidden_states)).float() + self.dt_bias[channels].float()
        gate = gate.unflatten(-1, (-1, self.head_dim))
        rate = self.A_log[heads].float().exp()[:, None]  # [heads, 1]
        if self.lower_bound is not None:
            return self.lower_bound * torch.sigmoid(rate * gate)
        return -rate * F.softplus(gate)


class HybridIndexPoolKimiRMSNormGated(nn.Module):
    """RMSNorm of each KDA head then a gate, `weight * norm(x) * act(gate)` (act sigmoid in KDA), entirely in
    float32 like flash-linear-attention's fused norm: the weight is not rounded to the input dtype first, as
    [`HybridIndexPoolRMSNormGated`] (Gated DeltaNet's) does."""

    def __init__(self, dim: int, eps: float = 1e-6, activation: str = "sigmoid"):
        super().__init__()
        self.eps = eps
        self.gate_act_fn = ACT2FN[activation]  # looked up once: ACT2FN builds a module on every lookup
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        normed = hidden_states.float()
        normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * normed * self.gate_act_fn(gate.float())).to(hidden_states.dtype)


class HybridIndexPoolKimiDeltaAttention(nn.Module):
    """Kimi Delta Attention token mixer (GLM-5.3-Flash's linear-attention layer).

    Separate query/key/value projections, one causal depthwise convolution over them (computed in float32), then the
    Kimi delta rule, whose decay is per key channel (chunked for prefill, recurrent for decode), then a gated RMSNorm
    and the output projection; forget gate and output gate come from low-rank projections. Real tokens, padding, cache
    and tensor parallelism are handled as in [`HybridIndexPoolGatedDeltaNet`]: each row's real tokens come first;
    padding after them is zeroed, neither decays nor writes the recurrent state, and the convolution state kept is that
    of the last real tokens; a rank runs its own heads.

    Weight names are GLM's (`Glm5NextTextLinearAttention`), so conversion maps
    `model.language_model.layers.{i}.linear_attn.<name>` to `model.layers.{i}.linear_attn.<name>` unchanged, with the
    same shapes and values for every `<name>`: `q_proj.weight`, `k_proj.weight`, `v_proj.weight`, `conv1d.weight`,
    `forget_gate.f_a_proj.weight`, `forget_gate.f_b_proj.weight`, `forget_gate.dt_bias`, `forget_gate.A_log`,
    `b_proj.weight`, `g_a_proj.weight`, `g_b_proj.weight`, `o_norm.weight` (a plain scale, `weight * x`, like GLM's:
    not zero-centred, nothing subtracted), `o_proj.weight`. GLM's `linear_lower_bound` is `linear_gate_lower_bound`.
    """

    def __init__(self, config: HybridIndexPoolConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.linear_num_key_heads  # == linear_num_value_heads, checked by the config
        self.head_dim = config.linear_key_head_dim  # == linear_value_head_dim
        self.qkv_dim = self.num_heads * self.head_dim
        self.conv_kernel_size = config.linear_conv_kernel_dim
        self.gate_lower_bound = config.linear_gate_lower_bound

        self.q_proj = HybridIndexPoolLinear(config.hidden_size, self.qkv_dim, bias=False)
        self.k_proj = HybridIndexPoolLinear(config.hidden_size, self.qkv_dim, bias=False)
        self.v_proj = HybridIndexPoolLinear(config.hidden_size, self.qkv_dim, bias=False)
        self.conv1d = HybridIndexPoolShortConvolution(3 * self.qkv_dim, self.conv_kernel_size, config.hidden_act)
        self.forget_gate = HybridIndexPoolKimiForgetGate(config)
        self.b_proj = HybridIndexPoolLinear(config.hidden_size, self.num_heads, bias=False)
        self.g_a_proj = HybridIndexPoolLinear(config.hidden_size, self.head_dim, bias=False)
        self.g_b_proj = HybridIndexPoolLinear(self.head_dim, self.qkv_dim, bias=False)
        self.o_norm = HybridIndexPoolKimiRMSNormGated(
            self.head_dim, eps=config.rms_norm_eps, activation=config.linear_output_gate_act
        )
        self.o_proj = HybridIndexPoolLinear(self.qkv_dim, config.hidden_size, bias=False)
        self._rank_channels = None  # under tensor parallelism, this rank's channels of the q|k|v convolution

    def forward(
        self,
        hidden_states: torch.Tensor,
        token_is_real: torch.Tensor,
        layer_cache: LinearAttentionLayerCache | None = None,
    ) -> torch.Tensor:
        batch_size, seq_len, _ = hidden_states.shape
        real = token_is_real[..., None].float()
        hidden_states = torch.where(token_is_real[..., None], hidden_states, 0.0)  # whatever a pad holds, even NaN

        # Causal depthwise convolution over [q | k | v] in float32, as GLM keeps it.
        mixed = torch.cat([self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)], dim=-1)
        conv_state = None if layer_cache is None else layer_cache.conv_states[0]
        mixed, conv_input = self.conv1d(mixed, conv_state, self._rank_channels_of_conv(), torch.float32)

        # [batch, seq, heads, head_dim] each
        query, key, value = (x.unflatten(-1, (-1, self.head_dim)) for x in mixed.chunk(3, dim=-1))
        log_decay = self.forget_gate(hidden_states) * real[..., None]  # [batch, seq, heads, head_dim]
        beta = self.b_proj(hidden_states).sigmoid() * real  # [batch, seq, heads]

        rule = partial(kimi_delta_rule, gate_lower_bound=self.gate_lower_bound)
        core = continue_delta_rule(rule, (query, key, value, log_decay, beta), token_is_real, layer_cache,
                                   None if layer_cache is None else self.conv1d.next_state(conv_input, token_is_real),
                                   conv_input)

        gate = self.g_b_proj(self.g_a_proj(hidden_states)).unflatten(-1, (-1, self.head_dim))
        core = self.o_norm(core, gate).reshape(batch_size, seq_len, -1)
        return self.o_proj(core)

    def _rank_channels_of_conv(self) -> torch.Tensor | None:
        """This rank's channels of the q|k|v convolution under transformers' tensor parallelism (None: all of them):
        `q_proj`, `k_proj` and `v_proj` are split by heads, the convolution is replicated."""
        rank, ranks = tensor_parallel_rank(self.q_proj.weight)
        if ranks == 1:
            return None
        if self._rank_channels is None:
            width = self.qkv_dim // ranks
            self._rank_channels = torch.cat([
                torch.arange(part * self.qkv_dim + rank * width, part * self.qkv_dim + (rank + 1) * width)
                for part in range(3)  # query, key, value
            ]).to(self.conv1d.weight.device)
        return self._rank_channels
