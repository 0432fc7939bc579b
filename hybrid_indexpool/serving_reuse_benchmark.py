"""What vLLM's prefix caching and speculative decoding buy the plugin, measured through vLLM's OpenAI server
(`scripts/bench_serving.py --prefix-cache` and `--drafting`):

- the time to the first token of a request whose long prefix an earlier request left in the cache, against the
  earlier request's (and the same pair with prefix caching off);
- tokens per second of one request (batch 1) with and without drafting (n-gram prompt lookup, the checkpoint's MTP
  layers), with vLLM's drafting counters and a check that every method gave the same text.

Each measurement is its own server; the machine's 1-minute load average after it is recorded beside it.
"""

import json
import os
import re
import time
import urllib.request
from pathlib import Path

from .scripts.bench_serving import Server, free_port, post, streamed_token_times

# vLLM's Prometheus counters these measurements read (summed over their labels).
PREFIX_CACHE_COUNTERS = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits")
DRAFTING_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                     "vllm:spec_decode_num_accepted_tokens")


def counter_values(metrics_text: str, names) -> dict[str, float]:
    """`{name: value}` of Prometheus counters `names` in a `/metrics` reply, each summed over its label sets (0 for a
    counter the reply does not have). A counter's samples are named `NAME_total`."""
    values = dict.fromkeys(names, 0.0)
    for line in metrics_text.splitlines():
        match = re.match(r"^([a-zA-Z_:][\w:]*?)(?:_total)?(?:\{[^}]*\})? ([-+\deE.]+|NaN)$", line)
        if match and match.group(1) in values:
            values[match.group(1)] += float(match.group(2))
    return values


def server_counters(url: str, names) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=60) as reply:
        return counter_values(reply.read().decode(), names)


def vllm_feature_server(python: str, checkpoint: Path, log_path: Path, max_model_len: int, threads: int,
                        kv_cache_gib: int, options: list[str]) -> Server:
    """vLLM's OpenAI server (eager, bfloat16, one request at a time) on `checkpoint` with the plugin installed in
    `python`'s environment and the extra command-line `options`."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "OMP_NUM_THREADS": str(threads)}
    env.pop("TRITON_INTERPRET", None)
    port = free_port()
    command = [os.path.abspath(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint),
               "--port", str(port), "--dtype", "bfloat16", "--max-model-len", str(max_model_len), "--enforce-eager",
               "--max-num-seqs", "4", *options]
    return Server(command, port, log_path, env)


def first_token_seconds(url: str, model: str, prompt: str) -> float:
    """Seconds from sending a streamed greedy request for `prompt` to its first token."""
    start = time.perf_counter()
    times = streamed_token_times(f"{url}/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 2,
                                                           "temperature": 0, "ignore_eos": True})
    return times[0] - start


def prefix_cache_first_tokens(python: str, checkpoint: Path, prefix: str, suffixes: tuple[str, str], scratch: Path,
                              enable_prefix_caching: bool, threads: int = 2, kv_cache_gib: int = 1) -> dict:
    """The time to the first token of `prefix + suffixes[0]`, then of `prefix + suffixes[1]` (which finds the prefix
    in the cache when `enable_prefix_caching`), after a warm-up request of other text as long; vLLM's prefix-cache
    counters (tokens looked up and found) over the two."""
    option = "--enable-prefix-caching" if enable_prefix_caching else "--no-enable-prefix-caching"
    max_model_len = len(prefix) + max(map(len, suffixes)) + 64
    server = vllm_feature_server(python, checkpoint, scratch / f"vllm_prefix_{enable_prefix_caching}.log",
                                 max_model_len, threads, kv_cache_gib, [option])
    try:
        # Warm-up: a prompt as long, of other text (the prefix reversed: it shares no block with it).
        post(f"{server.url}/v1/completions", {"model": str(checkpoint), "prompt": (prefix + suffixes[0])[::-1],
                                              "max_tokens": 2, "temperature": 0})
        before = server_counters(server.url, PREFIX_CACHE_COUNTERS)
        first = first_token_seconds(server.url, str(checkpoint), prefix + suffixes[0])
        second = first_token_seconds(server.url, str(checkpoint), prefix + suffixes[1])
        after = server_counters(server.url, PREFIX_CACHE_COUNTERS)
    finally:
        server.close()
    return {"prefix_caching": enable_prefix_caching, "prefix_characters": len(prefix),
            "suffix_characters": [len(suffix) for suffix in suffixes],
            "first_request_first_token_seconds": first, "second_request_first_token_seconds": second,
            "first_over_second": first / second,
            "prefix_cache_queries": after["vllm:prefix_cache_queries"] - before["vllm:prefix_cache_queries"],
            "prefix_cache_hits": after["vllm:prefix_cache_hits"] - before["vllm:prefix_cache_hits"],
            "load_average_1min_after": os.getloadavg()[0]}


def drafting_throughput(python: str, checkpoint: Path, prompt: str | list[int], new_tokens: int,
                        speculative_config: dict | None, scratch: Path, name: str, threads: int = 2,
                        kv_cache_gib: int = 1, repeats: int = 2) -> dict:
    """Tokens per second of one greedy request for `prompt` (text or token ids; `new_tokens` tokens, batch 1) on a
    server drafting with `speculative_config` (None: plain decoding), the best of `repeats` after a warm-up request;
    vLLM's drafting counters per timed request and the generated text."""
    options = ["--no-enable-prefix-caching"]  # each repeat computes its prompt; vLLM's CPU build cannot draft with it
    if speculative_config is not None:
        options += ["--speculative-config", json.dumps(speculative_config)]
    server = vllm_feature_server(python, checkpoint, scratch / f"vllm_drafting_{name}.log",
                                 len(prompt) + new_tokens + 64, threads, kv_cache_gib, options)
    body = {"model": str(checkpoint), "prompt": prompt, "max_tokens": new_tokens, "temperature": 0,
            "ignore_eos": True}
    try:
        post(f"{server.url}/v1/completions", {**body, "max_tokens": 4})
        before = server_counters(server.url, DRAFTING_COUNTERS)
        seconds, text = [], None
        for _ in range(repeats):
            start = time.perf_counter()
            reply = post(f"{server.url}/v1/completions", body)
            seconds.append(time.perf_counter() - start)
            text, tokens = reply["choices"][0]["text"], reply["usage"]["completion_tokens"]
        after = server_counters(server.url, DRAFTING_COUNTERS)
    finally:
        server.close()
    drafts = {counter.removeprefix("vllm:spec_decode_"): (after[counter] - before[counter]) / repeats
              for counter in DRAFTING_COUNTERS}
    verify_steps = drafts["num_drafts"]
    return {"method": name, "speculative_config": speculative_config, "generated_tokens": tokens,
            "seconds": min(seconds), "tokens_per_second": tokens / min(seconds), "text": text, **drafts,
            "accepted_per_verify": 1 + drafts["num_accepted_tokens"] / verify_steps if verify_steps else None,
            "load_average_1min_after": os.getloadavg()[0]}
