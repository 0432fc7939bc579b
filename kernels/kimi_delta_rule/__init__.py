"""Kimi delta rule (KDA): chunked (prefill, training) and recurrent (decode) forms behind one entry point.

On CUDA tensors it runs flash-linear-attention's KDA kernels, found by transformers' hub-kernel helper as transformers'
own GLM-5.3-Flash finds them: a kernel from the Hub when kernels are requested, else the `fla` package (the optional
extra `[fla]`), else the PyTorch reference (with transformers' warning that it is slower). On other devices it runs
the reference directly. All take queries/keys before L2 normalisation and precomputed per-channel log decays, and give
the same results.
"""

from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback

from ..dispatch import use_fast_path
from .reference import chunk_kimi_delta_rule_torch, recurrent_kimi_delta_rule_torch

MODES = ("chunk", "recurrent")
# fla's chunk kernel has a faster intra-chunk path for decays bounded below by at most this much per step.
FLA_SAFE_GATE_BOUND = -5.0


# The fallbacks have fla's signature (`g` the log decay; the state returned only when asked) so that the helper can
# put fla's kernels in their place.
@use_kernel_func_from_hub_with_fallback("chunk_kda", "fla")
def chunk_kda_kernel(q, k, v, g, beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
                     safe_gate=False):
    """fla's `chunk_kda` where it is found, otherwise the PyTorch reference (`safe_gate` only speeds fla up)."""
    output, state = chunk_kimi_delta_rule_torch(q, k, v, g, beta, initial_state, use_qk_l2norm_in_kernel)
    return output, state if output_final_state else None


@use_kernel_func_from_hub_with_fallback("fused_recurrent_kda", "fla")
def fused_recurrent_kda_kernel(q, k, v, g, beta, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False):
    """fla's `fused_recurrent_kda` where it is found, otherwise the PyTorch reference."""
    output, state = recurrent_kimi_delta_rule_torch(q, k, v, g, beta, initial_state, use_qk_l2norm_in_kernel)
    return output, state if output_final_state else None


def kimi_delta_rule(
    query, key, value, log_decay, beta, initial_state=None, use_qk_l2norm=True, mode="chunk", gate_lower_bound=None
):
    """Run the Kimi delta rule; `mode` is `"chunk"` (many tokens) or `"recurrent"` (a few decode tokens).

    Shapes as in `recurrent_kimi_delta_rule_torch` (log decays `[batch, seq, heads, key_dim]`). `gate_lower_bound`
    (the forget gate's lower bound, if any: every log decay is at least this) lets fla's chunk kernel take its
    bounded-gate path. Returns the output and the final float32 state.
    """
    if mode not in MODES:
        raise ValueError(f"kimi_delta_rule: mode is {mode!r}; use one of {list(MODES)}.")
    if not use_fast_path(query, key, value):
        implementation = chunk_kimi_delta_rule_torch if mode == "chunk" else recurrent_kimi_delta_rule_torch
        return implementation(query, key, value, log_decay, beta, initial_state, use_qk_l2norm)
    common = dict(
        g=log_decay, beta=beta.to(value.dtype), initial_state=None if initial_state is None else initial_state.float(),
        output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm,
    )
    if mode == "chunk":
        safe_gate = gate_lower_bound is not None and FLA_SAFE_GATE_BOUND <= gate_lower_bound < 0
        output, state = chunk_kda_kernel(query, key, value, safe_gate=safe_gate, **common)
    else:
        output, state = fused_recurrent_kda_kernel(query, key, value, **common)
    return output, state.float()


__all__ = ["kimi_delta_rule", "chunk_kimi_delta_rule_torch", "recurrent_kimi_delta_rule_torch"]
