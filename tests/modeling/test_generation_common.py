"""A compact version of transformers' common generation tests, for every padding side: each row generates what it
would alone, with or without a cache, greedy, sampling and beams, continuing from a returned cache, and from
`inputs_embeds`. Rows run past the budget (sparse selection) and one row is shorter than a window."""

import copy

import pytest
import torch
from model_factory import tiny_model

from hybrid_indexpool import HybridIndexPoolCache

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

LENGTHS = [26, 19, 3]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def model():
    return tiny_model(index_topk=8, eos_token_id=None)


def padded_batch(padding: str):
    """Rows of LENGTHS real tokens, padded on `padding` ("left", "right") to the longest, or all of the longest
    ("none")."""
    generator = torch.Generator().manual_seed(7)
    total = max(LENGTHS)
    lengths = [total] * len(LENGTHS) if padding == "none" else LENGTHS
    input_ids = torch.zeros(len(lengths), total, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    rows = []
    for row, length in enumerate(lengths):
        tokens = torch.randint(1, 97, (length,), generator=generator)
        columns = slice(total - length, total) if padding != "right" else slice(0, length)
        input_ids[row, columns], mask[row, columns] = tokens, 1
        rows.append(tokens[None])
    return input_ids, mask, rows


PADDINGS = pytest.mark.parametrize("padding", ["none", "left", "right"])


def new_tokens(sequences, input_ids):
    return sequences[:, input_ids.shape[1]:]


@PADDINGS
def test_greedy_dict_outputs_match_each_row_alone(model, padding):
    input_ids, mask, rows = padded_batch(padding)
    output = model.generate(input_ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                            return_dict_in_generate=True, output_scores=True, output_logits=True)
    assert output.sequences.shape == (len(rows), input_ids.shape[1] + NEW_TOKENS)
    assert len(output.scores) == len(output.logits) == NEW_TOKENS
    assert all(torch.isfinite(logits).all() for logits in output.logits)
    assert isinstance(output.cache, HybridIndexPoolCache)
    for row, tokens in enumerate(rows):
        alone = model.generate(tokens, max_new_tokens=NEW_TOKENS, do_sample=False)
        assert torch.equal(new_tokens(output.sequences, input_ids)[row], new_tokens(alone, tokens)[0])


@PADDINGS
def test_greedy_with_cache_equals_without(model, padding):
    input_ids, mask, _ = padded_batch(padding)
    cached = model.generate(input_ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    uncached = model.generate(input_ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                              use_cache=False)
    assert torch.equal(cached, uncached)


@PADDINGS
def test_sampling_with_cache_equals_without_and_returns_every_sequence(model, padding):
    input_ids, mask, _ = padded_batch(padding)
    outputs = []
    for use_cache in (True, False):
        torch.manual_seed(11)
        outputs.append(model.generate(input_ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=True,
                                      top_k=10, num_return_sequences=2, use_cache=use_cache))
    assert outputs[0].shape == (2 * len(LENGTHS), input_ids.shape[1] + NEW_TOKENS)
    assert torch.equal(outputs[0], outputs[1])
    assert torch.equal(outputs[0][::2, : input_ids.shape[1]], input_ids)


@PADDINGS
def test_beam_search_with_cache_equals_without(model, padding):
    input_ids, mask, _ = padded_batch(padding)
    settings = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, num_beams=3, num_return_sequences=2,
                    do_sample=False)
    cached = model.generate(input_ids, **settings)
    uncached = model.generate(input_ids, use_cache=False, **settings)
    assert cached.shape == (2 * len(LENGTHS), input_ids.shape[1] + NEW_TOKENS)
    assert torch.equal(cached, uncached)


@PADDINGS
def test_continuing_from_a_returned_cache_equals_one_generation(model, padding):
    input_ids, mask, _ = padded_batch(padding)
    whole = model.generate(input_ids, attention_mask=mask, max_new_tokens=2 * NEW_TOKENS, do_sample=False)
    first = model.generate(input_ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                           return_dict_in_generate=True)
    longer_mask = torch.cat([mask, mask.new_ones(mask.shape[0], NEW_TOKENS)], dim=1)
    reserved = first.cache.memory_footprint()["reserved"]
    second = model.generate(first.sequences, attention_mask=longer_mask, cache=first.cache,
                            max_new_tokens=NEW_TOKENS, do_sample=False)
    assert torch.equal(second, whole)
    assert first.cache.memory_footprint()["reserved"] > reserved  # grown once for the second call's tokens


@PADDINGS
def test_generating_from_inputs_embeds_equals_from_input_ids(model, padding):
    input_ids, mask, _ = padded_batch(padding)
    from_ids = model.generate(input_ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    embeds = model.get_input_embeddings()(input_ids)
    from_embeds = model.generate(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                                 do_sample=False)
    assert torch.equal(from_embeds, new_tokens(from_ids, input_ids))


@pytest.mark.parametrize("padding", ["none", "left"])
@pytest.mark.parametrize("drafting", ["prompt_lookup", "assistant"])
def test_drafting_dict_outputs_match_greedy(model, drafting, padding):
    """As transformers' assisted and prompt-lookup common tests: one row (left-padded or not) drafted by prompt
    lookup or by the model itself as its assistant gives greedy's sequences, scores and logits."""
    phrase = torch.randint(1, 97, (5,), generator=torch.Generator().manual_seed(3))
    input_ids = phrase.repeat(4)[None, :19]
    mask = torch.ones_like(input_ids)
    if padding == "left":
        input_ids = torch.cat([torch.zeros(1, 7, dtype=torch.long), input_ids], dim=1)
        mask = torch.cat([torch.zeros(1, 7, dtype=torch.long), mask], dim=1)
    settings = dict(attention_mask=mask, max_new_tokens=2 * NEW_TOKENS, do_sample=False, return_dict_in_generate=True,
                    output_scores=True, output_logits=True)
    assistant = copy.deepcopy(model)
    assistant.generation_config.num_assistant_tokens = 3
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    drafts = dict(prompt_lookup_num_tokens=3) if drafting == "prompt_lookup" else dict(assistant_model=assistant)
    greedy = model.generate(input_ids, **settings)
    drafted = model.generate(input_ids, **settings, **drafts)
    assert torch.equal(drafted.sequences, greedy.sequences)
    for name in ("scores", "logits"):
        torch.testing.assert_close(torch.cat(getattr(drafted, name)), torch.cat(getattr(greedy, name)), atol=1e-4,
                                   rtol=0)
