"""GLM-5.3-Flash -> ours -> GLM-5.3-Flash: the export gives back the source's tensors bit for bit (its MTP layer
included) and its config, and a
model changed here loads in transformers' `Glm5NextForConditionalGeneration` with our logits; what GLM's format
cannot express is refused."""

import warnings

import pytest
import torch
from checkpoint_files import config_dict, differing_tensors, saved_tensors
from glm_sources import VARIANTS, save_glm_source, tiny_glm_source
from transformers import AutoModelForImageTextToText, Glm5NextForConditionalGeneration
from transformers.models.glm5_next.image_processing_pil_glm5_next import Glm5NextImageProcessorPil

from hybrid_indexpool.conversion import ConversionError, ExportWarning, convert_glm5_next, export_glm5_next

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
QUIET = dict(progress=False, log=lambda message: None)


# The first two variants take every option one way or the other; the other two mix them again, in the slow suite.
@pytest.fixture(scope="module", ids=lambda variant: variant.name,
                params=[*VARIANTS[:2], *(pytest.param(variant, marks=pytest.mark.slow) for variant in VARIANTS[2:])])
def round_trip(request, tmp_path_factory):
    """(variant, folder): `source` saved by transformers, `ours` converted from it, `back` exported from ours."""
    variant = request.param
    folder = tmp_path_factory.mktemp(f"export-{variant.name}")
    # With an MTP layer: DeepSeek's layout (copies of the embedding and head in it) for the first variant only.
    save_glm_source(tiny_glm_source(variant), folder / "source", copies=variant == VARIANTS[0])
    Glm5NextImageProcessorPil(patch_size=14, merge_size=2).save_pretrained(folder / "source")
    convert_glm5_next(folder / "source", folder / "ours", max_shard_size="60KB", **QUIET)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        export_glm5_next(folder / "ours", folder / "back", max_shard_size="60KB", **QUIET)
    # Nothing is missing: the tokenizer and the processor went through the conversion and back.
    assert [str(warning.message) for warning in caught if warning.category is ExportWarning] == []
    return variant, folder


def test_source_to_ours_to_source_gives_the_same_tensors_names_and_config(round_trip):
    _, folder = round_trip
    assert differing_tensors(folder / "source", folder / "back") == []
    assert config_dict(folder / "back") == config_dict(folder / "source")
    for file_name in ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json"):
        assert (folder / "back" / file_name).read_bytes() == (folder / "source" / file_name).read_bytes()
    assert Glm5NextImageProcessorPil.from_pretrained(folder / "back").patch_size == 14


def test_a_model_trained_here_loads_in_glms_class_with_our_logits(round_trip, tmp_path):
    variant, folder = round_trip
    ours = AutoModelForImageTextToText.from_pretrained(folder / "ours", trust_remote_code=True)
    # A few steps on the indexer (its pooling gate and slot biases included), as the indexer training does.
    indexer = [parameter for name, parameter in ours.named_parameters() if ".indexer." in name]
    for parameter in ours.parameters():
        parameter.requires_grad_(False)
    for parameter in indexer:
        parameter.requires_grad_(True)
    optimizer = torch.optim.SGD(indexer, lr=0.5)
    generator = torch.Generator().manual_seed(0)
    budget = 2 * variant.kpool
    for _ in range(3):
        input_ids = torch.randint(2, 88, (2, 5 * budget), generator=generator)
        loss = ours(input_ids, indexer_loss="dense").indexer_loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    mtp_projection = ours.model.language_model.mtp.layers[0].input_proj.weight
    with torch.no_grad():  # the MTP layer changed too (as the MTP loss would)
        mtp_projection.mul_(1.5)
    ours.eval().save_pretrained(tmp_path / "trained")
    export_glm5_next(tmp_path / "trained", tmp_path / "glm", **QUIET)
    assert torch.equal(saved_tensors(tmp_path / "glm")["model.language_model.layers.5.eh_proj.weight"], mtp_projection)

    glm = Glm5NextForConditionalGeneration.from_pretrained(tmp_path / "glm").eval()
    changed = glm.state_dict()
    original = Glm5NextForConditionalGeneration.from_pretrained(folder / "source").state_dict()
    assert any(not torch.equal(changed[name], original[name]) for name in changed if "indexer" in name)
    input_ids = torch.randint(2, 88, (2, 5 * budget), generator=generator)
    with torch.no_grad():
        difference = (glm(input_ids).logits - ours(input_ids).logits).abs().max().item()
    assert difference <= 1e-4


def test_what_glms_format_cannot_express_is_refused(round_trip, tmp_path):
    _, folder = round_trip
    ours = AutoModelForImageTextToText.from_pretrained(folder / "ours", trust_remote_code=True)
    ours.config.text_config.index_sink_windows = 1
    ours.save_pretrained(tmp_path / "sinks")
    with pytest.raises(ConversionError, match=r"cannot express index_sink_windows = 1 \(GLM: 0\)"):
        export_glm5_next(tmp_path / "sinks", tmp_path / "out", **QUIET)
    convert_glm5_next(folder / "source", tmp_path / "text", text_only=True, **QUIET)
    with pytest.raises(ConversionError, match="this model has none; export a model converted without --text_only"):
        export_glm5_next(tmp_path / "text", tmp_path / "out", **QUIET)
    assert not (tmp_path / "out").exists()


def test_wrong_inputs_and_an_existing_output_are_refused_and_nothing_is_touched(round_trip, tmp_path):
    _, folder = round_trip
    with pytest.raises(ConversionError, match="model_type 'glm5_next' checkpoint; the export reads HybridIndexPool"):
        export_glm5_next(folder / "source", tmp_path / "out", **QUIET)
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text("{}")
    with pytest.raises(ConversionError, match="holds LoRA adapters, not a model. Merge them"):
        export_glm5_next(tmp_path / "adapter", tmp_path / "out", **QUIET)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep")
    with pytest.raises(ConversionError, match="already exists"):
        export_glm5_next(folder / "ours", tmp_path / "out", **QUIET)
    assert [path.name for path in (tmp_path / "out").iterdir()] == ["mine.txt"]


def test_a_model_built_here_in_glms_variant_exports_without_a_stored_source_config(round_trip, tmp_path):
    _, folder = round_trip
    config = AutoModelForImageTextToText.from_pretrained(folder / "ours", trust_remote_code=True).config
    config.text_config.source_config = None  # as if built here: every GLM field from ours, the rest GLM's defaults
    torch.manual_seed(3)
    ours = type(AutoModelForImageTextToText.from_pretrained(folder / "ours", trust_remote_code=True))(config).eval()
    ours.save_pretrained(tmp_path / "fresh")
    export_glm5_next(tmp_path / "fresh", tmp_path / "glm", **QUIET)
    glm = Glm5NextForConditionalGeneration.from_pretrained(tmp_path / "glm").eval()
    input_ids = torch.randint(2, 88, (1, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert (glm(input_ids).logits - ours(input_ids).logits).abs().max().item() <= 1e-4
