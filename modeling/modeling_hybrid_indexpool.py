"""HybridIndexPool: a hybrid decoder of Gated DeltaNet linear attention and IndexPool sparse attention.

An IndexPool layer is gated GQA attention whose key/value set is chosen per query by a lightweight indexer. The
indexer keeps one pooled key per window of `r = index_pool_size` consecutive tokens (weighted pooling, then norm,
then RoPE at the window's first position), scores the complete windows a query may see, and the query attends to
the raw keys/values of its best `index_topk // r` windows plus its own open window (the tail).
"""

import math
import os
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.generation import GenerationMixin
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface, use_experts_implementation
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    MoeCausalLMOutputWithPast,
    MoeModelOutputWithPast,
    SequenceClassifierOutputWithPast,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update
from transformers.modeling_utils import PreTrainedModel
from transformers.utils import logging
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import can_return_tuple

from ..configuration.configuration_hybrid_indexpool import HybridIndexPoolConfig
from ..kernels.decode_linear import decode_linear
from ..kernels.gated_delta_rule import gated_delta_rule
from ..kernels.pooled_index_topk import pooled_index_scores_torch, pooled_index_topk
from ..kernels.sparse_attention import masked_softmax, sparse_attention
from ..kernels.weighted_pool import weighted_pool
from .cache_hybrid_indexpool import HybridIndexPoolCache, IndexPoolLayerCache, LinearAttentionLayerCache
from .hub_export import auto_map_for, write_model_card, write_remote_code
from .token_layout import TokenLayout
from .ngram_hash import hash_multipliers, head_table_sizes, shifted_in_segment

logger = logging.get_logger(__name__)


@dataclass
class HybridIndexPoolModelOutput(MoeModelOutputWithPast):
    """`MoeModelOutputWithPast` (`router_logits`: one `[batch * seq, num_experts]` per MoE layer, when asked for) plus
    `indexer_loss`, the IndexPool layers' mean KL loss when it was asked for."""

    indexer_loss: torch.FloatTensor | None = None


@dataclass
class HybridIndexPoolCausalLMOutput(MoeCausalLMOutputWithPast):
    """`MoeCausalLMOutputWithPast` (`aux_loss`, the load-balancing loss, and `router_logits`, when router logits were
    asked for) plus `indexer_loss`; both losses are already included, weighted, in `loss`."""

    indexer_loss: torch.FloatTensor | None = None


@dataclass
class HybridIndexPoolSequenceClassifierOutput(SequenceClassifierOutputWithPast):
    """`SequenceClassifierOutputWithPast` plus the load-balancing `aux_loss` (included, weighted, in `loss`) and the
    `router_logits`, when router logits were asked for."""

    aux_loss: torch.FloatTensor | None = None
    router_logits: tuple[torch.Tensor, ...] | None = None


def load_balancing_loss(router_logits: tuple[torch.Tensor, ...], top_k: int,
                        attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Switch Transformer's load-balancing loss over the MoE layers, as transformers' MoE models compute it:
    `num_experts * sum_e f_e * P_e`, with `f_e` the top-k assignments expert `e` receives per token and `P_e` its mean
    router probability, both over the real tokens of every layer. Only `P_e` carries a gradient (to the routers).

    `router_logits`: one `[batch * seq, num_experts]` per layer; `attention_mask`: `[batch, seq]`, 0 for padding,
    which then counts for nothing.
    """
    num_experts = router_logits[0].shape[-1]
    device = router_logits[0].device
    token_weights = torch.ones(router_logits[0].shape[0], device=device)
    if attention_mask is not None:
        token_weights = attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    assignments = torch.zeros(num_experts, device=device)
    probability = torch.zeros(num_experts, device=device)
    # Summed one layer at a time: memory stays that of one layer's probabilities.
    for logits in router_logits:
        probs = logits.to(device).float().softmax(dim=-1)
        selected = probs.topk(top_k, dim=-1).indices
        assignments = assignments.index_add(0, selected.reshape(-1), token_weights.repeat_interleave(top_k))
        probability = probability + (probs * token_weights[:, None]).sum(dim=0)
    tokens = (token_weights.sum() * len(router_logits)).clamp(min=1.0)  # an all-padding batch gives 0, not NaN
    return num_experts * ((assignments / tokens) * (probability / tokens)).sum()


class HybridIndexPoolLinear(nn.Linear):
    """`nn.Linear` whose inference products of a few tokens on CPU (the decode step) run the streaming
    matrix-vector kernel of `kernels.decode_linear`; everything else (training, prefill, CUDA) is `F.linear`.
    Same parameters and state dict as `nn.Linear`."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return decode_linear(hidden_states, self.weight, self.bias)


class HybridIndexPoolRMSNorm(nn.Module):
    """Zero-centred RMSNorm: `x / rms(x) * (1 + weight)`, computed in float32 (the Qwen3-Next convention).

    With `group_size`, each consecutive group of that many channels (one residual stream) is normalised on its own.
    """

    def __init__(self, dim: int, eps: float = 1e-6, group_size: int | None = None):
        super().__init__()
        self.eps = eps
        self.group_size = group_size
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        normed = hidden_states.float()
        if self.group_size is not None:
            normed = normed.unflatten(-1, (-1, self.group_size))
        normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.group_size is not None:
            normed = normed.flatten(-2)
        return (normed * (1.0 + self.weight.float())).type_as(hidden_states)


class HybridIndexPoolRMSNormGated(nn.Module):
    """RMSNorm followed by a gate, on each Gated DeltaNet value head: `weight * norm(x) * act(gate)`, `act` SiLU
    (Qwen3-Next, Qwen3.5) or sigmoid (an option of Qwen4-Exp)."""

    def __init__(self, dim: int, eps: float = 1e-6, activation: str = "silu"):
        super().__init__()
        self.eps = eps
        self.gate_act_fn = ACT2FN[activation]  # looked up once: ACT2FN builds a module on every lookup
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        normed = hidden_states.float()
        normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + self.eps)
        normed = self.weight * normed.to(input_dtype)
        return (normed * self.gate_act_fn(gate.float())).to(input_dtype)


class HybridIndexPoolRotaryEmbedding(nn.Module):
    """Partial, non-interleaved RoPE shared by the attention heads and the indexer heads, through transformers' RoPE
    machinery: every `rope_type` of `ROPE_INIT_FUNCTIONS` (linear, dynamic NTK, YaRN, LongRoPE, Llama 3, ...), with
    the frequency updates of the dynamic types (which read the longest position from the device).

    With `mrope_section` in `rope_parameters` (a multimodal model) it is Qwen4-Exp's interleaved multimodal RoPE:
    positions come in three streams (time, height, width) and frequency `i` follows the height stream when
    `i % 3 == 1` and `i < 3 * mrope_section[1]`, the width stream when `i % 3 == 2` and `i < 3 * mrope_section[2]`,
    the time stream otherwise. Equal streams (text) give plain RoPE.

    `forward(x, position_ids)` takes `[batch, seq]` or `[3, batch, seq]` positions and returns `cos, sin` of shape
    `[batch, seq, rotary_dim]`.
    """

    def __init__(self, config: HybridIndexPoolConfig):
        super().__init__()
        self.config = config
        self.max_seq_len_cached = config.max_position_embeddings
        self.original_max_seq_len = config.max_position_embeddings
        self.rope_type = config.rope_parameters.get("rope_type", "default")
        self.mrope_section = config.rope_parameters.get("mrope_section")
        init_fn = self.compute_default_rope_parameters
        if self.rope_type != "default":
            init_fn = ROPE_INIT_FUNCTIONS[self.rope_type]
        inv_freq, self.attention_scaling = init_fn(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)

    @property
    def num_streams(self) -> int:
        """Position streams this RoPE reads: 3 with multimodal RoPE, else 1."""
        return 1 if self.mrope_section is None else 3

    @staticmethod
    def compute_default_rope_parameters(config: HybridIndexPoolConfig, device=None, **kwargs):
        """Inverse frequencies of plain RoPE over the rotated channels."""
        base = config.rope_parameters["rope_theta"]
        dim = config.rotary_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim))
        return inv_freq, 1.0

    @torch.no_grad()
    @dynamic_rope_update
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        if position_ids.dim() == 3:  # [3, batch, seq, dim / 2]: interleave the streams' frequencies
            interleaved = freqs[0].clone()
            for stream in (1, 2):
                take = slice(stream, 3 * self.mrope_section[stream], 3)
                interleaved[..., take] = freqs[stream, ..., take]
            freqs = interleaved
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling
        return cos.to(x.dtype), sin.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """`[x1, x2] -> [-x2, x1]` over the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first `cos.shape[-1]` channels of `x`; `cos`/`sin` must broadcast against them."""
    rotary_dim = cos.shape[-1]
    rotated, passed = x[..., :rotary_dim], x[..., rotary_dim:]
    rotated = rotated * cos + rotate_half(rotated) * sin
    return torch.cat([rotated, passed], dim=-1)


def last_real_entries(sequence: torch.Tensor, num_real: torch.Tensor, count: int) -> torch.Tensor:
    """The `count` entries that end at each row's last real token, along the last dimension of `sequence`
    `[batch, ..., count + new]` (a state of `count` entries followed by the new tokens, each row's real tokens before
    its padding): the state to keep after these tokens."""
    index = num_real[:, None] + torch.arange(count, device=sequence.device)
    index = index.view(index.shape[0], *([1] * (sequence.dim() - 2)), count).expand(*sequence.shape[:-1], count)
    return sequence.gather(-1, index)


def tensor_parallel_rank(weight: torch.Tensor) -> tuple[int, int]:
    """`(rank, ranks)` of the tensor-parallel group over which transformers' TP split `weight` (a DTensor), or
    `(0, 1)` for an ordinary tensor."""
    mesh = getattr(weight, "device_mesh", None)
    if mesh is None:
        return 0, 1
    dim = "tp" if mesh.ndim > 1 and "tp" in (mesh.mesh_dim_names or ()) else None
    return mesh.get_local_rank(dim), mesh.size(dim)


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
        self.act_fn = ACT2FN[config.hidden_act]

        self.in_proj_qkv = HybridIndexPoolLinear(config.hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = HybridIndexPoolLinear(config.hidden_size, self.value_dim, bias=False)
        self.in_proj_b = HybridIndexPoolLinear(config.hidden_size, self.num_value_heads, bias=False)
        self.in_proj_a = HybridIndexPoolLinear(config.hidden_size, self.num_value_heads, bias=False)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, self.conv_kernel_size, groups=self.conv_dim, bias=False,
            padding=self.conv_kernel_size - 1,
        )
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
        channels, key_dim, conv_weight, A_log, dt_bias = self._rank_share()

        # Causal depthwise convolution, continuing from the cached last `kernel - 1` inputs.
        mixed = self.in_proj_qkv(hidden_states)
        if channels is not None:
            mixed = mixed.index_select(-1, channels)  # this rank's heads
        mixed = mixed.transpose(1, 2)  # [batch, conv_dim, seq]
        conv_state = None if layer_cache is None else layer_cache.conv_state
        if conv_state is None:
            conv_state = mixed.new_zeros(batch_size, mixed.shape[1], self.conv_kernel_size - 1)
        conv_input = torch.cat([conv_state.to(mixed.dtype), mixed], dim=-1)
        if seq_len == 1:  # decode: one dot product per channel, cheaper than setting up a convolution
            mixed = (conv_input * conv_weight).sum(dim=-1, keepdim=True)
        else:
            mixed = F.conv1d(conv_input, conv_weight[:, None], groups=conv_weight.shape[0])
        mixed = self.act_fn(mixed).transpose(1, 2)

        query, key, value = mixed.split([key_dim, key_dim, mixed.shape[-1] - 2 * key_dim], dim=-1)
        query = query.reshape(batch_size, seq_len, -1, self.key_head_dim)
        key = key.reshape(batch_size, seq_len, -1, self.key_head_dim)
        value = value.reshape(batch_size, seq_len, -1, self.value_head_dim)
        beta = self.in_proj_b(hidden_states).sigmoid() * real
        log_decay = -A_log.float().exp() * F.softplus(self.in_proj_a(hidden_states).float() + dt_bias)
        log_decay = log_decay * real

        initial_state = None if layer_cache is None else layer_cache.recurrent_state
        mode = "recurrent" if initial_state is not None and seq_len == 1 else "chunk"
        core, final_state = gated_delta_rule(query, key, value, log_decay, beta, initial_state, mode=mode)
        if layer_cache is not None:
            num_real = token_is_real.sum(dim=1)
            layer_cache.update(last_real_entries(conv_input, num_real, self.conv_kernel_size - 1), final_state)

        gate = self.in_proj_z(hidden_states).reshape(batch_size, seq_len, -1, self.value_head_dim)
        core = self.norm(core, gate).reshape(batch_size, seq_len, -1)
        return self.out_proj(core)

    def _rank_share(self):
        """This rank's share of the layer under transformers' tensor parallelism (all of it otherwise): the index of
        its heads' channels in the fused q/k/v projection (None: every channel), its query/key width, and the
        convolution weights `[channels, kernel]`, `A_log` and `dt_bias` of those channels and heads.

        The rank follows `in_proj_z`, which the plan splits by value heads; each rank then owns the key heads those
        value heads read (`linear_num_key_heads` divide evenly, see `check_tensor_parallel_size`).
        """
        rank, ranks = tensor_parallel_rank(self.in_proj_z.weight)
        conv_weight = self.conv1d.weight[:, 0]
        if ranks == 1:
            return None, self.key_dim, conv_weight, self.A_log, self.dt_bias
        key_dim, value_dim = self.key_dim // ranks, self.value_dim // ranks
        if self._rank_channels is None:
            self._rank_channels = torch.cat([
                torch.arange(rank * key_dim, (rank + 1) * key_dim),  # query
                torch.arange(self.key_dim + rank * key_dim, self.key_dim + (rank + 1) * key_dim),  # key
                torch.arange(2 * self.key_dim + rank * value_dim, 2 * self.key_dim + (rank + 1) * value_dim),  # value
            ]).to(conv_weight.device)
        heads = slice(rank * self.num_value_heads // ranks, (rank + 1) * self.num_value_heads // ranks)
        return self._rank_channels, key_dim, conv_weight[self._rank_channels], self.A_log[heads], self.dt_bias[heads]


class HybridIndexPoolIndexer(nn.Module):
    """The IndexPool indexer: per-token queries, one shared raw key per token, weighted pooling of windows.

    Queries: `RoPE(norm(W_q x))`, `[index_n_heads, index_head_dim]` per token. Keys: `W_k x` per token, pooled per
    window of `r` tokens, then rotated at the window's first position. `index_pool_weighting`:

    - `learned`: weights `softmax_j(G x_j + b_{p_j mod r})` per channel (`G` and `b` start at zero, i.e. at the
      mean), normed after pooling;
    - `learned_scalar`: the same with one logit per token shared by all channels (`G` has one output);
    - `mean`: `1 / r`, normed after pooling (Qwen4-Exp's pooling);
    - `prenorm_mean`: every token's key normed first, then the mean and no norm after (a window of keys that
      disagree gets a shorter key, so its scores shrink).
    """

    def __init__(self, config: HybridIndexPoolConfig):
        super().__init__()
        self.num_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.pool_size = config.index_pool_size
        self.q_proj = HybridIndexPoolLinear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = HybridIndexPoolLinear(config.hidden_size, self.head_dim, bias=False)
        self.q_norm = HybridIndexPoolRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = HybridIndexPoolRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.learned_pooling = config.index_pool_weighting in ("learned", "learned_scalar")
        self.norm_before_pooling = config.index_pool_weighting == "prenorm_mean"
        if self.learned_pooling:
            gate_width = self.head_dim if config.index_pool_weighting == "learned" else 1
            self.pool_gate_proj = HybridIndexPoolLinear(config.hidden_size, gate_width, bias=False)
            self.pool_slot_bias = nn.Parameter(torch.zeros(self.pool_size, gate_width))
        self.head_weights_proj = None
        if config.index_head_weights:
            self.head_weights_proj = HybridIndexPoolLinear(config.hidden_size, self.num_heads, bias=False)

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Project new tokens.

        Returns:
            index_queries `[batch, seq, heads, head_dim]`, raw_keys `[batch, seq, head_dim]`, gate_logits
            `[batch, seq, head_dim]` (`[batch, seq, 1]` for `learned_scalar`) float32 (None with mean pooling),
            head_weights `[batch, seq, heads]` or None.
        """
        batch_size, seq_len, _ = hidden_states.shape
        queries = self.q_proj(hidden_states).view(batch_size, seq_len, self.num_heads, self.head_dim)
        queries = apply_rotary(self.q_norm(queries), cos[:, :, None], sin[:, :, None])
        raw_keys = self.k_proj(hidden_states)
        gate_logits = self.pool_gate_proj(hidden_states).float() if self.learned_pooling else None
        head_weights = None
        if self.head_weights_proj is not None:
            head_weights = self.head_weights_proj(hidden_states).float() * self.num_heads**-0.5
        return queries, raw_keys, gate_logits, head_weights

    def pool_windows(
        self,
        window_keys: torch.Tensor,
        window_gate_logits: torch.Tensor | None,
        first_positions: torch.Tensor,
        rotary_emb: HybridIndexPoolRotaryEmbedding,
    ) -> torch.Tensor:
        """Pool `[batch, windows, r, head_dim]` raw keys into normed `[batch, windows, head_dim]` keys rotated at the
        rotary positions of each window's first token, `first_positions [streams, batch, windows]` (for text,
        `c * r`)."""
        if window_gate_logits is not None:
            window_gate_logits = window_gate_logits + self.pool_slot_bias.float()
        if self.norm_before_pooling:
            pooled = weighted_pool(self.k_norm(window_keys), None).to(window_keys.dtype)
        else:
            pooled = self.k_norm(weighted_pool(window_keys, window_gate_logits).to(window_keys.dtype))
        cos, sin = rotary_emb(pooled, first_positions[0] if len(first_positions) == 1 else first_positions)
        return apply_rotary(pooled, cos, sin)


def window_kl_divergence(window_mass: torch.Tensor, index_scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """`KL(p || softmax(s))` per query over the `visible` windows, with `p` the renormalised `window_mass`.

    Args:
        window_mass: `[..., windows]` non-negative attention mass of each window (the target, not differentiated).
        index_scores: `[..., windows]` indexer scores `s`.
        visible: `[..., windows]` bool; queries with nothing visible get 0.
    """
    tiny = torch.finfo(torch.float32).tiny
    target = (window_mass.float() * visible).detach()
    target = target / target.sum(dim=-1, keepdim=True).clamp(min=tiny)
    log_q = torch.log_softmax(index_scores.float().masked_fill(~visible, float("-inf")), dim=-1)
    terms = target * (target.clamp(min=tiny).log() - log_q.masked_fill(~visible, 0.0))
    return terms.sum(dim=-1)


class HybridIndexPoolAttention(nn.Module):
    """IndexPool sparse attention: gated GQA attention over the windows its indexer selects plus the tail.

    With q/k RMSNorm, partial RoPE and a sigmoid output gate (Qwen3-Next style). While every query can see at most
    `index_topk // r` complete windows the selection is everything, and the layer runs dense causal attention.
    """

    def __init__(self, config: HybridIndexPoolConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = float(config.attention_dropout)
        self.output_gate = config.attention_output_gate
        self.pool_size = config.index_pool_size
        self.topk_windows = config.index_topk_windows
        self.sink_windows = config.index_sink_windows
        self.local_windows = config.index_local_windows
        query_width = self.num_heads * self.head_dim * (2 if self.output_gate else 1)
        self.q_proj = HybridIndexPoolLinear(config.hidden_size, query_width, bias=config.attention_bias)
        self.k_proj = HybridIndexPoolLinear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=config.attention_bias)
        self.v_proj = HybridIndexPoolLinear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=config.attention_bias)
        self.o_proj = HybridIndexPoolLinear(self.num_heads * self.head_dim, config.hidden_size, bias=config.attention_bias)
        self.q_norm = HybridIndexPoolRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = HybridIndexPoolRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.indexer = HybridIndexPoolIndexer(config)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        positions: torch.Tensor,
        rope_positions: torch.Tensor,
        token_is_real: torch.Tensor,
        rotary_emb: HybridIndexPoolRotaryEmbedding,
        layer_cache: IndexPoolLayerCache | None = None,
        output_attentions: bool = False,
        indexer_loss: str | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """`positions [batch, seq]` count each row's real tokens (windows and the cache follow them);
        `rope_positions [streams, batch, seq]` are the rotary positions (pooled keys are rotated at their windows'
        first tokens' ones).

        Returns the output, the attention weights (when asked) and the indexer's KL loss (when asked:
        `indexer_loss="dense"` against dense attention over all complete windows, `"sparse"` over the selected ones).

        `indexer_loss="dense"` is the dense warm-up of DESIGN §3: the attention itself is then dense at any length,
        not only within the budget, so the target and the output are those of the dense model.
        """
        batch_size, seq_len, _ = hidden_states.shape
        cos, sin = position_embeddings
        # Head counts follow the projections: under tensor parallelism a rank holds only its own heads.
        query_width = self.head_dim * (2 if self.output_gate else 1)
        query = self.q_proj(hidden_states).view(batch_size, seq_len, -1, query_width)
        gate = None
        if self.output_gate:
            query, gate = query.chunk(2, dim=-1)
            gate = gate.reshape(batch_size, seq_len, -1)
        if indexer_loss is not None and layer_cache is not None and layer_cache.fp8_index_keys:
            raise ValueError(
                "indexer_loss trains the pooling through full-precision pooled keys, but this cache stores them in fp8 "
                "(index_key_cache_dtype='float8_e4m3fn'); train without a cache (use_cache=False)."
            )
        if indexer_loss is not None and query.shape[2] != self.num_heads:
            raise ValueError(
                "indexer_loss needs the attention of every head, but this rank holds "
                f"{query.shape[2]} of {self.num_heads} (tensor parallelism); train the indexer without tensor "
                "parallelism (e.g. FSDP through accelerate)."
            )
        query = self.q_norm(query).transpose(1, 2)  # [batch, heads, seq, head_dim]
        key = self.k_norm(self.k_proj(hidden_states).view(batch_size, seq_len, -1, self.head_dim))
        key = key.transpose(1, 2)
        value = self.v_proj(hidden_states).view(batch_size, seq_len, -1, self.head_dim).transpose(1, 2)
        query = apply_rotary(query, cos[:, None], sin[:, None])
        key = apply_rotary(key, cos[:, None], sin[:, None])

        # The indexer reads a detached input: only its own loss trains it, and it never trains the model (the
        # selection passes no gradient either way).
        index_queries, raw_index_keys, gate_logits, head_weights = self.indexer(hidden_states.detach(), cos, sin)
        state = layer_cache
        if state is None:  # without a cache, a per-call state does the same bookkeeping
            state = IndexPoolLayerCache(self.pool_size)
            state.plan(token_is_real)
        # Everything by position: [batch, kv_heads, capacity, head_dim] and [batch, capacity // r, index_head_dim]
        key, value, pooled_index_keys = state.update(
            key, value, raw_index_keys, gate_logits, token_is_real, rope_positions,
            partial(self.indexer.pool_windows, rotary_emb=rotary_emb),
        )
        # A padding query sees no window, only its tail: a finite output that is never read.
        num_visible = torch.where(token_is_real, (positions + 1) // self.pool_size, 0)

        selected = None
        if seq_len == 1 and layer_cache is not None and indexer_loss is None:
            # Decode: fixed shapes and no host synchronisation. The selection is everything visible while that fits
            # the budget, so this is the dense result too.
            # The budget, or every window the storage can hold when that is less: the shapes follow the capacity.
            topk = min(self.topk_windows, pooled_index_keys.shape[1])
            # Forced windows matter only when the budget is smaller than the storage (otherwise all are selected).
            forced = (self.sink_windows, self.local_windows) if topk == self.topk_windows else (0, 0)
            selected = pooled_index_topk(
                index_queries.detach(), pooled_index_keys.detach(), num_visible, topk,
                None if head_weights is None else head_weights.detach(), None, *forced,
            )
            output, weights = sparse_attention(
                query, key, value, selected, positions, self.pool_size, self.scaling, self.attention_dropout,
                self.training, output_attentions,
            )
        else:
            max_visible = int(num_visible.max())
            length = int(positions.max()) + 1  # no query of this input sees beyond
            key, value = key[:, :, :length], value[:, :, :length]
            pooled_index_keys = pooled_index_keys[:, : length // self.pool_size]
            if indexer_loss == "dense" or max_visible <= self.topk_windows:
                output, weights = self._dense_attention(query, key, value, positions, output_attentions)
            else:
                selected = pooled_index_topk(
                    index_queries.detach(), pooled_index_keys.detach(), num_visible, self.topk_windows,
                    None if head_weights is None else head_weights.detach(), window_limit=max_visible,
                    sink_windows=self.sink_windows, local_windows=self.local_windows,
                )
                output, weights = sparse_attention(
                    query, key, value, selected, positions, self.pool_size, self.scaling, self.attention_dropout,
                    self.training, output_attentions,
                )
        output = output.reshape(batch_size, seq_len, -1)
        if gate is not None:
            output = output * torch.sigmoid(gate)
        kl = None
        if indexer_loss is not None:
            kl = self._indexer_kl(query.detach(), key.detach(), index_queries, pooled_index_keys, head_weights,
                                  num_visible, positions, token_is_real,
                                  selected if indexer_loss == "sparse" else None)
        return self.o_proj(output), weights, kl

    def _indexer_kl(self, query, key, index_queries, pooled_index_keys, head_weights, num_visible, positions,
                    token_is_real, selected):
        """Mean over real queries of KL(p || softmax(s)) between the attention mass of each complete visible window
        (summed over heads and the window's tokens, renormalised) and the indexer's scores; with `selected`, over the
        selected windows only. Queries go in chunks: memory linear in the context."""
        batch_size, num_heads, num_queries, _ = query.shape
        num_positions, r = key.shape[-2], self.pool_size
        num_windows = min(pooled_index_keys.shape[1], num_positions // r)
        pooled_index_keys = pooled_index_keys[:, :num_windows]
        key = key.repeat_interleave(num_heads // key.shape[1], dim=1).float()
        key_positions = torch.arange(num_positions, device=key.device)
        chunk = max(1, (1 << 24) // max(1, batch_size * num_heads * num_positions))
        total, count = query.new_zeros((), dtype=torch.float32), 0
        for start in range(0, num_queries, chunk):
            end = min(start + chunk, num_queries)
            visible_keys = key_positions <= positions[:, start:end, None]
            scores = (query[:, :, start:end].float() @ key.transpose(-1, -2)) * self.scaling
            mass = masked_softmax(scores, visible_keys[:, None]).sum(dim=1)  # [batch, queries, positions]
            mass = mass[..., : num_windows * r].unflatten(-1, (num_windows, r)).sum(-1)
            visible = torch.arange(num_windows, device=key.device) < num_visible[:, start:end, None]
            if selected is not None:
                chosen = torch.zeros(batch_size, end - start, num_windows + 1, dtype=torch.bool, device=key.device)
                chosen.scatter_(-1, selected[:, start:end].masked_fill(selected[:, start:end] < 0, num_windows), True)
                visible = visible & chosen[..., :num_windows]
            scores = pooled_index_scores_torch(
                index_queries[:, start:end], pooled_index_keys,
                None if head_weights is None else head_weights[:, start:end],
            )
            kl = window_kl_divergence(mass, scores, visible)
            rows = token_is_real[:, start:end] & visible.any(dim=-1)
            total = total + kl[rows].sum()
            count += int(rows.sum())
        return total / max(count, 1)

    def _dense_attention(self, query, key, value, positions, output_attentions):
        """Causal attention over every stored position up to the query's own (the selection when nothing is
        pruned). Keys are stored by position, so a row's padding is simply absent."""
        key_positions = torch.arange(key.shape[-2], device=key.device)
        visible = (key_positions <= positions[..., None])[:, None]  # [batch, 1, queries, positions]
        dropout = self.attention_dropout if self.training else 0.0
        if not output_attentions:
            output = F.scaled_dot_product_attention(
                query, key, value, attn_mask=visible, dropout_p=dropout, scale=self.scaling,
                enable_gqa=query.shape[1] != key.shape[1],
            )
            return output.transpose(1, 2), None
        group = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
        weights = masked_softmax((query.float() @ key.float().transpose(-1, -2)) * self.scaling, visible)
        probs = F.dropout(weights, p=dropout, training=self.training)
        return (probs @ value.float()).to(query.dtype).transpose(1, 2), weights


class HybridIndexPoolMLP(nn.Module):
    """SwiGLU MLP: `down(act(gate(x)) * up(x))`."""

    def __init__(self, config: HybridIndexPoolConfig, intermediate_size: int):
        super().__init__()
        self.gate_proj = HybridIndexPoolLinear(config.hidden_size, intermediate_size, bias=False)
        self.up_proj = HybridIndexPoolLinear(config.hidden_size, intermediate_size, bias=False)
        self.down_proj = HybridIndexPoolLinear(intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(hidden_states)) * self.up_proj(hidden_states))


def grouped_mm_fits(experts: nn.Module) -> bool:
    """Whether torch's grouped matrix product accepts these experts' operands: it needs every row stride a multiple
    of 16 bytes, that is `hidden_size` and `moe_intermediate_size` multiples of `16 / element size` (8 in half
    precision, 4 in float32)."""
    alignment = 16 // experts.down_proj.element_size()
    hidden, inner = experts.down_proj.shape[-2:]
    return hidden % alignment == 0 and inner % alignment == 0


def grouped_mm_where_it_fits(experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                             top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' `"grouped_mm"` experts, or the eager loop over the experts where torch's grouped kernel would
    refuse the widths (it raises "strides should be multiple of 16 bytes"; transformers checks only the pointers)."""
    if grouped_mm_fits(experts):  # transformers' own entry (looked up each call, as transformers dispatches)
        return ALL_EXPERTS_FUNCTIONS["grouped_mm"](experts, hidden_states, top_k_index, top_k_weights)
    hidden, inner = experts.down_proj.shape[-2:]
    alignment = 16 // experts.down_proj.element_size()
    logger.warning_once(
        f"The experts' widths (hidden_size {hidden}, moe_intermediate_size {inner}) are not both multiples of "
        f"{alignment}, which torch's grouped matrix product needs in {experts.down_proj.dtype}: the experts run as a "
        f"loop instead (same result, slower). Widths that are multiples of {alignment} use the grouped product."
    )
    return experts.expert_loop(hidden_states, top_k_index, top_k_weights)


# transformers' experts implementations, with "grouped_mm" guarded by the alignment check above.
EXPERTS_FUNCTIONS = ExpertsInterface()
EXPERTS_FUNCTIONS["grouped_mm"] = grouped_mm_where_it_fits


@use_experts_implementation(experts_interface=EXPERTS_FUNCTIONS)
class HybridIndexPoolExperts(nn.Module):
    """The routed SwiGLU experts as fused weights: `gate_up_proj [experts, 2 * inner, hidden]`,
    `down_proj [experts, hidden, inner]`.

    transformers' experts integration dispatches the computation (`config._experts_implementation`): `"grouped_mm"`
    by default (one grouped matrix product per projection, no loop over experts and no host synchronisation, so a
    decode step compiles whole; the loop where the widths do not suit the grouped kernel), `"batched_mm"`, or
    `"eager"`, the loop over the experts that were hit below.
    """

    def __init__(self, config: HybridIndexPoolConfig):
        super().__init__()
        self.num_experts = config.num_experts
        inner = config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * inner, config.hidden_size))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, config.hidden_size, inner))
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        """`hidden_states [tokens, hidden]`, `top_k_index`/`top_k_weights [tokens, k]` -> `[tokens, hidden]`."""
        return self.expert_loop(hidden_states, top_k_index, top_k_weights)

    def expert_loop(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        """The `"eager"` implementation: one pass per expert that was hit."""
        output = torch.zeros_like(hidden_states)
        for expert in top_k_index.unique().tolist():
            token_index, slot = torch.nonzero(top_k_index == expert, as_tuple=True)
            gate, up = decode_linear(hidden_states[token_index], self.gate_up_proj[expert]).chunk(2, dim=-1)
            expert_out = decode_linear(self.act_fn(gate) * up, self.down_proj[expert])
            weighted = expert_out * top_k_weights[token_index, slot, None].to(expert_out.dtype)
            output.index_add_(0, token_index, weighted.to(output.dtype))
        return output


class HybridIndexPoolSparseMoeBlock(nn.Module):
    """Mixture of experts: softmax router with top-k (renormalised when `norm_topk_prob`), routed experts, and an
    optional shared expert scaled by a sigmoid gate. Returns the output and the router logits
    `[..., num_experts]` (for the load-balancing loss)."""

    def __init__(self, config: HybridIndexPoolConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = HybridIndexPoolLinear(config.hidden_size, config.num_experts, bias=False)
        self.experts = HybridIndexPoolExperts(config)
        self.shared_expert = None
        if config.shared_expert_intermediate_size > 0:
            self.shared_expert = HybridIndexPoolMLP(config, config.shared_expert_intermediate_size)
            self.shared_expert_gate = HybridIndexPoolLinear(config.hidden_size, 1, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = hidden_states.shape
        flat = hidden_states.reshape(-1, shape[-1])
        router_logits = self.gate(flat)
        probs = router_logits.float().softmax(dim=-1)
        expert_weights, expert_ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            expert_weights = expert_weights / expert_weights.sum(dim=-1, keepdim=True)
        output = self.experts(flat, expert_ids, expert_weights.to(flat.dtype))
        if self.shared_expert is not None:
            output = output + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return output.reshape(shape), router_logits.reshape(*shape[:-1], -1)


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


class HybridIndexPoolNGramEmbedding(nn.Module):
    """Hashed n-gram embeddings of one PLE layer: for every order 2..`ple_ngram_size`, `ple_heads_per_ngram` heads
    each look the token's n-gram (its own token and the ones before it in its segment) up in their own prime-sized
    table; the heads' rows are concatenated to `ple_embed_dim` channels. See `ngram_hash` for the hashing.
    """

    def __init__(self, config: HybridIndexPoolConfig, ple_index: int):
        super().__init__()
        self.ngram_size = config.ple_ngram_size
        self.heads_per_ngram = config.ple_heads_per_ngram
        self.num_heads = (self.ngram_size - 1) * self.heads_per_ngram
        self.eos_token_id = config.ple_eos_token_id
        self.multiplier_values = hash_multipliers(config.vocab_size, self.ngram_size, ple_index, config.ple_hash_seed)
        self.table_sizes = head_table_sizes(config.ple_ngram_vocab_size_base, ple_index * self.num_heads,
                                            self.num_heads)
        self.table_offsets = [sum(self.table_sizes[:head]) for head in range(self.num_heads)]
        self.register_buffer("multipliers", torch.tensor(self.multiplier_values), persistent=False)
        self.register_buffer("head_table_sizes", torch.tensor(self.table_sizes), persistent=False)
        self.register_buffer("head_table_offsets", torch.tensor(self.table_offsets), persistent=False)
        multiple = config.ple_vocab_size_multiple
        num_rows = -(-sum(self.table_sizes) // multiple) * multiple
        self.ngram_embedding = nn.Embedding(num_rows, config.ple_embed_dim // self.num_heads)

    def forward(self, token_ids: torch.Tensor, token_context: torch.Tensor | None,
                num_real: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`token_ids [batch, seq]` and the `ple_ngram_size - 1` tokens before them (None: start of the sequence)
        -> embeddings `[batch, seq, ple_embed_dim]` and the context for the next call, which ends at each row's last
        real token (`num_real [batch]` real tokens first in each row; all of them when None)."""
        batch_size, seq_len = token_ids.shape
        if token_context is None:
            token_context = token_ids.new_full((batch_size, self.ngram_size - 1), self.eos_token_id)
        history = torch.cat([token_context, token_ids], dim=1).long()
        shifted = [shifted_in_segment(history, shift, self.eos_token_id) for shift in range(self.ngram_size)]
        row_ids = []
        for order in range(2, self.ngram_size + 1):
            mixed = shifted[0] * self.multipliers[0]
            for position in range(1, order):
                mixed = mixed ^ (shifted[position] * self.multipliers[position])
            heads = slice((order - 2) * self.heads_per_ngram, (order - 1) * self.heads_per_ngram)
            row_ids.append(torch.remainder(mixed[..., None], self.head_table_sizes[heads]) + self.head_table_offsets[heads])
        row_ids = torch.cat(row_ids, dim=-1)[:, -seq_len:]  # [batch, seq, heads]
        embeddings = self.ngram_embedding(row_ids.to(self.ngram_embedding.weight.device)).flatten(-2)
        if num_real is None:
            return embeddings.to(token_ids.device), history[:, -(self.ngram_size - 1):]
        return embeddings.to(token_ids.device), last_real_entries(history, num_real, self.ngram_size - 1)


class HybridIndexPoolPerLayerEmbedding(nn.Module):
    """PLE (Qwen4-Exp): adds hashed n-gram features of the tokens to every residual stream of one layer.

    The n-gram embedding gives one value and one key per stream; each stream's normed state gates the value through
    a signed-square-root dot product with its key, and a dilated causal depthwise convolution (dilation
    `ple_ngram_size`) of the normed gated values adds local context. Returns `[batch, seq, hc_count * hidden]`.
    """

    def __init__(self, config: HybridIndexPoolConfig, ple_index: int):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.hc_count = config.hc_count
        streams_width = self.hc_count * self.hidden_size
        self.ple_embedding = HybridIndexPoolNGramEmbedding(config, ple_index)
        self.key_proj = HybridIndexPoolLinear(config.ple_embed_dim, streams_width, bias=False)
        self.value_proj = HybridIndexPoolLinear(config.ple_embed_dim, self.hidden_size, bias=False)
        self.norm_key = HybridIndexPoolRMSNorm(streams_width, eps=config.rms_norm_eps, group_size=self.hidden_size)
        self.norm_query = HybridIndexPoolRMSNorm(streams_width, eps=config.rms_norm_eps, group_size=self.hidden_size)
        self.norm_conv = HybridIndexPoolRMSNorm(streams_width, eps=config.rms_norm_eps, group_size=self.hidden_size)
        self.conv_dilation = config.ple_ngram_size
        self.conv_state_length = (config.ple_conv_kernel_size - 1) * self.conv_dilation
        self.conv1d = nn.Conv1d(
            streams_width, streams_width, config.ple_conv_kernel_size, groups=streams_width,
            dilation=self.conv_dilation, bias=False,
        )

    def forward(
        self,
        streams: torch.Tensor,
        token_ids: torch.Tensor,
        token_is_real: torch.Tensor,
        layer_cache: LinearAttentionLayerCache | None = None,
    ) -> torch.Tensor:
        token_context = conv_state = None
        if layer_cache is not None:
            token_context, conv_state = layer_cache.ple_token_context, layer_cache.ple_conv_state
        num_real = token_is_real.sum(dim=1)  # each row's real tokens come first
        embeddings, token_context = self.ple_embedding(token_ids, token_context, num_real)
        keys = self.norm_key(self.key_proj(embeddings)).unflatten(-1, (self.hc_count, self.hidden_size))
        queries = self.norm_query(streams).unflatten(-1, (self.hc_count, self.hidden_size))
        gate = (keys * queries).sum(dim=-1, keepdim=True) / math.sqrt(self.hidden_size)  # [batch, seq, hc_count, 1]
        gate = gate.sign() * gate.abs().clamp(min=1e-6).sqrt()
        gated_values = torch.sigmoid(gate) * self.value_proj(embeddings).unsqueeze(-2)
        normed = torch.where(token_is_real[..., None], self.norm_conv(gated_values.flatten(-2)), 0.0)
        gated_values = torch.where(token_is_real[..., None], gated_values.flatten(-2), 0.0)

        # Dilated causal convolution, continuing from the cached last inputs.
        conv_input = normed.transpose(1, 2)  # [batch, channels, seq]
        if conv_state is None:
            conv_state = conv_input.new_zeros(*conv_input.shape[:2], self.conv_state_length)
        conv_input = torch.cat([conv_state.to(conv_input.dtype), conv_input], dim=-1)
        if layer_cache is not None:
            layer_cache.update_ple(token_context, last_real_entries(conv_input, num_real, self.conv_state_length))
        conv_output = F.conv1d(conv_input, self.conv1d.weight, dilation=self.conv_dilation, groups=conv_input.shape[1])
        return gated_values + F.silu(conv_output).transpose(1, 2)


class HybridIndexPoolDecoderLayer(GradientCheckpointingLayer):
    """Token mixer (Gated DeltaNet or IndexPool attention), then MLP or MoE, each in a residual block.

    With `hc_count == 1` the blocks are pre-norm residuals; with more, the layer carries `hc_count` residual streams
    and each block reads and writes them through a [`HybridIndexPoolHyperConnection`] (which also does the norm).
    A PLE layer first adds its n-gram features to the streams.
    """

    def __init__(self, config: HybridIndexPoolConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.layer_type = config.layer_types[layer_idx]
        if self.layer_type == "linear_attention":
            self.linear_attn = HybridIndexPoolGatedDeltaNet(config, layer_idx)
        else:
            self.self_attn = HybridIndexPoolAttention(config, layer_idx)
        if config.num_experts > 0:
            self.mlp = HybridIndexPoolSparseMoeBlock(config)
        else:
            self.mlp = HybridIndexPoolMLP(config, config.intermediate_size)
        self.ple = None
        if layer_idx in config.ple_layers:
            self.ple = HybridIndexPoolPerLayerEmbedding(config, config.ple_layers.index(layer_idx))
        self.hyper_connections = config.hc_count > 1
        if self.hyper_connections:
            self.attn_hyper_connection = HybridIndexPoolHyperConnection(config)
            self.mlp_hyper_connection = HybridIndexPoolHyperConnection(config)
        else:
            self.input_layernorm = HybridIndexPoolRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.post_attention_layernorm = HybridIndexPoolRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        positions: torch.Tensor,
        rope_positions: torch.Tensor,
        token_is_real: torch.Tensor,
        rotary_emb: HybridIndexPoolRotaryEmbedding,
        cache: HybridIndexPoolCache | None = None,
        output_attentions: bool = False,
        indexer_loss: str | None = None,
        ple_token_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """`hidden_states [batch, seq, hc_count * hidden]` -> the same, the attention weights, the indexer loss
        (when asked) and the router logits `[batch, seq, num_experts]` (MoE layers). `ple_token_ids` (pads replaced
        by the end-of-sequence id) feed a PLE layer."""
        layer_cache = None if cache is None else cache.layers[self.layer_idx]
        if self.ple is not None:
            hidden_states = hidden_states + self.ple(hidden_states, ple_token_ids, token_is_real, layer_cache)
        if self.hyper_connections:
            streams = hidden_states
            hidden_states, write_gates = self.attn_hyper_connection(streams)
        else:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        weights = kl = None
        if self.layer_type == "linear_attention":
            hidden_states = self.linear_attn(hidden_states, token_is_real, layer_cache)
        else:
            hidden_states, weights, kl = self.self_attn(
                hidden_states, position_embeddings, positions, rope_positions, token_is_real, rotary_emb, layer_cache,
                output_attentions, indexer_loss,
            )
        if self.hyper_connections:
            streams = self.attn_hyper_connection.inject(streams, hidden_states, write_gates)
            hidden_states, write_gates = self.mlp_hyper_connection(streams)
            mlp_output, router_logits = self._feed_forward(hidden_states)
            return self.mlp_hyper_connection.inject(streams, mlp_output, write_gates), weights, kl, router_logits
        hidden_states = residual + hidden_states
        mlp_output, router_logits = self._feed_forward(self.post_attention_layernorm(hidden_states))
        return hidden_states + mlp_output, weights, kl, router_logits

    def _feed_forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The MLP's output and, from a MoE block, its router logits (None from a dense MLP)."""
        if isinstance(self.mlp, HybridIndexPoolSparseMoeBlock):
            return self.mlp(hidden_states)
        return self.mlp(hidden_states), None


class HybridIndexPoolPreTrainedModel(PreTrainedModel):
    """Weight initialisation and the Hugging Face plumbing shared by the HybridIndexPool models."""

    config_class = HybridIndexPoolConfig
    config: HybridIndexPoolConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["HybridIndexPoolDecoderLayer"]
    # The Gated DeltaNet decay parameters stay float32 when the model is loaded in half precision.
    _keep_in_fp32_modules_strict = ["A_log", "dt_bias"]
    _skip_keys_device_placement = ["cache"]
    _supports_sdpa = True
    _is_stateful = True

    @classmethod
    def maybe_distribute_model(cls, model, distributed_config, mesh_manager):
        """Refuse what transformers' parallelism cannot do with this model before it applies its plans: a tensor
        parallel size that does not split the heads evenly, and pipeline stages for hyper-connections or PLE (a stage
        hands the next one `hidden_size` channels and no token ids)."""
        if distributed_config is not None and mesh_manager is not None:
            config = model.config.get_text_config()
            config.check_tensor_parallel_size(distributed_config.tp_size)
            if distributed_config.pp_size > 1 and (config.hc_count > 1 or config.ple_layers):
                raise ValueError(
                    "Pipeline parallelism passes one `hidden_size`-wide state between stages, but this model has "
                    f"hyper-connections (hc_count = {config.hc_count}) or PLE layers ({config.ple_layers}) "
                    "that need hc_count streams and the token ids in every stage; use tensor parallelism instead."
                )
        return super().maybe_distribute_model(model, distributed_config, mesh_manager)

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        # transformers looks for the experts decorator in the module of the class; subclasses defined elsewhere (the
        # converters' helpers, user code) use the same experts.
        return True

    def save_pretrained(self, save_directory, *args, **kwargs):
        """Save as usual, plus what makes the folder a self-contained Hub checkpoint: flat remote code, `auto_map`
        in the config, and a `README.md` model card (a card the user wrote is never replaced).

        The code and card are written first, so that `push_to_hub=True` uploads them with the weights.
        """
        if kwargs.get("is_main_process", True):
            os.makedirs(save_directory, exist_ok=True)
            write_remote_code(save_directory, multimodal=hasattr(self.config, "vision_config"))
            write_model_card(self, save_directory)
        self.config.auto_map = auto_map_for(self.config)
        return super().save_pretrained(save_directory, *args, **kwargs)

    def router_aux_loss(self, router_logits: tuple[torch.Tensor, ...] | None,
                        attention_mask: torch.Tensor | None) -> torch.Tensor | None:
        """The load-balancing loss of the router logits a forward returned (None when it returned none), over the
        real tokens of `attention_mask` `[batch, past + new]`."""
        if router_logits is None:
            return None
        if attention_mask is not None:
            new_tokens = router_logits[0].shape[0] // attention_mask.shape[0]
            attention_mask = attention_mask[:, attention_mask.shape[1] - new_tokens:]  # the cached tokens ran before
        return load_balancing_loss(router_logits, self.config.get_text_config().num_experts_per_tok, attention_mask)

    def _init_weights(self, module):
        super()._init_weights(module)
        std = self.config.get_text_config().initializer_range
        if isinstance(module, HybridIndexPoolRMSNorm):
            init.zeros_(module.weight)  # zero-centred: the scale is 1 + weight
        elif isinstance(module, HybridIndexPoolGatedDeltaNet):
            init.ones_(module.dt_bias)
            init.copy_(module.A_log, torch.empty_like(module.A_log).uniform_(1, 16).log_())
        elif isinstance(module, HybridIndexPoolIndexer) and module.learned_pooling:
            # Zero gate and slot bias: pooling starts exactly at the mean.
            init.zeros_(module.pool_gate_proj.weight)
            init.zeros_(module.pool_slot_bias)
        elif isinstance(module, HybridIndexPoolExperts):
            init.normal_(module.gate_up_proj, mean=0.0, std=std)
            init.normal_(module.down_proj, mean=0.0, std=std)
        elif isinstance(module, HybridIndexPoolPerLayerEmbedding):
            init.zeros_(module.conv1d.weight)  # the convolution starts silent, as in Qwen4-Exp
        elif isinstance(module, HybridIndexPoolNGramEmbedding):
            # Buffers computed from the config: loading creates the model on the meta device, so set them here.
            init.copy_(module.multipliers, torch.tensor(module.multiplier_values))
            init.copy_(module.head_table_sizes, torch.tensor(module.table_sizes))
            init.copy_(module.head_table_offsets, torch.tensor(module.table_offsets))


class HybridIndexPoolModel(HybridIndexPoolPreTrainedModel):
    """The decoder stack without a head; returns the final normed hidden states and the cache."""

    def __init__(self, config: HybridIndexPoolConfig):
        config.check_settings()
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [HybridIndexPoolDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        if config.hc_count > 1:
            self.hyper_connection_mixer = HybridIndexPoolHyperConnection(config, inject=False)
        else:
            self.norm = HybridIndexPoolRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = HybridIndexPoolRotaryEmbedding(config)
        self.gradient_checkpointing = False
        self.post_init()

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: HybridIndexPoolCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        indexer_loss: str | None = None,
        ple_input_ids: torch.LongTensor | None = None,
        output_router_logits: bool | None = None,
        **kwargs,
    ) -> "HybridIndexPoolModelOutput":
        """Run the decoder.

        Args:
            input_ids: `[batch, seq]` token ids (or give `inputs_embeds` `[batch, seq, hidden]`).
            attention_mask: `[batch, past + seq]` with 1 for real tokens and 0 for (left) padding.
            position_ids: `[batch, seq]`; by default each row counts its real tokens from 0. Multimodal-RoPE
                positions `[streams, batch, seq]` are accepted for text, where every stream is the same.
            cache: a [`HybridIndexPoolCache`] to continue from and update (`past_key_values` is accepted too).
            use_cache: create a cache when none is given (default `config.use_cache`).
            output_attentions: also return the attention weights of the IndexPool layers, dense `[b, h, t, slots]`.
            output_hidden_states: also return the hidden states entering each layer and the final ones.
            indexer_loss: `"dense"` or `"sparse"` to also return the indexer's KL loss (DeepSeek-V3.2 style, mean
                over the IndexPool layers): against the attention mass of every complete visible window, or of the
                selected ones only. It trains only the indexer and pooling parameters. `"dense"` (the warm-up) also
                makes the attention dense at any length.
            ple_input_ids: the token ids for the per-layer n-gram embeddings when `inputs_embeds` replace
                `input_ids` (models with `ple_layers` only).
            output_router_logits: also return each MoE layer's router logits `[batch * seq, num_experts]`, in
                the input's token order (default `config.output_router_logits`; None for a model without experts).
        """
        if indexer_loss not in (None, "dense", "sparse"):
            raise ValueError(f"indexer_loss is {indexer_loss!r}; use None, 'dense' or 'sparse'.")
        output_attentions = bool(output_attentions if output_attentions is not None else self.config.output_attentions)
        output_hidden_states = bool(
            output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        )
        output_router_logits = bool(
            output_router_logits if output_router_logits is not None else self.config.output_router_logits
        )
        use_cache_asked = use_cache
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        self._check_inputs(input_ids, inputs_embeds)
        if self.config.ple_layers:
            ple_input_ids = input_ids if ple_input_ids is None else ple_input_ids
            if ple_input_ids is None:
                raise ValueError(
                    "This model has per-layer n-gram embeddings (`ple_layers`), which need the token ids: with "
                    "`inputs_embeds`, also pass `ple_input_ids` [batch, seq]."
                )
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            use_cache, cache = False, None  # the recomputation would update a cache twice
        if cache is not None and not isinstance(cache, HybridIndexPoolCache):
            raise ValueError(
                f"`cache` is a {type(cache).__name__}; this model needs a HybridIndexPoolCache "
                "(leave it empty and one is created, or build one with HybridIndexPoolCache(model.config))."
            )
        if cache is not None:
            cache.check_compatible(self.config, inputs_embeds.shape[0])

        batch_size, seq_len = inputs_embeds.shape[:2]
        token_is_real = self._token_is_real(attention_mask, cache, batch_size, seq_len, inputs_embeds.device)
        rope_positions, text_positions = self._rope_positions(position_ids, batch_size, seq_len, inputs_embeds.device)
        # The layers run on a grid where every sequence's real tokens come first (see TokenLayout): padding and
        # holes then cost the recurrent layers nothing, and packed sequences never see each other.
        layout = None
        if seq_len > 1 and text_positions is not None and self._is_packed(text_positions, token_is_real):
            if cache is not None or use_cache_asked:
                raise ValueError(
                    "`position_ids` restart at 0 inside a row (packed sequences, as DataCollatorWithFlattening "
                    "makes): that is for training without a cache; pass use_cache=False, or one sequence per row."
                )
            use_cache = False
            layout = TokenLayout.unpack(text_positions, token_is_real)
        elif seq_len > 1:
            layout = TokenLayout.compact(token_is_real)
        # Attention weights are returned over every mask column, past and new (transformers' convention). Only read
        # when asked: the cache's count lives on the device, and a decode step must not wait for it.
        kv_length = None
        if output_attentions:
            kv_length = seq_len + (0 if cache is None else cache.get_seq_length())
        if use_cache and cache is None:
            cache = HybridIndexPoolCache(self.config)
        ple_token_ids = None
        if self.config.ple_layers:
            # Padding never enters an n-gram: it reads as end-of-sequence, after which the n-gram context restarts.
            ple_token_ids = ple_input_ids.to(inputs_embeds.device).masked_fill(
                ~token_is_real, self.config.ple_eos_token_id
            )
        if layout is not None:
            inputs_embeds, token_is_real = layout.to_grid(inputs_embeds), layout.token_is_real
            if rope_positions is not None:  # [streams, batch, seq]: the streams ride along
                rope_positions = layout.to_grid(rope_positions.permute(1, 2, 0)).permute(2, 0, 1)
            text_positions = None if text_positions is None else layout.to_grid(text_positions)
            ple_token_ids = None if ple_token_ids is None else layout.to_grid(ple_token_ids)
        # Storage positions: each row counts its real tokens (the cache's per-row lengths come first).
        if cache is not None:
            positions = cache.begin_update(token_is_real)
        else:
            positions = (token_is_real.long().cumsum(dim=1) - 1).clamp(min=0)
        if text_positions is not None and seq_len > 1:
            self._check_positions(text_positions, positions, token_is_real)
        if rope_positions is None:
            # The rotary positions count the tokens too, shifted per row after a multimodal prompt.
            rope_positions = positions
            if cache is not None and cache.rope_deltas is not None:
                rope_positions = positions + cache.rope_deltas.to(positions.device)
            rope_positions = rope_positions[None].expand(self.rotary_emb.num_streams, -1, -1)
        if self.config.hc_count > 1:
            inputs_embeds = inputs_embeds.repeat(1, 1, self.config.hc_count)  # every stream starts as the embedding
        # A long prompt goes through the whole stack a chunk at a time: every layer keeps its state in the cache,
        # so peak memory follows the cache (linear in the context), not the prompt's activations.
        grid_length = inputs_embeds.shape[1]
        chunk = self.config.prefill_chunk_length
        if cache is None or chunk is None or grid_length <= chunk or output_attentions or indexer_loss:
            chunk = grid_length
        starts = range(0, grid_length, chunk)
        # In one piece, the layers record their input hidden states in the input's layout and continue from those,
        # so the returned states are tensors the output was computed from (their gradients can be retained).
        record_layout = layout if len(starts) == 1 else None
        pieces = [
            self._run_layers(inputs_embeds[:, start:start + chunk], positions[:, start:start + chunk],
                             rope_positions[:, :, start:start + chunk], token_is_real[:, start:start + chunk], cache,
                             output_attentions, output_hidden_states,
                             indexer_loss, None if ple_token_ids is None else ple_token_ids[:, start:start + chunk],
                             record_layout, output_router_logits)
            for start in range(0, grid_length, chunk)
        ]
        hidden_states = torch.cat([piece[0] for piece in pieces], dim=1) if len(pieces) > 1 else pieces[0][0]
        all_hidden_states = None
        if output_hidden_states:
            all_hidden_states = tuple(torch.cat(states, dim=1) if len(states) > 1 else states[0]
                                      for states in zip(*(piece[1] for piece in pieces)))
        all_attentions = pieces[0][2] if output_attentions else None
        layer_losses = pieces[0][3]
        all_router_logits = tuple(torch.cat(logits, dim=1) if len(logits) > 1 else logits[0]
                                  for logits in zip(*(piece[4] for piece in pieces))) or None
        if layout is not None:
            hidden_states = layout.from_grid(hidden_states)
            if all_hidden_states is not None and record_layout is None:
                all_hidden_states = tuple(layout.from_grid(states) for states in all_hidden_states)
            if all_attentions is not None:  # [rows, heads, queries, positions]: move the queries
                all_attentions = tuple(layout.from_grid(weights.transpose(1, 2)).transpose(1, 2)
                                       for weights in all_attentions)
            if all_router_logits is not None:  # back in the input's order, so that its padding mask lines up
                all_router_logits = tuple(layout.from_grid(logits) for logits in all_router_logits)
        if all_router_logits is not None:
            all_router_logits = tuple(logits.flatten(0, 1) for logits in all_router_logits)
        if all_attentions is not None:
            columns = self._columns_of_positions(attention_mask, layout, batch_size, kv_length, inputs_embeds.device)
            all_attentions = tuple(self._attention_by_column(weights, columns, kv_length) for weights in all_attentions)
        return HybridIndexPoolModelOutput(
            last_hidden_state=hidden_states,
            cache=cache if use_cache else None,
            hidden_states=all_hidden_states,
            attentions=all_attentions,
            router_logits=all_router_logits,
            indexer_loss=torch.stack(layer_losses).mean() if layer_losses else None,
        )

    def _run_layers(self, hidden_states, positions, rope_positions, token_is_real, cache, output_attentions,
                    output_hidden_states, indexer_loss=None, ple_token_ids=None, record_layout=None,
                    output_router_logits=False):
        """One pass of the stack over a piece of the input: final normed states, per-layer states, attentions, the
        IndexPool layers' indexer losses and the MoE layers' router logits `[rows, seq, num_experts]`. With
        `record_layout`, the per-layer states are recorded in the input's layout (the final ones stay on the
        grid)."""
        position_embeddings = self.rotary_emb(hidden_states, rope_positions[0] if len(rope_positions) == 1
                                              else rope_positions)
        all_hidden_states, all_attentions, indexer_losses, all_router_logits = (), (), [], ()
        for decoder_layer in self.layers:
            if not isinstance(decoder_layer, HybridIndexPoolDecoderLayer):
                continue  # another pipeline stage runs this layer (transformers' pipeline parallelism left a stub)
            if output_hidden_states and record_layout is not None:
                # Real tokens' cells come back unchanged; padding cells, never read by a real token, may not.
                recorded = record_layout.from_grid(hidden_states)
                all_hidden_states += (recorded,)
                hidden_states = record_layout.to_grid(recorded)
            elif output_hidden_states:
                all_hidden_states += (hidden_states,)
            hidden_states, weights, kl, router_logits = decoder_layer(
                hidden_states, position_embeddings, positions, rope_positions, token_is_real, self.rotary_emb,
                cache=cache,
                output_attentions=output_attentions, indexer_loss=indexer_loss, ple_token_ids=ple_token_ids,
            )
            if output_attentions and decoder_layer.layer_type == "indexpool_attention":
                all_attentions += (weights,)
            if kl is not None:
                indexer_losses.append(kl)
            if output_router_logits and router_logits is not None:
                all_router_logits += (router_logits,)
        if self.config.hc_count > 1:
            hidden_states = self.hyper_connection_mixer(hidden_states)[0]
        else:
            hidden_states = self.norm(hidden_states)
        if output_hidden_states:
            all_hidden_states += (hidden_states if record_layout is None else record_layout.from_grid(hidden_states),)
        return hidden_states, all_hidden_states, all_attentions, indexer_losses, all_router_logits

    @staticmethod
    def _columns_of_positions(attention_mask, layout, batch_size, kv_length, device) -> torch.Tensor | None:
        """`[batch, queries or 1, positions]`: the mask column (past and new) of each stored position a query can
        attend to, or None when position `p` is column `p` (no padding anywhere). Positions count a row's real
        tokens, so position `p` is its `p`-th real column; in a row of packed sequences, the `p`-th column of the
        query's own sequence."""
        if layout is not None and layout.rows.shape[0] != batch_size:  # packed: one grid row per sequence
            return layout.columns[layout.source_rows]
        if layout is None and (attention_mask is None or bool(attention_mask.all())):
            return None
        # A stable sort puts each row's real columns first, in order; its padding columns follow.
        padding = attention_mask.to(device=device) == 0
        return torch.sort(padding.to(torch.uint8), dim=1, stable=True).indices[:, None]

    @staticmethod
    def _attention_by_column(weights, columns, kv_length) -> torch.Tensor:
        """Attention weights `[batch, heads, queries, positions]` laid out over the mask columns instead,
        `[batch, heads, queries, kv_length]`, zero where nothing was attended (padding, unselected windows)."""
        if columns is None and weights.shape[-1] == kv_length:
            return weights  # the very weights the output used (their gradient can be retained)
        if columns is None:  # a decode step's weights cover the cache's reserved positions
            return F.pad(weights, (0, kv_length - weights.shape[-1]))[..., :kv_length]
        batch_size, num_heads, num_queries, _ = weights.shape
        num_positions = min(weights.shape[-1], columns.shape[-1], kv_length)
        index = columns[..., :num_positions].expand(batch_size, num_queries, num_positions)
        index = index[:, None].expand(batch_size, num_heads, num_queries, num_positions)
        # Added, not written: cells past the end of a packed sequence repeat a column with zero weight.
        return weights.new_zeros(batch_size, num_heads, num_queries, kv_length).scatter_add_(
            -1, index, weights[..., :num_positions])

    def _check_inputs(self, input_ids, inputs_embeds) -> None:
        """Refuse malformed inputs with a message that names the argument and the fix."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Give exactly one of `input_ids` or `inputs_embeds`.")
        given = input_ids if input_ids is not None else inputs_embeds
        name = "input_ids" if input_ids is not None else "inputs_embeds"
        if given.dim() != (2 if input_ids is not None else 3):
            shape = "[batch, seq]" if input_ids is not None else "[batch, seq, hidden_size]"
            raise ValueError(f"`{name}` has shape {tuple(given.shape)}; give {shape} (add a batch dimension with "
                             f"{name}[None] for a single sequence).")
        if given.shape[0] == 0 or given.shape[1] == 0:
            raise ValueError(f"`{name}` has shape {tuple(given.shape)}: give at least one row of at least one token.")
        if input_ids is not None:
            if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
                raise ValueError(f"`input_ids` are {input_ids.dtype}; token ids must be integers (e.g. torch.long).")
            # Checked outside decode steps only: reading the values waits for the device.
            if input_ids.shape[1] > 1 and bool((input_ids < 0).any() | (input_ids >= self.config.vocab_size).any()):
                raise ValueError(
                    f"`input_ids` hold ids from {int(input_ids.min())} to {int(input_ids.max())}, outside the "
                    f"vocabulary [0, {self.config.vocab_size}); check the tokenizer matches this model."
                )
        else:
            if inputs_embeds.shape[-1] != self.config.hidden_size:
                raise ValueError(f"`inputs_embeds` are {inputs_embeds.shape[-1]} wide; this model's hidden_size is "
                                 f"{self.config.hidden_size}.")
            if not inputs_embeds.is_floating_point():
                raise ValueError(f"`inputs_embeds` are {inputs_embeds.dtype}; give floating-point embeddings (e.g. "
                                 "model.get_input_embeddings()(input_ids)).")

    @staticmethod
    def _token_is_real(attention_mask, cache, batch_size, seq_len, device):
        """`[batch, seq]` bool: which new tokens exist (mask 1); padding and holes are absent for everything."""
        if attention_mask is None:
            return torch.ones(batch_size, seq_len, dtype=torch.bool, device=device)
        if attention_mask.dim() != 2:
            raise ValueError(
                f"`attention_mask` has {attention_mask.dim()} dimensions; give the 2-D padding mask "
                "`[batch, past + new tokens]` (1 = token, 0 = padding): the sparse selection builds its own."
            )
        if seq_len > 1 or cache is None or cache.seen_tokens is None:
            past = 0 if cache is None else cache.get_seq_length()
        else:  # a decode step reads only the new token's column, and nothing from the device
            past = max(attention_mask.shape[1] - seq_len, 0)
        if attention_mask.shape != (batch_size, past + seq_len):
            raise ValueError(
                f"`attention_mask` has shape {tuple(attention_mask.shape)} but the cache holds {past} tokens and "
                f"{seq_len} new ones arrive for {batch_size} rows; it must be ({batch_size}, {past + seq_len})."
            )
        return attention_mask[:, attention_mask.shape[1] - seq_len:].to(device=device, dtype=torch.bool)

    def _rope_positions(self, position_ids, batch_size, seq_len, device):
        """`position_ids` as rotary positions `[streams, batch, seq]` for this model's RoPE and, where they include
        them, the text positions `[batch, seq]` (which count the real tokens); `(None, None)` when not given.

        Accepted: `[batch, seq]` text positions; `[3, batch, seq]` multimodal streams (time, height, width);
        `[4, batch, seq]`, the text positions then the three streams (what `generate()` builds for Qwen-VL models).
        """
        if position_ids is None:
            return None, None
        streams = self.rotary_emb.num_streams
        text_positions, multimodal = None, None
        if position_ids.dim() == 2:
            text_positions = position_ids
        elif position_ids.dim() == 3 and position_ids.shape[0] in (1, 3, 4):
            if position_ids.shape[0] in (1, 4):
                text_positions = position_ids[0]
            if position_ids.shape[0] != 1:
                multimodal = position_ids[-3:]
        else:
            raise ValueError(
                f"`position_ids` has shape {tuple(position_ids.shape)}; give [batch, seq] text positions, or "
                "[3, batch, seq] multimodal (time, height, width) positions, or [4, batch, seq] with the text positions "
                "first."
            )
        if multimodal is not None and streams == 1:
            if not bool((multimodal == multimodal[:1]).all()):
                raise ValueError(
                    "`position_ids` has several different position streams (multimodal RoPE for images or video), "
                    "but this model's rope_parameters have no 'mrope_section': give [batch, seq] positions, or use "
                    "a multimodal model."
                )
            text_positions = multimodal[0] if text_positions is None else text_positions
            multimodal = None
        for name, given in (("text", text_positions), ("multimodal", multimodal)):
            if given is not None and given.shape[-2:] not in ((batch_size, seq_len), (1, seq_len)):
                raise ValueError(f"`position_ids` ({name}) has shape {tuple(given.shape)}; its last two dimensions "
                                 f"must be ({batch_size}, {seq_len}).")
        if text_positions is not None:
            text_positions = text_positions.expand(batch_size, seq_len).to(device=device, dtype=torch.long)
        rope = multimodal if multimodal is not None else text_positions[None]
        rope = rope.expand(streams, batch_size, seq_len).to(device=device, dtype=torch.long)
        return rope, text_positions

    @staticmethod
    def _is_packed(position_ids, token_is_real) -> bool:
        """Whether some row holds several sequences: more than one real token at position 0 (reads the device)."""
        return bool((((position_ids == 0) & token_is_real).sum(dim=1) > 1).any())

    @staticmethod
    def _check_positions(position_ids, positions, token_is_real) -> None:
        """Refuse `position_ids` that disagree with each row's count of real tokens (reads the device; not done in
        decode steps): windows, the cache and RoPE all follow that count."""
        wrong = token_is_real & (position_ids != positions)
        if bool(wrong.any()):
            row, column = (int(index) for index in wrong.nonzero()[0])
            raise ValueError(
                f"`position_ids` give position {int(position_ids[row, column])} to a token that is real token number "
                f"{int(positions[row, column])} of its row (row {row}): positions must count each row's real tokens "
                "from 0 (from the tokens already in the cache), as attention_mask.cumsum(-1) - 1 does. Leave "
                "`position_ids` out and the model counts them; positions restarting at 0 mean packed sequences."
            )


class HybridIndexPoolGenerationMixin(GenerationMixin):
    """What the language-model heads share: the output of `lm_head` with its losses, and what `generate()` needs to
    know about this model family: its cache (reserved once for the call), positions counted by the model itself, and
    the 2-D padding mask passed through to a (possibly compiled) decode step."""

    def language_model_output(self, outputs, labels=None, logits_to_keep: int | torch.Tensor = 0,
                              attention_mask: torch.Tensor | None = None, **kwargs) -> "HybridIndexPoolCausalLMOutput":
        """Logits of the last `logits_to_keep` positions (all when 0) and, given `labels`, the loss; a requested
        indexer loss is added, weighted by `indexer_loss_weight`. With router logits, `aux_loss` is their
        load-balancing loss over the real tokens of `attention_mask`, added to a labelled loss weighted by
        `router_aux_loss_coef` (as transformers' MoE models do)."""
        text_config = self.config.get_text_config()
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(outputs.last_hidden_state[:, keep, :])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=text_config.vocab_size, **kwargs)
        aux_loss = self.router_aux_loss(outputs.router_logits, attention_mask)
        if aux_loss is not None and loss is not None:
            loss = loss + text_config.router_aux_loss_coef * aux_loss.to(loss.device)
        if outputs.indexer_loss is not None:
            weighted = text_config.indexer_loss_weight * outputs.indexer_loss
            loss = weighted if loss is None else loss + weighted
        return HybridIndexPoolCausalLMOutput(
            loss=loss, aux_loss=aux_loss, logits=logits, cache=outputs.cache, hidden_states=outputs.hidden_states,
            attentions=outputs.attentions, router_logits=outputs.router_logits, indexer_loss=outputs.indexer_loss,
        )

    def _prepare_cache_for_generation(
        self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
    ):
        """`generate()` gets a HybridIndexPoolCache (the default DynamicCache cannot hold pooled windows)."""
        cache = model_kwargs.get("cache")
        if isinstance(cache, HybridIndexPoolCache) and generation_config.use_cache is not False:
            cache.reserve(max_cache_length)  # continuing from a cache: room for this call's tokens, once
        if cache is not None or generation_config.use_cache is False:
            return super()._prepare_cache_for_generation(
                generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
            )
        if generation_config.cache_implementation not in (None, "dynamic", "hybrid_indexpool"):
            raise ValueError(
                f"cache_implementation={generation_config.cache_implementation!r} is not supported by "
                "HybridIndexPool; leave it unset (a HybridIndexPoolCache is built) or pass `cache=`."
            )
        # generate() knows the final length: reserve it once (padding excepted) and let the decode step compile.
        model_kwargs["cache"] = HybridIndexPoolCache(self.config.get_text_config(), max_cache_len=max_cache_length)

    def _prepare_position_ids_for_generation(self, inputs_tensor, model_kwargs):
        """None: the model counts each row's real tokens itself, from the attention mask and the cache, which
        `generate()`'s own positions get wrong for right-padded rows once decoding starts."""
        return None

    def prepare_inputs_for_generation(self, input_ids, next_sequence_length=None, cache=None, attention_mask=None,
                                      inputs_embeds=None, is_first_iteration=False, **kwargs):
        model_inputs = super().prepare_inputs_for_generation(
            input_ids, next_sequence_length=next_sequence_length, cache=cache, attention_mask=attention_mask,
            inputs_embeds=inputs_embeds, is_first_iteration=is_first_iteration, **kwargs,
        )
        cache, attention_mask = model_inputs.get("cache"), model_inputs.get("attention_mask")
        if isinstance(cache, HybridIndexPoolCache) and cache.is_compileable and attention_mask is not None:
            # A decode step reads only the new tokens' columns of the growing 2-D mask, so a compiled step serves
            # every length: say so up front instead of recompiling once the length changes.
            torch._dynamo.maybe_mark_dynamic(attention_mask, 1)
        return model_inputs

    @staticmethod
    def create_masks_for_generate(config, inputs_embeds, attention_mask, cache, **kwargs):
        """The layers build their own selections from the 2-D padding mask: `generate()` passes it through."""
        return attention_mask


class HybridIndexPoolForCausalLM(HybridIndexPoolPreTrainedModel, HybridIndexPoolGenerationMixin):
    """HybridIndexPool with a language-modelling head; `generate()` uses a [`HybridIndexPoolCache`]."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}
    _fsdp_plan = {"lm_head": "keep_full_weight"}

    def __init__(self, config: HybridIndexPoolConfig):
        super().__init__(config)
        self.model = HybridIndexPoolModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = HybridIndexPoolLinear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: HybridIndexPoolCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        indexer_loss: str | None = None,
        ple_input_ids: torch.LongTensor | None = None,
        output_router_logits: bool | None = None,
        **kwargs,
    ) -> "HybridIndexPoolCausalLMOutput":
        """Next-token logits (of the last `logits_to_keep` positions when non-zero) and, given `labels`, the loss.

        With `indexer_loss` (`"dense"` or `"sparse"`, see [`HybridIndexPoolModel.forward`]) the output also carries
        `indexer_loss`, and `loss` adds it weighted by `config.indexer_loss_weight`. With `output_router_logits`
        (default `config.output_router_logits`) a MoE model also returns `router_logits` and the load-balancing
        `aux_loss`, which `loss` adds weighted by `config.router_aux_loss_coef`.
        """
        outputs = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
            inputs_embeds=inputs_embeds, use_cache=use_cache, output_attentions=output_attentions,
            output_hidden_states=output_hidden_states, indexer_loss=indexer_loss, ple_input_ids=ple_input_ids,
            output_router_logits=output_router_logits,
        )
        return self.language_model_output(outputs, labels, logits_to_keep, attention_mask, **kwargs)


class HybridIndexPoolForSequenceClassification(HybridIndexPoolPreTrainedModel):
    """HybridIndexPool with a classification head on the last non-padding token (the transformers convention)."""

    def __init__(self, config: HybridIndexPoolConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = HybridIndexPoolModel(config)
        self.score = HybridIndexPoolLinear(config.hidden_size, config.num_labels, bias=False)
        self.post_init()

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: HybridIndexPoolCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        ple_input_ids: torch.LongTensor | None = None,
        output_router_logits: bool | None = None,
        **kwargs,
    ) -> HybridIndexPoolSequenceClassifierOutput:
        """Class logits `[batch, num_labels]` of the last real token of each row and, given `labels`, the loss (plus
        the load-balancing loss weighted by `config.router_aux_loss_coef`, with `output_router_logits`)."""
        outputs = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
            inputs_embeds=inputs_embeds, use_cache=use_cache, output_attentions=output_attentions,
            output_hidden_states=output_hidden_states, ple_input_ids=ple_input_ids,
            output_router_logits=output_router_logits,
        )
        logits = self.score(outputs.last_hidden_state)
        batch_size = logits.shape[0]
        if self.config.pad_token_id is None and batch_size != 1:
            raise ValueError("Cannot classify batches of more than one row without `config.pad_token_id`.")
        if self.config.pad_token_id is None or input_ids is None:
            last_real = torch.full((batch_size,), -1, device=logits.device)
        else:
            # The rightmost non-pad token, for left and right padding alike.
            not_pad = (input_ids != self.config.pad_token_id).to(logits.device, torch.int32)
            last_real = (torch.arange(input_ids.shape[-1], device=logits.device, dtype=torch.int32) * not_pad).argmax(-1)
        pooled_logits = logits[torch.arange(batch_size, device=logits.device), last_real]
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, pooled_logits=pooled_logits, config=self.config)
        aux_loss = self.router_aux_loss(outputs.router_logits, attention_mask)
        if aux_loss is not None and loss is not None:
            loss = loss + self.config.router_aux_loss_coef * aux_loss.to(loss.device)
        return HybridIndexPoolSequenceClassifierOutput(
            loss=loss, logits=pooled_logits, cache=outputs.cache, hidden_states=outputs.hidden_states,
            attentions=outputs.attentions, aux_loss=aux_loss, router_logits=outputs.router_logits,
        )


__all__ = [
    "HybridIndexPoolGenerationMixin",
    "HybridIndexPoolPreTrainedModel",
    "HybridIndexPoolModel",
    "HybridIndexPoolForCausalLM",
    "HybridIndexPoolForSequenceClassification",
]
