"""GLM-5.3-Flash conversions served by the plugin (`serving/vllm_glm.py`: Kimi Delta Attention, MLA IndexPool over the
latent cache, a shared indexer, dense layers among grouped-MoE ones, the SwiGLU clamp, Sinkhorn streams) against our
transformers model, on vLLM's CPU build (marker `vllm`). The checkpoint is a tiny `glm5_next` source converted with
`convert_glm5_next --text_only`, its pooling moved off the converted values (`glm_reference.py`). One engine serves
every test of the module."""

import subprocess
from pathlib import Path

import pytest
from vllm_reference import REFERENCE_PYTHON, REPO, assert_close_to_reference, random_prompts, score

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")

BUDGET = 8  # the tiny source's index_topk; r = 4, so prompts beyond 11 tokens are sparse
PROMPT_LENGTHS = [5, 18, 37, 70, 23, 130, 250, 301]
CHUNK_TOKENS = 38  # max_num_batched_tokens: prefills are split, and the splits fall inside windows (38 % 4 != 0)
NUM_BLOCKS = 12  # KV blocks (1,117 tokens): too few for the whole batch at once, so the scheduler preempts


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


def generate(llm, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    params = vllm.SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in prompts], params, use_tqdm=False)
    return [{"prompt": prompt, "output": list(completion.token_ids),
             "logprobs": [step[token].logprob for token, step in zip(completion.token_ids, completion.logprobs)]}
            for prompt, output in zip(prompts, outputs) for completion in output.outputs]


def test_glm_conversion_beyond_budget_matches_transformers(engine, checkpoint, tmp_path):
    """Eight requests in one batch, most far beyond the budget, prefills chunked inside windows (KDA states and the
    open windows carried across chunks, the shared layer reading the selection of the full layer before it), at least
    one request preempted and recomputed: tokens as our model scores them."""
    requests = generate(engine, random_prompts(PROMPT_LENGTHS, seed=0), max_tokens=24)
    assert [len(request["output"]) for request in requests] == [24] * len(PROMPT_LENGTHS)
    preemptions = {metric.name: metric for metric in engine.get_metrics()}["vllm:num_preemptions"]
    assert preemptions.value >= 1
    assert_close_to_reference(requests, score(checkpoint, requests, tmp_path))


def test_glm_conversion_within_budget_is_dense_and_exact(engine, checkpoint, tmp_path):
    """Up to `index_topk + r - 1` tokens every window is selected: vLLM and our model agree at every step."""
    requests = generate(engine, random_prompts([2, 4, 5, 6], seed=1), max_tokens=BUDGET + 3 - 6)
    assert_close_to_reference(requests, score(checkpoint, requests, tmp_path), within_budget=True)


def test_glm_requests_alone_or_batched_give_the_same_tokens(engine):
    """A request's tokens do not depend on what it was batched with: the KDA states, latents, pooled keys and the
    shared selection of one request never reach another's."""
    prompts = random_prompts([130, 23, 301], seed=2)
    batched = generate(engine, prompts, max_tokens=12)
    alone = [generate(engine, [prompt], max_tokens=12)[0] for prompt in prompts]
    for together, single in zip(batched, alone):
        assert together["output"] == single["output"]
