"""The README's round trip ("Back to the source formats") on the command line, on tiny models: convert, train the
indexer here, export, load in the source's transformers class. GLM-5.3-Flash conversions are multimodal, so this is
also the training commands on a multimodal checkpoint; Qwen4-Exp's export needs the pooling weights frozen."""

import json
from pathlib import Path

import pytest
import torch
from checkpoint_files import saved_tensors
from glm_sources import save_glm_source, tiny_glm_source
from qwen_sources import save_qwen4_source, tiny_qwen4_source
from transformers import AutoModelForImageTextToText, Glm5NextForConditionalGeneration
from transformers.models.glm5_next.image_processing_pil_glm5_next import Glm5NextImageProcessorPil

from hybrid_indexpool.scripts import (
    convert_glm5_next,
    convert_qwen4_exp,
    export_glm5_next,
    export_qwen4_exp,
    finetune,
    train_indexer,
)
from hybrid_indexpool.tokenization import byte_level_tokenizer
from hybrid_indexpool.training import FinetuneArguments, build_model

pytestmark = pytest.mark.filterwarnings("ignore")
# The byte-level tokenizer the tiny sources are saved with has 259 tokens: the training commands refuse a model
# with fewer embeddings than its tokenizer has tokens.
VOCAB = 259


def data_file(folder: Path) -> Path:
    """A small text file to train on: some of the standard library's source."""
    path = folder / "train.txt"
    path.write_text(Path(json.__file__).read_text()[:6000])
    return path


def train_command(model: Path, data: Path, output: Path, *extra: str) -> list[str]:
    """train_indexer's command line as the README gives it, with tiny sizes: blocks of 32 tokens beyond the budget
    (8 tokens), a couple of steps per stage."""
    return ["--model_name_or_path", str(model), "--train_files", str(data), "--output_dir", str(output),
            "--block_size", "32", "--per_device_train_batch_size", "2", "--report_to", "none", "--save_strategy",
            "no", "--seed", "0", "--dense_warmup_learning_rate", "1e-2", *extra]


def test_glm_convert_train_the_indexer_export_and_load_in_glms_class(tmp_path):
    source = tiny_glm_source(vocab_size=VOCAB)
    save_glm_source(source, tmp_path / "source")
    Glm5NextImageProcessorPil(patch_size=14, merge_size=2).save_pretrained(tmp_path / "source")
    convert_glm5_next.main(["--source", str(tmp_path / "source"), "--output", str(tmp_path / "ours"),
                            "--no_progress"])
    train_indexer.main(train_command(tmp_path / "ours", data_file(tmp_path), tmp_path / "trained", "--stage", "both",
                                     "--dense_warmup_steps", "2", "--sparse_steps", "1"))
    # The training kept the multimodal model (vision tower and processor), so GLM's multimodal format can take it.
    assert json.loads((tmp_path / "trained" / "config.json").read_text())["model_type"] == \
        "hybrid_indexpool_multimodal"
    assert (tmp_path / "trained" / "preprocessor_config.json").is_file()
    export_glm5_next.main(["--source", str(tmp_path / "trained"), "--output", str(tmp_path / "glm"), "--no_progress"])
    for file_name in ("preprocessor_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "glm" / file_name).is_file(), file_name
    assert Glm5NextImageProcessorPil.from_pretrained(tmp_path / "glm").patch_size == 14

    # LoRA (the fine-tune script's --lora) adapts the language model only: the vision tower does not train on text.
    adapted = build_model(FinetuneArguments(model_name_or_path=str(tmp_path / "ours"), lora=True),
                          byte_level_tokenizer())
    lora_layers = [name for name, _ in adapted.named_modules() if name.endswith(".lora_A")]
    assert lora_layers and all(".visual." not in name for name in lora_layers)
    assert any(".language_model." in name and "mlp" in name for name in lora_layers)

    glm = Glm5NextForConditionalGeneration.from_pretrained(tmp_path / "glm").eval()
    ours = AutoModelForImageTextToText.from_pretrained(tmp_path / "trained").eval()
    trained, original = glm.state_dict(), source.state_dict()
    assert any(not torch.equal(trained[name], original[name]) for name in trained if ".indexer." in name)
    input_ids = torch.randint(2, VOCAB, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (glm(input_ids).logits - ours(input_ids).logits).abs().max().item() <= 1e-4


@pytest.fixture(scope="module")
def qwen4_converted(tmp_path_factory):
    """A multimodal tiny Qwen4-Exp converted on the command line, and a data file."""
    folder = tmp_path_factory.mktemp("qwen4-recipe")
    save_qwen4_source(tiny_qwen4_source(multimodal=True, vocab_size=VOCAB, indexer_n_heads=32), folder / "source")
    convert_qwen4_exp.main(["--source", str(folder / "source"), "--output", str(folder / "ours"), "--no_progress"])
    return folder / "ours", data_file(folder)


def pooling_weights(folder: Path) -> dict[str, torch.Tensor]:
    return {name: tensor for name, tensor in saved_tensors(folder).items() if ".indexer.pool_" in name}


def test_qwen4_trained_with_the_pooling_frozen_exports(qwen4_converted, tmp_path):
    ours, data = qwen4_converted
    train_indexer.main(train_command(ours, data, tmp_path / "trained", "--stage", "both", "--dense_warmup_steps", "2",
                                     "--sparse_steps", "1", "--freeze_pooling"))
    before, after = saved_tensors(ours), saved_tensors(tmp_path / "trained")
    assert any(not torch.equal(before[name], after[name]) for name in after if ".indexer.q_proj" in name)
    frozen = pooling_weights(tmp_path / "trained")
    assert frozen and all(not tensor.any() for tensor in frozen.values())  # still the mean
    export_qwen4_exp.main(["--source", str(tmp_path / "trained"), "--output", str(tmp_path / "qwen4"),
                           "--no_progress"])
    qwen4 = AutoModelForImageTextToText.from_pretrained(tmp_path / "qwen4")
    assert type(qwen4).__name__ == "Qwen4ExpForConditionalGeneration"


def test_qwen4_trained_without_frozen_pooling_is_refused_naming_the_option(qwen4_converted, tmp_path, capsys):
    ours, data = qwen4_converted
    train_indexer.main(train_command(ours, data, tmp_path / "trained", "--stage", "warmup", "--dense_warmup_steps",
                                     "1"))
    assert any(tensor.any() for tensor in pooling_weights(tmp_path / "trained").values())  # the warm-up moved them
    with pytest.raises(SystemExit) as stop:
        export_qwen4_exp.main(["--source", str(tmp_path / "trained"), "--output", str(tmp_path / "qwen4"),
                               "--no_progress"])
    error = capsys.readouterr().err
    assert stop.value.code == 2 and "has moved from the mean" in error and "--freeze_pooling" in error
    assert not (tmp_path / "qwen4").exists()


def test_finetune_trains_a_multimodal_checkpoint_and_freezes_the_pooling_when_asked(qwen4_converted, tmp_path):
    ours, data = qwen4_converted
    finetune.main(["--model_name_or_path", str(ours), "--train_files", str(data), "--output_dir",
                   str(tmp_path / "tuned"), "--block_size", "32", "--per_device_train_batch_size", "2", "--max_steps",
                   "1", "--report_to", "none", "--save_strategy", "no"])
    assert json.loads((tmp_path / "tuned" / "config.json").read_text())["model_type"] == "hybrid_indexpool_multimodal"
    tokenizer = byte_level_tokenizer()
    for freeze in (False, True):
        model = build_model(FinetuneArguments(model_name_or_path=str(ours), freeze_pooling=freeze), tokenizer)
        trainable = {name for name, parameter in model.named_parameters() if parameter.requires_grad}
        pooling = {name for name, _ in model.named_parameters() if ".indexer.pool_" in name}
        assert pooling and (trainable.isdisjoint(pooling) if freeze else pooling <= trainable)
        assert any(".indexer.q_proj" in name for name in trainable)
