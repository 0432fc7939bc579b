"""Serving benchmark: the same concurrent requests served by vLLM (with the plugin), by `scripts/serve.py`
(`transformers serve`, one request at a time) and by our `generate()` one request after another, side by side in
one run; and the KV cache of one IndexPool layer in vLLM's accounting, pooled (r) against unpooled (r = 1).

vLLM's CPU build pins an older transformers than this package, so it lives in its own environment: run this script
with the package's environment and give the vLLM environment's Python with `--vllm-python`. A random bfloat16
checkpoint is saved first (byte-level tokenizer, no end-of-sequence token, so every request generates exactly
`--new-tokens`); prompts are random printable text of `--min-prompt`..`--max-prompt` bytes (one token each), beyond
the budget. Throughput is generated tokens over the wall time from the first request sent to the last answer; the
machine's 1-minute load average after each measurement is recorded beside it (other work on a shared machine slows
whichever measurement it overlaps).

vLLM reports how many tokens its KV cache holds in `VLLM_CPU_KVCACHE_SPACE` GiB; the benchmark starts a second vLLM
engine on the same model with r = 1 (mean pooling in both, so the pooling weights take no room) to read that number
too, and asks the plugin's specs for the bytes per token of each cache component.

`--against-qwen3-next` measures the plugin against vLLM's own Qwen3-Next at the same widths: a random Qwen3-Next
checkpoint (the same Gated DeltaNet layers and mixtures of experts, `QWEN3_NEXT_EXPERTS`: vLLM's Qwen3-Next has no
dense-MLP form; dense gated attention) is saved and converted into ours
(`convert_qwen3_next`, mean pooling, budget `--budget`), and vLLM serves each, the native model and the plugin's,
the same requests.

    python -m hybrid_indexpool.scripts.bench_serving --vllm-python .venv-vllm/bin/python \\
        --json docs/results/bench_serving.json
    python -m hybrid_indexpool.scripts.bench_serving --vllm-python .venv-vllm/bin/python --against-qwen3-next \\
        --budget 1024 --min-prompt 2048 --max-prompt 8192 --skip-transformers
"""

import argparse
import json
import os
import random
import re
import shutil
import socket
import statistics
import string
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

# The checkout this script runs from (an editable install): `--baseline-ref` reads its git history.
REPO = Path(__file__).resolve().parents[1]

MODEL = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
             head_dim=128, partial_rotary_factor=0.25, index_n_heads=4, index_head_dim=64, index_topk=256,
             linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
             max_position_embeddings=16384)
# The mixture of experts of the Qwen3-Next comparison (vLLM's Qwen3-Next model needs one), in both models.
QWEN3_NEXT_EXPERTS = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
                          shared_expert_intermediate_size=512)
KV_BYTES_SCRIPT = """
import json, sys
from hybrid_indexpool.configuration import HybridIndexPoolConfig
from hybrid_indexpool.serving.memory import bytes_per_token
config = HybridIndexPoolConfig(**json.loads(sys.argv[1]))
print(json.dumps(bytes_per_token(config, block_size=int(sys.argv[2]), context=int(sys.argv[3]))))
"""


def save_checkpoint(folder: Path, pool_size: int, weighting: str, budget: int = MODEL["index_topk"],
                    max_positions: int = MODEL["max_position_embeddings"]) -> None:
    from hybrid_indexpool import HybridIndexPoolConfig, HybridIndexPoolForCausalLM
    from hybrid_indexpool.tokenization import byte_level_tokenizer

    torch.manual_seed(0)
    tokenizer = byte_level_tokenizer()
    config = HybridIndexPoolConfig(vocab_size=len(tokenizer), index_pool_size=pool_size,
                                   index_pool_weighting=weighting, pad_token_id=tokenizer.pad_token_id,
                                   bos_token_id=tokenizer.bos_token_id, eos_token_id=None,
                                   **{**MODEL, "index_topk": budget, "max_position_embeddings": max_positions})
    HybridIndexPoolForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def save_qwen3_next_pair(folder: Path, pool_size: int, budget: int,
                         max_positions: int = MODEL["max_position_embeddings"]) -> tuple[Path, Path]:
    """A random bfloat16 Qwen3-Next checkpoint at `MODEL`'s widths (full attention where ours has IndexPool layers)
    and its conversion into ours with a mean-pooled indexer of budget `budget`; returns (Qwen3-Next, ours)."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    from hybrid_indexpool import HybridIndexPoolConfig
    from hybrid_indexpool.conversion import IndexerSettings, convert_qwen3_next
    from hybrid_indexpool.tokenization import byte_level_tokenizer

    torch.manual_seed(0)
    tokenizer = byte_level_tokenizer()
    ours = HybridIndexPoolConfig(**{**MODEL, "max_position_embeddings": max_positions})
    config = Qwen3NextConfig(
        vocab_size=len(tokenizer), hidden_size=ours.hidden_size, intermediate_size=ours.intermediate_size,
        num_hidden_layers=ours.num_hidden_layers, num_attention_heads=ours.num_attention_heads,
        num_key_value_heads=ours.num_key_value_heads, head_dim=ours.head_dim,
        layer_types=["full_attention" if kind == "indexpool_attention" else kind for kind in ours.layer_types],
        linear_num_key_heads=ours.linear_num_key_heads, linear_num_value_heads=ours.linear_num_value_heads,
        linear_key_head_dim=ours.linear_key_head_dim, linear_value_head_dim=ours.linear_value_head_dim,
        rope_parameters=dict(ours.rope_parameters), max_position_embeddings=ours.max_position_embeddings,
        **QWEN3_NEXT_EXPERTS, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=None)
    source, converted = folder / "qwen3_next", folder / "qwen3_next_indexpool"
    Qwen3NextForCausalLM(config).to(torch.bfloat16).save_pretrained(source)
    tokenizer.save_pretrained(source)
    convert_qwen3_next(source, converted, IndexerSettings(n_heads=ours.index_n_heads, head_dim=ours.index_head_dim,
                                                          topk=budget, pool_size=pool_size, pool_weighting="mean"),
                       progress=False, log=lambda *args: None)
    tokenizer.save_pretrained(converted)
    return source, converted


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=3600) as response:
        return json.loads(response.read())


class Server:
    """An OpenAI-compatible server in a subprocess, up once `/health` answers; its output goes to a log file."""

    def __init__(self, command: list[str], port: int, log_path: Path, env: dict | None = None):
        self.url, self.log_path = f"http://127.0.0.1:{port}", log_path
        self.log = log_path.open("w")
        # Started in the log's folder: from the checkout's root, its `hybrid_indexpool/` folder would shadow the
        # package on `PYTHONPATH`.
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                        cwd=log_path.parent)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{command[:4]} exited:\n{log_path.read_text()[-4000:]}")
            try:
                urllib.request.urlopen(f"{self.url}/health", timeout=5)
                return
            except OSError:
                time.sleep(2)
        raise RuntimeError(f"{command[:4]} did not answer /health in 600 s")

    def close(self) -> str:
        self.process.terminate()
        self.process.wait(timeout=120)
        self.log.close()
        return self.log_path.read_text()


def streamed_token_times(url: str, body: dict) -> list[float]:
    """`perf_counter` times at which a streamed `/v1/completions` reply's tokens arrived (one chunk per token)."""
    request = urllib.request.Request(url, json.dumps({**body, "stream": True}).encode(),
                                     {"Content-Type": "application/json"})
    times = []
    with urllib.request.urlopen(request, timeout=3600) as response:
        for line in response:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            if json.loads(line[6:])["choices"]:
                times.append(time.perf_counter())
    return times


def decode_phase(token_times: list[list[float]]) -> dict:
    """Throughput once every request has its first token (prefills done, every request decoding): the tokens that
    arrived after the last first token over the time from then to the last token."""
    start = max(times[0] for times in token_times)
    end = max(times[-1] for times in token_times)
    tokens = sum(time > start for times in token_times for time in times)
    return {"decode_seconds": end - start, "decode_tokens": tokens,
            "decode_tokens_per_second": tokens / (end - start) if end > start else 0.0,
            "first_token_seconds": [times[0] for times in token_times]}


def serve_concurrently(url: str, model: str, prompts: list[str], new_tokens: int, stream: bool = False,
                       **options) -> dict:
    """All prompts sent at once to `/v1/completions` (greedy, with the server's own `options`); generated tokens per
    second of wall time. `stream`: the replies are streamed and the decode phase is measured too (`decode_phase`;
    first-token times from the start)."""
    body = {"model": model, "max_tokens": new_tokens, "temperature": 0, **options}

    def complete(prompt: str) -> int:
        return post(f"{url}/v1/completions", {**body, "prompt": prompt})["usage"]["completion_tokens"]

    def complete_streamed(prompt: str) -> list[float]:
        return streamed_token_times(f"{url}/v1/completions", {**body, "prompt": prompt})

    post(f"{url}/v1/completions", {"model": model, "prompt": prompts[0][:32], "max_tokens": 2, "temperature": 0})
    start = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        replies = list(pool.map(complete_streamed if stream else complete, prompts))
    seconds = time.perf_counter() - start
    tokens = sum(len(times) for times in replies) if stream else sum(replies)
    result = {"seconds": seconds, "generated_tokens": tokens, "tokens_per_second": tokens / seconds,
              "load_average_1min_after": os.getloadavg()[0]}
    if stream:
        phase = decode_phase(replies)
        phase["first_token_seconds"] = [time - start for time in phase["first_token_seconds"]]
        result.update(phase)
    return result


def vllm_server(python: str, checkpoint: Path, args, log_path: Path, package_root: Path | None = None) -> Server:
    """vLLM's OpenAI server on `checkpoint`, with the plugin installed in `python`'s environment or, with
    `package_root`, the `hybrid_indexpool` package found there first."""
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib), "OMP_NUM_THREADS": str(args.threads)}
    env.pop("TRITON_INTERPRET", None)
    if package_root is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(package_root), env.get("PYTHONPATH")]))
    command = [os.path.abspath(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint),
               "--port", str(port), "--dtype", "bfloat16", "--max-num-seqs", str(args.requests),
               "--max-model-len", str(args.max_prompt + args.new_tokens + 8)]
    if not args.compile:
        command.append("--enforce-eager")
    return Server(command, port, log_path, env)


def package_at(ref: str, folder: Path) -> Path:
    """The `hybrid_indexpool` package as of git commit `ref` of this checkout, laid out under `folder` as `setup.py`
    installs it (the top-level folders as subpackages); returns the folder to put on `PYTHONPATH`."""
    source = folder / "source"
    source.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(source)], input=archive, check=True)
    root = folder / "packages"
    package = root / "hybrid_indexpool"
    shutil.copytree(source / "hybrid_indexpool", package)
    for name in ("configuration", "modeling", "kernels", "scripts", "serving"):  # setup.py's PACKAGE_FOLDERS
        shutil.copytree(source / name, package / name)
    return root


def machine_description() -> dict:
    """The machine a measurement ran on: processor, cores, torch."""
    import platform

    processor = platform.processor()
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        processor = re.search(r"model name\s*:\s*(.*)", cpuinfo).group(1)
    except (OSError, AttributeError):
        pass
    return {"processor": processor, "cores": os.cpu_count(), "torch": torch.__version__}


def kv_cache_tokens(log: str) -> int:
    """The tokens vLLM's KV cache holds, from its start-up log."""
    return int(re.search(r"KV cache size: ([\d,]+) tokens", log).group(1).replace(",", ""))


def generate_one_by_one(checkpoint: Path, prompts: list[str], new_tokens: int) -> dict:
    from transformers import AutoTokenizer

    from hybrid_indexpool import HybridIndexPoolForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = HybridIndexPoolForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).eval()
    inputs = [tokenizer(prompt, return_tensors="pt") for prompt in prompts]
    model.generate(**inputs[0], max_new_tokens=2, do_sample=False)  # warm-up (kernel builds)
    start = time.perf_counter()
    tokens = 0
    for encoded in inputs:
        output = model.generate(**encoded, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        tokens += output.shape[1] - encoded["input_ids"].shape[1]
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "generated_tokens": tokens, "tokens_per_second": tokens / seconds,
            "load_average_1min_after": os.getloadavg()[0]}


def decode_step_operations(model: dict, args) -> list[dict]:
    """Operators and host syncs of one IndexPool layer's batched decode step (the plugin's `indexpool_step`, CPU
    path, without vLLM: the compiled kernels' calls are not `aten` operators) at the model's widths: `--requests`
    requests decoding at the shortest and the longest prompt's context."""
    from hybrid_indexpool.serving.synthetic_step import count_step_operations, synthetic_step

    sizes = step_sizes(model, args)
    rows = []
    for context in (args.min_prompt, args.max_prompt):
        step = synthetic_step([context] * args.requests, [1] * args.requests, sizes)
        rows.append({"context": context, **count_step_operations(step)})
    return rows


def step_sizes(model: dict, args):
    """The synthetic step's widths for the bench model (mean pooling, as the served checkpoints)."""
    from hybrid_indexpool.serving.synthetic_step import StepSizes

    return StepSizes(heads=model["num_attention_heads"], kv_heads=model["num_key_value_heads"],
                     head_dim=model["head_dim"], index_heads=model["index_n_heads"],
                     index_head_dim=model["index_head_dim"], pool_size=args.pool_size, topk=args.budget,
                     weighting="mean")


def decode_step_timing(sizes, requests: int, contexts: list[int], repeats: int = 7) -> dict:
    """One IndexPool layer's batched decode step (`indexpool_step`, bfloat16) of `requests` requests at each of
    `contexts`, and its window selection and sparse attention alone, on the compiled CPU kernels and on the PyTorch
    paths (`HYBRID_INDEXPOOL_CPU_KERNELS=0`), calls alternated (a shared machine's load falls on both) and the median
    kept; beside them the bytes the step must read (each request's selected keys and values, its pooled keys) and
    their time at the copy bandwidth measured in the same run (`benchmarking.copy_bandwidth`, bytes read plus written
    per second). Each time is taken twice: wall time (`_ms`), and the CPU time the process used (`_cpu_ms`, against
    the copy bandwidth in CPU time), which leaves out the waits for a core on a loaded machine; with one thread it is
    the time the work took on the core (with more, waiting threads may spin and count)."""
    from hybrid_indexpool.benchmarking import copy_bandwidth
    from hybrid_indexpool.kernels import sparse_attention
    from hybrid_indexpool.kernels.cpu_build import ENABLE_VARIABLE
    from hybrid_indexpool.serving.huge_pages import anon_huge_page_bytes, transparent_huge_page_mode
    from hybrid_indexpool.serving.paged_step import select_windows
    from hybrid_indexpool.serving.synthetic_step import synthetic_step

    def timed(paths: dict) -> dict:
        samples = {name: [] for name in paths}
        for _ in range(repeats + 1):  # the first round warms up (kernel builds, allocator)
            for name, run in paths.items():
                start, start_cpu = time.perf_counter(), time.process_time()
                run()
                samples[name].append((time.perf_counter() - start, time.process_time() - start_cpu))
        return {f"{name}{suffix}": 1e3 * statistics.median(sample[clock] for sample in times[1:])
                for name, times in samples.items() for clock, suffix in ((0, ""), (1, "_cpu"))}

    def with_cpu_kernels(enabled: bool, run):
        def call():
            saved = os.environ.get(ENABLE_VARIABLE)
            os.environ[ENABLE_VARIABLE] = "1" if enabled else "0"
            try:
                return run()
            finally:
                if saved is None:
                    del os.environ[ENABLE_VARIABLE]
                else:
                    os.environ[ENABLE_VARIABLE] = saved
        return call

    bandwidth, bandwidth_cpu = copy_bandwidth(), copy_bandwidth(clock=time.process_time)
    rows = []
    for context in contexts:
        step = synthetic_step([context] * requests, [1] * requests, sizes, seed=context)
        main, head_dim = step.main, sizes.head_dim
        with torch.no_grad():
            def selection():
                return select_windows(step.inputs["index_queries"], step.inputs["head_weights"], step.caches, main,
                                      step.metadata["pooled_keys"], step.settings)

            selected = selection()

            def attention():
                kv = step.caches.main
                return sparse_attention.paged_sparse_attention(
                    step.inputs["query"], kv[..., :head_dim], kv[..., head_dim:], main.block_table,
                    main.token_request, selected, main.token_position, sizes.pool_size, step.settings.scaling,
                    step.inputs["output_gate"])

            torch.testing.assert_close(with_cpu_kernels(True, attention)(), with_cpu_kernels(False, attention)(),
                                       rtol=1.6e-2, atol=1e-2)
            if not torch.equal(with_cpu_kernels(True, selection)(), with_cpu_kernels(False, selection)()):
                raise AssertionError("the CPU kernel selected other windows than the PyTorch path")
            paths = {"step": step.run, "selection": selection, "attention": attention}
            times = timed({f"{name}_{path}": with_cpu_kernels(path == "kernel", run)
                           for name, run in paths.items() for path in ("kernel", "torch")})
        attended = min(sizes.topk, context // sizes.pool_size * sizes.pool_size) + sizes.pool_size - 1
        element = step.caches.main.element_size()
        attention_bytes = requests * sizes.kv_heads * attended * 2 * head_dim * element
        index_bytes = requests * (context // sizes.pool_size) * step.caches.pooled_keys.shape[-1] * \
            step.caches.pooled_keys.element_size()
        row = {"context": context, "requests": requests, **{f"{name}_ms": ms for name, ms in times.items()},
               "attention_bytes": attention_bytes, "index_bytes": index_bytes,
               # The caches in transparent huge pages, as the plugin advises vLLM's (`serving/huge_pages.py`): the
               # AnonHugePages of their mappings in /proc/self/smaps, and why the advice was declined where it was.
               "cache_bytes": {kind: getattr(step.caches, kind).nbytes for kind in ("main", "pooled_keys")},
               "cache_huge_page_bytes": {kind: anon_huge_page_bytes(getattr(step.caches, kind))
                                         for kind in ("main", "pooled_keys")},
               "huge_pages_declined": {kind: advice.reason for kind, advice in step.huge_pages.items()
                                       if advice.reason}}
        for suffix, rate in (("", bandwidth), ("_cpu", bandwidth_cpu)):
            bytes_ms = {"attention": 1e3 * attention_bytes / rate, "selection": 1e3 * index_bytes / rate,
                        "step": 1e3 * (attention_bytes + index_bytes) / rate}
            row.update({"attention_bytes_ms" + suffix: bytes_ms["attention"],
                        "index_bytes_ms" + suffix: bytes_ms["selection"], "step_bytes_ms" + suffix: bytes_ms["step"]})
            for part in ("attention", "selection", "step"):
                for path in ("kernel", "torch"):
                    row[f"{part}_{path}{suffix}_over_bytes"] = row[f"{part}_{path}{suffix}_ms"] / bytes_ms[part]
        rows.append(row)
    return {"copy_bandwidth": bandwidth, "copy_bandwidth_cpu": bandwidth_cpu, "threads": torch.get_num_threads(),
            "transparent_huge_pages": transparent_huge_page_mode(), "load_average_1min_after": os.getloadavg()[0],
            "rows": rows}


def print_decode_step_timing(timing: dict) -> None:
    for suffix, clock, rate in (("", "wall time", timing["copy_bandwidth"]),
                                ("_cpu", "CPU time", timing["copy_bandwidth_cpu"])):
        print(f"one IndexPool layer's decode step, bfloat16, {timing['threads']} threads, {clock}, copy bandwidth "
              f"{rate / 1e9:.1f} GB/s (read + written, in {clock}), load average "
              f"{timing['load_average_1min_after']:.1f}; ms, and x its bytes' time at that bandwidth (the selection's: "
              "the pooled keys; the attention's: the selected keys and values; the step's: both):")
        print("| context | requests | bytes (MB) | at copy bandwidth | selection: CPU kernel | selection: PyTorch | "
              "attention: CPU kernel | attention: PyTorch | step: CPU kernels | step: PyTorch |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for row in timing["rows"]:
            cells = [f"{row[name + suffix + '_ms']:.2f} ({row[name + suffix + '_over_bytes']:.1f}x)"
                     for name in ("selection_kernel", "selection_torch", "attention_kernel", "attention_torch",
                                  "step_kernel", "step_torch")]
            megabytes, bytes_ms = (row["attention_bytes"] + row["index_bytes"]) / 1e6, row["step_bytes_ms" + suffix]
            print(f"| {row['context']} | {row['requests']} | {megabytes:.1f} | {bytes_ms:.2f} ms | "
                  + " | ".join(cells) + " |")
    for row in timing["rows"]:
        held = ", ".join(f"{kind} {row['cache_huge_page_bytes'][kind] / 2**20:.0f} of {size / 2**20:.0f} MiB"
                         for kind, size in row["cache_bytes"].items())
        declined = "".join(f"; {kind} declined: {reason}" for kind, reason in row["huge_pages_declined"].items())
        print(f"{row['context']} tokens: caches in transparent huge pages (THP {timing['transparent_huge_pages']!r}; "
              f"AnonHugePages of their mappings): {held}{declined}")


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", help="Python of an environment with vllm-cpu and this package (required but "
                        "with --decode-step-only)")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--min-prompt", type=int, default=300)
    parser.add_argument("--max-prompt", type=int, default=1000)
    parser.add_argument("--pool-size", type=int, default=4)
    parser.add_argument("--budget", type=int, default=MODEL["index_topk"], help="index_topk: the token budget")
    parser.add_argument("--against-qwen3-next", action="store_true",
                        help="serve a random Qwen3-Next checkpoint with vLLM's own model and its conversion into ours "
                             "with the plugin, side by side (the plugin's numbers are then the converted model's)")
    parser.add_argument("--kv-cache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE of the vLLM engines")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--baseline-ref", help="also serve the same requests with the vLLM plugin as of this git "
                        "commit of the checkout (e.g. the one before a change), side by side")
    parser.add_argument("--compile", action="store_true",
                        help="leave vLLM's compilation on (the plugin's model is compiled); else --enforce-eager")
    parser.add_argument("--skip-transformers", action="store_true",
                        help="measure vLLM only (not scripts/serve.py nor generate())")
    parser.add_argument("--stream", action="store_true",
                        help="stream the replies and also report the decode phase (tokens/s once every request has "
                             "its first token) and each request's time to its first token")
    parser.add_argument("--decode-step-requests", type=int, default=16,
                        help="requests of the timed decode step of one IndexPool layer (CPU kernels against PyTorch)")
    parser.add_argument("--decode-step-only", action="store_true",
                        help="only time one IndexPool layer's decode step at --min-prompt and --max-prompt tokens "
                             "(no vLLM)")
    parser.add_argument("--skip-r1", action="store_true",
                        help="do not start the r = 1 engine that counts its KV cache's tokens")
    parser.add_argument("--prefix-cache", action="store_true",
                        help="only measure prefix caching: the time to the first token of a request sharing a "
                             "--prefix-tokens prefix with the request before it, with prefix caching on and off")
    parser.add_argument("--prefix-tokens", type=int, default=4096)
    parser.add_argument("--suffix-tokens", type=int, default=64)
    parser.add_argument("--drafting", metavar="CHECKPOINT",
                        help="only measure speculative decoding: tokens/s of one request (batch 1) on a copying prompt "
                             "served from CHECKPOINT (a byte-level model with MTP layers, e.g. bench_speculative's "
                             "trained one) without drafting and with each of --drafting-methods")
    parser.add_argument("--drafting-methods", default="ngram,ngram:8:1:5,mtp:1,mtp:2,mtp:3",
                        help="comma-separated: 'ngram' (prompt lookup of 2 to 5 tokens, 5 drafts), 'ngram:K:MIN:MAX' "
                             "(K drafts, lookup of MIN to MAX tokens) and 'mtp:K' (the checkpoint's MTP layers, K "
                             "drafts)")
    parser.add_argument("--copy-length", type=int, default=200,
                        help="characters of the held-out passage the copying prompt repeats (the tokens generated: "
                             "one fewer than the passage's tokens)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if args.vllm_python is None and not args.decode_step_only:
        parser.error("--vllm-python is required: give the Python of the vLLM environment (or --decode-step-only)")
    return args


def prefix_cache_rows(args, scratch: Path) -> list[dict]:
    """`serving_reuse_benchmark.prefix_cache_first_tokens` with prefix caching on and off, on the bench model (its
    budget `--budget`), for a random text prefix of `--prefix-tokens` characters (one token each) and two suffixes."""
    from hybrid_indexpool.serving_reuse_benchmark import prefix_cache_first_tokens

    generator = random.Random(1)
    def text(length):
        return "".join(generator.choices(string.ascii_letters + " ", k=length))

    prefix, suffixes = text(args.prefix_tokens), (text(args.suffix_tokens), text(args.suffix_tokens))
    checkpoint = scratch / "prefix_model"
    save_checkpoint(checkpoint, args.pool_size, "mean", args.budget,
                    max(MODEL["max_position_embeddings"], args.prefix_tokens + args.suffix_tokens + 128))
    return [prefix_cache_first_tokens(args.vllm_python, checkpoint, prefix, suffixes, scratch, caching,
                                      args.threads, args.kv_cache_gib) for caching in (True, False)]


def drafting_methods(text: str) -> dict:
    """`--drafting-methods` -> {name: vLLM's speculative_config}: 'ngram' (5 drafts, prompt lookup of 2 to 5 tokens),
    'ngram:K:MIN:MAX' (K drafts, lookup of MIN to MAX tokens), 'mtp:K' (the checkpoint's MTP layers, K drafts)."""
    methods = {}
    for method in text.split(","):
        fields = method.split(":")
        if fields[0] == "ngram" and len(fields) in (1, 4) and all(field.isdigit() for field in fields[1:]):
            drafts, shortest, longest = map(int, fields[1:]) if len(fields) == 4 else (5, 2, 5)
            methods[method] = {"method": "ngram", "num_speculative_tokens": drafts, "prompt_lookup_min": shortest,
                               "prompt_lookup_max": longest}
        elif fields[0] == "mtp" and len(fields) == 2 and fields[1].isdigit():
            methods[method] = {"method": "mtp", "num_speculative_tokens": int(fields[1])}
        else:
            raise ValueError(f"--drafting-methods: unknown method {method!r} (use 'ngram', 'ngram:K:MIN:MAX' or "
                             "'mtp:K')")
    return methods


def drafting_rows(args, scratch: Path) -> list[dict]:
    """`serving_reuse_benchmark.drafting_throughput` on bench_speculative's copying prompt (token ids: a held-out
    passage of `--copy-length` characters tokenized, twice, each after a marker, then the marker and the passage's
    first token), without drafting and with each of `--drafting-methods`; each row records whether its text is plain
    decoding's."""
    from transformers import AutoTokenizer

    from hybrid_indexpool.retrieval_task import stdlib_texts, text_window
    from hybrid_indexpool.serving_reuse_benchmark import drafting_throughput
    from hybrid_indexpool.speculative_benchmark import copying_prompt

    tokenizer = AutoTokenizer.from_pretrained(args.drafting)
    _, held_out, _, _ = stdlib_texts()
    passage = torch.tensor(tokenizer(text_window(held_out, args.copy_length, random.Random(0)))["input_ids"])
    marker = torch.tensor(tokenizer("\n# again:\n")["input_ids"])
    prompt = copying_prompt(passage, marker)[0].tolist()
    methods = {"greedy": None, **drafting_methods(args.drafting_methods)}
    rows = [drafting_throughput(args.vllm_python, Path(args.drafting), prompt, len(passage) - 1, config, scratch,
                                name, args.threads, args.kv_cache_gib) for name, config in methods.items()]
    for row in rows:
        row["same_text_as_greedy"] = row["text"] == rows[0]["text"]
        row["speedup"] = row["tokens_per_second"] / rows[0]["tokens_per_second"]
    return rows


def print_reuse_rows(results: dict) -> None:
    for row in results.get("prefix_cache", []):
        print(f"prefix caching {'on ' if row['prefix_caching'] else 'off'}: first token of the first request "
              f"{row['first_request_first_token_seconds']:.2f} s, of the second (same {row['prefix_characters']}-"
              f"token prefix) {row['second_request_first_token_seconds']:.2f} s: {row['first_over_second']:.1f}x; "
              f"prefix-cache hits {row['prefix_cache_hits']:.0f} of {row['prefix_cache_queries']:.0f} tokens")
    for row in results.get("drafting", []):
        print(f"{row['method']:8s} {row['tokens_per_second']:7.1f} tokens/s ({row['speedup']:.2f}x), "
              f"{row['num_accepted_tokens']:.0f} of {row['num_draft_tokens']:.0f} drafts kept"
              + (f", {row['accepted_per_verify']:.2f} tokens per verify step" if row["accepted_per_verify"] else "")
              + ("" if row["same_text_as_greedy"] else "; TEXT DIFFERS FROM GREEDY"))


def main(argv=None) -> dict:
    args = parse_arguments(argv)
    torch.set_num_threads(args.threads)
    if args.prefix_cache or args.drafting:
        results = {"threads": args.threads, "kv_cache_gib": args.kv_cache_gib, "machine": machine_description(),
                   "load_average_1min_before": os.getloadavg()[0]}
        with tempfile.TemporaryDirectory() as scratch:
            if args.prefix_cache:
                results["model"] = {**MODEL, "index_topk": args.budget, "index_pool_size": args.pool_size}
                results["prefix_cache"] = prefix_cache_rows(args, Path(scratch))
            if args.drafting:
                results["drafting_checkpoint"] = args.drafting
                results["drafting"] = drafting_rows(args, Path(scratch))
        print_reuse_rows(results)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
        return results
    generator = random.Random(0)
    prompts = ["".join(generator.choices(string.ascii_letters + " ", k=generator.randint(args.min_prompt,
                                                                                       args.max_prompt)))
               for _ in range(args.requests)]
    max_positions = max(MODEL["max_position_embeddings"], args.max_prompt + args.new_tokens + 8)
    model = {**MODEL, "index_topk": args.budget, "max_position_embeddings": max_positions}
    results = {"requests": args.requests, "new_tokens": args.new_tokens, "prompt_tokens": [len(p) for p in prompts],
               "model": model, "pool_size": args.pool_size, "threads": args.threads, "kv_cache_gib": args.kv_cache_gib,
               "compile": args.compile, "machine": machine_description()}
    if args.decode_step_only:
        results = {"model": model, "pool_size": args.pool_size, "machine": machine_description(),
                   "decode_step_timing": decode_step_timing(step_sizes(model, args), args.decode_step_requests,
                                                            sorted({args.min_prompt, args.max_prompt}))}
        print_decode_step_timing(results["decode_step_timing"])
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
        return results
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        checkpoint, unpooled = scratch / "pooled", scratch / "unpooled"
        if args.against_qwen3_next:
            qwen3_next, checkpoint = save_qwen3_next_pair(scratch, args.pool_size, args.budget, max_positions)
            results["model"] = {**model, **QWEN3_NEXT_EXPERTS}
            server = vllm_server(args.vllm_python, qwen3_next, args, scratch / "vllm_qwen3_next.log")
            try:
                results["vllm_qwen3_next"] = serve_concurrently(server.url, str(qwen3_next), prompts,
                                                                args.new_tokens, args.stream, ignore_eos=True)
            finally:
                server.close()
        else:
            save_checkpoint(checkpoint, args.pool_size, "mean", args.budget, max_positions)
        if not args.skip_r1:
            save_checkpoint(unpooled, 1, "mean", args.budget, max_positions)

        server = vllm_server(args.vllm_python, checkpoint, args, scratch / "vllm.log")
        try:
            # vLLM stops at the tokenizer's end-of-sequence token unless told not to; generate() has none to stop at.
            results["vllm"] = serve_concurrently(server.url, str(checkpoint), prompts, args.new_tokens, args.stream,
                                                 ignore_eos=True)
        finally:
            log = server.close()
        results["vllm"]["kv_cache_tokens"] = kv_cache_tokens(log)
        if args.baseline_ref:
            baseline = package_at(args.baseline_ref, scratch / "baseline")
            server = vllm_server(args.vllm_python, checkpoint, args, scratch / "vllm_baseline.log", baseline)
            try:
                results["vllm_baseline"] = serve_concurrently(server.url, str(checkpoint), prompts, args.new_tokens,
                                                              args.stream, ignore_eos=True)
            finally:
                server.close()
            results["vllm_baseline"]["ref"] = args.baseline_ref
        if not args.skip_r1:
            server = vllm_server(args.vllm_python, unpooled, args, scratch / "vllm_r1.log")
            results["vllm_r1_kv_cache_tokens"] = kv_cache_tokens(server.close())

        if not args.skip_transformers:
            port = free_port()
            server = Server([sys.executable, "-m", "hybrid_indexpool.scripts.serve", str(checkpoint), "--port",
                             str(port)], port, scratch / "serve.log")
            try:
                results["serve_py"] = serve_concurrently(server.url, str(checkpoint), prompts, args.new_tokens)
            finally:
                server.close()
            results["generate"] = generate_one_by_one(checkpoint, prompts, args.new_tokens)

    results["decode_step_operations"] = decode_step_operations(model, args)
    results["decode_step_timing"] = decode_step_timing(step_sizes(model, args), args.decode_step_requests,
                                                       sorted({args.min_prompt, args.max_prompt}))
    context = args.max_prompt + args.new_tokens
    for name, pool_size in (("kv_bytes_per_token", args.pool_size), ("kv_bytes_per_token_r1", 1)):
        config = {**model, "index_pool_size": pool_size, "index_pool_weighting": "learned"}
        output = subprocess.run([args.vllm_python, "-c", KV_BYTES_SCRIPT, json.dumps(config), "256", str(context)],
                                check=True, capture_output=True, text=True).stdout
        results[name] = json.loads(output.strip().splitlines()[-1])
    for name in ("vllm", "vllm_baseline", "vllm_qwen3_next", "serve_py", "generate"):
        if name not in results:
            continue
        print(f"{name:13s} {results[name]['tokens_per_second']:8.1f} tokens/s "
              f"({results[name]['generated_tokens']} tokens in {results[name]['seconds']:.1f} s)"
              + (f"; decode phase {results[name]['decode_tokens_per_second']:.1f} tokens/s "
                 f"({results[name]['decode_tokens']} tokens in {results[name]['decode_seconds']:.1f} s)"
                 if "decode_seconds" in results[name] else ""))
    for row in results["decode_step_operations"]:
        print(f"one IndexPool layer's decode step of {args.requests} requests at {row['context']} tokens (CPU "
              f"path): {row['operators']} operators (and {row['views']} views), {row['host_syncs']} host syncs")
    print_decode_step_timing(results["decode_step_timing"])
    print(f"vLLM KV cache in {args.kv_cache_gib} GiB: {results['vllm']['kv_cache_tokens']} tokens at r = "
          f"{args.pool_size}" + (f", {results['vllm_r1_kv_cache_tokens']} at r = 1" if not args.skip_r1 else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
