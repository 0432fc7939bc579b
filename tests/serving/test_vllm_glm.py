"""GLM-5.3-Flash conversions served by the plugin (`serving/vllm_glm.py`: Kimi Delta Attention, MLA IndexPool over the
latent cache, a shared indexer, dense layers among grouped-MoE ones, the SwiGLU clamp, Sinkhorn streams) against our
transformers model, on vLLM's CPU build (marker `vllm`). The checkpoint is a tiny `glm5_next` source converted with
`convert_glm5_next --text_only`, its pooling moved off the converted values (`glm_reference.py`). One bfloat16 engine
serves the module; the float32 one is built by its test."""

import subprocess
from pathlib import Path

import pytest
from vllm_reference import (
    REFERENCE_PYTHON,
    REPO,
    assert_close_to_reference,
    assert_same_tokens,
    assert_tokens_part_within_top_k,
    fill_caches,
    generate,
    num_preemptions,
    random_prompts,
    score,
)

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")

BUDGET = 8  # the tiny source's index_topk; r = 4, so prompts beyond 11 tokens are sparse
PROMPT_LENGTHS = [5, 18, 37, 70, 23, 130, 250, 301]
CHUNK_TOKENS = 38  # max_num_batched_tokens: prefills are split, and the splits fall inside windows (38 % 4 != 0)
NUM_BLOCKS = 12  # KV blocks (1,117 tokens in bfloat16): too few for the whole batch at once, so the scheduler preempts
# Log-probabilities of one token computed in batches of different shapes, or by vLLM and by transformers, differ by
# float32 rounding (matrix products block their sums by the batch's rows; the delta rule runs chunked or token by token
# at other places; MLA attends absorbed in vLLM, expanded in transformers within the budget).
FLOAT32_ROUNDING = 1e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("vllm") / "tiny-glm5-next-indexpool"
    subprocess.run([REFERENCE_PYTHON, str(REPO / "tests" / "serving" / "glm_reference.py"), "checkpoint", str(path)],
                   check=True)
    return path


@pytest.fixture(scope="module")
def engine(checkpoint):
    llm = vllm.LLM(str(checkpoint), dtype="bfloat16", max_model_len=1024, max_num_seqs=8, enforce_eager=True,
                   max_num_batched_tokens=CHUNK_TOKENS, num_gpu_blocks_override=NUM_BLOCKS, disable_log_stats=False,
                   seed=0)
    yield llm
    del llm


def test_glm_conversion_beyond_budget_matches_transformers(engine, checkpoint, tmp_path):
    """Eight requests in one batch, most far beyond the budget, prefills chunked inside windows (KDA states and the
    open windows carried across chunks, the shared layer reading the selection of the full layer before it), at least
    one request preempted and recomputed: tokens as our model scores them."""
    preempted_before = num_preemptions(engine)
    requests = generate(engine, random_prompts(PROMPT_LENGTHS, seed=0), max_tokens=24)
    assert [len(request["output"]) for request in requests] == [24] * len(PROMPT_LENGTHS)
    assert num_preemptions(engine) > preempted_before
    assert_close_to_reference(requests, score(checkpoint, requests, tmp_path))


def test_glm_conversion_within_budget_is_dense_and_exact(engine, checkpoint, tmp_path):
    """Up to `index_topk + r - 1` tokens every window is selected: vLLM and our model agree at every step."""
    requests = generate(engine, random_prompts([2, 4, 5, 6], seed=1), max_tokens=BUDGET + 3 - 6)
    assert_close_to_reference(requests, score(checkpoint, requests, tmp_path), within_budget=True)


def test_glm_requests_alone_or_batched_part_only_where_bfloat16_rounds(engine):
    """A request alone and in a batch: the same tokens until a step where bfloat16 rounding of the batch's shapes
    parts them, and there each token among the other run's 5 most likely (vLLM's rule)."""
    prompts = random_prompts([130, 23, 301], seed=2)
    batched = generate(engine, prompts, max_tokens=12, top_logprobs=5)
    alone = [generate(engine, [prompt], max_tokens=12, top_logprobs=5)[0] for prompt in prompts]
    assert_tokens_part_within_top_k(batched, alone)


def test_glm_caches_filled_with_nan_between_batches_change_nothing(engine):
    """Every KV-cache and state tensor (latents, pooled keys, open-window rings, KDA convolution and recurrent states)
    filled with NaN between two runs of the same batch: the same tokens and log-probabilities, bit for bit. A new
    request reads nothing a slot or page held before."""
    prompts = random_prompts([130, 23, 301, 6], seed=3)
    before = generate(engine, prompts, max_tokens=12)
    # 2 KDA layers (two states each), 3 latent caches, the pooled keys and ring of the 2 layers with an indexer
    assert fill_caches(engine, "nan") >= 2 * 2 + 3 + 2 * 2
    assert_same_tokens(generate(engine, prompts, max_tokens=12), before)


def test_glm_conversion_in_float32_is_our_float32_model(checkpoint, tmp_path):
    """In float32 (the bfloat16 weights widened exactly), a batch beyond the budget with prefills chunked inside
    windows gives at every step the log-probability our float32 transformers model gives the same token, to float32
    rounding, and a request alone gives its tokens in the batch."""
    llm = vllm.LLM(str(checkpoint), dtype="float32", max_model_len=1024, max_num_seqs=8, enforce_eager=True,
                   max_num_batched_tokens=CHUNK_TOKENS, seed=0)
    try:
        prompts = random_prompts([5, 70, 23, 130, 301], seed=4)
        requests = generate(llm, prompts, max_tokens=16)
        alone = [generate(llm, [prompt], max_tokens=16)[0] for prompt in prompts[-2:]]
    finally:
        del llm
    assert_same_tokens(alone, requests[-2:], logprob_tolerance=FLOAT32_ROUNDING)
    for request, reference in zip(requests, score(checkpoint, requests, tmp_path), strict=True):
        worst = max(abs(a - b) for a, b in zip(request["logprobs"], reference["float32"], strict=True))
        assert worst <= FLOAT32_ROUNDING, (request["prompt"][:8], worst)
