"""The vLLM model of the plugin against our transformers model, on vLLM's CPU build (marker `vllm`, run in the vLLM
environment: see the README's vLLM section). One engine serves every test of the module."""

import json
from pathlib import Path

import pytest
from vllm_reference import (
    assert_close_to_reference,
    assert_tokens_part_within_top_k,
    cache_tensor_count,
    fill_caches,
    generate,
    huge_page_reports,
    num_preemptions,
    random_prompts,
    score,
    tiny_checkpoint,
)

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")

BUDGET = 16  # the tiny checkpoint's index_topk; r = 4
# Prompts around and far beyond the budget; none a multiple of the chunk size or of r.
PROMPT_LENGTHS = [5, 18, 37, 70, 23, 130, 250, 301]
CHUNK_TOKENS = 38  # max_num_batched_tokens: prefills are split, and the splits fall inside windows (38 % 4 != 0)
NUM_BLOCKS = 8  # KV blocks of 256 tokens: too few for the whole batch at once, so the scheduler preempts


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("vllm") / "tiny-indexpool")


@pytest.fixture(scope="module")
def engine(checkpoint):
    llm = vllm.LLM(str(checkpoint), dtype="bfloat16", max_model_len=1024, max_num_seqs=8, enforce_eager=True,
                   max_num_batched_tokens=CHUNK_TOKENS, num_gpu_blocks_override=NUM_BLOCKS, disable_log_stats=False,
                   seed=0)
    yield llm
    del llm


def test_batch_beyond_budget_matches_transformers(engine, checkpoint, tmp_path):
    """Eight requests of different lengths in one batch, most far beyond the budget, prefills chunked inside windows
    and at least one request preempted and recomputed (too few KV blocks for all): tokens as our model scores them."""
    requests = generate(engine, random_prompts(PROMPT_LENGTHS, seed=0), max_tokens=24)
    assert [len(request["output"]) for request in requests] == [24] * len(PROMPT_LENGTHS)
    assert num_preemptions(engine) >= 1
    assert_close_to_reference(requests, score(checkpoint, requests, tmp_path))


def test_within_budget_is_dense_and_exact(engine, checkpoint, tmp_path):
    """Up to `index_topk + r - 1` tokens every window is selected: vLLM and our model agree at every step."""
    requests = generate(engine, random_prompts([3, 6, 9, 11], seed=1), max_tokens=BUDGET + 3 - 11)
    assert_close_to_reference(requests, score(checkpoint, requests, tmp_path), within_budget=True)


def test_requests_alone_or_batched_part_only_within_the_top_5(engine):
    """Continuous batching in bfloat16: a request batched with others (and preempted) against the same request alone
    gives the same tokens, or parts from it only where vLLM's own models may (its rule: each run's token among the
    other's top 5). Exactness, in float32, is `test_vllm_exactness.py`'s."""
    prompts = random_prompts([130, 23, 301], seed=2)
    batched = generate(engine, prompts, max_tokens=12, top_logprobs=5)
    alone = [generate(engine, [prompt], max_tokens=12, top_logprobs=5)[0] for prompt in prompts]
    assert_tokens_part_within_top_k(batched, alone, k=5)


def test_cache_contents_left_from_other_batches_never_reach_a_token(engine, checkpoint):
    """vLLM's own Gated DeltaNet kernels (bfloat16) with the IndexPool caches: every cache and state tensor filled
    with NaN, then random values, between two runs of the same batch; every token and log-probability the same."""
    prompts = random_prompts([130, 23, 301, 9], seed=7)
    first = generate(engine, prompts, max_tokens=12)
    for fill in ("nan", "random"):
        assert fill_caches(engine, fill) == cache_tensor_count(checkpoint)
        again = generate(engine, prompts, max_tokens=12)
        assert [request["output"] for request in again] == [request["output"] for request in first]
        assert [request["logprobs"] for request in again] == [request["logprobs"] for request in first]


def test_the_caches_are_advised_into_huge_pages(engine, checkpoint):
    """vLLM's CPU worker bound every IndexPool main and pooled-key cache through the owners' `bind_kv_cache`, which
    advised the buffer under them (one for all layers) into transparent huge pages: granted where the system has THP
    and the buffer holds a whole huge page, or declined with its reason."""
    config = json.loads((checkpoint / "config.json").read_text())
    layers = config.get("text_config", config)["layer_types"].count("indexpool_attention")
    for report in huge_page_reports(engine):
        assert len(report["advice"]) == 2 * layers and None not in report["advice"]
        # One buffer under every cache: the same advice each time (this engine's, of 2.2 MB, holds no whole huge
        # page; `test_indexpool_step.py` binds a larger one).
        assert len(set(report["advice"])) == 1
        for (advised, collapsed, reason), held in zip(report["advice"], report["huge_page_bytes"]):
            assert collapsed or reason
            assert advised or "no whole huge page" in reason
            if report["mode"] in ("always", "madvise") and advised:  # this machine: madvise, Linux 6.18
                assert collapsed, reason
                assert held >= advised


def test_tensor_parallel_2_matches_transformers(checkpoint, tmp_path, monkeypatch):
    """Two ranks (one core each): attention and Gated DeltaNet split by heads, the indexer and its caches replicated,
    so both ranks select the same windows; as close to our model as one rank is."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # vLLM's CPU workers bind one core list per rank
    llm = vllm.LLM(str(checkpoint), dtype="bfloat16", max_model_len=1024, enforce_eager=True, tensor_parallel_size=2,
                   seed=0)
    try:
        requests = generate(llm, random_prompts([5, 70, 130, 301], seed=4), max_tokens=16)
    finally:
        del llm
    assert_close_to_reference(requests, score(checkpoint, requests, tmp_path))


def test_mixture_of_experts_matches_transformers(tmp_path_factory, tmp_path):
    """Routed experts (vLLM's fused MoE, loaded from our fused `gate_up_proj`/`down_proj`) and the shared expert (the
    checkpoint's MTP layer skipped), in a batch within the budget (beyond it the attention is the one the other tests
    check). Experts amplify bfloat16 noise (our own bfloat16 model moves up to ~0.2 nat from float32 here), so the
    check is the statistical one."""
    checkpoint = tiny_checkpoint(tmp_path_factory.mktemp("vllm") / "tiny-indexpool-moe", experts=True)
    llm = vllm.LLM(str(checkpoint), dtype="bfloat16", max_model_len=1024, max_num_seqs=8, enforce_eager=True, seed=0)
    try:
        requests = generate(llm, random_prompts([3, 6, 9, 11, 4, 7, 10, 8], seed=5), max_tokens=BUDGET + 3 - 11)
    finally:
        del llm
    assert_close_to_reference(requests, score(checkpoint, requests, tmp_path))


def test_fp8_pooled_keys_match_transformers(tmp_path_factory, tmp_path):
    """`index_key_cache_dtype = "float8_e4m3fn"`: vLLM's pooled-key cache holds packed fp8 keys (rotated, fp8 bytes
    and a power-of-two float32 scale), written when windows complete and scored from the pages; as close to our
    transformers model with the same fp8 cache as the bfloat16 checks require, for a batch beyond the budget with
    prefills chunked inside windows."""
    checkpoint = tiny_checkpoint(tmp_path_factory.mktemp("vllm") / "tiny-indexpool-fp8", fp8_index_keys=True)
    llm = vllm.LLM(str(checkpoint), dtype="bfloat16", max_model_len=1024, max_num_seqs=8, enforce_eager=True,
                   max_num_batched_tokens=CHUNK_TOKENS, seed=0)
    try:
        requests = generate(llm, random_prompts([70, 23, 130, 250], seed=6), max_tokens=16)
    finally:
        del llm
    assert_close_to_reference(requests, score(checkpoint, requests, tmp_path))


def test_gated_deltanet_heads_vllm_cpu_kernels_do_not_take_are_served_by_the_projects_core(tmp_path_factory, tmp_path):
    """Gated DeltaNet heads of 32 in bfloat16 (vLLM's CPU kernels take 64 and 128 only, and would fail at the first
    request): the engine picks the project's core, and a batch beyond the budget matches our model."""
    checkpoint = tiny_checkpoint(tmp_path_factory.mktemp("vllm") / "tiny-indexpool-narrow", narrow=True)
    llm = vllm.LLM(str(checkpoint), dtype="bfloat16", max_model_len=1024, max_num_seqs=8, enforce_eager=True,
                   max_num_batched_tokens=CHUNK_TOKENS, seed=0)
    try:
        requests = generate(llm, random_prompts([70, 23, 130, 250], seed=8), max_tokens=16)
    finally:
        del llm
    assert_close_to_reference(requests, score(checkpoint, requests, tmp_path))


def test_compiled_model_parts_from_the_eager_tokens_only_within_the_top_5(engine, checkpoint):
    """With vLLM's compilation on (`@support_torch_compile`; on CPU vLLM traces the model once with Dynamo and
    compiles it with Inductor, the IndexPool step and the Gated DeltaNet core staying custom ops), in bfloat16: the
    eager engine's tokens up to where the runs part, there each within the other's top 5 (Inductor fuses and rounds
    bfloat16 differently; vLLM's own Qwen3-Next parts the same way). Exact in float32: `test_vllm_exactness.py`."""
    llm = vllm.LLM(str(checkpoint), dtype="bfloat16", max_model_len=1024, max_num_seqs=8, enforce_eager=False,
                   max_num_batched_tokens=CHUNK_TOKENS, seed=0)
    prompts = random_prompts([130, 23, 301], seed=2)
    try:
        compiled = generate(llm, prompts, max_tokens=12, top_logprobs=5)
    finally:
        del llm
    assert_tokens_part_within_top_k(compiled, generate(engine, prompts, max_tokens=12, top_logprobs=5), k=5)
