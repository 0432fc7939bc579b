"""Gated delta rule: chunked (prefill, training) and recurrent (decode) forms behind one entry point.

On CUDA tensors it runs flash-linear-attention's kernels, found by transformers' hub-kernel helper as transformers'
own Qwen3-Next finds them: a kernel from the Hub when kernels are requested, else the `fla` package (the optional
extra `[fla]`), else the PyTorch reference (with transformers' warning that it is slower). On other devices it runs
the reference directly. All take queries/keys before L2 normalisation and give the same results.
"""

from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback

from ..dispatch import use_fast_path
from .reference import chunk_gated_delta_rule_torch, l2_normalize, recurrent_gated_delta_rule_torch

MODES = ("chunk", "recurrent")


# The fallbacks have fla's signature (`g` the log decay; the state returned only when asked) so that the helper can
# put fla's kernels in their place.
@use_kernel_func_from_hub_with_fallback("chunk_gated_delta_rule", "fla")
def chunk_gated_delta_rule_kernel(q, k, v, g, beta, initial_state=None, output_final_state=False,
                                  use_qk_l2norm_in_kernel=False):
    """fla's `chunk_gated_delta_rule` where it is found, otherwise the PyTorch reference."""
    output, state = chunk_gated_delta_rule_torch(q, k, v, g, beta, initial_state, use_qk_l2norm_in_kernel)
    return output, state if output_final_state else None


@use_kernel_func_from_hub_with_fallback("fused_recurrent_gated_delta_rule", "fla")
def fused_recurrent_gated_delta_rule_kernel(q, k, v, g, beta, initial_state=None, output_final_state=False,
                                            use_qk_l2norm_in_kernel=False):
    """fla's `fused_recurrent_gated_delta_rule` where it is found, otherwise the PyTorch reference."""
    output, state = recurrent_gated_delta_rule_torch(q, k, v, g, beta, initial_state, use_qk_l2norm_in_kernel)
    return output, state if output_final_state else None


def gated_delta_rule(query, key, value, log_decay, beta, initial_state=None, use_qk_l2norm=True, mode="chunk"):
    """Run the gated delta rule; `mode` is `"chunk"` (many tokens) or `"recurrent"` (a few decode tokens).

    Shapes as in `chunk_gated_delta_rule_torch`. Returns the output and the final float32 state.
    """
    if mode not in MODES:
        raise ValueError(f"gated_delta_rule: mode is {mode!r}; use one of {list(MODES)}.")
    if not use_fast_path(query, key, value):
        implementation = chunk_gated_delta_rule_torch if mode == "chunk" else recurrent_gated_delta_rule_torch
        return implementation(query, key, value, log_decay, beta, initial_state, use_qk_l2norm)
    num_key_heads, num_value_heads = key.shape[2], value.shape[2]
    if num_value_heads != num_key_heads:  # fla wants a query/key head per value head
        query = query.repeat_interleave(num_value_heads // num_key_heads, dim=2)
        key = key.repeat_interleave(num_value_heads // num_key_heads, dim=2)
    kernel = chunk_gated_delta_rule_kernel if mode == "chunk" else fused_recurrent_gated_delta_rule_kernel
    output, state = kernel(
        query, key, value, g=log_decay, beta=beta.to(value.dtype), initial_state=initial_state,
        output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm,
    )
    return output, state.float()


__all__ = ["gated_delta_rule", "chunk_gated_delta_rule_torch", "recurrent_gated_delta_rule_torch", "l2_normalize"]
