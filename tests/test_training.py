"""Fine-tuning with the Trainer: loss goes down, checkpoints load and resume, LoRA, refusals."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, TrainingArguments

from hybrid_indexpool.tokenization import byte_level_tokenizer
from hybrid_indexpool.training import FinetuneArguments, build_lm_dataset, run_finetune

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

TINY = json.dumps(dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, index_n_heads=2, index_head_dim=16, index_topk=32, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
))


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    """Real text that is on every machine: the source of the standard library's json package."""
    source = Path(json.__file__).parent
    path = tmp_path_factory.mktemp("data") / "train.txt"
    path.write_text("\n\n".join(p.read_text() for p in sorted(source.glob("*.py"))))
    return str(path)


def training_arguments(output_dir, **overrides):
    settings = dict(output_dir=str(output_dir), max_steps=8, per_device_train_batch_size=4, learning_rate=3e-3,
                    logging_steps=1, save_steps=4, report_to="none", use_cpu=True, seed=0)
    settings.update(overrides)
    return TrainingArguments(**settings)


def test_trainer_steps_lower_the_loss_and_the_checkpoint_loads_and_resumes(tmp_path, text_file):
    args = FinetuneArguments(init_config=TINY, train_files=[text_file], block_size=128)
    metrics = run_finetune(args, training_arguments(tmp_path / "run", gradient_checkpointing=True))
    losses = [entry["loss"] for entry in metrics["log_history"] if "loss" in entry]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.3

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "run")
    checkpoint = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "checkpoint-8")
    input_ids = torch.randint(3, 259, (1, 40))
    with torch.no_grad():
        assert torch.equal(model(input_ids).logits, checkpoint(input_ids).logits)

    resumed = run_finetune(args, training_arguments(tmp_path / "run", max_steps=12, resume_from_checkpoint="last"))
    steps = [entry["step"] for entry in resumed["log_history"] if "loss" in entry]
    assert steps[0] <= 8 and steps[-1] == 12 and (tmp_path / "run" / "checkpoint-12").is_dir()


def test_padding_mode_and_json_files_train(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"body": f"example number {i} " * (i % 7 + 1)}) for i in range(40)))
    dataset = build_lm_dataset([str(data)], byte_level_tokenizer(), 64, packing=False, text_field="body")
    assert len(dataset) == 40 and max(len(ids) for ids in dataset["input_ids"]) <= 64
    args = FinetuneArguments(init_config=TINY, train_files=[str(data)], block_size=64, packing=False,
                             text_field="body")
    metrics = run_finetune(args, training_arguments(tmp_path / "run", max_steps=3, save_steps=100))
    losses = [entry["loss"] for entry in metrics["log_history"] if "loss" in entry]
    assert len(losses) == 3 and all(0 < loss < 10 for loss in losses)


def test_lora_trains_merges_saves_and_reloads_with_the_same_logits(tmp_path, text_file):
    base = tmp_path / "base"
    run_finetune(FinetuneArguments(init_config=TINY, train_files=[text_file], block_size=128),
                 training_arguments(base, max_steps=2, save_steps=100))
    args = FinetuneArguments(model_name_or_path=str(base), train_files=[text_file], block_size=128, lora=True,
                             lora_r=4)
    run_finetune(args, training_arguments(tmp_path / "lora", max_steps=8, save_steps=100, learning_rate=1e-2))

    from peft import LoraConfig

    from hybrid_indexpool.training import add_lora_adapters

    # The merged checkpoint has no adapter weights and fits the training text better than the base model.
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "lora")
    original = AutoModelForCausalLM.from_pretrained(base)
    assert not any("lora" in name for name in merged.state_dict())
    blocks = torch.tensor(build_lm_dataset([text_file], byte_level_tokenizer(), 128, True)["input_ids"][:16])
    with torch.no_grad():
        assert merged(blocks, labels=blocks).loss < original(blocks, labels=blocks).loss - 0.05
    input_ids = torch.randint(3, 259, (1, 50))

    # Merging is exact: an adapted model gives the same logits before and after merge, save and reload.
    adapted = add_lora_adapters(original, LoraConfig(r=4, target_modules=["q_proj", "in_proj_qkv", "down_proj"],
                                                  init_lora_weights=False))
    with torch.no_grad():
        before = adapted(input_ids).logits
    adapted.merge_and_unload().save_pretrained(tmp_path / "merged")
    with torch.no_grad():
        after = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")(input_ids).logits
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)


def test_refuses_a_non_empty_output_folder_and_bad_data(tmp_path, text_file):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "keep.txt").write_text("precious")
    args = FinetuneArguments(init_config=TINY, train_files=[text_file])
    with pytest.raises(ValueError, match="exists and is not empty"):
        run_finetune(args, training_arguments(tmp_path / "run"))
    assert (tmp_path / "run" / "keep.txt").read_text() == "precious"
    with pytest.raises(ValueError, match="Data files not found"):
        build_lm_dataset([str(tmp_path / "missing.txt")], byte_level_tokenizer(), 64, True)
    with pytest.raises(ValueError, match="exactly one of --model_name_or_path"):
        run_finetune(FinetuneArguments(train_files=[text_file]), training_arguments(tmp_path / "new"))


def test_packed_blocks_keep_every_example_to_itself(tmp_path):
    data = tmp_path / "train.txt"
    data.write_text("\n\n".join(f"example {i} " + "word " * (i % 5 + 2) for i in range(30)))
    tokenizer = byte_level_tokenizer()
    blocks = build_lm_dataset([str(data)], tokenizer, 64, packing=True)
    for row in range(len(blocks)):
        ids, positions, labels = (torch.tensor(blocks[row][name]) for name in ("input_ids", "position_ids", "labels"))
        starts = (positions == 0).nonzero().flatten().tolist()
        assert starts[0] == 0 and len(starts) > 1  # several examples per block, positions restarting at each
        for start in starts[1:]:
            assert ids[start - 1] == tokenizer.eos_token_id and labels[start] == -100
        assert torch.equal(labels[positions != 0], ids[positions != 0])
    # The model runs each example of a block alone.
    model = AutoModelForCausalLM.from_config(
        __import__("hybrid_indexpool").HybridIndexPoolConfig(**json.loads(TINY), vocab_size=259)).eval()
    ids, positions = torch.tensor([blocks[0]["input_ids"]]), torch.tensor([blocks[0]["position_ids"]])
    starts = (positions[0] == 0).nonzero().flatten().tolist() + [64]
    with torch.no_grad():
        packed = model(ids, position_ids=positions).logits
        for start, end in zip(starts, starts[1:]):
            torch.testing.assert_close(packed[:, start:end], model(ids[:, start:end]).logits, atol=1e-5, rtol=0)


def test_refuses_empty_and_non_utf8_data_files_by_name(tmp_path):
    empty, binary = tmp_path / "empty.txt", tmp_path / "latin.txt"
    empty.write_text("  \n")
    binary.write_bytes("caf\xe9 au lait".encode("latin-1"))
    with pytest.raises(ValueError, match="empty.txt is empty"):
        build_lm_dataset([str(empty)], byte_level_tokenizer(), 64, True)
    with pytest.raises(ValueError, match="latin.txt is not UTF-8"):
        build_lm_dataset([str(binary)], byte_level_tokenizer(), 64, True)


def test_resume_last_takes_the_newest_complete_checkpoint(tmp_path, text_file):
    from hybrid_indexpool.training import last_complete_checkpoint

    args = FinetuneArguments(init_config=TINY, train_files=[text_file], block_size=128)
    run_finetune(args, training_arguments(tmp_path / "run", max_steps=4, save_steps=4))
    (tmp_path / "run" / "checkpoint-6").mkdir()  # a save interrupted by Ctrl-C: no trainer state
    assert last_complete_checkpoint(tmp_path / "run") == str(tmp_path / "run" / "checkpoint-4")
    resumed = run_finetune(args, training_arguments(tmp_path / "run", max_steps=6, save_steps=100,
                                                    resume_from_checkpoint="last"))
    # Resuming from the empty checkpoint-6 (what get_last_checkpoint picks) would have failed to load.
    steps = [entry["step"] for entry in resumed["log_history"] if "loss" in entry]
    assert steps[-2:] == [5, 6]
    with pytest.raises(ValueError, match="no complete checkpoint"):
        last_complete_checkpoint(tmp_path / "elsewhere")


def test_warns_when_the_block_size_passes_the_trained_positions(tmp_path, text_file):
    from hybrid_indexpool.training import load_model

    small = json.dumps({**json.loads(TINY), "max_position_embeddings": 64})
    with pytest.warns(UserWarning, match="beyond the model's max_position_embeddings"):
        load_model(FinetuneArguments(init_config=small, train_files=[text_file], block_size=128),
                   byte_level_tokenizer())


@pytest.mark.parametrize("packing", [True, False])
def test_a_mixture_of_experts_trains_with_the_load_balancing_loss(tmp_path, text_file, packing):
    # A coefficient large enough that the aux loss (at least num_experts_per_tok = 2 by construction) shows.
    moe = json.dumps({**json.loads(TINY), "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                      "router_aux_loss_coef": 100.0})
    first_losses = {}
    for router_aux_loss in (True, False):
        args = FinetuneArguments(init_config=moe, train_files=[text_file], block_size=64, packing=packing,
                                 router_aux_loss=router_aux_loss)
        output_dir = tmp_path / f"run-{router_aux_loss}"
        metrics = run_finetune(args, training_arguments(output_dir, max_steps=1, save_steps=100,
                                                        per_device_train_batch_size=2))
        first_losses[router_aux_loss] = [entry["loss"] for entry in metrics["log_history"] if "loss" in entry][0]
        # The router logits were for training: the saved model does not return them by default.
        assert AutoModelForCausalLM.from_pretrained(output_dir).config.output_router_logits is False
    assert first_losses[True] - first_losses[False] > 100 * 1.5
