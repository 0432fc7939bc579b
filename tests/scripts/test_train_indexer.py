"""The indexer-training script: the warm-up trains only the indexer and lowers its KL, the sparse stage trains
everything and saves a loadable checkpoint, bad options are refused."""

import json
from pathlib import Path

import pytest
import torch
from model_factory import tiny_model
from transformers import AutoModelForCausalLM

from hybrid_indexpool.indexer_training import is_indexer_parameter
from hybrid_indexpool.scripts import train_indexer
from hybrid_indexpool.tokenization import byte_level_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def checkpoint_and_data(tmp_path_factory):
    """A saved tiny model (budget 8 tokens, byte-level vocabulary) and a text file of standard-library source."""
    folder = tmp_path_factory.mktemp("indexer")
    model = tiny_model(vocab_size=259, index_head_weights=True)
    model.save_pretrained(folder / "base")
    byte_level_tokenizer().save_pretrained(folder / "base")
    data = folder / "train.txt"
    data.write_text(Path(json.__file__).read_text())
    return folder / "base", data


def command_line(model, data, output_dir, *extra):
    return ["--model_name_or_path", str(model), "--train_files", str(data), "--block_size", "64",
            "--output_dir", str(output_dir), "--per_device_train_batch_size", "4", "--report_to", "none",
            "--save_strategy", "no", "--seed", "0", *extra]


def test_help_lists_the_stage_options(capsys):
    with pytest.raises(SystemExit):
        train_indexer.main(["--help"])
    printed = capsys.readouterr().out
    for option in ("--stage", "--dense_warmup_steps", "--sparse_steps", "--dense_warmup_learning_rate",
                   "--indexer_loss_weight", "--init_config", "--overwrite_output_dir", "--learning_rate",
                   "--freeze_pooling", "--pool_distillation_weight"):
        assert option in printed


def test_warm_up_trains_only_the_indexer_and_lowers_its_kl_then_sparse_stage_saves_a_loadable_model(
        tmp_path, checkpoint_and_data, capsys):
    base, data = checkpoint_and_data
    metrics = train_indexer.main(command_line(base, data, tmp_path / "warm", "--stage", "warmup",
                                              "--dense_warmup_steps", "10", "--dense_warmup_learning_rate", "1e-2"))
    kl = [entry["indexer_kl"] for entry in metrics["warmup"]["log_history"] if "indexer_kl" in entry]
    assert len(kl) == 10 and sum(kl[-3:]) < 0.8 * sum(kl[:3]), kl
    assert "train_indexer: warmup stage, 10 steps, indexer KL" in capsys.readouterr().out

    before = AutoModelForCausalLM.from_pretrained(base).state_dict()
    after = AutoModelForCausalLM.from_pretrained(tmp_path / "warm").state_dict()
    assert before.keys() == after.keys()
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert all(is_indexer_parameter(name) for name in changed), changed
    for part in ("indexer.q_proj", "indexer.k_proj", "indexer.pool_gate_proj", "indexer.pool_slot_bias",
                 "indexer.head_weights_proj"):
        assert any(part in name for name in changed), part

    metrics = train_indexer.main(command_line(tmp_path / "warm", data, tmp_path / "sparse", "--stage", "sparse",
                                              "--sparse_steps", "3", "--learning_rate", "1e-3"))
    logged = [entry for entry in metrics["sparse"]["log_history"] if "indexer_kl" in entry]
    assert len(logged) == 3 and all(entry["lm_loss"] > 0 and entry["indexer_kl"] >= 0 for entry in logged)
    sparse = AutoModelForCausalLM.from_pretrained(tmp_path / "sparse")
    changed = {name for name, tensor in sparse.state_dict().items() if not torch.equal(tensor, after[name])}
    assert any(not is_indexer_parameter(name) for name in changed)  # stage 2 trains every parameter
    assert (tmp_path / "sparse" / "tokenizer.json").exists() and (tmp_path / "sparse" / "README.md").exists()
    remote = AutoModelForCausalLM.from_pretrained(tmp_path / "sparse", trust_remote_code=True)
    input_ids = torch.randint(3, 259, (1, 40))
    with torch.no_grad():
        torch.testing.assert_close(remote(input_ids).logits, sparse(input_ids).logits)


def test_pool_distillation_is_logged_and_falls_in_the_warm_up_and_runs_in_the_sparse_stage(tmp_path,
                                                                                            checkpoint_and_data):
    base, data = checkpoint_and_data
    metrics = train_indexer.main(command_line(base, data, tmp_path / "out", "--dense_warmup_steps", "10",
                                              "--dense_warmup_learning_rate", "3e-2", "--sparse_steps", "2",
                                              "--pool_distillation_weight", "1.0"))
    warmup = [entry for entry in metrics["warmup"]["log_history"] if "pool_distillation" in entry]
    distillation = [entry["pool_distillation"] for entry in warmup]
    assert len(distillation) == 10 and sum(distillation[-3:]) < 0.8 * sum(distillation[:3]), distillation
    # The logged loss is the KL plus the distillation (weight 1).
    assert all(entry["loss"] == pytest.approx(entry["indexer_kl"] + entry["pool_distillation"], rel=1e-3, abs=1e-4)
               for entry in warmup)
    sparse = [entry for entry in metrics["sparse"]["log_history"] if "pool_distillation" in entry]
    assert len(sparse) == 2 and all(entry["pool_distillation"] > 0 for entry in sparse)


def test_both_stages_from_scratch(tmp_path, checkpoint_and_data):
    _, data = checkpoint_and_data
    config = json.dumps(dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, layer_types=["linear_attention",
        "indexpool_attention"], num_attention_heads=2, num_key_value_heads=1, head_dim=16, index_n_heads=2,
        index_head_dim=16, index_topk=16, linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8,
    ))
    argv = ["--init_config", config, *command_line("", data, tmp_path / "out")[2:], "--dense_warmup_steps", "2",
            "--sparse_steps", "2"]
    metrics = train_indexer.main(argv)
    assert metrics["warmup"]["steps"] == 2 and metrics["sparse"]["steps"] == 2
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "out").config.index_topk == 16


@pytest.mark.parametrize("extra, message", [
    (["--max_steps", "5"], "--dense_warmup_steps and --sparse_steps, not --max_steps"),
    (["--stage", "sparse", "--sparse_steps", "0"], "--sparse_steps is 0"),
    (["--resume_from_checkpoint", "last"], "does not resume inside a stage"),
    (["--block_size", "0"], "--block_size is 0; give the number of tokens per training sequence"),
    (["--pool_distillation_weight", "-1"], "--pool_distillation_weight is -1.0; use 0 (off) or a positive"),
    (["--pool_distillation_weight", "1", "--freeze_pooling"], "drop one of the two"),
])
def test_bad_options_are_refused(tmp_path, capsys, checkpoint_and_data, extra, message):
    base, data = checkpoint_and_data
    with pytest.raises(SystemExit) as stop:
        train_indexer.main(command_line(base, data, tmp_path / "out", *extra))
    assert stop.value.code == 2
    printed = capsys.readouterr().err
    assert "\nerror: " in "\n" + printed and message in printed and "Traceback" not in printed


def test_pool_distillation_of_a_mean_pooling_model_is_refused(tmp_path, capsys, checkpoint_and_data):
    _, data = checkpoint_and_data
    config = json.dumps(dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, layer_types=["linear_attention",
        "indexpool_attention"], num_attention_heads=2, num_key_value_heads=1, head_dim=16, index_n_heads=2,
        index_head_dim=16, index_topk=16, linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8, index_pool_weighting="mean",
    ))
    with pytest.raises(SystemExit) as stop:
        train_indexer.main(["--init_config", config, *command_line("", data, tmp_path / "out")[2:],
                            "--pool_distillation_weight", "1"])
    assert stop.value.code == 2
    assert "index_pool_weighting='mean'; use a model with 'learned' or 'learned_scalar'" in capsys.readouterr().err


def test_a_non_empty_output_folder_is_refused_unless_overwriting(tmp_path, checkpoint_and_data):
    base, data = checkpoint_and_data
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    argv = command_line(base, data, tmp_path / "out", "--stage", "warmup", "--dense_warmup_steps", "1")
    with pytest.raises(SystemExit) as stop:
        train_indexer.main(argv)
    assert stop.value.code == 2
    train_indexer.main(argv + ["--overwrite_output_dir"])
    assert (tmp_path / "out" / "model.safetensors").exists()
