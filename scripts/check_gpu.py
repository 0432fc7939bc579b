"""GPU check of the IndexPool kernels and the vLLM plugin's batched step, ending with a verdict: a PASS/FAIL table
against the thresholds below and exit status 1 on any failure (on a GPU, any check that could not run, SKIP, is one).

On one H100/H200 (torch, Triton and transformers; no vLLM, no network, nothing of the project installed), from the
checkout's root, at Qwen3.8-Flash-Next sizes (16 query heads, 2 key/value heads of dim 256, 16 index heads of dim
128, budget 2048 tokens); docs/check_gpu.md:

    python -m hybrid_indexpool.scripts.check_gpu --quick    # the verdict's checks only: under 3 minutes
    python -m hybrid_indexpool.scripts.check_gpu            # with every table: under 8 minutes; --json FILE keeps all

1. Every kernel against the PyTorch reference, float32 and bfloat16, r = 1/4/16: selections, outputs, gradients,
   split decode.
2. Decode step of one layer's unpaged kernels at 32K-1M tokens (r = 4, r = 1, dense), bandwidth (not in --quick).
3. Prefill throughput of the kernels (not in --quick).
4. Bytes and launches of one decode step, counted on meta tensors, against the minimum (any machine).
5. Registers / shared memory / spills of every kernel compiled ahead of time for sm_80 and sm_90 (`kernels/aot.py`;
   no GPU needed; not in --quick).
6. The vLLM plugin's batched step over paged caches (`serving/paged_step.py`, no vLLM needed): Triton against
   PyTorch on a mixed step (float32/bfloat16, pooled keys in the model's dtype and packed fp8, r = 1/4/16); a decode
   batch with padding captured in a CUDA graph, a new batch written into its tensors and replayed against an eager
   step; the selection work per step with `max_model_len` 1M; decode steps at 128K and 1M tokens, batch 1 and 8,
   timed from graph replays against the measured copy bandwidth, r = 4 against r = 1; the memory taken to fill the
   caches.

`--offline` prints sections 4 and 5 at the real sizes without a GPU. `TRITON_INTERPRET=1 python -m
hybrid_indexpool.scripts.check_gpu --smoke` runs everything at tiny sizes on the CPU (kernels in Triton's interpreter,
one configuration compiled ahead of time) to check the script itself; what needs a GPU is then a SKIP.
"""

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import statistics
import time
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hybrid_indexpool.command_line import exit_with_error

NOMINAL_BANDWIDTH = {"H200": 4.8e12, "H100 SXM": 3.35e12, "H100 PCIe": 2.0e12, "H100": 3.35e12, "A100": 2.0e12}
POOLS = (1, 4, 16)
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}

# The verdict's thresholds. Errors are relative: the largest difference over the reference's largest magnitude.
# float32 runs in plain float32 on both paths (summation order differs); bfloat16 rounds each stored value (2^-8).
KERNEL_ERROR = {torch.float32: 1e-3, torch.bfloat16: 3e-2}
GRAD_ERROR = {torch.float32: 1e-3, torch.bfloat16: 1e-1}
# Rows whose selected set is identical: near-ties of the scores may swap one window under another summation order.
SELECTIONS_IDENTICAL = {torch.float32: 0.95, torch.bfloat16: 0.9}
# Packed fp8 pooled keys: the share of keys with any byte different (a rounding boundary crossed).
FP8_KEYS_DIFFERING = {torch.float32: 0.01, torch.bfloat16: 0.2}
BANDWIDTH_TARGET = 0.5  # decode step: bytes read / time, against the measured copy bandwidth
HEADLINE_TARGET = 2.0  # decode step at the longest context: r = 1 time over r = 4 time, same widths and budget
FILL_TRANSIENT = 0.25  # memory allocated beyond the caches while filling them, as a fraction of the caches
QUICK_SECONDS, FULL_SECONDS = 180, 480  # whole run on the GPU
GPU_TOPK = 2048  # the budget (tokens) of the selection-work counts: Qwen3.8-Flash-Next's
L2_FLUSH_BYTES = 256 << 20  # written before each timed replay: more than any GPU's L2 cache


def parse_arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="32768,131072,524288,1048576", help="decode contexts (tokens)")
    parser.add_argument("--topk", type=int, default=2048, help="token budget (default 2048)")
    parser.add_argument("--index-heads", type=int, default=16)
    parser.add_argument("--index-head-dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=16, help="attention query heads")
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=256)
    parser.add_argument("--prefill", type=int, default=32768, help="prefill length (tokens)")
    parser.add_argument("--step-contexts", default="131072,1048576",
                        help="contexts (tokens) of the vLLM step's decode benchmark (section 6); r = 4 against r = 1 "
                             "is judged at the longest")
    parser.add_argument("--step-batches", default="1,8", help="batch sizes of the vLLM step's decode benchmark")
    parser.add_argument("--block-size", type=int, default=256, help="vLLM's KV-cache block size (tokens)")
    parser.add_argument("--aot", choices=("default", "full", "none"), default="default",
                        help="configurations compiled ahead of time: the representative subset, the whole matrix "
                             "(about 20 minutes on 2 cores), or none")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--quick", action="store_true",
                        help=f"only what the verdict judges (no decode/prefill tables, no compiled resources): "
                             f"under {QUICK_SECONDS} s on an H100")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on CPU, to test the script")
    parser.add_argument("--offline", action="store_true",
                        help="without a GPU: only the decode-step bytes and the compiled resources (sections 4-5)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.contexts, args.topk, args.index_heads, args.index_head_dim = "128,256", 32, 2, 16
        args.heads, args.kv_heads, args.head_dim, args.prefill = 4, 2, 16, 32
        args.step_contexts, args.step_batches, args.block_size = "256,512", "1,2", 16
    return args


def timed(fn, device, repeats: int) -> float:
    """Median milliseconds of `fn()` over `repeats` calls after a warm-up."""
    fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(samples)


def measured_copy_bandwidth(device) -> float:
    """Bytes per second of a large device-to-device copy (read + write)."""
    size = (1 << 30) if device.type == "cuda" else (1 << 24)
    source = torch.empty(size, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    milliseconds = timed(lambda: target.copy_(source), device, 10)
    return 2 * size / (milliseconds / 1e3)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest absolute difference over the largest magnitude of `expected`."""
    return ((got.float() - expected.float()).abs().max() / expected.float().abs().max().clamp(min=1e-12)).item()


def check_kernels(device, args, kernels, dtype, pool: int) -> dict:
    """Selections and attention (with gradients) of the Triton kernels against the reference, one dtype, pool `pool`
    (the budget `args.topk` tokens: `args.topk // pool` windows)."""
    generator = torch.Generator(device="cpu").manual_seed(pool)
    results = {}
    # Index top-k: a decode step and a prefill tile with left-padded rows, over `num_windows` pooled keys of pool r.
    batch, heads, dim, topk = 2, args.index_heads, args.index_head_dim, args.topk // pool
    num_windows = 4 * topk if args.smoke else 8192 // pool * 4
    agree = []
    for queries in (1, 64 if not args.smoke else 8):
        index_queries = torch.randn(batch, queries, heads, dim, generator=generator).to(device, dtype)
        pooled = torch.randn(batch, num_windows, dim, generator=generator).to(device, dtype)
        visible = torch.randint(num_windows // 2, num_windows + 1, (batch, queries), generator=generator).to(device)
        weights = torch.randn(batch, queries, heads, generator=generator).to(device)
        expected = kernels["topk_torch"](index_queries, pooled, visible, topk, weights)
        got = kernels["topk_triton"](index_queries, pooled, visible, topk, weights)
        same = [set(a.tolist()) == set(b.tolist()) for a, b in zip(expected.flatten(0, 1), got.flatten(0, 1))]
        agree.append(sum(same) / len(same))
    results["topk_identical_fraction"] = min(agree)

    # Sparse attention, prefill-sized with gradients, and a split decode step.
    kv_heads, group, head_dim = args.kv_heads, args.heads // args.kv_heads, args.head_dim
    context, queries, windows = (8192, 64, args.topk // pool) if not args.smoke else (64, 6, 16 // pool)
    shorter = torch.tensor([0, 3])  # row 1 holds three tokens fewer (it was padded)
    positions = torch.arange(context - queries, context).expand(2, queries) - shorter[:, None]
    selected = torch.stack([
        torch.stack([torch.randperm(int(p + 1) // pool, generator=generator)[:windows].sort().values for p in row])
        for row in positions
    ])
    index_args = [t.to(device) for t in (selected, positions)]
    tensors = [torch.randn(2, n, s, head_dim, generator=generator).to(device, dtype)
               for n, s in ((kv_heads * group, queries), (kv_heads, context), (kv_heads, context))]
    leaves = [t.float().requires_grad_() for t in tensors]
    expected, _ = kernels["attention_torch"](*leaves, *index_args, pool, head_dim**-0.5)
    grad_output = torch.randn(expected.shape, generator=generator).to(device)
    expected_grads = torch.autograd.grad(expected, leaves, grad_output)
    kernel_leaves = [t.clone().requires_grad_() for t in tensors]
    got = kernels["attention_triton"](*kernel_leaves, *index_args, pool, head_dim**-0.5)
    got_grads = torch.autograd.grad(got, kernel_leaves, grad_output.to(dtype))
    results["attention_error"] = relative_error(got, expected)
    results["attention_grad_error"] = max(relative_error(g, e) for g, e in zip(got_grads, expected_grads))
    with torch.no_grad():
        split = kernels["attention_triton"](*tensors, *index_args, pool, head_dim**-0.5, num_splits=4)
        last = [t[:, :, -1:] for t in tensors[:1]] + tensors[1:]  # a decode step, default splits
        step = kernels["attention_triton"](*last, *(t[:, -1:] for t in index_args), pool, head_dim**-0.5)
    results["split_decode_error"] = max(relative_error(split, expected.detach()),
                                        relative_error(step, expected[:, -1:].detach()))
    return results


def bench_decode(device, args, kernels, dtype, context: int) -> dict:
    """Milliseconds of one decode step of the layer's kernels: index top-k + sparse attention (r = 4, r = 1),
    and dense attention over every key; plus bytes moved by the index kernel."""
    generator = torch.Generator(device="cpu").manual_seed(context)
    heads, dim = args.index_heads, args.index_head_dim
    key = torch.randn(1, args.kv_heads, context, args.head_dim, generator=generator).to(device, dtype)
    value = torch.randn_like(key)
    query = torch.randn(1, args.heads, 1, args.head_dim, generator=generator).to(device, dtype)
    index_query = torch.randn(1, 1, heads, dim, generator=generator).to(device, dtype)
    row = {"context": context}
    repeats = 20 if device.type == "cuda" else 1
    for pool in (4, 1):
        pooled = torch.randn(1, context // pool, dim, generator=generator).to(device, dtype)
        visible = torch.tensor([[context // pool]], device=device)
        topk = args.topk // pool
        selected = kernels["topk_triton"](index_query, pooled, visible, topk)
        attention_args = (selected, torch.tensor([[context - 1]], device=device))
        index_ms = timed(lambda: kernels["topk_triton"](index_query, pooled, visible, topk), device, repeats)
        attention_ms = timed(lambda: kernels["attention_triton"](query, key, value, *attention_args, pool,
                                                                args.head_dim**-0.5), device, repeats)
        row[f"r{pool}_index_ms"] = index_ms
        row[f"r{pool}_attention_ms"] = attention_ms
        row[f"r{pool}_step_ms"] = index_ms + attention_ms
        row[f"r{pool}_index_bytes"] = pooled.numel() * pooled.element_size()
        row[f"r{pool}_attention_bytes"] = 2 * args.kv_heads * args.topk * args.head_dim * key.element_size()
    with torch.no_grad():
        row["dense_ms"] = timed(lambda: torch.nn.functional.scaled_dot_product_attention(
            query, key, value, enable_gqa=args.heads != args.kv_heads), device, repeats)
    return row


def bench_prefill(device, args, kernels, dtype) -> dict:
    """Tokens per second of the kernels over a whole prompt: index top-k then sparse attention, r = 4 and r = 1."""
    generator = torch.Generator(device="cpu").manual_seed(1)
    length = args.prefill
    results = {"tokens": length}
    query = torch.randn(1, args.heads, length, args.head_dim, generator=generator).to(device, dtype)
    key = torch.randn(1, args.kv_heads, length, args.head_dim, generator=generator).to(device, dtype)
    value = torch.randn_like(key)
    index_queries = torch.randn(1, length, args.index_heads, args.index_head_dim, generator=generator).to(device,
                                                                                                         dtype)
    positions = torch.arange(length, device=device)[None]
    for pool in (4, 1):
        pooled = torch.randn(1, length // pool, args.index_head_dim, generator=generator).to(device, dtype)
        visible = (positions + 1) // pool

        def step():
            selected = kernels["topk_triton"](index_queries, pooled, visible, args.topk // pool)
            return kernels["attention_triton"](query, key, value, selected, positions, pool, args.head_dim**-0.5)

        milliseconds = timed(step, device, 3 if device.type == "cuda" else 1)
        results[f"r{pool}_tokens_per_second"] = length / (milliseconds / 1e3)
    return results


class DecodeTraffic(TorchDispatchMode):
    """Counts the launches of a step and the bytes each moves: every PyTorch operator that computes (not views,
    not allocations) with its inputs and outputs, and every Triton kernel with what it must read and write by design
    (`triton_kernel_bytes`). Used on meta tensors: nothing runs, shapes are real."""

    def __init__(self):
        super().__init__()
        self.launches = []  # (name, bytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        output = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if not func.is_view and not name.startswith(("empty", "new_empty", "lift_fresh", "detach")):
            tensors = [t for t in tree_flatten((args, kwargs, output))[0] if isinstance(t, torch.Tensor)]
            self.launches.append((f"aten.{name}", sum(t.numel() * t.element_size() for t in tensors)))
        return output

    def record(self, launch):
        self.launches.append((launch.kernel.fn.__name__, triton_kernel_bytes(launch)))


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def triton_kernel_bytes(launch) -> int:
    """What a Triton decode kernel reads and writes once each: its inputs as far as it uses them (every window
    visible; a full tail) and its outputs."""
    name, options = launch.kernel.fn.__name__, launch.options
    if name == "_pooled_index_scores_kernel":
        queries, keys, weights, visible, scores = launch.args[:5]
        batch, _, num_windows = scores.shape
        used_keys = batch * num_windows * keys.shape[-1] * keys.element_size()
        return _nbytes(queries, visible, scores) + used_keys + (_nbytes(weights) if options["HAS_WEIGHTS"] else 0)
    if name == "_sparse_attention_forward_kernel":
        query, key, _, selected, positions, partial, partial_lse = launch.args[:7]
        tokens, kv_heads = launch.grid[:2]
        slots = selected.shape[-1] * options["POOL"] + options["POOL"] - 1
        used_keys = 2 * tokens * kv_heads * slots * key.shape[-1] * key.element_size()
        return _nbytes(query, selected, positions, partial, partial_lse) + used_keys
    if name == "_combine_splits_kernel":
        return _nbytes(*launch.args[:3])
    raise ValueError(f"no byte count for {name}")


def decode_traffic(args, kernels, context: int, pool: int, dtype=torch.bfloat16) -> dict:
    """Launches and bytes of one decode step of one layer at batch 1 (index top-k, then sparse attention), counted
    on meta tensors, against the minimum: the visible pooled keys read once and the selected keys/values read once.
    Splits are sized for an H100 (132 multiprocessors)."""
    from hybrid_indexpool.kernels import launch as launch_module
    from hybrid_indexpool.kernels.pooled_index_topk import triton_impl as topk_impl
    from hybrid_indexpool.kernels.sparse_attention import triton_impl as attention_impl

    meta = dict(device="meta", dtype=dtype)
    num_windows, topk = context // pool, args.topk // pool
    index_query = torch.empty(1, 1, args.index_heads, args.index_head_dim, **meta)
    pooled = torch.empty(1, num_windows, args.index_head_dim, **meta)
    visible = torch.empty(1, 1, dtype=torch.long, device="meta")
    query = torch.empty(1, 1, args.heads, args.head_dim, **meta).transpose(1, 2)
    key = torch.empty(1, context, args.kv_heads, args.head_dim, **meta).transpose(1, 2)
    position = torch.empty(1, 1, dtype=torch.long, device="meta")
    counters, original_run = {}, launch_module.Launch.run
    sizes_of = {module: module.multiprocessor_count for module in (topk_impl, attention_impl)}
    try:
        for module in sizes_of:
            module.multiprocessor_count = lambda device: 132
        for part in ("index", "attention"):
            with DecodeTraffic() as counter:
                launch_module.Launch.run = lambda launch, counter=counter: counter.record(launch)
                if part == "index":
                    selected = kernels["topk_triton"](index_query, pooled, visible, topk)
                else:
                    kernels["attention_triton"](query, key, key, selected, position, pool, 0.1)
            counters[part] = counter.launches
    finally:
        launch_module.Launch.run = original_run
        for module, function in sizes_of.items():
            module.multiprocessor_count = function
    element = torch.empty((), dtype=dtype).element_size()
    row = {"context": context, "pool": pool, "index_minimum_bytes": num_windows * args.index_head_dim * element,
           "attention_minimum_bytes": 2 * args.kv_heads * (args.topk + pool - 1) * args.head_dim * element}
    row["minimum_bytes"] = row["index_minimum_bytes"] + row["attention_minimum_bytes"]
    for part, launches in counters.items():
        row[f"{part}_launches"] = len(launches)
        row[f"{part}_triton_launches"] = sum(not name.startswith("aten.") for name, _ in launches)
        row[f"{part}_bytes"] = sum(size for _, size in launches)
        row[f"{part}_operators"] = launches
    row["bytes"] = row["index_bytes"] + row["attention_bytes"]
    return row


def aot_resources(args) -> list:
    """Registers / shared memory / spills of the kernels compiled for sm_80 and sm_90 (no GPU needed)."""
    from hybrid_indexpool.kernels import aot

    if args.smoke:
        sizes = [aot.ModelSizes("decode", torch.bfloat16, 4, 64, 4, head_dim=64, group=2)]
    else:
        sizes = aot.full_sizes() if args.aot == "full" else aot.default_sizes()
    results = aot.compile_sizes(sizes)
    print(aot.format_table(results))
    return results


def measured_sections(device, args, kernels, report):
    """Sections 2-3: decode and prefill tables of the unpaged kernels (on the GPU, or the interpreter for --smoke)."""
    name = report["device"]
    copy_bandwidth = measured_copy_bandwidth(device)
    nominal = next((value for key, value in NOMINAL_BANDWIDTH.items() if key in name), None)
    report["copy_bandwidth"], report["nominal_bandwidth"] = copy_bandwidth, nominal
    peak = nominal or copy_bandwidth
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    print(f"\n2. decode step ({dtype}), copy bandwidth {copy_bandwidth / 1e9:.0f} GB/s, nominal "
          f"{'unknown' if nominal is None else f'{nominal / 1e9:.0f} GB/s'}")
    header = ("context", "r=4 ms", "r=1 ms", "dense ms", "r=1 / r=4", "dense / r=4", "index GB/s", "index % peak",
              "attn % peak")
    print("  " + "".join(f"{h:>13}" for h in header))
    report["decode"] = []
    for context in (int(c) for c in args.contexts.split(",")):
        row = bench_decode(device, args, kernels, dtype, context)
        index_rate = row["r4_index_bytes"] / (row["r4_index_ms"] / 1e3)
        attention_rate = row["r4_attention_bytes"] / (row["r4_attention_ms"] / 1e3)
        row.update(index_bandwidth=index_rate, index_fraction=index_rate / peak,
                   attention_fraction=attention_rate / peak)
        report["decode"].append(row)
        cells = (f"{context:,}", f"{row['r4_step_ms']:.3f}", f"{row['r1_step_ms']:.3f}", f"{row['dense_ms']:.3f}",
                 f"{row['r1_step_ms'] / row['r4_step_ms']:.2f}x", f"{row['dense_ms'] / row['r4_step_ms']:.2f}x",
                 f"{index_rate / 1e9:.0f}", f"{100 * row['index_fraction']:.0f}%",
                 f"{100 * row['attention_fraction']:.0f}%")
        print("  " + "".join(f"{c:>13}" for c in cells))

    print(f"\n3. prefill of {args.prefill:,} tokens (index top-k + sparse attention kernels)")
    report["prefill"] = bench_prefill(device, args, kernels, dtype)
    for pool in (4, 1):
        print(f"  r={pool}: {report['prefill'][f'r{pool}_tokens_per_second']:,.0f} tokens/s")


def traffic_section(args, kernels, report):
    """Section 4: bytes and launches of a decode step (meta tensors, any machine)."""
    print("\n4. bytes and launches of one decode step (one layer, batch 1, bf16; counted on meta tensors)")
    header = ("context", "r", "launches", "Triton", "index MB", "index min", "attn MB", "attn min", "total/min")
    print("  " + "".join(f"{h:>12}" for h in header))
    report["decode_traffic"] = []
    for context in (int(c) for c in args.contexts.split(",")):
        for pool in (4, 1):
            row = decode_traffic(args, kernels, context, pool)
            report["decode_traffic"].append(row)
            cells = (f"{context:,}", pool, row["index_launches"] + row["attention_launches"],
                     row["index_triton_launches"] + row["attention_triton_launches"],
                     f"{row['index_bytes'] / 1e6:.2f}", f"{row['index_minimum_bytes'] / 1e6:.2f}",
                     f"{row['attention_bytes'] / 1e6:.2f}", f"{row['attention_minimum_bytes'] / 1e6:.2f}",
                     f"{row['bytes'] / row['minimum_bytes']:.2f}x")
            print("  " + "".join(f"{c:>12}" for c in cells))


@contextlib.contextmanager
def step_backend(name: str, interpreter: bool):
    """Run the paged step's kernels on `name`'s path: `torch` (the references) or `triton` (on CUDA by default; in
    the interpreter, for --smoke, by treating CPU tensors as the fast path)."""
    from hybrid_indexpool.kernels import dispatch, pooled_index_topk, pooled_key_write, sparse_attention

    previous = os.environ.get(dispatch.BACKEND_VARIABLE)
    os.environ[dispatch.BACKEND_VARIABLE] = "torch" if name == "torch" else "auto"
    modules = (pooled_index_topk, pooled_key_write, sparse_attention)
    originals = [module.use_fast_path for module in modules]
    if name == "triton" and interpreter:
        for module in modules:
            module.use_fast_path = lambda *tensors: dispatch.kernel_backend() == "auto"
    try:
        yield
    finally:
        for module, original in zip(modules, originals):
            module.use_fast_path = original
        if previous is None:
            del os.environ[dispatch.BACKEND_VARIABLE]
        else:
            os.environ[dispatch.BACKEND_VARIABLE] = previous


def step_sizes(args, fp8_index_keys: bool = False, pool: int = 4):
    from hybrid_indexpool.serving.synthetic_step import StepSizes

    return StepSizes(heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, index_heads=args.index_heads,
                     index_head_dim=args.index_head_dim, pool_size=pool, topk=args.topk, block_size=args.block_size,
                     fp8_index_keys=fp8_index_keys)


def step_selection(step):
    """The windows the step selects for each of its tokens (the step's own selection, on the step's tensors)."""
    from hybrid_indexpool.serving.paged_step import select_windows

    return select_windows(step.inputs["index_queries"], step.inputs["head_weights"], step.caches, step.main,
                          step.metadata["pooled_keys"], step.settings)


def check_paged_step(device, args, pool: int) -> list[dict]:
    """Triton against the PyTorch path on one mixed step (prefill chunks inside windows, decodes, padding): output
    (of the tokens both selected alike for), written caches and selections, per dtype and pooled-key storage."""
    from hybrid_indexpool.serving.synthetic_step import synthetic_step

    if args.smoke:
        contexts, new_tokens = [150, 37, 9, 260], [1, 22, 1, 5]
    else:
        contexts, new_tokens = [20000, 3001, 600, 9000], [1, 301, 1, 64]
    interpreter = device.type != "cuda"
    scheduled = sum(new_tokens)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for fp8 in (False, True):
            results = {}
            for backend in ("torch", "triton"):
                step = synthetic_step(contexts, new_tokens, step_sizes(args, fp8, pool), dtype=dtype, device=device,
                                      padding=3)
                with step_backend(backend, interpreter), torch.no_grad():
                    output = step.run()
                    selected = step_selection(step)  # what the step selected: after its writes, as it ran
                results[backend] = (output[:scheduled], selected[:scheduled], step.caches)
            (expected, expected_selection, expected_caches), (got, selection, caches) = results["torch"], \
                results["triton"]
            if fp8:  # packed bytes: the share of keys (rows) whose bytes differ at all
                pooled_difference = (caches.pooled_keys != expected_caches.pooled_keys).any(-1).float().mean().item()
            else:
                pooled_difference = relative_error(caches.pooled_keys, expected_caches.pooled_keys)
            # The output where both paths selected the same windows: in bfloat16 the pooled keys the step wrote
            # differ in rounding, and a near-tie of two windows' scores may then go the other way.
            same = (selection == expected_selection).all(-1)
            rows.append({
                "dtype": dtype, "fp8_index_keys": fp8, "pool": pool,
                "output_error": relative_error(got[same], expected[same]) if same.any() else float("inf"),
                "selection_identical_fraction": same.float().mean().item(),
                "pooled_keys_difference": pooled_difference,
                "main_cache_equal": torch.equal(caches.main, expected_caches.main),
                "ring_equal": torch.equal(caches.open_window, expected_caches.open_window),
            })
    return rows


def write_into(target, source, path: str = "step") -> None:
    """Copy every tensor of `source` into the tensor of the same shape at the same place of `target` (dataclasses,
    dicts, lists and tuples walked alike); every other value must be equal. What a CUDA graph captured on `target`
    replays is then `source`'s batch, as vLLM writes each step's batch into the buffers its graphs were captured on."""
    if isinstance(target, torch.Tensor):
        if target.shape != source.shape or target.dtype != source.dtype:
            raise ValueError(f"{path}: captured {tuple(target.shape)} {target.dtype}, new {tuple(source.shape)} "
                             f"{source.dtype}: a graph cannot replay this batch")
        target.copy_(source)
    elif dataclasses.is_dataclass(target):
        for field in dataclasses.fields(target):
            write_into(getattr(target, field.name), getattr(source, field.name), f"{path}.{field.name}")
    elif isinstance(target, dict):
        if target.keys() != source.keys():
            raise ValueError(f"{path}: keys {sorted(target)} captured, {sorted(source)} new")
        for key in target:
            write_into(target[key], source[key], f"{path}[{key!r}]")
    elif isinstance(target, (list, tuple)):
        if len(target) != len(source):
            raise ValueError(f"{path}: {len(target)} entries captured, {len(source)} new")
        for index, (old, new) in enumerate(zip(target, source)):
            write_into(old, new, f"{path}[{index}]")
    elif target != source:
        raise ValueError(f"{path}: {target!r} captured, {source!r} new: a graph cannot replay this batch")


def replay_batches(args) -> tuple[list[int], list[int]]:
    """Contexts of the captured decode batch and of a new one: other requests in every slot (other lengths, other
    blocks, caches and inputs), the same number of blocks and the same longest request (the shapes a graph keeps)."""
    block = args.block_size
    blocks = [13, 2, 7, 1, 16, 5] if args.smoke else [240, 36, 128, 17, 512, 80]
    captured = [count * block - 1 for count in blocks]  # each request's new token ends its last block
    new = [captured[(index + 2) % len(captured)] - 1 - 2 * (index % 5) for index in range(len(captured))]
    new[new.index(max(new))] = max(captured)  # the longest request as long as the captured one
    return captured, new


def check_graph_replay(device, args) -> dict:
    """A decode step of 6 requests and 2 padding tokens (vLLM pads a batch to a captured size), captured in a CUDA
    graph; then a new batch written into the captured step's tensors (`write_into`) and the graph replayed, against
    an eager step on that batch: outputs and caches bit for bit. Without CUDA, the captured step runs eagerly on the
    written tensors (whether the step reads nothing but its tensors; no graph)."""
    from hybrid_indexpool.serving.synthetic_step import synthetic_step

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    captured_contexts, new_contexts = replay_batches(args)
    max_model_len = 2 * (max(captured_contexts) + 1)  # the model's length: beyond the batch's
    build = functools.partial(synthetic_step, new_tokens=[1] * len(captured_contexts), sizes=step_sizes(args),
                              dtype=dtype, device=device, padding=2, full_graphs=True, max_model_len=max_model_len)
    captured, new = build(captured_contexts, seed=1), build(new_contexts, seed=2)
    scheduled = len(new_contexts)
    with step_backend("triton", device.type != "cuda"), torch.no_grad():
        if device.type == "cuda":
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: compilation and allocations out of the capture
                    captured.run()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                replayed = captured.run()
            write_into(captured, new)
            expected = new.run()
            graph.replay()
            torch.cuda.synchronize()
        else:
            captured.run()
            write_into(captured, new)
            expected, replayed = new.run(), captured.run()
    return {"contexts": new_contexts, "output_equal": torch.equal(replayed[:scheduled], expected[:scheduled]),
            "output_error": relative_error(replayed[:scheduled], expected[:scheduled]),
            "caches_equal": all(torch.equal(getattr(captured.caches, name), getattr(new.caches, name))
                                for name in ("main", "pooled_keys", "open_window")),
            "graph": device.type == "cuda"}


def graph_replay_ms(fn, device, repeats: int) -> float:
    """Median milliseconds of a CUDA-graph replay of `fn` (captured after a warm-up), the L2 cache flushed before
    each replay so that every byte comes from memory; eager calls (`timed`) without CUDA."""
    if device.type != "cuda":
        return timed(fn, device, repeats)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device)
    samples = []
    for _ in range(repeats):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def bench_step_decode(device, args, context: int, batch: int, pool: int, copy_bandwidth: float) -> dict:
    """One decode step of `batch` requests at `context` tokens (the model's length: full graphs score every window a
    request can reach) through the paged kernels, timed from CUDA-graph replays; what it reads (the visible pooled
    keys, the budget's keys and values) against the copy bandwidth; and the memory its caches took to fill."""
    from hybrid_indexpool.serving.synthetic_step import synthetic_step

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sizes = step_sizes(args, pool=pool)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    step = synthetic_step([context - 1] * batch, [1] * batch, sizes, dtype=dtype, device=device, seed=context,
                          full_graphs=True)
    caches = step.caches
    cache_bytes = sum(_nbytes(t) for t in (caches.main, caches.pooled_keys, caches.open_window))
    row = {"context": context, "batch": batch, "pool": pool, "cache_bytes": cache_bytes}
    if device.type == "cuda":
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before
        row["fill_transient_bytes"] = torch.cuda.max_memory_allocated() - before - held
    with step_backend("triton", device.type != "cuda"), torch.no_grad():
        row["step_ms"] = graph_replay_ms(step.run, device, 20 if device.type == "cuda" else 1)
    pooled = caches.pooled_keys
    element = torch.empty((), dtype=dtype).element_size()
    row["bytes"] = batch * (context // pool) * pooled.shape[-1] * pooled.element_size() + \
        batch * args.kv_heads * (args.topk + pool - 1) * 2 * args.head_dim * element
    row["copy_fraction"] = row["bytes"] / (row["step_ms"] / 1e3) / copy_bandwidth
    del step, caches, pooled
    return row


def step_work(contexts: list[int], new_tokens: list[int], full_graphs: bool, max_model_len: int, topk: int) -> dict:
    """Rows and scores the selection of one step computes (`selection_work`), built by the plugin's metadata builder
    for an engine of `max_model_len` tokens (no kernel runs: tiny widths, on the CPU), against the windows the step's
    queries see."""
    from hybrid_indexpool.serving.paged_step import selection_work
    from hybrid_indexpool.serving.synthetic_step import StepSizes, synthetic_step

    sizes = StepSizes(heads=1, kv_heads=1, head_dim=8, index_heads=1, index_head_dim=8, topk=topk)
    step = synthetic_step(contexts, new_tokens, sizes, dtype=torch.float32, full_graphs=full_graphs,
                          max_model_len=max_model_len)
    visible = sum((position + 1) // sizes.pool_size for context, count in zip(contexts, new_tokens)
                  for position in range(context, context + count))
    return {**selection_work(step.main, step.settings.topk_windows), "visible": visible,
            "tokens": sum(new_tokens), "prefill_requests": sum(count > 1 for count in new_tokens)}


STEP_WORK_CASES = {  # name -> (contexts, new tokens, full graphs): vLLM's GPU defaults, max_model_len 1M, r = 4
    "8K prefill chunk": ([0], [8192], True),
    "64 decodes at 8K (no full graph)": ([8192] * 64, [1] * 64, False),
    "63 decodes at 8K + 2K chunk": ([8192] * 63 + [0], [1] * 63 + [2048], True),
}


def paged_step_section(device, args, report, verdicts):
    """Section 6 (see the module's docstring)."""
    from hybrid_indexpool.serving.paged_step import QUERY_TILE

    on_gpu = device.type == "cuda"
    print("\n6. the vLLM plugin's batched step over paged caches: Triton against PyTorch, CUDA graph, decode bandwidth")
    report["paged_step_checks"] = []
    for pool in POOLS:
        with verdicts.section(f"paged step r={pool}"):
            for row in check_paged_step(device, args, pool):
                report["paged_step_checks"].append(row)
                dtype, fp8 = row["dtype"], row["fp8_index_keys"]
                name = f"paged step {DTYPE_NAMES[dtype]} r={pool}{' fp8 keys' if fp8 else ''}"
                print(f"  {name:<32} output error {row['output_error']:.3g}  selections identical "
                      f"{row['selection_identical_fraction']:.3f}  pooled keys {'differing' if fp8 else 'error'} "
                      f"{row['pooled_keys_difference']:.3g}  main/ring caches equal "
                      f"{row['main_cache_equal']}/{row['ring_equal']}")
                pooled_limit = (FP8_KEYS_DIFFERING if fp8 else KERNEL_ERROR)[dtype]
                verdicts.check(
                    name, row["output_error"] <= KERNEL_ERROR[dtype]
                    and row["selection_identical_fraction"] >= SELECTIONS_IDENTICAL[dtype]
                    and row["pooled_keys_difference"] <= pooled_limit and row["main_cache_equal"]
                    and row["ring_equal"],
                    f"err {row['output_error']:.2g}, sel {row['selection_identical_fraction']:.3f}, "
                    f"keys {row['pooled_keys_difference']:.2g}",
                    f"err<={KERNEL_ERROR[dtype]:g} sel>={SELECTIONS_IDENTICAL[dtype]:g} keys<={pooled_limit:g} "
                    "caches equal")

    name = "new batch replayed = eager step"
    with verdicts.section(name):
        row = report["graph_replay"] = check_graph_replay(device, args)
        print(f"  {name}: output equal {row['output_equal']} (error {row['output_error']:.3g}), caches equal "
              f"{row['caches_equal']}" + ("" if row["graph"] else " (no CUDA: the captured step rerun eagerly)"))
        measured = f"output equal {row['output_equal']}, caches equal {row['caches_equal']}"
        if not (row["output_equal"] and row["caches_equal"]):
            verdicts.check(name, False, measured, "bit for bit")
        elif row["graph"]:
            verdicts.check(name, True, measured, "bit for bit")
        else:
            verdicts.skip(name, "no CUDA graph without a GPU (the buffers, rerun eagerly, are equal)", "bit for bit")

    print(f"  selection work per step (max_model_len 1M, r = 4, budget {GPU_TOPK} tokens; QUERY_TILE {QUERY_TILE})")
    report["step_work"] = {}
    for name, (contexts, new_tokens, full_graphs) in STEP_WORK_CASES.items():
        with verdicts.section(f"scores: {name}"):
            work = report["step_work"][name] = step_work(contexts, new_tokens, full_graphs, 1 << 20, GPU_TOPK)
            row_limit = work["tokens"] + QUERY_TILE * work["prefill_requests"]
            print(f"    {name:<34} rows {work['rows']:>7,} (limit {row_limit:,})  scores {work['scores']:>13,}  "
                  f"visible windows {work['visible']:,} ({work['scores'] / work['visible']:.2f}x)")
            verdicts.check(f"scores: {name}", work["scores"] <= 2 * work["visible"] and work["rows"] <= row_limit,
                           f"{work['scores'] / work['visible']:.2f}x visible, {work['rows']:,} rows",
                           f"<=2x visible, rows<={row_limit:,}")

    copy_bandwidth = report.get("copy_bandwidth") or measured_copy_bandwidth(device)
    report["copy_bandwidth"] = copy_bandwidth
    print(f"  decode step from {'CUDA-graph replays' if on_gpu else 'eager calls (no CUDA)'}, copy bandwidth "
          f"{copy_bandwidth / 1e9:.0f} GB/s")
    header = ("context", "batch", "r", "step ms", "MB read", "% copy bw", "r=1 / r=4", "cache GB", "fill extra GB")
    print("  " + "".join(f"{h:>13}" for h in header))
    report["step_decode"] = []
    contexts = [int(c) for c in args.step_contexts.split(",")]
    for context in contexts:
        for batch in (int(b) for b in args.step_batches.split(",")):
            rows = {}
            for pool in (4, 1):
                with verdicts.section(f"decode step {context:,} x {batch} r={pool}"):
                    rows[pool] = bench_step_decode(device, args, context, batch, pool, copy_bandwidth)
                    report["step_decode"].append(rows[pool])
            if not rows:
                continue
            for pool, row in rows.items():
                speedup = rows[1]["step_ms"] / rows[4]["step_ms"] if len(rows) == 2 and pool == 1 else None
                transient = row.get("fill_transient_bytes")
                cells = (f"{context:,}", batch, pool, f"{row['step_ms']:.3f}", f"{row['bytes'] / 1e6:.1f}",
                         f"{100 * row['copy_fraction']:.0f}%", "-" if speedup is None else f"{speedup:.2f}x",
                         f"{row['cache_bytes'] / 1e9:.2f}", "-" if transient is None else f"{transient / 1e9:.2f}")
                print("  " + "".join(f"{c:>13}" for c in cells))
            if 4 in rows:
                row = rows[4]
                name = f"decode bandwidth {context:,} x {batch}"
                measured = f"{100 * row['copy_fraction']:.0f}% of copy"
                if on_gpu:
                    verdicts.check(name, row["copy_fraction"] >= BANDWIDTH_TARGET, measured,
                                   f">={100 * BANDWIDTH_TARGET:.0f}% of copy")
                else:
                    verdicts.skip(name, f"no GPU ({measured} on the CPU)", f">={100 * BANDWIDTH_TARGET:.0f}% of copy")
            if len(rows) == 2 and context == max(contexts):
                speedup = rows[1]["step_ms"] / rows[4]["step_ms"]
                name = f"r=4 vs r=1 decode {context:,} x {batch}"
                if on_gpu:
                    verdicts.check(name, speedup >= HEADLINE_TARGET, f"{speedup:.2f}x", f">={HEADLINE_TARGET:g}x")
                else:
                    verdicts.skip(name, f"no GPU ({speedup:.2f}x on the CPU)", f">={HEADLINE_TARGET:g}x")
            largest = max(rows.values(), key=lambda row: row["cache_bytes"])
            name = f"cache fill transient {context:,} x {batch}"
            if "fill_transient_bytes" in largest:
                transient = largest["fill_transient_bytes"]
                verdicts.check(name, transient <= FILL_TRANSIENT * largest["cache_bytes"],
                               f"{transient / 1e9:.2f} GB over {largest['cache_bytes'] / 1e9:.2f} GB",
                               f"<={FILL_TRANSIENT:g} x caches")
            else:
                verdicts.skip(name, "no CUDA allocator statistics without a GPU", f"<={FILL_TRANSIENT:g} x caches")


PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"


@dataclasses.dataclass
class Verdict:
    """One row of the verdict table."""

    check: str
    status: str  # PASS, FAIL or SKIP
    measured: str
    target: str


class VerdictTable:
    """The checks against their thresholds, and the run's exit status: 1 on any FAIL, and on a GPU on any SKIP too
    (there every check must run); 0 otherwise. A section that raises is a FAIL row, and the run goes on."""

    def __init__(self, on_gpu: bool):
        self.on_gpu = on_gpu
        self.rows: list[Verdict] = []

    def check(self, check: str, passed: bool, measured: str, target: str) -> None:
        self.rows.append(Verdict(check, PASS if passed else FAIL, measured, target))

    def skip(self, check: str, reason: str, target: str) -> None:
        self.rows.append(Verdict(check, SKIP, reason, target))

    @contextlib.contextmanager
    def section(self, check: str):
        """Run a section: an exception in it is printed and recorded as a FAIL of `check`."""
        try:
            yield
        except Exception as error:  # any error is a verdict, not the end of the run
            traceback.print_exc()
            self.check(check, False, f"{type(error).__name__}: {error}"[:160], "runs without error")

    def failures(self) -> list[Verdict]:
        return [row for row in self.rows if row.status == FAIL or (self.on_gpu and row.status == SKIP)]

    def exit_status(self) -> int:
        return 1 if self.failures() or not self.rows else 0

    def format(self) -> str:
        widths = [max(len(getattr(row, field)) for row in [Verdict("check", "verdict", "measured", "target"),
                                                            *self.rows]) for field in ("check", "status", "measured")]
        lines = ["  ".join([f"{'check':<{widths[0]}}", f"{'verdict':<{widths[1]}}", f"{'measured':<{widths[2]}}",
                            "target"])]
        lines += ["  ".join([f"{row.check:<{widths[0]}}", f"{row.status:<{widths[1]}}",
                             f"{row.measured:<{widths[2]}}", row.target]) for row in self.rows]
        failures = self.failures()
        skipped = sum(row.status == SKIP for row in self.rows)
        if not self.rows:
            lines.append("FAIL: no check ran")
        elif failures:
            rule = " (a SKIP on a GPU is a failure)" if self.on_gpu and skipped else ""
            lines.append(f"FAIL: {len(failures)} of {len(self.rows)} checks{rule}")
        else:
            lines.append(f"PASS: {len(self.rows) - skipped} checks passed, {skipped} skipped (no GPU)"
                         if skipped else f"PASS: all {len(self.rows)} checks")
        return "\n".join(lines)


def kernel_section(device, args, kernels, report, verdicts):
    """Section 1: every kernel against the PyTorch reference, per dtype and pool size."""
    print("\n1. kernels against the PyTorch reference (relative errors)")
    report["checks"] = {}
    for dtype in (torch.float32, torch.bfloat16):
        for pool in POOLS:
            name = f"kernels {DTYPE_NAMES[dtype]} r={pool}"
            with verdicts.section(name):
                checks = report["checks"][f"{dtype} r={pool}"] = check_kernels(device, args, kernels, dtype, pool)
                print(f"  {name:<20} " + "  ".join(f"{k} {v:.3g}" for k, v in checks.items()))
                verdicts.check(
                    name, checks["topk_identical_fraction"] >= SELECTIONS_IDENTICAL[dtype]
                    and max(checks["attention_error"], checks["split_decode_error"]) <= KERNEL_ERROR[dtype]
                    and checks["attention_grad_error"] <= GRAD_ERROR[dtype],
                    f"sel {checks['topk_identical_fraction']:.3f}, err {checks['attention_error']:.2g}/"
                    f"{checks['split_decode_error']:.2g}, grad {checks['attention_grad_error']:.2g}",
                    f"sel>={SELECTIONS_IDENTICAL[dtype]:g} err<={KERNEL_ERROR[dtype]:g} grad<={GRAD_ERROR[dtype]:g}")


def main(argv=None) -> int:
    """Run the check, print its tables and verdict table; the report (`exit_status`: what the command exits with)."""
    began = time.perf_counter()
    args = parse_arguments(argv)
    device = None
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":  # Triton reads it when the kernels are first imported
            exit_with_error("--smoke runs the kernels in Triton's interpreter: run it with TRITON_INTERPRET=1 set.")
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    elif not args.offline:
        exit_with_error("check_gpu needs a CUDA device (--offline: only the tables that need none; --smoke: a CPU "
                        "run of the script itself).")
    from hybrid_indexpool.kernels.pooled_index_topk import pooled_index_topk_torch, pooled_index_topk_triton
    from hybrid_indexpool.kernels.sparse_attention import sparse_attention_torch, sparse_attention_triton

    if pooled_index_topk_triton is None or sparse_attention_triton is None:
        exit_with_error("Triton is not installed: pip install triton (or the project with '.[triton]').")
    kernels = {"topk_torch": pooled_index_topk_torch, "topk_triton": pooled_index_topk_triton,
               "attention_torch": sparse_attention_torch, "attention_triton": sparse_attention_triton}
    import triton

    if device is None:
        name = "none (--offline)"
    else:
        name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (Triton interpreter)"
    mode = "smoke" if args.smoke else "quick" if args.quick else "offline" if args.offline else "full"
    print(f"device: {name}; torch {torch.__version__}, Triton {triton.__version__}; mode {mode}")
    report = {"device": name, "settings": vars(args)}
    verdicts = VerdictTable(on_gpu=device is not None and device.type == "cuda")
    if device is not None:
        kernel_section(device, args, kernels, report, verdicts)
        if not args.quick:
            with verdicts.section("decode and prefill tables"):
                measured_sections(device, args, kernels, report)
    with verdicts.section("decode traffic table"):
        traffic_section(args, kernels, report)
    report["aot"] = []
    if args.quick or (args.aot == "none" and not args.smoke):
        print("\n5. compiled resources: not run (--quick or --aot none)")
    else:
        print("\n5. registers / shared memory (bytes) / spills (4-byte words), compiled for sm_80 and sm_90")
        with verdicts.section("AOT compile"):
            report["aot"] = aot_resources(args)
            verdicts.check("AOT compile sm_80/sm_90", all(row.spills == 0 and row.shared <= row.shared_limit
                                                           for row in report["aot"]),
                           f"{len(report['aot'])} kernels compiled", "no spills, shared memory within the limit")
    if device is not None:
        paged_step_section(device, args, report, verdicts)
    seconds = time.perf_counter() - began
    limit = QUICK_SECONDS if args.quick else FULL_SECONDS
    if verdicts.on_gpu:
        verdicts.check("run time", seconds <= limit, f"{seconds:.0f} s", f"<={limit} s")
    print(f"\nverdict ({mode}, {seconds:.0f} s, {name}):\n{verdicts.format()}")
    report["verdicts"] = [dataclasses.asdict(row) for row in verdicts.rows]
    report["exit_status"] = verdicts.exit_status()
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2, default=lambda value: getattr(value, "__dict__", str(value)))
    return report


if __name__ == "__main__":
    raise SystemExit(main()["exit_status"])
