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
import multiprocessing
import os
import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass

import torch

from .launch import Launch

# Largest shared memory one block may use (opt-in), by compute capability.
SHARED_MEMORY_LIMIT = {80: 166_912, 90: 232_448}
CAPABILITIES = (90, 80)
# The kernel modules compiled here (their `aot_launches` plan each kernel's launch on meta tensors).
KERNEL_MODULES = ("hybrid_indexpool.kernels.pooled_index_topk.triton_impl",
                  "hybrid_indexpool.kernels.sparse_attention.triton_impl")
# Environment variables of Triton that are not code-generation settings and may stay while compiling.
_KEPT_VARIABLES = ("TRITON_CACHE_DIR", "TRITON_HOME", "TRITON_DEFAULT_FP_FUSION", "TRITON_PTXAS_PATH",
                   "TRITON_CUOBJDUMP_PATH", "TRITON_LIBDEVICE_PATH")


@dataclass
class KernelResources:
    """What one compiled kernel needs per block on one target."""

    kernel: str
    config: str
    capability: int
    registers: int
    shared: int
    spills: int
    num_warps: int
    num_stages: int

    @property
    def shared_limit(self) -> int:
        return SHARED_MEMORY_LIMIT[self.capability]

    @property
    def fits(self) -> bool:
        return self.shared <= self.shared_limit and self.registers <= 255


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


def compile_launch(launch: Launch, capability: int):
    """Compile `launch`'s kernel for `sm_<capability>` as its launch would; returns the compiled kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel = launch.kernel
    if not isinstance(kernel, triton.runtime.JITFunction):
        raise RuntimeError("kernels imported for Triton's interpreter cannot be compiled: use compile_sizes")
    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    # What `kernel[grid](*args)` does before compiling: bind, specialise (types, divisibility by 16), pack.
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.options)
    options, signature, constexprs, attrs = kernel._pack_args(backend, dict(launch.options), bound,
                                                              specialization, options)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)


def launch_resources(name: str, config: str, launch: Launch, capability: int) -> KernelResources:
    compiled = compile_launch(launch, capability)
    registers, local_bytes = cubin_usage(compiled.asm["cubin"])
    return KernelResources(kernel=name, config=config, capability=capability, registers=registers,
                           shared=compiled.metadata.shared, spills=local_bytes // 4,
                           num_warps=compiled.metadata.num_warps, num_stages=compiled.metadata.num_stages)


@dataclass(frozen=True)
class ModelSizes:
    """One configuration of the kernels' sizes (Qwen3.8-Flash-Next ranges). `mode` is `decode` (one query per row
    against `context` positions, `batch` rows) or `prefill` (`queries` queries, with the attention's backward);
    `kernels` is `index`, `attention` or `all`."""

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

    def label(self) -> str:
        dtype = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[self.dtype]
        parts = [self.mode, dtype]
        if self.kernels != "attention":
            parts.append(f"H={self.index_heads} dI={self.index_head_dim}")
        if self.kernels != "index":
            parts.append(f"r={self.pool_size} d={self.head_dim} g={self.group}")
        return " ".join(parts)


DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def default_sizes() -> list[ModelSizes]:
    """A representative subset, about two minutes on 2 CPU cores: every kernel in decode and prefill, each dtype,
    the extreme sizes (index heads 64 at dim 128; attention head dim 256 with group 16, r = 1 with group 1)."""
    return [
        ModelSizes("decode", torch.bfloat16, 64, 128, 4, head_dim=256, group=16),
        ModelSizes("decode", torch.float16, 4, 64, 1, head_dim=64, group=1),
        ModelSizes("decode", torch.float32, 16, 128, 8, head_dim=128, group=4),
        ModelSizes("prefill", torch.bfloat16, 64, 128, 4, head_dim=256, group=16),
        ModelSizes("prefill", torch.bfloat16, 4, 64, 1, head_dim=128, group=1),
        ModelSizes("prefill", torch.float32, 16, 128, 8, head_dim=64, group=8),
    ]


def full_sizes() -> list[ModelSizes]:
    """The whole matrix (slow): index heads x index head dims (the index kernel does not depend on r) and attention
    head dims x groups x pool sizes, each dtype, decode and prefill. The attention's forward compiles the same in
    decode and prefill but for the position strides, so decode is planned once per head dim (forward and combine)."""
    sizes = []
    for dtype in DTYPES:
        for mode in ("decode", "prefill"):
            sizes += [ModelSizes(mode, dtype, index_heads, index_head_dim, kernels="index")
                      for index_heads in (4, 16, 64) for index_head_dim in (64, 128)]
        sizes += [ModelSizes("prefill", dtype, pool_size=pool_size, head_dim=head_dim, group=group,
                             kernels="attention")
                  for head_dim in (64, 128, 256) for group in (1, 2, 4, 8, 16) for pool_size in (1, 2, 4, 8)]
        sizes += [ModelSizes("decode", dtype, pool_size=pool_size, head_dim=head_dim, group=group,
                             kernels="attention")
                  for head_dim in (64, 128, 256) for group in (1, 16) for pool_size in (1, 4)]
    return sizes


def size_launches(sizes: ModelSizes) -> list[tuple[str, Launch]]:
    """(kernel name, launch) of every kernel the sizes exercise, built by the kernels' own planning functions (in a
    compiling process)."""
    import importlib

    launches = []
    for name in KERNEL_MODULES:
        launches += importlib.import_module(name).aot_launches(sizes)
    return launches


def _compile_task(task) -> list[KernelResources]:
    sizes, capability = task
    return [launch_resources(name, launch_config(name, launch), launch, capability)
            for name, launch in size_launches(sizes)]


def compile_sizes(sizes_list, capabilities=CAPABILITIES, workers: int | None = None) -> list[KernelResources]:
    """Compile every kernel launch of each of `sizes_list` for each capability in `workers` processes (default: one
    per CPU); one row per distinct (configuration, capability)."""
    tasks = [(sizes, capability) for sizes in sizes_list for capability in capabilities]
    workers = max(1, min(len(tasks), workers or os.cpu_count() or 1))
    with compiler_environment():  # spawned workers start from this environment
        pool = multiprocessing.get_context("spawn").Pool(workers)
    with pool:
        batches = pool.map(_compile_task, tasks, chunksize=1)
    results, seen = [], set()
    for row in (row for batch in batches for row in batch):
        if (row.config, row.capability) not in seen:
            seen.add((row.config, row.capability))
            results.append(row)
    return results


def launch_config(name: str, launch: Launch) -> str:
    """A short description of what a launch compiles: the kernel and its constexprs, warps and stages."""
    settings = " ".join(f"{key}={value}" for key, value in launch.options.items())
    dtypes = sorted({str(arg.dtype).removeprefix("torch.") for arg in launch.args if isinstance(arg, torch.Tensor)
                     and arg.is_floating_point()})
    return f"{name} {'/'.join(dtypes)} {settings}"


def format_table(results: list[KernelResources]) -> str:
    """Registers / shared memory / spills of each compiled kernel, one line per kernel, config and target."""
    lines = [f"{'sm':>4} {'regs':>5} {'shared':>8} {'limit':>8} {'spills':>6}  kernel config"]
    for row in results:
        lines.append(f"{row.capability:>4} {row.registers:>5} {row.shared:>8} {row.shared_limit:>8} "
                     f"{row.spills:>6}  {row.config}")
    return "\n".join(lines)


def as_dicts(results: list[KernelResources]) -> list[dict]:
    return [asdict(row) | {"shared_limit": row.shared_limit} for row in results]
