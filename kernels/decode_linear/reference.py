"""PyTorch reference of the decode-step linear layer: `torch.nn.functional.linear`."""

import torch.nn.functional as F


def decode_linear_torch(hidden_states, weight, bias=None):
    """`hidden_states @ weight.T + bias` (`F.linear`): `hidden_states` `[..., in_features]`, `weight`
    `[out_features, in_features]`, `bias` `[out_features]` or None; returns `[..., out_features]`."""
    return F.linear(hidden_states, weight, bias)
