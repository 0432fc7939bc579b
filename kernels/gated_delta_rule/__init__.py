"""Gated delta rule: chunked (prefill, training) and recurrent (decode) forms behind one entry point."""

from .reference import chunk_gated_delta_rule_torch, l2_normalize, recurrent_gated_delta_rule_torch


def gated_delta_rule(query, key, value, log_decay, beta, initial_state=None, use_qk_l2norm=True, mode="chunk"):
    """Run the gated delta rule; `mode` is `"chunk"` (many tokens) or `"recurrent"` (a few decode tokens).

    Shapes as in `chunk_gated_delta_rule_torch`. Returns the output and the final float32 state.
    """
    if mode == "chunk":
        return chunk_gated_delta_rule_torch(query, key, value, log_decay, beta, initial_state, use_qk_l2norm)
    if mode == "recurrent":
        return recurrent_gated_delta_rule_torch(query, key, value, log_decay, beta, initial_state, use_qk_l2norm)
    raise ValueError(f"gated_delta_rule: mode is {mode!r}; use 'chunk' or 'recurrent'.")


__all__ = ["gated_delta_rule", "chunk_gated_delta_rule_torch", "recurrent_gated_delta_rule_torch", "l2_normalize"]
