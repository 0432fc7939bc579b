"""The HybridIndexPool models' output classes: transformers' MoE outputs plus what IndexPool and multi-token
prediction add."""

from dataclasses import dataclass

import torch
from transformers.modeling_outputs import (
    MoeCausalLMOutputWithPast,
    MoeModelOutputWithPast,
    SequenceClassifierOutputWithPast,
)


@dataclass
class HybridIndexPoolModelOutput(MoeModelOutputWithPast):
    """`MoeModelOutputWithPast` plus, each when asked for (the first three recorded from the layers by transformers'
    output capture, `_can_record_outputs`):

    - `indexer_losses`: each IndexPool layer's indexer KL loss (with `indexer_loss`);
    - `indexer_selections`: the windows each full-indexer IndexPool layer selected, `[batch, seq, topk]` (`-1` for
      none; with `output_indexer_selections`; a layer whose queries all see at most the budget selects nothing);
    - `mtp_hidden_states`: the multi-token-prediction layers' outputs, one `[batch, seq, hidden]` per depth (with
      `output_mtp_hidden_states`);
    - `mtp_inputs`: what those layers read (the final hidden states, or Qwen4-Exp's residual streams before the final
      mix; with `output_mtp_inputs`).
    """

    indexer_losses: tuple[torch.FloatTensor, ...] | None = None
    indexer_selections: tuple[torch.LongTensor, ...] | None = None
    mtp_hidden_states: tuple[torch.FloatTensor, ...] | None = None
    mtp_inputs: torch.FloatTensor | None = None


@dataclass
class HybridIndexPoolCausalLMOutput(MoeCausalLMOutputWithPast):
    """`MoeCausalLMOutputWithPast` (`aux_loss`, the load-balancing loss, and `router_logits`, when router logits were
    asked for) plus `indexer_loss` (the IndexPool layers' mean indexer KL loss), `indexer_selections`, the
    multi-token-prediction `mtp_logits` (one `[batch, seq, vocab]` per depth) and `mtp_loss`, and `mtp_inputs` (what the
    MTP layers read, for drafting with them), when asked for; the losses are already included, weighted, in `loss`."""

    indexer_loss: torch.FloatTensor | None = None
    indexer_selections: tuple[torch.LongTensor, ...] | None = None
    mtp_logits: tuple[torch.FloatTensor, ...] | None = None
    mtp_loss: torch.FloatTensor | None = None
    mtp_inputs: torch.FloatTensor | None = None


@dataclass
class HybridIndexPoolSequenceClassifierOutput(SequenceClassifierOutputWithPast):
    """`SequenceClassifierOutputWithPast` plus the load-balancing `aux_loss` (included, weighted, in `loss`) and the
    `router_logits`, when router logits were asked for."""

    aux_loss: torch.FloatTensor | None = None
    router_logits: tuple[torch.Tensor, ...] | None = None
