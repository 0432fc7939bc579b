"""Qwen4-Exp's multimodal model converted with its vision tower: images and video through our model give the
source's logits and tokens beyond the budget, text alone gives the causal LM's, and the checkpoint loads as remote
code."""

import subprocess
import sys

import pytest
import torch
from qwen_sources import VISION_TOKENS, save_source, tiny_qwen4_source
from transformers import AutoModelForImageTextToText

from hybrid_indexpool import HybridIndexPoolForCausalLM, HybridIndexPoolForConditionalGeneration
from hybrid_indexpool.conversion import convert_qwen4_exp

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
QUIET = dict(progress=False, log=lambda message: None)
PATCH = 3 * 2 * 16 * 16  # channels x temporal patch x patch x patch of the tiny vision tower


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen4_multimodal")
    source = tiny_qwen4_source(multimodal=True)
    save_source(source, folder / "source", max_shard_size="60KB")
    convert_qwen4_exp(folder / "source", folder / "ours", max_shard_size="60KB", **QUIET)
    convert_qwen4_exp(folder / "source", folder / "text", text_only=True, **QUIET)
    return source, folder


def vision_tokens(kind: str, frames: int, height: int, width: int) -> list[int]:
    """Placeholders of one image, or of a video's frames, each frame between its delimiters (after a timestamp)."""
    token = VISION_TOKENS["image_token_id" if kind == "image" else "video_token_id"]
    per_frame = height * width // 4  # 2 x 2 patches merge into one token
    tokens = []
    for frame in range(frames if kind == "video" else 1):
        if kind == "video":
            tokens.append(40 + frame)  # a timestamp
        start, end = VISION_TOKENS["vision_start_token_id"], VISION_TOKENS["vision_end_token_id"]
        tokens += [start] + [token] * per_frame + [end]
    return tokens


def batch(kind: str, seed: int = 0, text_row: bool = False):
    """Two left-padded rows past the budget (8 tokens), each with one image (of different sizes) or one video; with
    `text_row` the second row has none."""
    generator = torch.Generator().manual_seed(seed)
    grids = [[1, 4, 4], [1, 4, 8]] if kind == "image" else [[2, 4, 4], [3, 4, 4]]
    if text_row:
        grids = grids[:1]
    rows = []
    for row in range(2):
        before = torch.randint(2, 90, (5 + 3 * row,), generator=generator).tolist()
        after = torch.randint(2, 90, (30 - 4 * row,), generator=generator).tolist()
        rows.append(before + (vision_tokens(kind, *grids[row]) if row < len(grids) else []) + after)
    width = max(map(len, rows))
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for row, tokens in enumerate(rows):
        input_ids[row, width - len(tokens):], mask[row, width - len(tokens):] = torch.tensor(tokens), 1
    grid_thw = torch.tensor(grids)
    pixels = torch.randn(int(grid_thw.prod(-1).sum()), PATCH, generator=generator)
    token_types = torch.zeros_like(input_ids)
    token_types[input_ids == VISION_TOKENS[f"{kind}_token_id"]] = 1 if kind == "image" else 2
    vision = ({"pixel_values": pixels, "image_grid_thw": grid_thw} if kind == "image"
              else {"pixel_values_videos": pixels, "video_grid_thw": grid_thw})
    return input_ids, mask, vision, token_types


@pytest.mark.parametrize("kind, text_row", [("image", False), ("video", False), ("image", True)])
def test_images_and_video_give_the_sources_logits_and_tokens(converted, kind, text_row):
    source, folder = converted
    ours = AutoModelForImageTextToText.from_pretrained(folder / "ours").eval()
    assert isinstance(ours, HybridIndexPoolForConditionalGeneration)
    input_ids, mask, vision, token_types = batch(kind, text_row=text_row)
    assert input_ids.shape[1] > 3 * ours.config.text_config.index_topk  # the selection prunes
    with torch.no_grad():
        expected = source(input_ids, attention_mask=mask, mm_token_type_ids=token_types, **vision).logits
        actual = ours(input_ids, attention_mask=mask, **vision).logits
    difference = (expected - actual)[mask.bool()].abs().max().item()
    print(f"Qwen4-Exp multimodal -> ours ({kind}): max |logit difference| {difference:.2e}")
    assert difference <= 1e-4
    with torch.no_grad():
        expected = source.generate(input_ids, attention_mask=mask, mm_token_type_ids=token_types, max_new_tokens=12,
                                   do_sample=False, **vision)
        actual = ours.generate(input_ids, attention_mask=mask, max_new_tokens=12, do_sample=False, **vision)
    assert torch.equal(actual, expected)


def test_a_chunked_prefill_across_an_image_gives_one_pass(converted):
    _, folder = converted
    ours = HybridIndexPoolForConditionalGeneration.from_pretrained(folder / "ours").eval()
    input_ids, mask, vision, _ = batch("image", seed=1)
    with torch.no_grad():
        whole = ours(input_ids, attention_mask=mask, **vision).logits
        ours.config.text_config.prefill_chunk_length = 7  # chunks that cut through the images
        chunked = ours(input_ids, attention_mask=mask, use_cache=True, **vision).logits
    torch.testing.assert_close(chunked[mask.bool()], whole[mask.bool()], atol=1e-5, rtol=0)


def test_text_alone_through_the_multimodal_model_equals_the_causal_lm(converted):
    _, folder = converted
    multimodal = HybridIndexPoolForConditionalGeneration.from_pretrained(folder / "ours").eval()
    text = HybridIndexPoolForCausalLM.from_pretrained(folder / "text").eval()
    input_ids = torch.randint(2, 90, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(multimodal(input_ids).logits, text(input_ids).logits, rtol=0, atol=0)
        assert torch.equal(multimodal.generate(input_ids, max_new_tokens=8, do_sample=False),
                           text.generate(input_ids, max_new_tokens=8, do_sample=False))


LOAD_AS_REMOTE_CODE = r'''
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "hybrid_indexpool":
            raise ImportError(f"{name} is not installed here")
sys.meta_path.insert(0, Block())
import torch
from transformers import AutoModelForImageTextToText
model = AutoModelForImageTextToText.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
assert not type(model).__module__.startswith("hybrid_indexpool"), type(model).__module__
inputs = torch.load(sys.argv[2])
with torch.no_grad():
    torch.save(model(**inputs).logits, sys.argv[2] + ".out")
'''


def test_the_multimodal_checkpoint_loads_as_remote_code_without_the_package(converted, tmp_path):
    _, folder = converted
    input_ids, mask, vision, _ = batch("image", seed=2)
    inputs = {"input_ids": input_ids, "attention_mask": mask, **vision}
    torch.save(inputs, tmp_path / "inputs.pt")
    env = {"HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", LOAD_AS_REMOTE_CODE, str(folder / "ours"),
                             str(tmp_path / "inputs.pt")],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    ours = HybridIndexPoolForConditionalGeneration.from_pretrained(folder / "ours").eval()
    with torch.no_grad():
        expected = ours(**inputs).logits
    torch.testing.assert_close(torch.load(tmp_path / "inputs.pt.out"), expected, rtol=0, atol=0)


def test_the_processor_files_are_copied(converted, tmp_path):
    import json

    source, _ = converted
    folder = tmp_path / "source"
    save_source(source, folder, max_shard_size="60KB")
    processor = {"processor_class": "Qwen3VLProcessor", "image_processor_type": "Qwen2VLImageProcessor",
                 "patch_size": 16, "merge_size": 2, "temporal_patch_size": 2}
    (folder / "preprocessor_config.json").write_text(json.dumps(processor))
    (folder / "chat_template.jinja").write_text("{% for message in messages %}{{ message['content'] }}{% endfor %}")
    convert_qwen4_exp(folder, tmp_path / "ours", **QUIET)
    for name in ("preprocessor_config.json", "chat_template.jinja"):
        assert (tmp_path / "ours" / name).read_text() == (folder / name).read_text()
