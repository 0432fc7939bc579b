"""Per-layer embeddings (PLE) of Qwen4-Exp: hashed n-gram features added to every residual stream."""

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..configuration.configuration_hybrid_indexpool import HybridIndexPoolConfig
from .cache_hybrid_indexpool import LinearAttentionLayerCache
from .layers import HybridIndexPoolLinear, HybridIndexPoolRMSNorm, last_real_entries
from .ngram_hash import hash_multipliers, head_table_sizes, shifted_in_segment


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
            rows = torch.remainder(mixed[..., None], self.head_table_sizes[heads])
            row_ids.append(rows + self.head_table_offsets[heads])
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
        self.norm_key = HybridIndexPoolRMSNorm.from_config(config, streams_width, group_size=self.hidden_size)
        self.norm_query = HybridIndexPoolRMSNorm.from_config(config, streams_width, group_size=self.hidden_size)
        self.norm_conv = HybridIndexPoolRMSNorm.from_config(config, streams_width, group_size=self.hidden_size)
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
            conv_state, token_context = layer_cache.conv_states.get(1), layer_cache.conv_states.get(2)
        num_real = token_is_real.sum(dim=1)  # each row's real tokens come first
        if token_context is None:  # the start of the sequence (as the n-gram embedding would fill it)
            token_context = token_ids.new_full((token_ids.shape[0], self.ple_embedding.ngram_size - 1),
                                               self.ple_embedding.eos_token_id)
        token_history = torch.cat([token_context, token_ids], dim=1)
        embeddings, _ = self.ple_embedding(token_ids, token_context, num_real)
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
        if layer_cache is not None:  # the windows after the new tokens: each row's last entries
            start, num_new = layer_cache.recording_start(token_is_real), token_is_real.shape[1]
            for index, window in ((1, conv_input), (2, token_history)):
                layer_cache.update_conv_state(last_real_entries(window, num_real, window.shape[-1] - num_new), index,
                                              window, token_is_real, start)
        conv_output = F.conv1d(conv_input, self.conv1d.weight, dilation=self.conv_dilation, groups=conv_input.shape[1])
        return gated_values + F.silu(conv_output).transpose(1, 2)
