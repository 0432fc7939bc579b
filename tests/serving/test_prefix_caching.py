"""Prefix caching, on by default (marker `vllm`): a repeated prompt and prompts sharing a prefix with different
suffixes resume from the cached blocks (vLLM's prefix-cache hit counter counts them) and give the tokens of an engine
with prefix caching off, exactly in float32 (the project's Gated DeltaNet core: the same tokens, log-probabilities
to float32 rounding). `tests/scripts/test_bench_serving_reuse.py` serves prefixes on vLLM's bfloat16 kernels.

A hit ends at a block boundary: a multiple of r, where the open window is empty, with the pooled windows in the
shared pages and the Gated DeltaNet states that vLLM's "align" mode keeps at block boundaries."""

import pytest
from vllm_reference import assert_same_tokens, generate, random_prompts, tiny_checkpoint

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")

NEW_TOKENS = 16
CHUNK_TOKENS = 100  # prefills in chunks; vLLM's align mode also ends chunks at block boundaries
# Log-probabilities of one token from prefills split at other tokens differ by float32 rounding.
FLOAT32_ROUNDING = 1e-4
# A prefix of 600 tokens: full blocks (vLLM's blocks for the tiny model hold 128 or 256 tokens) to share, far beyond
# the budget.
PREFIX = random_prompts([600], seed=20)[0]
SUFFIXES = random_prompts([37, 5, 130], seed=21)
# Served in this order: a prompt, the same prompt again, then two others sharing its prefix.
ROUNDS = [[PREFIX + SUFFIXES[0]], [PREFIX + SUFFIXES[0]], [PREFIX + SUFFIXES[1], PREFIX + SUFFIXES[2]]]


def serve_rounds(checkpoint, **options) -> tuple[list[list[dict]], float]:
    """Each round's greedy runs and vLLM's prefix-cache hits (tokens) over all rounds, from an engine started with
    `options`; prefix caching (on, unless `options` turn it off) in vLLM's hybrid "align" mode."""
    llm = vllm.LLM(str(checkpoint), dtype="float32", max_model_len=1024, max_num_seqs=4, enforce_eager=True,
                   max_num_batched_tokens=CHUNK_TOKENS, disable_log_stats=False, seed=0, **options)
    try:
        cache = llm.llm_engine.vllm_config.cache_config
        caching = options.get("enable_prefix_caching", True)
        assert cache.enable_prefix_caching == caching and (cache.mamba_cache_mode == "align") == caching
        runs = [generate(llm, prompts, NEW_TOKENS) for prompts in ROUNDS]
        metrics = {metric.name: metric for metric in llm.get_metrics()}
        hits = metrics["vllm:prefix_cache_hits"].value if "vllm:prefix_cache_hits" in metrics else 0
    finally:
        del llm
    return runs, hits


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("vllm") / "tiny-indexpool")


def test_cached_prefixes_give_the_tokens_of_an_engine_without_prefix_caching(checkpoint):
    """Prefix caching on by default; the same rounds with it turned off are the reference."""
    uncached, no_hits = serve_rounds(checkpoint, enable_prefix_caching=False)
    cached, hits = serve_rounds(checkpoint)
    assert no_hits == 0
    # The second round hits the first's full blocks; the third round's two prompts hit them too.
    assert hits >= 3 * 512
    for runs, references in zip(cached, uncached, strict=True):
        assert_same_tokens(runs, references, FLOAT32_ROUNDING)
