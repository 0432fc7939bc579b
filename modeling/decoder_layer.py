"""The HybridIndexPool decoder layer: a token mixer (linear attention or IndexPool attention), then an MLP or MoE,
on one residual stream or several."""

import torch
from transformers.modeling_layers import GradientCheckpointingLayer

from ..configuration.configuration_hybrid_indexpool import HybridIndexPoolConfig
from .attention_gqa import HybridIndexPoolAttention
from .attention_mla import HybridIndexPoolMLAAttention
from .cache_hybrid_indexpool import HybridIndexPoolCache
from .inputs import LayerStep
from .layers import HybridIndexPoolRMSNorm
from .linear_attention_gdn import HybridIndexPoolGatedDeltaNet
from .linear_attention_kda import HybridIndexPoolKimiDeltaAttention
from .moe import HybridIndexPoolMLP, HybridIndexPoolSparseMoeBlock
from .per_layer_embedding import HybridIndexPoolPerLayerEmbedding
from .residual_streams import HybridIndexPoolHyperConnection, HybridIndexPoolSinkhornHyperConnection

LINEAR_ATTENTION_CLASSES = {
    "gated_deltanet": HybridIndexPoolGatedDeltaNet,
    "kimi_delta": HybridIndexPoolKimiDeltaAttention,
}


HYPER_CONNECTION_CLASSES = {
    "qwen4_exp": HybridIndexPoolHyperConnection,
    "sinkhorn": HybridIndexPoolSinkhornHyperConnection,
}


class HybridIndexPoolDecoderLayer(GradientCheckpointingLayer):
    """Token mixer (linear attention: Gated DeltaNet or Kimi Delta Attention; or IndexPool attention), then MLP or MoE
    (`mlp_layer_types`), each in a residual block.

    Without hyper-connections the blocks are pre-norm residuals. With them, the layer carries `hc_count` residual
    streams and each block reads and writes them through a hyper-connection: a [`HybridIndexPoolHyperConnection`]
    (Qwen4-Exp, which also does the norm) or a [`HybridIndexPoolSinkhornHyperConnection`] (GLM-5.3-Flash, whose
    block input then goes through the block's RMSNorm). A PLE layer first adds its n-gram features to the streams.
    """

    def __init__(self, config: HybridIndexPoolConfig, layer_idx: int, multi_token_prediction: bool = False):
        super().__init__()
        self.layer_idx = layer_idx
        # An MTP layer (index `num_hidden_layers + depth`) is an IndexPool layer with its own indexer, the last decoder
        # layer's MLP, no PLE, and residual streams only for Qwen4-Exp's MTP.
        self.layer_type = "indexpool_attention" if multi_token_prediction else config.layer_types[layer_idx]
        mlp_type = config.mtp_mlp_type if multi_token_prediction else config.mlp_types[layer_idx]
        if self.layer_type == "linear_attention":
            linear_attention_class = LINEAR_ATTENTION_CLASSES[config.linear_attention_type]
            self.linear_attn = linear_attention_class(config, layer_idx)
        elif config.attention_type == "mla":
            self.self_attn = HybridIndexPoolMLAAttention(config, layer_idx)
        else:
            self.self_attn = HybridIndexPoolAttention(config, layer_idx)
        if mlp_type == "sparse":
            self.mlp = HybridIndexPoolSparseMoeBlock(config)
        else:
            self.mlp = HybridIndexPoolMLP(config, config.intermediate_size)
        self.ple = None
        if layer_idx in config.ple_layers:
            self.ple = HybridIndexPoolPerLayerEmbedding(config, config.ple_layers.index(layer_idx))
        self.hyper_connections = config.has_hyper_connections and (not multi_token_prediction
                                                                   or config.mtp_type == "qwen4_exp")
        if self.hyper_connections:
            hyper_connection_class = HYPER_CONNECTION_CLASSES[config.hc_type]
            self.attn_hyper_connection = hyper_connection_class(config)
            self.mlp_hyper_connection = hyper_connection_class(config)
        self.input_layernorm = self.post_attention_layernorm = None
        if not self.hyper_connections or config.hc_type == "sinkhorn":  # Qwen4-Exp's hyper-connections norm instead
            self.input_layernorm = HybridIndexPoolRMSNorm.from_config(config, config.hidden_size)
            self.post_attention_layernorm = HybridIndexPoolRMSNorm.from_config(config, config.hidden_size)
        # A shared-indexer layer attends to the windows the closest full IndexPool layer before it selected.
        self.selection_source = None
        if self.layer_type == "indexpool_attention" and config.is_shared_indexer_layer(layer_idx):
            full_layers = [index for index in range(layer_idx) if config.layer_types[index] == "indexpool_attention"
                           and not config.is_shared_indexer_layer(index)]
            self.selection_source = full_layers[-1] if full_layers else None

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        step: LayerStep,
        cache: HybridIndexPoolCache | None = None,
    ) -> torch.Tensor:
        """`hidden_states [batch, seq, hc_count * hidden]` -> the same. An IndexPool layer with its own indexer
        records its selection in `step` (a shared-indexer layer attends to that of `selection_source`), and its
        indexer loss when `step.indexer_loss` asks for it; attention weights and router logits are recorded by the
        model's output capture."""
        layer_cache = None if cache is None else cache.layers[self.layer_idx]
        if self.ple is not None:
            hidden_states = hidden_states + self.ple(hidden_states, step.ple_token_ids, step.token_is_real,
                                                     layer_cache)
        if self.hyper_connections:
            streams = hidden_states
            hidden_states, write_weights = self.attn_hyper_connection(streams)
        else:
            residual = hidden_states
        if self.input_layernorm is not None:
            hidden_states = self.input_layernorm(hidden_states)
        if self.layer_type == "linear_attention":
            hidden_states = self.linear_attn(hidden_states, step.token_is_real, layer_cache)
        else:
            hidden_states = self._sparse_attention(hidden_states, position_embeddings, step, layer_cache)
        if self.hyper_connections:
            streams = self.attn_hyper_connection.inject(streams, hidden_states, write_weights)
            hidden_states, write_weights = self.mlp_hyper_connection(streams)
            if self.post_attention_layernorm is not None:
                hidden_states = self.post_attention_layernorm(hidden_states)
            return self.mlp_hyper_connection.inject(streams, self._feed_forward(hidden_states), write_weights)
        hidden_states = residual + hidden_states
        return hidden_states + self._feed_forward(self.post_attention_layernorm(hidden_states))

    def _sparse_attention(self, hidden_states, position_embeddings, step: LayerStep, layer_cache) -> torch.Tensor:
        """The IndexPool attention's output; its selection and indexer loss go to `step`."""
        shared = None if self.selection_source is None else step.selections.get(self.selection_source)
        output, _, kl, selection = self.self_attn(
            hidden_states, position_embeddings, step.positions, step.rope_positions, step.token_is_real, layer_cache,
            step.output_attentions, step.indexer_loss, shared,
        )
        if self.selection_source is None:  # a full layer: the shared layers after it may attend to its selection
            step.selections[self.layer_idx] = selection
        if kl is not None:
            step.indexer_losses[self.layer_idx] = kl
        return output

    def _feed_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The MLP's output (a MoE block's router logits are recorded from the block itself)."""
        if isinstance(self.mlp, HybridIndexPoolSparseMoeBlock):
            return self.mlp(hidden_states)[0]
        return self.mlp(hidden_states)
