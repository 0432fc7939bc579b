"""IndexPool sparse attention in the gated GQA shape (Qwen3-Next style attention heads)."""

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ..configuration.configuration_hybrid_indexpool import HybridIndexPoolConfig
from ..kernels.pooled_index_topk import pooled_index_scores_torch, pooled_index_topk
from ..kernels.sparse_attention import masked_softmax, sparse_attention
from .cache_hybrid_indexpool import IndexPoolLayerCache
from .indexer import HybridIndexPoolIndexer, window_kl_divergence
from .layers import HybridIndexPoolLinear, HybridIndexPoolRMSNorm, HybridIndexPoolRotaryEmbedding, apply_rotary


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
