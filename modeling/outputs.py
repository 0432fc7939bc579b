"""The HybridIndexPool models' output classes: transformers' MoE outputs plus the indexer's KL loss."""

from dataclasses import dataclass

import torch
from transformers.modeling_outputs import (
    MoeCausalLMOutputWithPast,
    MoeModelOutputWithPast,
    SequenceClassifierOutputWithPast,
)


@dataclass
class HybridIndexPoolModelOutput(MoeModelOutputWithPast):
    """`MoeModelOutputWithPast` (`router_logits`: one `[batch * seq, num_experts]` per MoE layer, when asked for) plus
    `indexer_loss`, the IndexPool layers' mean KL loss when it was asked for."""

    indexer_loss: torch.FloatTensor | None = None


@dataclass
class HybridIndexPoolCausalLMOutput(MoeCausalLMOutputWithPast):
    """`MoeCausalLMOutputWithPast` (`aux_loss`, the load-balancing loss, and `router_logits`, when router logits were
    asked for) plus `indexer_loss`; both losses are already included, weighted, in `loss`."""

    indexer_loss: torch.FloatTensor | None = None


@dataclass
class HybridIndexPoolSequenceClassifierOutput(SequenceClassifierOutputWithPast):
    """`SequenceClassifierOutputWithPast` plus the load-balancing `aux_loss` (included, weighted, in `loss`) and the
    `router_logits`, when router logits were asked for."""

    aux_loss: torch.FloatTensor | None = None
    router_logits: tuple[torch.Tensor, ...] | None = None
