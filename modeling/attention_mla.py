"""IndexPool sparse attention in the multi-head latent attention shape (DeepSeek-V3 / GLM-5.3-Flash MLA, NoPE)."""

from functools import partial

import torch

from ..configuration.configuration_hybrid_indexpool import HybridIndexPoolConfig
from ..kernels.sparse_attention import sparse_latent_attention
from .attention_indexpool import HybridIndexPoolAttentionBase
from .cache_hybrid_indexpool import IndexPoolLayerCache
from .layers import HybridIndexPoolLinear, HybridIndexPoolRMSNorm, HybridIndexPoolRotaryEmbedding


class HybridIndexPoolMLAAttention(HybridIndexPoolAttentionBase):
    """IndexPool sparse attention with MLA heads: low-rank queries, and one normed key/value latent per token.

    Queries `W_qb RMSNorm(W_qa x)` per head; latent `c = RMSNorm(W_kva x)` (`kv_lora_rank` wide, the only thing the
    cache keeps per token); keys and values `W_kvb c` split per head into `qk_nope_head_dim` and `v_head_dim`; scale
    `qk_head_dim ** -0.5`. No RoPE (`qk_rope_head_dim` 0, as GLM-5.3-Flash).

    Two exact forms of the same attention:
    - expanded: `kv_b_proj` applied to every latent, then ordinary attention per head; used while the budget covers
      the whole context (dense, short);
    - absorbed (whenever windows are selected: decode steps and long prefills): `W_k^h` is folded into the query,
      `q'_h = W_k^h^T q_h` (`kv_lora_rank` wide), every head attends over the latents themselves as keys and values
      (one shared "head", as FlashMLA's sparse decode), and `W_v^h` is applied to the attended latent. Only latents
      are read, and each selected window once for all heads.
    """

    def __init__(self, config: HybridIndexPoolConfig, layer_idx: int):
        self.qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        super().__init__(config, layer_idx, scaling=self.qk_head_dim**-0.5)
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.v_head_dim = config.v_head_dim
        self.q_a_proj = HybridIndexPoolLinear(config.hidden_size, config.q_lora_rank, bias=config.attention_bias)
        self.q_a_layernorm = HybridIndexPoolRMSNorm(config.q_lora_rank, eps=config.rms_norm_eps)
        self.q_b_proj = HybridIndexPoolLinear(config.q_lora_rank, self.num_heads * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = HybridIndexPoolLinear(config.hidden_size, self.kv_lora_rank,
                                                        bias=config.attention_bias)
        self.kv_a_layernorm = HybridIndexPoolRMSNorm(self.kv_lora_rank, eps=config.rms_norm_eps)
        self.kv_b_proj = HybridIndexPoolLinear(
            self.kv_lora_rank, self.num_heads * (self.qk_nope_head_dim + self.v_head_dim), bias=False)
        self.o_proj = HybridIndexPoolLinear(self.num_heads * self.v_head_dim, config.hidden_size,
                                            bias=config.attention_bias)
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
        """Same interface as [`HybridIndexPoolAttention.forward`]: the output, the attention weights (when asked),
        the indexer's KL loss (when asked, None in a shared layer) and the selection (None when dense). The rotary
        inputs serve only an indexer with `index_rope`."""
        batch_size, seq_len, _ = hidden_states.shape
        cos, sin = position_embeddings
        query_latent = self.q_a_layernorm(self.q_a_proj(hidden_states))  # [batch, seq, q_lora_rank]
        # Head count from the projection: under tensor parallelism a rank holds only its own heads.
        query = self.q_b_proj(query_latent).view(batch_size, seq_len, -1, self.qk_head_dim).transpose(1, 2)
        self.check_indexer_loss(indexer_loss, layer_cache, query.shape[1])
        latent = self.kv_a_layernorm(self.kv_a_proj_with_mqa(hidden_states))  # [batch, seq, kv_lora_rank]

        index_queries = raw_index_keys = gate_logits = head_weights = pool_windows = None
        if self.indexer is not None:
            # Detached inputs: only the indexer's own loss trains it (the selection passes no gradient anyway).
            index_queries, raw_index_keys, gate_logits, head_weights = self.indexer(
                hidden_states.detach(), cos, sin, query_latent.detach())
            pool_windows = partial(self.indexer.pool_windows, rotary_emb=rotary_emb)
        state = layer_cache
        if state is None:  # without a cache, a per-call state does the same bookkeeping
            state = IndexPoolLayerCache(self.pool_size)
            state.plan(token_is_real)
        # By position: latents [batch, 1, capacity, kv_lora_rank], pooled keys [batch, capacity // r, index_dim]
        latents, _, pooled_index_keys = state.update(
            latent[:, None], None, raw_index_keys, gate_logits, token_is_real, rope_positions, pool_windows)
        # A padding query sees no window, only its tail: a finite output that is never read.
        num_visible = torch.where(token_is_real, (positions + 1) // self.pool_size, 0)

        decode = seq_len == 1 and layer_cache is not None and indexer_loss is None
        if not decode:
            length = int(positions.max()) + 1  # no query of this input sees beyond
            latents = latents[:, :, :length]
            if pooled_index_keys is not None:
                pooled_index_keys = pooled_index_keys[:, : length // self.pool_size]
        selected = self.select_windows(index_queries, pooled_index_keys, head_weights, num_visible, decode,
                                       indexer_loss, shared_selection)
        # kv_b_proj per head: [heads, qk_nope_head_dim, kv_lora_rank] and [heads, v_head_dim, kv_lora_rank]
        per_head = self.kv_b_proj.weight.unflatten(0, (-1, self.qk_nope_head_dim + self.v_head_dim))
        key_weight, value_weight = per_head.split([self.qk_nope_head_dim, self.v_head_dim], dim=1)
        absorbed_query = None
        if selected is None:
            output, weights = self._dense_attention(query, *self.expand_latents(latents), positions,
                                                    output_attentions)
        else:
            absorbed_query = torch.einsum("bhtn,hnc->bhtc", query, key_weight)  # [batch, heads, seq, kv_lora_rank]
            attended, weights = sparse_latent_attention(
                absorbed_query, latents, selected, positions, self.pool_size, self.scaling, self.attention_dropout,
                self.training, output_attentions,
            )  # [batch, seq, heads, kv_lora_rank]
            output = torch.einsum("bthc,hvc->bthv", attended, value_weight)
        kl = None
        if indexer_loss is not None and self.indexer is not None:
            if absorbed_query is None:
                absorbed_query = torch.einsum("bhtn,hnc->bhtc", query, key_weight)
            # Scores of the absorbed queries on the latents are the expanded ones: the target needs latents only.
            kl = self._indexer_kl(absorbed_query.detach(), latents.detach(), index_queries, pooled_index_keys,
                                  head_weights, num_visible, positions, token_is_real,
                                  selected if indexer_loss == "sparse" else None)
        return self.o_proj(output.reshape(batch_size, seq_len, -1)), weights, kl, selected

    def expand_latents(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys `[batch, heads, positions, qk_head_dim]` and values `[batch, heads, positions, v_head_dim]` of
        latents `[batch, 1, positions, kv_lora_rank]`."""
        batch_size, _, num_positions, _ = latents.shape
        expanded = self.kv_b_proj(latents[:, 0]).view(batch_size, num_positions, -1,
                                                      self.qk_nope_head_dim + self.v_head_dim)
        key, value = expanded.transpose(1, 2).split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        return key, value
