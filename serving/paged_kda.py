"""Kimi Delta Attention's step over vLLM's mamba state cache, in plain tensors: nothing here imports vLLM.

The vLLM layer (`vllm_kda.py`) feeds it its projections and the slices of vLLM's Gated DeltaNet metadata it reads;
the main test suite runs it on CPU against the transformers layer. Per request, the cache holds (in vLLM's layouts):

- the convolution state `[slots, kernel - 1, channels]`: the last `kernel - 1` inputs of the causal depthwise
  convolution over `[q | k | v]` (vLLM's "SD" layout; a "DS" cache is passed transposed), in the model's dtype, which
  holds the projections' outputs exactly;
- the recurrent state `[slots, heads, key_dim, value_dim]` in float32.

A step is any mix of decodes (first, one token each, as vLLM orders them) and prefill chunks. The convolution runs for
every token at once; the Kimi delta rule runs on the decodes as one batch (recurrent form) and on each prefill chunk
alone (chunked form), through `kernels.kimi_delta_rule` (flash-linear-attention's kernels on CUDA where installed, the
PyTorch reference elsewhere).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kernels.kimi_delta_rule import kimi_delta_rule


@dataclass
class KdaStepMetadata:
    """What a step reads of vLLM's Gated DeltaNet metadata (`GDNAttentionMetadata`, no speculative decoding)."""

    num_decodes: int  # the first requests, one token each
    num_prefills: int  # the requests after them
    query_start_loc: torch.Tensor  # [requests + 1] int: their token offsets
    state_indices: torch.Tensor  # [requests] int: each request's slot of the state caches
    has_initial_state: torch.Tensor | None  # [requests] bool: it continues a state (None: every request does)


def token_requests(query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """`[tokens]` the request of each of a step's tokens (requests' tokens are contiguous), on the device."""
    tokens = torch.arange(num_tokens, device=query_start_loc.device)
    return torch.searchsorted(query_start_loc[1:].long(), tokens, right=True)


def short_convolution_step(mixed: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                           metadata: KdaStepMetadata, activation: str = "silu") -> torch.Tensor:
    """The causal depthwise convolution of a step's tokens, each continuing its request's state; the states are
    updated in place to the last `kernel - 1` inputs of each request.

    `mixed [tokens, channels]` (the model's dtype), `conv_state [slots, kernel - 1, channels]` (any view),
    `weight [channels, kernel]` -> `[tokens, channels]` in `mixed`'s dtype, computed in float32 as the transformers
    layer does. No host read: every token gathers its window, from this step's rows or from its request's state.
    """
    num_tokens, kernel = mixed.shape[0], weight.shape[-1]
    starts = metadata.query_start_loc.long()
    request = token_requests(starts, num_tokens)
    slot = metadata.state_indices.long().clamp(min=0)
    continues = (torch.ones_like(slot, dtype=torch.bool) if metadata.has_initial_state is None
                 else metadata.has_initial_state.bool())
    offset = torch.arange(num_tokens, device=mixed.device) - starts[request]  # place in the request's chunk
    weight = weight.float()
    output = torch.zeros(mixed.shape, dtype=torch.float32, device=mixed.device)
    for lag in range(kernel):  # input `lag` of the window is the token `kernel - 1 - lag` places back
        back = offset - (kernel - 1 - lag)
        from_step = mixed[(starts[request] + back).clamp(min=0)]
        from_state = conv_state[slot[request], (back + kernel - 1).clamp(0, kernel - 2)]
        # A request's first chunk starts from zeros, whatever its slot holds (a selection: NaN there stays there).
        from_state = torch.where(continues[request, None], from_state, 0)
        output += torch.where((back >= 0)[:, None], from_step, from_state).float() * weight[:, lag]
    # The new state of each request: its last `kernel - 1` inputs, from this step or from its old state.
    ends = starts[1:] - starts[:-1]  # [requests] tokens of each request in the step
    back = ends[:, None] - (kernel - 1) + torch.arange(kernel - 1, device=mixed.device)  # [requests, kernel - 1]
    from_step = mixed[(starts[:-1, None] + back).clamp(min=0, max=max(num_tokens - 1, 0))]
    from_state = conv_state[slot[:, None], (back + kernel - 1).clamp(0, kernel - 2)]
    from_state = torch.where(continues[:, None, None], from_state, 0)
    new_state = torch.where((back >= 0)[..., None], from_step, from_state.to(mixed.dtype))
    conv_state[slot] = new_state.to(conv_state.dtype)
    if activation in ("silu", "swish"):
        output = F.silu(output)
    elif activation is not None:
        raise ValueError(f"short_convolution_step: activation {activation!r} is not supported; use 'silu' or None.")
    return output.to(mixed.dtype)


def kimi_delta_step(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, log_decay: torch.Tensor,
                    beta: torch.Tensor, recurrent_state: torch.Tensor, metadata: KdaStepMetadata,
                    gate_lower_bound: float | None = None) -> torch.Tensor:
    """The Kimi delta rule of a step's tokens from each request's state, the states updated in place.

    `query`/`key`/`value [tokens, heads, dim]` (after the convolution, before L2 normalisation), `log_decay [tokens,
    heads, key_dim]` float32, `beta [tokens, heads]`, `recurrent_state [slots, heads, key_dim, value_dim]` float32
    -> `[tokens, heads, value_dim]` in `value`'s dtype. Decodes run as one batch without any host read; prefill chunks
    one at a time (their offsets are read on the host once per step).
    """
    output = torch.empty_like(value)
    slots = metadata.state_indices.long()
    decodes = metadata.num_decodes
    if decodes:
        slot = slots[:decodes]
        initial = recurrent_state[slot]
        if metadata.has_initial_state is not None:
            initial = torch.where(metadata.has_initial_state[:decodes, None, None, None], initial, 0)
        step = [tensor[:decodes, None] for tensor in (query, key, value, log_decay, beta)]
        out, state = kimi_delta_rule(*step, initial_state=initial, mode="recurrent",
                                     gate_lower_bound=gate_lower_bound)
        output[:decodes] = out[:, 0]
        recurrent_state[slot] = state.to(recurrent_state.dtype)
    if metadata.num_prefills:
        requests = range(decodes, decodes + metadata.num_prefills)
        starts = metadata.query_start_loc[decodes: decodes + metadata.num_prefills + 1].tolist()
        continues = ([True] * len(requests) if metadata.has_initial_state is None
                     else metadata.has_initial_state[decodes: decodes + metadata.num_prefills].tolist())
        for request, start, end, has_state in zip(requests, starts[:-1], starts[1:], continues):
            chunk = [tensor[None, start:end] for tensor in (query, key, value, log_decay, beta)]
            initial = recurrent_state[slots[request]][None] if has_state else None
            out, state = kimi_delta_rule(*chunk, initial_state=initial, mode="chunk",
                                         gate_lower_bound=gate_lower_bound)
            output[start:end] = out[0]
            recurrent_state[slots[request]] = state[0].to(recurrent_state.dtype)
    return output


def gated_rms_norm(hidden_states: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """KDA's output norm: `weight * rms_norm(x) * sigmoid(gate)` per head, all in float32, in `x`'s dtype."""
    normed = hidden_states.float()
    normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * normed * torch.sigmoid(gate.float())).to(hidden_states.dtype)
