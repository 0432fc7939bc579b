"""Gated delta rule: chunked (prefill, training) and recurrent (decode) forms behind one entry point.

On CUDA tensors it runs flash-linear-attention's Triton kernels when the package is installed (the optional extra
`[fla]`); otherwise the PyTorch reference. Both take queries/keys before L2 normalisation and give the same results.
"""

from ..dispatch import use_fast_path
from .reference import chunk_gated_delta_rule_torch, l2_normalize, recurrent_gated_delta_rule_torch

try:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk_gated_delta_rule
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_recurrent_gated_delta_rule
except ImportError:  # flash-linear-attention is optional
    fla_chunk_gated_delta_rule = fla_recurrent_gated_delta_rule = None


def _fla_gated_delta_rule(query, key, value, log_decay, beta, initial_state, use_qk_l2norm, mode):
    num_key_heads, num_value_heads = key.shape[2], value.shape[2]
    if num_value_heads != num_key_heads:  # give every value head its own query/key head
        query = query.repeat_interleave(num_value_heads // num_key_heads, dim=2)
        key = key.repeat_interleave(num_value_heads // num_key_heads, dim=2)
    kernel = fla_chunk_gated_delta_rule if mode == "chunk" else fla_recurrent_gated_delta_rule
    output, state = kernel(
        query, key, value, g=log_decay, beta=beta.to(value.dtype), initial_state=initial_state,
        output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm,
    )
    return output, state.float()


def gated_delta_rule(query, key, value, log_decay, beta, initial_state=None, use_qk_l2norm=True, mode="chunk"):
    """Run the gated delta rule; `mode` is `"chunk"` (many tokens) or `"recurrent"` (a few decode tokens).

    Shapes as in `chunk_gated_delta_rule_torch`. Returns the output and the final float32 state.
    """
    if mode not in ("chunk", "recurrent"):
        raise ValueError(f"gated_delta_rule: mode is {mode!r}; use 'chunk' or 'recurrent'.")
    if fla_chunk_gated_delta_rule is not None and use_fast_path(query, key, value):
        return _fla_gated_delta_rule(query, key, value, log_decay, beta, initial_state, use_qk_l2norm, mode)
    implementation = chunk_gated_delta_rule_torch if mode == "chunk" else recurrent_gated_delta_rule_torch
    return implementation(query, key, value, log_decay, beta, initial_state, use_qk_l2norm)


__all__ = ["gated_delta_rule", "chunk_gated_delta_rule_torch", "recurrent_gated_delta_rule_torch", "l2_normalize"]
