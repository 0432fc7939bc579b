"""The fine-tuning script from the command line, alone and under `accelerate launch` with two CPU processes."""

import json
import subprocess
import sys
import time
from pathlib import Path

import huggingface_hub
import pytest

from hybrid_indexpool.scripts import finetune

TINY = json.dumps(dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
    head_dim=16, index_n_heads=2, index_head_dim=16, index_topk=16, linear_num_key_heads=1,
    linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
))


def command_line(tmp_path, max_steps=3):
    data = tmp_path / "train.txt"
    data.write_text(Path(json.__file__).read_text() * 3)
    return ["--init_config", TINY, "--train_files", str(data), "--block_size", "64", "--output_dir",
            str(tmp_path / "out"), "--max_steps", str(max_steps), "--per_device_train_batch_size", "2",
            "--logging_steps", "1", "--save_steps", "100", "--report_to", "none"]


def test_help_lists_the_script_and_trainer_options(capsys):
    with pytest.raises(SystemExit):
        finetune.main(["--help"])
    printed = capsys.readouterr().out
    for option in ("--train_files", "--packing", "--lora", "--overwrite_output_dir", "--learning_rate",
                   "--gradient_checkpointing", "--resume_from_checkpoint", "--bf16"):
        assert option in printed


def test_main_trains_and_writes_a_checkpoint(tmp_path, capsys):
    finetune.main(command_line(tmp_path))
    assert "process 0 of 1 finished after 3 steps" in capsys.readouterr().out
    assert (tmp_path / "out" / "model.safetensors").exists() and (tmp_path / "out" / "tokenizer.json").exists()


@pytest.mark.filterwarnings("ignore")
def test_accelerate_launch_with_two_cpu_processes(tmp_path):
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
              "-m", "hybrid_indexpool.scripts.finetune"]
    result = subprocess.run(launch + command_line(tmp_path, max_steps=4), capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        assert f"process {rank} of 2 finished after 4 steps (trainer world size 2" in result.stdout


@pytest.mark.parametrize("change, message", [
    (("--init_config", '{"index_topk": 10}'), "--init_config (a JSON object of config fields, or a file of one): "
                                             "HybridIndexPoolConfig: `index_topk` (10) is not a multiple"),
    (("--init_config", "no_such_config.json"), "--init_config (a JSON object of config fields, or a file of one)"),
    (("--train_files", "no_such_file.txt"), "Data files not found: ['no_such_file.txt']"),
])
def test_bad_input_ends_with_an_error_line_and_status_2(tmp_path, capsys, change, message):
    argv = command_line(tmp_path)
    argv[argv.index(change[0]) + 1] = change[1]
    with pytest.raises(SystemExit) as stop:
        finetune.main(argv)
    printed = capsys.readouterr().err
    assert stop.value.code == 2 and "\nerror: " in "\n" + printed and message in printed
    assert "Traceback" not in printed and not (tmp_path / "out").exists()


@pytest.mark.parametrize("change, message", [
    (["--block_size", "0"], "error: --block_size is 0; give the number of tokens per training sequence, a positive "
                            "number (default 512).\n"),
    (["--model_name_or_path", "/nonexistent"], "error: --model_name_or_path /nonexistent: no such folder (nor a Hub "
                                               "model id); give the folder of a checkpoint of ours, or --init_config "
                                               "to train a new model.\n"),
    (["--init_config", '{"hiden_size": 64, "num_hidden_layers": 4, "colour": 1}'],
     "error: --init_config (a JSON object of config fields, or a file of one): `hiden_size` (did you mean "
     "`hidden_size`?); `colour` is not a field of HybridIndexPoolConfig; use the field names of its documentation.\n"),
    (["--init_config", "[64]"], "error: --init_config (a JSON object of config fields, or a file of one): it holds a "
                                "list, not an object of fields.\n"),
])
def test_an_argument_refused_before_anything_loads_is_one_error_line(tmp_path, capsys, change, message):
    argv = command_line(tmp_path)
    if change[0] in ("--model_name_or_path", "--init_config"):
        del argv[:2]  # instead of the tiny --init_config
    argv += change
    with pytest.raises(SystemExit) as stop:
        finetune.main(argv)
    assert stop.value.code == 2 and capsys.readouterr().err == message
    assert not (tmp_path / "out").exists()


def test_a_model_name_neither_a_folder_nor_downloadable_is_refused_at_once(tmp_path, capsys, monkeypatch):
    """A bare name that is no folder: offline, or where the Hub has no such model or cannot be reached, one error line
    at once (transformers' own retries take over a minute offline and end in 'has no tokenizer')."""
    argv = command_line(tmp_path)[2:] + ["--model_name_or_path", "hybrid-indexpool-tests/no-such-model-49"]
    start = time.monotonic()
    with pytest.raises(SystemExit) as stop:
        finetune.main(argv)
    assert time.monotonic() - start < 30
    printed = capsys.readouterr().err
    assert stop.value.code == 2 and printed.count("\n") == 1 and printed.startswith(
        "error: --model_name_or_path hybrid-indexpool-tests/no-such-model-49: no such folder, and the Hub ")
    assert printed.endswith("; give the folder of a checkpoint of ours, or --init_config to train a new model.\n")
    monkeypatch.setattr(huggingface_hub, "is_offline_mode", lambda: True)
    with pytest.raises(SystemExit) as stop:
        finetune.main(argv[:-1] + ["nomodel"])
    assert stop.value.code == 2 and capsys.readouterr().err == (
        "error: --model_name_or_path nomodel: no such folder, and no download of it in the Hub cache while offline "
        "(HF_HUB_OFFLINE); give the folder of a checkpoint of ours, or --init_config to train a new model.\n")
    assert not (tmp_path / "out").exists()
