"""GPU check of the IndexPool kernels: correctness against the PyTorch reference, benchmark tables, the bytes and
launches of a decode step, and the kernels' registers / shared memory / spills compiled for sm_80 and sm_90.

On a CUDA machine (about 5-10 minutes on an H100/H200), at Qwen3.8-Flash-Next sizes by default (16 query heads, 2
key/value heads of dim 256, 16 index heads of dim 128, budget 2048 tokens):

    python -m hybrid_indexpool.scripts.check_gpu            # add --json results.json to keep the numbers

1. Kernel vs reference in float32 and bfloat16: identical selections (float32), selection agreement (bfloat16),
   output and gradient errors of the sparse attention, split decode against one program per query.
2. Decode step of one IndexPool layer's kernels (index top-k + sparse attention) at 32K-1M tokens of context:
   pooled r = 4 against r = 1 against dense attention over every key, same widths; achieved memory bandwidth of the
   index step and of the sparse attention as a fraction of the device's peak (a large device copy measures what the
   device actually reaches; the nominal peak is listed where known).
3. Prefill throughput of the kernels at 32K tokens.
4. Bytes and launches of one decode step (per layer, batch 1), counted on meta tensors: every PyTorch operator's
   inputs and outputs, and what each Triton kernel must read and write by design; against the minimum (the visible
   pooled keys read once and the selected keys/values read once).
5. Registers / shared memory / spills of every kernel compiled ahead of time for sm_80 and sm_90 (`kernels/aot.py`;
   no GPU needed, so this runs anywhere).
6. The vLLM plugin's batched step over paged caches (`serving/paged_step.py`, no vLLM needed): its Triton kernels
   (paged scoring + top-k, pooled-key write, paged sparse attention) against its PyTorch path on a mixed step of
   prefill chunks and decodes (float32 and bfloat16, pooled keys in the model's dtype and packed fp8); a decode step
   of `--step-batch` requests at 128K and 1M tokens of context, each part's achieved bandwidth as a fraction of the
   measured copy bandwidth; and that step captured in a CUDA graph and replayed (same output as eager, replay time).

`python -m hybrid_indexpool.scripts.check_gpu --offline` prints sections 4 and 5 at the real sizes on a machine
without a GPU. `TRITON_INTERPRET=1 python -m hybrid_indexpool.scripts.check_gpu --smoke` runs tiny sizes on the CPU
(kernels in Triton's interpreter, one configuration compiled ahead of time) to check the script itself.
"""

import argparse
import contextlib
import json
import os
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hybrid_indexpool.command_line import exit_with_error

NOMINAL_BANDWIDTH = {"H200": 4.8e12, "H100 SXM": 3.35e12, "H100 PCIe": 2.0e12, "H100": 3.35e12, "A100": 2.0e12}


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
                        help="contexts (tokens) of the vLLM step's decode benchmark (section 6)")
    parser.add_argument("--step-batch", type=int, default=8, help="requests of the vLLM step's decode benchmark")
    parser.add_argument("--block-size", type=int, default=256, help="vLLM's KV-cache block size (tokens)")
    parser.add_argument("--aot", choices=("default", "full", "none"), default="default",
                        help="configurations compiled ahead of time: the representative subset, the whole matrix "
                             "(about 20 minutes on 2 cores), or none")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on CPU, to test the script")
    parser.add_argument("--offline", action="store_true",
                        help="without a GPU: only the decode-step bytes and the compiled resources (sections 4-5)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.contexts, args.topk, args.index_heads, args.index_head_dim = "128,256", 32, 2, 16
        args.heads, args.kv_heads, args.head_dim, args.prefill = 4, 2, 16, 32
        args.step_contexts, args.step_batch, args.block_size = "256,512", 2, 16
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


def check_kernels(device, args, kernels, dtype) -> dict:
    """Selections and attention (with gradients) of the Triton kernels against the reference, one dtype."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    results = {}
    # Index top-k: a decode step and a prefill tile with left-padded rows.
    batch, heads, dim, topk = 2, args.index_heads, args.index_head_dim, args.topk // 4
    num_windows = 128 if args.smoke else 4096
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
    pool, kv_heads, group, head_dim = 4, args.kv_heads, args.heads // args.kv_heads, args.head_dim
    context, queries, windows = (8192, 64, args.topk // pool) if not args.smoke else (64, 6, 4)
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
    results["attention_max_error"] = (got.float() - expected).abs().max().item()
    results["attention_grad_max_error"] = max((g.float() - e).abs().max().item()
                                              for g, e in zip(got_grads, expected_grads))
    with torch.no_grad():
        split = kernels["attention_triton"](*tensors, *index_args, pool, head_dim**-0.5, num_splits=4)
        last = [t[:, :, -1:] for t in tensors[:1]] + tensors[1:]  # a decode step, default splits
        step = kernels["attention_triton"](*last, *(t[:, -1:] for t in index_args), pool, head_dim**-0.5)
    results["split_decode_max_error"] = max((split.float() - expected.detach()).abs().max().item(),
                                            (step.float() - expected[:, -1:].detach()).abs().max().item())
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
    """Sections 1-3: run the kernels (on the GPU, or in the interpreter for --smoke)."""
    name = report["device"]
    print("\n1. kernels against the PyTorch reference")
    report["checks"] = {}
    for dtype in (torch.float32, torch.bfloat16):
        checks = check_kernels(device, args, kernels, dtype)
        report["checks"][str(dtype)] = checks
        print(f"  {str(dtype):<15} " + "  ".join(f"{k} {v:.3g}" for k, v in checks.items()))

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


def step_sizes(args, fp8_index_keys: bool = False):
    from hybrid_indexpool.serving.synthetic_step import StepSizes

    return StepSizes(heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, index_heads=args.index_heads,
                     index_head_dim=args.index_head_dim, pool_size=4, topk=args.topk, block_size=args.block_size,
                     fp8_index_keys=fp8_index_keys)


def step_selection(step):
    """The windows the step selects for each of its tokens (the scoring + top-k entry on the step's tensors)."""
    from hybrid_indexpool.kernels.pooled_index_topk import paged_pooled_index_topk

    main, pooled = step.metadata["main"], step.metadata["pooled_keys"]
    return torch.cat([paged_pooled_index_topk(
        step.inputs["index_queries"], step.caches.pooled_keys, pooled.block_table, tiles.tile_tokens,
        tiles.tile_request, None, main.num_visible_windows, tiles.window_bound, step.settings.topk_windows,
        step.inputs["head_weights"]) for tiles in main.selection_tiles])[main.token_tile]


def check_paged_step(device, args) -> list[dict]:
    """Triton against the PyTorch path on one mixed step (prefill chunks inside windows, decodes, padding): output,
    written caches and selections, per dtype and pooled-key storage."""
    from hybrid_indexpool.serving.synthetic_step import synthetic_step

    if args.smoke:
        contexts, new_tokens = [150, 37, 9, 260], [1, 22, 1, 5]
    else:
        contexts, new_tokens = [20000, 3001, 600, 9000], [1, 301, 1, 64]
    interpreter = device.type != "cuda"
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for fp8 in (False, True):
            results = {}
            for backend in ("torch", "triton"):
                step = synthetic_step(contexts, new_tokens, step_sizes(args, fp8), dtype=dtype, device=device,
                                      padding=3)
                with step_backend(backend, interpreter), torch.no_grad():
                    selected = step_selection(step)
                    output = step.run()
                results[backend] = (output[:sum(new_tokens)].float(), selected[:sum(new_tokens)], step.caches)
            (expected, expected_selection, expected_caches), (got, selection, caches) = results["torch"], \
                results["triton"]
            if fp8:  # packed bytes: the share of keys (rows) whose bytes differ at all
                pooled_difference = (caches.pooled_keys != expected_caches.pooled_keys).any(-1).float().mean()
            else:
                pooled_difference = (caches.pooled_keys.float() - expected_caches.pooled_keys.float()).abs().max()
            rows.append({
                "dtype": str(dtype), "fp8_index_keys": fp8,
                "output_max_error": (got - expected).abs().max().item(),
                "selection_identical_fraction": (selection == expected_selection).all(-1).float().mean().item(),
                "pooled_keys_difference": pooled_difference.item(),
                "main_cache_equal": torch.equal(caches.main, expected_caches.main),
                "ring_equal": torch.equal(caches.open_window, expected_caches.open_window),
            })
    return rows


def bench_paged_decode(device, args, context: int, copy_bandwidth: float) -> dict:
    """One decode step of `--step-batch` requests at `context` tokens through the paged Triton kernels: milliseconds
    of the whole step, of its scoring + top-k and of its sparse attention, and what each reads against the copy
    bandwidth; with CUDA, the step captured in a CUDA graph and replayed."""
    from hybrid_indexpool.kernels.sparse_attention import paged_sparse_attention
    from hybrid_indexpool.serving.synthetic_step import synthetic_step

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    batch, sizes = args.step_batch, step_sizes(args)
    step = synthetic_step([context - 1] * batch, [1] * batch, sizes, dtype=dtype, device=device, seed=context,
                          full_graphs=True)
    main = step.main
    repeats = 20 if device.type == "cuda" else 1
    element = torch.empty((), dtype=dtype).element_size()
    with step_backend("triton", device.type != "cuda"), torch.no_grad():
        selected = step_selection(step)
        head_dim = args.head_dim
        kv = step.caches.main
        row = {"context": context, "batch": batch,
               "step_ms": timed(step.run, device, repeats),
               "index_ms": timed(lambda: step_selection(step), device, repeats),
               "attention_ms": timed(lambda: paged_sparse_attention(
                   step.inputs["query"], kv[..., :head_dim], kv[..., head_dim:], main.block_table,
                   main.token_request, selected, main.token_position, sizes.pool_size, step.settings.scaling,
                   step.inputs["output_gate"]), device, repeats)}
        if device.type == "cuda":
            eager = step.run()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    step.run()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                replayed = step.run()
            graph.replay()
            torch.cuda.synchronize()
            row["graph_replay_equal"] = torch.equal(replayed, eager)
            row["graph_replay_ms"] = timed(graph.replay, device, repeats)
    row["index_bytes"] = batch * (context // sizes.pool_size) * step.caches.pooled_keys.shape[-1] * \
        step.caches.pooled_keys.element_size()
    row["attention_bytes"] = batch * args.kv_heads * (args.topk + sizes.pool_size - 1) * 2 * head_dim * element
    row["index_fraction"] = row["index_bytes"] / (row["index_ms"] / 1e3) / copy_bandwidth
    row["attention_fraction"] = row["attention_bytes"] / (row["attention_ms"] / 1e3) / copy_bandwidth
    row["step_fraction"] = (row["index_bytes"] + row["attention_bytes"]) / (row["step_ms"] / 1e3) / copy_bandwidth
    return row


def paged_step_section(device, args, report):
    """Section 6 (see the module's docstring)."""
    print("\n6. the vLLM plugin's batched step over paged caches: Triton against PyTorch, decode bandwidth, CUDA graph")
    report["paged_step_checks"] = check_paged_step(device, args)
    for row in report["paged_step_checks"]:
        print(f"  {row['dtype']:<15} fp8 keys {str(row['fp8_index_keys']):<6} output error "
              f"{row['output_max_error']:.3g}  selections identical {row['selection_identical_fraction']:.3f}  "
              f"pooled keys {'differing' if row['fp8_index_keys'] else 'max diff'} "
              f"{row['pooled_keys_difference']:.3g}  main/ring caches equal "
              f"{row['main_cache_equal']}/{row['ring_equal']}")
    copy_bandwidth = report.get("copy_bandwidth") or measured_copy_bandwidth(device)
    header = ("context", "batch", "step ms", "graph ms", "index ms", "attn ms", "index %copy", "attn %copy",
              "step %copy")
    print("  " + "".join(f"{h:>12}" for h in header))
    report["paged_step_decode"] = []
    for context in (int(c) for c in args.step_contexts.split(",")):
        row = bench_paged_decode(device, args, context, copy_bandwidth)
        report["paged_step_decode"].append(row)
        graph = f"{row['graph_replay_ms']:.3f}" if "graph_replay_ms" in row else "-"
        cells = (f"{context:,}", row["batch"], f"{row['step_ms']:.3f}", graph, f"{row['index_ms']:.3f}",
                 f"{row['attention_ms']:.3f}", f"{100 * row['index_fraction']:.0f}%",
                 f"{100 * row['attention_fraction']:.0f}%", f"{100 * row['step_fraction']:.0f}%")
        print("  " + "".join(f"{c:>12}" for c in cells))
    if device.type != "cuda":
        print("  (no CUDA device: the CUDA-graph capture and replay run on a GPU only)")


def main(argv=None):
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
        exit_with_error("Triton is not installed: pip install -e '.[triton]'.")
    kernels = {"topk_torch": pooled_index_topk_torch, "topk_triton": pooled_index_topk_triton,
               "attention_torch": sparse_attention_torch, "attention_triton": sparse_attention_triton}
    if device is None:
        name = "none (--offline)"
    else:
        name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (Triton interpreter)"
    print(f"device: {name}; torch {torch.__version__}")
    report = {"device": name, "settings": vars(args)}
    if device is not None:
        measured_sections(device, args, kernels, report)
    traffic_section(args, kernels, report)
    print("\n5. registers / shared memory (bytes) / spills (4-byte words), compiled for sm_80 and sm_90")
    report["aot"] = []
    if args.aot == "none" and not args.smoke:
        print("  (skipped: --aot none)")
    else:
        report["aot"] = aot_resources(args)
    if device is not None:
        paged_step_section(device, args, report)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2, default=lambda value: getattr(value, "__dict__", str(value)))
    return report


if __name__ == "__main__":
    main()
