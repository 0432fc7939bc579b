"""IndexPool sparse attention in the multi-head latent attention shape (DeepSeek-V3 / GLM-5.3-Flash MLA, NoPE)."""

import torch

from ..configuration.configuration_hybrid_indexpool import HybridIndexPoolConfig
from ..kernels.sparse_attention import sparse_latent_attention
from .attention_indexpool import HybridIndexPoolAttentionBase, ProjectedTokens
from .layers import HybridIndexPoolLinear, HybridIndexPoolRMSNorm


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
        self.q_a_layernorm = HybridIndexPoolRMSNorm.from_config(config, config.q_lora_rank)
        self.q_b_proj = HybridIndexPoolLinear(config.q_lora_rank, self.num_heads * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = HybridIndexPoolLinear(config.hidden_size, self.kv_lora_rank,
                                                        bias=config.attention_bias)
        self.kv_a_layernorm = HybridIndexPoolRMSNorm.from_config(config, self.kv_lora_rank)
        self.kv_b_proj = HybridIndexPoolLinear(
            self.kv_lora_rank, self.num_heads * (self.qk_nope_head_dim + self.v_head_dim), bias=False)
        self.o_proj = HybridIndexPoolLinear(self.num_heads * self.v_head_dim, config.hidden_size,
                                            bias=config.attention_bias)
        self.add_indexer(config, layer_idx)

    def project(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> ProjectedTokens:
        """No RoPE in the heads: `cos`/`sin` serve only an indexer with `index_rope`."""
        batch_size, seq_len, _ = hidden_states.shape
        query_latent = self.q_a_layernorm(self.q_a_proj(hidden_states))  # [batch, seq, q_lora_rank]
        # Head count from the projection: under tensor parallelism a rank holds only its own heads.
        query = self.q_b_proj(query_latent).view(batch_size, seq_len, -1, self.qk_head_dim).transpose(1, 2)
        latent = self.kv_a_layernorm(self.kv_a_proj_with_mqa(hidden_states))  # [batch, seq, kv_lora_rank]
        return ProjectedTokens(query, latent[:, None], None, query_latent=query_latent)

    def attend(self, query, key, value, selected, positions, output_attentions):
        """`key`: the stored latents `[batch, 1, positions, kv_lora_rank]`; `value` is None."""
        if selected is None:
            return self._dense_attention(query, *self.expand_latents(key), positions, output_attentions)
        _, value_weight = self.per_head_weights()
        attended, weights = sparse_latent_attention(
            self.absorb(query), key, selected, positions, self.pool_size, self.scaling, self.attention_dropout,
            self.training, output_attentions,
        )  # [batch, seq, heads, kv_lora_rank]
        return torch.einsum("bthc,hvc->bthv", attended, value_weight), weights

    def indexer_target(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Scores of the absorbed queries on the latents are the expanded ones: the target needs latents only.
        return self.absorb(query), key

    def per_head_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`kv_b_proj` per head: `[heads, qk_nope_head_dim, kv_lora_rank]` and `[heads, v_head_dim, kv_lora_rank]`."""
        per_head = self.kv_b_proj.weight.unflatten(0, (-1, self.qk_nope_head_dim + self.v_head_dim))
        key_weight, value_weight = per_head.split([self.qk_nope_head_dim, self.v_head_dim], dim=1)
        return key_weight, value_weight

    def absorb(self, query: torch.Tensor) -> torch.Tensor:
        """Queries `[batch, heads, seq, qk_head_dim]` with `W_k^h` folded in: `[batch, heads, seq, kv_lora_rank]`."""
        return torch.einsum("bhtn,hnc->bhtc", query, self.per_head_weights()[0])

    def expand_latents(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys `[batch, heads, positions, qk_head_dim]` and values `[batch, heads, positions, v_head_dim]` of
        latents `[batch, 1, positions, kv_lora_rank]`."""
        batch_size, _, num_positions, _ = latents.shape
        expanded = self.kv_b_proj(latents[:, 0]).view(batch_size, num_positions, -1,
                                                      self.qk_nope_head_dim + self.v_head_dim)
        key, value = expanded.transpose(1, 2).split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        return key, value
