"""The MTP-training script: a fresh head trains alone and is saved with the model, an existing head is realigned
from its own weights, bad options are refused with a one-line error."""

import json
from pathlib import Path

import pytest
import torch
from model_factory import tiny_model
from transformers import AutoModelForCausalLM

from hybrid_indexpool.mtp_training import is_mtp_parameter
from hybrid_indexpool.scripts import train_mtp
from hybrid_indexpool.tokenization import byte_level_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def checkpoints_and_data(tmp_path_factory):
    """Saved tiny models (byte-level vocabulary) without and with an MTP layer, and a text file of standard-library
    source."""
    folder = tmp_path_factory.mktemp("mtp")
    for name, layers in (("plain", 0), ("with_mtp", 1)):
        tiny_model(vocab_size=259, num_mtp_layers=layers).save_pretrained(folder / name)
        byte_level_tokenizer().save_pretrained(folder / name)
    data = folder / "train.txt"
    data.write_text(Path(json.__file__).read_text())
    (folder / "validation.txt").write_text(Path(json.__file__).read_text()[:1500])  # a few blocks: a quick evaluation
    return folder, data


def command_line(model, data, output_dir, *extra):
    return ["--model_name_or_path", str(model), "--train_files", str(data), "--block_size", "32",
            "--output_dir", str(output_dir), "--per_device_train_batch_size", "2", "--report_to", "none",
            "--save_strategy", "no", "--seed", "0", *extra]


def test_help_lists_the_mtp_options(capsys):
    with pytest.raises(SystemExit):
        train_mtp.main(["--help"])
    printed = capsys.readouterr().out
    for option in ("--num_mtp_layers", "--mtp_type", "--reinitialize_mtp", "--init_config", "--learning_rate"):
        assert option in printed


def changed_weights(before_folder, after_folder) -> set[str]:
    before = AutoModelForCausalLM.from_pretrained(before_folder).state_dict()
    after = AutoModelForCausalLM.from_pretrained(after_folder).state_dict()
    return {name for name in after if name not in before or not torch.equal(before[name], after[name])}


def test_a_fresh_head_trains_alone_lowers_its_loss_and_is_saved_with_the_model(tmp_path, checkpoints_and_data,
                                                                                capsys):
    folder, data = checkpoints_and_data
    metrics = train_mtp.main(command_line(folder / "plain", data, tmp_path / "out", "--num_mtp_layers", "1",
                                          "--max_steps", "6", "--learning_rate", "1e-2",
                                          "--validation_files", str(folder / "validation.txt")))
    losses = [entry["mtp_loss"] for entry in metrics["log_history"] if "mtp_loss" in entry]
    assert len(losses) == 6 and losses[-1] < losses[0], losses
    assert all("mtp_accuracy_0" in entry for entry in metrics["log_history"] if "mtp_loss" in entry)
    assert "train_mtp: 6 steps, MTP loss" in capsys.readouterr().out
    assert metrics["eval_mtp_loss"] == metrics["eval_loss"] and 0 <= metrics["eval_mtp_accuracy_0"] <= 1
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert (trained.config.num_mtp_layers, trained.config.mtp_type) == (1, "deepseek")
    changed = changed_weights(folder / "plain", tmp_path / "out")
    assert changed and all(is_mtp_parameter(name) for name in changed), changed
    assert (tmp_path / "out" / "tokenizer.json").exists()


def test_an_existing_head_is_realigned_from_its_own_weights(tmp_path, checkpoints_and_data):
    folder, data = checkpoints_and_data
    train_mtp.main(command_line(folder / "with_mtp", data, tmp_path / "out", "--max_steps", "1",
                                "--learning_rate", "1e-5"))
    before = AutoModelForCausalLM.from_pretrained(folder / "with_mtp").state_dict()
    after = AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    changed = changed_weights(folder / "with_mtp", tmp_path / "out")
    assert changed and all(is_mtp_parameter(name) for name in changed), changed
    # One small step from the head's own weights, not a fresh start.
    assert max((after[name] - before[name]).abs().max().item() for name in changed) < 1e-3


@pytest.mark.parametrize("extra, message", [
    ((), "has no MTP layers: give it fresh ones with --num_mtp_layers N"),
    (("--num_mtp_layers", "1", "--mtp_type", "qwen4_exp"), "reads Qwen4-Exp's residual streams"),
    (("--num_mtp_layers", "1", "--block_size", "3"), "--block_size 3 leaves the deepest MTP layer no target"),
])
def test_bad_options_are_refused_in_one_line(tmp_path, checkpoints_and_data, capsys, extra, message):
    folder, data = checkpoints_and_data
    with pytest.raises(SystemExit) as exit_info:
        train_mtp.main(command_line(folder / "plain", data, tmp_path / "out", "--max_steps", "1", *extra))
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_head_of_another_size_is_refused_unless_reinitialized(tmp_path, checkpoints_and_data, capsys):
    folder, data = checkpoints_and_data
    with pytest.raises(SystemExit):
        train_mtp.main(command_line(folder / "with_mtp", data, tmp_path / "out", "--max_steps", "1",
                                    "--num_mtp_layers", "2"))
    assert "has 1 MTP layers, not --num_mtp_layers 2" in capsys.readouterr().err
