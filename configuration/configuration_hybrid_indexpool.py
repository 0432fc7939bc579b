"""Configuration of the HybridIndexPool model: Gated DeltaNet layers interleaved with IndexPool sparse attention."""

import dataclasses
import difflib
import warnings
from typing import ClassVar

from huggingface_hub.dataclasses import strict
from transformers import AutoConfig, configuration_utils
from transformers.configuration_utils import PreTrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, RopeParameters

try:
    from transformers.configuration_utils import SubConfigSpec
except ImportError:  # transformers < 5.20 (vLLM's pin), where only the text config is needed (the vLLM plugin)
    SubConfigSpec = None

LAYER_TYPES = ("linear_attention", "indexpool_attention")
POOL_WEIGHTINGS = ("learned", "learned_scalar", "mean", "prenorm_mean")

# The settings `check_settings` validates, as data. Each choice field and the values it takes.
CHOICES = {
    "attention_type": ("gqa", "mla"),
    "index_pool_weighting": POOL_WEIGHTINGS,
    "index_key_cache_dtype": ("auto", "float8_e4m3fn"),
    "index_query_source": ("hidden", "q_lora"),
    "index_key_norm": ("rms_after_pool", "layer_norm_before_pool"),
    "linear_attention_type": ("gated_deltanet", "kimi_delta"),
    "linear_output_gate_act": ("silu", "sigmoid"),
    "moe_router_type": ("softmax", "sigmoid_grouped"),
    "hc_type": ("qwen4_exp", "sinkhorn"),
    "mtp_type": ("deepseek", "qwen3_next", "qwen4_exp"),
}
# Per-layer lists (None: their default), one entry per layer, and the values of an entry.
LAYER_CHOICES = {
    "layer_types": LAYER_TYPES,
    "mlp_layer_types": ("dense", "sparse"),
    "indexer_types": ("full", "shared"),
}
# Numeric fields and the interval they lie in; those in NULLABLE may also be None (off).
NULLABLE = ("prefill_chunk_length", "swiglu_limit", "linear_gate_lower_bound")
POSITIVE = "[1, inf)"
RANGES = {
    **dict.fromkeys(
        ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
         "index_n_heads", "index_head_dim", "index_pool_size", "index_topk", "linear_num_key_heads",
         "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
         "max_position_embeddings", "prefill_chunk_length", "hc_count", "hc_lowrank", "ple_conv_kernel_size",
         "ple_ngram_vocab_size_base", "ple_vocab_size_multiple", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
         "v_head_dim", "hc_sinkhorn_iters", "n_group", "topk_group"), POSITIVE),
    **dict.fromkeys(("index_sink_windows", "index_local_windows", "num_experts", "router_aux_loss_coef", "hc_eps",
                     "num_mtp_layers", "mtp_loss_weight"), "[0, inf)"),
    "partial_rotary_factor": "(0, 1]",
    "attention_dropout": "[0, 1)",
    "swiglu_limit": "(0, inf)",
    "routed_scaling_factor": "(0, inf)",
    "linear_gate_lower_bound": "(-inf, 0)",
    "qk_rope_head_dim": "[0, 0]",
}
# Fields only one variant reads: they are checked (and may not be None) only when it is chosen.
READ_WHEN = {
    **dict.fromkeys(("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "qk_rope_head_dim"),
                    ("attention_type", "mla")),
    **dict.fromkeys(("hc_sinkhorn_iters", "hc_eps"), ("hc_type", "sinkhorn")),
    **dict.fromkeys(("n_group", "topk_group", "routed_scaling_factor"), ("moe_router_type", "sigmoid_grouped")),
    "linear_gate_lower_bound": ("linear_attention_type", "kimi_delta"),
}
# Of those, the ones that must keep a neutral value when their variant is not chosen, with what the variant is.
VARIANT_ONLY = {
    ("moe_router_type", "sigmoid_grouped"): ("the 'sigmoid_grouped' router",
                                             {"n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0}),
    ("linear_attention_type", "kimi_delta"): ("Kimi Delta Attention's forget gate", {"linear_gate_lower_bound": None}),
}
# Fields that must be a multiple of another, and why.
MULTIPLES = {
    "num_attention_heads": ("num_key_value_heads", "each key/value head serves a whole group of query heads"),
    "linear_num_value_heads": ("linear_num_key_heads", "each key head serves a whole group of value heads"),
    "index_topk": ("index_pool_size", "the budget is spent in whole windows"),
}


def _in_interval(value, interval: str) -> bool:
    low, high = (float(bound) for bound in interval[1:-1].split(","))
    above = low <= value if interval[0] == "[" else low < value
    return above and (value <= high if interval[-1] == "]" else value < high)


def misspelled_fields(config_class, keys) -> dict[str, str | None]:
    """Each of `keys` that is not a field of the dataclass `config_class`, with the field it most resembles (`difflib`,
    similarity >= 0.85), or None when it resembles none; private keys (`_name`) are left out."""
    fields = [field.name for field in dataclasses.fields(config_class)]
    return {key: next(iter(difflib.get_close_matches(key, fields, n=1, cutoff=0.85)), None)
            for key in keys if key not in fields and not key.startswith("_")}


def warn_misspelled_fields(config_class, keys) -> None:
    """One warning for the `keys` a config was given that are not its fields but resemble one (a typo, which
    transformers would keep as an attribute nobody reads). Other unknown keys pass silently: checkpoints carry keys of
    other tools and versions."""
    resembling = {key: field for key, field in misspelled_fields(config_class, keys).items() if field is not None}
    if resembling:
        listed = "; ".join(f"`{key}` (did you mean `{field}`?)" for key, field in resembling.items())
        warnings.warn(f"{config_class.__name__}: {listed} is not a setting of the model and is ignored; use the "
                      "field's name.", UserWarning, stacklevel=5)  # the caller of the config class


def register_layer_type() -> None:
    """Add `"indexpool_attention"` to the layer types transformers accepts in any config.

    Tools that read a `config.json` through the base `PreTrainedConfig` (the Trainer does when it resumes from a
    checkpoint) validate `layer_types` against transformers' own list, which does not know ours. Like the Auto-class
    registration, this is done once when the configuration module is imported.
    """
    if "indexpool_attention" not in configuration_utils.ALLOWED_ATTN_LAYER_TYPES:
        configuration_utils.ALLOWED_ATTN_LAYER_TYPES += ("indexpool_attention",)
        configuration_utils.ALLOWED_LAYER_TYPES += ("indexpool_attention",)


register_layer_type()


@strict
class HybridIndexPoolConfig(PreTrainedConfig):
    r"""
    Configuration of a [`HybridIndexPoolModel`].

    The decoder interleaves Gated DeltaNet linear-attention layers (`"linear_attention"`) with IndexPool sparse
    attention layers (`"indexpool_attention"`). An IndexPool layer is gated GQA attention whose keys are chosen per
    query by a lightweight indexer; the indexer keeps one *pooled* key per window of `index_pool_size` consecutive
    tokens, so its cache is `1 / index_pool_size` of a per-token indexer's.

    Args:
        vocab_size (`int`): Vocabulary size.
        hidden_size (`int`): Width of the residual stream.
        intermediate_size (`int`): Inner width of the dense SwiGLU MLP (used when `num_experts == 0`).
        num_hidden_layers (`int`): Number of decoder layers.
        layer_types (`list[str]`, *optional*): Mixer of each layer, `"linear_attention"` or `"indexpool_attention"`.
            Defaults to three linear layers then one IndexPool layer, repeating.
        num_attention_heads (`int`): Query heads of the IndexPool attention.
        num_key_value_heads (`int`): Key/value heads of the IndexPool attention (GQA).
        head_dim (`int`): Width of one attention head.
        partial_rotary_factor (`float`): Fraction of each head (and of each indexer head) rotated by RoPE.
        rope_parameters (`dict`, *optional*): RoPE settings (`rope_type`, `rope_theta`, ...), as in transformers.
        attention_output_gate (`bool`): Multiply the attention output by `sigmoid(gate)`, the gate being a second
            half of the query projection (Qwen3-Next style).
        attention_bias (`bool`): Bias on the attention projections.
        attention_dropout (`float`): Dropout on the attention probabilities during training.
        attention_type (`str`): Shape of the IndexPool attention: `"gqa"` (gated GQA, the default) or `"mla"`
            (multi-head latent attention as in DeepSeek-V3 / GLM-5.3-Flash: the cache holds one normed latent of
            `kv_lora_rank` per token, expanded per head by `kv_b_proj`; decode steps absorb `kv_b_proj` into the
            query and the output and attend over the latents directly). MLA ignores `num_key_value_heads`,
            `head_dim` (except as the RoPE width of a RoPE indexer) and `attention_output_gate`.
        q_lora_rank (`int`, *optional*): MLA: width of the low-rank query latent (`q_a_proj`, `q_a_layernorm`).
        kv_lora_rank (`int`, *optional*): MLA: width of the key/value latent each token caches.
        qk_nope_head_dim (`int`, *optional*): MLA: query/key width per head without RoPE.
        qk_rope_head_dim (`int`): MLA: query/key width per head with RoPE; only 0 (NoPE, as GLM-5.3-Flash) is
            supported.
        v_head_dim (`int`, *optional*): MLA: value width per head.
        index_n_heads (`int`): Query heads of the indexer.
        index_head_dim (`int`): Width of one indexer head (and of the single shared indexer key).
        index_topk (`int`): Token budget B: each query attends to `index_topk // index_pool_size` selected windows
            plus the open tail of its own window. Must be a multiple of `index_pool_size`.
        index_pool_size (`int`): Tokens per pooled indexer key (r). `1` means no pooling (plain DSA).
        index_pool_weighting (`str`): `"learned"` (a softmax gate per channel over each window's tokens,
            initialised to the mean), `"learned_scalar"` (one gate logit per token, shared by the channels), `"mean"`
            (Qwen4-Exp's pooling) or `"prenorm_mean"` (each token's key normed, then averaged, no norm after).
        index_head_weights (`bool`): Weight the indexer heads by learned, input-dependent weights (DeepSeek style)
            instead of summing them.
        index_sink_windows (`int`): The first windows of every row, always selected once visible (attention sinks),
            counted inside the budget. `0` (the default) leaves every choice to the indexer, as Qwen4-Exp does.
        index_local_windows (`int`): Each query's most recent complete windows, always selected, counted inside the
            budget. `0` by default. `index_sink_windows + index_local_windows` must not exceed the budget's windows.
        index_key_cache_dtype (`str`): How the cache stores pooled index keys: `"auto"` (the model's dtype) or
            `"float8_e4m3fn"` (each pooled key rotated by a Walsh-Hadamard transform, then fp8 with one power-of-two
            scale: `index_head_dim + 4` bytes per window, half of bfloat16; queries are rotated alike, so scores
            change only by the rounding). Only the cache is quantised: a forward without a cache, and indexer
            training, keep full-precision keys. fp8 needs a power-of-two `index_head_dim`.
        index_query_source (`str`): Input of the indexer's query projection: `"hidden"` (the layer input, then an
            RMSNorm per head) or `"q_lora"` (MLA only: the attention's normed query latent, no further norm; GLM).
        index_key_norm (`str`): `"rms_after_pool"` (RMSNorm of each pooled key) or `"layer_norm_before_pool"` (a
            LayerNorm with bias, eps 1e-6, of every token's key, then pooling, no norm after; GLM).
        index_rope (`bool`): Rotate the indexer queries and pooled keys (default). GLM-5.3-Flash's indexer is NoPE.
        indexer_types (`list[str]`, *optional*): Per layer, `"full"` (the IndexPool layer runs its indexer) or
            `"shared"` (it has no indexer and no indexer cache, and reuses the selection of the closest full
            IndexPool layer before it). Entries of linear-attention layers are ignored; the first IndexPool layer
            must be full. None: every IndexPool layer is full.
        indexer_loss_weight (`float`): Weight of the indexer's KL loss in `loss` when a forward asks for it
            (`indexer_loss="dense"` or `"sparse"`).
        linear_attention_type (`str`): Mixer of the `"linear_attention"` layers: `"gated_deltanet"` (Gated DeltaNet,
            Qwen3-Next / Qwen3.5 / Qwen4-Exp) or `"kimi_delta"` (Kimi Delta Attention, GLM-5.3-Flash: a decay per key
            channel; needs as many value heads as key heads, of the same width).
        linear_gate_lower_bound (`float`, *optional*): Kimi Delta Attention only: the forget gate's lower bound (a
            negative log decay per step; GLM-5.3-Flash uses -5.0), or None for the unbounded softplus gate.
        linear_num_key_heads (`int`): Query/key heads of the linear attention.
        linear_num_value_heads (`int`): Value heads of the linear attention (a multiple of the key heads).
        linear_key_head_dim (`int`): Width of a linear-attention query/key head.
        linear_value_head_dim (`int`): Width of a linear-attention value head.
        linear_conv_kernel_dim (`int`): Kernel size of the causal depthwise convolution in the linear attention.
        linear_output_gate_act (`str`, *optional*): Activation of the gate after the linear attention's output norm,
            `"silu"` or `"sigmoid"` (Qwen4-Exp's `output_gate_type`). Defaults to `"silu"` for Gated DeltaNet and
            `"sigmoid"` for Kimi Delta Attention.
        num_experts (`int`): Routed experts per MoE block; `0` means a dense MLP in every layer.
        mlp_layer_types (`list[str]`, *optional*): Feed-forward block of each layer, `"dense"` (SwiGLU MLP of
            `intermediate_size`) or `"sparse"` (MoE block, needs `num_experts > 0`). Default: every layer sparse when
            `num_experts > 0`, dense otherwise. GLM-5.3-Flash has three dense layers first.
        num_experts_per_tok (`int`): Experts each token is routed to.
        moe_intermediate_size (`int`): Inner width of one routed expert.
        shared_expert_intermediate_size (`int`): Inner width of the shared expert (`0` for none).
        norm_topk_prob (`bool`): Renormalise the top-k router probabilities to sum to one.
        moe_router_type (`str`): `"softmax"` (Qwen: softmax over the experts, then top-k) or `"sigmoid_grouped"`
            (DeepSeek-V3 / GLM-5.3-Flash: sigmoid scores; a learned per-expert bias `e_score_correction_bias` steers the
            choice only; experts come in `n_group` groups, each scored by the sum of its two best experts, and tokens
            pick among the experts of the `topk_group` best groups; weights are the chosen sigmoid scores, renormalised
            when `norm_topk_prob`, times `routed_scaling_factor`).
        n_group (`int`): Expert groups of the `"sigmoid_grouped"` router (must divide `num_experts`).
        topk_group (`int`): Groups each token may pick experts from (`"sigmoid_grouped"`; at most `n_group`).
        routed_scaling_factor (`float`): Scale of the routed experts' weights (`"sigmoid_grouped"`).
        shared_expert_gate (`bool`): Scale the shared expert by a learned sigmoid gate per token (Qwen); `False` adds
            it ungated (GLM-5.3-Flash).
        swiglu_limit (`float`, *optional*): Clamp of every SwiGLU (dense MLP, experts, shared expert) before the
            activation: the gate projection to at most `swiglu_limit`, the up projection to `[-limit, limit]`
            (GLM-5.3-Flash: 10). `None`: no clamp.
        output_router_logits (`bool`): Return the router logits of every MoE layer (`router_logits`) and, from the
            language-model heads, the load-balancing loss `aux_loss` (Switch Transformer), added to `loss` weighted by
            `router_aux_loss_coef` when labels are given. Turn it on to fine-tune a MoE model.
        router_aux_loss_coef (`float`): Weight of the load-balancing loss in `loss`.
        hidden_act (`str`): Activation of the MLPs and of the Gated DeltaNet convolution.
        hc_count (`int`): Residual streams. `1` is the ordinary pre-norm residual; more turns on the hyper-connections
            of Qwen4-Exp: every mixer and MLP reads a gated mix of the normed streams and writes its output back into
            each stream with its own gate, and the final norm is replaced by a last mix.
        hc_lowrank (`int`): Rank of the low-rank projection that computes the hyper-connection mixing gates.
        hc_type (`str`): Kind of residual streams: `"qwen4_exp"` (the gated hyper-connections above, on when
            `hc_count > 1`) or `"sinkhorn"` (GLM-5.3-Flash's manifold-constrained hyper-connections, on at any
            `hc_count`: one projection of the RMS-normed streams gives per-stream read weights `pre`, write weights
            `post` and a stream-mixing matrix `comb` made doubly stochastic by Sinkhorn iterations; each block reads
            `sum_n pre_n * stream_n`, then its usual RMSNorm, and the streams become `post * output + comb^T @ streams`;
            the final norm reads the mean of the streams).
        hc_sinkhorn_iters (`int`): Sinkhorn iterations of the `"sinkhorn"` mixing matrix.
        hc_eps (`float`): Floor added to the `"sinkhorn"` read weights and mixing matrix, and to its normalisers.
        ple_layers (`list[int]`, *optional*): Zero-based indices of the Gated DeltaNet layers that add per-layer
            n-gram embeddings (PLE, Qwen4-Exp): hashed 2..`ple_ngram_size`-gram embeddings, gated per residual
            stream and smoothed by a dilated causal convolution. Requires `eos_token_id` (n-grams never cross it).
        ple_embed_dim (`int`, *optional*): Width of the concatenated n-gram embedding heads (default `hidden_size`).
        ple_conv_kernel_size (`int`): Kernel of the PLE convolution (its dilation is `ple_ngram_size`).
        ple_ngram_size (`int`): Longest n-gram PLE embeds.
        ple_heads_per_ngram (`int`): Independently hashed embedding heads per n-gram order.
        ple_ngram_vocab_size_base (`int`): Each head's table size is a distinct prime from this number up.
        ple_vocab_size_multiple (`int`): The concatenated n-gram table is padded to a multiple of this.
        ple_hash_seed (`int`): Seed of the per-layer hash multipliers.
        rms_norm_eps (`float`): Epsilon of the RMS norms.
        rms_norm_unit_offset (`bool`): RMSNorm weights are zero-centred, the scale being `1 + weight` (Qwen, the
            default); `False` scales by the weight itself (GLM-5.3-Flash), so that converted weights are stored as the
            source stores them.
        max_position_embeddings (`int`): Longest context the RoPE settings are meant for.
        initializer_range (`float`): Standard deviation of the normal weight initialisation.
        tie_word_embeddings (`bool`): Share the input embedding and the language-model head.
        use_cache (`bool`): Return a [`HybridIndexPoolCache`] by default.
        prefill_chunk_length (`int`, *optional*): With a cache, inputs longer than this go through the model in chunks
            of this many tokens (same result, memory linear in the context); `None` disables chunking. It applies to
            `generate()` too. (Not named `prefill_chunk_size`: `generate()` would copy that into its own setting,
            which refuses `use_cache=False`.)
        pad_token_id, bos_token_id, eos_token_id (`int`, *optional*): Special token ids.
        num_mtp_layers (`int`): Multi-token-prediction (MTP) layers after the decoder, for the speculative decoding of
            the engines that serve the source models; `0` (the default) for none. MTP layer `k` predicts the token
            `k + 2` places ahead from the main model's hidden state and the embedding of the token `k + 1` ahead;
            each is one IndexPool decoder layer with its own indexer (and the MLP of the last decoder layer).
        mtp_type (`str`): How an MTP layer reads its inputs: `"deepseek"` (DeepSeek-V3 / GLM-5.3-Flash: the normed
            token embedding, zero at position 0, and the normed final hidden state, concatenated and projected
            (`input_proj`), then a plain pre-norm decoder layer without residual streams, then `output_norm`),
            `"qwen3_next"` (Qwen3-Next / Qwen3.5: the same layer, with the embedding kept at position 0) or
            `"qwen4_exp"` (Qwen4-Exp: the main model's residual streams before the final mix, normed together and
            projected stream by stream, plus the projected normed embedding in every stream; then decoder layers with
            hyper-connections, one per depth, and the MTP's own final mix). `"qwen4_exp"` needs `hc_type
            "qwen4_exp"` and `hc_count > 1`. The MTP logits use the language-model head.
        mtp_loss_weight (`float`): Weight of the MTP layers' mean next-next-token loss in `loss` when labels are
            given; `0` (the default) leaves the MTP layers out of a labelled forward (they are then not trained).
        source_config (`dict`, *optional*): The config (`to_dict()`) of the checkpoint this model was converted from,
            written by the converters. The export back to that format starts from it, so that settings ours does not
            carry (the source's own defaults, fields of variants ours leaves out) come back unchanged.
    """

    model_type = "hybrid_indexpool"
    keys_to_ignore_at_inference = ["cache"]
    # Multimodal RoPE settings, read by the rotary embedding itself.
    ignore_keys_at_rope_validation = {"mrope_section", "mrope_interleaved"}
    # Tensor parallelism (transformers' styles; `from_pretrained(..., distributed_config=DistributedConfig(tp_size=N))`
    # under torchrun). Every rank keeps whole heads: see `check_tensor_parallel_size`. The plan of a config, the
    # `base_model_tp_plan` property, keeps the entries of `TENSOR_PARALLEL_PLAN` whose modules its model has.
    TENSOR_PARALLEL_PLAN: ClassVar[dict[str, str]] = {
        # IndexPool attention, split by query and key/value heads. `q_proj` holds each head's query and output gate
        # side by side, so a contiguous split keeps both halves of a head together. The cache holds the rank's heads.
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
        "layers.*.self_attn.k_norm": "replicated_with_grad_allreduce",
        "layers.*.self_attn.o_proj": "rowwise",
        # MLA: query heads and the per-head expansion of the latent split by heads; the latents themselves (and the
        # low-rank projections that make them) are replicated, so every rank caches the same latent per token.
        "layers.*.self_attn.q_b_proj": "colwise",
        "layers.*.self_attn.kv_b_proj": "colwise",
        # The indexer (`self_attn.indexer.*`) is replicated: it is small, and every rank must select the same
        # windows; a replicated indexer selects exactly what one process selects, with no collective before the top-k.
        # Gated DeltaNet, split by heads. The fused `in_proj_qkv` ([q heads | k heads | v heads]) has no contiguous
        # slice per rank, so its weight is split but its output gathered, and each rank keeps its own heads' channels
        # (with its slice of the replicated `conv1d`, `A_log` and `dt_bias`); `in_proj_z/b/a` split by value heads.
        "layers.*.linear_attn.in_proj_qkv": "colwise_gather_output",
        "layers.*.linear_attn.in_proj_z": "colwise",
        "layers.*.linear_attn.in_proj_b": "colwise",
        "layers.*.linear_attn.in_proj_a": "colwise",
        "layers.*.linear_attn.norm": "replicated_with_grad_allreduce",
        "layers.*.linear_attn.out_proj": "rowwise",
        # Kimi Delta Attention, split by heads: its q/k/v projections are separate, so each splits contiguously; each
        # rank slices the replicated `conv1d`, `forget_gate.dt_bias` and `forget_gate.A_log` to its heads. The
        # low-rank down projections (`forget_gate.f_a_proj`, `g_a_proj`) are replicated.
        "layers.*.linear_attn.q_proj": "colwise",
        "layers.*.linear_attn.k_proj": "colwise",
        "layers.*.linear_attn.v_proj": "colwise",
        "layers.*.linear_attn.forget_gate.f_b_proj": "colwise",
        "layers.*.linear_attn.b_proj": "colwise",
        "layers.*.linear_attn.g_b_proj": "colwise",
        "layers.*.linear_attn.o_norm": "replicated_with_grad_allreduce",
        "layers.*.linear_attn.o_proj": "rowwise",
        # MLP, routed experts and shared expert as in Qwen3-Next / Qwen3.5-MoE (the router stays replicated).
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
        "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
        "layers.*.mlp.experts.down_proj": "rowwise",
        "layers.*.mlp.experts": "moe_tp_experts",
        "layers.*.mlp.shared_expert.gate_proj": "colwise",
        "layers.*.mlp.shared_expert.up_proj": "colwise",
        "layers.*.mlp.shared_expert.down_proj": "rowwise",
        # Hyper-connections and PLE as in Qwen4-Exp: only the largest weights are split, the rest is replicated.
        "layers.*.attn_hyper_connection.input_mix_weight_down": "rowwise_split_input",
        "layers.*.mlp_hyper_connection.input_mix_weight_down": "rowwise_split_input",
        "hyper_connection_mixer.input_mix_weight_down": "rowwise_split_input",
        "layers.*.ple.ple_embedding.ngram_embedding": "embedding_colwise",
    }
    base_model_pp_plan = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }

    vocab_size: int = 32000
    hidden_size: int = 1024
    intermediate_size: int = 2816
    num_hidden_layers: int = 8
    layer_types: list[str] | None = None
    # IndexPool attention
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int = 128
    partial_rotary_factor: float = 0.25
    rope_parameters: RopeParameters | dict | None = None
    attention_output_gate: bool = True
    attention_bias: bool = False
    attention_dropout: float | int = 0.0
    attention_type: str = "gqa"
    # multi-head latent attention (attention_type="mla")
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int = 0
    v_head_dim: int | None = None
    # indexer
    index_n_heads: int = 4
    index_head_dim: int = 64
    index_topk: int = 2048
    index_pool_size: int = 4
    index_pool_weighting: str = "learned"
    index_head_weights: bool = False
    index_sink_windows: int = 0
    index_local_windows: int = 0
    index_key_cache_dtype: str = "auto"
    index_query_source: str = "hidden"
    index_key_norm: str = "rms_after_pool"
    index_rope: bool = True
    indexer_types: list[str] | None = None
    indexer_loss_weight: float = 1.0
    # linear attention (Gated DeltaNet or Kimi Delta Attention)
    linear_attention_type: str = "gated_deltanet"
    linear_gate_lower_bound: float | int | None = None
    linear_num_key_heads: int = 8
    linear_num_value_heads: int = 16
    linear_key_head_dim: int = 64
    linear_value_head_dim: int = 64
    linear_conv_kernel_dim: int = 4
    linear_output_gate_act: str | None = None
    # MLP / MoE
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    mlp_layer_types: list[str] | None = None
    moe_router_type: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float | int = 1.0
    shared_expert_gate: bool = True
    swiglu_limit: float | int | None = None
    output_router_logits: bool = False
    router_aux_loss_coef: float | int = 0.001
    hidden_act: str = "silu"
    # hyper-connections and per-layer n-gram embeddings (Qwen4-Exp)
    hc_count: int = 1
    hc_lowrank: int = 320
    hc_type: str = "qwen4_exp"
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    ple_layers: list[int] | None = None
    ple_embed_dim: int | None = None
    ple_conv_kernel_size: int = 4
    ple_ngram_size: int = 3
    ple_heads_per_ngram: int = 8
    ple_ngram_vocab_size_base: int = 20_000_000
    ple_vocab_size_multiple: int = 128
    ple_hash_seed: int = 1234
    # the usual
    rms_norm_eps: float = 1e-6
    rms_norm_unit_offset: bool = True
    max_position_embeddings: int = 262144
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    use_cache: bool = True
    prefill_chunk_length: int | None = 8192
    num_mtp_layers: int = 0
    mtp_type: str = "deepseek"
    mtp_loss_weight: float | int = 0.0
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    source_config: dict | None = None

    def __post_init__(self, **kwargs):
        warn_misspelled_fields(type(self), kwargs)
        if self.layer_types is None:
            self.layer_types = [
                "indexpool_attention" if (i + 1) % 4 == 0 else "linear_attention"
                for i in range(self.num_hidden_layers)
            ]
        if self.rope_parameters is None:
            self.rope_parameters = {"rope_type": "default", "rope_theta": kwargs.pop("rope_theta", 10000000.0)}
        self.rope_parameters.setdefault("partial_rotary_factor", self.partial_rotary_factor)
        self.ple_layers = sorted(set(self.ple_layers or []))
        if self.linear_output_gate_act is None:
            self.linear_output_gate_act = "sigmoid" if self.linear_attention_type == "kimi_delta" else "silu"
        if self.ple_embed_dim is None:
            self.ple_embed_dim = self.hidden_size
        super().__post_init__(**kwargs)
        self.check_settings()

    def check_settings(self):
        """Raise a `ValueError` naming the field and the fix for every invalid combination of settings: single fields
        by the tables above, then what relates several. Runs at construction and again when a model is built (settings
        changed after construction are checked); not a strict-dataclass `validate_*` hook, which would wrap the error.
        """

        def fail(message: str):
            raise ValueError(f"HybridIndexPoolConfig: {message}")

        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                fail(f"`{name}` is {getattr(self, name)!r}; it must be one of {list(allowed)}.")
        for name, allowed in LAYER_CHOICES.items():
            entries = getattr(self, name)
            if entries is not None and len(entries) != self.num_hidden_layers:
                fail(f"`{name}` has {len(entries)} entries but `num_hidden_layers` is {self.num_hidden_layers}; "
                     "give one entry per layer" + ("." if name == "layer_types" else " (or None for the default)."))
            for index, entry in enumerate(entries or []):
                if entry not in allowed:
                    fail(f"`{name}[{index}]` is {entry!r}; each entry must be one of {list(allowed)}.")
        for name, interval in RANGES.items():
            field, variant = READ_WHEN.get(name, (None, None))
            if field is not None and getattr(self, field) != variant:
                continue
            value = getattr(self, name)
            if value is None and name not in NULLABLE:
                fail(f"`{name}` is None; {field} {variant!r} needs it in {interval}.")
            if value is not None and not _in_interval(value, interval):
                fail(f"`{name}` is {value}; it must lie in {interval}.")
        for (field, variant), (description, neutral) in VARIANT_ONLY.items():
            changed = [f"{name} = {getattr(self, name)}" for name, value in neutral.items()
                       if getattr(self, name) != value and getattr(self, field) != variant]
            if changed:
                fail(f"{', '.join(changed)} apply to {description} only; set {field}={variant!r} or leave them at "
                     f"{', '.join(f'{name} = {value}' for name, value in neutral.items())}.")
        for name, (divisor, why) in MULTIPLES.items():
            value, step = getattr(self, name), getattr(self, divisor)
            if value % step != 0:
                fail(f"`{name}` ({value}) is not a multiple of `{divisor}` ({step}): {why}; use e.g. "
                     f"{name} = {max(step, value // step * step)}.")
        self._check_combinations(fail)

    def _check_combinations(self, fail):
        budget = self.index_topk // self.index_pool_size
        if self.index_sink_windows + self.index_local_windows > budget:
            fail(f"`index_sink_windows` ({self.index_sink_windows}) + `index_local_windows` "
                 f"({self.index_local_windows}) exceed the budget of {budget} windows (`index_topk // "
                 "index_pool_size`); they are counted inside it, so lower them or raise `index_topk`.")
        if self.index_key_cache_dtype == "float8_e4m3fn" and self.index_head_dim & (self.index_head_dim - 1):
            fail(f"`index_key_cache_dtype` 'float8_e4m3fn' rotates each key by a Walsh-Hadamard transform, which needs "
                 f"a power-of-two `index_head_dim` (got {self.index_head_dim}); use e.g. "
                 f"{1 << (self.index_head_dim.bit_length() - 1)} or keep 'auto'.")
        rope_type = self.rope_parameters.get("rope_type", "default")
        if rope_type != "default" and rope_type not in ROPE_INIT_FUNCTIONS:
            fail(f"`rope_parameters['rope_type']` is {rope_type!r}; use 'default' or one of transformers' RoPE types "
                 f"{sorted(ROPE_INIT_FUNCTIONS)}.")
        if self.rotary_dim % 2 != 0:
            fail(f"`head_dim * partial_rotary_factor` is {self.rotary_dim}, an odd number of rotated channels; "
                 "choose values whose product is even.")
        if self.index_head_dim < self.rotary_dim:
            fail(f"`index_head_dim` ({self.index_head_dim}) is smaller than the rotated width `head_dim * "
                 f"partial_rotary_factor` ({self.rotary_dim}) that the indexer shares with the attention; raise "
                 "`index_head_dim` or lower `partial_rotary_factor`.")
        if self.index_query_source == "q_lora" and self.attention_type != "mla":
            fail("`index_query_source` 'q_lora' reads the MLA query latent, but `attention_type` is "
                 f"{self.attention_type!r}; use attention_type='mla' or index_query_source='hidden'.")
        if self.index_key_norm == "layer_norm_before_pool" and self.index_pool_weighting == "prenorm_mean":
            fail("`index_key_norm` 'layer_norm_before_pool' and `index_pool_weighting` 'prenorm_mean' both norm the "
                 "keys before pooling; use index_pool_weighting 'learned', 'learned_scalar' or 'mean'.")
        first = next((index for index, kind in enumerate(self.layer_types) if kind == "indexpool_attention"), None)
        if self.indexer_types is not None and first is not None and self.indexer_types[first] != "full":
            fail(f"`indexer_types[{first}]` is 'shared', but layer {first} is the first IndexPool layer: a shared "
                 "layer reuses the selection of an earlier full layer, so the first IndexPool layer must be 'full'.")
        same = (("linear_num_value_heads", "linear_num_key_heads", "as many value heads as key heads"),
                ("linear_value_head_dim", "linear_key_head_dim", "value heads as wide as key heads"))
        for value_field, key_field, need in same if self.linear_attention_type == "kimi_delta" else ():
            if getattr(self, value_field) != getattr(self, key_field):
                fail(f"`linear_attention_type` 'kimi_delta' needs {need}, but `{value_field}` is "
                     f"{getattr(self, value_field)} and `{key_field}` {getattr(self, key_field)}; set both the same.")
        if self.num_mtp_layers and self.mtp_type == "qwen4_exp" and not (self.hc_type == "qwen4_exp"
                                                                           and self.hc_count > 1):
            fail("`mtp_type` 'qwen4_exp' reads Qwen4-Exp's residual streams, but the model has none (hc_type "
                 f"{self.hc_type!r}, hc_count {self.hc_count}); use mtp_type 'deepseek' or hc_type 'qwen4_exp' with "
                 "hc_count > 1.")
        self._check_experts(fail)
        self._check_ple(fail)

    def _check_experts(self, fail):
        if "sparse" in self.mlp_types and self.num_experts == 0:
            fail("`mlp_layer_types` has 'sparse' layers but `num_experts` is 0; give the MoE layers experts "
                 "(num_experts > 0) or make every layer 'dense'.")
        if self.num_experts > 0 and not 1 <= self.num_experts_per_tok <= self.num_experts:
            fail(f"`num_experts_per_tok` ({self.num_experts_per_tok}) must lie between 1 and `num_experts` "
                 f"({self.num_experts}).")
        if self.moe_router_type != "sigmoid_grouped":
            return
        if self.topk_group > self.n_group:
            fail(f"`n_group` is {self.n_group} and `topk_group` {self.topk_group}; use 1 <= topk_group <= n_group.")
        if self.num_experts and (self.num_experts % self.n_group or self.num_experts // self.n_group < 2):
            fail(f"`num_experts` ({self.num_experts}) must split into `n_group` ({self.n_group}) equal groups of at "
                 "least 2 experts (a group is scored by its two best experts); choose an n_group that divides "
                 "num_experts at most half as large.")
        reachable = self.topk_group * (self.num_experts // self.n_group)
        if self.num_experts and self.num_experts_per_tok > reachable:
            fail(f"`num_experts_per_tok` ({self.num_experts_per_tok}) exceeds the {reachable} experts of the "
                 f"`topk_group` ({self.topk_group}) groups a token may choose from; raise topk_group or lower "
                 "num_experts_per_tok.")

    def _check_ple(self, fail):
        if not self.ple_layers:
            return
        wrong = [index for index in self.ple_layers
                 if not (0 <= index < self.num_hidden_layers and self.layer_types[index] == "linear_attention")]
        if wrong:
            fail(f"`ple_layers` {wrong} are not Gated DeltaNet layers: give zero-based indices (below "
                 f"{self.num_hidden_layers}) of 'linear_attention' layers, where PLE sits.")
        heads = (self.ple_ngram_size - 1) * self.ple_heads_per_ngram
        if self.ple_ngram_size < 2 or self.ple_heads_per_ngram < 1 or self.ple_embed_dim % heads != 0:
            fail(f"`ple_embed_dim` ({self.ple_embed_dim}) must be a multiple of the n-gram heads "
                 f"(ple_ngram_size - 1) * ple_heads_per_ngram = {heads}, with ple_ngram_size >= 2.")
        if self.eos_token_id is None or self.eos_token_id == []:
            fail("`ple_layers` need `eos_token_id`: the n-gram context restarts after it. Set eos_token_id.")

    def is_shared_indexer_layer(self, layer_idx: int) -> bool:
        """Whether IndexPool layer `layer_idx` reuses the previous full layer's selection (it has no indexer). MTP
        layers (indices from `num_hidden_layers` on) always have their own."""
        return (self.indexer_types is not None and layer_idx < self.num_hidden_layers
                and self.indexer_types[layer_idx] == "shared")

    def check_tensor_parallel_size(self, tp_size: int) -> None:
        """Raise a `ValueError` naming every head count (or width) that `tp_size` ranks cannot split evenly.

        Tensor parallelism gives each rank whole heads (attention query and key/value heads, Gated DeltaNet key and
        value heads) and equal slices of the expert widths.
        """
        if tp_size <= 1:
            return
        names = ["num_attention_heads"] + (["num_key_value_heads"] if self.attention_type == "gqa" else [])
        if "linear_attention" in self.layer_types:
            names += ["linear_num_key_heads", "linear_num_value_heads"]
        if "sparse" in self.mlp_types:
            names.append("moe_intermediate_size")
        uneven = [f"{name} = {getattr(self, name)}" for name in names if getattr(self, name) % tp_size != 0]
        if uneven:
            raise ValueError(
                f"HybridIndexPoolConfig: tensor parallel size {tp_size} does not divide {', '.join(uneven)}; every "
                "rank holds whole heads, so use a tensor parallel size that divides them (or pipeline parallelism)."
            )

    @property
    def base_model_tp_plan(self) -> dict[str, str]:
        """The entries of `TENSOR_PARALLEL_PLAN` that name modules this config's model has (no dense-MLP entries with
        experts, no hyper-connection entries without them, ...): every entry of a plan must match a module."""
        # The first of these parts found in an entry's name says whether the model has that module.
        linear = "linear_attention" in self.layer_types
        gated_deltanet = linear and self.linear_attention_type == "gated_deltanet"
        parts = (
            ("hyper_connection", self.hc_type == "qwen4_exp" and self.hc_count > 1),
            (".ple.", bool(self.ple_layers)),
            (".self_attn.q_b_proj", self.attention_type == "mla" and "indexpool_attention" in self.layer_types),
            (".self_attn.kv_b_proj", self.attention_type == "mla" and "indexpool_attention" in self.layer_types),
            (".self_attn.o_proj", "indexpool_attention" in self.layer_types),
            (".self_attn.", self.attention_type == "gqa" and "indexpool_attention" in self.layer_types),
            (".linear_attn.in_proj_", gated_deltanet),
            (".linear_attn.norm", gated_deltanet),
            (".linear_attn.out_proj", gated_deltanet),
            (".linear_attn.", linear and self.linear_attention_type == "kimi_delta"),
            (".mlp.shared_expert.", "sparse" in self.mlp_types and self.shared_expert_intermediate_size > 0),
            (".mlp.experts", "sparse" in self.mlp_types),
            (".mlp.", "dense" in self.mlp_types),
        )
        return {
            rule: style for rule, style in self.TENSOR_PARALLEL_PLAN.items()
            if next(present for part, present in parts if part in rule)
        }

    @property
    def mlp_types(self) -> list[str]:
        """The feed-forward block of each layer, `"dense"` or `"sparse"`: `mlp_layer_types`, or its default."""
        if self.mlp_layer_types is not None:
            return list(self.mlp_layer_types)
        return ["sparse" if self.num_experts > 0 else "dense"] * self.num_hidden_layers

    @property
    def has_hyper_connections(self) -> bool:
        """Whether the layers carry residual streams through hyper-connections (Sinkhorn ones at any `hc_count`)."""
        return self.hc_type == "sinkhorn" or self.hc_count > 1

    @property
    def ple_eos_token_id(self) -> int:
        """The end-of-sequence id the n-gram context restarts after (the first one when there are several)."""
        return self.eos_token_id[0] if isinstance(self.eos_token_id, list) else self.eos_token_id

    @property
    def mtp_mlp_type(self) -> str:
        """The feed-forward block of the MTP layers: that of the last decoder layer (as vLLM builds GLM's)."""
        return self.mlp_types[-1]

    @property
    def rotary_dim(self) -> int:
        """Channels of each attention head (and indexer head) that RoPE rotates."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def index_topk_windows(self) -> int:
        """Windows each query selects: the token budget divided by the pool size."""
        return self.index_topk // self.index_pool_size


@strict
class HybridIndexPoolMultimodalConfig(PreTrainedConfig):
    r"""
    Configuration of a [`HybridIndexPoolForConditionalGeneration`]: the HybridIndexPool text model
    (`text_config`, a [`HybridIndexPoolConfig`]) reading the features of a transformers vision tower (`vision_config`)
    in place of image and video placeholder tokens: Qwen4-Exp's (`Qwen4ExpVisionConfig`, the default; the text model's
    `rope_parameters` then carry the multimodal RoPE `mrope_section`), or GLM-5.3-Flash's (`Glm5NextVisionConfig`, in
    front of a text model without RoPE, whose positions are plain token counts).

    Args:
        text_config (`dict` or `HybridIndexPoolConfig`, *optional*): The language model.
        vision_config (`dict` or `PreTrainedConfig`, *optional*): The vision tower, of the `model_type` it names
            (default `"qwen4_exp_vision"`).
        image_token_id, video_token_id (`int`): Placeholder tokens that image / video features replace.
        vision_start_token_id, vision_end_token_id (`int`): Tokens around each image or video.
        video_start_token_id, video_end_token_id (`int`, *optional*): GLM-5.3-Flash's layout: a video's frames are
            image placeholders between these delimiters (not `video_token_id` placeholders), and each frame goes
            through the vision tower alone. None (the default, Qwen's layout) or both set.
        tie_word_embeddings (`bool`): Share the input embedding and the language-model head.
    """

    model_type = "hybrid_indexpool_multimodal"
    sub_configs_defaults = {
        "text_config": HybridIndexPoolConfig,
        # Any vision tower by the `model_type` its dict names (Qwen4-Exp's by default).
        "vision_config": SubConfigSpec(AutoConfig, model_type="qwen4_exp_vision") if SubConfigSpec else AutoConfig,
    }

    text_config: dict | PreTrainedConfig | None = None
    vision_config: dict | PreTrainedConfig | None = None
    image_token_id: int = 248056
    video_token_id: int = 248057
    vision_start_token_id: int = 248053
    vision_end_token_id: int = 248054
    video_start_token_id: int | None = None
    video_end_token_id: int | None = None
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        self.check_settings()

    def check_settings(self):
        """Raise a `ValueError` naming what is wrong: the vision tower must fit the text model."""
        text, vision = self.text_config, self.vision_config
        text.check_settings()
        if vision.out_hidden_size != text.hidden_size:
            raise ValueError(
                f"HybridIndexPoolMultimodalConfig: the vision tower's out_hidden_size ({vision.out_hidden_size}) "
                f"must equal the text model's hidden_size ({text.hidden_size}): its features replace token embeddings."
            )
        section = text.rope_parameters.get("mrope_section")
        if self.multimodal_rope and (section is None or len(section) != 3):
            raise ValueError(
                "HybridIndexPoolMultimodalConfig: the text model's rope_parameters need 'mrope_section' (three "
                "numbers: the frequencies of the time, height and width position streams), e.g. [11, 11, 10]."
            )
        if (self.video_start_token_id is None) != (self.video_end_token_id is None):
            raise ValueError("HybridIndexPoolMultimodalConfig: set both `video_start_token_id` and "
                             "`video_end_token_id` (GLM-5.3-Flash's video layout) or neither.")
        tokens = ["image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"]
        if self.video_start_token_id is not None:
            tokens += ["video_start_token_id", "video_end_token_id"]
        for token in tokens:
            if not 0 <= getattr(self, token) < text.vocab_size:
                raise ValueError(f"HybridIndexPoolMultimodalConfig: `{token}` ({getattr(self, token)}) is outside the "
                                 f"text model's vocabulary ({text.vocab_size} tokens).")

    @property
    def multimodal_rope(self) -> bool:
        """Whether the text model rotates by position, so that images get multimodal (time, height, width) positions;
        a model without RoPE (MLA with `qk_rope_head_dim = 0` and an indexer without RoPE, as GLM-5.3-Flash) counts
        tokens only."""
        text = self.text_config
        return text.attention_type != "mla" or text.qk_rope_head_dim > 0 or text.index_rope


__all__ = ["HybridIndexPoolConfig", "HybridIndexPoolMultimodalConfig"]
