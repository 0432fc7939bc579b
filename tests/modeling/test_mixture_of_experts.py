"""The mixture-of-experts block: its experts implementations at every width and dtype."""

import pytest
import torch

from hybrid_indexpool.modeling.modeling_hybrid_indexpool import HybridIndexPoolExperts, grouped_mm_fits

from model_factory import tiny_config, tiny_model

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
