"""Speculative decoding through vLLM's `speculative_config` (marker `vllm`): n-gram drafting and the checkpoint's own
MTP layer give greedy decoding's tokens, at batch 4 and batch 1, exactly in float32 (the project's Gated DeltaNet
core; `test_linear_attention_drafts.py` checks the drafting step on vLLM's bfloat16 CPU kernels bit for bit, and
`tests/scripts/test_bench_serving_reuse.py` serves with them), with drafts proposed and rejected (the tiny random
model keeps few of them), so that the tokens after every rejected draft are the model's own. One engine per method.
"""

from pathlib import Path

import pytest
from vllm_reference import assert_same_tokens, generate, random_prompts, tiny_checkpoint

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")

NEW_TOKENS = 32
CHUNK_TOKENS = 64  # prefills in chunks that end inside windows (64 + the drafts' tokens: never a multiple of r)
# Log-probabilities of one token computed in verify steps and in one-token steps differ by float32 rounding (matrix
# products block their sums by the batch's row count).
FLOAT32_ROUNDING = 1e-4


def copying_prompt(seed: int, unit_length: int, copies: int) -> list[int]:
    """A passage repeated: n-gram drafting proposes its continuation (the random model seldom follows it)."""
    unit = random_prompts([unit_length], seed=seed)[0]
    return unit * copies


# Batch 4: two copying prompts beyond the budget (16 tokens), a short random one, a long random one.
BATCH = [copying_prompt(10, 12, 12), copying_prompt(11, 7, 30), *random_prompts([9, 170], seed=12)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("vllm") / "tiny-indexpool-mtp", mtp=True)


def float32_engine(checkpoint, speculative_config=None):
    """The bfloat16 checkpoint served in float32 (the project's Gated DeltaNet core), prefix caching off (vLLM's CPU
    build cannot combine it with drafting: the plugin turns it off there, and the engine without drafts must match)."""
    return vllm.LLM(str(checkpoint), dtype="float32", max_model_len=1024, max_num_seqs=4, enforce_eager=True,
                    max_num_batched_tokens=CHUNK_TOKENS, enable_prefix_caching=False, disable_log_stats=False,
                    seed=0, speculative_config=speculative_config)


@pytest.fixture(scope="module")
def greedy(checkpoint):
    """Greedy decoding without drafts: the batch, and its first request alone."""
    llm = float32_engine(checkpoint)
    try:
        return {"batch": generate(llm, BATCH, NEW_TOKENS), "alone": generate(llm, BATCH[:1], NEW_TOKENS)}
    finally:
        del llm


def drafting_counters(llm) -> dict:
    metrics = {metric.name: metric for metric in llm.get_metrics()}
    return {name: metrics[f"vllm:spec_decode_{name}"].value
            for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}


def check_drafting(llm, greedy) -> dict:
    """The batch then its first request alone, each against greedy decoding; the drafting counters of both."""
    assert_same_tokens(generate(llm, BATCH, NEW_TOKENS), greedy["batch"], FLOAT32_ROUNDING)
    batch = drafting_counters(llm)
    assert_same_tokens(generate(llm, BATCH[:1], NEW_TOKENS), greedy["alone"], FLOAT32_ROUNDING)
    alone = {name: count - batch[name] for name, count in drafting_counters(llm).items()}
    for counters in (batch, alone):
        assert counters["num_drafts"] > 0  # drafts were proposed and verified ...
        assert counters["num_accepted_tokens"] < counters["num_draft_tokens"]  # ... and some were rejected
    return {"batch": batch, "alone": alone}


def test_ngram_drafting_gives_greedy_tokens(checkpoint, greedy):
    """Prompt lookup of 1 to 4 tokens, up to 4 drafts (as many as it finds, none included: the verify steps have
    every width)."""
    llm = float32_engine(checkpoint, {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                                      "prompt_lookup_max": 4})
    try:
        check_drafting(llm, greedy)
    finally:
        del llm


def test_mtp_drafting_gives_greedy_tokens(checkpoint, greedy):
    """The checkpoint's MTP layer drafts 2 tokens per step (vLLM reuses it for the second)."""
    llm = float32_engine(checkpoint, {"method": "mtp", "num_speculative_tokens": 2})
    try:
        counters = check_drafting(llm, greedy)
    finally:
        del llm
    # Every step drafts: two tokens per verify step.
    assert counters["batch"]["num_draft_tokens"] == 2 * counters["batch"]["num_drafts"]


def test_drafting_turns_prefix_caching_off_on_cpu_and_mtp_needs_mtp_layers(tmp_path):
    """vLLM's CPU build cannot combine drafting with prefix caching (on by default): the plugin turns it off. A
    checkpoint without MTP layers is refused when the engine starts, with what to do. Neither needs an engine to run:
    both are decided on the engine's settings."""
    from vllm.engine.arg_utils import EngineArgs

    plain = tiny_checkpoint(tmp_path / "tiny-indexpool")
    ngram = EngineArgs(str(plain), dtype="bfloat16", max_model_len=256, enforce_eager=True,
                       speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2})
    assert not ngram.create_engine_config().cache_config.enable_prefix_caching
    with pytest.raises(ValueError, match="num_mtp_layers = 0"):
        EngineArgs(str(plain), dtype="bfloat16", max_model_len=256, enforce_eager=True,
                   speculative_config={"method": "mtp", "num_speculative_tokens": 1}).create_engine_config()


def test_ngram_drafting_on_cpu_keeps_numbas_pool_to_one_thread(tmp_path, monkeypatch):
    """vLLM's n-gram proposer uses one numba thread; a pool of one per core spins between steps on the model's cores.
    An n-gram engine on CPU sets NUMBA_NUM_THREADS=1 where the user has not set it, and keeps the user's value."""
    import os

    from vllm.engine.arg_utils import EngineArgs

    plain = tiny_checkpoint(tmp_path / "tiny-indexpool")

    def engine_config():
        return EngineArgs(str(plain), dtype="bfloat16", max_model_len=256, enforce_eager=True,
                          speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                              "prompt_lookup_max": 2}).create_engine_config()

    monkeypatch.delenv("NUMBA_NUM_THREADS", raising=False)
    engine_config()
    assert os.environ["NUMBA_NUM_THREADS"] == "1"
    monkeypatch.setenv("NUMBA_NUM_THREADS", "2")
    engine_config()
    assert os.environ["NUMBA_NUM_THREADS"] == "2"
