"""Every input is either right or refused: padding on either side, masks with holes, positions, packed sequences."""

import pytest
import torch
from model_factory import tiny_model
from transformers import DataCollatorWithFlattening

from hybrid_indexpool.tokenization import byte_level_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

PROMPTS = ["hello there, a longer prompt that runs well past the budget", "hi", "abc"]


@pytest.mark.parametrize("pool_size", [1, 4])
def test_right_left_and_no_padding_generate_the_same_tokens(pool_size):
    model = tiny_model(vocab_size=259, index_topk=2 * pool_size, index_pool_size=pool_size)
    tokenizer = byte_level_tokenizer()
    assert tokenizer.padding_side == "left"  # what generation wants; the model takes either
    alone = [model.generate(**tokenizer([prompt], return_tensors="pt"), max_new_tokens=8, do_sample=False)
             for prompt in PROMPTS]
    for side in ("left", "right"):
        tokenizer.padding_side = side
        batch = tokenizer(PROMPTS, padding=True, return_tensors="pt")
        output = model.generate(**batch, max_new_tokens=8, do_sample=False)
        for row, expected in enumerate(alone):
            assert torch.equal(output[row, -8:], expected[0, -8:]), (side, row)


def test_right_padded_logits_of_real_tokens_equal_the_rows_alone_and_padding_repeats_the_last_real_token():
    model = tiny_model(index_topk=8)
    input_ids = torch.randint(1, 97, (2, 30))
    mask = torch.ones(2, 30, dtype=torch.long)
    mask[1, 19:] = 0
    with torch.no_grad():
        batch = model(input_ids, attention_mask=mask).logits
        alone = model(input_ids[1:, :19]).logits
    torch.testing.assert_close(batch[1, :19], alone[0], atol=1e-5, rtol=0)
    # A padding column carries its row's last real token's output, so logits[:, -1] is the next-token prediction.
    torch.testing.assert_close(batch[1, 19:], alone[0, -1:].expand(11, -1), atol=1e-5, rtol=0)


@pytest.mark.parametrize("with_cache", [False, True])
def test_a_mask_with_holes_equals_the_sequence_without_the_masked_tokens(with_cache):
    model = tiny_model(index_topk=8, ple_layers=[0], eos_token_id=2) if not with_cache else tiny_model(index_topk=8)
    input_ids = torch.randint(3, 97, (2, 40))
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[0, 10:13] = 0
    mask[1, 25:31] = 0
    with torch.no_grad():
        if with_cache:  # a prefill, then the rest token by token, holes included
            from hybrid_indexpool import HybridIndexPoolCache

            cache = HybridIndexPoolCache(model.config)
            pieces = [model(input_ids[:, :20], attention_mask=mask[:, :20], cache=cache).logits]
            for step in range(20, 40):
                pieces.append(model(input_ids[:, step:step + 1], attention_mask=mask[:, :step + 1],
                                    cache=cache).logits)
            logits = torch.cat(pieces, dim=1)
        else:
            logits = model(input_ids, attention_mask=mask).logits
        for row in range(2):
            real = mask[row].bool()
            alone = model(input_ids[row:row + 1, real]).logits[0]
            torch.testing.assert_close(logits[row, real], alone, atol=1e-4, rtol=0)


def test_position_ids_that_disagree_with_the_real_tokens_are_refused():
    model = tiny_model()
    input_ids = torch.randint(1, 97, (2, 12))
    with pytest.raises(ValueError, match="must count each row's real tokens"):
        model(input_ids, position_ids=torch.arange(100, 112).expand(2, -1))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :4] = 0
    with pytest.raises(ValueError, match="must count each row's real tokens"):  # padding counted as positions
        model(input_ids, attention_mask=mask, position_ids=torch.arange(12).expand(2, -1))
    with torch.no_grad():  # the counting positions are accepted and change nothing
        expected = model(input_ids, attention_mask=mask).logits
        given = model(input_ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    torch.testing.assert_close(given, expected, rtol=0, atol=0)


def test_packed_sequences_give_each_sequence_its_logits_alone():
    model = tiny_model(index_topk=8, ple_layers=[0], eos_token_id=2)
    lengths = [23, 5, 31, 1]
    sequences = [torch.randint(3, 97, (1, n)) for n in lengths]
    packed = torch.cat(sequences, dim=1)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        logits = model(packed, position_ids=position_ids).logits
        start = 0
        for sequence in sequences:
            alone = model(sequence).logits
            torch.testing.assert_close(logits[:, start:start + sequence.shape[1]], alone, atol=1e-5, rtol=0)
            start += sequence.shape[1]
        with pytest.raises(ValueError, match="packed sequences"):
            model(packed, position_ids=position_ids, use_cache=True)


def test_trainer_batches_from_data_collator_with_flattening_train_each_sequence_alone():
    model = tiny_model(index_topk=8)
    examples = [{"input_ids": torch.randint(3, 97, (n,)).tolist()} for n in (17, 9, 26)]
    batch = DataCollatorWithFlattening(return_tensors="pt")(examples)
    assert batch["input_ids"].shape[0] == 1 and "position_ids" in batch
    loss = model(**batch).loss
    # The packed loss is the token-weighted mean of each sequence's own loss.
    total, count = 0.0, 0
    for example in examples:
        ids = torch.tensor([example["input_ids"]])
        total += model(ids, labels=ids).loss * (ids.shape[1] - 1)
        count += ids.shape[1] - 1
    torch.testing.assert_close(loss, total / count, atol=1e-5, rtol=1e-5)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_a_trainer_run_on_flattened_batches(tmp_path):
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    model = tiny_model(index_topk=8).train()
    generator = torch.Generator().manual_seed(0)
    examples = Dataset.from_list([{"input_ids": torch.randint(3, 97, (int(n),), generator=generator).tolist()}
                                  for n in torch.randint(5, 40, (24,), generator=generator)])
    arguments = TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=6,
                                  learning_rate=1e-2, logging_steps=1, report_to="none", use_cpu=True,
                                  save_strategy="no", remove_unused_columns=False)
    trainer = Trainer(model=model, args=arguments, train_dataset=examples,
                      data_collator=DataCollatorWithFlattening(return_tensors="pt"))
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 4 and all(0 < loss < 10 for loss in losses) and losses[-1] < losses[0]


@pytest.mark.parametrize("row", [0, 1])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_bad_row_never_changes_the_other_rows(row, bad):
    model = tiny_model(index_topk=8)
    embeds = model.get_input_embeddings()(torch.randint(1, 97, (2, 40)))
    broken = embeds.clone()
    broken[row, 5:9] = bad
    with torch.no_grad():
        clean = model(inputs_embeds=embeds).logits
        dirty = model(inputs_embeds=broken).logits
    other = 1 - row
    torch.testing.assert_close(dirty[other], clean[other], rtol=0, atol=0)


def test_a_cache_from_another_model_or_batch_is_refused_with_what_differs():
    from hybrid_indexpool import HybridIndexPoolCache

    model = tiny_model()
    input_ids = torch.randint(1, 97, (2, 10))
    with torch.no_grad():
        cache = model(input_ids, use_cache=True).cache
        with pytest.raises(ValueError, match="holds 2 rows but the input has 3"):
            model(torch.randint(1, 97, (3, 1)), cache=cache)
        for other in (tiny_model(index_pool_size=2), tiny_model(head_dim=32, index_head_dim=32),
                      tiny_model(layer_types=["indexpool_attention"] * 4)):
            with pytest.raises(ValueError, match="built for another model"):
                other(input_ids[:, :1], cache=cache)
        with pytest.raises(ValueError, match="index_pool_size: cache 4, model 2"):
            tiny_model(index_pool_size=2)(input_ids, cache=HybridIndexPoolCache(model.config))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(input_ids=torch.tensor([[5, 97, 3]])), "outside the vocabulary"),
        (dict(input_ids=torch.tensor([[5, -1, 3]])), "outside the vocabulary"),
        (dict(input_ids=torch.tensor([[5.0, 6.0]])), "must be integers"),
        (dict(input_ids=torch.tensor([5, 6, 7])), "add a batch dimension"),
        (dict(input_ids=torch.zeros(1, 0, dtype=torch.long)), "at least one token"),
        (dict(input_ids=torch.zeros(0, 4, dtype=torch.long)), "at least one row"),
        (dict(inputs_embeds=torch.randn(1, 4, 32)), "32 wide; this model.s hidden_size is 64"),
        (dict(inputs_embeds=torch.ones(1, 4, 64, dtype=torch.long)), "floating-point"),
    ],
)
def test_malformed_inputs_get_a_message_naming_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        tiny_model()(**kwargs)


def test_embeddings_in_another_precision_are_cast_to_the_models():
    """float64 `inputs_embeds` into a float32 model (a user's pipeline) give the float32 embeddings' logits, as
    transformers' models cast them, instead of failing deep inside on mismatched dtypes."""
    model = tiny_model()
    embeds = model.get_input_embeddings()(torch.randint(1, 97, (2, 9)))
    with torch.no_grad():
        expected = model(inputs_embeds=embeds).logits
        doubled = model(inputs_embeds=embeds.double()).logits
    assert doubled.dtype == torch.float32
    torch.testing.assert_close(doubled, expected, atol=0, rtol=0)


def test_invalid_rope_settings_are_config_errors_and_scaled_rope_types_follow_transformers():
    from model_factory import tiny_config
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRotaryEmbedding

    with pytest.raises(ValueError, match="rope_type"):
        tiny_config(rope_parameters={"rope_type": "bogus", "rope_theta": 10000.0})
    with pytest.raises(ValueError, match="max_position_embeddings"):
        tiny_config(max_position_embeddings=0)
    for rope in ({"rope_type": "dynamic", "factor": 2.0}, {"rope_type": "linear", "factor": 4.0},
                 {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}):
        rope = {**rope, "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
        model = tiny_model(rope_parameters=dict(rope), max_position_embeddings=32)
        oracle = Qwen3NextRotaryEmbedding(Qwen3NextConfig(
            hidden_size=64, num_attention_heads=4, head_dim=16, rope_parameters=dict(rope),
            max_position_embeddings=32))
        positions = torch.arange(100)[None]  # beyond max_position_embeddings: dynamic NTK rescales
        x = torch.zeros(1, dtype=torch.float32)
        for ours, theirs in zip(model.model.rotary_emb(x, positions), oracle(x, positions)):
            torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


def test_returned_hidden_states_are_the_ones_the_model_used():
    model = tiny_model(prefill_chunk_length=None).train()
    output = model(torch.randint(1, 97, (2, 12)), output_hidden_states=True, use_cache=False)
    for states in output.hidden_states:
        states.retain_grad()
    output.logits.sum().backward()
    assert all(states.grad is not None and states.grad.abs().sum() > 0 for states in output.hidden_states)


def test_transformers_knows_the_class_names_and_half_precision_keeps_the_decay_in_float32(tmp_path):
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES

    assert MODEL_FOR_CAUSAL_LM_MAPPING_NAMES["hybrid_indexpool"] == "HybridIndexPoolForCausalLM"
    assert MODEL_MAPPING_NAMES["hybrid_indexpool"] == "HybridIndexPoolModel"
    tiny_model().save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    linear = loaded.model.layers[0].linear_attn
    assert linear.A_log.dtype == linear.dt_bias.dtype == torch.float32
    assert linear.in_proj_qkv.weight.dtype == torch.bfloat16
    with torch.no_grad():
        assert torch.isfinite(loaded(torch.randint(1, 97, (1, 12))).logits).all()


def test_returned_sparse_attention_weights_are_the_ones_the_output_used():
    model = tiny_model(index_topk=8, prefill_chunk_length=None).train()
    output = model(torch.randint(1, 97, (1, 40)), output_attentions=True, use_cache=False)
    weights = output.attentions[0]  # beyond the budget: the sparse path
    weights.retain_grad()
    output.logits.sum().backward()
    assert weights.grad is not None and weights.grad.abs().sum() > 0
    torch.testing.assert_close(weights.sum(-1), torch.ones_like(weights.sum(-1)))
    assert (weights[0, 0, -1] > 0).sum() < 40  # pruned: not every earlier position is attended
