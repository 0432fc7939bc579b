"""GLM-5.3-Flash checkpoints converted to ours and loaded through the saved remote code compute what the source
computes in float32: logits within 1e-4 and the same greedy tokens beyond the budget, on a left-padded batch, in
chunked prefill, with generate(), with images and video; and the refusals."""

import json

import pytest
import torch
from checkpoint_files import saved_tensors
from glm_sources import PATCH, VARIANTS, VISION_TOKENS, save_glm_source, tiny_glm_source
from qwen_sources import save_source, tiny_source_model
from transformers.dynamic_module_utils import get_class_from_dynamic_module
from transformers.models.glm5_next.image_processing_pil_glm5_next import Glm5NextImageProcessorPil

from hybrid_indexpool.conversion import ConversionError, convert_glm5_next

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
QUIET = dict(progress=False, log=lambda message: None)
TOLERANCE = 1e-4


def load_remote_code(folder, auto_class: str):
    """The model of the checkpoint in `folder`, of the class `auto_map` names for `auto_class`, loaded from the
    checkpoint's own flat modules (not from the installed package)."""
    reference = json.loads((folder / "config.json").read_text())["auto_map"][auto_class]
    model = get_class_from_dynamic_module(reference, folder).from_pretrained(folder).eval()
    assert not type(model).__module__.startswith("hybrid_indexpool"), type(model).__module__
    return model


# The first two variants take every option one way or the other; the other two mix them again, in the slow suite.
@pytest.fixture(scope="module", ids=lambda variant: variant.name,
                params=[*VARIANTS[:2], *(pytest.param(variant, marks=pytest.mark.slow) for variant in VARIANTS[2:])])
def converted(request, tmp_path_factory):
    """(variant, source model, our model loaded as remote code, folder with `source` and the converted checkpoint)."""
    variant = request.param
    folder = tmp_path_factory.mktemp(variant.name)
    source = tiny_glm_source(variant)
    save_source(source, folder / "source", max_shard_size="60KB")
    output = folder / f"glm-{variant.name}"  # one remote-code module name per variant
    convert_glm5_next(folder / "source", output, max_shard_size="60KB", **QUIET)
    return variant, source, load_remote_code(output, "AutoModelForImageTextToText"), folder


def media_tokens(kind: str, grid: list[int]) -> list[int]:
    """GLM's placeholders of an image, or of a video: each frame an image between image delimiters and then a
    timestamp, the frames between video delimiters."""
    frames, per_frame = grid[0], grid[1] * grid[2] // 4  # 2 x 2 patches merge into one token
    image = [VISION_TOKENS["image_start_token_id"], *[VISION_TOKENS["image_token_id"]] * per_frame,
             VISION_TOKENS["image_end_token_id"]]
    if kind == "image":
        return image
    frame_tokens = [token for frame in range(frames) for token in image + [40 + frame]]
    return [VISION_TOKENS["video_start_token_id"], *frame_tokens, VISION_TOKENS["video_end_token_id"]]


def prompts(variant, media=(), seed: int = 0):
    """Two left-padded rows of about four budgets (the second padded by 9); `media[row]`, `("image" | "video", grid)`,
    puts an image or a video in the middle of that row. Returns `(input_ids, attention_mask, vision inputs)`."""
    generator = torch.Generator().manual_seed(seed)
    budget = 2 * variant.kpool
    rows = []
    for row in range(2):
        length = 4 * budget + 5 - 9 * row
        tokens = torch.randint(2, 88, (length,), generator=generator).tolist()
        if row < len(media):
            placeholders = media_tokens(*media[row])
            tokens[length // 3: length // 3 + len(placeholders)] = placeholders
        rows.append(tokens)
    width = max(map(len, rows))
    input_ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for row, tokens in enumerate(rows):
        input_ids[row, width - len(tokens):], mask[row, width - len(tokens):] = torch.tensor(tokens), 1
    vision = {}
    for kind, pixels, grids in (("image", "pixel_values", "image_grid_thw"),
                                ("video", "pixel_values_videos", "video_grid_thw")):
        grid_thw = torch.tensor([grid for media_kind, grid in media if media_kind == kind]).view(-1, 3)
        if len(grid_thw):
            vision[pixels] = torch.randn(int(grid_thw.prod(-1).sum()), PATCH, generator=generator)
            vision[grids] = grid_thw
    return input_ids, mask, vision


def max_difference(expected, actual, mask):
    return (expected - actual)[mask.bool()].abs().max().item()


def test_logits_equal_glm_beyond_the_budget_alone_and_left_padded(converted):
    variant, source, ours, _ = converted
    input_ids, mask, _ = prompts(variant)
    with torch.no_grad():
        single = (source(input_ids[:1]).logits - ours(input_ids[:1]).logits).abs().max().item()
        padded = max_difference(source(input_ids, attention_mask=mask).logits,
                                ours(input_ids, attention_mask=mask).logits, mask)
    print(f"GLM-5.3-Flash {variant.name} -> ours: max |logit difference| {single:.2e} ({input_ids.shape[1]} tokens, "
          f"budget {2 * variant.kpool}), {padded:.2e} (left-padded)")
    assert single <= TOLERANCE and padded <= TOLERANCE


def test_chunked_prefill_equals_glm(converted):
    variant, source, ours, _ = converted
    input_ids, mask, _ = prompts(variant, seed=1)
    with torch.no_grad():
        expected = source(input_ids, attention_mask=mask).logits
        ours.config.text_config.prefill_chunk_length = 2 * variant.kpool + 3  # chunks that cut through windows
        try:
            actual = ours(input_ids, attention_mask=mask, use_cache=True).logits
        finally:
            ours.config.text_config.prefill_chunk_length = 8192
    assert max_difference(expected, actual, mask) <= TOLERANCE


def test_greedy_generation_equals_glm(converted):
    variant, source, ours, _ = converted
    input_ids, mask, _ = prompts(variant, seed=2)
    with torch.no_grad():
        expected = source.generate(input_ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
        actual = ours.generate(input_ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    assert torch.equal(actual, expected)


@pytest.mark.parametrize("media", [
    (("image", [1, 4, 4]),),  # one row with an image, one without
    (("image", [1, 4, 4]), ("image", [1, 4, 8])),
    (("video", [2, 4, 4]), ("image", [1, 4, 8])),  # a video's frames are image placeholders inside video delimiters
], ids=["image-and-text", "two-images", "video-and-image"])
def test_images_and_video_give_glms_logits_and_tokens(converted, media):
    variant, source, ours, _ = converted
    input_ids, mask, vision = prompts(variant, media, seed=3)
    with torch.no_grad():
        difference = max_difference(source(input_ids, attention_mask=mask, **vision).logits,
                                    ours(input_ids, attention_mask=mask, **vision).logits, mask)
        expected = source.generate(input_ids, attention_mask=mask, max_new_tokens=8, do_sample=False, **vision)
        actual = ours.generate(input_ids, attention_mask=mask, max_new_tokens=8, do_sample=False, **vision)
    print(f"GLM-5.3-Flash {variant.name} -> ours, {media}: max |logit difference| {difference:.2e}")
    assert difference <= TOLERANCE
    assert torch.equal(actual, expected)


def test_text_only_conversion_gives_the_causal_lm(tmp_path):
    variant = VARIANTS[0]
    source = tiny_glm_source(variant)
    save_source(source, tmp_path / "source", max_shard_size="60KB")
    messages = []
    report = convert_glm5_next(tmp_path / "source", tmp_path / "glm-text", text_only=True, progress=False,
                               log=messages.append)
    assert any("vision tower is left out" in message for message in messages)
    assert any(name.startswith("model.visual.") for names in report.ignored.values() for name in names)
    ours = load_remote_code(tmp_path / "glm-text", "AutoModelForCausalLM")
    assert type(ours).__name__ == "HybridIndexPoolForCausalLM"
    input_ids, mask, _ = prompts(variant, seed=4)
    with torch.no_grad():
        difference = max_difference(source(input_ids, attention_mask=mask).logits,
                                    ours(input_ids, attention_mask=mask).logits, mask)
        expected = source.generate(input_ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
        actual = ours.generate(input_ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert difference <= TOLERANCE and torch.equal(actual, expected)


def test_the_processor_files_and_the_mtp_layer_are_kept(tmp_path):
    folder, _ = save_glm_source(tiny_glm_source(VARIANTS[1]), tmp_path / "source")
    Glm5NextImageProcessorPil(patch_size=14, merge_size=2).save_pretrained(folder)
    report = convert_glm5_next(folder, tmp_path / "ours", **QUIET)
    assert report.ignored == {}
    processor_file = "preprocessor_config.json"
    assert (tmp_path / "ours" / processor_file).read_text() == (folder / processor_file).read_text()
    assert Glm5NextImageProcessorPil.from_pretrained(tmp_path / "ours").patch_size == 14
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert config["auto_map"]["AutoModelForImageTextToText"].endswith("HybridIndexPoolForConditionalGeneration")
    assert config["vision_config"]["model_type"] == "glm5_next_vision"
    assert config["text_config"]["attention_type"] == "mla"
    assert config["text_config"]["linear_attention_type"] == "kimi_delta"
    assert config["text_config"]["num_mtp_layers"] == 1 and config["text_config"]["mtp_type"] == "deepseek"
    tensors = saved_tensors(tmp_path / "ours")
    source_tensors = saved_tensors(folder)
    assert torch.equal(tensors["model.language_model.mtp.layers.0.input_proj.weight"],
                       source_tensors["model.language_model.layers.5.eh_proj.weight"])


@pytest.mark.parametrize("variant", VARIANTS[:2], ids=lambda variant: variant.name)
def test_the_mtp_layer_computes_what_the_source_modules_compute(variant, tmp_path):
    """Our next-next-token logits against GLM's own modules composed as vLLM's GLM-5.3-Flash MTP layer does
    (transformers has no MTP): the embedding of the next token (zero at position 0) and the final hidden state,
    normed, concatenated and projected, a pre-norm MLA block with its indexer, `shared_head.norm`, the head."""
    source = tiny_glm_source(variant)
    folder, mtp = save_glm_source(source, tmp_path / "source")
    convert_glm5_next(folder, tmp_path / "ours", **QUIET)
    ours = load_remote_code(tmp_path / "ours", "AutoModelForImageTextToText")
    input_ids = torch.randint(2, 88, (1, 10 * variant.kpool + 3), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        actual = ours(input_ids, output_mtp_logits=True, use_cache=False).mtp_logits[0][:, :-1]
        text = source.model.language_model
        hidden = text(input_ids=input_ids).last_hidden_state[:, :-1]
        embeds = text.embed_tokens(input_ids[:, 1:]).clone()
        embeds[:, 0] = 0
        states = mtp["eh_proj"](torch.cat([mtp["enorm"](embeds), mtp["hnorm"](hidden)], dim=-1))
        mask = torch.ones(states.shape[:2], dtype=torch.bool)
        positions = torch.arange(states.shape[1])[None]
        states = states + mtp["self_attn"](mtp["input_layernorm"](states), attention_mask=mask,
                                           position_ids=positions, position_embeddings=None)[0]
        states = states + mtp["mlp"](mtp["post_attention_layernorm"](states))
        expected = source.lm_head(mtp["shared_head.norm"](states))
    assert (actual - expected).abs().max() <= TOLERANCE


def test_refusals_leave_the_users_files_alone(tmp_path):
    folder = save_source(tiny_glm_source(VARIANTS[1]), tmp_path / "source", max_shard_size="60KB")
    output = tmp_path / "ours"
    output.mkdir()
    (output / "mine.txt").write_text("keep me")
    with pytest.raises(ConversionError, match="already exists"):
        convert_glm5_next(folder, output, **QUIET)
    assert [path.name for path in output.iterdir()] == ["mine.txt"] and (output / "mine.txt").read_text() == "keep me"

    save_source(tiny_source_model("qwen3_next"), tmp_path / "next")
    with pytest.raises(ConversionError, match=r"model_type 'qwen3_next'.*convert_glm5_next.py converts only model "
                                              r"types \['glm5_next'\]: use scripts/convert_qwen3_next.py"):
        convert_glm5_next(tmp_path / "next", tmp_path / "out", **QUIET)

    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["index_kpool_always_select_tail"] = False
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match="index_kpool_always_select_tail"):
        convert_glm5_next(folder, tmp_path / "out", **QUIET)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))
