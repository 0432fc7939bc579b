"""Exactness of the vLLM model in float32 (marker `vllm`): with the project's Gated DeltaNet core (vLLM's CPU kernels
take bfloat16 only) the plugin's tokens do not depend on compilation, batching, preemption or what the caches held
before, and they are our transformers model's float32 tokens. bfloat16 comparisons (vLLM's top-5 rule) are in
`test_vllm_model.py`. One eager engine serves the module; the compiled one is built by its test."""

from pathlib import Path

import pytest
from vllm_reference import (
    assert_matches_float32_reference,
    assert_same_tokens,
    cache_tensor_count,
    fill_caches,
    generate,
    num_preemptions,
    random_prompts,
    score,
    tiny_checkpoint,
)

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")

# Prompts around and far beyond the budget (16 tokens, r = 4), none a multiple of the chunk size or of r; four end
# just before a block boundary (128 tokens in float32), so that they all need new blocks as they decode.
PROMPT_LENGTHS = [120, 5, 37, 122, 250, 70, 121, 23]
CHUNK_TOKENS = 38  # max_num_batched_tokens: prefills are split, and the splits fall inside windows (38 % 4 != 0)
NUM_BLOCKS = 10  # KV blocks, shared by the model's cache groups: too few for the batch, so the scheduler preempts
# Log-probabilities of one token computed in batches of different shapes differ by float32 rounding (matrix products
# block their sums by the batch's row count; prefills split at other tokens): measured at most ~2e-6 here.
FLOAT32_ROUNDING = 1e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("vllm") / "tiny-indexpool")


def float32_engine(checkpoint: Path, **settings):
    """An engine serving the bfloat16 checkpoint in float32 (weights widened exactly): the project's Gated DeltaNet
    core (`additional_config["hybrid_indexpool_gdn_kernel"] = "auto"` picks it for float32 on CPU)."""
    return vllm.LLM(str(checkpoint), dtype="float32", max_model_len=384, max_num_seqs=8,
                    max_num_batched_tokens=CHUNK_TOKENS, seed=0, **settings)


@pytest.fixture(scope="module")
def engine(checkpoint):
    llm = float32_engine(checkpoint, enforce_eager=True, num_gpu_blocks_override=NUM_BLOCKS, disable_log_stats=False)
    yield llm
    del llm


def test_float32_batch_beyond_budget_is_our_float32_model(engine, checkpoint, tmp_path):
    """Eight requests in one batch, most far beyond the budget, prefills chunked inside windows and at least one
    request preempted and recomputed: at every step the token our float32 transformers model gives the same
    log-probability, to float32 rounding (no selection flips: ties within float32 noise are rare)."""
    preempted_before = num_preemptions(engine)
    requests = generate(engine, random_prompts(PROMPT_LENGTHS, seed=0), max_tokens=16)
    assert num_preemptions(engine) > preempted_before
    assert_matches_float32_reference(requests, score(checkpoint, requests, tmp_path))


def test_float32_tokens_do_not_depend_on_batching_or_preemption(engine):
    """The batch above (preempting) against each request served alone: the same tokens, log-probabilities to
    float32 rounding."""
    prompts = random_prompts(PROMPT_LENGTHS, seed=0)
    preempted_before = num_preemptions(engine)
    batched = generate(engine, prompts, max_tokens=16)
    assert num_preemptions(engine) > preempted_before
    alone = [generate(engine, [prompt], max_tokens=16)[0] for prompt in prompts]
    assert_same_tokens(batched, alone, FLOAT32_ROUNDING)


def test_cache_contents_left_from_other_batches_never_reach_a_token(engine, checkpoint):
    """Every cache and state tensor (keys/values, pooled keys, open-window rings, Gated DeltaNet convolution and
    recurrent states) filled with NaN, then with random values, between two runs of the same batch: every token and
    log-probability bit for bit the same (the same batch is scheduled the same way)."""
    prompts = random_prompts([130, 23, 301, 9], seed=7)
    engine.reset_prefix_cache()  # the first run computes every block, as the later ones do
    first = generate(engine, prompts, max_tokens=12)
    for fill in ("nan", "random"):
        assert fill_caches(engine, fill) == cache_tensor_count(checkpoint)
        # Cached prefix blocks are the one thing a later request is meant to read, and the fill overwrote them too.
        engine.reset_prefix_cache()
        assert_same_tokens(generate(engine, prompts, max_tokens=12), first)


def test_compiled_float32_gives_the_eager_tokens(engine, checkpoint):
    """With vLLM's compilation on (on CPU Dynamo traces the model once and Inductor compiles it, the IndexPool step and
    the Gated DeltaNet core staying custom ops): the eager engine's tokens, log-probabilities to float32 rounding,
    for a batch beyond the budget with chunked prefill."""
    prompts = random_prompts([130, 23, 301], seed=2)
    llm = float32_engine(checkpoint, enforce_eager=False)
    try:
        compiled = generate(llm, prompts, max_tokens=12)
    finally:
        del llm
    assert_same_tokens(compiled, generate(engine, prompts, max_tokens=12), FLOAT32_ROUNDING)
