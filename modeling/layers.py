"""The small building blocks of every layer: the decode-aware linear layer, RMS norms, rotary embeddings and
helpers over padded token rows."""

import torch
from torch import nn
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update

from ..configuration.configuration_hybrid_indexpool import HybridIndexPoolConfig
from ..kernels.decode_linear import decode_linear

# Tokens per row up to which a forward over a cache takes the decode path of every layer (the recurrent delta rules,
# the IndexPool decode selection), as a decode step or a speculative verify forward (the last accepted token and up
# to 7 drafts) does: such a forward reads the weights once and costs about one step.
FEW_TOKENS = 8


class HybridIndexPoolLinear(nn.Linear):
    """`nn.Linear` whose inference products of a few tokens on CPU (the decode step) run the streaming
    matrix-vector kernel of `kernels.decode_linear`; everything else (training, prefill, CUDA) is `F.linear`.
    Same parameters and state dict as `nn.Linear`."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return decode_linear(hidden_states, self.weight, self.bias)


class HybridIndexPoolRMSNorm(nn.Module):
    """RMSNorm computed in float32: `x / rms(x) * (1 + weight)`, zero-centred (the Qwen3-Next convention), or with
    `unit_offset=False` `x / rms(x) * weight` (GLM-5.3-Flash, DeepSeek), so that either family's weights are used as
    they are stored.

    With `group_size`, each consecutive group of that many channels (one residual stream) is normalised on its own.
    """

    def __init__(self, dim: int, eps: float = 1e-6, group_size: int | None = None, unit_offset: bool = True):
        super().__init__()
        self.eps = eps
        self.group_size = group_size
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    @classmethod
    def from_config(cls, config, dim: int, group_size: int | None = None) -> "HybridIndexPoolRMSNorm":
        """The model's RMSNorm of width `dim`: its epsilon and weight convention (`rms_norm_unit_offset`)."""
        return cls(dim, eps=config.rms_norm_eps, group_size=group_size, unit_offset=config.rms_norm_unit_offset)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        normed = hidden_states.float()
        if self.group_size is not None:
            normed = normed.unflatten(-1, (-1, self.group_size))
        normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.group_size is not None:
            normed = normed.flatten(-2)
        scale = 1.0 + self.weight.float() if self.unit_offset else self.weight.float()
        return (normed * scale).type_as(hidden_states)


class HybridIndexPoolRMSNormGated(nn.Module):
    """RMSNorm followed by a gate, on each Gated DeltaNet value head: `weight * norm(x) * act(gate)`, `act` SiLU
    (Qwen3-Next, Qwen3.5) or sigmoid (an option of Qwen4-Exp)."""

    def __init__(self, dim: int, eps: float = 1e-6, activation: str = "silu"):
        super().__init__()
        self.eps = eps
        self.gate_act_fn = ACT2FN[activation]  # looked up once: ACT2FN builds a module on every lookup
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        normed = hidden_states.float()
        normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + self.eps)
        normed = self.weight * normed.to(input_dtype)
        return (normed * self.gate_act_fn(gate.float())).to(input_dtype)


class HybridIndexPoolRotaryEmbedding(nn.Module):
    """Partial, non-interleaved RoPE shared by the attention heads and the indexer heads, through transformers' RoPE
    machinery: every `rope_type` of `ROPE_INIT_FUNCTIONS` (linear, dynamic NTK, YaRN, LongRoPE, Llama 3, ...), with
    the frequency updates of the dynamic types (which read the longest position from the device).

    With `mrope_section` in `rope_parameters` (a multimodal model) it is Qwen4-Exp's interleaved multimodal RoPE:
    positions come in three streams (time, height, width) and frequency `i` follows the height stream when
    `i % 3 == 1` and `i < 3 * mrope_section[1]`, the width stream when `i % 3 == 2` and `i < 3 * mrope_section[2]`,
    the time stream otherwise. Equal streams (text) give plain RoPE.

    `forward(x, position_ids)` takes `[batch, seq]` or `[3, batch, seq]` positions and returns `cos, sin` of shape
    `[batch, seq, rotary_dim]`.
    """

    def __init__(self, config: HybridIndexPoolConfig):
        super().__init__()
        self.config = config
        self.max_seq_len_cached = config.max_position_embeddings
        self.original_max_seq_len = config.max_position_embeddings
        self.rope_type = config.rope_parameters.get("rope_type", "default")
        self.mrope_section = config.rope_parameters.get("mrope_section")
        init_fn = self.compute_default_rope_parameters
        if self.rope_type != "default":
            init_fn = ROPE_INIT_FUNCTIONS[self.rope_type]
        inv_freq, self.attention_scaling = init_fn(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)

    @property
    def num_streams(self) -> int:
        """Position streams this RoPE reads: 3 with multimodal RoPE, else 1."""
        return 1 if self.mrope_section is None else 3

    @staticmethod
    def compute_default_rope_parameters(config: HybridIndexPoolConfig, device=None, **kwargs):
        """Inverse frequencies of plain RoPE over the rotated channels."""
        base = config.rope_parameters["rope_theta"]
        dim = config.rotary_dim
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim
        inv_freq = 1.0 / (base**exponents)
        return inv_freq, 1.0

    @torch.no_grad()
    @dynamic_rope_update
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        if position_ids.dim() == 3:  # [3, batch, seq, dim / 2]: interleave the streams' frequencies
            interleaved = freqs[0].clone()
            for stream in (1, 2):
                take = slice(stream, 3 * self.mrope_section[stream], 3)
                interleaved[..., take] = freqs[stream, ..., take]
            freqs = interleaved
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling
        return cos.to(x.dtype), sin.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """`[x1, x2] -> [-x2, x1]` over the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first `cos.shape[-1]` channels of `x`; `cos`/`sin` must broadcast against them."""
    rotary_dim = cos.shape[-1]
    rotated, passed = x[..., :rotary_dim], x[..., rotary_dim:]
    rotated = rotated * cos + rotate_half(rotated) * sin
    return torch.cat([rotated, passed], dim=-1)


def last_real_entries(sequence: torch.Tensor, num_real: torch.Tensor, count: int) -> torch.Tensor:
    """The `count` entries that end at each row's last real token, along the last dimension of `sequence`
    `[batch, ..., count + new]` (a state of `count` entries followed by the new tokens, each row's real tokens before
    its padding): the state to keep after these tokens."""
    index = num_real[:, None] + torch.arange(count, device=sequence.device)
    index = index.view(index.shape[0], *([1] * (sequence.dim() - 2)), count).expand(*sequence.shape[:-1], count)
    return sequence.gather(-1, index)


def tensor_parallel_rank(weight: torch.Tensor) -> tuple[int, int]:
    """`(rank, ranks)` of the tensor-parallel group over which transformers' TP split `weight` (a DTensor), or
    `(0, 1)` for an ordinary tensor."""
    mesh = getattr(weight, "device_mesh", None)
    if mesh is None:
        return 0, 1
    dim = "tp" if mesh.ndim > 1 and "tp" in (mesh.mesh_dim_names or ()) else None
    return mesh.get_local_rank(dim), mesh.size(dim)
