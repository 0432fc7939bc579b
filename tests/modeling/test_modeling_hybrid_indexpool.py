"""The model as a Hugging Face model: padding, generation, save/load, Auto classes, training, outputs."""

import pytest
import torch
from model_factory import tiny_config, tiny_model
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

from hybrid_indexpool import (
    HybridIndexPoolCache,
    HybridIndexPoolForCausalLM,
    HybridIndexPoolForSequenceClassification,
    HybridIndexPoolModel,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def left_padded_batch(lengths, total, seed=0):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.zeros(len(lengths), total, dtype=torch.long)
    mask = torch.zeros(len(lengths), total, dtype=torch.long)
    for row, length in enumerate(lengths):
        input_ids[row, total - length:] = torch.randint(1, 97, (length,), generator=generator)
        mask[row, total - length:] = 1
    return input_ids, mask


@pytest.mark.parametrize("pool_size", [1, 4])
def test_left_padded_rows_equal_each_row_alone(pool_size):
    model = tiny_model(index_pool_size=pool_size, index_topk=2 * pool_size)
    lengths = [37, 30, 23]
    input_ids, mask = left_padded_batch(lengths, 37)
    with torch.no_grad():
        batch_logits = model(input_ids, attention_mask=mask).logits
        batch_tokens = model.generate(input_ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
        for row, length in enumerate(lengths):
            alone_ids = input_ids[row:row + 1, 37 - length:]
            alone_logits = model(alone_ids).logits
            torch.testing.assert_close(batch_logits[row, 37 - length:], alone_logits[0], atol=1e-4, rtol=0)
            alone_tokens = model.generate(alone_ids, max_new_tokens=12, do_sample=False)
            assert batch_tokens[row, 37:].tolist() == alone_tokens[0, length:].tolist()


def test_generate_builds_our_cache_and_greedy_equals_no_cache_greedy():
    model = tiny_model()
    input_ids = torch.randint(1, 97, (2, 19))
    with torch.no_grad():
        out = model.generate(input_ids, max_new_tokens=15, do_sample=False, return_dict_in_generate=True)
        no_cache = model.generate(input_ids, max_new_tokens=15, do_sample=False, use_cache=False)
    assert isinstance(out.cache, HybridIndexPoolCache)
    assert torch.equal(out.sequences, no_cache)


def test_beam_search_with_and_without_cache_agree_and_sampling_runs():
    model = tiny_model()
    input_ids = torch.randint(1, 97, (2, 17))
    with torch.no_grad():
        beams = model.generate(input_ids, max_new_tokens=10, num_beams=3, do_sample=False)
        beams_no_cache = model.generate(input_ids, max_new_tokens=10, num_beams=3, do_sample=False, use_cache=False)
        sampled = model.generate(input_ids, max_new_tokens=10, do_sample=True, top_k=5, num_return_sequences=2)
    assert torch.equal(beams, beams_no_cache)
    assert sampled.shape == (4, 27) and torch.equal(sampled[::2, :17], input_ids)


def test_cache_argument_and_legacy_past_key_values_name():
    model = tiny_model()
    input_ids = torch.randint(1, 97, (1, 12))
    with torch.no_grad():
        cache = model(input_ids[:, :10], use_cache=True).cache
        new = model(input_ids[:, 10:], cache=cache).logits
        legacy_cache = model(input_ids[:, :10], use_cache=True).cache
        legacy = model(input_ids[:, 10:], past_key_values=legacy_cache).logits
    torch.testing.assert_close(new, legacy)
    torch.testing.assert_close(new, model(input_ids).logits[:, 10:], atol=1e-5, rtol=0)


def test_save_and_load_round_trip_and_auto_classes(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    assert AutoConfig.from_pretrained(tmp_path).model_type == "hybrid_indexpool"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is HybridIndexPoolForCausalLM
    input_ids = torch.randint(1, 97, (2, 30))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids).logits, model(input_ids).logits)
    assert type(AutoModel.from_pretrained(tmp_path)) is HybridIndexPoolModel
    classifier = AutoModelForSequenceClassification.from_pretrained(tmp_path)
    assert type(classifier) is HybridIndexPoolForSequenceClassification


def test_tied_embeddings_share_one_tensor_and_survive_save_load(tmp_path):
    model = tiny_model(tie_word_embeddings=True)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.save_pretrained(tmp_path)
    loaded = HybridIndexPoolForCausalLM.from_pretrained(tmp_path)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(loaded.lm_head.weight, model.lm_head.weight)


def test_initialisation_follows_the_design():
    torch.manual_seed(0)
    model = HybridIndexPoolForCausalLM(tiny_config())
    indexer = model.model.layers[3].self_attn.indexer
    assert torch.count_nonzero(indexer.pool_gate_proj.weight) == 0 and torch.count_nonzero(indexer.pool_slot_bias) == 0
    assert torch.count_nonzero(model.model.norm.weight) == 0  # zero-centred norm: scale 1
    assert torch.all(model.model.layers[0].linear_attn.norm.weight == 1)
    assert 0.01 < model.lm_head.weight.std() < 0.03


def test_backward_gives_finite_gradients_and_checkpointing_gives_the_same_ones():
    model = tiny_model(index_topk=4, index_head_weights=True).train()
    input_ids = torch.randint(1, 97, (2, 33))
    loss = model(input_ids, labels=input_ids).loss
    loss.backward()
    reference = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    assert all(torch.isfinite(g).all() for g in reference.values())
    assert reference["model.layers.0.linear_attn.A_log"].abs().sum() > 0
    assert reference["model.layers.3.self_attn.q_proj.weight"].abs().sum() > 0
    model.zero_grad()
    model.activation_checkpointing_enable()
    model(input_ids, labels=input_ids).loss.backward()
    for name, grad in reference.items():
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, grad, atol=1e-6, rtol=1e-5)


def test_a_few_optimizer_steps_lower_the_loss():
    model = tiny_model().train()
    input_ids = torch.randint(1, 97, (4, 24))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        loss = model(input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1


def test_outputs_hidden_states_attentions_embeds_and_logits_to_keep():
    model = tiny_model(num_hidden_layers=8)
    input_ids = torch.randint(1, 97, (2, 26))
    with torch.no_grad():
        out = model(input_ids, output_hidden_states=True, output_attentions=True)
        embeds = model(inputs_embeds=model.get_input_embeddings()(input_ids)).logits
        last = model(input_ids, logits_to_keep=1).logits
    assert len(out.hidden_states) == 9 and out.hidden_states[0].shape == (2, 26, 64)
    assert len(out.attentions) == 2 and out.attentions[0].shape == (2, 4, 26, 26)
    attention = out.attentions[0]
    torch.testing.assert_close(attention.sum(-1), torch.ones(2, 4, 26))
    assert torch.count_nonzero(attention.triu(1)) == 0  # causal
    # Beyond the budget each query attends at most to budget + r - 1 = 11 tokens.
    assert int((attention > 0).sum(-1).max()) <= 11
    torch.testing.assert_close(embeds, out.logits)
    torch.testing.assert_close(last, out.logits[:, -1:])


def test_attention_weights_cover_every_mask_column_with_zeros_on_padding():
    """transformers' convention `[batch, heads, queries, past + new columns]`: a padded row's weights are the row's
    own at its real columns (left padding and a hole), zero elsewhere; a decode step covers past and new columns;
    packed sequences attend only within their own columns."""
    model = tiny_model(prefill_chunk_length=None)
    input_ids, mask = left_padded_batch([26, 17], 26)
    mask[1, 15] = 0  # a hole
    real = mask[1].bool()
    with torch.no_grad():
        batched = model(input_ids, attention_mask=mask, output_attentions=True)
        alone = model(input_ids[1:, real], output_attentions=True)
        step = model(torch.tensor([[5], [6]]), attention_mask=torch.cat([mask, torch.ones(2, 1)], 1).long(),
                     cache=batched.cache, output_attentions=True)
        packed_ids = torch.cat([input_ids[:1, :10], input_ids[:1, 10:16]], dim=1)
        packed = model(packed_ids, position_ids=torch.cat([torch.arange(10), torch.arange(6)])[None],
                       output_attentions=True, use_cache=False)
    weights = batched.attentions[0]
    assert weights.shape == (2, 4, 26, 26)
    torch.testing.assert_close(weights[1][:, real][:, :, real], alone.attentions[0][0])
    assert torch.count_nonzero(weights[1][:, real][:, :, ~real]) == 0
    assert step.attentions[0].shape == (2, 4, 1, 27)
    torch.testing.assert_close(step.attentions[0].sum(-1), torch.ones(2, 4, 1))
    assert torch.count_nonzero(step.attentions[0][1, :, :, :27 - 1][:, :, ~real]) == 0
    assert torch.count_nonzero(packed.attentions[0][0, :, 10:, :10]) == 0  # the second sequence sees only itself


def test_sequence_classification_scores_the_last_real_token():
    torch.manual_seed(0)
    model = HybridIndexPoolForSequenceClassification(tiny_config(num_labels=3)).eval()
    input_ids, mask = left_padded_batch([20, 11], 20)
    with torch.no_grad():
        logits = model(input_ids, attention_mask=mask).logits
        alone = model(input_ids[1:, 9:]).logits
    assert logits.shape == (2, 3)
    torch.testing.assert_close(logits[1], alone[0], atol=1e-5, rtol=0)
    loss = model(input_ids, attention_mask=mask, labels=torch.tensor([0, 2])).loss
    assert torch.isfinite(loss)


def test_mixture_of_experts_forward_backward_and_cache():
    model = tiny_model(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48)
    input_ids = torch.randint(1, 97, (2, 20))
    with torch.no_grad():
        full = model(input_ids).logits
        cache = model(input_ids[:, :15], use_cache=True).cache
        tail = model(input_ids[:, 15:], cache=cache).logits
    torch.testing.assert_close(tail, full[:, 15:], atol=1e-4, rtol=0)
    model.train()
    model(input_ids, labels=input_ids).loss.backward()
    assert model.model.layers[0].mlp.experts.gate_up_proj.grad.abs().sum() > 0


def test_experts_run_through_transformers_integration_and_every_implementation_agrees():
    model = tiny_model(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48)
    assert model.config._experts_implementation == "grouped_mm"  # the default: no loop over experts
    input_ids = torch.randint(1, 97, (2, 20))
    logits = {}
    for implementation in ("grouped_mm", "batched_mm", "eager"):
        model.set_experts_implementation(implementation)
        with torch.no_grad():
            logits[implementation] = model(input_ids).logits
    torch.testing.assert_close(logits["grouped_mm"], logits["eager"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits["batched_mm"], logits["eager"], atol=1e-5, rtol=1e-5)


def test_bfloat16_forward_and_generate_run():
    model = tiny_model().to(torch.bfloat16)
    input_ids = torch.randint(1, 97, (2, 30))
    with torch.no_grad():
        logits = model(input_ids).logits
        tokens = model.generate(input_ids, max_new_tokens=5, do_sample=False)
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all() and tokens.shape == (2, 35)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(attention_mask=torch.ones(1, 2, 5, 5)), "give the 2-D padding mask"),
        (dict(attention_mask=torch.ones(1, 3)), "it must be (1, 5)"),
        (dict(position_ids=torch.arange(4)[None]), "must be (1, 5)"),
    ],
)
def test_bad_inputs_are_rejected_with_a_clear_message(kwargs, message):
    model = tiny_model()
    with pytest.raises(ValueError) as error:
        model(torch.randint(1, 97, (1, 5)), **kwargs)
    assert message in str(error.value)


def test_unsupported_cache_implementation_is_rejected():
    model = tiny_model()
    with pytest.raises(ValueError, match="not supported by HybridIndexPool"):
        model.generate(torch.randint(1, 97, (1, 5)), max_new_tokens=2, cache_implementation="static")


def test_long_input_never_builds_a_tokens_by_tokens_tensor(monkeypatch):
    """Record every tensor the forward creates: beyond the budget none grows with the square of the length."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from hybrid_indexpool.kernels.pooled_index_topk import reference as topk_reference
    from hybrid_indexpool.kernels.sparse_attention import reference as attention_reference

    # Small blocks so that the test's modest length already exceeds them.
    monkeypatch.setattr(topk_reference, "SCORE_BLOCK_ELEMENTS", 1 << 16)
    monkeypatch.setattr(attention_reference, "GATHER_BLOCK_ELEMENTS", 1 << 16)

    class LargestTensor(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            for tensor in result if isinstance(result, (tuple, list)) else (result,):
                if isinstance(tensor, torch.Tensor):
                    LargestTensor.largest = max(LargestTensor.largest, tensor.numel())
            return result

    model = tiny_model(index_topk=16)
    tokens = 3000
    with torch.no_grad(), LargestTensor():
        model(torch.randint(1, 97, (1, tokens)), logits_to_keep=1)
    # Linear in the length (the Gated DeltaNet chunk matrices are tokens x 64 x heads), far below tokens^2.
    assert LargestTensor.largest <= 512 * tokens < tokens * tokens // 4


def test_a_model_refuses_a_transformers_older_than_it_needs(monkeypatch):
    from hybrid_indexpool.modeling import modeling_hybrid_indexpool

    monkeypatch.setattr(modeling_hybrid_indexpool.transformers, "__version__", "5.19.0")
    with pytest.raises(ImportError, match=r"needs transformers >= 5\.24, but transformers 5\.19\.0 is installed"):
        modeling_hybrid_indexpool.HybridIndexPoolForCausalLM(tiny_config())
    monkeypatch.setattr(modeling_hybrid_indexpool.transformers, "__version__",
                        modeling_hybrid_indexpool.MINIMUM_TRANSFORMERS_VERSION)
    modeling_hybrid_indexpool.HybridIndexPoolForCausalLM(tiny_config())  # the minimum itself is accepted
