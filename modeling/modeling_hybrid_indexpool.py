"""HybridIndexPool: a hybrid decoder of Gated DeltaNet linear attention and IndexPool sparse attention.

An IndexPool layer is gated GQA attention whose key/value set is chosen per query by a lightweight indexer. The
indexer keeps one pooled key per window of `r = index_pool_size` consecutive tokens (weighted pooling, then norm,
then RoPE at the window's first position), scores the complete windows a query may see, and the query attends to
the raw keys/values of its best `index_topk // r` windows plus its own open window (the tail).

This module assembles the model and its heads; each concept lives in a module of its own: `decoder_layer`,
`layers` (linear, norms, rotary), `linear_attention_gdn` / `linear_attention_kda`, `indexer`, `attention_indexpool`
(the IndexPool forward) with its head shapes `attention_gqa` / `attention_mla`, `moe`, `residual_streams`
(hyper-connections), `per_layer_embedding`, `multi_token_prediction` (MTP layers), `inputs` (validation, positions,
token layout), `outputs`, `generation`, and the cache in `cache_hybrid_indexpool`.
"""

import math
import os

import torch
import transformers
from packaging import version
from torch import nn
from transformers import initialization as init
from transformers.modeling_utils import PreTrainedModel
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import can_return_tuple
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from ..configuration.configuration_hybrid_indexpool import HybridIndexPoolConfig
from .attention_indexpool import HybridIndexPoolAttentionBase
from .cache_hybrid_indexpool import HybridIndexPoolCache
from .decoder_layer import HybridIndexPoolDecoderLayer
from .generation import HybridIndexPoolGenerationMixin
from .hub_export import auto_map_for, write_model_card, write_remote_code
from .indexer import HybridIndexPoolIndexer
from .inputs import (
    LayerStep,
    attention_by_column,
    check_cache,
    check_inputs,
    check_mtp_inputs,
    columns_of_positions,
    gather_pieces,
    joined,
    prepare_inputs,
)
from .layers import HybridIndexPoolLinear, HybridIndexPoolRMSNorm, HybridIndexPoolRotaryEmbedding
from .linear_attention_gdn import HybridIndexPoolGatedDeltaNet
from .linear_attention_kda import (
    HybridIndexPoolKimiForgetGate,
    HybridIndexPoolKimiRMSNormGated,
)
from .moe import (
    HybridIndexPoolExperts,
    HybridIndexPoolGroupedTopkRouter,
    HybridIndexPoolSparseMoeBlock,
    load_balancing_loss,
)
from .multi_token_prediction import MTP_CLASSES
from .outputs import HybridIndexPoolCausalLMOutput, HybridIndexPoolModelOutput, HybridIndexPoolSequenceClassifierOutput
from .per_layer_embedding import HybridIndexPoolNGramEmbedding, HybridIndexPoolPerLayerEmbedding
from .residual_streams import HybridIndexPoolHyperConnection, HybridIndexPoolSinkhornHyperConnection
from .tokenizer_fit import warn_if_tokenizer_does_not_fit

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
    # Recorded from the layers by transformers' output capture (only when asked): the IndexPool attentions' weights
    # and the MoE blocks' router logits, each the second output of its module.
    _can_record_outputs = {
        "attentions": OutputRecorder(HybridIndexPoolAttentionBase, index=1),
        "router_logits": OutputRecorder(HybridIndexPoolSparseMoeBlock, index=1),
    }

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
        in the config, and a `README.md` model card (a card the user wrote is never replaced); warns when a tokenizer
        already saved in the folder does not fit the model's `vocab_size`.

        The code and card are written first, so that `push_to_hub=True` uploads them with the weights.
        """
        if kwargs.get("is_main_process", True):
            os.makedirs(save_directory, exist_ok=True)
            write_remote_code(save_directory, multimodal=hasattr(self.config, "vision_config"))
            write_model_card(self, save_directory)
        self.config.auto_map = auto_map_for(self.config)
        saved = super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            warn_if_tokenizer_does_not_fit(self.config.get_text_config().vocab_size, save_directory)
        return saved

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """transformers' `from_pretrained`, plus a warning when the folder's tokenizer does not fit the model's
        `vocab_size` (ids without an embedding, or many ids that decode to nothing)."""
        loaded = super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded  # with output_loading_info
        if pretrained_model_name_or_path is not None and os.path.isdir(pretrained_model_name_or_path):
            warn_if_tokenizer_does_not_fit(model.config.get_text_config().vocab_size, pretrained_model_name_or_path)
        return loaded

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
            # The scale starts at 1: a zero weight when zero-centred (scale 1 + weight), else a unit weight.
            (init.zeros_ if module.unit_offset else init.ones_)(module.weight)
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
            self.norm = HybridIndexPoolRMSNorm.from_config(config, config.hidden_size)
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
        self.mtp = MTP_CLASSES[config.mtp_type](config) if config.num_mtp_layers else None
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
        output_mtp_hidden_states: bool = False,
        output_mtp_inputs: bool = False,
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
                over IndexPool layers) against the attention mass of every complete visible window, or of the
                selected ones; it trains only the indexer and pooling. `"dense"` also makes the attention dense.
            ple_input_ids: the token ids for the per-layer n-gram embeddings when `inputs_embeds` replace
                `input_ids` (models with `ple_layers` only).
            output_router_logits: also return each MoE layer's router logits `[batch * seq, num_experts]`, in
                the input's token order (default `config.output_router_logits`; None for a model without experts).
            output_mtp_hidden_states: also return the multi-token-prediction layers' outputs, one `[batch, seq,
                hidden]` per depth (models with `num_mtp_layers` only; the whole sequence in one forward, from an
                empty cache or none).
            output_mtp_inputs: also return what the MTP layers read at each new token, `mtp_inputs`: the final
                normed hidden states `[batch, seq, hidden]`, or for Qwen4-Exp's MTP the residual streams before the
                final mix `[batch, seq, hc_count * hidden]` (what drafting with the MTP layers feeds them; any forward,
                with or without a cache).
        """
        if indexer_loss not in (None, "dense", "sparse"):
            raise ValueError(f"indexer_loss is {indexer_loss!r}; use None, 'dense' or 'sparse'.")
        config = self.config
        output_attentions = bool(config.output_attentions if output_attentions is None else output_attentions)
        output_hidden_states = bool(config.output_hidden_states if output_hidden_states is None
                                    else output_hidden_states)
        output_router_logits = bool(config.output_router_logits if output_router_logits is None
                                    else output_router_logits)
        check_inputs(config, input_ids, inputs_embeds)
        if config.ple_layers and (ple_input_ids := input_ids if ple_input_ids is None else ple_input_ids) is None:
            raise ValueError(
                "This model has per-layer n-gram embeddings (`ple_layers`), which need the token ids: with "
                "`inputs_embeds`, also pass `ple_input_ids` [batch, seq]."
            )
        inputs_embeds = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        use_cache_asked, use_cache = use_cache, config.use_cache if use_cache is None else use_cache
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            use_cache, cache = False, None  # the recomputation would update a cache twice
        check_cache(config, cache, inputs_embeds.shape[0])
        if output_mtp_hidden_states:
            check_mtp_inputs(config, cache)
        inputs = prepare_inputs(self, inputs_embeds, attention_mask, position_ids, cache, use_cache, use_cache_asked,
                                output_attentions, indexer_loss, ple_input_ids)
        hidden_states = inputs.inputs_embeds
        if config.has_hyper_connections:
            hidden_states = hidden_states.repeat(1, 1, config.hc_count)  # every stream starts as the embedding
        # A long prompt goes through the whole stack a chunk at a time: every layer keeps its state in the cache,
        # so peak memory follows the cache (linear in the context), not the prompt's activations.
        grid_length, chunk = hidden_states.shape[1], config.prefill_chunk_length
        if inputs.cache is None or chunk is None or grid_length <= chunk or output_attentions or indexer_loss:
            chunk = grid_length
        # In one piece, the layers record their input hidden states in the input's layout and continue from those,
        # so the returned states are tensors the output was computed from (their gradients can be retained).
        record_layout = inputs.layout if chunk == grid_length else None
        steps = [inputs.step.chunk(start, start + chunk) for start in range(0, grid_length, chunk)]
        if output_mtp_inputs and self.mtp is None:
            check_mtp_inputs(config, None)
        keep_streams = (output_mtp_hidden_states or output_mtp_inputs) and self.mtp.reads_residual_streams
        pieces = [self._run_layers(hidden_states[:, start:start + chunk], step, inputs.cache, record_layout,
                                   output_hidden_states=output_hidden_states, keep_final_streams=keep_streams,
                                   output_attentions=output_attentions, output_router_logits=output_router_logits)
                  for start, step in zip(range(0, grid_length, chunk), steps)]
        if output_mtp_hidden_states:  # on the grid, from the whole pass
            mtp_inputs = joined([step.final_streams for step in steps] if keep_streams else [
                piece.last_hidden_state for piece in pieces])
            mtp_hidden_states = self.mtp(mtp_inputs, inputs.inputs_embeds,
                                         self._position_embeddings(mtp_inputs, inputs.step), inputs.step)
        output = gather_pieces(pieces, inputs.layout, record_layout)
        if output_mtp_inputs:
            output.mtp_inputs = output.last_hidden_state
            if keep_streams:
                streams = joined([step.final_streams for step in steps])
                output.mtp_inputs = streams if inputs.layout is None else inputs.layout.from_grid(streams)
        if output_mtp_hidden_states:
            output.mtp_hidden_states = tuple(states if inputs.layout is None else inputs.layout.from_grid(states)
                                             for states in mtp_hidden_states)
        if output.attentions is not None:
            columns = columns_of_positions(attention_mask, inputs.layout, inputs_embeds.shape[0], inputs.kv_length,
                                           inputs_embeds.device)
            output.attentions = tuple(attention_by_column(weights, columns, inputs.kv_length)
                                      for weights in output.attentions)
        output.cache = inputs.cache if inputs.use_cache else None
        return output

    def _position_embeddings(self, hidden_states, step: LayerStep) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary `(cos, sin)` of a pass's positions (text positions, or the multimodal streams)."""
        return self.rotary_emb(hidden_states, step.rope_positions[0] if len(step.rope_positions) == 1
                               else step.rope_positions)

    @capture_outputs
    def _run_layers(self, hidden_states, step: LayerStep, cache, record_layout, output_hidden_states=False,
                    keep_final_streams=False, **kwargs) -> "HybridIndexPoolModelOutput":
        """One pass of the stack over a piece of the input: final normed states, per-layer states (recorded in the
        input's layout with `record_layout`; the final ones stay on the grid) and the indexer loss; attention
        weights and router logits `[rows, seq, num_experts]` are captured from the layers (`_can_record_outputs`).
        With `keep_final_streams`, `step.final_streams` keeps the residual streams before the final mix (on the
        grid), which Qwen4-Exp's MTP reads."""
        position_embeddings = self._position_embeddings(hidden_states, step)
        all_hidden_states = ()
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
            hidden_states = decoder_layer(hidden_states, position_embeddings, step, cache=cache)
        if keep_final_streams:
            step.final_streams = hidden_states
        if self.config.hc_type == "sinkhorn":
            hidden_states = self.norm(HybridIndexPoolSinkhornHyperConnection.collapse(hidden_states,
                                                                                      self.config.hc_count))
        elif self.config.hc_count > 1:
            hidden_states = self.hyper_connection_mixer(hidden_states)[0]
        else:
            hidden_states = self.norm(hidden_states)
        if output_hidden_states:
            all_hidden_states += (hidden_states if record_layout is None else record_layout.from_grid(hidden_states),)
        losses = list(step.indexer_losses.values())
        return HybridIndexPoolModelOutput(last_hidden_state=hidden_states, hidden_states=all_hidden_states or None,
                                          indexer_loss=torch.stack(losses).mean() if losses else None)


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
        output_mtp_logits: bool | None = None,
        output_mtp_inputs: bool = False,
        **kwargs,
    ) -> "HybridIndexPoolCausalLMOutput":
        """Next-token logits (of the last `logits_to_keep` positions when non-zero) and, given `labels`, the loss.

        With `indexer_loss` (`"dense"` or `"sparse"`, see [`HybridIndexPoolModel.forward`]) the output also carries
        `indexer_loss`, and `loss` adds it weighted by `config.indexer_loss_weight`. With `output_router_logits`
        (default `config.output_router_logits`) a MoE model also returns `router_logits` and the load-balancing
        `aux_loss`, which `loss` adds weighted by `config.router_aux_loss_coef`. With `output_mtp_logits` (default:
        with labels, when `config.mtp_loss_weight > 0`) a model with MTP layers also returns `mtp_logits`, one `[batch,
        seq, vocab]` per depth `k` whose position `i` predicts the token at `i + k + 2`, and with labels `mtp_loss`,
        which `loss` adds weighted by `config.mtp_loss_weight`. With `output_mtp_inputs` it also returns `mtp_inputs`,
        what the MTP layers read (see [`HybridIndexPoolModel.forward`]; `generate(use_mtp=True)` asks for them).
        """
        outputs = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
            inputs_embeds=inputs_embeds, use_cache=use_cache, output_attentions=output_attentions,
            output_hidden_states=output_hidden_states, indexer_loss=indexer_loss, ple_input_ids=ple_input_ids,
            output_router_logits=output_router_logits,
            output_mtp_hidden_states=self.wants_mtp_logits(output_mtp_logits, labels),
            output_mtp_inputs=output_mtp_inputs,
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
