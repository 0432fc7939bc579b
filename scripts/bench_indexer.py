"""The decode indexer step alone against the memory bandwidth: one query of `--index-heads` heads scored against N
pooled keys and the top-k windows selected, by the compiled CPU kernel (`pooled_index_topk`'s CPU path) and by the
PyTorch reference (`pooled_index_topk_torch`), side by side, per thread count and key storage: float32, bfloat16, or
`fp8` (packed fp8 keys of `kernels.fp8_index_keys`: d fp8 bytes and a float32 scale per key, made by
`quantize_pooled_keys` from the same float32 keys). With both bf16 and fp8 keys, the last column is bf16's time over
fp8's (the speed-up fp8 keys bring to the step).

The bandwidth is a 512 MiB in-memory copy's (bytes read + bytes written per second) measured with the same thread
count just before; "% of copy bandwidth" is the bytes of pooled keys read per second over it, the measure the decode
benchmark's indexer column uses. Median of `--repeats` runs.

    python -m hybrid_indexpool.scripts.bench_indexer --windows 262144,1048576 --threads 1,2 \\
        --dtypes float32,bfloat16,fp8
"""

import argparse
import json
import os
import platform

import torch
from tqdm import tqdm

from hybrid_indexpool.benchmarking import copy_bandwidth, median_seconds

# Key storages: a torch dtype's name, or fp8 for packed fp8 keys.
KEY_STORAGES = ("float32", "bfloat16", "fp8")


def make_keys(windows: int, head_dim: int, storage: str, generator: torch.Generator) -> torch.Tensor:
    """`[1, windows, head_dim]` random pooled keys in `storage`; fp8: packed `uint8 [1, windows, head_dim + 4]`."""
    keys = torch.randn(1, windows, head_dim, generator=generator)
    if storage == "fp8":
        from hybrid_indexpool.kernels.fp8_index_keys import quantize_pooled_keys

        # In chunks: the quantisation's float32 temporaries of a 4M-window store would take gigabytes at once.
        return torch.cat([quantize_pooled_keys(chunk) for chunk in keys.split(1 << 16, dim=1)], dim=1)
    return keys.to(getattr(torch, storage))


def measure(windows: int, storage: str, args) -> dict:
    """The kernel's and the reference's step over `windows` pooled keys, with the current thread count."""
    from hybrid_indexpool.kernels.pooled_index_topk import cpu_impl, pooled_index_topk, pooled_index_topk_torch

    generator = torch.Generator().manual_seed(windows)
    keys = make_keys(windows, args.index_head_dim, storage, generator)
    query = torch.randn(1, 1, args.index_heads, args.index_head_dim, generator=generator)
    head_weights = torch.randn(1, 1, args.index_heads, generator=generator) if args.head_weights else None
    visible = torch.tensor([[windows]])
    topk = args.topk_windows
    if not cpu_impl.fused_topk_applies(args.index_heads, keys):
        reason = cpu_impl.KERNEL.error or "turned off or backend forced"
        raise RuntimeError(f"The CPU kernel does not serve this step ({reason}).")
    kernel = median_seconds(lambda: pooled_index_topk(query, keys, visible, topk, head_weights), args.repeats)
    reference = median_seconds(lambda: pooled_index_topk_torch(query, keys, visible, topk, head_weights),
                               args.repeats)
    same = torch.equal(pooled_index_topk(query, keys, visible, topk, head_weights),
                       pooled_index_topk_torch(query, keys, visible, topk, head_weights))
    key_bytes = keys.numel() * keys.element_size()
    return {"windows": windows, "dtype": storage, "key_bytes": key_bytes,
            "kernel_ms": kernel * 1e3, "reference_ms": reference * 1e3, "same_selection": same}


def run(args) -> dict:
    results = []
    dtypes = args.dtypes.split(",")
    caller_threads = torch.get_num_threads()
    try:
        for threads in (int(value) for value in args.threads.split(",")):
            torch.set_num_threads(threads)
            bandwidth = copy_bandwidth()
            for windows in tqdm([int(value) for value in args.windows.split(",")], desc=f"{threads} threads"):
                for dtype in dtypes:
                    row = measure(windows, dtype, args)
                    row.update(threads=threads, copy_bytes_per_second=bandwidth)
                    for path in ("kernel", "reference"):
                        row[f"{path}_bandwidth_fraction"] = row["key_bytes"] / (row[f"{path}_ms"] / 1e3) / bandwidth
                    results.append(row)
    finally:  # the caller's thread count as it was (tests call run in-process)
        torch.set_num_threads(caller_threads)
    add_fp8_speedups(results)
    return {"machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                        "cpu_count": os.cpu_count(), "torch": torch.__version__},
            "settings": vars(args), "results": results}


def add_fp8_speedups(results: list[dict]) -> None:
    """Give each fp8 row measured beside a bfloat16 one (same threads and windows) bf16 time / fp8 time, for the
    kernel and the reference."""
    bf16 = {(row["threads"], row["windows"]): row for row in results if row["dtype"] == "bfloat16"}
    for row in results:
        other = bf16.get((row["threads"], row["windows"]))
        if row["dtype"] == "fp8" and other is not None:
            for path in ("kernel", "reference"):
                row[f"{path}_bf16_over_fp8"] = other[f"{path}_ms"] / row[f"{path}_ms"]


def format_table(report: dict) -> str:
    lines = ["| threads | windows | keys | key MiB | copy GB/s | kernel ms | % of copy bandwidth | reference ms | "
             "% of copy bandwidth | reference / kernel | same selection | bf16 / fp8 kernel | bf16 / fp8 reference |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in report["results"]:
        speedups = " | ".join(f"{row[key]:.2f}x" if key in row else "-"
                              for key in ("kernel_bf16_over_fp8", "reference_bf16_over_fp8"))
        lines.append(
            f"| {row['threads']} | {row['windows']:,} | {row['dtype']} | {row['key_bytes'] / 2**20:,.0f} | "
            f"{row['copy_bytes_per_second'] / 1e9:.1f} | {row['kernel_ms']:.2f} | "
            f"{row['kernel_bandwidth_fraction']:.0%} | "
            f"{row['reference_ms']:.2f} | {row['reference_bandwidth_fraction']:.0%} | "
            f"{row['reference_ms'] / row['kernel_ms']:.1f}x | {'yes' if row['same_selection'] else 'NO'} | "
            f"{speedups} |")
    return "\n".join(lines)


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", default="262144,1048576",
                        help="comma-separated pooled key counts (1M tokens at r = 4 is 262,144 windows)")
    parser.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    parser.add_argument("--dtypes", default="float32",
                        help="comma-separated key storages: float32, bfloat16, fp8 (packed fp8 keys)")
    parser.add_argument("--index-heads", type=int, default=4)
    parser.add_argument("--index-head-dim", type=int, default=128)
    parser.add_argument("--topk-windows", type=int, default=512, help="windows kept (budget 2048 tokens at r = 4)")
    parser.add_argument("--head-weights", action="store_true", help="per-query head weights instead of all ones")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", help="write the report to this file")
    args = parser.parse_args(argv)
    for name in ("windows", "threads"):
        if any(int(value) <= 0 for value in getattr(args, name).split(",")):
            parser.error(f"--{name} must be positive integers")
    unknown = set(args.dtypes.split(",")) - set(KEY_STORAGES)
    if unknown:
        parser.error(f"--dtypes takes {', '.join(KEY_STORAGES)}, not {sorted(unknown)}")
    if "fp8" in args.dtypes.split(",") and args.index_head_dim & (args.index_head_dim - 1):
        parser.error("fp8 keys need a power-of-two --index-head-dim (the Walsh-Hadamard rotation)")
    return args


def main(argv=None) -> dict:
    args = parse_arguments(argv)
    report = run(args)
    print(format_table(report))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=1)
    return report


if __name__ == "__main__":
    main()
