"""Mixture of experts: the experts implementations at every width and dtype, and the routers' outputs and
load-balancing loss (checked against transformers' Qwen3-Next)."""

import pytest
import torch
from model_factory import tiny_config, tiny_model
from transformers.models.qwen3_next.modeling_qwen3_next import load_balancing_loss_func as qwen_load_balancing_loss

from hybrid_indexpool import HybridIndexPoolForSequenceClassification
from hybrid_indexpool.modeling.moe import (
    HybridIndexPoolExperts,
    grouped_mm_fits,
    load_balancing_loss,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def routed_experts(hidden_size: int, inner: int, dtype: torch.dtype, seed: int = 0):
    """Experts with random weights and a random top-2 routing of 23 tokens over 6 experts."""
    generator = torch.Generator().manual_seed(seed)
    config = tiny_config(hidden_size=hidden_size, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=inner)
    experts = HybridIndexPoolExperts(config)
    with torch.no_grad():
        for weight in (experts.gate_up_proj, experts.down_proj):
            weight.copy_(torch.randn(weight.shape, generator=generator) * 0.2)
    experts.to(dtype)
    hidden_states = torch.randn(23, hidden_size, generator=generator).to(dtype)
    weights, index = torch.rand(23, 6, generator=generator).softmax(-1).topk(2, dim=-1)
    return experts, hidden_states, index, weights.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("hidden_size, inner", [(64, 12), (64, 16), (64, 20), (64, 6), (36, 16)])
def test_grouped_experts_equal_the_loop_at_every_width_and_dtype(hidden_size, inner, dtype):
    experts, hidden_states, index, weights = routed_experts(hidden_size, inner, dtype)
    outputs, grads = {}, {}
    for implementation in ("grouped_mm", "eager"):
        experts.config._experts_implementation = implementation
        experts.zero_grad()
        inputs = hidden_states.clone().requires_grad_()
        outputs[implementation] = experts(inputs, index, weights)
        outputs[implementation].float().square().sum().backward()
        grads[implementation] = (inputs.grad, experts.gate_up_proj.grad, experts.down_proj.grad)
    tolerance = TOLERANCE[dtype]
    assert outputs["grouped_mm"].dtype == dtype
    torch.testing.assert_close(outputs["grouped_mm"], outputs["eager"], atol=tolerance, rtol=tolerance)
    for grouped, eager in zip(grads["grouped_mm"], grads["eager"]):
        torch.testing.assert_close(grouped, eager, atol=4 * tolerance, rtol=4 * tolerance)


def test_the_alignment_check_follows_the_kernel():
    """16-byte row strides: widths that are multiples of 8 in half precision, of 4 in float32."""
    for dtype, aligned, unaligned in ((torch.bfloat16, 16, 12), (torch.float16, 24, 20), (torch.float32, 12, 6)):
        assert grouped_mm_fits(routed_experts(64, aligned, dtype)[0])
        assert not grouped_mm_fits(routed_experts(64, unaligned, dtype)[0])


@pytest.mark.parametrize("inner", [12, 20])
def test_half_precision_moe_model_trains_at_widths_the_grouped_kernel_refuses(inner):
    model = tiny_model(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=inner).to(torch.bfloat16)
    assert model.config._experts_implementation == "grouped_mm"
    input_ids = torch.randint(1, 97, (2, 12))
    loss = model(input_ids, labels=input_ids).loss
    loss.backward()
    assert torch.isfinite(loss) and model.model.layers[0].mlp.experts.down_proj.grad.abs().sum() > 0


MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)


def padded_batch(lengths, total, seed=0, pad_id=0):
    """Left-padded random rows of the given lengths, and their mask."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.full((len(lengths), total), pad_id, dtype=torch.long)
    mask = torch.zeros(len(lengths), total, dtype=torch.long)
    for row, length in enumerate(lengths):
        input_ids[row, total - length:] = torch.randint(1, 97, (length,), generator=generator)
        mask[row, total - length:] = 1
    return input_ids, mask


def test_load_balancing_loss_equals_transformers_on_the_same_router_logits():
    generator = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(2 * 9, 6, generator=generator) * 3 for _ in range(3))
    _, mask = padded_batch([9, 5], 9)
    for top_k in (1, 2):
        torch.testing.assert_close(load_balancing_loss(logits, top_k), qwen_load_balancing_loss(logits, 6, top_k))
        torch.testing.assert_close(load_balancing_loss(logits, top_k, mask),
                                   qwen_load_balancing_loss(logits, 6, top_k, mask))


def test_router_logits_and_aux_loss_are_those_of_a_transformers_moe_model():
    model = tiny_model(**MOE)
    input_ids, mask = padded_batch([13, 9, 4], 13)
    output = model(input_ids, attention_mask=mask, labels=input_ids, output_router_logits=True)
    assert len(output.router_logits) == model.config.num_hidden_layers
    assert all(logits.shape == (3 * 13, 4) for logits in output.router_logits)
    expected = qwen_load_balancing_loss(output.router_logits, 4, 2, mask)
    torch.testing.assert_close(output.aux_loss, expected)
    # The base model returns the same router logits.
    base = model.model(input_ids, attention_mask=mask, output_router_logits=True)
    for ours, theirs in zip(base.router_logits, output.router_logits):
        torch.testing.assert_close(ours, theirs)


def test_loss_adds_the_aux_loss_weighted_by_the_coefficient():
    model = tiny_model(**MOE, router_aux_loss_coef=0.25)
    input_ids, mask = padded_batch([11, 7], 11)
    with torch.no_grad():
        plain = model(input_ids, attention_mask=mask, labels=input_ids)
        routed = model(input_ids, attention_mask=mask, labels=input_ids, output_router_logits=True)
        unlabelled = model(input_ids, attention_mask=mask, output_router_logits=True)
    torch.testing.assert_close(routed.loss, plain.loss + 0.25 * routed.aux_loss)
    assert routed.aux_loss > 0 and unlabelled.loss is None  # as transformers: the aux loss joins a labelled loss
    torch.testing.assert_close(unlabelled.aux_loss, routed.aux_loss)


def test_the_aux_loss_trains_the_routers():
    model = tiny_model(**MOE).train()
    input_ids = torch.randint(1, 97, (2, 10))
    model(input_ids, output_router_logits=True).aux_loss.backward()
    for layer in model.model.layers:
        assert layer.mlp.gate.weight.grad is not None and layer.mlp.gate.weight.grad.abs().sum() > 0


def test_gradient_checkpointing_keeps_the_aux_loss_gradient():
    model = tiny_model(**MOE).train()
    input_ids = torch.randint(1, 97, (2, 10))
    model(input_ids, output_router_logits=True).aux_loss.backward()
    expected = [layer.mlp.gate.weight.grad.clone() for layer in model.model.layers]
    model.zero_grad()
    model.activation_checkpointing_enable()
    model(input_ids, output_router_logits=True).aux_loss.backward()
    for layer, grad in zip(model.model.layers, expected):
        torch.testing.assert_close(layer.mlp.gate.weight.grad, grad)


def test_padding_counts_for_nothing_in_the_aux_loss():
    model = tiny_model(**MOE)
    lengths = [12, 8, 5]
    input_ids, mask = padded_batch(lengths, 12)
    other_pads = input_ids.masked_fill(mask == 0, 50)
    with torch.no_grad():
        padded = model(input_ids, attention_mask=mask, output_router_logits=True)
        repadded = model(other_pads, attention_mask=mask, output_router_logits=True)
        alone = [model(input_ids[row:row + 1, 12 - length:], output_router_logits=True)
                 for row, length in enumerate(lengths)]
    torch.testing.assert_close(padded.aux_loss, repadded.aux_loss)
    # Each real token's router logits are those of its row run alone, and the loss is over those tokens only.
    real = mask.reshape(-1).bool()
    for layer, logits in enumerate(padded.router_logits):
        torch.testing.assert_close(logits[real], torch.cat([out.router_logits[layer] for out in alone]),
                                   atol=1e-5, rtol=1e-5)
    real_only = tuple(logits[real] for logits in padded.router_logits)
    torch.testing.assert_close(padded.aux_loss, load_balancing_loss(real_only, 2))
    # Right padding too.
    right_ids = torch.stack([input_ids[row].roll(length - 12) for row, length in enumerate(lengths)])
    right_mask = torch.stack([mask[row].roll(length - 12) for row, length in enumerate(lengths)])
    with torch.no_grad():
        right = model(right_ids, attention_mask=right_mask, output_router_logits=True)
    torch.testing.assert_close(right.aux_loss, padded.aux_loss, atol=1e-5, rtol=1e-5)


def test_a_chunked_prefill_and_decode_steps_return_every_tokens_router_logits():
    model = tiny_model(**MOE, prefill_chunk_length=4)
    input_ids, mask = padded_batch([11, 6], 11)
    with torch.no_grad():
        whole = model(input_ids, attention_mask=mask, use_cache=False, output_router_logits=True)
        chunked = model(input_ids, attention_mask=mask, use_cache=True, output_router_logits=True)
        step = model(torch.randint(1, 97, (2, 1)), attention_mask=torch.cat([mask, torch.ones(2, 1)], dim=1),
                     cache=chunked.cache, output_router_logits=True)
    for ours, reference in zip(chunked.router_logits, whole.router_logits):
        torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked.aux_loss, whole.aux_loss, atol=1e-5, rtol=1e-5)
    assert step.router_logits[0].shape == (2, 4) and torch.isfinite(step.aux_loss)


def test_without_router_logits_the_outputs_are_unchanged():
    model = tiny_model(**MOE)
    input_ids, mask = padded_batch([9, 6], 9)
    with torch.no_grad():
        output = model(input_ids, attention_mask=mask, labels=input_ids)
        asked = model(input_ids, attention_mask=mask, labels=input_ids, output_router_logits=True)
    assert output.aux_loss is None and output.router_logits is None
    assert list(output.keys()) == ["loss", "logits", "cache"]
    assert len(output.to_tuple()) == 3 and len(asked.to_tuple()) == 5
    torch.testing.assert_close(asked.logits, output.logits)
    model.config.output_router_logits = True  # the config's default
    with torch.no_grad():
        assert model(input_ids, attention_mask=mask).aux_loss is not None
        assert model(input_ids, attention_mask=mask, output_router_logits=False).aux_loss is None
    dense = tiny_model()  # no experts: no router logits to return
    with torch.no_grad():
        output = dense(input_ids, attention_mask=mask, labels=input_ids, output_router_logits=True)
    assert output.router_logits is None and output.aux_loss is None


def test_packed_sequences_route_every_token():
    model = tiny_model(**MOE)
    input_ids = torch.randint(1, 97, (1, 12))
    position_ids = torch.cat([torch.arange(7), torch.arange(5)])[None]
    with torch.no_grad():
        packed = model(input_ids, position_ids=position_ids, use_cache=False, output_router_logits=True)
        first = model(input_ids[:, :7], output_router_logits=True)
        second = model(input_ids[:, 7:], output_router_logits=True)
    for layer, logits in enumerate(packed.router_logits):
        expected = torch.cat([first.router_logits[layer], second.router_logits[layer]])
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)


def test_sequence_classification_adds_the_aux_loss():
    torch.manual_seed(0)
    model = HybridIndexPoolForSequenceClassification(tiny_config(**MOE, num_labels=3)).eval()
    input_ids, mask = padded_batch([9, 6], 9)
    labels = torch.tensor([0, 2])
    with torch.no_grad():
        plain = model(input_ids, attention_mask=mask, labels=labels)
        routed = model(input_ids, attention_mask=mask, labels=labels, output_router_logits=True)
    torch.testing.assert_close(routed.aux_loss, qwen_load_balancing_loss(routed.router_logits, 4, 2, mask))
    torch.testing.assert_close(routed.loss, plain.loss + 0.001 * routed.aux_loss)
    assert plain.aux_loss is None and list(plain.keys()) == ["loss", "logits", "cache"]


def test_the_multimodal_model_adds_the_text_models_aux_loss():
    from hybrid_indexpool import HybridIndexPoolForConditionalGeneration, HybridIndexPoolMultimodalConfig

    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]}
    text = tiny_config(**MOE, rope_parameters=rope)
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=64)
    torch.manual_seed(0)
    model = HybridIndexPoolForConditionalGeneration(HybridIndexPoolMultimodalConfig(
        text_config=text.to_dict(), vision_config=vision, image_token_id=93, video_token_id=94,
        vision_start_token_id=95, vision_end_token_id=96,
    )).eval()
    input_ids, mask = padded_batch([9, 6], 9)
    with torch.no_grad():
        plain = model(input_ids, attention_mask=mask, labels=input_ids)
        routed = model(input_ids, attention_mask=mask, labels=input_ids, output_router_logits=True)
    torch.testing.assert_close(routed.aux_loss, qwen_load_balancing_loss(routed.router_logits, 4, 2, mask))
    torch.testing.assert_close(routed.loss, plain.loss + 0.001 * routed.aux_loss)
    assert plain.aux_loss is None
