"""Feed-forward blocks: the SwiGLU MLP, the routed experts with a shared expert, the routers (Qwen's softmax, GLM's
grouped sigmoid), and the load-balancing loss."""

import torch
import torch.nn.functional as F
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


def clamp_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """GLM-5.3-Flash's SwiGLU clamp (`swiglu_limit`): the gate to at most `limit`, the up projection to
    `[-limit, limit]`; unchanged when `limit` is None."""
    if limit is None:
        return gate, up
    return gate.clamp(max=limit), up.clamp(min=-limit, max=limit)


class HybridIndexPoolMLP(nn.Module):
    """SwiGLU MLP: `down(act(gate(x)) * up(x))`, with the projections clamped first when `swiglu_limit` is set."""

    def __init__(self, config: HybridIndexPoolConfig, intermediate_size: int):
        super().__init__()
        self.gate_proj = HybridIndexPoolLinear(config.hidden_size, intermediate_size, bias=False)
        self.up_proj = HybridIndexPoolLinear(config.hidden_size, intermediate_size, bias=False)
        self.down_proj = HybridIndexPoolLinear(intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]
        self.swiglu_limit = config.swiglu_limit

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        gate, up = clamp_swiglu(self.gate_proj(hidden_states), self.up_proj(hidden_states), self.swiglu_limit)
        return self.down_proj(self.act_fn(gate) * up)


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
    `"eager"`, the loop over the experts that were hit below. Every one of them turns the gate/up product into the
    SwiGLU through `_apply_gate`, which is where `swiglu_limit` clamps.
    """

    def __init__(self, config: HybridIndexPoolConfig):
        super().__init__()
        self.num_experts = config.num_experts
        inner = config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * inner, config.hidden_size))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, config.hidden_size, inner))
        self.act_fn = ACT2FN[config.hidden_act]
        self.swiglu_limit = config.swiglu_limit

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        """`hidden_states [tokens, hidden]`, `top_k_index`/`top_k_weights [tokens, k]` -> `[tokens, hidden]`."""
        return self.expert_loop(hidden_states, top_k_index, top_k_weights)

    def expert_loop(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        """The `"eager"` implementation: one pass per expert that was hit."""
        output = torch.zeros_like(hidden_states)
        for expert in top_k_index.unique().tolist():
            token_index, slot = torch.nonzero(top_k_index == expert, as_tuple=True)
            gated = self._apply_gate(decode_linear(hidden_states[token_index], self.gate_up_proj[expert]))
            expert_out = decode_linear(gated, self.down_proj[expert])
            weighted = expert_out * top_k_weights[token_index, slot, None].to(expert_out.dtype)
            output.index_add_(0, token_index, weighted.to(output.dtype))
        return output

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """`[tokens, 2 * inner]` gate and up products -> `[tokens, inner]` SwiGLU (clamped by `swiglu_limit`)."""
        gate, up = clamp_swiglu(*gate_up.chunk(2, dim=-1), self.swiglu_limit)
        return self.act_fn(gate) * up


class HybridIndexPoolGroupedTopkRouter(nn.Module):
    """Group-limited sigmoid router (DeepSeek-V3, GLM-5.3-Flash), in float32.

    Scores are `sigmoid(logits)`. The choice adds the per-expert `e_score_correction_bias` (a buffer, balanced outside
    back-propagation during pre-training); it ranks groups of `num_experts // n_group` experts by the sum of their two
    best scores and picks the top-k experts within the best `topk_group` groups. The weights are the chosen experts'
    scores without the bias, renormalised when `norm_topk_prob`, times `routed_scaling_factor`.
    """

    def __init__(self, config: HybridIndexPoolConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.num_experts
        self.n_group = config.n_group
        self.topk_group = config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts))

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`hidden_states [tokens, hidden]` -> router logits `[tokens, num_experts]` (before the sigmoid: what the
        load-balancing loss reads), expert weights `[tokens, k]` (float32) and expert ids `[tokens, k]`."""
        router_logits = F.linear(hidden_states.float(), self.weight.float())
        scores = router_logits.sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        per_group = choice.unflatten(-1, (self.n_group, -1))  # [tokens, n_group, experts per group]
        group_scores = per_group.topk(2, dim=-1).values.sum(dim=-1)  # [tokens, n_group]
        best_groups = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
        group_kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(-1, best_groups, True)
        choice = per_group.masked_fill(~group_kept.unsqueeze(-1), float("-inf")).flatten(-2)
        expert_ids = choice.topk(self.top_k, dim=-1, sorted=False).indices
        expert_weights = scores.gather(-1, expert_ids)
        if self.norm_topk_prob:
            expert_weights = expert_weights / (expert_weights.sum(dim=-1, keepdim=True) + 1e-20)
        return router_logits, expert_weights * self.routed_scaling_factor, expert_ids


class HybridIndexPoolSparseMoeBlock(nn.Module):
    """Mixture of experts: a router (`moe_router_type`: Qwen's softmax top-k, renormalised when `norm_topk_prob`, or
    the [`HybridIndexPoolGroupedTopkRouter`] of GLM), routed experts, and an optional shared expert, scaled by a
    sigmoid gate when `shared_expert_gate` (Qwen) or added as it is (GLM). Returns the output and the router logits
    `[tokens, num_experts]` (for the load-balancing loss; None with `returns_router_logits=False`, as in an MTP layer,
    whose routing that loss leaves out)."""

    def __init__(self, config: HybridIndexPoolConfig, returns_router_logits: bool = True):
        super().__init__()
        self.returns_router_logits = returns_router_logits
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        if config.moe_router_type == "sigmoid_grouped":
            self.gate = HybridIndexPoolGroupedTopkRouter(config)
        else:
            self.gate = HybridIndexPoolLinear(config.hidden_size, config.num_experts, bias=False)
        self.experts = HybridIndexPoolExperts(config)
        self.shared_expert = self.shared_expert_gate = None
        if config.shared_expert_intermediate_size > 0:
            self.shared_expert = HybridIndexPoolMLP(config, config.shared_expert_intermediate_size)
            if config.shared_expert_gate:
                self.shared_expert_gate = HybridIndexPoolLinear(config.hidden_size, 1, bias=False)

    def route(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`hidden_states [tokens, hidden]` -> router logits `[tokens, num_experts]`, expert weights and ids
        `[tokens, k]`."""
        if isinstance(self.gate, HybridIndexPoolGroupedTopkRouter):
            return self.gate(hidden_states)
        router_logits = self.gate(hidden_states)
        probs = router_logits.float().softmax(dim=-1)
        expert_weights, expert_ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            expert_weights = expert_weights / expert_weights.sum(dim=-1, keepdim=True)
        return router_logits, expert_weights, expert_ids

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = hidden_states.shape
        flat = hidden_states.reshape(-1, shape[-1])
        router_logits, expert_weights, expert_ids = self.route(flat)
        output = self.experts(flat, expert_ids, expert_weights.to(flat.dtype))
        if self.shared_expert_gate is not None:
            output = output + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        elif self.shared_expert is not None:
            output = output + self.shared_expert(flat)
        return output.reshape(shape), router_logits if self.returns_router_logits else None
