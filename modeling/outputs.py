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
    `indexer_loss`, the IndexPool layers' mean KL loss, `mtp_hidden_states`, the multi-token-prediction layers'
    outputs (one `[batch, seq, hidden]` per depth), and `mtp_inputs`, what those layers read (final hidden states, or
    Qwen4-Exp's residual streams), when asked for."""

    indexer_loss: torch.FloatTensor | None = None
    mtp_hidden_states: tuple[torch.FloatTensor, ...] | None = None
    mtp_inputs: torch.FloatTensor | None = None


@dataclass
class HybridIndexPoolCausalLMOutput(MoeCausalLMOutputWithPast):
    """`MoeCausalLMOutputWithPast` (`aux_loss`, the load-balancing loss, and `router_logits`, when router logits were
    asked for) plus `indexer_loss` and the multi-token-prediction `mtp_logits` (one `[batch, seq, vocab]` per depth)
    and `mtp_loss`, and `mtp_inputs` (what the MTP layers read, for drafting with them), when asked for; the losses
    are already included, weighted, in `loss`."""

    indexer_loss: torch.FloatTensor | None = None
    mtp_logits: tuple[torch.FloatTensor, ...] | None = None
    mtp_loss: torch.FloatTensor | None = None
    mtp_inputs: torch.FloatTensor | None = None


@dataclass
class HybridIndexPoolSequenceClassifierOutput(SequenceClassifierOutputWithPast):
    """`SequenceClassifierOutputWithPast` plus the load-balancing `aux_loss` (included, weighted, in `loss`) and the
    `router_logits`, when router logits were asked for."""

    aux_loss: torch.FloatTensor | None = None
    router_logits: tuple[torch.Tensor, ...] | None = None
