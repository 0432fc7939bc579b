"""Qwen4-Exp -> ours -> Qwen4-Exp: the export gives back the source's tensors bit for bit and its config (text and
multimodal, hyper-connections, PLE with split n-gram tables, MoE, the MTP head), and a model changed here loads in
transformers' Qwen4-Exp classes with our logits; learned pooling that left the mean is refused."""

import json
import warnings

import pytest
import torch
from checkpoint_files import config_dict, differing_tensors, saved_tensors
from qwen_sources import save_qwen4_source, save_source, tiny_qwen4_source
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from hybrid_indexpool.conversion import ConversionError, ExportWarning, convert_qwen4_exp, export_qwen4_exp

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
QUIET = dict(progress=False, log=lambda message: None)
# A multimodal Qwen4-Exp's image processor settings (Qwen3-VL's processor), as its preprocessor_config.json holds them.
PROCESSOR = {"processor_class": "Qwen3VLProcessor", "image_processor_type": "Qwen2VLImageProcessor", "patch_size": 16,
             "merge_size": 2, "temporal_patch_size": 2}


@pytest.fixture(scope="module", params=["text", "multimodal"])
def round_trip(request, tmp_path_factory):
    """(kind, folder): `source` saved by transformers, `ours` converted from it, `back` exported from ours."""
    folder = tmp_path_factory.mktemp(f"export-qwen4-{request.param}")
    # 32 index heads: with few, ReLU scores tie at zero, and the two implementations break ties differently.
    source = tiny_qwen4_source(multimodal=request.param == "multimodal", indexer_n_heads=32)
    save_qwen4_source(source, folder / "source")  # with an MTP head
    if request.param == "multimodal":  # its processor, as the released checkpoint ships it
        (folder / "source" / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    convert_qwen4_exp(folder / "source", folder / "ours", max_shard_size="40KB", **QUIET)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        export_qwen4_exp(folder / "ours", folder / "back", max_shard_size="40KB", **QUIET)
    # Nothing is missing: the tokenizer (and the processor) went through the conversion and back.
    assert [str(warning.message) for warning in caught if warning.category is ExportWarning] == []
    return request.param, folder


def test_source_to_ours_to_source_gives_the_same_tensors_names_and_config(round_trip):
    kind, folder = round_trip
    assert differing_tensors(folder / "source", folder / "back") == []
    assert config_dict(folder / "back") == config_dict(folder / "source")
    shipped = ["tokenizer.json", "tokenizer_config.json"] + (["preprocessor_config.json"] if kind == "multimodal"
                                                               else [])
    for file_name in shipped:
        assert (folder / "back" / file_name).read_bytes() == (folder / "source" / file_name).read_bytes()


def train_indexer_projections(ours, steps: int = 3, learning_rate: float = 0.005) -> None:
    """A few steps on the indexer's projections and norms (its pooling weights frozen at the mean). Small ones: the KL
    loss of a random model soon drives every score but the first window's below zero, and ReLU scores tied at zero
    are broken differently by the two implementations."""
    trained = [parameter for name, parameter in ours.named_parameters()
               if ".indexer." in name and ".pool_" not in name]
    for parameter in ours.parameters():
        parameter.requires_grad_(False)
    for parameter in trained:
        parameter.requires_grad_(True)
    optimizer = torch.optim.SGD(trained, lr=learning_rate)
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        loss = ours(torch.randint(2, 97, (2, 48), generator=generator), indexer_loss="dense").indexer_loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    ours.eval()


def test_a_model_trained_here_loads_in_qwen4s_class_with_our_logits(round_trip, tmp_path):
    kind, folder = round_trip
    auto = AutoModelForImageTextToText if kind == "multimodal" else AutoModelForCausalLM
    ours = auto.from_pretrained(folder / "ours", trust_remote_code=True)
    train_indexer_projections(ours)
    mtp_projection = next(parameter for name, parameter in ours.named_parameters()
                          if name.endswith("mtp.embedding_proj.weight"))
    with torch.no_grad():  # the MTP head changed too (as the MTP loss would)
        mtp_projection.mul_(1.5)
    ours.save_pretrained(tmp_path / "trained")
    export_qwen4_exp(tmp_path / "trained", tmp_path / "qwen4", **QUIET)
    assert torch.equal(saved_tensors(tmp_path / "qwen4")["mtp.fc_embedding.weight"], mtp_projection)
    qwen4 = auto.from_pretrained(tmp_path / "qwen4").eval()
    assert type(qwen4).__name__ == ("Qwen4ExpForConditionalGeneration" if kind == "multimodal" else
                                    "Qwen4ExpForCausalLM")
    original = auto.from_pretrained(folder / "source").state_dict()
    assert any(not torch.equal(tensor, original[name]) for name, tensor in qwen4.state_dict().items()
               if "indexer" in name)
    input_ids = torch.randint(2, 97, (1, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        difference = (qwen4(input_ids).logits - ours(input_ids).logits).abs().max().item()
    assert difference <= 1e-4


def test_learned_pooling_away_from_the_mean_and_other_variants_are_refused(round_trip, tmp_path):
    kind, folder = round_trip
    auto = AutoModelForImageTextToText if kind == "multimodal" else AutoModelForCausalLM
    model = auto.from_pretrained(folder / "ours", trust_remote_code=True)
    indexer = next(module for name, module in model.named_modules() if name.endswith("layers.3.self_attn.indexer"))
    with torch.no_grad():
        indexer.pool_slot_bias.add_(0.1)
    model.save_pretrained(tmp_path / "pooled")
    with pytest.raises(ConversionError,
                       match=r"The learned pooling of model.layers.3.self_attn.indexer .* has moved from the mean"):
        export_qwen4_exp(tmp_path / "pooled", tmp_path / "out", **QUIET)
    assert not (tmp_path / "out").exists()
    model.config.get_text_config().index_local_windows = 1
    model.save_pretrained(tmp_path / "local")
    with pytest.raises(ConversionError, match=r"cannot express index_local_windows = 1 \(Qwen4-Exp: 0\)"):
        export_qwen4_exp(tmp_path / "local", tmp_path / "out", **QUIET)


def test_tied_embeddings_round_trip(tmp_path):
    save_source(tiny_qwen4_source(tie_word_embeddings=True), tmp_path / "source", max_shard_size="40KB")
    convert_qwen4_exp(tmp_path / "source", tmp_path / "ours", **QUIET)
    export_qwen4_exp(tmp_path / "ours", tmp_path / "back", **QUIET)
    assert "lm_head.weight" not in saved_tensors(tmp_path / "back")
    assert differing_tensors(tmp_path / "source", tmp_path / "back") == []
    assert config_dict(tmp_path / "back") == config_dict(tmp_path / "source")
