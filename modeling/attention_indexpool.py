"""What every IndexPool attention shares, whatever its heads look like (GQA, MLA): the forward (indexer, cache,
window selection, attention, output gate), the dense path while the budget covers everything, and the indexer's KL
loss. A head shape provides only its projections (`project`) and its attention over the stored keys (`attend`)."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..configuration.configuration_hybrid_indexpool import HybridIndexPoolConfig
from ..kernels.pooled_index_topk import pooled_index_scores_torch, pooled_index_topk
from ..kernels.sparse_attention import masked_softmax
from .cache_layers import IndexPoolLayerCache
from .indexer import HybridIndexPoolIndexer, window_kl_divergence
from .inputs import tracing
from .layers import FEW_TOKENS


@dataclass
class ProjectedTokens:
    """The new tokens as a head shape projects them.

    Attributes:
        query: `[batch, heads, seq, qk_dim]`, rotated where the heads use RoPE.
        key, value: `[batch, kv_heads, seq, head_dim]` as the cache stores them; MLA gives its latents `[batch, 1,
            seq, kv_lora_rank]` as keys and no values (None).
        gate: `[batch, seq, heads * head_dim]` output-gate logits (sigmoid), or None.
        query_latent: `[batch, seq, q_lora_rank]` the MLA query latent, which an indexer with
            `index_query_source="q_lora"` reads; None otherwise.
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor | None
    gate: torch.Tensor | None = None
    query_latent: torch.Tensor | None = None


class HybridIndexPoolAttentionBase(nn.Module):
    """Selection and dense attention of an IndexPool layer.

    A layer whose `indexer_types` entry is `"shared"` has no indexer: it attends to the windows the closest full
    IndexPool layer before it selected for the same queries (the model passes them down its layer loop).
    """

    def __init__(self, config: HybridIndexPoolConfig, layer_idx: int, scaling: float):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.scaling = scaling
        self.attention_dropout = float(config.attention_dropout)
        self.pool_size = config.index_pool_size
        self.topk_windows = config.index_topk_windows
        self.sink_windows = config.index_sink_windows
        self.local_windows = config.index_local_windows

    def add_indexer(self, config: HybridIndexPoolConfig, layer_idx: int) -> None:
        """Register the indexer (None in a shared-indexer layer). Subclasses call it after their own projections, so
        that parameters keep the order, and seeded initialisations the values, they had before MLA existed."""
        self.indexer = None if config.is_shared_indexer_layer(layer_idx) else HybridIndexPoolIndexer(config)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        positions: torch.Tensor,
        rope_positions: torch.Tensor,
        token_is_real: torch.Tensor,
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

        `indexer_loss="dense"` is the dense warm-up: the attention itself is then dense at any length, not only
        within the budget, so the target and the output are those of the dense model.
        """
        batch_size, seq_len, _ = hidden_states.shape
        cos, sin = position_embeddings
        projected = self.project(hidden_states, cos, sin)
        self.check_indexer_loss(indexer_loss, layer_cache, projected.query.shape[1])

        index_queries = head_weights = pooled_index_keys = None
        if self.indexer is not None:
            # The indexer reads detached inputs: only its own loss trains it, and it never trains the model (the
            # selection passes no gradient either way).
            query_latent = None if projected.query_latent is None else projected.query_latent.detach()
            index_queries, raw_index_keys, gate_logits, head_weights = self.indexer(
                hidden_states.detach(), cos, sin, query_latent)
        key, value = projected.key, projected.value  # [batch, kv_heads, seq, head_dim] (MLA: latents, no values)
        if layer_cache is None:
            # Without a cache each row's real tokens come first, so position p is column p: pool its complete windows.
            # Padding (and an MTP entry without its next token) holds no key, as in a cache.
            absent = ~token_is_real[:, None, :, None]
            key = key.masked_fill(absent, 0)
            value = None if value is None else value.masked_fill(absent, 0)
            if self.indexer is not None:
                num_windows, r = seq_len // self.pool_size, self.pool_size
                pooled_index_keys = self.indexer.pool_windows(
                    raw_index_keys[:, : num_windows * r].unflatten(1, (num_windows, r)),
                    None if gate_logits is None else gate_logits[:, : num_windows * r].unflatten(1, (num_windows, r)),
                    rope_positions[:, :, : num_windows * r: r])
        else:
            windows = pooled = None
            if self.indexer is not None:
                windows = layer_cache.place_windows(raw_index_keys, gate_logits, token_is_real, rope_positions)
                pooled = self.indexer.pool_windows(windows.keys, windows.gate_logits, windows.first_positions,
                                                   quantize=layer_cache.fp8_index_keys)
            # By position: [batch, kv_heads, capacity, head_dim]; pooled keys [batch, capacity // r, index_head_dim]
            key, value, pooled_index_keys = layer_cache.update(key, value, token_is_real, windows, pooled)
        # A padding query sees no window, only its tail: a finite output that is never read.
        num_visible = torch.where(token_is_real, (positions + 1) // self.pool_size, 0)

        # A decode step, or a verify forward's few tokens over a cache: fixed shapes, nothing read from the device.
        decode = seq_len <= FEW_TOKENS and layer_cache is not None and indexer_loss is None
        if not decode:
            # No query of this input sees beyond its last position; a trace, which cannot read it, takes a bound.
            length = int(positions.max()) + 1 if not tracing() else key.shape[2] if layer_cache else seq_len
            key = key[:, :, :length]
            value = None if value is None else value[:, :, :length]
            if pooled_index_keys is not None:
                pooled_index_keys = pooled_index_keys[:, : length // self.pool_size]
        selected = self.select_windows(index_queries, pooled_index_keys, head_weights, num_visible, decode,
                                       indexer_loss, shared_selection)
        output, weights = self.attend(projected.query, key, value, selected, positions, output_attentions)
        output = output.reshape(batch_size, seq_len, -1)
        if projected.gate is not None:
            output = output * torch.sigmoid(projected.gate)
        kl = None
        if indexer_loss is not None and self.indexer is not None:
            target_query, target_key = self.indexer_target(projected.query, key)
            kl = self._indexer_kl(target_query.detach(), target_key.detach(), index_queries, pooled_index_keys,
                                  head_weights, num_visible, positions, token_is_real,
                                  selected if indexer_loss == "sparse" else None)
        return self.o_proj(output), weights, kl, selected

    def project(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> ProjectedTokens:
        """The new tokens' queries, keys/values as the cache stores them, and output gate (the head shape's own)."""
        raise NotImplementedError

    def attend(self, query, key, value, selected, positions, output_attentions):
        """Attention `[batch, seq, heads, ...]` and its weights (when asked) over the stored `key`/`value`: dense
        when `selected` is None, else over the selected windows plus each query's open window."""
        raise NotImplementedError

    def indexer_target(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries and stored keys whose scaled dot products are the attention scores the indexer learns from."""
        return query, key

    def check_indexer_loss(self, indexer_loss: str | None, layer_cache, local_heads: int) -> None:
        """Refuse an indexer loss this layer cannot compute: fp8 cached keys, or a rank holding only some heads."""
        if indexer_loss is not None and layer_cache is not None and layer_cache.fp8_index_keys:
            raise ValueError(
                "indexer_loss trains the pooling through full-precision pooled keys, but this cache stores them in fp8 "
                "(index_key_cache_dtype='float8_e4m3fn'); train without a cache (use_cache=False)."
            )
        if indexer_loss is not None and local_heads != self.num_heads:
            raise ValueError(
                "indexer_loss needs the attention of every head, but this rank holds "
                f"{local_heads} of {self.num_heads} (tensor parallelism); train the indexer without tensor "
                "parallelism (e.g. FSDP through accelerate)."
            )

    def select_windows(self, index_queries, pooled_index_keys, head_weights, num_visible, decode: bool,
                       indexer_loss: str | None, shared_selection: torch.Tensor | None) -> torch.Tensor | None:
        """Windows each query attends to, `[batch, queries, topk]` (`-1` for none), or None for dense attention.

        Decode (`decode`: up to `FEW_TOKENS` tokens per row with a cache, a decode step or a speculative verify
        forward): fixed shapes, no host synchronisation, always a selection
        (everything visible while that fits the budget, so the dense result too). Otherwise None while every query
        sees at most the budget's windows (or for the dense indexer warm-up); a trace (torch.compile, torch.export),
        which cannot read how many windows the queries see, bounds them by the stored windows and selects with fixed
        shapes. A shared layer returns `shared_selection`, which its full layer made under the same rule.
        """
        if self.indexer is None:
            return shared_selection
        max_visible = pooled_index_keys.shape[1]
        if not decode:
            max_visible = max_visible if tracing() else int(num_visible.max())
            if indexer_loss == "dense" or max_visible <= self.topk_windows:
                return None
        head_weights = None if head_weights is None else head_weights.detach()
        if decode or tracing():
            # The budget, or every window the storage can hold when that is less: the shapes follow the capacity.
            topk = min(self.topk_windows, pooled_index_keys.shape[1])
            # Forced windows matter only when the budget is smaller than the storage (otherwise all are selected).
            forced = (self.sink_windows, self.local_windows) if topk == self.topk_windows else (0, 0)
            return pooled_index_topk(index_queries.detach(), pooled_index_keys.detach(), num_visible, topk,
                                     head_weights, None, *forced)
        return pooled_index_topk(
            index_queries.detach(), pooled_index_keys.detach(), num_visible, self.topk_windows, head_weights,
            window_limit=max_visible, sink_windows=self.sink_windows, local_windows=self.local_windows,
        )

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
