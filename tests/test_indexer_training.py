"""The indexer-training library: freezing, and the attention mass its selection captures."""

import pytest
import torch

from hybrid_indexpool.indexer_training import freeze_all_but_indexer, selection_attention_mass
from model_factory import tiny_model

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_freezing_leaves_only_the_indexer_trainable():
    model = tiny_model()
    trainable = freeze_all_but_indexer(model)
    assert trainable == [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".indexer." in name for name in trainable)
    assert any("pool_gate_proj" in name for name in trainable)
    with pytest.raises(ValueError, match="no indexer parameters"):
        freeze_all_but_indexer(tiny_model(layer_types=["linear_attention"] * 4))


@pytest.mark.parametrize("pool_size", [4, 1])
def test_captured_mass_matches_the_slots_the_sparse_attention_uses(pool_size):
    model = tiny_model(index_topk=8, index_pool_size=pool_size, index_head_weights=True)
    input_ids = torch.randint(1, 97, (2, 45))
    result = selection_attention_mass(model, input_ids)
    with torch.no_grad():
        dense = model(input_ids, output_attentions=True, indexer_loss="dense").attentions[0]
        sparse = model(input_ids, output_attentions=True).attentions[0]
    # The single IndexPool layer comes after Gated DeltaNet layers only, so it sees the same input in both runs and
    # the slots the sparse run attends to are exactly its selection plus the tail.
    captured = (dense * (sparse > 0)).sum(-1).mean(dim=1)  # [batch, queries]
    pruned = (torch.arange(45) + 1) // pool_size > 8 // pool_size
    expected = captured[:, pruned].mean().item()
    assert result["mass"] == pytest.approx(expected, abs=1e-5)
    assert 0.0 < result["mass"] < 0.99 and result["dense_kl"] > 0


def test_captured_mass_is_one_within_the_budget():
    model = tiny_model(index_topk=64)
    assert selection_attention_mass(model, torch.randint(1, 97, (1, 45)))["mass"] == 1.0


@pytest.mark.parametrize("pool_size", [4, 1])
def test_the_best_selection_mass_is_a_brute_force_bound_on_the_indexer(pool_size):
    model = tiny_model(index_topk=8, index_pool_size=pool_size)
    input_ids = torch.randint(1, 97, (2, 45), generator=torch.Generator().manual_seed(1))
    result = selection_attention_mass(model, input_ids)
    with torch.no_grad():
        dense = model(input_ids, output_attentions=True, indexer_loss="dense").attentions[0].mean(dim=1)
    topk_windows, best = 8 // pool_size, []
    for row in range(2):
        for position in range(45):
            visible = (position + 1) // pool_size
            if visible <= topk_windows:
                continue
            window_mass = sorted((dense[row, position, w * pool_size:(w + 1) * pool_size].sum().item()
                                  for w in range(visible)), reverse=True)
            tail = dense[row, position, visible * pool_size: position + 1].sum().item()
            best.append(sum(window_mass[:topk_windows]) + tail)
    assert result["oracle_mass"] == pytest.approx(sum(best) / len(best), abs=1e-5)
    assert result["mass"] <= result["oracle_mass"] + 1e-6 and result["oracle_mass"] < 1.0
    assert selection_attention_mass(model, input_ids[:, :7])["oracle_mass"] == 1.0
