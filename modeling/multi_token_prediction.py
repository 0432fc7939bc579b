"""Multi-token prediction (MTP): the layers after the decoder that predict the tokens beyond the next one.

The released models keep them for speculative decoding (vLLM and SGLang draft with them); here they are computed
over a whole input, so that they can be evaluated and trained, and exported back with the rest of the model, and a
prompt's forward with a cache fills their cache layers, from which `generate(use_mtp=True)` drafts.

At depth `k` (from 0) the MTP entry at position `i` reads the depth-`k - 1` output at `i` (the main model's for
`k = 0`) and the input embedding of the token at `i + k + 1`, and its logits predict the token at `i + k + 2`. An
entry whose token `i + k + 1` is padding, beyond the row's end or in the next packed sequence is not a real token of
its layer: on the model's grid, where each sequence's real tokens come first, that is one more column off the end of
every row per depth.
"""

import torch
from torch import nn

from ..configuration.configuration_hybrid_indexpool import HybridIndexPoolConfig
from .decoder_layer import HybridIndexPoolMTPDecoderLayer
from .layers import HybridIndexPoolLinear, HybridIndexPoolRMSNorm
from .residual_streams import HybridIndexPoolHyperConnection
from .token_layout import TokenLayout


def next_token_embeddings(inputs_embeds: torch.Tensor, depth: int, tokens: TokenLayout) -> torch.Tensor:
    """`[batch, seq, hidden]` embeddings -> those of each token's real token `depth + 1` places later in its sequence
    (zeros past the end)."""
    shifted = tokens.to_grid(inputs_embeds)[:, depth + 1:]
    return tokens.from_grid(torch.cat([shifted, shifted.new_zeros(shifted.shape[0], depth + 1, shifted.shape[2])], 1))


class HybridIndexPoolMTP(nn.Module):
    """What both MTP variants share: the depths run in a chain over a whole input."""

    def forward(self, hidden_states, inputs_embeds, position_embeddings, tokens: TokenLayout,
                cache=None) -> tuple[torch.Tensor, ...]:
        """`hidden_states` (what depth 0 reads: the final normed hidden states, or Qwen4-Exp's residual streams) and
        `inputs_embeds [batch, seq, hidden]` -> each depth's output `[batch, seq, hidden]` (what the head reads; the
        model records them). With `cache`, each depth's entries go to its layer of the cache."""
        outputs = ()
        for depth in range(len(self.layers)):
            hidden_states, output = self.layer_step(depth, hidden_states,
                                                    next_token_embeddings(inputs_embeds, depth, tokens),
                                                    position_embeddings, tokens.shifted(depth), cache)
            outputs += (output,)
        return outputs


class HybridIndexPoolDeepSeekMTPLayer(nn.Module):
    """One MTP layer of DeepSeek-V3 (GLM-5.3-Flash's next-n layer) or of Qwen3-Next / Qwen3.5: the normed token
    embedding and the normed hidden state, concatenated and projected to `hidden_size`, then a pre-norm IndexPool
    decoder layer without residual streams, then a final norm. DeepSeek's zeroes the embedding at position 0 (as vLLM
    computes it); Qwen3-Next's keeps it (vLLM's `qwen3_next_mtp`)."""

    def __init__(self, config: HybridIndexPoolConfig, depth: int):
        super().__init__()
        self.zero_first_embedding = config.mtp_type == "deepseek"
        self.embedding_norm = HybridIndexPoolRMSNorm.from_config(config, config.hidden_size)
        self.hidden_norm = HybridIndexPoolRMSNorm.from_config(config, config.hidden_size)
        self.input_proj = HybridIndexPoolLinear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.block = HybridIndexPoolMTPDecoderLayer(config, config.num_hidden_layers + depth)
        self.output_norm = HybridIndexPoolRMSNorm.from_config(config, config.hidden_size)

    def forward(self, hidden_states, next_embeds, position_embeddings, tokens: TokenLayout, cache=None) -> torch.Tensor:
        """`hidden_states`, `next_embeds` `[batch, seq, hidden]` -> the normed output `[batch, seq, hidden]`, which is
        both what the head reads and the next depth's hidden state. With `cache` (whose `layers[layer_idx]` is this
        block's [`IndexPoolLayerCache`]), the new entries continue the ones it holds."""
        if self.zero_first_embedding:
            next_embeds = next_embeds.masked_fill(tokens.from_grid(tokens.positions == 0).unsqueeze(-1), 0)
        hidden_states = self.input_proj(torch.cat([self.embedding_norm(next_embeds), self.hidden_norm(hidden_states)],
                                                  dim=-1))
        return self.output_norm(self.block(hidden_states, position_embeddings, tokens, cache=cache)[0])


class HybridIndexPoolDeepSeekMTP(HybridIndexPoolMTP):
    """DeepSeek-V3's (and Qwen3-Next's) MTP: one [`HybridIndexPoolDeepSeekMTPLayer`] per depth, chained, reading the
    final normed hidden states."""

    reads_residual_streams = False

    def __init__(self, config: HybridIndexPoolConfig):
        super().__init__()
        self.layers = nn.ModuleList(HybridIndexPoolDeepSeekMTPLayer(config, depth)
                                    for depth in range(config.num_mtp_layers))

    def layer_step(self, layer_index: int, hidden_states, next_embeds, position_embeddings, tokens: TokenLayout,
                   cache=None) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP layer `layer_index` over entries whose hidden input is `hidden_states` `[batch, seq, hidden]` and whose
        next token embeds as `next_embeds` `[batch, seq, hidden]`: `(the next depth's hidden input, what the head
        reads)`, here the same normed output. `cache` as for [`HybridIndexPoolDeepSeekMTPLayer`]."""
        output = self.layers[layer_index](hidden_states, next_embeds, position_embeddings, tokens, cache)
        return output, output


class HybridIndexPoolQwen4ExpMTP(HybridIndexPoolMTP):
    """Qwen4-Exp's MTP, on the residual streams.

    The main model's streams before its final mix `[batch, seq, hc_count * hidden]` are normed together
    (`streams_norm`) and projected stream by stream by one shared `stream_proj`; the normed token embedding, projected
    by `embedding_proj`, is added to every stream (with weight 1). A decoder layer with hyper-connections (one per
    depth) follows, and the MTP's own final mix gives what the head reads; the next depth continues from the layer's
    streams.
    """

    reads_residual_streams = True

    def __init__(self, config: HybridIndexPoolConfig):
        super().__init__()
        self.hc_count, self.hidden_size = config.hc_count, config.hidden_size
        self.embedding_norm = HybridIndexPoolRMSNorm.from_config(config, config.hidden_size)
        self.streams_norm = HybridIndexPoolRMSNorm.from_config(config, config.hc_count * config.hidden_size)
        self.embedding_proj = HybridIndexPoolLinear(config.hidden_size, config.hidden_size, bias=False)
        self.stream_proj = HybridIndexPoolLinear(config.hidden_size, config.hidden_size, bias=False)
        self.layers = nn.ModuleList(
            HybridIndexPoolMTPDecoderLayer(config, config.num_hidden_layers + depth)
            for depth in range(config.num_mtp_layers)
        )
        self.hyper_connection_mixer = HybridIndexPoolHyperConnection(config, inject=False)

    def layer_step(self, layer_index: int, streams, next_embeds, position_embeddings, tokens: TokenLayout,
                   cache=None) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP layer `layer_index` over entries whose input streams are `streams [batch, seq, hc_count * hidden]` and
        whose next token embeds as `next_embeds [batch, seq, hidden]`: `(the layer's streams, the next depth's input;
        their mix [batch, seq, hidden], what the head reads)`. With `cache` (whose `layers[layer_idx]` is the
        layer's [`IndexPoolLayerCache`]), the new entries continue the ones it holds."""
        embedded = self.embedding_proj(self.embedding_norm(next_embeds))
        streams = self.stream_proj(self.streams_norm(streams).unflatten(-1, (self.hc_count, self.hidden_size)))
        streams = (streams + embedded.unsqueeze(-2)).flatten(-2)
        streams = self.layers[layer_index](streams, position_embeddings, tokens, cache=cache)[0]
        return streams, self.hyper_connection_mixer(streams)[0]


MTP_CLASSES = {"deepseek": HybridIndexPoolDeepSeekMTP, "qwen3_next": HybridIndexPoolDeepSeekMTP,
               "qwen4_exp": HybridIndexPoolQwen4ExpMTP}
