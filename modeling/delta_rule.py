"""How a linear-attention layer (Gated DeltaNet, Kimi Delta Attention) runs its delta rule over a cache: the replay a
crop left, the new tokens, and what a recording keeps so that a later crop can remove them."""

import torch

from .cache_layers import LinearAttentionLayerCache
from .layers import FEW_TOKENS


def continue_delta_rule(rule, inputs: tuple[torch.Tensor, ...], token_is_real: torch.Tensor,
                        layer_cache: LinearAttentionLayerCache | None, conv_state: torch.Tensor | None,
                        conv_input: torch.Tensor | None) -> torch.Tensor:
    """Run `rule(query, key, value, log_decay, beta, initial_state, mode=...) -> (output, final_state)` over the new
    tokens' `inputs` (`[batch, new, ...]` each, padding already a no-op), continuing `layer_cache`, and store the states
    after them there: the convolution state `conv_state` the layer computed and the rule's final state. Returns the
    rule's output.

    With a cache, a crop's pending replay runs first (the kept recorded tokens from their checkpoint; its output is
    not needed), and while the cache records, `conv_input [batch, channels, kernel - 1 + new]` and the recorded
    tokens' inputs go to it: a forward longer than a crop may remove runs its rule in two pieces, so that the state
    where its recording starts is known. A few tokens over a state run token by token (decode, a verify forward).
    """
    state = None
    if layer_cache is not None:
        state = layer_cache.recurrent_states[0]
        if layer_cache.replay_inputs is not None:
            checkpoint, recorded = layer_cache.replay_state, layer_cache.replay_inputs
            few = checkpoint is not None and recorded[0].shape[1] <= FEW_TOKENS
            _, state = rule(*recorded, checkpoint, mode="recurrent" if few else "chunk")
    mode = "recurrent" if state is not None and inputs[0].shape[1] <= FEW_TOKENS else "chunk"
    start = None if layer_cache is None else layer_cache.recording_start(token_is_real)
    head = None
    if start:  # the untracked head of a long recorded forward
        head, state = rule(*(x[:, :start] for x in inputs), state, mode="chunk")
        mode = "chunk"
    tail = inputs if not start else tuple(x[:, start:] for x in inputs)
    output, final_state = rule(*tail, state, mode=mode)
    if layer_cache is not None:
        layer_cache.update_recurrent_state(final_state, checkpoint=state, rule_inputs=tail, start=start)
        layer_cache.update_conv_state(conv_state, window_input=conv_input, token_is_real=token_is_real, start=start)
    return output if head is None else torch.cat([head, output], dim=1)
