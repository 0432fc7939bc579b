"""The decoder of GLM-5.3-Flash conversions in vLLM: Kimi Delta Attention (`vllm_kda.py`) and MLA IndexPool layers
(`vllm_mla.py`, shared indexers included), dense layers among the mixture-of-experts ones, the grouped sigmoid router
with an ungated shared expert and the SwiGLU clamp, and Sinkhorn-mixed residual streams (vLLM's mHC ops).

`HybridIndexPoolForCausalLM` (`vllm_model.py`) builds `GlmModel` for a checkpoint with GLM's variants
(`glm_options.serves_glm`); weight names are the checkpoint's, with the fused parameters of `GLM_STACKED_WEIGHTS`.
"""

import torch
import torch.nn.functional as F
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.distributed.communication_op import tensor_model_parallel_all_reduce
from vllm.model_executor.layers.activation import SiluAndMul, SiluAndMulWithClamp
from vllm.model_executor.layers.fused_moe import FusedMoEFactory, GateLinear
from vllm.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from vllm.model_executor.layers.mhc import MHCPostOp, MHCPreOp
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.model_executor.models.utils import extract_layer_index
from vllm.platforms import current_platform
from vllm.utils.torch_utils import direct_register_custom_op

from .vllm_kda import KimiDeltaAttention
from .vllm_mla import IndexPoolMLAAttention, rms_norm_class

# Checkpoint weight name part -> (vLLM parameter name part, shard of the fused parameter), for GLM's layers.
GLM_STACKED_WEIGHTS = (
    (".linear_attn.q_proj.", ".linear_attn.qkv_proj.", 0),
    (".linear_attn.k_proj.", ".linear_attn.qkv_proj.", 1),
    (".linear_attn.v_proj.", ".linear_attn.qkv_proj.", 2),
    (".self_attn.q_a_proj.", ".self_attn.fused_qkv_a_proj.", 0),
    (".self_attn.kv_a_proj_with_mqa.", ".self_attn.fused_qkv_a_proj.", 1),
)


class GlmMLP(nn.Module):
    """SwiGLU MLP `down(silu(gate) * up)`, the gate clamped to at most `swiglu_limit` and the up projection to
    `[-limit, limit]` when it is set (vLLM's `SiluAndMulWithClamp`); split over the inner width."""

    def __init__(self, config, intermediate_size: int, prefix: str, reduce_results: bool = True):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [intermediate_size] * 2, bias=False,
                                                       prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(intermediate_size, config.hidden_size, bias=False,
                                           reduce_results=reduce_results, prefix=f"{prefix}.down_proj")
        if config.hidden_act != "silu":
            raise ValueError(f"HybridIndexPool in vLLM: hidden_act {config.hidden_act!r} in a GLM MLP; use 'silu'.")
        self.act_fn = SiluAndMul() if config.swiglu_limit is None else SiluAndMulWithClamp(config.swiglu_limit)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(hidden_states)[0]))[0]


def grouped_topk_routing(router_logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int, n_group: int,
                         topk_group: int, norm_topk_prob: bool,
                         routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GLM's group-limited sigmoid routing in float32 (as the transformers router): `router_logits [tokens, experts]`
    -> expert weights `[tokens, k]` float32 (the chosen sigmoid scores without the bias, renormalised when asked,
    times the scale) and ids `[tokens, k]`."""
    scores = router_logits.float().sigmoid()
    choice = (scores + correction_bias.float()).unflatten(-1, (n_group, -1))
    group_scores = choice.topk(2, dim=-1).values.sum(dim=-1)  # [tokens, n_group]
    best_groups = group_scores.topk(topk_group, dim=-1, sorted=False).indices
    group_kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(-1, best_groups, True)
    choice = choice.masked_fill(~group_kept[..., None], float("-inf")).flatten(-2)
    expert_ids = choice.topk(top_k, dim=-1, sorted=False).indices
    weights = scores.gather(-1, expert_ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, expert_ids


class GlmClampedExperts(nn.Module):
    """The routed experts with the SwiGLU clamp, in PyTorch, where vLLM's fused experts would drop the clamp (its CPU
    experts take no limit): `gate_up_proj [experts, 2 * inner / tp, hidden]`, `down_proj [experts, hidden, inner /
    tp]` (the checkpoint's fused layout, this rank's slice of the inner width), one pass per expert that was hit."""

    def __init__(self, config):
        super().__init__()
        tp_size = get_tensor_model_parallel_world_size()
        self.tp_size, self.tp_rank = tp_size, get_tensor_model_parallel_rank()
        self.inner = config.moe_intermediate_size // tp_size
        self.swiglu_limit = config.swiglu_limit
        self.gate_up_proj = nn.Parameter(torch.empty(config.num_experts, 2 * self.inner, config.hidden_size))
        self.down_proj = nn.Parameter(torch.empty(config.num_experts, config.hidden_size, self.inner))

    def load_weights(self, weights) -> set[str]:
        """Load `gate_up_proj [E, 2I, H]` and `down_proj [E, H, I]` (this rank's slice of `I`); the names loaded."""
        loaded = set()
        rows = slice(self.tp_rank * self.inner, (self.tp_rank + 1) * self.inner)
        for name, tensor in weights:
            if name == "gate_up_proj":
                gate, up = tensor.chunk(2, dim=1)
                self.gate_up_proj.data.copy_(torch.cat([gate[:, rows], up[:, rows]], dim=1))
            elif name == "down_proj":
                self.down_proj.data.copy_(tensor[:, :, rows])
            else:
                raise ValueError(f"HybridIndexPool: the checkpoint has an expert weight {name!r} this model does not "
                                 "know (expected gate_up_proj and down_proj).")
            loaded.add(name)
        return loaded

    def forward(self, hidden_states: torch.Tensor, expert_weights: torch.Tensor,
                expert_ids: torch.Tensor) -> torch.Tensor:
        """`[tokens, hidden]`, weights and ids `[tokens, k]` -> `[tokens, hidden]` (summed over the ranks)."""
        output = torch.ops.vllm.hybrid_indexpool_clamped_experts(hidden_states, expert_weights, expert_ids,
                                                                 self.gate_up_proj, self.down_proj, self.swiglu_limit)
        return tensor_model_parallel_all_reduce(output) if self.tp_size > 1 else output


def hybrid_indexpool_clamped_experts(hidden_states: torch.Tensor, expert_weights: torch.Tensor,
                                     expert_ids: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                                     swiglu_limit: float) -> torch.Tensor:
    """`GlmClampedExperts`' computation, one pass per expert that was hit (which the host reads): a custom op, so that
    the compiled model keeps one graph around it."""
    output = torch.zeros_like(hidden_states)
    for expert in expert_ids.unique().tolist():
        token, slot = torch.nonzero(expert_ids == expert, as_tuple=True)
        gate, up = F.linear(hidden_states[token], gate_up_proj[expert]).chunk(2, dim=-1)
        gate, up = gate.clamp(max=swiglu_limit), up.clamp(min=-swiglu_limit, max=swiglu_limit)
        expert_output = F.linear(F.silu(gate) * up, down_proj[expert])
        output.index_add_(0, token, expert_output * expert_weights[token, slot, None].to(expert_output.dtype))
    return output


def hybrid_indexpool_clamped_experts_fake(hidden_states, expert_weights, expert_ids, gate_up_proj, down_proj,
                                          swiglu_limit) -> torch.Tensor:
    return torch.empty_like(hidden_states)


direct_register_custom_op(op_name="hybrid_indexpool_clamped_experts", op_func=hybrid_indexpool_clamped_experts,
                          mutates_args=[], fake_impl=hybrid_indexpool_clamped_experts_fake)


class GlmSparseMoeBlock(nn.Module):
    """GLM's mixture of experts: the group-limited sigmoid router (float32, with `e_score_correction_bias`), routed
    SwiGLU experts (vLLM's fused MoE, or `GlmClampedExperts` where that would drop the clamp) and an ungated shared
    expert."""

    def __init__(self, config, prefix: str):
        super().__init__()
        self.config = config
        self.gate = GateLinear(config.hidden_size, config.num_experts, out_dtype=torch.float32,
                               params_dtype=torch.float32, force_fp32_compute=True, prefix=f"{prefix}.gate")
        self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(config.num_experts, dtype=torch.float32))
        self.shared_expert = None
        if config.shared_expert_intermediate_size > 0:
            self.shared_expert = GlmMLP(config, config.shared_expert_intermediate_size, f"{prefix}.shared_expert")
        self.fused = config.swiglu_limit is None or not current_platform.is_cpu()
        if self.fused:
            self.experts = FusedMoEFactory(
                gate=self.gate, num_experts=config.num_experts, top_k=config.num_experts_per_tok,
                hidden_size=config.hidden_size, intermediate_size=config.moe_intermediate_size,
                renormalize=config.norm_topk_prob, use_grouped_topk=True, num_expert_group=config.n_group,
                topk_group=config.topk_group, scoring_func="sigmoid",
                routed_scaling_factor=config.routed_scaling_factor,
                e_score_correction_bias=self.gate.e_score_correction_bias, swiglu_limit=config.swiglu_limit,
                router_logits_dtype=torch.float32, prefix=f"{prefix}.experts")
        else:
            self.experts = GlmClampedExperts(config)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.fused:  # the fused MoE runs the gate itself
            output = self.experts(hidden_states=hidden_states, router_logits=hidden_states)
        else:
            config = self.config
            router_logits = self.gate(hidden_states.float())[0]
            weights, ids = grouped_topk_routing(router_logits, self.gate.e_score_correction_bias,
                                                config.num_experts_per_tok, config.n_group, config.topk_group,
                                                config.norm_topk_prob, config.routed_scaling_factor)
            output = self.experts(hidden_states, weights, ids)
        if self.shared_expert is not None:
            output = output + self.shared_expert(hidden_states)
        return output


class SinkhornHyperConnection(nn.Module):
    """Read from and write to `hc_count` residual streams through a doubly stochastic mixing matrix (GLM's mHC), with
    vLLM's mHC ops: one projection `fn` of the RMS-normed streams gives read weights `pre`, write weights `post`
    (`2 * sigmoid`) and the Sinkhorn-normalised mixing `comb`; the block reads `sum_n pre_n * stream_n`, and stream
    `n` becomes `post_n * output + sum_m comb_mn * stream_m`. Parameters `fn`, `base`, `scale` in float32."""

    def __init__(self, config):
        super().__init__()
        count = config.hc_count
        mixes = (2 + count) * count
        self.fn = nn.Parameter(torch.empty(mixes, count * config.hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.empty(mixes, dtype=torch.float32))
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32))
        self.rms_eps, self.hc_eps, self.iterations = config.rms_norm_eps, config.hc_eps, config.hc_sinkhorn_iters
        self.read_op, self.write_op = MHCPreOp(), MHCPostOp()

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """`streams [tokens, hc_count, hidden]` -> the block input `[tokens, hidden]` and the write weights (`post
        [tokens, hc_count, 1]`, `comb [tokens, hc_count, hc_count]`, float32)."""
        if streams.dtype == torch.float32:  # vLLM's mHC kernels take 16-bit streams only
            return self.read_float32(streams)
        post, comb, block_input = self.read_op(streams, self.fn, self.scale, self.base, self.rms_eps, self.hc_eps,
                                               self.hc_eps, 2.0, self.iterations)
        return block_input, (post, comb)

    def read_float32(self, streams: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """`forward` for float32 streams, in PyTorch (the same arithmetic as vLLM's mHC reference)."""
        count = streams.shape[1]
        flat = streams.flatten(1)
        mixes = F.linear(flat, self.fn) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.rms_eps)
        pre, post, comb = mixes.split([count, count, count * count], dim=-1)
        pre_base, post_base, comb_base = self.base.split([count, count, count * count])
        pre = torch.sigmoid(pre * self.scale[0] + pre_base) + self.hc_eps
        post = 2 * torch.sigmoid(post * self.scale[1] + post_base)
        comb = torch.softmax((comb * self.scale[2] + comb_base).unflatten(-1, (count, count)), dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)  # Sinkhorn: columns, then rows and columns
        for _ in range(self.iterations - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        return (pre[..., None] * streams).sum(dim=1), (post[..., None], comb)

    def inject(self, streams: torch.Tensor, block_output: torch.Tensor,
               write_weights: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if streams.dtype == torch.float32:
            post, comb = write_weights
            return post * block_output[:, None] + comb.transpose(-1, -2) @ streams
        return self.write_op(block_output, streams, *write_weights)


class GlmDecoderLayer(nn.Module):
    """Token mixer (Kimi Delta Attention, or MLA IndexPool attention with its own or a shared indexer), then the MLP
    or the MoE (`mlp_layer_types`), each read from and written to the Sinkhorn streams (`hc_type = "sinkhorn"`) and
    RMS-normed, or as pre-norm residual blocks without streams."""

    def __init__(self, config, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        index = extract_layer_index(prefix)
        self.layer_type = config.layer_types[index]
        if self.layer_type == "linear_attention":
            self.linear_attn = KimiDeltaAttention(config, vllm_config, prefix=f"{prefix}.linear_attn")
        else:
            self.self_attn = IndexPoolMLAAttention(config, vllm_config, f"{prefix}.self_attn",
                                                   shared_indexer=config.is_shared_indexer_layer(index))
        if config.mlp_types[index] == "sparse":
            self.mlp = GlmSparseMoeBlock(config, prefix=f"{prefix}.mlp")
        else:
            self.mlp = GlmMLP(config, config.intermediate_size, prefix=f"{prefix}.mlp")
        norm = rms_norm_class(config)
        self.input_layernorm = norm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = norm(config.hidden_size, eps=config.rms_norm_eps)
        self.streams = config.hc_type == "sinkhorn"
        if self.streams:
            self.attn_hyper_connection = SinkhornHyperConnection(config)
            self.mlp_hyper_connection = SinkhornHyperConnection(config)

    def mix(self, positions: torch.Tensor, hidden_states: torch.Tensor, selection: torch.Tensor) -> torch.Tensor:
        if self.layer_type == "linear_attention":
            return self.linear_attn(hidden_states)
        return self.self_attn(positions, hidden_states, selection)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                selection: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """With streams: `hidden_states` the streams `[tokens, hc_count, hidden]`, `residual` None, both returned
        likewise. Without: vLLM's fused residual (`hidden_states`, `residual` `[tokens, hidden]`)."""
        if self.streams:
            streams = hidden_states
            block_input, write_weights = self.attn_hyper_connection(streams)
            output = self.mix(positions, self.input_layernorm(block_input), selection)
            streams = self.attn_hyper_connection.inject(streams, output, write_weights)
            block_input, write_weights = self.mlp_hyper_connection(streams)
            output = self.mlp(self.post_attention_layernorm(block_input))
            return self.mlp_hyper_connection.inject(streams, output, write_weights), None
        if residual is None:
            residual, hidden_states = hidden_states, self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.mix(positions, hidden_states, selection)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


@support_torch_compile
class GlmModel(nn.Module):
    """Embedding, GLM decoder layers and final norm (of the streams' mean with Sinkhorn streams), compiled by vLLM
    (its token mixers' steps are custom ops, opaque to the compiler)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([GlmDecoderLayer(config, vllm_config, prefix=f"{prefix}.layers.{index}")
                                     for index in range(config.num_hidden_layers)])
        self.norm = rms_norm_class(config)(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        config = self.config
        if config.hc_type == "sinkhorn":  # every stream starts as the embedding
            hidden_states = hidden_states[:, None].expand(-1, config.hc_count, -1).contiguous()
        # The windows each token's last full IndexPool layer selected, read by the shared-indexer layers after it.
        selection = torch.full((hidden_states.shape[0], config.index_topk_windows), -1, dtype=torch.long,
                               device=hidden_states.device)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual, selection)
        if config.hc_type == "sinkhorn":
            return self.norm(hidden_states.mean(dim=1))
        return self.norm(hidden_states, residual)[0]
