"""The language-model heads' losses: next-token cross-entropy (transformers' `loss_function`), the multi-token
prediction loss, the MoE load-balancing loss and the indexer's KL loss, weighted into one `loss` as the config says."""

import torch
import torch.nn.functional as F

from .moe import load_balancing_loss
from .outputs import HybridIndexPoolCausalLMOutput


def router_aux_loss(config, router_logits: tuple[torch.Tensor, ...] | None,
                    attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """The load-balancing loss of the router logits a forward returned (one `[batch * seq, num_experts]` per MoE
    layer; None when it returned none), over the real tokens of `attention_mask` `[batch, past + new]`."""
    if not router_logits:
        return None
    if attention_mask is not None:
        new_tokens = router_logits[0].shape[0] // attention_mask.shape[0]
        attention_mask = attention_mask[:, attention_mask.shape[1] - new_tokens:]  # the cached tokens ran before
    return load_balancing_loss(router_logits, config.num_experts_per_tok, attention_mask)


def wants_mtp_logits(config, output_mtp_logits: bool | None, labels) -> bool:
    """Whether a forward computes the MTP layers: when asked, or by default for a labelled forward whose loss weighs
    them (`mtp_loss_weight > 0`)."""
    if output_mtp_logits is None:
        return labels is not None and config.num_mtp_layers > 0 and config.mtp_loss_weight > 0
    return bool(output_mtp_logits)


def causal_lm_output(head, outputs, labels=None, logits_to_keep: int | torch.Tensor = 0,
                     attention_mask: torch.Tensor | None = None, mtp_logits: bool = False,
                     **loss_kwargs) -> HybridIndexPoolCausalLMOutput:
    """The language-model output of `head` (a model with `lm_head` and `loss_function`) from its text model's
    `outputs`: logits of the last `logits_to_keep` positions (all when 0) and, given `labels`, the loss. MTP logits
    (with `mtp_logits`, from the outputs' MTP hidden states) add `mtp_loss` (next-next token, mean over depths)
    weighted by `mtp_loss_weight`; router logits add their load-balancing `aux_loss` over the real tokens of
    `attention_mask`, weighted by `router_aux_loss_coef` (as transformers' MoE models do); indexer losses add their
    mean, weighted by `indexer_loss_weight` (alone when there are no labels)."""
    config = head.config.get_text_config()
    keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    logits = head.lm_head(outputs.last_hidden_state[:, keep, :])
    loss = None
    if labels is not None:
        loss = head.loss_function(logits=logits, labels=labels, vocab_size=config.vocab_size, **loss_kwargs)
    mtp_loss = None
    if mtp_logits:
        mtp_logits = tuple(head.lm_head(states[:, keep, :]) for states in outputs.mtp_hidden_states)
    else:
        mtp_logits = None
    if mtp_logits is not None and labels is not None:
        # Depth k's position i predicts token i + k + 2: the usual one-place shift, of the labels k + 1 ahead.
        mtp_loss = torch.stack([
            head.loss_function(logits=depth_logits, labels=F.pad(labels[:, depth + 1:], (0, depth + 1), value=-100),
                               vocab_size=config.vocab_size, **loss_kwargs)
            for depth, depth_logits in enumerate(mtp_logits)
        ]).mean()
        if config.mtp_loss_weight:
            loss = loss + config.mtp_loss_weight * mtp_loss
    router_logits = outputs.router_logits or None  # a model without experts records none
    aux_loss = router_aux_loss(config, router_logits, attention_mask)
    if aux_loss is not None and loss is not None:
        loss = loss + config.router_aux_loss_coef * aux_loss.to(loss.device)
    indexer_loss = None
    if outputs.indexer_losses:
        indexer_loss = torch.stack(outputs.indexer_losses).mean()
        weighted = config.indexer_loss_weight * indexer_loss
        loss = weighted if loss is None else loss + weighted
    return HybridIndexPoolCausalLMOutput(
        loss=loss, aux_loss=aux_loss, logits=logits, cache=outputs.cache, hidden_states=outputs.hidden_states,
        attentions=outputs.attentions, router_logits=router_logits, indexer_loss=indexer_loss,
        indexer_selections=outputs.indexer_selections, mtp_logits=mtp_logits, mtp_loss=mtp_loss,
        mtp_inputs=outputs.mtp_inputs,
    )
