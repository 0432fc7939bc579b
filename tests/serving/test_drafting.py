"""Speculative decoding through vLLM's `speculative_config` (marker `vllm`): n-gram drafting and the checkpoint's own
MTP layer give greedy decoding's tokens (vLLM's top-5 rule, log-probabilities before any parting within bfloat16
noise), at batch 4 and batch 1, with drafts proposed and rejected (the tiny random model keeps few of them), so that
the tokens after every rejected draft are the model's own. One engine per method, each shared by the module's tests.
"""

from pathlib import Path

import pytest
from greedy_agreement import assert_greedy_agreement, greedy_runs
from vllm_reference import random_prompts, tiny_checkpoint

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")

NEW_TOKENS = 32
CHUNK_TOKENS = 64  # prefills in chunks that end inside windows (64 + the drafts' tokens: never a multiple of r)


def copying_prompt(seed: int, unit_length: int, copies: int) -> list[int]:
    """A passage repeated: n-gram drafting proposes its continuation (the random model seldom follows it)."""
    unit = random_prompts([unit_length], seed=seed)[0]
    return unit * copies


# Batch 4: two copying prompts beyond the budget (16 tokens), a short random one, a long random one.
BATCH = [copying_prompt(10, 12, 12), copying_prompt(11, 7, 30), *random_prompts([9, 170], seed=12)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("vllm") / "tiny-indexpool-mtp", mtp=True)


def engine(checkpoint, speculative_config=None):
    return vllm.LLM(str(checkpoint), dtype="bfloat16", max_model_len=1024, max_num_seqs=4, enforce_eager=True,
                    max_num_batched_tokens=CHUNK_TOKENS, disable_log_stats=False, seed=0,
                    speculative_config=speculative_config)


@pytest.fixture(scope="module")
def greedy(checkpoint):
    """Greedy decoding without drafts: the batch, and its first request alone."""
    llm = engine(checkpoint)
    try:
        return {"batch": greedy_runs(llm, BATCH, NEW_TOKENS), "alone": greedy_runs(llm, BATCH[:1], NEW_TOKENS)}
    finally:
        del llm


def drafting_counters(llm) -> dict:
    metrics = {metric.name: metric for metric in llm.get_metrics()}
    return {name: metrics[f"vllm:spec_decode_{name}"].value
            for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}


def check_drafting(llm, greedy) -> dict:
    """The batch then its first request alone, each against greedy decoding; the drafting counters of both."""
    assert_greedy_agreement(greedy_runs(llm, BATCH, NEW_TOKENS), greedy["batch"])
    batch = drafting_counters(llm)
    assert_greedy_agreement(greedy_runs(llm, BATCH[:1], NEW_TOKENS), greedy["alone"])
    alone = {name: count - batch[name] for name, count in drafting_counters(llm).items()}
    for counters in (batch, alone):
        assert counters["num_drafts"] > 0  # drafts were proposed and verified ...
        assert counters["num_accepted_tokens"] < counters["num_draft_tokens"]  # ... and some were rejected
    return {"batch": batch, "alone": alone}


def test_ngram_drafting_gives_greedy_tokens(checkpoint, greedy):
    """Prompt lookup of 1 to 4 tokens, up to 4 drafts (as many as it finds, none included: the verify steps have
    every width), on vLLM's CPU build: with prefix caching, which vLLM cannot combine with drafting there, turned off
    by the plugin at engine start."""
    llm = engine(checkpoint, {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                              "prompt_lookup_max": 4})
    try:
        assert not llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
        check_drafting(llm, greedy)
    finally:
        del llm


def test_mtp_drafting_gives_greedy_tokens(checkpoint, greedy):
    """The checkpoint's MTP layer drafts 2 tokens per step (vLLM reuses it for the second)."""
    llm = engine(checkpoint, {"method": "mtp", "num_speculative_tokens": 2})
    try:
        counters = check_drafting(llm, greedy)
    finally:
        del llm
    # Every step drafts: two tokens per verify step.
    assert counters["batch"]["num_draft_tokens"] == 2 * counters["batch"]["num_drafts"]


def test_mtp_drafting_needs_mtp_layers(tmp_path):
    """A checkpoint without MTP layers is refused when the engine starts, with what to do."""
    plain = tiny_checkpoint(tmp_path / "tiny-indexpool")
    with pytest.raises(ValueError, match="num_mtp_layers = 0"):
        vllm.LLM(str(plain), dtype="bfloat16", max_model_len=256, enforce_eager=True,
                 speculative_config={"method": "mtp", "num_speculative_tokens": 1})
