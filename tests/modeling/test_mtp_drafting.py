"""generate(use_mtp=True): drafting with the model's own MTP layers gives exactly the greedy tokens on every variant,
each draft is what the MTP layers give by their definition (the whole-sequence MTP forward for each layer's own depth,
the last layer reused recursively beyond), a head that agrees with the model has its drafts accepted, a round costs
O(k) MTP entries, the returned cache continues exactly, and the refusals say what to do."""

import pytest
import torch
from model_factory import DRAFTING_VARIANTS, randomize_parameters, repetitive_prompt, tiny_model
from transformers import CompileConfig
from transformers.generation.logits_process import (
    LogitsProcessorList,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
)

from hybrid_indexpool.modeling.mtp_drafting import HybridIndexPoolMTPCandidateGenerator
from hybrid_indexpool.modeling.token_layout import TokenLayout

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

NEW_TOKENS = 10
# (variant, MTP settings, draft depth k): every variant, k = 1, 2 and 3, one and two MTP layers, both MTP classes;
# beyond the MTP layers the last one drafts recursively. The slowest on 2 CPU cores run with `-m slow`.
CASES = {
    "gdn-r4-k3": ("gdn-r4", dict(num_mtp_layers=1), 3),
    "r1-k2": pytest.param("r1", dict(num_mtp_layers=1), 2, marks=pytest.mark.slow),
    "r16-2layers-k3": ("r16", dict(num_mtp_layers=2), 3),
    "fp8-k2": ("fp8", dict(num_mtp_layers=1), 2),
    "glm-style-k3": ("glm-style", dict(num_mtp_layers=1, mtp_type="deepseek"), 3),
    "qwen4-exp-style-k2": pytest.param("qwen4-exp-style", dict(num_mtp_layers=1, mtp_type="qwen4_exp"), 2,
                                       marks=pytest.mark.slow),
    "qwen4-exp-style-2layers-k3": ("qwen4-exp-style", dict(num_mtp_layers=2, mtp_type="qwen4_exp"), 3),
    "qwen3-next-k1": ("gdn-r4", dict(num_mtp_layers=1, mtp_type="qwen3_next"), 1),
}


def mtp_model(variant: str, seed: int = 0, **mtp_settings):
    """A tiny model of `variant` with random MTP layers (their zero-centred norms random too)."""
    model = tiny_model(seed, **DRAFTING_VARIANTS[variant], **mtp_settings)
    randomize_parameters(model, lambda name: "mtp" in name and "norm" in name, seed + 1, 0.3)
    return model


class DraftLog:
    """Records every round's verified tokens, drafts and draft logits, and the MTP entries each layer pass reads."""

    def __init__(self, monkeypatch):
        self.rounds, self.entries = [], []
        get_candidates, run_layer = (HybridIndexPoolMTPCandidateGenerator.get_candidates,
                                     HybridIndexPoolMTPCandidateGenerator._run_layer)

        def logged_get_candidates(generator, input_ids, **kwargs):
            candidates, logits = get_candidates(generator, input_ids, **kwargs)
            if logits is not None:
                self.rounds.append((input_ids, candidates[:, input_ids.shape[1]:], logits))
            return candidates, logits

        def logged_run_layer(generator, layer, hidden, next_ids, first_position):
            self.entries.append(next_ids.shape[1])
            return run_layer(generator, layer, hidden, next_ids, first_position)

        monkeypatch.setattr(HybridIndexPoolMTPCandidateGenerator, "get_candidates", logged_get_candidates)
        monkeypatch.setattr(HybridIndexPoolMTPCandidateGenerator, "_run_layer", logged_run_layer)


def greedy(model, input_ids, **kwargs):
    with torch.no_grad():
        return model.generate(input_ids, max_new_tokens=NEW_TOKENS, do_sample=False, **kwargs)


def run_mtp_layer(model, layer, hidden, next_ids):
    """MTP layer `layer` over one unpadded row of entries at positions 0.. without a cache: `(next input, head
    input)`."""
    tokens = TokenLayout.of_sequences(torch.arange(next_ids.shape[1])[None])
    text = model.model
    return text.mtp.layer_step(layer, hidden, text.embed_tokens(next_ids), text.position_embeddings(hidden, tokens),
                               tokens)


def drafts_by_definition(model, input_ids, drafts) -> torch.Tensor:
    """The logits `[k, vocab]` of drafts 1..k after the verified `input_ids [1, N + 1]`, by definition and without a
    cache: depth d < num_mtp_layers is the whole-sequence MTP forward's depth d at position N - 1 (over the tokens
    and the drafts); deeper, the last layer again, one position further each time, reading its own previous output."""
    last, num_drafts = input_ids.shape[1] - 1, drafts.shape[1]
    num_layers = min(num_drafts, model.config.num_mtp_layers)
    sequence = torch.cat([input_ids, drafts], dim=1)
    whole = model(sequence[:, :last + num_layers], output_mtp_logits=True, use_cache=False)
    logits = [whole.mtp_logits[depth][0, last - 1] for depth in range(num_layers)]
    if num_drafts > num_layers:
        # The last layer's inputs at positions 0 .. N - 1, by the chain of the layers before it.
        hidden = model.model(sequence[:, :last], use_cache=False, output_mtp_inputs=True).mtp_inputs
        for layer in range(num_layers - 1):
            hidden, _ = run_mtp_layer(model, layer, hidden, sequence[:, layer + 1:last + layer + 1])
        outputs, _ = run_mtp_layer(model, num_layers - 1, hidden, sequence[:, num_layers:last + num_layers])
        for extra in range(1, num_drafts - num_layers + 1):
            inputs = torch.cat([hidden, outputs[:, last - 1:last - 1 + extra]], dim=1)
            outputs, head_inputs = run_mtp_layer(model, num_layers - 1, inputs,
                                                 sequence[:, num_layers:last + num_layers + extra])
            logits.append(model.lm_head(head_inputs[0, -1]))
    return torch.stack(logits)


@pytest.mark.parametrize("variant, mtp_settings, k", list(CASES.values()), ids=list(CASES))
def test_mtp_drafting_gives_the_greedy_tokens_and_drafts_by_definition(variant, mtp_settings, k, monkeypatch):
    """Prompts far beyond the budget (34 tokens, budget 8 or 16), drafts crossing window boundaries; every round's
    drafts are the MTP layers' by definition (not with fp8 pooled keys, which the MTP cache quantises and the
    cache-free definition does not) and cost O(k) MTP entries after the prefill (checked on the first two rounds,
    whose drafts cross a window boundary, and the last)."""
    model = mtp_model(variant, **mtp_settings)
    input_ids = repetitive_prompt(34, seed=2)
    expected = greedy(model, input_ids)
    log = DraftLog(monkeypatch)
    drafted = greedy(model, input_ids, use_mtp=True, num_assistant_tokens=k)
    torch.testing.assert_close(drafted, expected, rtol=0, atol=0)
    generator = model.last_mtp_candidate_generator
    assert generator.num_draft_tokens == k and generator.num_verify_forwards == len(log.rounds) >= NEW_TOKENS // 3
    assert max(log.entries[min(k, mtp_settings["num_mtp_layers"]):]) <= k + 1 + mtp_settings["num_mtp_layers"]
    if variant == "fp8":
        return
    with torch.no_grad():
        for verified, drafts, logits in log.rounds[:2] + log.rounds[-1:]:
            torch.testing.assert_close(logits[0], drafts_by_definition(model, verified, drafts), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("num_mtp_layers, k", [(1, 2), (2, 3)])
def test_the_prompts_forward_fills_the_mtp_layers_so_the_first_round_is_a_step(num_mtp_layers, k, monkeypatch):
    """The prompt's forward runs the MTP layers over the prompt into the cache's MTP layers: the first drafting round
    runs each layer over as few entries as every later round (`num_mtp_layers` each, not the 40-token prompt), and
    the tokens are greedy's."""
    model = mtp_model("gdn-r4", num_mtp_layers=num_mtp_layers)
    input_ids = repetitive_prompt(40, seed=7)
    expected = greedy(model, input_ids)
    log = DraftLog(monkeypatch)
    torch.testing.assert_close(greedy(model, input_ids, use_mtp=True, num_assistant_tokens=k), expected, rtol=0,
                               atol=0)
    first_round = log.entries[:k]  # one layer pass per draft
    assert first_round[:num_mtp_layers] == [num_mtp_layers] * num_mtp_layers and max(first_round) <= num_mtp_layers


def agreeing_model(leak: float, **overrides):
    """A model whose layers write `leak` times their random outputs (0: it predicts the next token from the current
    one alone) and whose MTP layer predicts that same way from the token it reads: with `leak = 0` every draft is the
    model's own next token."""
    model = tiny_model(num_mtp_layers=1, **overrides)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
                parameter.mul_(0.0 if "mtp" in name else leak)
            elif "norm" in name and name.endswith("weight"):  # unit scales: norm(norm(x)) = norm(x)
                parameter.fill_(0.0)
        mtp = model.model.mtp.layers[0]
        hidden_size = model.config.hidden_size
        mtp.input_proj.weight.zero_()
        mtp.input_proj.weight[:, :hidden_size] = torch.eye(hidden_size)  # reads the token's embedding only
    return model


@pytest.mark.parametrize("k", [1, 3])
def test_an_mtp_head_that_agrees_with_the_model_has_every_draft_accepted(k):
    model = agreeing_model(leak=0.0)
    input_ids = repetitive_prompt(21, seed=3)
    drafted = greedy(model, input_ids, use_mtp=True, num_assistant_tokens=k)
    torch.testing.assert_close(drafted, greedy(model, input_ids), rtol=0, atol=0)
    generator = model.last_mtp_candidate_generator
    assert generator.num_accepted_tokens == generator.num_drafted_tokens > 0
    # Each verify forward yields its k drafts and a token of its own; the 9 tokens after the prefill's leave a last
    # one that no room remains to draft for.
    assert generator.num_verify_forwards == (NEW_TOKENS - 1) // (k + 1) and generator.mean_accepted_per_verify == k
    # The MTP cache is dropped when generate() returns; its bytes stay readable: keys/values reserved once for
    # max_length + k entries (rounded up to r = 4), float32 keys and values of 2 heads of 16.
    footprint, max_length = generator.mtp_cache_footprint, input_ids.shape[1] + NEW_TOKENS
    per_entry = 2 * 2 * 16 * 4
    assert generator.cache is None and footprint["key_value_reserved"] == per_entry * -(-(max_length + k) // 4) * 4
    assert 0 < footprint["key_value"] < footprint["key_value_reserved"]


def test_drafts_accepted_in_part_leave_the_greedy_tokens(monkeypatch):
    """Some drafts accepted and some rejected in the same generate: the model's cache keeps the accepted ones and the
    MTP layers are fed several verified positions per round."""
    model = agreeing_model(leak=0.5)
    input_ids = repetitive_prompt(30, seed=4)
    log = DraftLog(monkeypatch)
    drafted = greedy(model, input_ids, use_mtp=True, num_assistant_tokens=3)
    torch.testing.assert_close(drafted, greedy(model, input_ids), rtol=0, atol=0)
    generator = model.last_mtp_candidate_generator
    assert 0 < generator.num_accepted_tokens < generator.num_drafted_tokens
    with torch.no_grad():
        for verified, drafts, logits in log.rounds:
            torch.testing.assert_close(logits[0], drafts_by_definition(model, verified, drafts), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("k", [1, 2])
def test_the_mtp_layer_records_for_a_crop_only_when_it_reads_drafts(k, monkeypatch):
    """With k = 1 the one MTP layer in use reads only verified tokens and is never cropped: it records nothing for a
    rollback. With k = 2 its second entry reads the first draft and is cropped the next round: it records."""
    model = mtp_model("gdn-r4", num_mtp_layers=1)
    input_ids = repetitive_prompt(34, seed=2)
    seen = []
    draft = HybridIndexPoolMTPCandidateGenerator._draft

    def logged_draft(generator, *args):
        result = draft(generator, *args)
        cache = generator.cache
        seen.append((cache.mtp_layers[0].record_past, cache.memory_footprint(cache.num_decoder_layers)["rollback"]))
        return result

    monkeypatch.setattr(HybridIndexPoolMTPCandidateGenerator, "_draft", logged_draft)
    drafted = greedy(model, input_ids, use_mtp=True, num_assistant_tokens=k)
    torch.testing.assert_close(drafted, greedy(model, input_ids), rtol=0, atol=0)
    assert len(seen) >= NEW_TOKENS // 3
    assert all(records == (k > 1) and (rollback_bytes > 0) == (k > 1) for records, rollback_bytes in seen)


def test_drafts_go_through_the_logits_processors_as_the_processor_list_applies_them(monkeypatch):
    """With logits processors (a repetition penalty, n-grams not to repeat) the tokens are greedy's under the same
    processors, and each draft's logits are its logits by definition after `LogitsProcessorList`, which sees the
    verified tokens and the drafts before it (the drafter calls the processors one by one)."""
    model = mtp_model("gdn-r4", num_mtp_layers=1)
    input_ids = repetitive_prompt(34, seed=2)
    settings = dict(repetition_penalty=1.5, no_repeat_ngram_size=3)
    expected = greedy(model, input_ids, **settings)
    log = DraftLog(monkeypatch)
    drafted = greedy(model, input_ids, use_mtp=True, num_assistant_tokens=2, **settings)
    torch.testing.assert_close(drafted, expected, rtol=0, atol=0)
    processors = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.5), NoRepeatNGramLogitsProcessor(3)])
    changed = 0
    with torch.no_grad():
        for verified, drafts, logits in log.rounds:
            raw = drafts_by_definition(model, verified, drafts)
            for index in range(drafts.shape[1]):
                seen = torch.cat([verified, drafts[:, :index]], dim=1)
                processed = processors(seen, raw[index][None].float())
                torch.testing.assert_close(logits[0, index], processed[0], rtol=1e-4, atol=1e-4)
                changed += int(not torch.equal(processed, raw[index][None].float()))
    assert changed > 0  # the processors did change the drafts' logits


@pytest.mark.parametrize("variant", ["gdn-r4", pytest.param("qwen4-exp-style", marks=pytest.mark.slow)])
def test_the_cache_returned_by_mtp_drafting_continues_exactly(variant):
    """A second generate from the returned cache, plain or drafting again, gives the greedy continuation."""
    settings = dict(num_mtp_layers=1, mtp_type="qwen4_exp" if variant == "qwen4-exp-style" else "deepseek")
    model = mtp_model(variant, **settings)
    input_ids = repetitive_prompt(25, seed=5)
    with torch.no_grad():
        output = model.generate(input_ids, max_new_tokens=9, do_sample=False, use_mtp=True, num_assistant_tokens=2,
                                return_dict_in_generate=True)
        sequence, cache = output.sequences, output.cache
        assert cache.get_seq_length() == sequence.shape[1] - 1
        assert not any(layer.record_past for layer in cache.layers)
        continued = model.generate(sequence, cache=cache, max_new_tokens=7, do_sample=False, use_mtp=True,
                                   num_assistant_tokens=3)
        expected = model.generate(input_ids, max_new_tokens=16, do_sample=False)
    torch.testing.assert_close(continued, expected, rtol=0, atol=0)


def test_the_draft_depth_defaults_to_one_per_mtp_layer():
    model = mtp_model("gdn-r4", num_mtp_layers=2)
    greedy(model, repetitive_prompt(12), use_mtp=True)
    assert model.last_mtp_candidate_generator.num_draft_tokens == 2


def test_sampled_mtp_drafting_returns_valid_tokens():
    model = mtp_model("gdn-r4", num_mtp_layers=1)
    torch.manual_seed(0)
    with torch.no_grad():
        output = model.generate(repetitive_prompt(15), max_new_tokens=10, do_sample=True, use_mtp=True,
                                num_assistant_tokens=2)
    assert output.shape == (1, 25) and bool(((output >= 0) & (output < 97)).all())


def test_a_compile_config_with_mtp_drafting_verifies_eagerly_with_the_greedy_tokens():
    """While the model's cache records (every verify forward) it is not compileable: generate() verifies eagerly."""
    model = mtp_model("gdn-r4", num_mtp_layers=1)
    input_ids = repetitive_prompt(20, seed=6)
    config = CompileConfig(fullgraph=True)
    config._compile_all_devices = True
    drafted = greedy(model, input_ids, use_mtp=True, num_assistant_tokens=2, compile_config=config)
    torch.testing.assert_close(drafted, greedy(model, input_ids), rtol=0, atol=0)


@pytest.mark.parametrize("settings, kwargs, message", [
    (dict(num_mtp_layers=0), {}, r"has none \(num_mtp_layers is 0\); train some with scripts/train_mtp.py"),
    (dict(num_mtp_layers=1), dict(num_assistant_tokens=0), r"num_assistant_tokens is 0: .* give 1 or more"),
], ids=["no-mtp-layers", "zero-depth"])
def test_refusals_say_what_to_do(settings, kwargs, message):
    model = tiny_model(**settings)
    with pytest.raises(ValueError, match=message) as error:
        greedy(model, repetitive_prompt(8), use_mtp=True, **kwargs)
    assert "\n" not in str(error.value)


def test_a_batch_is_refused_in_one_line():
    model = mtp_model("gdn-r4", num_mtp_layers=1)
    input_ids = torch.cat([repetitive_prompt(10), repetitive_prompt(10, seed=1)])
    with pytest.raises(ValueError, match=r"use_mtp\) verifies one sequence at a time.*2 rows.*once per row") as error:
        greedy(model, input_ids, use_mtp=True, num_assistant_tokens=2)
    assert "\n" not in str(error.value)
