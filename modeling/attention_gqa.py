"""IndexPool sparse attention in the gated GQA shape (Qwen3-Next style attention heads)."""

import torch

from ..configuration.configuration_hybrid_indexpool import HybridIndexPoolConfig
from ..kernels.sparse_attention import sparse_attention
from .attention_indexpool import HybridIndexPoolAttentionBase, ProjectedTokens
from .layers import HybridIndexPoolLinear, HybridIndexPoolRMSNorm, apply_rotary


class HybridIndexPoolAttention(HybridIndexPoolAttentionBase):
    """IndexPool sparse attention: gated GQA attention over the windows its indexer selects plus the tail.

    With q/k RMSNorm, partial RoPE and a sigmoid output gate (Qwen3-Next style). While every query can see at most
    `index_topk // r` complete windows the selection is everything, and the layer runs dense causal attention.
    """

    def __init__(self, config: HybridIndexPoolConfig, layer_idx: int):
        super().__init__(config, layer_idx, scaling=config.head_dim**-0.5)
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.output_gate = config.attention_output_gate
        query_width = self.num_heads * self.head_dim * (2 if self.output_gate else 1)
        self.q_proj = HybridIndexPoolLinear(config.hidden_size, query_width, bias=config.attention_bias)
        kv_width = self.num_kv_heads * self.head_dim
        self.k_proj = HybridIndexPoolLinear(config.hidden_size, kv_width, bias=config.attention_bias)
        self.v_proj = HybridIndexPoolLinear(config.hidden_size, kv_width, bias=config.attention_bias)
        self.o_proj = HybridIndexPoolLinear(self.num_heads * self.head_dim, config.hidden_size,
                                            bias=config.attention_bias)
        self.q_norm = HybridIndexPoolRMSNorm.from_config(config, self.head_dim)
        self.k_norm = HybridIndexPoolRMSNorm.from_config(config, self.head_dim)
        self.add_indexer(config, layer_idx)

    def project(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> ProjectedTokens:
        batch_size, seq_len, _ = hidden_states.shape
        # Head counts follow the projections: under tensor parallelism a rank holds only its own heads.
        query_width = self.head_dim * (2 if self.output_gate else 1)
        query = self.q_proj(hidden_states).view(batch_size, seq_len, -1, query_width)
        gate = None
        if self.output_gate:
            query, gate = query.chunk(2, dim=-1)
            gate = gate.reshape(batch_size, seq_len, -1)
        query = self.q_norm(query).transpose(1, 2)  # [batch, heads, seq, head_dim]
        key = self.k_norm(self.k_proj(hidden_states).view(batch_size, seq_len, -1, self.head_dim))
        key = key.transpose(1, 2)
        value = self.v_proj(hidden_states).view(batch_size, seq_len, -1, self.head_dim).transpose(1, 2)
        query = apply_rotary(query, cos[:, None], sin[:, None])
        key = apply_rotary(key, cos[:, None], sin[:, None])
        return ProjectedTokens(query, key, value, gate)

    def attend(self, query, key, value, selected, positions, output_attentions):
        if selected is None:
            return self._dense_attention(query, key, value, positions, output_attentions)
        return sparse_attention(
            query, key, value, selected, positions, self.pool_size, self.scaling, self.attention_dropout,
            self.training, output_attentions,
        )
