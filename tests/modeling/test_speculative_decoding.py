"""Speculative decoding through transformers' generate(): prompt lookup and an assistant model give exactly the
tokens of plain greedy decoding on every variant (the cache rolls back every layer type after rejected drafts),
sampling keeps the target distribution, and a returned cache continues exactly."""

import copy
import math

import pytest
import torch
from model_factory import DRAFTING_VARIANTS as VARIANTS
from model_factory import repetitive_prompt, tiny_model
from transformers import CompileConfig, LlamaConfig, LlamaForCausalLM

from hybrid_indexpool import HybridIndexPoolCache

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

NEW_TOKENS = 24


class CropLog:
    """Records the counts `crop(-n)` removes from a HybridIndexPoolCache (to see drafts accepted and rejected)."""

    def __init__(self, monkeypatch):
        self.removed = []
        original = HybridIndexPoolCache.crop

        def crop(cache, tokens_to_remove):
            self.removed.append(-tokens_to_remove)
            return original(cache, tokens_to_remove)

        monkeypatch.setattr(HybridIndexPoolCache, "crop", crop)


def greedy(model, input_ids, **kwargs):
    with torch.no_grad():
        return model.generate(input_ids, max_new_tokens=NEW_TOKENS, do_sample=False, **kwargs)


@pytest.mark.parametrize("variant", list(VARIANTS), ids=list(VARIANTS))
def test_prompt_lookup_gives_the_greedy_tokens(variant, monkeypatch):
    """Prompts far beyond the budget (40 tokens, budget 8 or 16), drafts of 5 crossing window boundaries."""
    model = tiny_model(**VARIANTS[variant])
    input_ids = repetitive_prompt(40)
    expected = greedy(model, input_ids)
    log = CropLog(monkeypatch)
    drafted = greedy(model, input_ids, prompt_lookup_num_tokens=5)
    torch.testing.assert_close(drafted, expected, rtol=0, atol=0)
    assert any(removed > 0 for removed in log.removed)  # some drafts were rejected and rolled back


@pytest.mark.parametrize("draft_length", [1, 3, 9])
def test_the_model_as_its_own_assistant_accepts_every_draft(draft_length, monkeypatch):
    """A copy of the target drafts exactly its tokens: every draft is accepted, verify forwards of up to
    `draft_length + 1` tokens cross windows (r = 4) and the budget, and the tokens are the greedy ones."""
    model = tiny_model()
    assistant = copy.deepcopy(model)
    assistant.generation_config.num_assistant_tokens = draft_length
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    input_ids = repetitive_prompt(30, seed=1)
    expected = greedy(model, input_ids)
    log = CropLog(monkeypatch)
    drafted = greedy(model, input_ids, assistant_model=assistant)
    torch.testing.assert_close(drafted, expected, rtol=0, atol=0)
    assert log.removed and all(removed == 0 for removed in log.removed[1::2])  # the target's crops: nothing removed


@pytest.mark.parametrize("variant", list(VARIANTS), ids=list(VARIANTS))
def test_a_smaller_hybrid_assistant_gives_the_greedy_tokens(variant):
    model = tiny_model(**VARIANTS[variant])
    assistant = tiny_model(seed=1, num_hidden_layers=2, layer_types=["linear_attention", "indexpool_attention"])
    assistant.generation_config.num_assistant_tokens = 4
    input_ids = repetitive_prompt(40, seed=2)
    torch.testing.assert_close(greedy(model, input_ids, assistant_model=assistant), greedy(model, input_ids),
                               rtol=0, atol=0)


def test_a_transformers_llama_assistant_with_the_same_vocabulary_gives_the_greedy_tokens():
    model = tiny_model()
    torch.manual_seed(3)
    assistant = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=2, num_key_value_heads=1, pad_token_id=0)).eval()
    assistant.generation_config.num_assistant_tokens = 6
    input_ids = repetitive_prompt(35, seed=3)
    torch.testing.assert_close(greedy(model, input_ids, assistant_model=assistant), greedy(model, input_ids),
                               rtol=0, atol=0)


@pytest.mark.parametrize("variant", ["gdn-r4", "qwen4-exp-style"])
def test_the_cache_returned_by_assisted_generate_continues_exactly(variant):
    model = tiny_model(**VARIANTS[variant])
    input_ids = repetitive_prompt(33, seed=4)
    with torch.no_grad():
        output = model.generate(input_ids, max_new_tokens=NEW_TOKENS, do_sample=False, prompt_lookup_num_tokens=6,
                                return_dict_in_generate=True)
        sequence, cache = output.sequences, output.cache
        assert cache.get_seq_length() == sequence.shape[1] - 1  # the last token is not fed yet
        assert not any(layer.record_past for layer in cache.layers)  # recording ends with generate
        # ... leaving the plain decode's fixed shapes: compileable, the storage reserved once for the whole call
        assert cache.is_compileable and cache.memory_footprint()["rollback"] == 0
        assert all(layer.capacity == -(-(33 + NEW_TOKENS - 1) // layer.pool_size) * layer.pool_size
                   for layer in cache.index_layers)
        more = torch.randint(3, 97, (1, 6))
        continued = model(torch.cat([sequence[:, -1:], more], dim=1), cache=cache, use_cache=True).logits
        fresh = model(torch.cat([sequence, more], dim=1)).logits[:, -7:]
    torch.testing.assert_close(continued, fresh, atol=1e-4, rtol=0)


def test_assisted_decoding_refuses_a_batch_with_a_clear_error():
    model = tiny_model()
    input_ids = torch.cat([repetitive_prompt(20), repetitive_prompt(20, seed=1)])
    with pytest.raises(ValueError, match="one sequence at a time.*2 rows.*once per row"):
        greedy(model, input_ids, prompt_lookup_num_tokens=3)


@pytest.mark.parametrize("arguments, message", [
    (dict(prompt_lookup_num_tokens=0), "prompt_lookup_num_tokens is 0: the tokens prompt lookup drafts per verify "
                                       "forward; give 1 or more"),
    (dict(prompt_lookup_num_tokens=-2), "prompt_lookup_num_tokens is -2: the tokens prompt lookup drafts"),
    (dict(prompt_lookup_num_tokens=3, max_matching_ngram_size=-1), "max_matching_ngram_size is -1: the longest "
                                                                   "n-gram prompt lookup matches"),
])
def test_prompt_lookup_settings_below_one_are_refused_naming_the_argument(arguments, message):
    with pytest.raises(ValueError) as error:
        greedy(tiny_model(), repetitive_prompt(20), **arguments)
    assert str(error.value).startswith(message) and "Invalid max_matching_ngram_size" not in str(error.value)


def test_a_compile_config_with_drafting_runs_the_verify_forwards_eagerly_with_the_greedy_tokens(monkeypatch, caplog):
    """While the cache records (every verify forward) it is not compileable, so generate() verifies eagerly, says
    why, and gives the greedy tokens."""
    model = tiny_model()
    input_ids = repetitive_prompt(30, seed=5)
    config = CompileConfig(fullgraph=True)
    config._compile_all_devices = True
    compiled = []
    monkeypatch.setattr(model, "get_compiled_call", lambda compile_config: compiled.append(compile_config))
    with caplog.at_level("WARNING"):
        drafted = greedy(model, input_ids, prompt_lookup_num_tokens=4, compile_config=config)
    assert compiled == []
    assert "compile_config is not used while drafting" in caplog.text
    torch.testing.assert_close(drafted, greedy(model, input_ids), rtol=0, atol=0)


TOP_K, TEMPERATURE = 3, 0.05  # the tiny model's logits spread about 0.17: sharpened, the 3 ranks differ
FALSE_FAILURE_RATE = 1e-3


def sampled_target_ranks(model, prompt, sequences, generated_logits):
    """`[new]` the rank of each sampled token in the target's own distribution (softmax of its top-k logits over the
    temperature) and `[new, k]` that distribution, from a forward of the whole sequence; asserts the logits that
    generate() sampled from are that forward's (the cache rolled back exactly under sampling too)."""
    logits = model(sequences).logits[0, prompt.shape[1] - 1:-1]
    torch.testing.assert_close(torch.cat(generated_logits), logits, atol=1e-4, rtol=0)
    top = logits.topk(TOP_K, dim=-1)
    drawn = sequences[0, prompt.shape[1]:]
    in_top = top.indices == drawn[:, None]  # [new, k]
    assert in_top.any(dim=-1).all(), "a sampled token lies outside the target's top-k"
    return in_top.int().argmax(dim=-1), (top.values / TEMPERATURE).softmax(dim=-1)


@pytest.mark.parametrize("drafting, calls", [
    ("prompt_lookup", 12), ("assistant", 5),  # 16 new tokens per call: 192 and 80 sampled steps
    pytest.param("prompt_lookup", 120, marks=pytest.mark.slow), pytest.param("assistant", 60, marks=pytest.mark.slow),
])
def test_speculative_sampling_keeps_the_target_distribution(drafting, calls, monkeypatch):
    """Sampling with drafts (transformers' speculative sampling for an assistant, matching for prompt lookup) draws
    every token from the target's distribution given the tokens before it.

    Each step's distribution is known exactly (a forward of the final sequence), so the count of tokens drawn at
    each rank of it, minus the sum of that rank's probabilities, is a martingale of steps bounded by 1: by
    Azuma-Hoeffding, over n steps it exceeds `sqrt(n ln(2 k / rate) / 2)` for any of the k ranks with probability at
    most `rate` when the sampling is right. The drafts are both accepted and rejected (an assistant that is the target
    made overconfident), so crops of every length happen between sampled verify forwards."""
    model = tiny_model()
    kwargs = dict(prompt_lookup_num_tokens=4)
    if drafting == "assistant":
        assistant = copy.deepcopy(model)
        with torch.no_grad():
            assistant.lm_head.weight.mul_(3.0)  # the target's top tokens, overconfident: ~80% of drafts accepted
        assistant.generation_config.num_assistant_tokens = 4
        assistant.generation_config.num_assistant_tokens_schedule = "constant"
        kwargs = dict(assistant_model=assistant)
    prompt = repetitive_prompt(18, seed=1)
    log = CropLog(monkeypatch)
    ranks, probabilities = [], []
    torch.manual_seed(0)
    with torch.no_grad():
        for _ in range(calls):
            output = model.generate(prompt, max_new_tokens=16, do_sample=True, top_k=TOP_K, temperature=TEMPERATURE,
                                    output_logits=True, return_dict_in_generate=True, **kwargs)
            rank, probability = sampled_target_ranks(model, prompt, output.sequences, output.logits)
            ranks.append(rank)
            probabilities.append(probability)
    ranks, probabilities = torch.cat(ranks), torch.cat(probabilities)
    assert any(removed > 0 for removed in log.removed) and any(removed == 0 for removed in log.removed)
    observed = torch.bincount(ranks, minlength=TOP_K).double()
    expected = probabilities.double().sum(dim=0)
    bound = math.sqrt(ranks.numel() * math.log(2 * TOP_K / FALSE_FAILURE_RATE) / 2)
    assert (observed - expected).abs().max() < bound, (observed.tolist(), expected.tolist(), bound)


def test_drafts_that_grow_past_the_recording_activated_for_roll_back(monkeypatch):
    """transformers' heuristic schedule adds 2 drafts after every fully accepted round: recording was activated for
    the first count (2), yet a later verify forward's rejected drafts (more than 3) roll back."""
    model = tiny_model()
    assistant = copy.deepcopy(model)
    with torch.no_grad():  # agrees with the target on long runs, then not
        noise = torch.randn(assistant.lm_head.weight.shape, generator=torch.Generator().manual_seed(1))
        assistant.lm_head.weight.add_(0.01 * noise)
    assistant.generation_config.num_assistant_tokens = 2
    assistant.generation_config.num_assistant_tokens_schedule = "heuristic"
    input_ids = torch.randint(3, 97, (1, 20), generator=torch.Generator().manual_seed(0))
    log = CropLog(monkeypatch)
    with torch.no_grad():
        drafted = model.generate(input_ids, max_new_tokens=60, do_sample=False, assistant_model=assistant)
        expected = model.generate(input_ids, max_new_tokens=60, do_sample=False)
    torch.testing.assert_close(drafted, expected, rtol=0, atol=0)
    assert max(log.removed) > 3
