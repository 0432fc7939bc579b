"""Ahead-of-time compilation of the Triton kernels for real GPUs, on a machine without one.

Triton's CPU interpreter (`TRITON_INTERPRET=1`, how the tests run the kernels without a GPU) ignores register and
shared-memory limits and accepts code the compiler rejects. This module compiles every kernel with Triton's own
compiler and `ptxas` (shipped in Triton's wheel) for sm_80 (A100) and sm_90 (H100/H200) at the model's real sizes and
reads what a launch would need: registers per thread, shared memory per block and register spills.

A kernel is compiled exactly as its launch would compile it: the entry points build a `Launch` (kernel, grid,
arguments, options) and run it; here the kernels' own planning functions (`aot_launches` of each `triton_impl`) are
called with tensors on the `meta` device (real shapes, no memory), and Triton's own argument binder turns the
arguments into the signature, constants and alignment attributes of the compilation.

The compilations run in worker processes started without `TRITON_INTERPRET` and without any other `TRITON_*`
variable that changes code generation: Triton decides at import time whether its functions (its standard library
too) are interpreted, so a process that imported it for the interpreter cannot compile. Triton's settings are its
defaults; the on-disk cache (`TRITON_CACHE_DIR`) is shared, so repeated configurations compile once.

Registers and spills are read from the cubin with `cuobjdump -res-usage`: the numbers the CUDA driver reports when
it loads a kernel (Triton's `n_regs`; its `n_spills` is the local memory per thread in 4-byte words). Shared memory
is `metadata.shared`, which Triton checks against the device's limit at launch.
"""

import contextlib
import functools
import multiprocessing
import os
import re
import subprocess
import tempfile
import traceback
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass

import torch

from .launch import Launch

# Largest shared memory one block may use (opt-in), by compute capability.
SHARED_MEMORY_LIMIT = {80: 166_912, 90: 232_448}
CAPABILITIES = (90, 80)
# The kernel modules compiled here (their `aot_launches` plan each kernel's launch on meta tensors).
INDEX_MODULES = ("hybrid_indexpool.kernels.pooled_index_topk.triton_impl",
                 "hybrid_indexpool.kernels.pooled_key_write.triton_impl")
ATTENTION_MODULE = "hybrid_indexpool.kernels.sparse_attention.triton_impl"
KERNEL_MODULES = (*INDEX_MODULES, ATTENTION_MODULE)
# Environment variables of Triton that are not code-generation settings and may stay while compiling.
_KEPT_VARIABLES = ("TRITON_CACHE_DIR", "TRITON_HOME", "TRITON_DEFAULT_FP_FUSION", "TRITON_PTXAS_PATH",
                   "TRITON_CUOBJDUMP_PATH", "TRITON_LIBDEVICE_PATH")


@dataclass
class KernelResources:
    """What one compiled kernel needs per block on one target. `key` identifies the compilation (Triton's
    specialisation of the launch); `config` describes it."""

    kernel: str
    mode: str
    config: str
    capability: int
    registers: int
    shared: int
    spills: int
    key: str

    @property
    def shared_limit(self) -> int:
        return SHARED_MEMORY_LIMIT[self.capability]


@contextlib.contextmanager
def compiler_environment():
    """The environment without Triton's code-generation variables (the interpreter's among them)."""
    saved = {name: value for name, value in os.environ.items()
             if name.startswith("TRITON_") and name not in _KEPT_VARIABLES}
    for name in saved:
        del os.environ[name]
    try:
        yield
    finally:
        os.environ.update(saved)


def _triton_tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def cubin_usage(cubin: bytes) -> tuple[int, int]:
    """(registers per thread, local memory bytes per thread) of a cubin's kernel, from `cuobjdump -res-usage`."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        report = subprocess.run([_triton_tool("cuobjdump"), "-res-usage", handle.name], check=True,
                                capture_output=True, text=True).stdout
    match = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", report)
    if match is None:
        raise RuntimeError(f"cuobjdump printed no resource usage:\n{report}")
    registers, stack, local = (int(group) for group in match.groups())
    return registers, max(stack, local)


def _specialise(launch: Launch, capability: int):
    """What `kernel[grid](*args)` does before compiling, for `sm_<capability>`: bind the arguments, specialise them
    (types, divisibility by 16, integers equal to 1) and pack (target, options, signature, constexprs, attrs)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel = launch.kernel
    if not isinstance(kernel, triton.runtime.JITFunction):
        raise RuntimeError("kernels imported for Triton's interpreter cannot be compiled: use compile_sizes")
    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.options)
    return (target, *kernel._pack_args(backend, dict(launch.options), bound, specialization, options))


def specialisation_key(launch: Launch, capability: int = 90) -> str:
    """The compilation a launch needs, as Triton's cache tells them apart: two launches with the same key share one
    compiled kernel."""
    _, options, signature, constexprs, attrs = _specialise(launch, capability)
    return repr((launch.kernel.__name__, sorted(options.__dict__.items()), signature, sorted(constexprs.items()),
                 sorted(attrs.items())))


def compile_launch(launch: Launch, capability: int):
    """Compile `launch`'s kernel for `sm_<capability>` as its launch would; returns the compiled kernel."""
    import triton
    from triton.compiler import ASTSource

    target, options, signature, constexprs, attrs = _specialise(launch, capability)
    return triton.compile(ASTSource(launch.kernel, signature, constexprs, attrs), target=target,
                          options=options.__dict__)


def launch_resources(name: str, mode: str, launch: Launch, capability: int) -> KernelResources:
    compiled = compile_launch(launch, capability)
    registers, local_bytes = cubin_usage(compiled.asm["cubin"])
    return KernelResources(kernel=name, mode=mode, config=launch_config(launch), capability=capability,
                           registers=registers, shared=compiled.metadata.shared, spills=local_bytes // 4,
                           key=specialisation_key(launch))


@dataclass(frozen=True)
class ModelSizes:
    """One configuration of the kernels' sizes (Qwen3.8-Flash-Next ranges). `mode` is `decode` (one query per row
    against `context` positions, `batch` rows) or `prefill` (`queries` queries, with the attention's backward);
    `kernels` is `index`, `attention` (per-row caches and vLLM's paged one), `paged` (the paged attention only: the
    vLLM plugin's) or `all`; `index_keys` is the pooled keys' storage, `float` (the dtype's) or
    `fp8` (packed fp8 keys with their scales). `latent_dim > 0` makes the attention MLA's absorbed form: `kv_heads *
    group` query heads on one latent of that width (keys and values at once; `head_dim` unused). `pool_weighting`
    and `rotary_dim` are the pooled-key write's (the indexer's pooling and the RoPE width of its keys)."""

    mode: str
    dtype: torch.dtype = torch.bfloat16
    index_heads: int = 16
    index_head_dim: int = 128
    pool_size: int = 4
    head_dim: int = 128
    group: int = 8
    kernels: str = "all"
    budget: int = 2048
    kv_heads: int = 2
    context: int = 1 << 20
    batch: int = 8
    queries: int = 4096
    multiprocessors: int = 132  # H100 SXM: decode splits are sized for it
    index_keys: str = "float"
    latent_dim: int = 0
    pool_weighting: str = "learned"
    rotary_dim: int = 64

    def label(self) -> str:
        dtype = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[self.dtype]
        parts = [self.mode, dtype]
        if self.kernels not in ("attention", "paged"):
            parts.append(f"H={self.index_heads} dI={self.index_head_dim}")
            if self.index_keys == "fp8":
                parts.append("fp8 keys")
        if self.kernels != "index" and self.latent_dim:
            parts.append(f"r={self.pool_size} MLA heads={self.kv_heads * self.group} c={self.latent_dim}")
        elif self.kernels != "index":
            parts.append(f"r={self.pool_size} d={self.head_dim} g={self.group}")
        if self.kernels == "paged":
            parts.append("paged")
        return " ".join(parts)


DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def default_sizes() -> list[ModelSizes]:
    """A representative subset, about two minutes on 2 CPU cores with a cold cache: every kernel in decode and
    prefill, each dtype, the extreme sizes (index heads 64 at dim 128; attention head dim 256 with group 16, r = 1
    with group 1), and Qwen3.8-Flash-Next's widths: its indexer (`flash_next_index_sizes`) and the paged attention
    (16 heads on 2 key/value heads of 256, r = 4)."""
    return [
        ModelSizes("decode", torch.bfloat16, 64, 128, 4, head_dim=256, group=16),
        ModelSizes("decode", torch.float16, 4, 64, 1, head_dim=64, group=1),
        ModelSizes("decode", torch.float32, 16, 128, 8, head_dim=128, group=4),
        ModelSizes("prefill", torch.bfloat16, 64, 128, 4, head_dim=256, group=16),
        ModelSizes("prefill", torch.bfloat16, 4, 64, 1, head_dim=128, group=1),
        ModelSizes("prefill", torch.float32, 16, 128, 8, head_dim=64, group=8),
        ModelSizes("decode", torch.bfloat16, 64, 128, kernels="index", index_keys="fp8"),
        ModelSizes("prefill", torch.bfloat16, 64, 128, kernels="index", index_keys="fp8"),
        ModelSizes("decode", torch.bfloat16, pool_size=4, head_dim=256, group=8, kernels="paged"),
        ModelSizes("prefill", torch.bfloat16, pool_size=4, head_dim=256, group=8, kernels="paged"),
        *flash_next_index_sizes(),
    ]


def flash_next_index_sizes() -> list[ModelSizes]:
    """Qwen3.8-Flash-Next's indexer kernels (unpaged and paged scores, pooled-key write): 16 heads x 128 at r = 4,
    learned pooling (gate width 128), keys rotated over 64 channels, bf16, float and fp8 keys, decode and prefill."""
    return [ModelSizes(mode, torch.bfloat16, 16, 128, 4, kernels="index", index_keys=keys, pool_weighting="learned",
                       rotary_dim=64)
            for mode in ("decode", "prefill") for keys in ("float", "fp8")]


def full_sizes() -> list[ModelSizes]:
    """The whole matrix (slow): index heads x index head dims (the index kernel does not depend on r) and attention
    head dims x groups x pool sizes, each dtype, decode and prefill. The attention's forward compiles the same in
    decode and prefill but for the position strides, so decode is planned once per head dim (forward and combine)."""
    sizes = []
    for dtype in DTYPES:
        for mode in ("decode", "prefill"):
            sizes += [ModelSizes(mode, dtype, index_heads, index_head_dim, kernels="index", index_keys=index_keys)
                      for index_heads in (4, 16, 64) for index_head_dim in (64, 128)
                      for index_keys in ("float", "fp8")]
        sizes += [ModelSizes("prefill", dtype, pool_size=pool_size, head_dim=head_dim, group=group,
                             kernels="attention")
                  for head_dim in (64, 128, 256) for group in (1, 2, 4, 8, 16) for pool_size in (1, 2, 4, 8)]
        sizes += [ModelSizes("decode", dtype, pool_size=pool_size, head_dim=head_dim, group=group,
                             kernels="attention")
                  for head_dim in (64, 128, 256) for group in (1, 16) for pool_size in (1, 4)]
    return sizes


def glm_sizes() -> list[ModelSizes]:
    """GLM-5.3-Flash (`glm5_next`): the indexer's 32 heads x 128 over pooled keys of r = 16 (float and fp8), and MLA's
    64 query heads on one 512-wide latent, budget 2048, in decode (split for an H100) and prefill (inference: the
    sparse prefill runs the absorbed form too; training runs the PyTorch path)."""
    glm = dict(index_heads=32, index_head_dim=128, pool_size=16, kv_heads=1, group=64, latent_dim=512, budget=2048)
    return [ModelSizes("decode", torch.bfloat16, **glm), ModelSizes("prefill", torch.bfloat16, **glm),
            ModelSizes("decode", torch.bfloat16, **glm, kernels="index", index_keys="fp8")]


def size_launches(sizes: ModelSizes) -> list[tuple[str, Launch]]:
    """(kernel name, launch) of every kernel the sizes exercise, built by the kernels' own planning functions (in a
    compiling process)."""
    import importlib

    launches = []
    for name in KERNEL_MODULES if sizes.kernels != "paged" else (ATTENTION_MODULE,):
        launches += importlib.import_module(name).aot_launches(sizes)
    return launches


def _compile_task(task) -> list[KernelResources]:
    sizes, capability = task
    return [launch_resources(name, sizes.mode, launch, capability) for name, launch in size_launches(sizes)]


def _keys_task(sizes) -> dict[str, str]:
    return {name: specialisation_key(launch) for name, launch in size_launches(sizes)}


def _reporting(function, task):
    """`(True, function(task))`, or `(False, the formatted traceback)`: an exception object may not survive the trip
    back (one whose constructor takes other arguments than its message cannot be unpickled)."""
    try:
        return True, function(task)
    except Exception:  # noqa: BLE001 - every failure goes back to the parent as text
        return False, traceback.format_exc()


def _in_workers(function, tasks, workers: int | None):
    """`map(function, tasks)` in spawned processes (default: one per CPU) started without Triton's code-generation
    variables, the interpreter's among them. A task that raises, or a worker that dies, ends the map with a
    `RuntimeError` carrying the worker's traceback (a process pool would wait forever for a dead worker's task)."""
    workers = max(1, min(len(tasks), workers or os.cpu_count() or 1))
    with compiler_environment():  # the workers start, from this environment, as the tasks are submitted
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as executor:
            results = list(executor.map(functools.partial(_reporting, function), tasks))
    for task, (ok, value) in zip(tasks, results):
        if not ok:
            raise RuntimeError(f"Compiling {task} failed in its worker:\n{value}")
    return [value for _, value in results]


def compile_sizes(sizes_list, capabilities=CAPABILITIES, workers: int | None = None) -> list[KernelResources]:
    """Compile every kernel launch of each of `sizes_list` for each capability; one row per distinct compilation and
    capability."""
    batches = _in_workers(_compile_task, [(sizes, cap) for sizes in sizes_list for cap in capabilities], workers)
    results, seen = [], set()
    for row in (row for batch in batches for row in batch):
        if (row.key, row.capability) not in seen:
            seen.add((row.key, row.capability))
            results.append(row)
    return results


def specialisation_keys(sizes_list, workers: int | None = None) -> list[dict[str, str]]:
    """For each of `sizes_list`, kernel name -> the compilation its launch needs (`specialisation_key`)."""
    return _in_workers(_keys_task, list(sizes_list), workers)


# Constexprs left out of a configuration's description: implied by the dtype or by the unpadded sizes.
_IMPLIED = ("FP32", "HAS_WEIGHTS", "HEADS_PAD", "GROUP_PAD", "DIM_PAD", "POOL_PAD", "HALF_PAD", "REST_PAD",
            "num_stages")


def launch_config(launch: Launch) -> str:
    """A short description of a launch's compilation: its inputs' dtype, sizes, tiles and warps."""
    floats = [arg.dtype for arg in launch.args if isinstance(arg, torch.Tensor) and arg.is_floating_point()]
    dtype = next((dtype for dtype in floats if dtype != torch.float32), torch.float32)
    names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
    settings = [f"{key}={value}" for key, value in launch.options.items()
                if key not in _IMPLIED and not (key == "PRECISION" and value in ("tf32", "ieee"))]
    return " ".join([names[dtype], *settings]).replace("num_warps", "warps")


def _by_compilation(results: list[KernelResources]) -> tuple[list[int], list[dict[int, KernelResources]]]:
    """The capabilities present, and one {capability: row} per compilation, in order."""
    by_key = {}
    for row in results:
        by_key.setdefault(row.key, {})[row.capability] = row
    return sorted({row.capability for row in results}), list(by_key.values())


def _cell(rows: dict, capability: int) -> str:
    row = rows.get(capability)
    return "-" if row is None else f"{row.registers} / {row.shared:,} / {row.spills}"


def format_table(results: list[KernelResources]) -> str:
    """Registers / shared memory (bytes) / spills (4-byte words) of each compilation on each target, one line per
    compilation."""
    capabilities, compilations = _by_compilation(results)
    lines = [f"{'kernel':<30} {'mode':<8}" + "".join(f" {f'sm_{cap} regs / shared / spills':>30}"
                                                      for cap in capabilities) + "  config"]
    for rows in compilations:
        first = next(iter(rows.values()))
        lines.append(f"{first.kernel:<30} {first.mode:<8}" + "".join(f" {_cell(rows, cap):>30}" for cap in capabilities)
                     + f"  {first.config}")
    return "\n".join(lines)


def markdown_table(results: list[KernelResources]) -> str:
    """`format_table` as a Markdown table (for docs/kernels.md)."""
    capabilities, compilations = _by_compilation(results)
    lines = ["| kernel | mode | config | " + " | ".join(f"sm_{cap} regs / shared / spills" for cap in capabilities)
             + " |", "|---|---|---|" + "---|" * len(capabilities)]
    for rows in compilations:
        first = next(iter(rows.values()))
        lines.append(f"| `{first.kernel}` | {first.mode} | {first.config} | "
                     + " | ".join(_cell(rows, cap) for cap in capabilities) + " |")
    return "\n".join(lines)


def as_dicts(results: list[KernelResources]) -> list[dict]:
    return [asdict(row) | {"shared_limit": row.shared_limit} for row in results]


def main(argv=None):
    """`python -m hybrid_indexpool.kernels.aot [--full] [--markdown] [--json FILE]`: compile and print the table."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--full", action="store_true", help="the whole matrix (about 20 minutes on 2 cores)")
    parser.add_argument("--glm", action="store_true", help="GLM-5.3-Flash's sizes (indexer r = 16, MLA latents)")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    results = compile_sizes(full_sizes() if args.full else glm_sizes() if args.glm else default_sizes())
    print(markdown_table(results) if args.markdown else format_table(results))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(as_dicts(results), handle, indent=1)
    return results


if __name__ == "__main__":
    main()
