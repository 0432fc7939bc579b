"""Beyond one process, through the libraries' own machinery: tensor and pipeline parallelism of transformers
(`torchrun --nproc_per_node 2`, gloo on CPU) against one process, and FSDP2 fine-tuning under `accelerate launch`
against one process with the same global batch."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from model_factory import KIMI_DELTA, MLA, tiny_config, tiny_model
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig

from hybrid_indexpool import HybridIndexPoolConfig, HybridIndexPoolForCausalLM
from hybrid_indexpool.scripts import finetune
from hybrid_indexpool.tokenization import byte_level_tokenizer
from hybrid_indexpool.training import FinetuneArguments, build_model

TESTS = Path(__file__).parent
# One thread per process: two processes on two shared cores otherwise spend their time spinning.
ENVIRONMENT = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
PROMPT_LENGTH, NEW_TOKENS = 40, 10  # the tiny models attend to 8 tokens (+ the open window): 40 is beyond the budget

# Every optional feature at once: MoE with a shared expert, hyper-connections, PLE, learned indexer head weights.
FULL_FEATURED = dict(hc_count=3, hc_lowrank=8, ple_layers=[0, 2], ple_ngram_size=3, ple_heads_per_ngram=2,
                     ple_ngram_vocab_size_base=40, ple_vocab_size_multiple=8, eos_token_id=1, num_experts=4,
                     num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                     index_head_weights=True)


def sharp_model(**overrides) -> HybridIndexPoolForCausalLM:
    """A tiny model with weights large enough for logits of a few units (and every norm random), so a sum taken in
    another order shows."""
    model = tiny_model(0, initializer_range=0.05, **overrides)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name or "ple.conv1d" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return model


def left_padded_batch() -> dict:
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, 97, (2, PROMPT_LENGTH), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :15] = 0  # the second row has 25 real tokens, still beyond the budget
    input_ids[1, :15] = 0
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def test_tensor_and_pipeline_parallel_give_the_one_process_logits_and_tokens(tmp_path):
    cases = {"plain": (sharp_model(), ["tp", "pp"]), "full_featured": (sharp_model(**FULL_FEATURED), ["tp"]),
             "kimi_delta": (sharp_model(**KIMI_DELTA), ["tp"])}
    inputs = left_padded_batch()
    expected = {}
    for name, (model, _) in cases.items():
        model.save_pretrained(tmp_path / name)
        torch.save({**inputs, "max_new_tokens": NEW_TOKENS}, tmp_path / name / "inputs.pt")
        with torch.no_grad():
            expected[name] = (model(**inputs).logits,
                              model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False))
        assert model.config.index_topk + model.config.index_pool_size - 1 < 25  # the sparse path, for both rows
    (tmp_path / "cases.json").write_text(json.dumps({name: kinds for name, (_, kinds) in cases.items()}))

    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
              str(TESTS / "distributed_worker.py"), str(tmp_path)]
    result = subprocess.run(launch, capture_output=True, text=True, timeout=600, env=ENVIRONMENT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]

    for name, (model, kinds) in cases.items():
        config = model.config
        logits, tokens = expected[name]
        for kind in kinds:
            for rank in (0, 1):
                output = torch.load(tmp_path / name / f"{kind}.{rank}.pt")
                difference = (output["logits"] - logits).abs().max().item()
                print(f"{name} {kind} rank {rank}: logits within {difference:.1e} of one process "
                      f"(largest {logits.abs().max():.2f})")
                assert difference <= 1e-5, (name, kind, rank, difference)
                assert torch.equal(output["tokens"], tokens), (name, kind, rank)
                if kind == "tp":  # each rank's cache holds its own heads, half of them
                    for layer_type, first, second in output["cache_shapes"]:
                        if layer_type == "indexpool":  # keys and values [batch, capacity, kv_heads, head_dim]
                            assert first[2] == second[2] == config.num_key_value_heads // 2
                        else:  # convolution [batch, channels, kernel - 1], recurrent [batch, value_heads, dk, dv]
                            channels = model.model.layers[0].linear_attn.conv1d.weight.shape[0]
                            assert first[1] == channels // 2
                            assert second[1] == config.linear_num_value_heads // 2
    # Pipeline stages: each rank's cache holds the layers of its stage only.
    shapes = [torch.load(tmp_path / "plain" / f"pp.{rank}.pt")["cache_shapes"] for rank in (0, 1)]
    assert [entry[0] for entry in shapes[0]] == ["linear", "linear", "other stage", "other stage"]
    assert [entry[0] for entry in shapes[1]] == ["other stage", "other stage", "linear", "indexpool"]


def test_tensor_parallel_sizes_that_split_a_head_are_refused():
    config = tiny_config(num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=4)
    config.check_tensor_parallel_size(2)
    with pytest.raises(ValueError, match="tensor parallel size 4 does not divide num_key_value_heads = 2, "
                                         "linear_num_key_heads = 2"):
        config.check_tensor_parallel_size(4)
    model = HybridIndexPoolForCausalLM(config)
    with pytest.raises(ValueError, match="does not divide"):
        # Refused before transformers touches the mesh (hence no process group is needed here).
        HybridIndexPoolForCausalLM.maybe_distribute_model(model, DistributedConfig(tp_size=4), mesh_manager=object())


def test_pipeline_parallel_refuses_hyper_connections_and_ple():
    model = HybridIndexPoolForCausalLM(tiny_config(hc_count=2, hc_lowrank=4))
    with pytest.raises(ValueError, match="hyper-connections"):
        HybridIndexPoolForCausalLM.maybe_distribute_model(model, DistributedConfig(pp_size=2), mesh_manager=object())


@pytest.mark.parametrize("features", [FULL_FEATURED, {}, KIMI_DELTA], ids=["full_featured", "dense", "kimi_delta"])
def test_the_plans_name_only_modules_the_model_has(features):
    model = HybridIndexPoolForCausalLM(tiny_config(**features))
    names = {name for name, _ in model.named_modules()} | {name for name, _ in model.named_parameters()}
    generic = {".".join("*" if part.isdigit() else part for part in name.split(".")) for name in names}
    for rule in model.config.base_model_tp_plan:
        assert f"model.{rule}" in generic, rule
    assert not any("indexer" in rule for rule in model.config.base_model_tp_plan)  # replicated
    assert model.tp_plan["lm_head"] == "colwise_gather_output"


def test_the_plans_of_a_dense_a_full_featured_a_kimi_delta_and_an_mla_model_cover_every_entry():
    plans = tiny_config().base_model_tp_plan | tiny_config(**FULL_FEATURED).base_model_tp_plan \
        | tiny_config(**KIMI_DELTA).base_model_tp_plan | tiny_config(**MLA).base_model_tp_plan
    assert plans == HybridIndexPoolConfig.TENSOR_PARALLEL_PLAN


# ---- FSDP2 training ------------------------------------------------------------------------------------------------

TINY = json.dumps(dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
    head_dim=16, index_n_heads=2, index_head_dim=16, index_topk=16, linear_num_key_heads=1,
    linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
))
STEPS = 4


def finetune_command(data: Path, output_dir: Path, batch_size: int) -> list[str]:
    return ["-m", "hybrid_indexpool.scripts.finetune", "--init_config", TINY, "--train_files", str(data),
            "--block_size", "64", "--output_dir", str(output_dir), "--max_steps", str(STEPS),
            "--per_device_train_batch_size", str(batch_size), "--learning_rate", "1e-3", "--seed", "0",
            "--logging_steps", "1", "--save_steps", "100", "--report_to", "none"]


def logged_losses(output_dir: Path) -> list[float]:
    state = json.loads((output_dir / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
    return [entry["loss"] for entry in state["log_history"] if "loss" in entry]


def test_fsdp2_under_accelerate_launch_trains_like_one_process_and_its_checkpoint_generates(tmp_path):
    data = tmp_path / "train.txt"
    data.write_text(Path(json.__file__).read_text() * 3)
    sharded, single = tmp_path / "fsdp", tmp_path / "single"
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    # Global batch 4 both times: 2 processes x 2 rows, and 1 process x 4 rows.
    result = subprocess.run(launch + finetune_command(data, sharded, 2) + ["--fsdp_size", "2"],
                            capture_output=True, text=True, timeout=600, env=ENVIRONMENT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    for rank in (0, 1):
        assert (f"process {rank} of 2 finished after {STEPS} steps (trainer world size 2, "
                "ParallelMode.DISTRIBUTED, FSDP2 (transformers))") in result.stdout
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        finetune.main(finetune_command(data, single, 4)[2:])
    finally:
        torch.set_num_threads(threads)

    sharded_losses, single_losses = logged_losses(sharded), logged_losses(single)
    assert len(sharded_losses) == STEPS and sharded_losses[-1] < sharded_losses[0]  # it trains
    print(f"FSDP2 losses {sharded_losses}, one process {single_losses}: at most "
          f"{max(abs(a - b) for a, b in zip(sharded_losses, single_losses)):.1e} apart")
    # Measured: about 1e-6 apart (the gradients are summed in another order).
    assert sharded_losses == pytest.approx(single_losses, rel=1e-5, abs=0)

    # The checkpoint written from the sharded run is a whole model, the one the single process trained.
    trained = AutoModelForCausalLM.from_pretrained(sharded).eval()
    reference = AutoModelForCausalLM.from_pretrained(single).eval()
    assert trained.state_dict().keys() == reference.state_dict().keys()
    for name, expected in reference.state_dict().items():
        parameter = trained.state_dict()[name]
        assert parameter.shape == expected.shape and torch.allclose(parameter, expected, atol=1e-5), name
    print("FSDP2 weights within", max((trained.state_dict()[name] - expected).abs().max().item()
                                      for name, expected in reference.state_dict().items()), "of one process")
    prompt = torch.tensor([[40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59]])
    tokens = trained.generate(prompt, max_new_tokens=8, do_sample=False)
    assert tokens.shape[1] > prompt.shape[1]
    assert torch.equal(tokens, reference.generate(prompt, max_new_tokens=8, do_sample=False))


def test_fsdp_size_needs_that_many_processes_and_no_lora(tmp_path, monkeypatch, capsys):
    data = tmp_path / "train.txt"
    data.write_text("some text\n\nmore text\n")
    command = finetune_command(data, tmp_path / "out", 2)[2:] + ["--fsdp_size", "2"]
    with pytest.raises(SystemExit) as stop:  # the command's error line, exit status 2
        finetune.main(command)
    assert stop.value.code == 2
    assert "error: --fsdp_size 2 needs that many processes (this run has 1)" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="--lora with --fsdp_size is not supported"):
        build_model(FinetuneArguments(init_config=TINY, fsdp_size=2, lora=True), byte_level_tokenizer())
