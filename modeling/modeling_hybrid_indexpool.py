"""HybridIndexPool: a hybrid decoder of Gated DeltaNet linear attention and IndexPool sparse attention.

An IndexPool layer is gated GQA attention whose key/value set is chosen per query by a lightweight indexer. The
indexer keeps one pooled key per window of `r = index_pool_size` consecutive tokens (weighted pooling, then norm,
then RoPE at the window's first position), scores the complete windows a query may see, and the query attends to
the raw keys/values of its best `index_topk // r` windows plus its own open window (the tail).

This module assembles the model and its heads; each concept lives in a module of its own: `decoder_layer`,
`layers` (linear, norms, rotary), `linear_attention_gdn` / `linear_attention_kda` (with `delta_rule`), `indexer`,
`attention_indexpool` (the IndexPool forward) with its head shapes `attention_gqa` / `attention_mla`, `moe`,
`residual_streams` (hyper-connections), `per_layer_embedding`, `multi_token_prediction` (MTP layers), `inputs`
(validation, the token layout of a pass), `token_layout`, `outputs`, `losses`, `generation`, and the cache in
`cache_hybrid_indexpool` / `cache_layers`. docs/model.md walks through one forward.
"""

import math
import os
from functools import wraps

import torch
import transformers
from packaging import version
from torch import nn
from transformers import initialization as init
from transformers.modeling_layers import GenericForSequenceClassification
from transformers.modeling_utils import PreTrainedModel
from transformers.processing_utils import Unpack
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
    HybridIndexPoolKwargs,
    cache_for_forward,
    check_inputs,
    check_mtp_inputs,
    packed_sequences,
    token_layout,
)
from .layers import HybridIndexPoolLinear, HybridIndexPoolRMSNorm, HybridIndexPoolRotaryEmbedding
from .linear_attention_gdn import HybridIndexPoolGatedDeltaNet
from .linear_attention_kda import (
    HybridIndexPoolKimiForgetGate,
    HybridIndexPoolKimiRMSNormGated,
)
from .losses import causal_lm_output, router_aux_loss, wants_mtp_logits
from .moe import (
    HybridIndexPoolExperts,
    HybridIndexPoolGroupedTopkRouter,
    HybridIndexPoolSparseMoeBlock,
)
from .multi_token_prediction import MTP_CLASSES, HybridIndexPoolDeepSeekMTPLayer
from .outputs import HybridIndexPoolCausalLMOutput, HybridIndexPoolModelOutput, HybridIndexPoolSequenceClassifierOutput
from .per_layer_embedding import HybridIndexPoolNGramEmbedding, HybridIndexPoolPerLayerEmbedding
from .residual_streams import HybridIndexPoolHyperConnection, HybridIndexPoolSinkhornHyperConnection
from .token_layout import fill_padding
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


def prefill_in_chunks(decoder_pass, chunk_length: int | None, hidden_states: torch.Tensor,
                      attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None,
                      ple_input_ids: torch.Tensor | None) -> torch.Tensor:
    """`decoder_pass(hidden_states, attention_mask, position_ids, ple_input_ids)` over the input, or over consecutive
    pieces of `chunk_length` columns when it is longer: each piece continues the cache the previous one filled, so
    peak memory follows the cache (linear in the context), not a long prompt's activations. The pieces' outputs
    `[batch, piece, width]` are joined."""
    seq_len = hidden_states.shape[1]
    if chunk_length is None or seq_len <= chunk_length:
        return decoder_pass(hidden_states, attention_mask, position_ids, ple_input_ids)
    pieces = []
    for start in range(0, seq_len, chunk_length):
        end = min(start + chunk_length, seq_len)
        pieces.append(decoder_pass(
            hidden_states[:, start:end],
            None if attention_mask is None else attention_mask[:, : attention_mask.shape[1] - seq_len + end],
            None if position_ids is None else position_ids[..., start:end],
            None if ple_input_ids is None else ple_input_ids[:, start:end],
        ))
    return torch.cat(pieces, dim=1)


def records_indexer_losses(forward):
    """Ask transformers' output capture for the IndexPool layers' indexer losses whenever `indexer_loss` computes
    them (placed above `capture_outputs`)."""

    @wraps(forward)
    def wrapper(self, *args, **kwargs):
        if kwargs.get("indexer_loss") is not None:
            kwargs.setdefault("output_indexer_losses", True)
        return forward(self, *args, **kwargs)

    return wrapper


class HybridIndexPoolPreTrainedModel(PreTrainedModel):
    """Weight initialisation and the Hugging Face plumbing shared by the HybridIndexPool models."""

    config_class = HybridIndexPoolConfig
    config: HybridIndexPoolConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["HybridIndexPoolDecoderLayer", "HybridIndexPoolMTPDecoderLayer"]
    # The linear attentions' decay parameters stay float32 when the model is loaded in half precision; the model adds
    # the float32 parameters of GLM-5.3-Flash's variants it has (`HybridIndexPoolModel`).
    _keep_in_fp32_modules_strict = ["A_log", "dt_bias"]
    _skip_keys_device_placement = ["cache"]
    _supports_sdpa = True
    _is_stateful = True
    # Recorded from the layers by transformers' output capture (each when its `output_<name>` is asked for), all in
    # the input's layout: each decoder layer's input hidden states (and the final ones), attention weights over the mask
    # columns and its indexer's selection; the MoE blocks' router logits; the IndexPool attentions' indexer losses; the
    # MTP layers' outputs (a DeepSeek MTP layer's, or the Qwen4-Exp MTP's final mix at each depth).
    _can_record_outputs = {
        "hidden_states": OutputRecorder(HybridIndexPoolDecoderLayer, index=0),
        "attentions": OutputRecorder(HybridIndexPoolDecoderLayer, index=1),
        "indexer_selections": OutputRecorder(HybridIndexPoolDecoderLayer, index=2),
        "router_logits": OutputRecorder(HybridIndexPoolSparseMoeBlock, index=1),
        "indexer_losses": OutputRecorder(HybridIndexPoolAttentionBase, index=2),
        "mtp_hidden_states": [
            OutputRecorder(HybridIndexPoolDeepSeekMTPLayer, index=0),
            OutputRecorder(HybridIndexPoolHyperConnection, index=0, layer_name="mtp.hyper_connection_mixer"),
        ],
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

    @records_indexer_losses
    @capture_outputs
    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: HybridIndexPoolCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Unpack[HybridIndexPoolKwargs],
    ) -> HybridIndexPoolModelOutput:
        """Run the decoder.

        Args:
            input_ids: `[batch, seq]` token ids (or give `inputs_embeds` `[batch, seq, hidden]`, cast to the model's
                dtype).
            attention_mask: `[batch, past + seq]` with 1 for real tokens and 0 for padding (either side, or holes).
            position_ids: `[batch, seq]`; by default each row counts its real tokens from 0. Multimodal-RoPE
                positions `[streams, batch, seq]` are accepted for text, where every stream is the same; positions
                restarting at 0 inside a row mean packed sequences (training, without a cache).
            cache: a [`HybridIndexPoolCache`] to continue from and update (`past_key_values` is accepted too).
            use_cache: create a cache when none is given (default `config.use_cache`).
            kwargs: transformers' `output_attentions` (IndexPool layers' weights over the mask columns),
                `output_hidden_states`, `output_router_logits` (`[batch * seq, num_experts]` per MoE layer), and
                HybridIndexPool's ([`HybridIndexPoolKwargs`]): `indexer_loss`, `ple_input_ids`,
                `output_indexer_selections`, `output_mtp_hidden_states` and `output_mtp_inputs`.
        """
        config = self.config
        ple_input_ids = kwargs.pop("ple_input_ids", None)
        ple_input_ids = input_ids if ple_input_ids is None else ple_input_ids
        check_inputs(config, input_ids, inputs_embeds, kwargs.get("indexer_loss"), ple_input_ids)
        # Embeddings in another precision (float64 from a user's pipeline) are cast to the model's, as its own are (a
        # later pipeline stage has no embedding: it takes the states the stage before handed it).
        embedding_weight = getattr(self.embed_tokens, "weight", None)
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        elif embedding_weight is not None:
            inputs_embeds = inputs_embeds.to(embedding_weight.dtype)
        seq_len = inputs_embeds.shape[1]
        # Gradient checkpointing recomputes layers, which would update a cache twice.
        recomputing = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        cache, use_cache = cache_for_forward(config, cache, use_cache, recomputing, inputs_embeds.shape[0],
                                             packed_sequences(position_ids, attention_mask, seq_len))
        output_mtp_inputs = kwargs.pop("output_mtp_inputs", False)
        output_mtp_hidden_states = kwargs.get("output_mtp_hidden_states", False)
        if output_mtp_hidden_states or output_mtp_inputs:
            check_mtp_inputs(config, cache if output_mtp_hidden_states else None)
        kwargs["output_attentions"] = bool(kwargs.get("output_attentions", config.output_attentions))

        hidden_states = inputs_embeds
        if config.has_hyper_connections:
            hidden_states = hidden_states.repeat(1, 1, config.hc_count)  # every stream starts as the embedding
        recording = any(kwargs.get(f"output_{name}", getattr(config, f"output_{name}", False))
                        for name in self._can_record_outputs if name != "mtp_hidden_states")
        # With a cache and nothing recorded from the layers, a long prompt goes through the stack a chunk at a time.
        chunk = None if cache is None or recording or kwargs.get("indexer_loss") else config.prefill_chunk_length

        def decoder_pass(hidden_states, attention_mask, position_ids, ple_input_ids):
            return self.decoder_pass(hidden_states, attention_mask, position_ids, ple_input_ids, cache, **kwargs)

        streams = prefill_in_chunks(decoder_pass, chunk, hidden_states, attention_mask, position_ids, ple_input_ids)
        hidden_states = self.final_norm(streams)
        if attention_mask is not None and seq_len > 1:
            # A padding token's output is the last real token's before it: logits[:, -1] are every row's next token.
            token_is_real = attention_mask[:, -seq_len:].to(device=hidden_states.device, dtype=torch.bool)
            hidden_states, streams = fill_padding(hidden_states, token_is_real), fill_padding(streams, token_is_real)
        mtp_inputs = streams if self.mtp is not None and self.mtp.reads_residual_streams else hidden_states
        if output_mtp_hidden_states:
            tokens = token_layout(config, self.rotary_emb.num_streams, inputs_embeds, attention_mask, position_ids,
                                  ple_input_ids, None)
            self.mtp(mtp_inputs, inputs_embeds, self.position_embeddings(inputs_embeds, tokens), tokens, cache)
        return HybridIndexPoolModelOutput(last_hidden_state=hidden_states, cache=cache if use_cache else None,
                                          mtp_inputs=mtp_inputs if output_mtp_inputs else None)

    def position_embeddings(self, hidden_states: torch.Tensor, tokens) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary `(cos, sin)` `[rows, width, rotary_dim]` of a pass's grid (text positions, or the multimodal
        streams)."""
        positions = tokens.rope_positions
        return self.rotary_emb(hidden_states, positions[0] if len(positions) == 1 else positions)

    def decoder_pass(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None,
                     position_ids: torch.Tensor | None, ple_input_ids: torch.Tensor | None,
                     cache: HybridIndexPoolCache | None, **kwargs) -> torch.Tensor:
        """One pass of the decoder layers over `hidden_states [batch, seq, hc_count * hidden]` (a whole input or a
        prefill chunk): the token layout once, then every layer, a full IndexPool layer handing its selection to the
        shared-indexer layers after it. Returns the residual streams after the last layer, before the final norm."""
        tokens = token_layout(self.config, self.rotary_emb.num_streams, hidden_states, attention_mask, position_ids,
                              ple_input_ids, cache, kwargs.get("output_attentions", False))
        position_embeddings = self.position_embeddings(hidden_states, tokens)
        selection = None
        for decoder_layer in self.layers:
            if not isinstance(decoder_layer, HybridIndexPoolDecoderLayer):
                continue  # another pipeline stage runs this layer (transformers' pipeline parallelism left a stub)
            hidden_states, _, layer_selection = decoder_layer(hidden_states, position_embeddings, tokens, cache=cache,
                                                              shared_selection=selection, **kwargs)
            if decoder_layer.selects_windows:
                selection = layer_selection
        return hidden_states

    def final_norm(self, streams: torch.Tensor) -> torch.Tensor:
        """The final normed hidden states `[batch, seq, hidden]` of the residual streams after the last layer."""
        if self.config.hc_type == "sinkhorn":
            return self.norm(HybridIndexPoolSinkhornHyperConnection.collapse(streams, self.config.hc_count))
        if self.config.hc_count > 1:
            return self.hyper_connection_mixer(streams)[0]
        return self.norm(streams)


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

    @can_return_tuple
    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: HybridIndexPoolCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[HybridIndexPoolKwargs],
    ) -> HybridIndexPoolCausalLMOutput:
        """Next-token logits (of the last `logits_to_keep` positions when non-zero) and, given `labels`, the loss.

        With `indexer_loss` (`"dense"` or `"sparse"`, see [`HybridIndexPoolKwargs`]) the output also carries
        `indexer_loss`, and `loss` adds it weighted by `config.indexer_loss_weight`. With `output_router_logits`
        (default `config.output_router_logits`) a MoE model also returns `router_logits` and the load-balancing
        `aux_loss`, which `loss` adds weighted by `config.router_aux_loss_coef`. With `output_mtp_logits` (default:
        with labels, when `config.mtp_loss_weight > 0`) a model with MTP layers also returns `mtp_logits`, one `[batch,
        seq, vocab]` per depth `k` whose position `i` predicts the token at `i + k + 2`, and with labels `mtp_loss`,
        which `loss` adds weighted by `config.mtp_loss_weight`. With `output_mtp_inputs` it also returns `mtp_inputs`,
        what the MTP layers read (`generate(use_mtp=True)` asks for them).
        """
        mtp_logits = wants_mtp_logits(self.config, kwargs.pop("output_mtp_logits", None), labels)
        kwargs["output_mtp_hidden_states"] = mtp_logits or kwargs.get("output_mtp_hidden_states", False)
        if kwargs.get("output_router_logits") is None:  # the config's default, as transformers' MoE heads take it
            kwargs["output_router_logits"] = self.config.output_router_logits
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             cache=cache, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
        return causal_lm_output(self, outputs, labels, logits_to_keep, attention_mask, mtp_logits, **kwargs)


class HybridIndexPoolForSequenceClassification(GenericForSequenceClassification, HybridIndexPoolPreTrainedModel):
    """HybridIndexPool with transformers' classification head on the last non-padding token, plus the MoE
    load-balancing loss (weighted by `config.router_aux_loss_coef`) when router logits are asked for."""

    def __init__(self, config: HybridIndexPoolConfig):
        # The text model is built here rather than through AutoModel, which a checkpoint loaded as remote code lacks.
        HybridIndexPoolPreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.model = HybridIndexPoolModel(config)
        self.score = HybridIndexPoolLinear(config.hidden_size, config.num_labels, bias=False)
        self.post_init()

    @can_return_tuple
    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: HybridIndexPoolCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Unpack[HybridIndexPoolKwargs],
    ) -> HybridIndexPoolSequenceClassifierOutput:
        """`GenericForSequenceClassification.forward`: class logits `[batch, num_labels]` of the last real token of
        each row and, given `labels`, the loss; plus `router_logits` and their load-balancing `aux_loss` (added to the
        loss) with `output_router_logits` (default `config.output_router_logits`)."""
        if kwargs.get("output_router_logits") is None:  # the config's default, as transformers' MoE heads take it
            kwargs["output_router_logits"] = self.config.output_router_logits
        base_outputs = []  # the text model's output, which the generic head keeps only in part
        hook = self.model.register_forward_hook(lambda module, args, output: base_outputs.append(output))
        try:
            output = super().forward(input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                                     inputs_embeds=inputs_embeds, labels=labels, use_cache=use_cache, **kwargs)
        finally:
            hook.remove()
        router_logits = base_outputs[-1].router_logits or None
        aux_loss = router_aux_loss(self.config, router_logits, attention_mask)
        loss = output.loss
        if aux_loss is not None and loss is not None:
            loss = loss + self.config.router_aux_loss_coef * aux_loss.to(loss.device)
        return HybridIndexPoolSequenceClassifierOutput(
            loss=loss, logits=output.logits, cache=output.cache, hidden_states=output.hidden_states,
            attentions=output.attentions, aux_loss=aux_loss, router_logits=router_logits,
        )


__all__ = [
    "HybridIndexPoolGenerationMixin",
    "HybridIndexPoolPreTrainedModel",
    "HybridIndexPoolModel",
    "HybridIndexPoolForCausalLM",
    "HybridIndexPoolForSequenceClassification",
]
