"""Kimi Delta Attention (GLM-5.3-Flash's linear-attention layer) for vLLM, with its convolution and recurrent states in
vLLM's mamba state cache.

vLLM's own KDA layer (`KimiGatedDeltaNetAttention`) runs flash-linear-attention's Triton kernels only, which vLLM's
CPU build cannot run; this layer is built from vLLM's parts instead (parallel linear layers, the mamba state cache and
its Gated DeltaNet metadata, KDA's state shapes and dtypes) around the package's own step (`paged_kda.py`, which runs
`kernels.kimi_delta_rule`: fla's kernels on CUDA where installed, PyTorch elsewhere). Weight names are the
checkpoint's (`HybridIndexPoolKimiDeltaAttention`), with `q_proj`, `k_proj` and `v_proj` loaded into one fused
`qkv_proj` (`vllm_glm.GLM_STACKED_WEIGHTS`).
"""

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
    is_conv_state_dim_first,
)
from vllm.model_executor.model_loader.weight_utils import sharded_weight_loader
from vllm.model_executor.utils import set_weight_attrs
from vllm.utils.torch_utils import LayerNameType, _encode_layer_name, _resolve_layer_name, direct_register_custom_op
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from .paged_kda import KdaStepMetadata, gated_rms_norm, kimi_delta_step, short_convolution_step
from .step_layers import register_step_layer
from .vllm_config import GLM_OPS

KDA_OP = GLM_OPS[0]


def kda_state_shape(config, tp_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(convolution state, recurrent state) shapes of one KDA layer on one rank, as vLLM lays out KDA's."""
    return MambaStateShapeCalculator.kda_state_shape(
        tp_size, config.linear_num_key_heads, config.linear_key_head_dim,
        conv_kernel_size=config.linear_conv_kernel_dim)


def kda_state_dtype(vllm_config: VllmConfig) -> tuple[torch.dtype, torch.dtype]:
    """(convolution state, recurrent state) dtypes: the model's and, by default, float32."""
    cache = vllm_config.cache_config
    return MambaStateDtypeCalculator.kda_state_dtype(vllm_config.model_config.dtype, cache.mamba_cache_dtype,
                                                     cache.mamba_ssm_cache_dtype)


def fused_conv_weight_loader(projection_size: int, tp_size: int, tp_rank: int):
    """Load the checkpoint's `conv1d.weight [3 * P, 1, kernel]` (q | k | v channels) into this rank's `[3 * P / tp,
    kernel]`: its heads' channels of each of the three parts."""
    def loader(parameter: torch.Tensor, loaded: torch.Tensor) -> None:
        parts = loaded.reshape(3, projection_size, -1)
        width = projection_size // tp_size
        parameter.data.copy_(parts[:, tp_rank * width: (tp_rank + 1) * width].reshape(parameter.shape))
    return loader


class KimiShortConvolution(nn.Module):
    """The depthwise convolution's weight, `[3 * P / tp, kernel]` float32 (this rank's q | k | v channels), under the
    checkpoint's name `conv1d.weight`."""

    def __init__(self, projection_size: int, kernel_size: int):
        super().__init__()
        tp_size = get_tensor_model_parallel_world_size()
        self.weight = nn.Parameter(torch.empty(3 * projection_size // tp_size, kernel_size, dtype=torch.float32))
        set_weight_attrs(self.weight, {"weight_loader": fused_conv_weight_loader(
            projection_size, tp_size, get_tensor_model_parallel_rank())})


class KimiOutputNorm(nn.Module):
    """KDA's output norm, `weight * rms_norm(x) * sigmoid(gate)` per head in float32 (`o_norm.weight`)."""

    def __init__(self, head_dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(head_dim))

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(hidden_states, gate, self.weight, self.eps)


class KimiForgetGate(nn.Module):
    """KDA's forget gate: log decays `lb * sigmoid(exp(A_log) * (f_b(f_a(x)) + dt_bias))` per key channel (the
    "safe gate"; `-exp(A_log) * softplus(.)` without a lower bound), in float32. This rank's heads."""

    def __init__(self, config, prefix: str):
        super().__init__()
        tp_size = get_tensor_model_parallel_world_size()
        self.head_dim = config.linear_key_head_dim
        self.lower_bound = config.linear_gate_lower_bound
        projection_size = config.linear_num_key_heads * self.head_dim
        self.f_a_proj = ReplicatedLinear(config.hidden_size, self.head_dim, bias=False, prefix=f"{prefix}.f_a_proj")
        self.f_b_proj = ColumnParallelLinear(self.head_dim, projection_size, bias=False, prefix=f"{prefix}.f_b_proj")
        self.dt_bias = nn.Parameter(torch.empty(projection_size // tp_size, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.empty(config.linear_num_key_heads // tp_size, dtype=torch.float32))
        for parameter in (self.dt_bias, self.A_log):
            set_weight_attrs(parameter, {"weight_loader": sharded_weight_loader(0)})

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """`[tokens, hidden]` -> log decays `[tokens, heads, head_dim]` float32."""
        gate = self.f_b_proj(self.f_a_proj(hidden_states)[0])[0].float() + self.dt_bias
        gate = gate.unflatten(-1, (-1, self.head_dim))
        rate = self.A_log.float().exp()[:, None]
        if self.lower_bound is not None:
            return self.lower_bound * torch.sigmoid(rate * gate)
        return -rate * torch.nn.functional.softplus(gate)


class KimiDeltaAttention(nn.Module, MambaBase):
    """Kimi Delta Attention: q/k/v projections, a causal depthwise convolution over them (float32), the Kimi delta
    rule (a decay per key channel), a gated RMSNorm per head and the output projection; heads split under tensor
    parallelism, the low-rank down projections replicated. States live in vLLM's mamba cache (`kv_cache`: the
    convolution state, then the recurrent state), stepped by the custom op `hybrid_indexpool_kda`."""

    def __init__(self, config, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        self.prefix = prefix
        self.tp_size = get_tensor_model_parallel_world_size()
        self.vllm_config, self.config = vllm_config, config
        self.num_heads = config.linear_num_key_heads // self.tp_size
        self.head_dim = config.linear_key_head_dim
        projection_size = config.linear_num_key_heads * self.head_dim
        hidden = config.hidden_size
        self.qkv_proj = MergedColumnParallelLinear(hidden, [projection_size] * 3, bias=False,
                                                   prefix=f"{prefix}.qkv_proj")
        self.conv1d = KimiShortConvolution(projection_size, config.linear_conv_kernel_dim)
        self.forget_gate = KimiForgetGate(config, f"{prefix}.forget_gate")
        self.b_proj = ColumnParallelLinear(hidden, config.linear_num_key_heads, bias=False, prefix=f"{prefix}.b_proj")
        self.g_a_proj = ReplicatedLinear(hidden, self.head_dim, bias=False, prefix=f"{prefix}.g_a_proj")
        self.g_b_proj = ColumnParallelLinear(self.head_dim, projection_size, bias=False, prefix=f"{prefix}.g_b_proj")
        self.o_norm = KimiOutputNorm(self.head_dim, config.rms_norm_eps)
        self.o_proj = RowParallelLinear(projection_size, hidden, bias=False, prefix=f"{prefix}.o_proj")
        self.kv_cache = (torch.tensor([]), torch.tensor([]))
        register_step_layer(vllm_config, prefix, self)

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.GDN_ATTN  # vLLM's Gated DeltaNet metadata, as its own KDA layer uses

    def get_state_shape(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return kda_state_shape(self.config, self.tp_size)

    def get_state_dtype(self) -> tuple[torch.dtype, torch.dtype]:
        return kda_state_dtype(self.vllm_config)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """`[tokens, hidden]` -> `[tokens, hidden]`."""
        num_tokens = hidden_states.shape[0]
        mixed_qkv, _ = self.qkv_proj(hidden_states)
        log_decay = self.forget_gate(hidden_states)  # [tokens, heads, head_dim] float32
        beta = torch.sigmoid(self.b_proj(hidden_states)[0])  # [tokens, heads]
        core = torch.zeros(num_tokens, self.num_heads, self.head_dim, dtype=hidden_states.dtype,
                           device=hidden_states.device)
        torch.ops.vllm.hybrid_indexpool_kda(mixed_qkv, log_decay, beta, core, _encode_layer_name(self.prefix))
        gate = self.g_b_proj(self.g_a_proj(hidden_states)[0])[0].unflatten(-1, (-1, self.head_dim))
        core = self.o_norm(core, gate)
        return self.o_proj(core.reshape(num_tokens, -1))[0]

    def step(self, mixed_qkv: torch.Tensor, log_decay: torch.Tensor, beta: torch.Tensor, metadata) -> torch.Tensor:
        """The convolution and the delta rule of a step's tokens over this layer's states (vLLM's Gated DeltaNet
        `metadata`, without speculative decoding) -> `[tokens, heads, head_dim]`."""
        conv_state, recurrent_state = self.kv_cache
        if is_conv_state_dim_first():  # "DS" layout [slots, channels, kernel - 1]: the step reads "SD"
            conv_state = conv_state.transpose(-1, -2)
        step_metadata = KdaStepMetadata(
            num_decodes=metadata.num_decodes, num_prefills=metadata.num_prefills,
            query_start_loc=metadata.non_spec_query_start_loc,
            state_indices=metadata.non_spec_state_indices_tensor, has_initial_state=metadata.has_initial_state)
        mixed_qkv = short_convolution_step(mixed_qkv, conv_state, self.conv1d.weight, step_metadata,
                                           self.config.hidden_act)
        query, key, value = (part.unflatten(-1, (-1, self.head_dim)) for part in mixed_qkv.chunk(3, dim=-1))
        return kimi_delta_step(query, key, value, log_decay, beta, recurrent_state, step_metadata,
                               self.config.linear_gate_lower_bound)


def hybrid_indexpool_kda(mixed_qkv: torch.Tensor, log_decay: torch.Tensor, beta: torch.Tensor, output: torch.Tensor,
                         layer_name: LayerNameType) -> None:
    """The step of KDA layer `layer_name` (`KimiDeltaAttention.step`) into `output [tokens, heads, head_dim]`. A
    custom op, opaque to `torch.compile` and a split point of vLLM's piecewise graphs (`vllm_config.py`): prefill
    chunks read their offsets on the host."""
    forward_context = get_forward_context()
    metadata = forward_context.attn_metadata
    if isinstance(metadata, list):
        metadata = metadata[0]
    if not isinstance(metadata, dict):  # vLLM's profiling and warm-up runs: no states yet
        return
    layer = forward_context.no_compile_layers[_resolve_layer_name(layer_name)]
    layer_metadata = metadata.get(layer.prefix)
    if layer_metadata is None or layer_metadata.num_actual_tokens == 0:
        return
    if layer_metadata.spec_sequence_masks is not None:
        raise NotImplementedError("Kimi Delta Attention in the HybridIndexPool plugin has no speculative decoding.")
    tokens = layer_metadata.num_actual_tokens
    output[:tokens] = layer.step(mixed_qkv[:tokens], log_decay[:tokens], beta[:tokens], layer_metadata)


def hybrid_indexpool_kda_fake(mixed_qkv, log_decay, beta, output, layer_name) -> None:
    return None


direct_register_custom_op(op_name=KDA_OP.removeprefix("vllm::"), op_func=hybrid_indexpool_kda,
                          mutates_args=["output"], fake_impl=hybrid_indexpool_kda_fake)
