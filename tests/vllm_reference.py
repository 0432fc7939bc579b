"""The transformers side of the vLLM tests (`tests/serving/`, `tests/scripts/test_bench_serving.py`): a tiny
checkpoint and teacher-forced log-probabilities from our model, computed by `serving/hf_reference.py` in the main
environment's Python (`HYBRID_INDEXPOOL_REFERENCE_PYTHON`, default `.venv/bin/python` of this checkout): the vLLM
environment pins an older transformers than the model needs."""

import functools
import json
import os
import random
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REFERENCE_SCRIPT = REPO / "tests" / "serving" / "hf_reference.py"
# Absolute (not resolved: a virtual environment's interpreter is a link), so that subprocesses may run elsewhere.
REFERENCE_PYTHON = os.path.abspath(os.environ.get("HYBRID_INDEXPOOL_REFERENCE_PYTHON",
                                                  REPO / ".venv" / "bin" / "python"))


def reference(*arguments: str) -> None:
    subprocess.run([REFERENCE_PYTHON, str(REFERENCE_SCRIPT), *arguments], check=True)


def tiny_checkpoint(path: Path, experts: bool = False, fp8_index_keys: bool = False, narrow: bool = False,
                    mtp: bool = False) -> Path:
    """The tiny bfloat16 checkpoint of `hf_reference.py` (budget 16 tokens, r = 4), saved at `path`; with
    `experts`, a mixture of experts; with `fp8_index_keys`, pooled index keys cached packed in fp8; with `narrow`,
    Gated DeltaNet heads of 32; with `mtp`, one MTP layer."""
    variant = ("experts" if experts else "fp8" if fp8_index_keys else "narrow" if narrow else "mtp" if mtp
               else None)
    reference("checkpoint", str(path), *([variant] if variant else []))
    return path


def qwen4_exp_checkpoint(path: Path, multimodal: bool = False) -> Path:
    """A tiny Qwen4-Exp source converted with `convert_qwen4_exp` (hyper-connections, PLE, MoE; Gated DeltaNet heads
    of 64, budget 8 tokens at r = 4), its pooling moved off the mean, in bfloat16 (`hf_reference.py qwen4_exp`); with
    `multimodal`, converted from the multimodal source with its vision tower and multimodal RoPE."""
    reference("qwen4_exp", str(path), *(["multimodal"] if multimodal else []))
    return path


def score(checkpoint: Path, requests: list[dict], tmp_path: Path) -> list[dict]:
    """Our transformers model's log-probabilities of each request's output tokens, teacher-forced, in bfloat16 and
    float32."""
    requests_path, output_path = tmp_path / "requests.json", tmp_path / "reference.json"
    requests_path.write_text(json.dumps(requests))
    reference("score", str(checkpoint), str(requests_path), str(output_path))
    return json.loads(output_path.read_text())


def random_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    """Random token ids of the byte-level tokenizer (special tokens left out)."""
    generator = random.Random(seed)
    return [[generator.randrange(3, 259) for _ in range(length)] for length in lengths]


def assert_close_to_reference(requests: list[dict], references: list[dict], within_budget: bool = False) -> None:
    """vLLM's log-probability of each token it chose against our model's, teacher-forced along the same tokens.

    Within the budget the attention is dense and vLLM agrees with our bfloat16 model to bfloat16 noise at every step.
    Beyond it a selection flips wherever two windows' scores tie within bfloat16 noise (tiny random models are full
    of near-ties), which moves a few steps by up to ~1 nat, in our own bfloat16 model as much as in vLLM. So vLLM must
    be about as close to our float32 model as our bfloat16 model is. Measured: correct code 82% of steps within 0.1
    and a median of 0.015 (our bfloat16: 88%, 0.011); with the pooling's slot bias dropped, 70% and 0.043.
    """
    def differences(ours: str, theirs: str | None = None) -> list[float]:
        return sorted(abs(a - b) for request, ref in zip(requests, references, strict=True)
                      for a, b in zip(request["logprobs"] if theirs is None else ref[theirs], ref[ours], strict=True))

    if within_budget:
        assert differences("bfloat16")[-1] < 0.08, differences("bfloat16")[-5:]
        return
    served, bfloat16 = differences("float32"), differences("float32", "bfloat16")
    def within(values):
        return sum(value < 0.1 for value in values) / len(values)
    def median(values):
        return values[len(values) // 2]
    assert within(served) >= within(bfloat16) - 0.1, (within(served), within(bfloat16), served[-10:])
    assert median(served) <= 2 * median(bfloat16) + 0.005, (median(served), median(bfloat16))
    assert served[-1] < 1.5, served[-5:]


def generate(llm, prompts: list[list[int]], max_tokens: int, top_logprobs: int = 0) -> list[dict]:
    """Greedy completions of token-id prompts on a `vllm.LLM`: per request its `prompt`, `output` tokens, their
    `logprobs` and, with `top_logprobs = k`, `top` (per step, the k most likely tokens' log-probabilities)."""
    import vllm

    params = vllm.SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=top_logprobs, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in prompts], params, use_tqdm=False)
    requests = []
    for prompt, output in zip(prompts, outputs, strict=True):
        completion = output.outputs[0]
        request = {"prompt": prompt, "output": list(completion.token_ids),
                   "logprobs": [step[token].logprob for token, step in zip(completion.token_ids, completion.logprobs)]}
        if top_logprobs:
            request["top"] = [{token: entry.logprob for token, entry in step.items() if entry.rank <= top_logprobs}
                              for step in completion.logprobs]
        requests.append(request)
    return requests


def num_preemptions(llm) -> int:
    """Requests the engine has preempted so far (an engine built with `disable_log_stats=False`)."""
    return int({metric.name: metric for metric in llm.get_metrics()}["vllm:num_preemptions"].value)


def assert_matches_float32_reference(requests: list[dict], references: list[dict], tolerance: float = 1e-3) -> None:
    """A float32 engine against our float32 transformers model teacher-forced along its tokens: every step's
    log-probability within `tolerance` (float32 rounding; a wrong layer moves them by far more)."""
    for request, reference_run in zip(requests, references, strict=True):
        worst = max(abs(a - b) for a, b in zip(request["logprobs"], reference_run["float32"], strict=True))
        assert worst < tolerance, (len(request["prompt"]), worst)


def assert_same_tokens(runs: list[dict], other_runs: list[dict], logprob_tolerance: float = 0.0) -> None:
    """Exactness (float32): the same tokens at every step of every request, their log-probabilities within
    `logprob_tolerance` (0: bit for bit)."""
    for run, other in zip(runs, other_runs, strict=True):
        assert run["output"] == other["output"], (run["prompt"][:8], run["output"], other["output"])
        worst = max(abs(a - b) for a, b in zip(run["logprobs"], other["logprobs"], strict=True))
        assert worst <= logprob_tolerance, (run["prompt"][:8], worst, run["logprobs"], other["logprobs"])


def assert_tokens_part_within_top_k(runs: list[dict], other_runs: list[dict], k: int = 5) -> int:
    """vLLM's rule for comparing two runs in bfloat16 (its tests' `check_logprobs_close`): per request the tokens
    agree up to the first step where the runs part, and there each run's token is among the other's `k` most likely
    (both generated with `top_logprobs >= k`); after it the runs continue from different text and are not compared.
    Returns how many requests parted."""
    parted = 0
    for run, other in zip(runs, other_runs, strict=True):
        for step, (token, other_token) in enumerate(zip(run["output"], other["output"], strict=True)):
            if token != other_token:
                top, other_top = sorted(run["top"][step], key=run["top"][step].get)[-k:], \
                    sorted(other["top"][step], key=other["top"][step].get)[-k:]
                assert token in other_top and other_token in top, (run["prompt"][:8], step, run["output"],
                                                                   other["output"])
                parted += 1
                break
    return parted


def fill_caches(llm, fill: str = "nan", seed: int = 0) -> int:
    """Overwrite every KV-cache and state tensor of the engine's model (main keys/values, pooled keys, open-window
    rings, Gated DeltaNet convolution and recurrent states) with NaN (`fill = "nan"`; random bytes where the dtype
    has no NaN) or random values (`"random"`), in every worker. What a correct engine computes next cannot depend on
    what was there. Returns the number of tensors filled (per worker, summed). Needs
    `VLLM_ALLOW_INSECURE_SERIALIZATION=1` (the function travels to the engine's processes)."""
    return sum(llm.apply_model(functools.partial(_fill_model_caches, fill=fill, seed=seed)))


def huge_page_reports(llm) -> list[dict]:
    """Per worker: the system's THP mode, each IndexPool main and pooled-key cache owner's `huge_pages` advice (as
    `(advised_bytes, collapsed, reason)`) and the AnonHugePages bytes of the mappings holding the caches, in the
    engine's process (`serving/huge_pages.py`)."""
    return llm.apply_model(_huge_page_report)


def _huge_page_report(model) -> dict:
    from hybrid_indexpool.serving.huge_pages import anon_huge_page_bytes, transparent_huge_page_mode
    from hybrid_indexpool.serving.indexpool_attention import IndexPoolKVCache, PooledKeyCache

    owners = [module for module in model.modules() if isinstance(module, (IndexPoolKVCache, PooledKeyCache))]
    return {"mode": transparent_huge_page_mode(),
            "advice": [None if owner.huge_pages is None else
                       (owner.huge_pages.advised_bytes, owner.huge_pages.collapsed, owner.huge_pages.reason)
                       for owner in owners],
            "huge_page_bytes": [anon_huge_page_bytes(owner.kv_cache) for owner in owners]}


def cache_tensor_count(checkpoint: Path) -> int:
    """The KV-cache and state tensors an engine serving `checkpoint` keeps per worker: two per Gated DeltaNet layer
    (convolution, recurrent), three per IndexPool layer (keys/values, pooled keys, open-window ring), two per PLE layer
    (n-gram context, convolution)."""
    config = json.loads((checkpoint / "config.json").read_text())
    config = config.get("text_config", config)
    return (2 * config["layer_types"].count("linear_attention") + 3 * config["layer_types"].count("indexpool_attention")
            + 2 * len(config.get("ple_layers") or []))


def _fill_model_caches(model, fill: str, seed: int) -> int:
    import torch

    generator = torch.Generator().manual_seed(seed)
    filled = 0

    def fill_tensor(tensor: torch.Tensor) -> None:
        nonlocal filled
        if tensor.numel() == 0:
            return
        if tensor.is_floating_point() and fill == "nan":
            tensor.fill_(float("nan"))
        elif tensor.is_floating_point():
            tensor.copy_(torch.randn(tensor.shape, generator=generator).mul_(4.0))
        else:  # packed fp8 keys: random bytes
            tensor.copy_(torch.randint(0, 256, tensor.shape, generator=generator).to(tensor.dtype))
        filled += 1

    for module in model.modules():
        caches = getattr(module, "kv_cache", None)
        for tensor in caches if isinstance(caches, (list, tuple)) else [caches]:
            if isinstance(tensor, torch.Tensor):
                fill_tensor(tensor)
    return filled
