"""What the Triton kernels share on the host: a planned launch, the GPU's size and the arithmetic of the products.

Each operation's Triton modules plan its kernels as `Launch`es (kernel, grid, arguments, options) and run them;
`aot` compiles the same plans, made on meta tensors, without a GPU. Nothing here imports Triton.
"""

import functools
from dataclasses import dataclass

import torch

from .dispatch import triton_interpreted

# Programs per streaming multiprocessor a launch aims for when it can choose (decode splits): enough to hide latency.
PROGRAMS_PER_SM = 4


@dataclass(frozen=True)
class Launch:
    """One kernel launch: `kernel[grid](*args, **options)` (options hold the constexprs, num_warps, num_stages)."""

    kernel: object
    grid: tuple
    args: tuple
    options: dict

    def run(self):
        if triton_interpreted():
            accept_scalar_loop_bounds()
        return self.kernel[self.grid](*self.args, **self.options)


@functools.cache
def accept_scalar_loop_bounds() -> None:
    """Let Triton's interpreter take a kernel's runtime scalars as `range` bounds (`range(start, end, BLOCK)` over a
    split's windows or selected entries), whatever its version and numpy's.

    The interpreter holds every scalar (program ids, integer arguments) as a 1-element numpy array and turns it into a
    Python int for `range` with `int(array)`; numpy 2 refuses `int()` of an array with a dimension, so Triton 3.6's
    interpreter fails on every such loop. Triton 3.9's reads the array's one element (`int(data.squeeze())`); so does
    every version once this has run. Compiled kernels are not concerned.
    """
    from triton.runtime import interpreter

    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is None or getattr(patch_tensor, "reads_one_element", False):
        return

    def patch_lang_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch_lang_tensor.reads_one_element = True
    interpreter._patch_lang_tensor = patch_lang_tensor


@functools.lru_cache(maxsize=None)
def multiprocessor_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 elsewhere (the interpreter: fewer, longer programs)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def dot_precision(dtype: torch.dtype) -> tuple[bool, str]:
    """(compute in float32, `tl.dot` input precision): bf16/fp16 inputs on tensor cores (exact products, float32
    sums); float32 inputs in plain float32 (`ieee`, like the reference), and everything in the interpreter, whose
    16-bit arithmetic is wrong."""
    fp32 = triton_interpreted() or dtype == torch.float32
    return fp32, "ieee" if fp32 else "tf32"
