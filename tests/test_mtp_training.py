"""The MTP training library: targets that never cross a packed example, fresh heads of the right kind, only the MTP
layers trained, and a head trained here written out by the export to its source's format."""

import json

import pytest
import torch
from checkpoint_files import saved_tensors
from model_factory import tiny_model
from qwen_sources import save_qwen4_source, tiny_qwen4_source
from transformers import AutoModelForCausalLM

from hybrid_indexpool.conversion import convert_qwen4_exp, export_qwen4_exp
from hybrid_indexpool.mtp_training import (
    TrainingInputError,
    add_mtp_layers,
    freeze_all_but_mtp,
    is_mtp_parameter,
    mtp_loss_and_accuracy,
    mtp_targets,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_targets_are_the_labels_depth_plus_two_ahead_within_one_packed_example():
    labels = torch.tensor([[10, 11, 12, 13, -100, 21, 22, 23]])  # the second example starts at column 4
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])
    assert mtp_targets(labels, positions, 0).tolist() == [[12, 13, -100, -100, 22, 23, -100, -100]]
    assert mtp_targets(labels, positions, 1).tolist() == [[13, -100, -100, -100, 23, -100, -100, -100]]
    # Without positions (padded rows, labels -100 at the padding) only the labels and the row's end limit them.
    assert mtp_targets(labels, None, 0).tolist() == [[12, 13, -100, 21, 22, 23, -100, -100]]


def test_a_fresh_head_is_of_the_model_kind_and_bad_kinds_are_refused():
    model = tiny_model()
    add_mtp_layers(model, 2)
    assert (model.config.num_mtp_layers, model.config.mtp_type) == (2, "deepseek")
    assert len(model.model.mtp.layers) == 2
    streams = tiny_model(hc_type="qwen4_exp", hc_count=2)
    add_mtp_layers(streams, 1)
    assert streams.config.mtp_type == "qwen4_exp"
    with pytest.raises(TrainingInputError, match="reads Qwen4-Exp's residual streams"):
        add_mtp_layers(tiny_model(), 1, "qwen4_exp")
    with pytest.raises(TrainingInputError, match="at least 1 MTP layer"):
        add_mtp_layers(tiny_model(), 0)
    with pytest.raises(TrainingInputError, match="no MTP layers to train"):
        freeze_all_but_mtp(tiny_model())


def train_steps(model, steps: int = 4, learning_rate: float = 1e-2, seed: int = 0) -> list[float]:
    """A few Adam steps of the MTP loss alone on random tokens; returns the losses."""
    trainable = [model.get_parameter(name) for name in freeze_all_but_mtp(model)]
    optimizer = torch.optim.Adam(trainable, lr=learning_rate)
    input_ids = torch.randint(2, model.config.get_text_config().vocab_size, (2, 24),
                              generator=torch.Generator().manual_seed(seed))
    losses = []
    for _ in range(steps):
        outputs = model(input_ids, output_mtp_logits=True, use_cache=False)
        loss, _ = mtp_loss_and_accuracy(outputs.mtp_logits, input_ids, None)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    model.requires_grad_(True)
    return losses


def test_training_moves_only_the_mtp_layers_and_lowers_the_loss():
    model = tiny_model(num_mtp_layers=1)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    losses = train_steps(model.train(), steps=6)
    assert losses[-1] < losses[0], losses
    changed = {name for name, tensor in model.state_dict().items() if not torch.equal(before[name], tensor)}
    assert changed and all(is_mtp_parameter(name) for name in changed), changed


def test_a_head_trained_here_on_a_qwen4_exp_conversion_exports_in_its_format(tmp_path):
    """A Qwen4-Exp source without MTP, converted; a fresh head (Qwen4-Exp's kind) trained here; the export writes it
    under Qwen4-Exp's names (`mtp.`) with `mtp_num_hidden_layers`, and the rest as it was."""
    folder, _ = save_qwen4_source(tiny_qwen4_source(), tmp_path / "source", mtp=False)
    convert_qwen4_exp(folder, tmp_path / "ours", progress=False, log=lambda message: None)
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", trust_remote_code=True)
    add_mtp_layers(ours, 1)
    assert ours.config.mtp_type == "qwen4_exp"
    train_steps(ours, steps=2, learning_rate=1e-3)
    ours.save_pretrained(tmp_path / "trained")
    export_qwen4_exp(tmp_path / "trained", tmp_path / "back", progress=False, log=lambda message: None)
    exported, source = saved_tensors(tmp_path / "back"), saved_tensors(folder)
    assert {name for name in exported if not name.startswith("mtp.")} == set(source)
    assert torch.equal(exported["mtp.fc_embedding.weight"], ours.model.mtp.embedding_proj.weight)
    assert torch.equal(exported["mtp.pre_fc_norm_hidden.weight"], ours.model.mtp.streams_norm.weight)
    assert any(name.startswith("mtp.layers.0.self_attn.") for name in exported)
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config.get("mtp_num_hidden_layers", config.get("text_config", {}).get("mtp_num_hidden_layers")) == 1


def test_a_depth_without_targets_adds_a_zero_loss_that_keeps_the_graph():
    logits = torch.randn(1, 3, 5, requires_grad=True)
    labels = torch.tensor([[1, 2, 3]])
    loss, accuracies = mtp_loss_and_accuracy((logits, logits), labels, None)  # depth 1 needs 4 tokens
    expected = torch.nn.functional.cross_entropy(logits[0, :1], labels[0, 2:]) / 2
    assert torch.allclose(loss, expected) and torch.isnan(accuracies[1])
    loss.backward()
    assert logits.grad is not None


def test_a_fresh_head_in_a_half_precision_model_keeps_the_float32_parameters_the_model_loads_so():
    model = tiny_model(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_layer_types=["sparse"] * 4,
                       moe_router_type="sigmoid_grouped", n_group=2, topk_group=1).to(torch.bfloat16)
    add_mtp_layers(model, 1)
    dtypes = {name: parameter.dtype for name, parameter in model.model.mtp.named_parameters()}
    assert dtypes["layers.0.block.mlp.gate.weight"] == torch.float32
    assert dtypes["layers.0.input_proj.weight"] == torch.bfloat16
