"""What the HybridIndexPool language-model heads share for `generate()`, and what the rollback recording of its
verify forwards holds (`recording_bytes`)."""

import torch
from transformers.generation import GenerationMixin
from transformers.utils import logging

from .cache_hybrid_indexpool import HybridIndexPoolCache
from .mtp_drafting import HybridIndexPoolMTPCandidateGenerator

logger = logging.get_logger(__name__)


def recording_bytes(config, recorded_tokens: int, dtype: torch.dtype = torch.bfloat16, batch_size: int = 1,
                    rope_streams: int = 1) -> list[int]:
    """Bytes each layer's recording holds (the cache's `memory_footprint(layer_idx)["rollback"]`) after a forward of
    `recorded_tokens` tokens over a cache that holds earlier ones: a verify forward of `k` drafts and the token before
    them, after `activate_past_recording(recurrent_states_to_keep=k)` or the crop of the previous one. By formula, for a
    model in `dtype` (rotary positions in `rope_streams` streams: 3 for a multimodal model's); one entry per layer.
    What each layer type records is described by `LinearAttentionLayerCache` and `IndexPoolLayerCache._record` (an
    IndexPool layer's keys and values are stored by position anyway: a crop only lowers its lengths; its recording
    holds the indexer's raw keys, gate logits and rotary positions of the recorded tokens and the r - 1 before them)."""
    element = torch.empty((), dtype=dtype).element_size()
    tokens, float32, int64, mask = recorded_tokens, 4, 8, 1
    kimi = config.linear_attention_type == "kimi_delta"
    key_heads, key_dim = config.linear_num_key_heads, config.linear_key_head_dim
    value_heads, value_dim = config.linear_num_value_heads, config.linear_value_head_dim
    conv_channels = 2 * key_heads * key_dim + value_heads * value_dim
    conv_element = float32 if kimi else element  # KDA convolves in float32
    decay_width = value_heads * (key_dim if kimi else 1)  # KDA decays per key channel
    beta_element = float32 if kimi else element
    linear_checkpoint = value_heads * key_dim * value_dim * float32 + conv_channels * (
        config.linear_conv_kernel_dim - 1) * conv_element
    linear_per_token = (conv_channels * element + decay_width * float32 + value_heads * beta_element
                        + conv_channels * conv_element + mask)
    ple_history = (config.ple_conv_kernel_size - 1) * config.ple_ngram_size
    ple_width = config.hc_count * config.hidden_size
    ple_checkpoint = (config.ple_ngram_size - 1) * int64 + ple_width * ple_history * element
    ple_per_token = int64 + ple_width * element + 2 * mask
    gate_width = {"learned": config.index_head_dim, "learned_scalar": 1}.get(config.index_pool_weighting, 0)
    index_entry = config.index_head_dim * element + gate_width * float32 + rope_streams * int64
    index_masks = (3 if gate_width else 2) * mask  # each recorded window's (keys, gate logits, positions)
    indexer_types = config.indexer_types or ["full"] * len(config.layer_types)
    sizes = []
    for layer, layer_type in enumerate(config.layer_types):
        if layer_type == "linear_attention":
            size = linear_checkpoint + tokens * linear_per_token
            if layer in config.ple_layers:
                size += ple_checkpoint + tokens * ple_per_token
        elif config.index_pool_size > 1 and indexer_types[layer] != "shared":
            size = (config.index_pool_size - 1 + tokens) * index_entry + tokens * index_masks
        else:
            size = 0
        sizes.append(batch_size * size)
    return sizes


class HybridIndexPoolGenerationMixin(GenerationMixin):
    """What `generate()` needs to know about this model family: its cache (reserved once for the call), drafting with
    the MTP layers, positions counted by the model itself, and the 2-D padding mask passed through to a (possibly
    compiled) decode step."""

    def _prepare_generation_config(self, generation_config, **kwargs):
        """transformers' preparation, plus the MTP draft depth: `generate(use_mtp=True)` drafts
        `num_assistant_tokens` tokens per verify forward when the call (or a generation config) sets it, else one per
        MTP layer (`num_mtp_layers`), instead of transformers' default of 20."""
        explicit = kwargs.get("num_assistant_tokens") is not None or any(
            config is not None and config.num_assistant_tokens is not None
            for config in (generation_config, self.generation_config))
        generation_config, model_kwargs = super()._prepare_generation_config(generation_config, **kwargs)
        if generation_config.use_mtp and not explicit:
            generation_config.num_assistant_tokens = self.config.get_text_config().num_mtp_layers
        return generation_config, model_kwargs

    def _get_candidate_generator(self, generation_config, *args, **kwargs):
        """With `use_mtp=True`, a [`HybridIndexPoolMTPCandidateGenerator`]: transformers' own MTP drafting builds a
        copy of the MTP layers from known layer patterns, which ours are not. Refused in one line for a model without
        MTP layers, a multimodal model and a draft depth below 1; prompt lookup's own settings below 1 are refused
        naming the argument (transformers' message names neither)."""
        prompt_lookup = (("prompt_lookup_num_tokens", "tokens prompt lookup drafts per verify forward"),
                         ("max_matching_ngram_size", "longest n-gram prompt lookup matches (default 2)"))
        for name, meaning in prompt_lookup if generation_config.prompt_lookup_num_tokens is not None else ():
            value = getattr(generation_config, name)
            if value is not None and not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name} is {value!r}: the {meaning}; give 1 or more (or leave prompt lookup's "
                                 "arguments out to decode without drafting).")
        if not generation_config.use_mtp:
            return super()._get_candidate_generator(generation_config, *args, **kwargs)
        text_config = self.config.get_text_config()
        if not text_config.num_mtp_layers:
            raise ValueError(
                "generate(use_mtp=True) drafts with the model's multi-token-prediction layers, but this model has "
                "none (num_mtp_layers is 0); train some with scripts/train_mtp.py (docs/multi_token_prediction.md), "
                "or draft with prompt_lookup_num_tokens or assistant_model."
            )
        if hasattr(self.config, "vision_config"):
            raise ValueError(
                "generate(use_mtp=True) drafts for the text-only HybridIndexPoolForCausalLM; generate without use_mtp "
                "here, or load the text model alone for MTP drafting."
            )
        if generation_config.num_assistant_tokens is None or generation_config.num_assistant_tokens < 1:
            raise ValueError(
                f"num_assistant_tokens is {generation_config.num_assistant_tokens!r}: with use_mtp=True it is the "
                "number of tokens the MTP layers draft per verify forward; give 1 or more (or leave it out for one "
                "per MTP layer)."
            )
        generator = HybridIndexPoolMTPCandidateGenerator(self, generation_config, kwargs.get("logits_processor"))
        # The counters of the last MTP-drafting generate() stay readable here (its cache is dropped at the end).
        self.last_mtp_candidate_generator = generator
        return generator

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
        if generation_config.is_assistant:  # a draft model: its drafts are rolled back (as transformers' own caches)
            model_kwargs["cache"].activate_past_recording(
                recurrent_states_to_keep=generation_config.num_assistant_tokens)

    def _assisted_decoding(self, input_ids, *args, **model_kwargs):
        """transformers' assisted decoding (`prompt_lookup_num_tokens`, `assistant_model`, `use_mtp`), refusing a
        batch up front and leaving a returned cache recording nothing: a further plain decode then records nothing it
        never crops (generate() turns recording on, with `activate_past_recording`, for the verify forwards)."""
        if input_ids.shape[0] > 1:
            raise ValueError(
                f"Assisted decoding (prompt_lookup_num_tokens, assistant_model, use_mtp) verifies one sequence at a "
                f"time in "
                f"transformers, but the input has {input_ids.shape[0]} rows; call generate() once per row, or drop "
                "the drafting arguments to decode the batch together."
            )
        try:
            output = super()._assisted_decoding(input_ids, *args, **model_kwargs)
        finally:
            generator = getattr(self, "last_mtp_candidate_generator", None)
            if generator is not None:
                generator.release()
        cache = model_kwargs.get("cache")
        if isinstance(cache, HybridIndexPoolCache):
            cache.crop(0)  # keeps every token for good and forgets the recording
            for layer in cache.layers:  # what transformers does to a cache it hands back
                layer.record_past = False
        return output

    def _prepare_position_ids_for_generation(self, inputs_tensor, model_kwargs):
        """None: the model counts each row's real tokens itself, from the attention mask and the cache, which
        `generate()`'s own positions get wrong for right-padded rows once decoding starts."""
        return None

    def prepare_inputs_for_generation(self, input_ids, next_sequence_length=None, cache=None, attention_mask=None,
                                      inputs_embeds=None, is_first_iteration=False, **kwargs):
        """transformers' inputs, where a first forward continuing a given cache feeds only the tokens that cache lacks:
        plain decoding's prefill slices them off, assisted decoding's first verify forward does not (it would feed
        the whole sequence again)."""
        if (is_first_iteration and next_sequence_length is None and isinstance(cache, HybridIndexPoolCache)
                and cache.get_seq_length() > 0 and inputs_embeds is None):
            next_sequence_length = input_ids.shape[1] - cache.get_seq_length()
        model_inputs = super().prepare_inputs_for_generation(
            input_ids, next_sequence_length=next_sequence_length, cache=cache, attention_mask=attention_mask,
            inputs_embeds=inputs_embeds, is_first_iteration=is_first_iteration, **kwargs,
        )
        cache, attention_mask = model_inputs.get("cache"), model_inputs.get("attention_mask")
        recording = isinstance(cache, HybridIndexPoolCache) and cache.is_recording_past(0)
        if recording and next_sequence_length is not None and next_sequence_length > 1:
            # A verify forward, right after the crop of the last one (nothing recorded): transformers' heuristic
            # schedule may have grown its drafts beyond what recording was activated for.
            keep = cache.get_recurrent_states_to_keep(0)
            if keep is not None and keep < next_sequence_length - 1:
                cache.activate_past_recording(recurrent_states_to_keep=next_sequence_length - 1)
        if isinstance(cache, HybridIndexPoolCache) and cache.is_compileable and attention_mask is not None:
            # A decode step reads only the new tokens' columns of the growing 2-D mask, so a compiled step serves
            # every length: say so up front instead of recompiling once the length changes.
            torch._dynamo.maybe_mark_dynamic(attention_mask, 1)
        return model_inputs

    @staticmethod
    def create_masks_for_generate(config, inputs_embeds, attention_mask, cache, **kwargs):
        """The layers build their own selections from the 2-D padding mask: `generate()` passes it through."""
        return attention_mask

    def _valid_auto_compile_criteria(self, model_kwargs, generation_config) -> bool:
        """transformers' criteria, saying why a `compile_config` is not used while drafting: the verify forwards
        record what a crop replays (host-side lists of per-forward tensors) and vary in width, so they run eagerly;
        a plain decode (no drafting) compiles."""
        cache = model_kwargs.get("cache")
        recording = isinstance(cache, HybridIndexPoolCache) and any(layer.record_past for layer in cache.layers)
        if recording and generation_config.compile_config is not None:
            logger.warning(
                "compile_config is not used while drafting (prompt_lookup_num_tokens, assistant_model, use_mtp): the "
                "verify forwards record what a rollback replays and vary in width, so they run eagerly; generate "
                "without drafting to decode compiled."
            )
        return super()._valid_auto_compile_criteria(model_kwargs, generation_config)
