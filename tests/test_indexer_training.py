"""The indexer-training library: freezing, the attention mass its selection captures, and how the pooled keys' storage
format changes the selection."""

import pytest
import torch
from model_factory import tiny_model

from hybrid_indexpool.indexer_training import (
    freeze_all_but_indexer,
    index_key_format_measures,
    selection_attention_mass,
)

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


def selected_windows(attentions: torch.Tensor, pool_size: int) -> list[list[set]]:
    """Per row and query, the complete windows a sparse run attended to (any head put weight on a slot of them)."""
    used = (attentions > 0).any(dim=1)  # [batch, queries, slots]
    return [[{slot // pool_size for slot in used[row, query].nonzero().flatten().tolist()
              if slot < (query + 1) // pool_size * pool_size} for query in range(used.shape[1])]
            for row in range(used.shape[0])]


@pytest.mark.parametrize("pool_size", [4, 1])
def test_the_fp8_measures_are_those_of_a_forward_through_an_fp8_cache(pool_size):
    seq_len, topk = 160, 8
    model = tiny_model(index_topk=topk, index_pool_size=pool_size, index_head_weights=True)
    input_ids = torch.randint(1, 97, (2, seq_len), generator=torch.Generator().manual_seed(2))
    result = index_key_format_measures(model, input_ids)
    with torch.no_grad():
        dense = model(input_ids, output_attentions=True, indexer_loss="dense").attentions[0]
        runs = {}
        for dtype in ("auto", "float8_e4m3fn"):
            model.config.index_key_cache_dtype = dtype
            runs[dtype] = model(input_ids, output_attentions=True, use_cache=True).attentions[0]
    pruned = (torch.arange(seq_len) + 1) // pool_size > topk // pool_size
    # The single IndexPool layer follows Gated DeltaNet layers only (see above): its sparse slots are the selection.
    for dtype, mass in (("auto", result["mass"]), ("float8_e4m3fn", result["float8_e4m3fn"]["mass"])):
        assert mass == pytest.approx((dense * (runs[dtype] > 0)).sum(-1).mean(dim=1)[:, pruned].mean().item(),
                                     abs=1e-5)
    full, fp8 = selected_windows(runs["auto"], pool_size), selected_windows(runs["float8_e4m3fn"], pool_size)
    overlaps, identical = [], []
    for row in range(2):
        for query in pruned.nonzero().flatten().tolist():
            assert len(full[row][query]) == topk // pool_size
            overlaps.append(len(full[row][query] & fp8[row][query]) / len(full[row][query]))
            identical.append(full[row][query] == fp8[row][query])
    assert sum(identical) < len(identical)  # fp8 changes some selections here: the comparison is not vacuous
    assert result["float8_e4m3fn"]["overlap"] == pytest.approx(sum(overlaps) / len(overlaps), abs=1e-6)
    assert result["float8_e4m3fn"]["identical"] == pytest.approx(sum(identical) / len(identical), abs=1e-6)
    for name in ("bfloat16", "float8_e4m3fn", "float8_e4m3fn_unrotated"):
        measures = result[name]
        assert 0.0 <= measures["identical"] <= measures["overlap"] <= 1.0 and 0.0 < measures["mass"] < 1.0
        assert measures["per_layer_overlap"] == [measures["overlap"]]  # one IndexPool layer


def test_key_formats_change_nothing_within_the_budget_and_unknown_ones_are_refused():
    model = tiny_model(index_topk=64)
    result = index_key_format_measures(model, torch.randint(1, 97, (1, 45)), formats=["float8_e4m3fn"])
    assert result == {"mass": 1.0, "float8_e4m3fn": {"overlap": 1.0, "identical": 1.0, "mass": 1.0,
                                                      "per_layer_overlap": [1.0]}}
    with pytest.raises(ValueError, match="Unknown index key formats"):
        index_key_format_measures(model, torch.randint(1, 97, (1, 45)), formats=["int4"])


def test_the_kl_summary_line_keeps_small_figures_readable():
    from hybrid_indexpool.indexer_training import kl_summary_line

    assert kl_summary_line("warmup", 10, (3.2e-5, 4.1e-7)) == \
        "train_indexer: warmup stage, 10 steps, indexer KL 3.2e-05 -> 4.1e-07"
    assert kl_summary_line("sparse", 2, (0.51234, 0.25)) == \
        "train_indexer: sparse stage, 2 steps, indexer KL 0.5123 -> 0.25"
