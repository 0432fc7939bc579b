"""Feed-forward blocks: the SwiGLU MLP, the routed experts with a shared expert, and the load-balancing loss."""

import torch
from torch import nn
from transformers.activations import ACT2FN
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface, use_experts_implementation
from transformers.utils import logging

from ..configuration.configuration_hybrid_indexpool import HybridIndexPoolConfig
from ..kernels.decode_linear import decode_linear
from .layers import HybridIndexPoolLinear

logger = logging.get_logger(__name__)


def load_balancing_loss(router_logits: tuple[torch.Tensor, ...], top_k: int,
                        attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Switch Transformer's load-balancing loss over the MoE layers, as transformers' MoE models compute it:
    `num_experts * sum_e f_e * P_e`, with `f_e` the top-k assignments expert `e` receives per token and `P_e` its mean
    router probability, both over the real tokens of every layer. Only `P_e` carries a gradient (to the routers).

    `router_logits`: one `[batch * seq, num_experts]` per layer; `attention_mask`: `[batch, seq]`, 0 for padding,
    which then counts for nothing.
    """
    num_experts = router_logits[0].shape[-1]
    device = router_logits[0].device
    token_weights = torch.ones(router_logits[0].shape[0], device=device)
    if attention_mask is not None:
        token_weights = attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    assignments = torch.zeros(num_experts, device=device)
    probability = torch.zeros(num_experts, device=device)
    # Summed one layer at a time: memory stays that of one layer's probabilities.
    for logits in router_logits:
        probs = logits.to(device).float().softmax(dim=-1)
        selected = probs.topk(top_k, dim=-1).indices
        assignments = assignments.index_add(0, selected.reshape(-1), token_weights.repeat_interleave(top_k))
        probability = probability + (probs * token_weights[:, None]).sum(dim=0)
    tokens = (token_weights.sum() * len(router_logits)).clamp(min=1.0)  # an all-padding batch gives 0, not NaN
    return num_experts * ((assignments / tokens) * (probability / tokens)).sum()


class HybridIndexPoolMLP(nn.Module):
    """SwiGLU MLP: `down(act(gate(x)) * up(x))`."""

    def __init__(self, config: HybridIndexPoolConfig, intermediate_size: int):
        super().__init__()
        self.gate_proj = HybridIndexPoolLinear(config.hidden_size, intermediate_size, bias=False)
        self.up_proj = HybridIndexPoolLinear(config.hidden_size, intermediate_size, bias=False)
        self.down_proj = HybridIndexPoolLinear(intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(hidden_states)) * self.up_proj(hidden_states))


def grouped_mm_fits(experts: nn.Module) -> bool:
    """Whether torch's grouped matrix product accepts these experts' operands: it needs every row stride a multiple
    of 16 bytes, that is `hidden_size` and `moe_intermediate_size` multiples of `16 / element size` (8 in half
    precision, 4 in float32)."""
    alignment = 16 // experts.down_proj.element_size()
    hidden, inner = experts.down_proj.shape[-2:]
    return hidden % alignment == 0 and inner % alignment == 0


def grouped_mm_where_it_fits(experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                             top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' `"grouped_mm"` experts, or the eager loop over the experts where torch's grouped kernel would
    refuse the widths (it raises "strides should be multiple of 16 bytes"; transformers checks only the pointers)."""
    if grouped_mm_fits(experts):  # transformers' own entry (looked up each call, as transformers dispatches)
        return ALL_EXPERTS_FUNCTIONS["grouped_mm"](experts, hidden_states, top_k_index, top_k_weights)
    hidden, inner = experts.down_proj.shape[-2:]
    alignment = 16 // experts.down_proj.element_size()
    logger.warning_once(
        f"The experts' widths (hidden_size {hidden}, moe_intermediate_size {inner}) are not both multiples of "
        f"{alignment}, which torch's grouped matrix product needs in {experts.down_proj.dtype}: the experts run as a "
        f"loop instead (same result, slower). Widths that are multiples of {alignment} use the grouped product."
    )
    return experts.expert_loop(hidden_states, top_k_index, top_k_weights)


# transformers' experts implementations, with "grouped_mm" guarded by the alignment check above.
EXPERTS_FUNCTIONS = ExpertsInterface()
EXPERTS_FUNCTIONS["grouped_mm"] = grouped_mm_where_it_fits


@use_experts_implementation(experts_interface=EXPERTS_FUNCTIONS)
class HybridIndexPoolExperts(nn.Module):
    """The routed SwiGLU experts as fused weights: `gate_up_proj [experts, 2 * inner, hidden]`,
    `down_proj [experts, hidden, inner]`.

    transformers' experts integration dispatches the computation (`config._experts_implementation`): `"grouped_mm"`
    by default (one grouped matrix product per projection, no loop over experts and no host synchronisation, so a
    decode step compiles whole; the loop where the widths do not suit the grouped kernel), `"batched_mm"`, or
    `"eager"`, the loop over the experts that were hit below.
    """

    def __init__(self, config: HybridIndexPoolConfig):
        super().__init__()
        self.num_experts = config.num_experts
        inner = config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * inner, config.hidden_size))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, config.hidden_size, inner))
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        """`hidden_states [tokens, hidden]`, `top_k_index`/`top_k_weights [tokens, k]` -> `[tokens, hidden]`."""
        return self.expert_loop(hidden_states, top_k_index, top_k_weights)

    def expert_loop(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        """The `"eager"` implementation: one pass per expert that was hit."""
        output = torch.zeros_like(hidden_states)
        for expert in top_k_index.unique().tolist():
            token_index, slot = torch.nonzero(top_k_index == expert, as_tuple=True)
            gate, up = decode_linear(hidden_states[token_index], self.gate_up_proj[expert]).chunk(2, dim=-1)
            expert_out = decode_linear(self.act_fn(gate) * up, self.down_proj[expert])
            weighted = expert_out * top_k_weights[token_index, slot, None].to(expert_out.dtype)
            output.index_add_(0, token_index, weighted.to(output.dtype))
        return output


class HybridIndexPoolSparseMoeBlock(nn.Module):
    """Mixture of experts: softmax router with top-k (renormalised when `norm_topk_prob`), routed experts, and an
    optional shared expert scaled by a sigmoid gate. Returns the output and the router logits
    `[..., num_experts]` (for the load-balancing loss)."""

    def __init__(self, config: HybridIndexPoolConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = HybridIndexPoolLinear(config.hidden_size, config.num_experts, bias=False)
        self.experts = HybridIndexPoolExperts(config)
        self.shared_expert = None
        if config.shared_expert_intermediate_size > 0:
            self.shared_expert = HybridIndexPoolMLP(config, config.shared_expert_intermediate_size)
            self.shared_expert_gate = HybridIndexPoolLinear(config.hidden_size, 1, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = hidden_states.shape
        flat = hidden_states.reshape(-1, shape[-1])
        router_logits = self.gate(flat)
        probs = router_logits.float().softmax(dim=-1)
        expert_weights, expert_ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            expert_weights = expert_weights / expert_weights.sum(dim=-1, keepdim=True)
        output = self.experts(flat, expert_ids, expert_weights.to(flat.dtype))
        if self.shared_expert is not None:
            output = output + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return output.reshape(shape), router_logits.reshape(*shape[:-1], -1)
