"""IndexPool sparse attention in the gated GQA shape (Qwen3-Next style attention heads)."""

from functools import partial

import torch

from ..configuration.configuration_hybrid_indexpool import HybridIndexPoolConfig
from ..kernels.sparse_attention import sparse_attention
from .attention_indexpool import HybridIndexPoolAttentionBase
from .cache_hybrid_indexpool import IndexPoolLayerCache
from .layers import HybridIndexPoolLinear, HybridIndexPoolRMSNorm, HybridIndexPoolRotaryEmbedding, apply_rotary


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
        self.q_norm = HybridIndexPoolRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = HybridIndexPoolRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.add_indexer(config, layer_idx)

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
        shared_selection: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """`positions [batch, seq]` count each row's real tokens (windows and the cache follow them);
        `rope_positions [streams, batch, seq]` are the rotary positions (pooled keys are rotated at their windows'
        first tokens' ones).

        Returns the output, the attention weights (when asked), the indexer's KL loss (when asked:
        `indexer_loss="dense"` against dense attention over all complete windows, `"sparse"` over the selected ones;
        None in a shared layer) and the selection `[batch, seq, topk]` (None when dense), which a shared layer takes
        as `shared_selection`.

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
        self.check_indexer_loss(indexer_loss, layer_cache, query.shape[2])
        query = self.q_norm(query).transpose(1, 2)  # [batch, heads, seq, head_dim]
        key = self.k_norm(self.k_proj(hidden_states).view(batch_size, seq_len, -1, self.head_dim))
        key = key.transpose(1, 2)
        value = self.v_proj(hidden_states).view(batch_size, seq_len, -1, self.head_dim).transpose(1, 2)
        query = apply_rotary(query, cos[:, None], sin[:, None])
        key = apply_rotary(key, cos[:, None], sin[:, None])

        index_queries = raw_index_keys = gate_logits = head_weights = pool_windows = None
        if self.indexer is not None:
            # The indexer reads a detached input: only its own loss trains it, and it never trains the model (the
            # selection passes no gradient either way).
            index_queries, raw_index_keys, gate_logits, head_weights = self.indexer(hidden_states.detach(), cos, sin)
            pool_windows = partial(self.indexer.pool_windows, rotary_emb=rotary_emb)
        state = layer_cache
        if state is None:  # without a cache, a per-call state does the same bookkeeping
            state = IndexPoolLayerCache(self.pool_size)
            state.plan(token_is_real)
        # Everything by position: [batch, kv_heads, capacity, head_dim] and [batch, capacity // r, index_head_dim]
        key, value, pooled_index_keys = state.update(
            key, value, raw_index_keys, gate_logits, token_is_real, rope_positions, pool_windows,
        )
        # A padding query sees no window, only its tail: a finite output that is never read.
        num_visible = torch.where(token_is_real, (positions + 1) // self.pool_size, 0)

        decode = seq_len == 1 and layer_cache is not None and indexer_loss is None
        if not decode:
            length = int(positions.max()) + 1  # no query of this input sees beyond
            key, value = key[:, :, :length], value[:, :, :length]
            if pooled_index_keys is not None:
                pooled_index_keys = pooled_index_keys[:, : length // self.pool_size]
        selected = self.select_windows(index_queries, pooled_index_keys, head_weights, num_visible, decode,
                                       indexer_loss, shared_selection)
        if selected is None:
            output, weights = self._dense_attention(query, key, value, positions, output_attentions)
        else:
            output, weights = sparse_attention(
                query, key, value, selected, positions, self.pool_size, self.scaling, self.attention_dropout,
                self.training, output_attentions,
            )
        output = output.reshape(batch_size, seq_len, -1)
        if gate is not None:
            output = output * torch.sigmoid(gate)
        kl = None
        if indexer_loss is not None and self.indexer is not None:
            kl = self._indexer_kl(query.detach(), key.detach(), index_queries, pooled_index_keys, head_weights,
                                  num_visible, positions, token_is_real,
                                  selected if indexer_loss == "sparse" else None)
        return self.o_proj(output), weights, kl, selected
