"""Pooling weights distilled from the attention each key receives: a training target for the learned pooling gate.

The indexer pools the raw keys of a window of `r` tokens with weights `softmax_j(G x_j + b_{p_j mod r})`
(`index_pool_weighting="learned_scalar"`: one weight per token; `"learned"`: one per channel). Through the indexer's
KL loss the gate only learns what reaches it through the pooled key's scores. This target tells it directly which
tokens of a window matter: the dense attention each token receives, summed over heads and over the queries that see
its window complete (the only queries that ever score the pooled key), normalised within the window,

    pi[c, j] = m_j / sum_{j' in c} m_j',   m_j = sum_{t: (p_t + 1) // r > c} sum_h A[t, h, j],

and the loss is `KL(pi_c || w_c)` averaged over complete windows (and over channels for a per-channel gate). Weights
that follow `pi` make the pooled key the attention-weighted mean of the window's keys instead of their plain mean.

It adds no parameter and changes nothing at inference: the model still pools with its learned gate, which starts at
zero (the mean), in the PyTorch path and the Triton pooled-key write alike. `PoolDistillation` computes the loss for
one forward of a model from hooks, so the model's code is unchanged; `IndexerTrainer(pool_distillation_weight=...)`
adds it to either stage's loss.
"""

import inspect

import torch

from .kernels.sparse_attention import masked_softmax
from .modeling.attention_indexpool import HybridIndexPoolAttentionBase


def window_token_mass(attention: torch.Tensor, positions: torch.Tensor, token_is_real: torch.Tensor,
                      pool_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The distillation target: each token's share of its window's attention, by position.

    Args:
        attention: `[batch, heads, queries, keys]` dense attention probabilities over the same tokens as queries and
            keys (a layer's input columns).
        positions: `[batch, seq]` each column's position (real tokens count from 0 in each row).
        token_is_real: `[batch, seq]` bool, False for padding.
        pool_size: `r`.

    Returns:
        target `[batch, windows, r]` (window `c` = positions `c * r .. c * r + r - 1`; rows sum to 1 where complete)
        and complete `[batch, windows]` bool (all `r` positions are real tokens of the row).
    """
    batch_size, seq_len = positions.shape
    num_windows = seq_len // pool_size
    received = attention.float().sum(dim=1)  # [batch, queries, keys]
    # A query scores window c only once the window is complete: (p_t + 1) // r > c.
    query_sees = (positions[:, :, None] + 1) // pool_size > positions[:, None, :] // pool_size
    query_sees &= token_is_real[:, :, None] & token_is_real[:, None, :]
    mass = (received * query_sees).sum(dim=1)  # [batch, keys]
    # Laid out by position (padding dropped into a spare column), then cut into windows.
    by_position = mass.new_zeros(batch_size, seq_len + 1)
    by_position.scatter_add_(1, positions.masked_fill(~token_is_real, seq_len).clamp(max=seq_len), mass)
    window_mass = by_position[:, : num_windows * pool_size].unflatten(1, (num_windows, pool_size))
    lengths = token_is_real.sum(dim=1, keepdim=True)
    complete = (torch.arange(num_windows, device=positions.device) + 1) * pool_size <= lengths
    tiny = torch.finfo(torch.float32).tiny
    target = window_mass / window_mass.sum(dim=-1, keepdim=True).clamp(min=tiny)
    return target * complete[..., None], complete


def gate_logits_by_window(gate_logits: torch.Tensor, positions: torch.Tensor, token_is_real: torch.Tensor,
                          pool_size: int) -> torch.Tensor:
    """`[batch, seq, width]` gate logits (by column) laid out by position: `[batch, seq // r, r, width]` (zeros where a
    window has no real token at that slot). Differentiable in `gate_logits`."""
    batch_size, seq_len, width = gate_logits.shape
    num_windows = seq_len // pool_size
    index = positions.masked_fill(~token_is_real, seq_len).clamp(max=seq_len)
    by_position = gate_logits.new_zeros(batch_size, seq_len + 1, width)
    by_position = by_position.scatter(1, index[..., None].expand(-1, -1, width), gate_logits)
    return by_position[:, : num_windows * pool_size].unflatten(1, (num_windows, pool_size))


def pool_distillation_loss(target: torch.Tensor, window_logits: torch.Tensor, complete: torch.Tensor) -> torch.Tensor:
    """Mean over complete windows (and gate channels) of `KL(target || softmax(window_logits))`.

    Args:
        target: `[batch, windows, r]` (rows of complete windows sum to 1), not differentiated.
        window_logits: `[batch, windows, r, width]` pooling-gate logits with the slot bias added.
        complete: `[batch, windows]` bool; a batch with no complete window gives 0.
    """
    target = target.detach().float()[..., None]
    tiny = torch.finfo(torch.float32).tiny
    log_weights = torch.log_softmax(window_logits.float(), dim=2)
    kl = (target * (target.clamp(min=tiny).log() - log_weights)).sum(dim=2).mean(dim=-1)  # [batch, windows]
    return kl[complete].sum() / complete.sum().clamp(min=1)


def within_window_concentration(attention: torch.Tensor, positions: torch.Tensor, token_is_real: torch.Tensor,
                                pool_size: int) -> dict:
    """How far the attention inside windows is from uniform, per query and shared by the queries, in nats (0: the
    mean's weights; at most `log r`). What bounds any pooling weighting, which is one per token for all queries.

    - `per_query`: for each query and each complete window it sees, `KL(a_t(. | c) || uniform)` of the head-averaged
      attention within the window, averaged with the window's attention mass `m_t(c)` as the weight;
    - `shared`: `KL(pi_c || uniform)` of the distillation target (`window_token_mass`: the attention the window's
      tokens receive from all those queries), averaged with the total mass `sum_t m_t(c)` as the weight.

    `shared` near `per_query`: queries agree on which tokens of a window matter, and per-token weights can follow
    them; `shared` far below it: each query wants other tokens, and one pooled key per window cannot serve them all.

    Args: as `window_token_mass` (`attention` `[batch, heads, queries, keys]`).
    """
    batch_size, seq_len = positions.shape
    num_windows = seq_len // pool_size
    tiny = torch.finfo(torch.float32).tiny
    averaged = attention.float().mean(dim=1)  # [batch, queries, keys]
    query_sees = (positions[:, :, None] + 1) // pool_size > positions[:, None, :] // pool_size
    query_sees &= token_is_real[:, :, None] & token_is_real[:, None, :]
    by_position = averaged.new_zeros(batch_size, seq_len, seq_len + 1)
    index = positions.masked_fill(~token_is_real, seq_len).clamp(max=seq_len)
    by_position.scatter_add_(2, index[:, None, :].expand(-1, seq_len, -1), averaged * query_sees)
    within = by_position[..., : num_windows * pool_size].unflatten(-1, (num_windows, pool_size))
    mass = within.sum(-1)  # [batch, queries, windows]
    shares = within / mass[..., None].clamp(min=tiny)
    entropy = -(shares * shares.clamp(min=tiny).log()).sum(-1)
    log_r = torch.log(torch.tensor(float(pool_size)))
    per_query = ((log_r - entropy) * mass).sum() / mass.sum().clamp(min=tiny)
    target, complete = window_token_mass(attention, positions, token_is_real, pool_size)
    total = mass.sum(dim=1) * complete  # [batch, windows]
    shared_entropy = -(target * target.clamp(min=tiny).log()).sum(-1)
    shared = ((log_r - shared_entropy) * total).sum() / total.sum().clamp(min=tiny)
    return {"per_query": float(per_query), "shared": float(shared)}


@torch.no_grad()
def layer_dense_attentions(model: torch.nn.Module, input_ids: torch.Tensor, **model_kwargs) -> list[tuple]:
    """Run `model` on `input_ids` and return, per IndexPool layer with an indexer, its dense causal attention
    `[batch, heads, seq, seq]` (recomputed from its own projections, as `PoolDistillation` does) with the layer's
    `positions` and `token_is_real`."""
    layers = [module for module in model.modules() if isinstance(module, HybridIndexPoolAttentionBase)
              and module.indexer is not None]
    entered, hooks = {}, []

    def keep_inputs(module, args, kwargs):
        entered[module] = inspect.signature(module.forward).bind(*args, **kwargs).arguments

    hooks = [layer.register_forward_pre_hook(keep_inputs, with_kwargs=True) for layer in layers]
    try:
        model(input_ids, use_cache=False, **model_kwargs)
    finally:
        for hook in hooks:
            hook.remove()
    results = []
    for layer in layers:
        inputs = entered[layer]
        attention = PoolDistillation.dense_attention(layer, inputs["hidden_states"], inputs["position_embeddings"],
                                                     inputs["positions"], inputs["token_is_real"])
        results.append((attention, inputs["positions"], inputs["token_is_real"]))
    return results


class PoolDistillation:
    """Hooks on a model's IndexPool layers that compute the pool distillation loss of the forward run inside the
    `with` block: `loss()` (differentiable in the pooling gates and slot biases only), averaged over the layers that
    have a learned pooling gate.

    Each layer's dense attention is recomputed from its own projections of the hidden states that entered it (what
    the layer attends with when nothing is pruned), so the target is the same in the dense warm-up and in the sparse
    stage.
    """

    def __init__(self, model: torch.nn.Module):
        self.layers = [module for module in model.modules() if isinstance(module, HybridIndexPoolAttentionBase)
                       and module.indexer is not None and module.indexer.learned_pooling]
        if not self.layers:
            raise ValueError(
                "Pool distillation trains a learned pooling gate, but this model has none: use index_pool_weighting "
                "'learned' or 'learned_scalar' (mean pooling has no weights to distill into).")
        self._inputs, self._gate_logits, self._hooks = {}, {}, []

    def __enter__(self) -> "PoolDistillation":
        self._inputs.clear()
        self._gate_logits.clear()
        for layer in self.layers:
            self._hooks.append(layer.register_forward_pre_hook(self._keep_inputs, with_kwargs=True))
            self._hooks.append(layer.indexer.register_forward_hook(self._keep_gate_logits(layer)))
        return self

    def __exit__(self, *exc_info) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def _keep_inputs(self, module, args, kwargs) -> None:
        self._inputs[module] = inspect.signature(module.forward).bind(*args, **kwargs).arguments

    def _keep_gate_logits(self, layer):
        def keep(module, args, outputs) -> None:
            self._gate_logits[layer] = outputs[2]  # [batch, seq, width] float32, with the gate's graph
        return keep

    def loss(self) -> torch.Tensor:
        """The loss of the forward that ran inside the block (0-dim tensor)."""
        losses = []
        for layer in self.layers:
            if layer not in self._gate_logits:
                raise RuntimeError("No forward of the model ran inside the `with PoolDistillation(model)` block.")
            inputs = self._inputs[layer]
            positions, token_is_real = inputs["positions"], inputs["token_is_real"]
            with torch.no_grad():
                attention = self.dense_attention(layer, inputs["hidden_states"], inputs["position_embeddings"],
                                                 positions, token_is_real)
                target, complete = window_token_mass(attention, positions, token_is_real, layer.pool_size)
            logits = gate_logits_by_window(self._gate_logits[layer], positions, token_is_real, layer.pool_size)
            logits = logits + layer.indexer.pool_slot_bias.float()
            losses.append(pool_distillation_loss(target, logits, complete))
        return torch.stack(losses).mean()

    @staticmethod
    def dense_attention(layer, hidden_states, position_embeddings, positions, token_is_real) -> torch.Tensor:
        """`[batch, heads, seq, seq]` causal attention probabilities of `layer` over the real tokens of its input."""
        cos, sin = position_embeddings
        projected = layer.project(hidden_states, cos, sin)
        query, key = layer.indexer_target(projected.query, projected.key)
        key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
        visible = (positions[:, None, :] <= positions[:, :, None]) & token_is_real[:, None, :]
        scores = (query.float() @ key.float().transpose(-1, -2)) * layer.scaling
        return masked_softmax(scores, visible[:, None])
