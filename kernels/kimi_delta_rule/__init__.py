"""Kimi delta rule (KDA): chunked (prefill, training) and recurrent (decode) forms behind one entry point.

On CUDA tensors it runs flash-linear-attention's KDA kernels when the package is installed (the optional extra
`[fla]`); otherwise the PyTorch reference. Both take queries/keys before L2 normalisation and precomputed per-channel
log decays, and give the same results.
"""

from ..dispatch import use_fast_path
from .reference import chunk_kimi_delta_rule_torch, recurrent_kimi_delta_rule_torch

try:
    from fla.ops.kda import chunk_kda as fla_chunk_kda
    from fla.ops.kda import fused_recurrent_kda as fla_recurrent_kda
except ImportError:  # flash-linear-attention is optional
    fla_chunk_kda = fla_recurrent_kda = None

# fla's chunk kernel has a faster intra-chunk path for decays bounded below by at most this much per step.
FLA_SAFE_GATE_BOUND = -5.0


def _fla_kimi_delta_rule(query, key, value, log_decay, beta, initial_state, use_qk_l2norm, gate_lower_bound, mode):
    common = dict(
        initial_state=None if initial_state is None else initial_state.float(), output_final_state=True,
        use_qk_l2norm_in_kernel=use_qk_l2norm,
    )
    if mode == "chunk":
        safe_gate = gate_lower_bound is not None and FLA_SAFE_GATE_BOUND <= gate_lower_bound < 0
        output, state = fla_chunk_kda(
            query, key, value, log_decay, beta.to(value.dtype), safe_gate=safe_gate, **common
        )
    else:
        output, state = fla_recurrent_kda(query, key, value, log_decay, beta.to(value.dtype), **common)
    return output, state.float()


def kimi_delta_rule(
    query, key, value, log_decay, beta, initial_state=None, use_qk_l2norm=True, mode="chunk", gate_lower_bound=None
):
    """Run the Kimi delta rule; `mode` is `"chunk"` (many tokens) or `"recurrent"` (a few decode tokens).

    Shapes as in `recurrent_kimi_delta_rule_torch` (log decays `[batch, seq, heads, key_dim]`). `gate_lower_bound`
    (the forget gate's lower bound, if any: every log decay is at least this) lets fla's chunk kernel take its
    bounded-gate path. Returns the output and the final float32 state.
    """
    if mode not in ("chunk", "recurrent"):
        raise ValueError(f"kimi_delta_rule: mode is {mode!r}; use 'chunk' or 'recurrent'.")
    if fla_chunk_kda is not None and use_fast_path(query, key, value):
        return _fla_kimi_delta_rule(
            query, key, value, log_decay, beta, initial_state, use_qk_l2norm, gate_lower_bound, mode
        )
    implementation = chunk_kimi_delta_rule_torch if mode == "chunk" else recurrent_kimi_delta_rule_torch
    return implementation(query, key, value, log_decay, beta, initial_state, use_qk_l2norm)


__all__ = ["kimi_delta_rule", "chunk_kimi_delta_rule_torch", "recurrent_kimi_delta_rule_torch"]
