"""The Gated DeltaNet layer of the vLLM model: vLLM's own (`QwenGatedDeltaNetAttention`: its parallel projections,
gated RMSNorm, state cache and metadata), whose core runs on vLLM's kernels or on the project's
(`gated_deltanet_kernel.py` chooses).

The project's core is the causal convolution and the gated delta rule of the transformers model
(`kernels/causal_conv1d`, `kernels/gated_delta_rule`: PyTorch, or flash-linear-attention on CUDA), over vLLM's state
cache: any dtype (float32 included, where vLLM's CPU kernels take bfloat16 only) and any head size. It is a custom op
(`hybrid_indexpool_gdn_core`), opaque to `torch.compile`, that reads the host's view of the step (prefill lengths): a
CPU and test path, not one for CUDA graphs. Verify steps of speculative decoding run the plugin's drafting step on
either core (`linear_attention_drafts.py`).
"""

import torch
from vllm.config import VllmConfig
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
from vllm.platforms import current_platform
from vllm.utils.torch_utils import LayerNameType, _encode_layer_name, direct_register_custom_op

from ..kernels.causal_conv1d import causal_conv1d
from ..kernels.gated_delta_rule import gated_delta_rule
from . import linear_attention_drafts  # noqa: F401 (registers the drafting step's custom op)
from .gated_deltanet_kernel import gdn_kernel
from .step_layers import step_layer_and_metadata
from .vllm_config import GDN_CORE_OP


class GatedDeltaNetConfigView:
    """The config fields vLLM's Gated DeltaNet layer reads, under its names (ours calls the gate activation
    `linear_output_gate_act`)."""

    def __init__(self, config):
        for name in ("hidden_size", "hidden_act", "rms_norm_eps", "linear_num_key_heads", "linear_num_value_heads",
                     "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim"):
            setattr(self, name, getattr(config, name))
        self.output_gate_type = config.linear_output_gate_act


class HybridIndexPoolGatedDeltaNet(QwenGatedDeltaNetAttention):
    """vLLM's Gated DeltaNet layer (Qwen3.5 weight layout: fused `in_proj_qkvz`, `in_proj_ba`), with the core on the
    kernels `gated_deltanet_kernel.gdn_kernel` chooses for this engine."""

    def __init__(self, config, vllm_config: VllmConfig, prefix: str):
        super().__init__(GatedDeltaNetConfigView(config), vllm_config, prefix=prefix)
        self.project_core = gdn_kernel(vllm_config) == "project"
        if self.project_core:
            self._forward_method = self.forward_project_core
        if vllm_config.speculative_config is not None and (self.project_core or current_platform.is_cpu()):
            # Verify steps of drafts: the plugin's step, on either core (`linear_attention_drafts.py`); vLLM's own
            # kernels handle drafts on GPUs.
            self._forward_method = self.forward_with_drafts
        self.conv_weight = None  # [channels, kernel]: kept by `keep_conv_weight` (vLLM may repack `conv1d.weight`)

    def keep_conv_weight(self) -> None:
        """Keep the loaded convolution weight for the project's core (call after loading, before vLLM's
        post-load processing, which packs it for its CPU kernel)."""
        if self.project_core:
            weight = self.conv1d.weight
            self.conv_weight = weight.detach().reshape(weight.shape[0], weight.shape[-1]).clone()

    def forward_project_core(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.forward_through(torch.ops.vllm.hybrid_indexpool_gdn_core, hidden_states)

    def forward_with_drafts(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.forward_through(torch.ops.vllm.hybrid_indexpool_gated_deltanet_with_drafts, hidden_states)

    def forward_through(self, core_op, hidden_states: torch.Tensor) -> torch.Tensor:
        """`[tokens, hidden]` -> `[tokens, hidden]`: vLLM's projections and gated norm around the custom op
        `core_op(mixed_qkv, b, a, core_out, layer_name)` (the recurrent core)."""
        mixed_qkvz, _ = self.in_proj_qkvz(hidden_states)
        ba, _ = self.in_proj_ba(hidden_states)
        qkv_size = (2 * self.key_dim + self.value_dim) // self.tp_size
        mixed_qkv, z = mixed_qkvz.split([qkv_size, self.value_dim // self.tp_size], dim=-1)
        b, a = ba.chunk(2, dim=-1)
        core = torch.zeros(hidden_states.shape[0], self.num_v_heads // self.tp_size, self.head_v_dim,
                           dtype=hidden_states.dtype, device=hidden_states.device)
        core_op(mixed_qkv, b, a, core, _encode_layer_name(self.prefix))
        return self._output_projection(core, z.reshape(z.shape[0], -1, self.head_v_dim))

    def state_views(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's states in vLLM's cache: convolution `[slots, channels, kernel - 1]` and recurrent
        `[slots, heads, key_dim, value_dim]` (float32, vLLM's CPU layout)."""
        conv_states, recurrent_states = self.kv_cache[0], self.kv_cache[1]
        if not is_conv_state_dim_first():
            conv_states = conv_states.transpose(-1, -2)
        slots, heads = recurrent_states.shape[:2]
        return conv_states, recurrent_states.view(slots, heads, self.head_k_dim, self.head_v_dim)

    def run_core(self, mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, metadata) -> torch.Tensor:
        """The core of one step's tokens (decodes first, then prefill chunks, as vLLM orders them):
        `mixed_qkv [tokens, channels]`, `b`, `a [tokens, heads]` -> `[tokens, heads, value_dim]`."""
        conv_states, recurrent_states = self.state_views()
        slots = metadata.non_spec_state_indices_tensor.long()
        starts = metadata.non_spec_query_start_loc.tolist()
        num_decodes = metadata.num_decodes
        has_initial_state = (metadata.has_initial_state.tolist() if metadata.has_initial_state is not None
                             else [True] * len(starts))
        outputs = []
        if num_decodes:  # one token each, batched
            decode_slots = slots[:num_decodes]
            conv_input = torch.cat([conv_states[decode_slots], mixed_qkv[:num_decodes, :, None]], dim=-1)
            outputs.append(self.convolve_and_apply_rule(conv_input, b[:num_decodes, None], a[:num_decodes, None],
                                                        recurrent_states, decode_slots, "recurrent")[:, 0])
            conv_states[decode_slots] = conv_input[..., 1:]
        for request in range(num_decodes, len(starts) - 1):  # prefill chunks, one request at a time
            tokens, slot = slice(starts[request], starts[request + 1]), slots[request:request + 1]
            if not has_initial_state[request]:
                conv_states[slot] = 0
                recurrent_states[slot] = 0
            conv_input = torch.cat([conv_states[slot], mixed_qkv[tokens].T[None]], dim=-1)
            outputs.append(self.convolve_and_apply_rule(conv_input, b[None, tokens], a[None, tokens],
                                                        recurrent_states, slot, "chunk")[0])
            conv_states[slot] = conv_input[..., conv_input.shape[-1] - conv_states.shape[-1]:]
        return torch.cat(outputs)

    def convolve_and_apply_rule(self, conv_input, b, a, recurrent_states, slots, mode) -> torch.Tensor:
        """`conv_input [requests, channels, kernel - 1 + seq]` (states, then tokens), `b`, `a [requests, seq, heads]`
        -> `[requests, seq, heads, value_dim]`; the requests' recurrent states (`slots`) advanced in place."""
        mixed = causal_conv1d(conv_input, self.conv_weight, self.activation).transpose(1, 2)
        key_dim = self.key_dim // self.tp_size
        query, key, value = mixed.split([key_dim, key_dim, mixed.shape[-1] - 2 * key_dim], dim=-1)
        batch, seq = mixed.shape[:2]
        query = query.reshape(batch, seq, -1, self.head_k_dim)
        key = key.reshape(batch, seq, -1, self.head_k_dim)
        value = value.reshape(batch, seq, -1, self.head_v_dim)
        log_decay = -self.A_log.float().exp() * torch.nn.functional.softplus(a.float() + self.dt_bias.float())
        output, final_state = gated_delta_rule(query, key, value, log_decay, b.sigmoid(),
                                               recurrent_states[slots], mode=mode)
        recurrent_states[slots] = final_state.to(recurrent_states.dtype)
        return output


def hybrid_indexpool_gdn_core(mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, core_attn_out: torch.Tensor,
                              layer_name: LayerNameType) -> None:
    """The project's Gated DeltaNet core of layer `layer_name` into `core_attn_out [tokens, heads, value_dim]`."""
    layer, metadata = step_layer_and_metadata(layer_name)
    if metadata is None:  # vLLM's memory-profiling run: no caches yet
        return
    tokens = metadata.num_actual_tokens
    if tokens == 0:
        return
    if metadata.num_spec_decodes:
        raise NotImplementedError("HybridIndexPool: the project's Gated DeltaNet core has no speculative decoding.")
    core_attn_out[:tokens] = layer.run_core(mixed_qkv[:tokens], b[:tokens], a[:tokens], metadata)


def hybrid_indexpool_gdn_core_fake(mixed_qkv, b, a, core_attn_out, layer_name) -> None:
    return None


direct_register_custom_op(op_name=GDN_CORE_OP.removeprefix("vllm::"), op_func=hybrid_indexpool_gdn_core,
                          mutates_args=["core_attn_out"], fake_impl=hybrid_indexpool_gdn_core_fake)
