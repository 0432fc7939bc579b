"""The HybridIndexPool decoder layer: a token mixer (linear attention or IndexPool attention), then an MLP or MoE,
on one residual stream or several."""

import torch
from transformers.modeling_layers import GradientCheckpointingLayer

from ..configuration.configuration_hybrid_indexpool import HybridIndexPoolConfig
from .attention_gqa import HybridIndexPoolAttention
from .attention_mla import HybridIndexPoolMLAAttention
from .cache_hybrid_indexpool import HybridIndexPoolCache
from .layers import HybridIndexPoolRMSNorm
from .linear_attention_gdn import HybridIndexPoolGatedDeltaNet
from .linear_attention_kda import HybridIndexPoolKimiDeltaAttention
from .moe import HybridIndexPoolMLP, HybridIndexPoolSparseMoeBlock
from .per_layer_embedding import HybridIndexPoolPerLayerEmbedding
from .residual_streams import HybridIndexPoolHyperConnection, HybridIndexPoolSinkhornHyperConnection
from .token_layout import TokenLayout

LINEAR_ATTENTION_CLASSES = {
    "gated_deltanet": HybridIndexPoolGatedDeltaNet,
    "kimi_delta": HybridIndexPoolKimiDeltaAttention,
}


HYPER_CONNECTION_CLASSES = {
    "qwen4_exp": HybridIndexPoolHyperConnection,
    "sinkhorn": HybridIndexPoolSinkhornHyperConnection,
}


class HybridIndexPoolLayer(GradientCheckpointingLayer):
    """Token mixer (linear attention: Gated DeltaNet or Kimi Delta Attention; or IndexPool attention), then MLP or MoE
    (`mlp_layer_types`), each in a residual block: what a [`HybridIndexPoolDecoderLayer`] and the block of a
    multi-token-prediction layer ([`HybridIndexPoolMTPDecoderLayer`]) share.

    Without hyper-connections the blocks are pre-norm residuals. With them, the layer carries `hc_count` residual
    streams and each block reads and writes them through a hyper-connection: a [`HybridIndexPoolHyperConnection`]
    (Qwen4-Exp, which also does the norm) or a [`HybridIndexPoolSinkhornHyperConnection`] (GLM-5.3-Flash, whose
    block input then goes through the block's RMSNorm). A PLE layer first adds its n-gram features to the streams.

    Hidden states stay in the input's layout; the token mixer (and PLE) run on the pass's grid, where each sequence's
    real tokens come first (`TokenLayout`).
    """

    multi_token_prediction = False

    def __init__(self, config: HybridIndexPoolConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        # An MTP block is an IndexPool layer with its own indexer, the MTP MLP type, no PLE, and residual streams only
        # for Qwen4-Exp's MTP.
        mtp = self.multi_token_prediction
        self.layer_type = "indexpool_attention" if mtp else config.layer_types[layer_idx]
        mlp_type = config.mtp_mlp_type if mtp else config.mlp_types[layer_idx]
        if self.layer_type == "linear_attention":
            self.linear_attn = LINEAR_ATTENTION_CLASSES[config.linear_attention_type](config, layer_idx)
        elif config.attention_type == "mla":
            self.self_attn = HybridIndexPoolMLAAttention(config, layer_idx)
        else:
            self.self_attn = HybridIndexPoolAttention(config, layer_idx)
        if mlp_type == "sparse":
            # An MTP block's routing is not part of the model's load-balancing loss: it returns no router logits.
            self.mlp = HybridIndexPoolSparseMoeBlock(config, returns_router_logits=not mtp)
        else:
            self.mlp = HybridIndexPoolMLP(config, config.intermediate_size)
        self.ple = None
        if not mtp and layer_idx in config.ple_layers:
            self.ple = HybridIndexPoolPerLayerEmbedding(config, config.ple_layers.index(layer_idx))
        self.hyper_connections = config.has_hyper_connections and (not mtp or config.mtp_type == "qwen4_exp")
        if self.hyper_connections:
            hyper_connection_class = HYPER_CONNECTION_CLASSES[config.hc_type]
            self.attn_hyper_connection = hyper_connection_class(config)
            self.mlp_hyper_connection = hyper_connection_class(config)
        self.input_layernorm = self.post_attention_layernorm = None
        if not self.hyper_connections or config.hc_type == "sinkhorn":  # Qwen4-Exp's hyper-connections norm instead
            self.input_layernorm = HybridIndexPoolRMSNorm.from_config(config, config.hidden_size)
            self.post_attention_layernorm = HybridIndexPoolRMSNorm.from_config(config, config.hidden_size)
        # Whether this layer selects windows with an indexer of its own: the shared-indexer layers after it (up to the
        # next such layer) attend to its selection.
        self.selects_windows = self.layer_type == "indexpool_attention" and (
            mtp or not config.is_shared_indexer_layer(layer_idx))

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        tokens: TokenLayout,
        cache: HybridIndexPoolCache | None = None,
        shared_selection: torch.Tensor | None = None,
        output_attentions: bool = False,
        indexer_loss: str | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """`hidden_states [batch, seq, hc_count * hidden]` -> the same, the attention weights over the mask columns
        `[batch, heads, seq, kv_length]` (an IndexPool layer, when asked) and the windows this layer's indexer selected
        `[batch, seq, topk]` (None for other layers, and while every query sees all its windows). A shared-indexer
        layer attends to `shared_selection`, the selection of the full layer before it.

        `position_embeddings` are the rotary `(cos, sin)` of the grid's tokens; with `indexer_loss` (`"dense"` or
        `"sparse"`) an IndexPool layer also computes the indexer's KL loss (recorded from its attention module).
        """
        layer_cache = None if cache is None else cache.layers[self.layer_idx]
        if self.ple is not None:
            hidden_states = hidden_states + tokens.from_grid(self.ple(
                tokens.to_grid(hidden_states), tokens.ple_token_ids, tokens.token_is_real, layer_cache))
        if self.hyper_connections:
            streams = hidden_states
            hidden_states, write_weights = self.attn_hyper_connection(streams)
        else:
            residual = hidden_states
        if self.input_layernorm is not None:
            hidden_states = self.input_layernorm(hidden_states)
        weights = selection = None
        if self.layer_type == "linear_attention":
            mixed = self.linear_attn(tokens.to_grid(hidden_states), tokens.token_is_real, layer_cache)
        else:
            mixed, weights, _, selection = self.self_attn(
                tokens.to_grid(hidden_states), position_embeddings, tokens.positions, tokens.rope_positions,
                tokens.token_is_real, layer_cache, output_attentions, indexer_loss,
                None if shared_selection is None else tokens.to_grid(shared_selection),
            )
            weights = None if weights is None else tokens.attention_by_column(weights)
            selection = tokens.from_grid(selection) if self.selects_windows and selection is not None else None
        hidden_states = tokens.from_grid(mixed)
        if self.hyper_connections:
            streams = self.attn_hyper_connection.inject(streams, hidden_states, write_weights)
            hidden_states, write_weights = self.mlp_hyper_connection(streams)
            if self.post_attention_layernorm is not None:
                hidden_states = self.post_attention_layernorm(hidden_states)
            hidden_states = self.mlp_hyper_connection.inject(streams, self._feed_forward(hidden_states), write_weights)
        else:
            hidden_states = residual + hidden_states
            hidden_states = hidden_states + self._feed_forward(self.post_attention_layernorm(hidden_states))
        return hidden_states, weights, selection

    def _feed_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The MLP's output (a MoE block's router logits are recorded from the block itself)."""
        if isinstance(self.mlp, HybridIndexPoolSparseMoeBlock):
            return self.mlp(hidden_states)[0]
        return self.mlp(hidden_states)


class HybridIndexPoolDecoderLayer(HybridIndexPoolLayer):
    """A layer of the decoder stack (see [`HybridIndexPoolLayer`]); the model's output recorders read its hidden
    states, attention weights and selections."""


class HybridIndexPoolMTPDecoderLayer(HybridIndexPoolLayer):
    """The decoder block of a multi-token-prediction layer (index `num_hidden_layers + depth`): an IndexPool layer
    with its own indexer and the MTP MLP type (`mtp_mlp_type`), no PLE, residual streams only for Qwen4-Exp's MTP. Its
    outputs are not the decoder's (the model records the MTP layers' outputs instead)."""

    multi_token_prediction = True
