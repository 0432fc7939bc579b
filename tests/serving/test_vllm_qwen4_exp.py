"""Qwen3.8-Flash-Next (Qwen4-Exp) conversions served by the plugin (marker `vllm`): hyper-connections, per-layer
n-gram embeddings, MoE with the shared expert and the QSA indexer become IndexPool with learned pooling, trained off
the mean; a tiny source at widths vLLM's CPU Gated DeltaNet takes (heads of 64), converted with
`convert_qwen4_exp`, served in one batch far beyond its budget (8 tokens, r = 4) with chunked prefill, against our
transformers model teacher-forced along vLLM's tokens. In float32 (the project's Gated DeltaNet core) every step
matches; in bfloat16 with tensor parallelism 2 (vLLM's Gated DeltaNet kernels) the check is the statistical one."""

from pathlib import Path

import pytest
from vllm_reference import (
    assert_close_to_reference,
    assert_matches_float32_reference,
    assert_same_tokens,
    cache_tensor_count,
    fill_caches,
    generate,
    qwen4_exp_checkpoint,
    random_prompts,
    score,
)

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")

PROMPT_LENGTHS = [5, 37, 70, 23, 130, 250]  # the budget is 8 tokens: all but the first are sparse
CHUNK_TOKENS = 38  # prefills split inside windows (38 % 4 != 0) and inside n-gram contexts


def engine(checkpoint: Path, dtype: str, **settings):
    return vllm.LLM(str(checkpoint), dtype=dtype, max_model_len=512, max_num_seqs=8, enforce_eager=True,
                    max_num_batched_tokens=CHUNK_TOKENS, seed=0, **settings)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return qwen4_exp_checkpoint(tmp_path_factory.mktemp("vllm") / "tiny-qwen4-exp-converted")


@pytest.fixture(scope="module")
def float32_engine(checkpoint):
    llm = engine(checkpoint, "float32")
    yield llm
    del llm


def test_converted_qwen4_exp_in_float32_is_our_float32_model(float32_engine, checkpoint, tmp_path):
    """Every step of a batch beyond the budget within float32 rounding of our model: the hyper-connections, the
    n-gram embeddings (their context and convolution carried across prefill chunks and into decode in vLLM's state
    cache) and the learned pooling are the transformers model's."""
    requests = generate(float32_engine, random_prompts(PROMPT_LENGTHS, seed=10), max_tokens=12)
    assert_matches_float32_reference(requests, score(checkpoint, requests, tmp_path))


def test_converted_qwen4_exp_states_do_not_leak_between_batches(float32_engine, checkpoint):
    """Every cache and state tensor (the n-gram contexts and convolution states included) filled with NaN between
    two runs of the same batch: the same tokens and log-probabilities."""
    prompts = random_prompts([70, 9, 130], seed=11)
    first = generate(float32_engine, prompts, max_tokens=8)
    assert fill_caches(float32_engine, "nan") == cache_tensor_count(checkpoint)
    assert_same_tokens(generate(float32_engine, prompts, max_tokens=8), first)


def test_converted_qwen4_exp_with_tensor_parallel_2_matches_transformers(checkpoint, tmp_path, monkeypatch):
    """bfloat16 on two ranks (vLLM's Gated DeltaNet kernels, heads split; the streams, their hyper-connections, the
    n-gram embeddings and the indexer whole on each rank): as close to our model as our bfloat16 model is."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # vLLM's CPU workers bind one core list per rank
    llm = engine(checkpoint, "bfloat16", tensor_parallel_size=2)
    try:
        requests = generate(llm, random_prompts(PROMPT_LENGTHS, seed=12), max_tokens=12)
    finally:
        del llm
    assert_close_to_reference(requests, score(checkpoint, requests, tmp_path))


def test_prompt_embeddings_are_refused_at_start_for_ngram_embeddings(checkpoint):
    """The n-gram embeddings hash token ids: an engine that would take prompt embeddings instead is refused."""
    with pytest.raises(ValueError, match=r"enable_prompt_embeds with per-layer n-gram embeddings \(ple_layers"):
        engine(checkpoint, "bfloat16", enable_prompt_embeds=True)


def test_multimodal_conversion_is_served_for_text(tmp_path_factory, tmp_path):
    """A conversion of the multimodal model (`HybridIndexPoolForConditionalGeneration`: the vision tower kept, the
    text model's RoPE multimodal with `mrope_section`): vLLM serves its language model for text, the three position
    streams equal, and every step is our float32 multimodal model's on the same text."""
    checkpoint = qwen4_exp_checkpoint(tmp_path_factory.mktemp("vllm") / "tiny-qwen4-exp-multimodal", multimodal=True)
    llm = engine(checkpoint, "float32")
    try:
        requests = generate(llm, random_prompts(PROMPT_LENGTHS, seed=13), max_tokens=12)
    finally:
        del llm
    assert_matches_float32_reference(requests, score(checkpoint, requests, tmp_path))
