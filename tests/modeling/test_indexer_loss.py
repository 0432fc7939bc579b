"""The indexer's KL loss (DeepSeek-V3.2 recipe): zero at the target, trains only the indexer, falls with training."""

import pytest
import torch
from model_factory import tiny_config, tiny_model

from hybrid_indexpool import HybridIndexPoolForCausalLM
from hybrid_indexpool.modeling.indexer import window_kl_divergence

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

INDEXER_PARAMETERS = ("indexer.",)


def test_kl_is_zero_when_the_indexer_matches_the_target_and_positive_otherwise():
    generator = torch.Generator().manual_seed(0)
    mass = torch.rand(3, 5, 9, generator=generator)
    visible = torch.arange(9) < torch.tensor([9, 4, 1, 0, 6])[None, :, None]
    target = (mass * visible) / (mass * visible).sum(-1, keepdim=True).clamp(min=1e-30)
    matching = torch.log(target.clamp(min=1e-30)) + 2.5  # a constant shift leaves the softmax unchanged
    kl = window_kl_divergence(mass, matching, visible)
    torch.testing.assert_close(kl, torch.zeros_like(kl), atol=1e-5, rtol=0)
    other = window_kl_divergence(mass, torch.randn(3, 5, 9, generator=generator), visible)
    assert (other[:, [0, 1, 4]] > 1e-4).all()
    torch.testing.assert_close(other[:, 2:4], torch.zeros(3, 2))  # one window visible, or none: nothing to learn


@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_gradients_reach_the_indexer_and_pooling_parameters_only(mode):
    model = tiny_model(index_topk=8, index_head_weights=True).train()
    input_ids = torch.randint(1, 97, (2, 37))
    output = model(input_ids, indexer_loss=mode)
    assert output.indexer_loss is not None and output.indexer_loss > 0
    torch.testing.assert_close(output.loss, model.config.indexer_loss_weight * output.indexer_loss)
    output.indexer_loss.backward()
    with_gradient = {name for name, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert with_gradient and all("indexer." in name for name in with_gradient), with_gradient
    for part in ("q_proj", "k_proj", "pool_gate_proj", "pool_slot_bias", "head_weights_proj"):
        assert any(f"indexer.{part}" in name for name in with_gradient), part

    # And the language-model loss never reaches the indexer.
    model.zero_grad()
    model(input_ids, labels=input_ids).loss.backward()
    assert all(p.grad is None or p.grad.abs().sum() == 0
               for name, p in model.named_parameters() if "indexer." in name)


def test_a_few_steps_on_the_indexer_lower_the_loss():
    model = tiny_model(index_topk=8).train()
    input_ids = torch.randint(1, 97, (4, 40))
    parameters = [p for name, p in model.named_parameters() if "indexer." in name]
    optimizer = torch.optim.Adam(parameters, lr=1e-2)
    losses = []
    for _ in range(15):
        loss = model(input_ids, indexer_loss="dense").indexer_loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses


def test_unknown_indexer_loss_mode_is_rejected():
    with pytest.raises(ValueError, match="use None, 'dense' or 'sparse'"):
        tiny_model()(torch.randint(1, 97, (1, 9)), indexer_loss="full")


def test_dense_warm_up_attends_densely_beyond_the_budget():
    model = tiny_model(index_topk=8)
    dense_model = HybridIndexPoolForCausalLM(tiny_config(index_topk=64)).eval()
    dense_model.load_state_dict(model.state_dict())
    input_ids = torch.randint(1, 97, (2, 45))  # 11 windows visible at the end, the budget keeps 2
    with torch.no_grad():
        warm_up = model(input_ids, indexer_loss="dense").logits
        dense = dense_model(input_ids).logits
        sparse = model(input_ids).logits
    torch.testing.assert_close(warm_up, dense)
    assert (sparse - dense).abs().max() > 1e-3  # without the flag the same model prunes
