"""What every IndexPool attention shares, whatever its heads look like (GQA, MLA): the window selection (its own
indexer's, or a shared one's), the dense path while the budget covers everything, and the indexer's KL loss."""

import torch
import torch.nn.functional as F
from torch import nn

from ..configuration.configuration_hybrid_indexpool import HybridIndexPoolConfig
from ..kernels.pooled_index_topk import pooled_index_scores_torch, pooled_index_topk
from ..kernels.sparse_attention import masked_softmax
from .indexer import HybridIndexPoolIndexer, window_kl_divergence


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

        Decode (`decode`: one token per row with a cache): fixed shapes, no host synchronisation, always a selection
        (everything visible while that fits the budget, so the dense result too). Otherwise None while every query
        sees at most the budget's windows (or for the dense indexer warm-up). A shared layer returns
        `shared_selection`, which its full layer made under the same rule.
        """
        if self.indexer is None:
            return shared_selection
        if decode:
            # The budget, or every window the storage can hold when that is less: the shapes follow the capacity.
            topk = min(self.topk_windows, pooled_index_keys.shape[1])
            # Forced windows matter only when the budget is smaller than the storage (otherwise all are selected).
            forced = (self.sink_windows, self.local_windows) if topk == self.topk_windows else (0, 0)
            return pooled_index_topk(
                index_queries.detach(), pooled_index_keys.detach(), num_visible, topk,
                None if head_weights is None else head_weights.detach(), None, *forced,
            )
        max_visible = int(num_visible.max())
        if indexer_loss == "dense" or max_visible <= self.topk_windows:
            return None
        return pooled_index_topk(
            index_queries.detach(), pooled_index_keys.detach(), num_visible, self.topk_windows,
            None if head_weights is None else head_weights.detach(), window_limit=max_visible,
            sink_windows=self.sink_windows, local_windows=self.local_windows,
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
