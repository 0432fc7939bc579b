"""`HybridIndexPoolForCausalLM` for vLLM: Gated DeltaNet layers (vLLM's own, with its state cache) interleaved with
IndexPool attention layers (`indexpool_attention.py`), vLLM's parallel linear layers, RMSNorm and rotary embedding.
Loads the weights of a checkpoint saved by `hybrid_indexpool` under their own names."""

from collections.abc import Iterable

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.model_executor.layers.layernorm import GemmaRMSNorm
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateCopyFuncCalculator,
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
)
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid
from vllm.model_executor.models.qwen3_next import Qwen3NextMLP, Qwen3NextSparseMoeBlock
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.kv_cache_interface import MambaSpec

from .gated_deltanet import HybridIndexPoolGatedDeltaNet
from .glm_options import serves_glm
from .indexpool_attention import IndexPoolAttention
from .per_layer_embedding import PerLayerEmbedding, ple_state_dtypes, ple_state_shapes
from .residual_streams import hyper_connection
from .rope import TextMultimodalRoPE
from .vllm_config import unsupported_options
from .vllm_glm import GLM_STACKED_WEIGHTS, GlmModel
from .vllm_kda import kda_state_dtype, kda_state_shape

# Checkpoint weight name part -> (vLLM parameter name part, shard of the fused parameter).
STACKED_WEIGHTS = (
    (".self_attn.q_proj.", ".self_attn.qkv_proj.", "q"),
    (".self_attn.k_proj.", ".self_attn.qkv_proj.", "k"),
    (".self_attn.v_proj.", ".self_attn.qkv_proj.", "v"),
    (".mlp.gate_proj.", ".mlp.gate_up_proj.", 0),
    (".mlp.up_proj.", ".mlp.gate_up_proj.", 1),
    (".mlp.shared_expert.gate_proj.", ".mlp.shared_expert.gate_up_proj.", 0),
    (".mlp.shared_expert.up_proj.", ".mlp.shared_expert.gate_up_proj.", 1),
    (".linear_attn.in_proj_qkv.", ".linear_attn.in_proj_qkvz.", (0, 1, 2)),
    (".linear_attn.in_proj_z.", ".linear_attn.in_proj_qkvz.", 3),
    (".linear_attn.in_proj_b.", ".linear_attn.in_proj_ba.", 0),
    (".linear_attn.in_proj_a.", ".linear_attn.in_proj_ba.", 1),
)


class HybridIndexPoolDecoderLayer(nn.Module):
    """Token mixer (Gated DeltaNet or IndexPool attention), then the SwiGLU MLP or the mixture of experts (vLLM's fused
    MoE with the shared expert, as its Qwen3-Next), each a pre-norm residual block; or, with Qwen4-Exp's
    hyper-connections, each reading and writing the residual streams through one (`residual_streams.py`), after the
    layer's per-layer n-gram embedding where it has one (`per_layer_embedding.py`)."""

    def __init__(self, config, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        layer_index = extract_layer_index(prefix)
        self.layer_type = config.layer_types[layer_index]
        if self.layer_type == "linear_attention":
            self.linear_attn = HybridIndexPoolGatedDeltaNet(config, vllm_config, prefix=f"{prefix}.linear_attn")
        else:
            self.self_attn = IndexPoolAttention(config, vllm_config, prefix=f"{prefix}.self_attn")
        if config.num_experts > 0:
            self.mlp = Qwen3NextSparseMoeBlock(vllm_config, prefix=f"{prefix}.mlp")
        else:
            self.mlp = Qwen3NextMLP(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                                    hidden_act=config.hidden_act, prefix=f"{prefix}.mlp")
        self.ple = None
        if layer_index in config.ple_layers:
            self.ple = PerLayerEmbedding(config, vllm_config, config.ple_layers.index(layer_index), f"{prefix}.ple")
        self.hyper_connections = config.has_hyper_connections
        if self.hyper_connections:
            dtype = vllm_config.model_config.dtype
            self.attn_hyper_connection = hyper_connection(config, dtype)
            self.mlp_hyper_connection = hyper_connection(config, dtype)
        else:
            self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                input_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`hidden_states [tokens, hidden]` and the running residual (None at the first layer), or with
        hyper-connections the streams `[tokens, hc_count * hidden]` and None."""
        if self.ple is not None:
            hidden_states = hidden_states + self.ple(hidden_states, input_ids)
        if self.hyper_connections:
            block_input, streams = self.attn_hyper_connection.mix(hidden_states)
            hidden_states = self.attn_hyper_connection.combine(self.mix_tokens(positions, block_input), streams)
            block_input, streams = self.mlp_hyper_connection.mix(hidden_states)
            return self.mlp_hyper_connection.combine(self.mlp(block_input), streams), None
        if residual is None:
            residual, hidden_states = hidden_states, self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.mix_tokens(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual

    def mix_tokens(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.layer_type == "linear_attention":
            return self.linear_attn(hidden_states=hidden_states)
        return self.self_attn(positions, hidden_states)


@support_torch_compile
class HybridIndexPoolModel(nn.Module):
    """Embedding, decoder layers and final norm (with hyper-connections: every stream starts as the embedding and a
    last hyper-connection mixes them, without a norm), compiled by vLLM (its token mixers are custom ops, opaque to
    the compiler: the Gated DeltaNet core, `hybrid_indexpool_attention` and `hybrid_indexpool_ple`)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        self.hc_count = config.hc_count if config.has_hyper_connections else 1
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([
            HybridIndexPoolDecoderLayer(config, vllm_config, prefix=f"{prefix}.layers.{index}")
            for index in range(config.num_hidden_layers)
        ])
        if config.has_hyper_connections:
            self.hyper_connection_mixer = hyper_connection(config, vllm_config.model_config.dtype, inject=False)
        else:
            self.norm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if self.hc_count > 1:
            hidden_states = hidden_states.repeat(1, self.hc_count)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual, input_ids)
        if self.hc_count > 1:
            return self.hyper_connection_mixer.mix(hidden_states)[0]
        return self.norm(hidden_states, residual)[0]


class HybridIndexPoolForCausalLM(nn.Module, HasInnerState, IsHybrid, TextMultimodalRoPE):
    """The causal LM served by vLLM. Checkpoint settings it cannot serve are refused when the engine starts
    (`vllm_config.unsupported_options`)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        problems = unsupported_options(config)
        if problems:  # also checked at engine start; a model built directly must refuse too
            raise ValueError("HybridIndexPool in vLLM does not support: " + "; ".join(problems) + ".")
        self.config = config
        model_class = GlmModel if serves_glm(config) else HybridIndexPoolModel  # GLM-5.3-Flash's decoder
        self.model = model_class(vllm_config=vllm_config, prefix=f"{prefix}model" if not prefix else f"{prefix}.model")
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix="lm_head")
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        return self.model(input_ids, self.text_positions(positions), inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig) -> tuple[torch.dtype, torch.dtype]:
        if vllm_config.model_config.hf_text_config.linear_attention_type == "kimi_delta":
            return kda_state_dtype(vllm_config)
        cache = vllm_config.cache_config
        return MambaStateDtypeCalculator.gated_delta_net_state_dtype(
            vllm_config.model_config.dtype, cache.mamba_cache_dtype, cache.mamba_ssm_cache_dtype)

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig):
        config = vllm_config.model_config.hf_text_config
        if config.linear_attention_type == "kimi_delta":
            return kda_state_shape(config, vllm_config.parallel_config.tensor_parallel_size)
        return MambaStateShapeCalculator.gated_delta_net_state_shape(
            vllm_config.parallel_config.tensor_parallel_size, config.linear_num_key_heads,
            config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim,
            config.linear_conv_kernel_dim, vllm_config.num_speculative_tokens)

    @classmethod
    def get_mamba_specs_from_config(cls, vllm_config: VllmConfig) -> tuple[MambaSpec, ...]:
        """Every kind of mamba state the model keeps (vLLM sizes its pages by the largest): the Gated DeltaNet's and,
        with per-layer n-gram embeddings, theirs."""
        specs = [MambaSpec(shapes=cls.get_mamba_state_shape_from_config(vllm_config),
                           dtypes=cls.get_mamba_state_dtype_from_config(vllm_config), block_size=-1)]
        config = vllm_config.model_config.hf_text_config
        if config.ple_layers:
            specs.append(MambaSpec(shapes=ple_state_shapes(config),
                                   dtypes=ple_state_dtypes(vllm_config.model_config.dtype), block_size=-1))
        return tuple(specs)

    @classmethod
    def get_mamba_state_copy_func(cls):
        return MambaStateCopyFuncCalculator.gated_delta_net_state_copy_func()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint weights by name (`load_named_weights`). Multi-token-prediction layers (`model.mtp.*`) are
        the drafter's (`vllm_mtp.py`), loaded by it when vLLM drafts with them."""
        loaded = load_named_weights(self, ((name, tensor) for name, tensor in weights
                                           if not name.startswith("model.mtp.")))
        for module in self.modules():
            if isinstance(module, HybridIndexPoolGatedDeltaNet):
                module.keep_conv_weight()
        return loaded


def load_named_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Load checkpoint weights into `model` by name: q/k/v, gate/up and the Gated DeltaNet input projections go into
    vLLM's fused parameters, the fused experts (`experts.gate_up_proj [E, 2I, H]`, `experts.down_proj [E, H, I]`)
    through vLLM's fused-MoE loader, everything else by its own name. An unknown name is an error."""
    config = model.config
    parameters = dict(model.named_parameters())
    loaded = set()
    if config.num_experts > 0 and config.shared_expert_intermediate_size == 0:
        # vLLM's MoE block always has a shared-expert gate; without a shared expert nothing reads it.
        loaded |= {name for name in parameters if name.endswith(".mlp.shared_expert_gate.weight")}
    for name, tensor in weights:
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue
        if ".mlp.experts." in name:
            module_name, weight_name = name.split(".mlp.experts.")
            experts = model.get_submodule(f"{module_name}.mlp.experts")
            loaded |= {f"{module_name}.mlp.experts.{loaded_name}"
                       for loaded_name in experts.load_weights([(weight_name, tensor)])}
            continue
        for part, fused_part, shard in STACKED_WEIGHTS + GLM_STACKED_WEIGHTS:
            if part in name:
                parameter = parameters[name.replace(part, fused_part)]
                parameter.weight_loader(parameter, tensor, shard)
                loaded.add(name.replace(part, fused_part))
                break
        else:
            if name not in parameters:
                raise ValueError(f"HybridIndexPool: the checkpoint has a weight {name!r} this model does not know.")
            parameter = parameters[name]
            getattr(parameter, "weight_loader", default_weight_loader)(parameter, tensor)
            loaded.add(name)
    return loaded
