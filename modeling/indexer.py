"""The IndexPool lightning indexer: per-token queries, pooled window keys, and the indexer's KL training loss."""

import torch
from torch import nn

from ..configuration.configuration_hybrid_indexpool import HybridIndexPoolConfig
from ..kernels.fp8_index_keys import quantize_pooled_keys
from ..kernels.weighted_pool import weighted_pool
from .layers import HybridIndexPoolLinear, HybridIndexPoolRMSNorm, HybridIndexPoolRotaryEmbedding, apply_rotary


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

    GLM-5.3-Flash's variant (`index_query_source="q_lora"`, `index_key_norm="layer_norm_before_pool"`,
    `index_rope=False`): queries `W_q c_q` from the MLA query latent `c_q` (already RMS-normed, so no query norm),
    keys `LayerNorm(W_k x)` per token (weight and bias), pooled with no norm after, and no RoPE anywhere.
    """

    def __init__(self, config: HybridIndexPoolConfig):
        super().__init__()
        self.num_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.pool_size = config.index_pool_size
        self.rope = config.index_rope
        query_from_latent = config.index_query_source == "q_lora"
        query_input = config.q_lora_rank if query_from_latent else config.hidden_size
        self.q_proj = HybridIndexPoolLinear(query_input, self.num_heads * self.head_dim, bias=False)
        self.k_proj = HybridIndexPoolLinear(config.hidden_size, self.head_dim, bias=False)
        # The MLA query latent is RMS-normed already (`q_a_layernorm`): its queries get no second norm.
        self.q_norm = None if query_from_latent else HybridIndexPoolRMSNorm.from_config(config, self.head_dim)
        if config.index_key_norm == "layer_norm_before_pool":
            self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        else:
            self.k_norm = HybridIndexPoolRMSNorm.from_config(config, self.head_dim)
        self.learned_pooling = config.index_pool_weighting in ("learned", "learned_scalar")
        self.norm_before_pooling = (config.index_pool_weighting == "prenorm_mean"
                                    or config.index_key_norm == "layer_norm_before_pool")
        if self.learned_pooling:
            gate_width = self.head_dim if config.index_pool_weighting == "learned" else 1
            self.pool_gate_proj = HybridIndexPoolLinear(config.hidden_size, gate_width, bias=False)
            self.pool_slot_bias = nn.Parameter(torch.zeros(self.pool_size, gate_width))
        self.head_weights_proj = None
        if config.index_head_weights:
            self.head_weights_proj = HybridIndexPoolLinear(config.hidden_size, self.num_heads, bias=False)
        # Pooled keys are rotated at their windows' first positions, which may lie in an earlier step than the tokens
        # the model has rotary tensors for: the indexer has its own RoPE for them (the same frequencies).
        self.rotary_emb = HybridIndexPoolRotaryEmbedding(config) if self.rope else None

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                query_latent: torch.Tensor | None = None):
        """Project new tokens; `query_latent` `[batch, seq, q_lora_rank]` is the MLA query latent the queries read
        with `index_query_source="q_lora"`.

        Returns:
            index_queries `[batch, seq, heads, head_dim]`, raw_keys `[batch, seq, head_dim]`, gate_logits
            `[batch, seq, head_dim]` (`[batch, seq, 1]` for `learned_scalar`) float32 (None with mean pooling),
            head_weights `[batch, seq, heads]` or None.
        """
        batch_size, seq_len, _ = hidden_states.shape
        query_input = hidden_states if self.q_norm is not None else query_latent
        queries = self.q_proj(query_input).view(batch_size, seq_len, self.num_heads, self.head_dim)
        if self.q_norm is not None:
            queries = self.q_norm(queries)
        if self.rope:
            queries = apply_rotary(queries, cos[:, :, None], sin[:, :, None])
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
        first_positions: torch.Tensor | None,
        quantize: bool = False,
    ) -> torch.Tensor:
        """Pool `[batch, windows, r, head_dim]` raw keys into normed `[batch, windows, head_dim]` keys rotated (with
        `index_rope`) at the rotary positions of each window's first token, `first_positions [streams, batch,
        windows]` (for text, `c * r`; unused without `index_rope`). With `quantize`, the keys come packed in fp8 as
        a cache with `index_key_cache_dtype="float8_e4m3fn"` stores them (`uint8 [batch, windows, head_dim + 4]`)."""
        if window_gate_logits is not None:
            window_gate_logits = window_gate_logits + self.pool_slot_bias.float()
        if self.norm_before_pooling:
            pooled = weighted_pool(self.k_norm(window_keys), window_gate_logits).to(window_keys.dtype)
        else:
            pooled = self.k_norm(weighted_pool(window_keys, window_gate_logits).to(window_keys.dtype))
        if self.rope:
            cos, sin = self.rotary_emb(pooled, first_positions[0] if len(first_positions) == 1 else first_positions)
            pooled = apply_rotary(pooled, cos, sin)
        return quantize_pooled_keys(pooled) if quantize else pooled


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
