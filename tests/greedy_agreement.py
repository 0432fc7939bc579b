"""Two vLLM runs of the same greedy requests compared by vLLM's top-5 rule (the vLLM tests of prefix caching and
speculative decoding): the runs' tokens agree until the first step where they part; there each run's token is among
the other's top-5 log-probabilities. Before that step, where both runs computed the same context, the chosen tokens'
log-probabilities must agree too: a state left wrong (a cached prefix resumed from the wrong state, a rejected draft
left behind) moves them by far more than bfloat16 noise."""

# Nats by which two runs' log-probabilities of the same token in the same context may differ: bfloat16 noise of
# batches of other shapes and kernels (measured up to 0.03 between engines, 0.2 between vLLM's two CPU convolution
# kernels). vLLM's own rollback on CPU leaves tokens up to 2 nats below the model's best.
LOGPROB_TOLERANCE = 0.25


def greedy_runs(llm, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    """Greedy completions of `prompts` with each step's top-5 log-probabilities: `[{"tokens": [...], "top": [{token:
    logprob}, ...]}]`."""
    import vllm

    params = vllm.SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=5, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in prompts], params, use_tqdm=False)
    return [{"tokens": list(completion.token_ids),
             "top": [{token: entry.logprob for token, entry in step.items()} for step in completion.logprobs]}
            for output in outputs for completion in output.outputs]


def assert_greedy_agreement(runs: list[dict], references: list[dict]) -> dict:
    """Assert vLLM's top-5 rule between each run and its reference (and the log-probabilities before the runs part,
    within `LOGPROB_TOLERANCE`); returns how many tokens agreed before the runs parted (`agreed`, over all requests,
    of `tokens`) and the largest log-probability difference among them (`largest_difference`)."""
    agreed, largest = 0, 0.0
    for request, (run, reference) in enumerate(zip(runs, references, strict=True)):
        assert len(run["tokens"]) == len(reference["tokens"]), request
        for step, (token, expected) in enumerate(zip(run["tokens"], reference["tokens"])):
            if token != expected:
                top, expected_top = run["top"][step], reference["top"][step]
                assert expected in _top5(top) and token in _top5(expected_top), (
                    f"request {request} parts from its reference at step {step}: {token} (top-5 "
                    f"{_top5(top)}) against {expected} (top-5 {_top5(expected_top)})")
                break
            difference = abs(run["top"][step][token] - reference["top"][step][token])
            assert difference <= LOGPROB_TOLERANCE, (request, step, difference)
            agreed, largest = agreed + 1, max(largest, difference)
    return {"agreed": agreed, "tokens": sum(len(run["tokens"]) for run in runs), "largest_difference": largest}


def _top5(step: dict) -> list[int]:
    return sorted(step, key=step.get, reverse=True)[:5]
