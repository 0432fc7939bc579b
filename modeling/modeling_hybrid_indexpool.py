"""HybridIndexPool: a hybrid decoder of Gated DeltaNet linear attention and IndexPool sparse attention.

An IndexPool layer is gated GQA attention whose key/value set is chosen per query by a lightweight indexer. The
indexer keeps one pooled key per window of `r = index_pool_size` consecutive tokens (weighted pooling, then norm,
then RoPE at the window's first position), scores the complete windows a query may see, and the query attends to
the raw keys/values of its best `index_topk // r` windows plus its own open window (the tail).

This module assembles the decoder layer, the model and its heads; each concept lives in a module of its own:
`layers` (linear, norms, rotary), `linear_attention_gdn`, `indexer`, `attention_gqa`, `moe`, `residual_streams`
(hyper-connections), `per_layer_embedding`, and the cache in `cache_hybrid_indexpool`.
"""

import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import transformers
from packaging import version
from torch import nn
from transformers import initialization as init
from transformers.generation import GenerationMixin
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    MoeCausalLMOutputWithPast,
    MoeModelOutputWithPast,
    SequenceClassifierOutputWithPast,
)
from transformers.modeling_utils import PreTrainedModel
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import can_return_tuple

from ..configuration.configuration_hybrid_indexpool import HybridIndexPoolConfig
from .attention_gqa import HybridIndexPoolAttention
from .attention_mla import HybridIndexPoolMLAAttention
from .cache_hybrid_indexpool import HybridIndexPoolCache
from .hub_export import auto_map_for, write_model_card, write_remote_code
from .indexer import HybridIndexPoolIndexer
from .layers import HybridIndexPoolLinear, HybridIndexPoolRMSNorm, HybridIndexPoolRotaryEmbedding
from .linear_attention_gdn import HybridIndexPoolGatedDeltaNet
from .linear_attention_kda import (
    HybridIndexPoolKimiDeltaAttention,
    HybridIndexPoolKimiForgetGate,
    HybridIndexPoolKimiRMSNormGated,
)
from .moe import (
    HybridIndexPoolExperts,
    HybridIndexPoolGroupedTopkRouter,
    HybridIndexPoolMLP,
    HybridIndexPoolSparseMoeBlock,
    load_balancing_loss,
)
from .per_layer_embedding import HybridIndexPoolNGramEmbedding, HybridIndexPoolPerLayerEmbedding
from .residual_streams import HybridIndexPoolHyperConnection, HybridIndexPoolSinkhornHyperConnection
from .token_layout import TokenLayout


@dataclass
class HybridIndexPoolModelOutput(MoeModelOutputWithPast):
    """`MoeModelOutputWithPast` (`router_logits`: one `[batch * seq, num_experts]` per MoE layer, when asked for) plus
    `indexer_loss`, the IndexPool layers' mean KL loss when it was asked for."""

    indexer_loss: torch.FloatTensor | None = None


@dataclass
class HybridIndexPoolCausalLMOutput(MoeCausalLMOutputWithPast):
    """`MoeCausalLMOutputWithPast` (`aux_loss`, the load-balancing loss, and `router_logits`, when router logits were
    asked for) plus `indexer_loss`; both losses are already included, weighted, in `loss`."""

    indexer_loss: torch.FloatTensor | None = None


@dataclass
class HybridIndexPoolSequenceClassifierOutput(SequenceClassifierOutputWithPast):
    """`SequenceClassifierOutputWithPast` plus the load-balancing `aux_loss` (included, weighted, in `loss`) and the
    `router_logits`, when router logits were asked for."""

    aux_loss: torch.FloatTensor | None = None
    router_logits: tuple[torch.Tensor, ...] | None = None


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

    def __init__(self, config: HybridIndexPoolConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.layer_type = config.layer_types[layer_idx]
        if self.layer_type == "linear_attention":
            linear_attention_class = LINEAR_ATTENTION_CLASSES[config.linear_attention_type]
            self.linear_attn = linear_attention_class(config, layer_idx)
        elif config.attention_type == "mla":
            self.self_attn = HybridIndexPoolMLAAttention(config, layer_idx)
        else:
            self.self_attn = HybridIndexPoolAttention(config, layer_idx)
        if config.mlp_types[layer_idx] == "sparse":
            self.mlp = HybridIndexPoolSparseMoeBlock(config)
        else:
            self.mlp = HybridIndexPoolMLP(config, config.intermediate_size)
        self.ple = None
        if layer_idx in config.ple_layers:
            self.ple = HybridIndexPoolPerLayerEmbedding(config, config.ple_layers.index(layer_idx))
        self.hyper_connections = config.has_hyper_connections
        if self.hyper_connections:
            hyper_connection_class = HYPER_CONNECTION_CLASSES[config.hc_type]
            self.attn_hyper_connection = hyper_connection_class(config)
            self.mlp_hyper_connection = hyper_connection_class(config)
        self.input_layernorm = self.post_attention_layernorm = None
        if not self.hyper_connections or config.hc_type == "sinkhorn":  # Qwen4-Exp's hyper-connections norm instead
            self.input_layernorm = HybridIndexPoolRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.post_attention_layernorm = HybridIndexPoolRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        positions: torch.Tensor,
        rope_positions: torch.Tensor,
        token_is_real: torch.Tensor,
        cache: HybridIndexPoolCache | None = None,
        output_attentions: bool = False,
        indexer_loss: str | None = None,
        ple_token_ids: torch.Tensor | None = None,
        shared_selection: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """`hidden_states [batch, seq, hc_count * hidden]` -> the same, the attention weights, the indexer loss
        (when asked), the router logits `[batch, seq, num_experts]` (MoE layers) and the IndexPool selection
        `[batch, seq, topk]` (None when dense or in a linear layer). `ple_token_ids` (pads replaced by the
        end-of-sequence id) feed a PLE layer; `shared_selection` is the selection a shared-indexer layer reuses."""
        layer_cache = None if cache is None else cache.layers[self.layer_idx]
        if self.ple is not None:
            hidden_states = hidden_states + self.ple(hidden_states, ple_token_ids, token_is_real, layer_cache)
        if self.hyper_connections:
            streams = hidden_states
            hidden_states, write_weights = self.attn_hyper_connection(streams)
        else:
            residual = hidden_states
        if self.input_layernorm is not None:
            hidden_states = self.input_layernorm(hidden_states)
        weights = kl = selection = None
        if self.layer_type == "linear_attention":
            hidden_states = self.linear_attn(hidden_states, token_is_real, layer_cache)
        else:
            hidden_states, weights, kl, selection = self.self_attn(
                hidden_states, position_embeddings, positions, rope_positions, token_is_real, layer_cache,
                output_attentions, indexer_loss, shared_selection,
            )
        if self.hyper_connections:
            streams = self.attn_hyper_connection.inject(streams, hidden_states, write_weights)
            hidden_states, write_weights = self.mlp_hyper_connection(streams)
            if self.post_attention_layernorm is not None:
                hidden_states = self.post_attention_layernorm(hidden_states)
            mlp_output, router_logits = self._feed_forward(hidden_states)
            streams = self.mlp_hyper_connection.inject(streams, mlp_output, write_weights)
            return streams, weights, kl, router_logits, selection
        hidden_states = residual + hidden_states
        mlp_output, router_logits = self._feed_forward(self.post_attention_layernorm(hidden_states))
        return hidden_states + mlp_output, weights, kl, router_logits, selection

    def _feed_forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The MLP's output and, from a MoE block, its router logits (None from a dense MLP)."""
        if isinstance(self.mlp, HybridIndexPoolSparseMoeBlock):
            return self.mlp(hidden_states)
        return self.mlp(hidden_states), None


# The oldest transformers the model runs on. The package installs next to older ones (vLLM pins transformers < 5.20)
# because its vLLM plugin needs only the configuration; building a model there is refused here.
MINIMUM_TRANSFORMERS_VERSION = "5.24"


def require_transformers_version() -> None:
    """Raise an `ImportError` saying what to install when the installed transformers is too old for the model."""
    if version.parse(transformers.__version__) < version.parse(MINIMUM_TRANSFORMERS_VERSION):
        raise ImportError(
            f"The HybridIndexPool model needs transformers >= {MINIMUM_TRANSFORMERS_VERSION}, but transformers "
            f"{transformers.__version__} is installed (an environment with vLLM pins an older one: serve there through "
            f"the vLLM plugin, or run the model elsewhere). Upgrade with "
            f"`pip install 'transformers>={MINIMUM_TRANSFORMERS_VERSION}'`."
        )


class HybridIndexPoolPreTrainedModel(PreTrainedModel):
    """Weight initialisation and the Hugging Face plumbing shared by the HybridIndexPool models."""

    config_class = HybridIndexPoolConfig
    config: HybridIndexPoolConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["HybridIndexPoolDecoderLayer"]
    # The linear attentions' decay parameters stay float32 when the model is loaded in half precision; the model adds
    # the float32 parameters of GLM-5.3-Flash's variants it has (`HybridIndexPoolModel`).
    _keep_in_fp32_modules_strict = ["A_log", "dt_bias"]
    _skip_keys_device_placement = ["cache"]
    _supports_sdpa = True
    _is_stateful = True

    def __init__(self, config, *inputs, **kwargs):
        require_transformers_version()
        super().__init__(config, *inputs, **kwargs)

    @classmethod
    def maybe_distribute_model(cls, model, distributed_config, mesh_manager):
        """Refuse what transformers' parallelism cannot do with this model before it applies its plans: a tensor
        parallel size that does not split the heads evenly, and pipeline stages for hyper-connections or PLE (a stage
        hands the next one `hidden_size` channels and no token ids)."""
        if distributed_config is not None and mesh_manager is not None:
            config = model.config.get_text_config()
            config.check_tensor_parallel_size(distributed_config.tp_size)
            if distributed_config.pp_size > 1 and (config.hc_count > 1 or config.ple_layers):
                raise ValueError(
                    "Pipeline parallelism passes one `hidden_size`-wide state between stages, but this model has "
                    f"hyper-connections (hc_count = {config.hc_count}) or PLE layers ({config.ple_layers}) "
                    "that need hc_count streams and the token ids in every stage; use tensor parallelism instead."
                )
        return super().maybe_distribute_model(model, distributed_config, mesh_manager)

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        # transformers looks for the experts decorator in the module of the class; subclasses defined elsewhere (the
        # converters' helpers, user code) use the same experts.
        return True

    def save_pretrained(self, save_directory, *args, **kwargs):
        """Save as usual, plus what makes the folder a self-contained Hub checkpoint: flat remote code, `auto_map`
        in the config, and a `README.md` model card (a card the user wrote is never replaced).

        The code and card are written first, so that `push_to_hub=True` uploads them with the weights.
        """
        if kwargs.get("is_main_process", True):
            os.makedirs(save_directory, exist_ok=True)
            write_remote_code(save_directory, multimodal=hasattr(self.config, "vision_config"))
            write_model_card(self, save_directory)
        self.config.auto_map = auto_map_for(self.config)
        return super().save_pretrained(save_directory, *args, **kwargs)

    def router_aux_loss(self, router_logits: tuple[torch.Tensor, ...] | None,
                        attention_mask: torch.Tensor | None) -> torch.Tensor | None:
        """The load-balancing loss of the router logits a forward returned (None when it returned none), over the
        real tokens of `attention_mask` `[batch, past + new]`."""
        if router_logits is None:
            return None
        if attention_mask is not None:
            new_tokens = router_logits[0].shape[0] // attention_mask.shape[0]
            attention_mask = attention_mask[:, attention_mask.shape[1] - new_tokens:]  # the cached tokens ran before
        return load_balancing_loss(router_logits, self.config.get_text_config().num_experts_per_tok, attention_mask)

    def _init_weights(self, module):
        super()._init_weights(module)
        std = self.config.get_text_config().initializer_range
        if isinstance(module, HybridIndexPoolRMSNorm):
            init.zeros_(module.weight)  # zero-centred: the scale is 1 + weight
        elif isinstance(module, HybridIndexPoolGatedDeltaNet):
            init.ones_(module.dt_bias)
            init.copy_(module.A_log, torch.empty_like(module.A_log).uniform_(1, 16).log_())
        elif isinstance(module, HybridIndexPoolKimiForgetGate):
            # flash-linear-attention's: A_log = 0 under a lower bound, else log U(1, 16); dt_bias the inverse softplus
            # of a log-uniform step in [1e-3, 1e-1].
            if module.lower_bound is None:
                init.copy_(module.A_log, torch.empty_like(module.A_log).uniform_(1, 16).log_())
            else:
                init.zeros_(module.A_log)
            step = torch.empty_like(module.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp_min(1e-4)
            init.copy_(module.dt_bias, step + torch.log(-torch.expm1(-step)))
        elif isinstance(module, HybridIndexPoolKimiRMSNormGated):
            init.ones_(module.weight)
        elif isinstance(module, HybridIndexPoolIndexer) and module.learned_pooling:
            # Zero gate and slot bias: pooling starts exactly at the mean.
            init.zeros_(module.pool_gate_proj.weight)
            init.zeros_(module.pool_slot_bias)
        elif isinstance(module, HybridIndexPoolExperts):
            init.normal_(module.gate_up_proj, mean=0.0, std=std)
            init.normal_(module.down_proj, mean=0.0, std=std)
        elif isinstance(module, HybridIndexPoolGroupedTopkRouter):
            init.normal_(module.weight, mean=0.0, std=std)
            init.zeros_(module.e_score_correction_bias)
        elif isinstance(module, HybridIndexPoolSinkhornHyperConnection):
            # GLM-5.3-Flash's start: even reads, writes of 1, a uniform mixing matrix.
            init.normal_(module.fn, mean=0.0, std=std)
            init.zeros_(module.base)
            init.ones_(module.scale)
        elif isinstance(module, HybridIndexPoolPerLayerEmbedding):
            init.zeros_(module.conv1d.weight)  # the convolution starts silent, as in Qwen4-Exp
        elif isinstance(module, HybridIndexPoolNGramEmbedding):
            # Buffers computed from the config: loading creates the model on the meta device, so set them here.
            init.copy_(module.multipliers, torch.tensor(module.multiplier_values))
            init.copy_(module.head_table_sizes, torch.tensor(module.table_sizes))
            init.copy_(module.head_table_offsets, torch.tensor(module.table_offsets))


class HybridIndexPoolModel(HybridIndexPoolPreTrainedModel):
    """The decoder stack without a head; returns the final normed hidden states and the cache."""

    def __init__(self, config: HybridIndexPoolConfig):
        config.check_settings()
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [HybridIndexPoolDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        if config.hc_type == "qwen4_exp" and config.hc_count > 1:
            self.hyper_connection_mixer = HybridIndexPoolHyperConnection(config, inject=False)
        else:
            self.norm = HybridIndexPoolRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # GLM-5.3-Flash's grouped router (weights and bias) and the Sinkhorn streams' affine mixing parameters stay
        # float32 when loaded in half precision, as there; only those the model has are named (transformers checks).
        float32_parameters = []
        if config.moe_router_type == "sigmoid_grouped" and "sparse" in config.mlp_types:
            float32_parameters += ["mlp.gate.weight", "e_score_correction_bias"]
        if config.hc_type == "sinkhorn":
            float32_parameters += [f"{block}_hyper_connection.{name}" for block in ("attn", "mlp")
                                   for name in ("base", "scale")]
        self._keep_in_fp32_modules_strict = [*self._keep_in_fp32_modules_strict, *float32_parameters]
        self.rotary_emb = HybridIndexPoolRotaryEmbedding(config)
        self.gradient_checkpointing = False
        self.post_init()

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: HybridIndexPoolCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        indexer_loss: str | None = None,
        ple_input_ids: torch.LongTensor | None = None,
        output_router_logits: bool | None = None,
        **kwargs,
    ) -> "HybridIndexPoolModelOutput":
        """Run the decoder.

        Args:
            input_ids: `[batch, seq]` token ids (or give `inputs_embeds` `[batch, seq, hidden]`).
            attention_mask: `[batch, past + seq]` with 1 for real tokens and 0 for (left) padding.
            position_ids: `[batch, seq]`; by default each row counts its real tokens from 0. Multimodal-RoPE
                positions `[streams, batch, seq]` are accepted for text, where every stream is the same.
            cache: a [`HybridIndexPoolCache`] to continue from and update (`past_key_values` is accepted too).
            use_cache: create a cache when none is given (default `config.use_cache`).
            output_attentions: also return the attention weights of the IndexPool layers, dense `[b, h, t, slots]`.
            output_hidden_states: also return the hidden states entering each layer and the final ones.
            indexer_loss: `"dense"` or `"sparse"` to also return the indexer's KL loss (DeepSeek-V3.2 style, mean
                over the IndexPool layers): against the attention mass of every complete visible window, or of the
                selected ones only. It trains only the indexer and pooling parameters. `"dense"` (the warm-up) also
                makes the attention dense at any length.
            ple_input_ids: the token ids for the per-layer n-gram embeddings when `inputs_embeds` replace
                `input_ids` (models with `ple_layers` only).
            output_router_logits: also return each MoE layer's router logits `[batch * seq, num_experts]`, in
                the input's token order (default `config.output_router_logits`; None for a model without experts).
        """
        if indexer_loss not in (None, "dense", "sparse"):
            raise ValueError(f"indexer_loss is {indexer_loss!r}; use None, 'dense' or 'sparse'.")
        output_attentions = bool(output_attentions if output_attentions is not None else self.config.output_attentions)
        output_hidden_states = bool(
            output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        )
        output_router_logits = bool(
            output_router_logits if output_router_logits is not None else self.config.output_router_logits
        )
        use_cache_asked = use_cache
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        self._check_inputs(input_ids, inputs_embeds)
        if self.config.ple_layers:
            ple_input_ids = input_ids if ple_input_ids is None else ple_input_ids
            if ple_input_ids is None:
                raise ValueError(
                    "This model has per-layer n-gram embeddings (`ple_layers`), which need the token ids: with "
                    "`inputs_embeds`, also pass `ple_input_ids` [batch, seq]."
                )
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            use_cache, cache = False, None  # the recomputation would update a cache twice
        if cache is not None and not isinstance(cache, HybridIndexPoolCache):
            raise ValueError(
                f"`cache` is a {type(cache).__name__}; this model needs a HybridIndexPoolCache "
                "(leave it empty and one is created, or build one with HybridIndexPoolCache(model.config))."
            )
        if cache is not None:
            cache.check_compatible(self.config, inputs_embeds.shape[0])

        batch_size, seq_len = inputs_embeds.shape[:2]
        token_is_real = self._token_is_real(attention_mask, cache, batch_size, seq_len, inputs_embeds.device)
        rope_positions, text_positions = self._rope_positions(position_ids, batch_size, seq_len, inputs_embeds.device)
        # The layers run on a grid where every sequence's real tokens come first (see TokenLayout): padding and
        # holes then cost the recurrent layers nothing, and packed sequences never see each other.
        layout = None
        if seq_len > 1 and text_positions is not None and self._is_packed(text_positions, token_is_real):
            if cache is not None or use_cache_asked:
                raise ValueError(
                    "`position_ids` restart at 0 inside a row (packed sequences, as DataCollatorWithFlattening "
                    "makes): that is for training without a cache; pass use_cache=False, or one sequence per row."
                )
            use_cache = False
            layout = TokenLayout.unpack(text_positions, token_is_real)
        elif seq_len > 1:
            layout = TokenLayout.compact(token_is_real)
        # Attention weights are returned over every mask column, past and new (transformers' convention). Only read
        # when asked: the cache's count lives on the device, and a decode step must not wait for it.
        kv_length = None
        if output_attentions:
            kv_length = seq_len + (0 if cache is None else cache.get_seq_length())
        if use_cache and cache is None:
            cache = HybridIndexPoolCache(self.config)
        ple_token_ids = None
        if self.config.ple_layers:
            # Padding never enters an n-gram: it reads as end-of-sequence, after which the n-gram context restarts.
            ple_token_ids = ple_input_ids.to(inputs_embeds.device).masked_fill(
                ~token_is_real, self.config.ple_eos_token_id
            )
        if layout is not None:
            inputs_embeds, token_is_real = layout.to_grid(inputs_embeds), layout.token_is_real
            if rope_positions is not None:  # [streams, batch, seq]: the streams ride along
                rope_positions = layout.to_grid(rope_positions.permute(1, 2, 0)).permute(2, 0, 1)
            text_positions = None if text_positions is None else layout.to_grid(text_positions)
            ple_token_ids = None if ple_token_ids is None else layout.to_grid(ple_token_ids)
        # Storage positions: each row counts its real tokens (the cache's per-row lengths come first).
        if cache is not None:
            positions = cache.begin_update(token_is_real)
        else:
            positions = (token_is_real.long().cumsum(dim=1) - 1).clamp(min=0)
        if text_positions is not None and seq_len > 1:
            self._check_positions(text_positions, positions, token_is_real)
        if rope_positions is None:
            # The rotary positions count the tokens too, shifted per row after a multimodal prompt.
            rope_positions = positions
            if cache is not None and cache.rope_deltas is not None:
                rope_positions = positions + cache.rope_deltas.to(positions.device)
            rope_positions = rope_positions[None].expand(self.rotary_emb.num_streams, -1, -1)
        if self.config.has_hyper_connections:
            inputs_embeds = inputs_embeds.repeat(1, 1, self.config.hc_count)  # every stream starts as the embedding
        # A long prompt goes through the whole stack a chunk at a time: every layer keeps its state in the cache,
        # so peak memory follows the cache (linear in the context), not the prompt's activations.
        grid_length = inputs_embeds.shape[1]
        chunk = self.config.prefill_chunk_length
        if cache is None or chunk is None or grid_length <= chunk or output_attentions or indexer_loss:
            chunk = grid_length
        starts = range(0, grid_length, chunk)
        # In one piece, the layers record their input hidden states in the input's layout and continue from those,
        # so the returned states are tensors the output was computed from (their gradients can be retained).
        record_layout = layout if len(starts) == 1 else None
        pieces = [
            self._run_layers(inputs_embeds[:, start:start + chunk], positions[:, start:start + chunk],
                             rope_positions[:, :, start:start + chunk], token_is_real[:, start:start + chunk], cache,
                             output_attentions, output_hidden_states,
                             indexer_loss, None if ple_token_ids is None else ple_token_ids[:, start:start + chunk],
                             record_layout, output_router_logits)
            for start in range(0, grid_length, chunk)
        ]
        hidden_states = torch.cat([piece[0] for piece in pieces], dim=1) if len(pieces) > 1 else pieces[0][0]
        all_hidden_states = None
        if output_hidden_states:
            all_hidden_states = tuple(torch.cat(states, dim=1) if len(states) > 1 else states[0]
                                      for states in zip(*(piece[1] for piece in pieces)))
        all_attentions = pieces[0][2] if output_attentions else None
        layer_losses = pieces[0][3]
        all_router_logits = tuple(torch.cat(logits, dim=1) if len(logits) > 1 else logits[0]
                                  for logits in zip(*(piece[4] for piece in pieces))) or None
        if layout is not None:
            hidden_states = layout.from_grid(hidden_states)
            if all_hidden_states is not None and record_layout is None:
                all_hidden_states = tuple(layout.from_grid(states) for states in all_hidden_states)
            if all_attentions is not None:  # [rows, heads, queries, positions]: move the queries
                all_attentions = tuple(layout.from_grid(weights.transpose(1, 2)).transpose(1, 2)
                                       for weights in all_attentions)
            if all_router_logits is not None:  # back in the input's order, so that its padding mask lines up
                all_router_logits = tuple(layout.from_grid(logits) for logits in all_router_logits)
        if all_router_logits is not None:
            all_router_logits = tuple(logits.flatten(0, 1) for logits in all_router_logits)
        if all_attentions is not None:
            columns = self._columns_of_positions(attention_mask, layout, batch_size, kv_length, inputs_embeds.device)
            all_attentions = tuple(self._attention_by_column(weights, columns, kv_length) for weights in all_attentions)
        return HybridIndexPoolModelOutput(
            last_hidden_state=hidden_states,
            cache=cache if use_cache else None,
            hidden_states=all_hidden_states,
            attentions=all_attentions,
            router_logits=all_router_logits,
            indexer_loss=torch.stack(layer_losses).mean() if layer_losses else None,
        )

    def _run_layers(self, hidden_states, positions, rope_positions, token_is_real, cache, output_attentions,
                    output_hidden_states, indexer_loss=None, ple_token_ids=None, record_layout=None,
                    output_router_logits=False):
        """One pass of the stack over a piece of the input: final normed states, per-layer states, attentions, the
        IndexPool layers' indexer losses and the MoE layers' router logits `[rows, seq, num_experts]`. With
        `record_layout`, the per-layer states are recorded in the input's layout (the final ones stay on the
        grid)."""
        position_embeddings = self.rotary_emb(hidden_states, rope_positions[0] if len(rope_positions) == 1
                                              else rope_positions)
        all_hidden_states, all_attentions, indexer_losses, all_router_logits = (), (), [], ()
        # The last full IndexPool layer's selection, which the shared-indexer layers after it reuse.
        selection = None
        for decoder_layer in self.layers:
            if not isinstance(decoder_layer, HybridIndexPoolDecoderLayer):
                continue  # another pipeline stage runs this layer (transformers' pipeline parallelism left a stub)
            if output_hidden_states and record_layout is not None:
                # Real tokens' cells come back unchanged; padding cells, never read by a real token, may not.
                recorded = record_layout.from_grid(hidden_states)
                all_hidden_states += (recorded,)
                hidden_states = record_layout.to_grid(recorded)
            elif output_hidden_states:
                all_hidden_states += (hidden_states,)
            hidden_states, weights, kl, router_logits, layer_selection = decoder_layer(
                hidden_states, position_embeddings, positions, rope_positions, token_is_real, cache=cache,
                output_attentions=output_attentions, indexer_loss=indexer_loss, ple_token_ids=ple_token_ids,
                shared_selection=selection,
            )
            if decoder_layer.layer_type == "indexpool_attention" and decoder_layer.self_attn.indexer is not None:
                selection = layer_selection
            if output_attentions and decoder_layer.layer_type == "indexpool_attention":
                all_attentions += (weights,)
            if kl is not None:
                indexer_losses.append(kl)
            if output_router_logits and router_logits is not None:
                all_router_logits += (router_logits,)
        if self.config.hc_type == "sinkhorn":
            hidden_states = self.norm(HybridIndexPoolSinkhornHyperConnection.collapse(hidden_states,
                                                                                      self.config.hc_count))
        elif self.config.hc_count > 1:
            hidden_states = self.hyper_connection_mixer(hidden_states)[0]
        else:
            hidden_states = self.norm(hidden_states)
        if output_hidden_states:
            all_hidden_states += (hidden_states if record_layout is None else record_layout.from_grid(hidden_states),)
        return hidden_states, all_hidden_states, all_attentions, indexer_losses, all_router_logits

    @staticmethod
    def _columns_of_positions(attention_mask, layout, batch_size, kv_length, device) -> torch.Tensor | None:
        """`[batch, queries or 1, positions]`: the mask column (past and new) of each stored position a query can
        attend to, or None when position `p` is column `p` (no padding anywhere). Positions count a row's real
        tokens, so position `p` is its `p`-th real column; in a row of packed sequences, the `p`-th column of the
        query's own sequence."""
        if layout is not None and layout.rows.shape[0] != batch_size:  # packed: one grid row per sequence
            return layout.columns[layout.source_rows]
        if layout is None and (attention_mask is None or bool(attention_mask.all())):
            return None
        # A stable sort puts each row's real columns first, in order; its padding columns follow.
        padding = attention_mask.to(device=device) == 0
        return torch.sort(padding.to(torch.uint8), dim=1, stable=True).indices[:, None]

    @staticmethod
    def _attention_by_column(weights, columns, kv_length) -> torch.Tensor:
        """Attention weights `[batch, heads, queries, positions]` laid out over the mask columns instead,
        `[batch, heads, queries, kv_length]`, zero where nothing was attended (padding, unselected windows)."""
        if columns is None and weights.shape[-1] == kv_length:
            return weights  # the very weights the output used (their gradient can be retained)
        if columns is None:  # a decode step's weights cover the cache's reserved positions
            return F.pad(weights, (0, kv_length - weights.shape[-1]))[..., :kv_length]
        batch_size, num_heads, num_queries, _ = weights.shape
        num_positions = min(weights.shape[-1], columns.shape[-1], kv_length)
        index = columns[..., :num_positions].expand(batch_size, num_queries, num_positions)
        index = index[:, None].expand(batch_size, num_heads, num_queries, num_positions)
        # Added, not written: cells past the end of a packed sequence repeat a column with zero weight.
        return weights.new_zeros(batch_size, num_heads, num_queries, kv_length).scatter_add_(
            -1, index, weights[..., :num_positions])

    def _check_inputs(self, input_ids, inputs_embeds) -> None:
        """Refuse malformed inputs with a message that names the argument and the fix."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Give exactly one of `input_ids` or `inputs_embeds`.")
        given = input_ids if input_ids is not None else inputs_embeds
        name = "input_ids" if input_ids is not None else "inputs_embeds"
        if given.dim() != (2 if input_ids is not None else 3):
            shape = "[batch, seq]" if input_ids is not None else "[batch, seq, hidden_size]"
            raise ValueError(f"`{name}` has shape {tuple(given.shape)}; give {shape} (add a batch dimension with "
                             f"{name}[None] for a single sequence).")
        if given.shape[0] == 0 or given.shape[1] == 0:
            raise ValueError(f"`{name}` has shape {tuple(given.shape)}: give at least one row of at least one token.")
        if input_ids is not None:
            if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
                raise ValueError(f"`input_ids` are {input_ids.dtype}; token ids must be integers (e.g. torch.long).")
            # Checked outside decode steps only: reading the values waits for the device.
            if input_ids.shape[1] > 1 and bool((input_ids < 0).any() | (input_ids >= self.config.vocab_size).any()):
                raise ValueError(
                    f"`input_ids` hold ids from {int(input_ids.min())} to {int(input_ids.max())}, outside the "
                    f"vocabulary [0, {self.config.vocab_size}); check the tokenizer matches this model."
                )
        else:
            if inputs_embeds.shape[-1] != self.config.hidden_size:
                raise ValueError(f"`inputs_embeds` are {inputs_embeds.shape[-1]} wide; this model's hidden_size is "
                                 f"{self.config.hidden_size}.")
            if not inputs_embeds.is_floating_point():
                raise ValueError(f"`inputs_embeds` are {inputs_embeds.dtype}; give floating-point embeddings (e.g. "
                                 "model.get_input_embeddings()(input_ids)).")

    @staticmethod
    def _token_is_real(attention_mask, cache, batch_size, seq_len, device):
        """`[batch, seq]` bool: which new tokens exist (mask 1); padding and holes are absent for everything."""
        if attention_mask is None:
            return torch.ones(batch_size, seq_len, dtype=torch.bool, device=device)
        if attention_mask.dim() != 2:
            raise ValueError(
                f"`attention_mask` has {attention_mask.dim()} dimensions; give the 2-D padding mask "
                "`[batch, past + new tokens]` (1 = token, 0 = padding): the sparse selection builds its own."
            )
        if seq_len > 1 or cache is None or cache.seen_tokens is None:
            past = 0 if cache is None else cache.get_seq_length()
        else:  # a decode step reads only the new token's column, and nothing from the device
            past = max(attention_mask.shape[1] - seq_len, 0)
        if attention_mask.shape != (batch_size, past + seq_len):
            raise ValueError(
                f"`attention_mask` has shape {tuple(attention_mask.shape)} but the cache holds {past} tokens and "
                f"{seq_len} new ones arrive for {batch_size} rows; it must be ({batch_size}, {past + seq_len})."
            )
        return attention_mask[:, attention_mask.shape[1] - seq_len:].to(device=device, dtype=torch.bool)

    def _rope_positions(self, position_ids, batch_size, seq_len, device):
        """`position_ids` as rotary positions `[streams, batch, seq]` for this model's RoPE and, where they include
        them, the text positions `[batch, seq]` (which count the real tokens); `(None, None)` when not given.

        Accepted: `[batch, seq]` text positions; `[3, batch, seq]` multimodal streams (time, height, width);
        `[4, batch, seq]`, the text positions then the three streams (what `generate()` builds for Qwen-VL models).
        """
        if position_ids is None:
            return None, None
        streams = self.rotary_emb.num_streams
        text_positions, multimodal = None, None
        if position_ids.dim() == 2:
            text_positions = position_ids
        elif position_ids.dim() == 3 and position_ids.shape[0] in (1, 3, 4):
            if position_ids.shape[0] in (1, 4):
                text_positions = position_ids[0]
            if position_ids.shape[0] != 1:
                multimodal = position_ids[-3:]
        else:
            raise ValueError(
                f"`position_ids` has shape {tuple(position_ids.shape)}; give [batch, seq] text positions, or "
                "[3, batch, seq] multimodal (time, height, width) positions, or [4, batch, seq] with the text "
                "positions first."
            )
        if multimodal is not None and streams == 1:
            if not bool((multimodal == multimodal[:1]).all()):
                raise ValueError(
                    "`position_ids` has several different position streams (multimodal RoPE for images or video), "
                    "but this model's rope_parameters have no 'mrope_section': give [batch, seq] positions, or use "
                    "a multimodal model."
                )
            text_positions = multimodal[0] if text_positions is None else text_positions
            multimodal = None
        for name, given in (("text", text_positions), ("multimodal", multimodal)):
            if given is not None and given.shape[-2:] not in ((batch_size, seq_len), (1, seq_len)):
                raise ValueError(f"`position_ids` ({name}) has shape {tuple(given.shape)}; its last two dimensions "
                                 f"must be ({batch_size}, {seq_len}).")
        if text_positions is not None:
            text_positions = text_positions.expand(batch_size, seq_len).to(device=device, dtype=torch.long)
        rope = multimodal if multimodal is not None else text_positions[None]
        rope = rope.expand(streams, batch_size, seq_len).to(device=device, dtype=torch.long)
        return rope, text_positions

    @staticmethod
    def _is_packed(position_ids, token_is_real) -> bool:
        """Whether some row holds several sequences: more than one real token at position 0 (reads the device)."""
        return bool((((position_ids == 0) & token_is_real).sum(dim=1) > 1).any())

    @staticmethod
    def _check_positions(position_ids, positions, token_is_real) -> None:
        """Refuse `position_ids` that disagree with each row's count of real tokens (reads the device; not done in
        decode steps): windows, the cache and RoPE all follow that count."""
        wrong = token_is_real & (position_ids != positions)
        if bool(wrong.any()):
            row, column = (int(index) for index in wrong.nonzero()[0])
            raise ValueError(
                f"`position_ids` give position {int(position_ids[row, column])} to a token that is real token number "
                f"{int(positions[row, column])} of its row (row {row}): positions must count each row's real tokens "
                "from 0 (from the tokens already in the cache), as attention_mask.cumsum(-1) - 1 does. Leave "
                "`position_ids` out and the model counts them; positions restarting at 0 mean packed sequences."
            )


class HybridIndexPoolGenerationMixin(GenerationMixin):
    """What the language-model heads share: the output of `lm_head` with its losses, and what `generate()` needs to
    know about this model family: its cache (reserved once for the call), positions counted by the model itself, and
    the 2-D padding mask passed through to a (possibly compiled) decode step."""

    def language_model_output(self, outputs, labels=None, logits_to_keep: int | torch.Tensor = 0,
                              attention_mask: torch.Tensor | None = None, **kwargs) -> "HybridIndexPoolCausalLMOutput":
        """Logits of the last `logits_to_keep` positions (all when 0) and, given `labels`, the loss; a requested
        indexer loss is added, weighted by `indexer_loss_weight`. With router logits, `aux_loss` is their
        load-balancing loss over the real tokens of `attention_mask`, added to a labelled loss weighted by
        `router_aux_loss_coef` (as transformers' MoE models do)."""
        text_config = self.config.get_text_config()
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(outputs.last_hidden_state[:, keep, :])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=text_config.vocab_size, **kwargs)
        aux_loss = self.router_aux_loss(outputs.router_logits, attention_mask)
        if aux_loss is not None and loss is not None:
            loss = loss + text_config.router_aux_loss_coef * aux_loss.to(loss.device)
        if outputs.indexer_loss is not None:
            weighted = text_config.indexer_loss_weight * outputs.indexer_loss
            loss = weighted if loss is None else loss + weighted
        return HybridIndexPoolCausalLMOutput(
            loss=loss, aux_loss=aux_loss, logits=logits, cache=outputs.cache, hidden_states=outputs.hidden_states,
            attentions=outputs.attentions, router_logits=outputs.router_logits, indexer_loss=outputs.indexer_loss,
        )

    def _prepare_cache_for_generation(
        self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
    ):
        """`generate()` gets a HybridIndexPoolCache (the default DynamicCache cannot hold pooled windows)."""
        cache = model_kwargs.get("cache")
        if isinstance(cache, HybridIndexPoolCache) and generation_config.use_cache is not False:
            cache.reserve(max_cache_length)  # continuing from a cache: room for this call's tokens, once
        if cache is not None or generation_config.use_cache is False:
            return super()._prepare_cache_for_generation(
                generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
            )
        if generation_config.cache_implementation not in (None, "dynamic", "hybrid_indexpool"):
            raise ValueError(
                f"cache_implementation={generation_config.cache_implementation!r} is not supported by "
                "HybridIndexPool; leave it unset (a HybridIndexPoolCache is built) or pass `cache=`."
            )
        # generate() knows the final length: reserve it once (padding excepted) and let the decode step compile.
        model_kwargs["cache"] = HybridIndexPoolCache(self.config.get_text_config(), max_cache_len=max_cache_length)

    def _prepare_position_ids_for_generation(self, inputs_tensor, model_kwargs):
        """None: the model counts each row's real tokens itself, from the attention mask and the cache, which
        `generate()`'s own positions get wrong for right-padded rows once decoding starts."""
        return None

    def prepare_inputs_for_generation(self, input_ids, next_sequence_length=None, cache=None, attention_mask=None,
                                      inputs_embeds=None, is_first_iteration=False, **kwargs):
        model_inputs = super().prepare_inputs_for_generation(
            input_ids, next_sequence_length=next_sequence_length, cache=cache, attention_mask=attention_mask,
            inputs_embeds=inputs_embeds, is_first_iteration=is_first_iteration, **kwargs,
        )
        cache, attention_mask = model_inputs.get("cache"), model_inputs.get("attention_mask")
        if isinstance(cache, HybridIndexPoolCache) and cache.is_compileable and attention_mask is not None:
            # A decode step reads only the new tokens' columns of the growing 2-D mask, so a compiled step serves
            # every length: say so up front instead of recompiling once the length changes.
            torch._dynamo.maybe_mark_dynamic(attention_mask, 1)
        return model_inputs

    @staticmethod
    def create_masks_for_generate(config, inputs_embeds, attention_mask, cache, **kwargs):
        """The layers build their own selections from the 2-D padding mask: `generate()` passes it through."""
        return attention_mask


class HybridIndexPoolForCausalLM(HybridIndexPoolPreTrainedModel, HybridIndexPoolGenerationMixin):
    """HybridIndexPool with a language-modelling head; `generate()` uses a [`HybridIndexPoolCache`]."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}
    _fsdp_plan = {"lm_head": "keep_full_weight"}

    def __init__(self, config: HybridIndexPoolConfig):
        super().__init__(config)
        self.model = HybridIndexPoolModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = HybridIndexPoolLinear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: HybridIndexPoolCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        indexer_loss: str | None = None,
        ple_input_ids: torch.LongTensor | None = None,
        output_router_logits: bool | None = None,
        **kwargs,
    ) -> "HybridIndexPoolCausalLMOutput":
        """Next-token logits (of the last `logits_to_keep` positions when non-zero) and, given `labels`, the loss.

        With `indexer_loss` (`"dense"` or `"sparse"`, see [`HybridIndexPoolModel.forward`]) the output also carries
        `indexer_loss`, and `loss` adds it weighted by `config.indexer_loss_weight`. With `output_router_logits`
        (default `config.output_router_logits`) a MoE model also returns `router_logits` and the load-balancing
        `aux_loss`, which `loss` adds weighted by `config.router_aux_loss_coef`.
        """
        outputs = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
            inputs_embeds=inputs_embeds, use_cache=use_cache, output_attentions=output_attentions,
            output_hidden_states=output_hidden_states, indexer_loss=indexer_loss, ple_input_ids=ple_input_ids,
            output_router_logits=output_router_logits,
        )
        return self.language_model_output(outputs, labels, logits_to_keep, attention_mask, **kwargs)


class HybridIndexPoolForSequenceClassification(HybridIndexPoolPreTrainedModel):
    """HybridIndexPool with a classification head on the last non-padding token (the transformers convention)."""

    def __init__(self, config: HybridIndexPoolConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = HybridIndexPoolModel(config)
        self.score = HybridIndexPoolLinear(config.hidden_size, config.num_labels, bias=False)
        self.post_init()

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: HybridIndexPoolCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        ple_input_ids: torch.LongTensor | None = None,
        output_router_logits: bool | None = None,
        **kwargs,
    ) -> HybridIndexPoolSequenceClassifierOutput:
        """Class logits `[batch, num_labels]` of the last real token of each row and, given `labels`, the loss (plus
        the load-balancing loss weighted by `config.router_aux_loss_coef`, with `output_router_logits`)."""
        outputs = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
            inputs_embeds=inputs_embeds, use_cache=use_cache, output_attentions=output_attentions,
            output_hidden_states=output_hidden_states, ple_input_ids=ple_input_ids,
            output_router_logits=output_router_logits,
        )
        logits = self.score(outputs.last_hidden_state)
        batch_size = logits.shape[0]
        if self.config.pad_token_id is None and batch_size != 1:
            raise ValueError("Cannot classify batches of more than one row without `config.pad_token_id`.")
        if self.config.pad_token_id is None or input_ids is None:
            last_real = torch.full((batch_size,), -1, device=logits.device)
        else:
            # The rightmost non-pad token, for left and right padding alike.
            not_pad = (input_ids != self.config.pad_token_id).to(logits.device, torch.int32)
            columns = torch.arange(input_ids.shape[-1], device=logits.device, dtype=torch.int32)
            last_real = (columns * not_pad).argmax(-1)
        pooled_logits = logits[torch.arange(batch_size, device=logits.device), last_real]
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, pooled_logits=pooled_logits, config=self.config)
        aux_loss = self.router_aux_loss(outputs.router_logits, attention_mask)
        if aux_loss is not None and loss is not None:
            loss = loss + self.config.router_aux_loss_coef * aux_loss.to(loss.device)
        return HybridIndexPoolSequenceClassifierOutput(
            loss=loss, logits=pooled_logits, cache=outputs.cache, hidden_states=outputs.hidden_states,
            attentions=outputs.attentions, aux_loss=aux_loss, router_logits=outputs.router_logits,
        )


__all__ = [
    "HybridIndexPoolGenerationMixin",
    "HybridIndexPoolPreTrainedModel",
    "HybridIndexPoolModel",
    "HybridIndexPoolForCausalLM",
    "HybridIndexPoolForSequenceClassification",
]
