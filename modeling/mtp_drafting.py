"""Drafting with the model's own multi-token-prediction (MTP) layers: what `generate(use_mtp=True)` runs.

transformers' assisted decoding alternates a draft (here: the MTP layers) with a verify forward of the model over the
last accepted token and the drafts, keeps the drafts the model agrees with (greedy) or accepts them by speculative
sampling, and crops the model's cache back. The drafts never change the tokens: only how many a verify forward yields.

MTP layer `d` (from 0) has an entry at each position `i`: it reads the depth-`d - 1` output at `i` (the model's final
hidden state, or Qwen4-Exp's residual streams, for `d = 0`) and the embedding of token `i + d + 1`, and its output
predicts token `i + d + 2` (`multi_token_prediction`). After a verify forward that leaves tokens `x_0 .. x_N` (the
model's hidden states are known for positions `0 .. N - 1`; `x_N`, the model's own next token, is not fed yet):

- depth 0 runs over the new positions up to `N - 1` and its last output drafts `x_{N+1}`;
- depth `d < num_mtp_layers` runs over its positions up to `N - 1` too, its last `d` entries reading drafted tokens,
  and its last output drafts `x_{N+d+1}`: exactly the whole-sequence MTP forward over the tokens and drafts;
- deeper drafts reuse the last MTP layer recursively, as vLLM does: one more entry at the next position, whose hidden
  input is the previous draft step's MTP output and whose token is the previous draft.

Each MTP layer keeps its entries in its layer of the model's [`HybridIndexPoolCache`] (keys/values and pooled index
keys, stored by position like the model's IndexPool layers), so a draft round costs `O(k)` entries per layer, not the
context. The prompt's forward fills them (it runs the MTP layers over the prompt, `output_mtp_hidden_states`), so the
first round, too, costs a few entries. The entries that read drafted tokens (`d` of them for layer `d`, `k - 1` for the
last layer in use) are cropped at the start of the next round and recomputed from the verified tokens.
"""

import torch
import torch.nn.functional as F
from transformers.generation.candidate_generator import CandidateGenerator

from .token_layout import TokenLayout


class HybridIndexPoolMTPCandidateGenerator(CandidateGenerator):
    """The candidate generator of `generate(use_mtp=True)` for a HybridIndexPool model with MTP layers (both
    `mtp_type`s): drafts `num_draft_tokens` tokens per round with the MTP layers (see the module docstring), one
    sequence at a time.

    Args:
        model: the `HybridIndexPoolForCausalLM` that generates (its MTP layers and head draft).
        generation_config: the call's generation config: `num_assistant_tokens` is the draft depth `k`, `do_sample`
            samples the drafts (their logits go to transformers' speculative sampling), `max_length` bounds them.
        logits_processor: applied to the drafts' logits, as to the model's.

    Counters, for benchmarks: `num_verify_forwards` (forwards that verified drafts), `num_drafted_tokens`,
    `num_accepted_tokens` (drafts the model kept), and `mean_accepted_per_verify`; after `release()` (at the end of
    `generate()`), `mtp_cache_footprint`, the MTP cache's bytes (`reserved`, `total` in use, per component).
    """

    requires_model_outputs = True

    def __init__(self, model, generation_config, logits_processor=None):
        self.text_model = model.model
        self.lm_head = model.lm_head
        config = self.text_model.config
        self.num_draft_tokens = int(generation_config.num_assistant_tokens)
        self.max_length = generation_config.max_length
        self.do_sample = bool(generation_config.do_sample)
        self.logits_processor = logits_processor
        self.first_layer_idx = config.num_hidden_layers
        self.num_layers = min(self.num_draft_tokens, config.num_mtp_layers)  # the MTP layers that draft
        self.cache = None  # the model's cache, whose MTP layers hold the MTP entries
        self.prompt_fills = False  # whether the prompt's forward fills the MTP layers (a cache that starts empty)
        self.padding = None  # left-padding columns of the row (found at the first round)
        self.start = None  # position of the first entry: the tokens the model's cache held before this generate
        self.verified = [0] * self.num_layers  # per layer: entries below this position read only verified tokens
        self.stored = [0] * self.num_layers  # per layer: entries held in its cache
        self.carry = [None] * self.num_layers  # depth-d outputs at [verified[d + 1], verified[d]), for depth d + 1
        self.drafted_last = 0
        self.num_verify_forwards = self.num_drafted_tokens = self.num_accepted_tokens = 0
        self.mtp_cache_footprint: dict[str, int] | None = None

    @property
    def num_drafting_tokens(self) -> int:
        """The drafts per round (transformers records that many recurrent states in the model's cache)."""
        return self.num_draft_tokens

    @property
    def model_kwargs_overrides(self) -> dict:
        """What every forward of the model in the generate loop also returns: what the MTP layers read; and the
        prompt's forward runs the MTP layers too, filling their cache layers."""
        if self.prompt_fills and self.start is None:
            return {"output_mtp_inputs": True, "output_mtp_hidden_states": True}
        return {"output_mtp_inputs": True}

    @property
    def mean_accepted_per_verify(self) -> float:
        """Drafts the model kept per verify forward (each verify forward also yields one token of its own)."""
        return self.num_accepted_tokens / max(self.num_verify_forwards, 1)

    def get_candidates(self, input_ids: torch.LongTensor, model_kwargs=None, model_outputs=None,
                       is_first_iteration: bool = False, n_last_matches: int = 0, **kwargs):
        """`input_ids [1, length]` (the verified tokens) -> `(input_ids and the drafts [1, length + k'], their logits
        [1, k', vocab])`, `k' <= k` within `max_length`; no drafts (and None) before the prefill forward, whose
        outputs the MTP layers need, and at the end of the budget."""
        if is_first_iteration:
            self._use_cache(model_kwargs["cache"])
            self.prompt_fills = self.cache.get_seq_length() == 0
            return input_ids, None
        if model_outputs is None or getattr(model_outputs, "mtp_inputs", None) is None:
            raise ValueError("MTP drafting needs the model's `mtp_inputs` from each verify forward (the forward is "
                             "called with output_mtp_inputs=True by generate(use_mtp=True)).")
        num_drafts = min(self.num_draft_tokens, self.max_length - input_ids.shape[1] - 1)
        if num_drafts <= 0:  # the last tokens: the rounds left verify nothing more
            self.drafted_last = 0
            return input_ids, None
        self._check_padding(input_ids, model_kwargs.get("attention_mask"))
        tokens = input_ids[0, self.padding:]  # x_0 .. x_N
        # The verify forward fed the last accepted token and `drafted_last` drafts; the model kept `n_last_matches`.
        accepted = model_outputs.mtp_inputs.shape[1] - (self.drafted_last - int(n_last_matches))
        last = tokens.shape[0] - 1  # N
        if self.start is None:  # the prefill: its real tokens from the first position the model's cache lacked
            new = min(accepted, last)
            self.start = last - new
            self.verified = [self.start] * self.num_layers
            if self.prompt_fills:
                # The prompt's forward filled depth d's entries up to N - 2 - d. The first round recomputes the last
                # L - 1 - d of them (L layers), so that every layer starts at N - L and none needs a carry.
                self.verified = [max(self.start, last - self.num_layers)] * self.num_layers
                self.stored = [max(0, last - 1 - layer) for layer in range(self.num_layers)]
        states = model_outputs.mtp_inputs[:, accepted - (last - self.verified[0]):accepted]
        for layer in range(self.num_layers):  # forget the entries that read drafts (and keep the others for good)
            self.cache.layers[self.first_layer_idx + layer].crop(
                self.stored[layer] - (self.verified[layer] - self.start))
            self.stored[layer] = self.verified[layer] - self.start
        drafts, logits = self._draft(tokens, states, num_drafts, input_ids)
        self.drafted_last = num_drafts
        self.num_drafted_tokens += num_drafts
        return torch.cat([input_ids, drafts], dim=1), logits

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int):
        """Count the verify forward and the drafts it kept (the draft depth stays constant)."""
        if self.drafted_last:
            self.num_verify_forwards += 1
            self.num_accepted_tokens += int(num_matches)

    def release(self) -> None:
        """Drop the MTP cache and round state; the counters stay, and so does the cache's last `memory_footprint()`
        (`mtp_cache_footprint`)."""
        if self.cache is not None:
            self.mtp_cache_footprint = self.draft_cache_footprint()
            for layer in self.cache.mtp_layers:  # the returned cache keeps only the model's tokens
                layer.reset()
                layer.record_past = False
        self.cache = self.carry = None

    def _use_cache(self, cache) -> None:
        """Draft into the MTP layers of the model's `cache`: entries never pass the generated length plus a round of
        drafts (their reservation), and every layer records, so that a crop of up to k entries (the drafted ones)
        reopens a window they completed. With k = 1 the one layer in use never reads a draft, so nothing of it is
        ever cropped and it records nothing (a drafting round then stores its entries as plainly as a decode step)."""
        self.cache = cache
        for layer in cache.mtp_layers[: self.num_layers]:
            layer.max_cache_len = self.max_length + self.num_draft_tokens
            if self.num_draft_tokens > 1:
                layer.activate_past_recording(recurrent_states_to_keep=self.num_draft_tokens)

    def draft_cache_footprint(self) -> dict[str, int]:
        """The bytes of the MTP layers' cache (the drafter's own), as the cache's `memory_footprint()` gives them."""
        footprint = {}
        for index in range(self.cache.num_decoder_layers, len(self.cache.layers)):
            for name, size in self.cache.memory_footprint(index).items():
                footprint[name] = footprint.get(name, 0) + size
        return footprint

    def _check_padding(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None) -> None:
        """Find the row's left padding (once) and refuse padding anywhere else."""
        if self.padding is not None:
            return
        self.padding = 0
        if attention_mask is not None:
            real = attention_mask[0].bool()
            self.padding = int((~real).sum())
            if not bool(real[self.padding:].all()):
                raise ValueError("generate(use_mtp=True) drafts for a row whose padding (attention_mask 0) is on the "
                                 "left only; remove the padding inside the row.")

    def _draft(self, tokens, states, num_drafts: int, input_ids):
        """Run the MTP layers over the new verified entries and draft `num_drafts` tokens: `(drafts [1, k'], their
        logits [1, k', vocab])`. `tokens` are `x_0 .. x_N`, `states [1, new, width]` what depth 0 reads at the new
        positions `verified[0] .. N - 1`."""
        last = tokens.shape[0] - 1
        drafts, draft_logits = [], []
        hidden = states  # the previous depth's outputs at [verified[layer], N)
        for depth in range(num_drafts):
            layer = min(depth, self.num_layers - 1)
            if depth < self.num_layers:
                # This layer's entries from its first unverified one to N - 1; entry i reads token i + layer + 1.
                begin = self.verified[layer]
                if layer > 0:
                    if self.carry[layer - 1] is not None:
                        hidden = torch.cat([self.carry[layer - 1], hidden], dim=1)
                    self.carry[layer - 1] = hidden[:, max(self.start, last - layer) - begin:
                                                   self.verified[layer - 1] - begin]
                next_ids = self._tokens(tokens, drafts, begin + layer + 1, last + layer + 1)
                hidden, head_input = self._run_layer(layer, hidden, next_ids, begin)
                self.verified[layer] = max(self.start, last - layer)
                self.stored[layer] = last - self.start
            else:
                # The last layer again, one position further: its hidden input is its own last output.
                position = last + depth - self.num_layers
                hidden, head_input = self._run_layer(layer, hidden[:, -1:], drafts[-1], position)
                self.stored[layer] += 1
            token, logits = self._pick(head_input[:, -1], input_ids, drafts)
            drafts.append(token)
            draft_logits.append(logits)
        return torch.cat(drafts, dim=1), torch.stack(draft_logits, dim=1)

    @staticmethod
    def _tokens(tokens, drafts, begin: int, end: int) -> torch.Tensor:
        """`[1, end - begin]` tokens `x_begin .. x_{end - 1}`, the drafts continuing the verified `tokens`."""
        offset = min(begin, tokens.shape[0])
        return torch.cat([tokens[None, offset:], *drafts], dim=1)[:, begin - offset:end - offset]

    def _run_layer(self, layer: int, hidden, next_ids, first_position: int):
        """MTP layer `layer` over entries at positions `first_position ...` reading `hidden [1, n, width]` and
        tokens `next_ids [1, n]`, continuing its cache: `(next depth's input, head input)`."""
        num_new = next_ids.shape[1]
        token_is_real = torch.ones_like(next_ids, dtype=torch.bool)
        layer_cache = self.cache.layers[self.first_layer_idx + layer]
        steps = torch.arange(num_new, device=next_ids.device)
        # Every entry is real: each one's position is the next after its layer's entries.
        positions = steps[None] if layer_cache.lengths is None else layer_cache.lengths[:, None] + steps
        rope_positions = (steps + first_position)[None, None].expand(self.text_model.rotary_emb.num_streams, 1, num_new)
        tokens = TokenLayout(token_is_real, positions, rope_positions)
        position_embeddings = self.text_model.position_embeddings(hidden, tokens)
        next_embeds = self.text_model.embed_tokens(next_ids)
        return self.text_model.mtp.layer_step(layer, hidden, next_embeds, position_embeddings, tokens,
                                              cache=self.cache)

    def _pick(self, head_input, input_ids, drafts) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft `[1, 1]` from the head's input `[1, hidden]` and its logits `[1, vocab]` (after the logits
        processors, which see the tokens before it: `input_ids` and the earlier `drafts`): the argmax, or a sample
        when sampling."""
        logits = self.lm_head(head_input).float()
        if self.logits_processor:  # none in plain greedy decoding: the sequence is not rebuilt for nothing
            sequence = torch.cat([input_ids, *drafts], dim=1)
            # What `LogitsProcessorList` does when called without keyword arguments (as the generate loop calls it),
            # without its per-call signature inspection of every processor (a tenth of a drafted token's time).
            for processor in self.logits_processor:
                logits = processor(sequence, logits)
        if self.do_sample:
            token = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
        else:
            token = logits.argmax(dim=-1, keepdim=True)
        return token, logits


__all__ = ["HybridIndexPoolMTPCandidateGenerator"]
