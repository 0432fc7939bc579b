"""CPU kernel of the decode step's linear layers: a matrix-vector product that streams the weight once.

A decode step multiplies one token (or a few) by every weight matrix of the model: the step reads all the weights
and does two flops per weight, so it runs at the memory bandwidth at best. The BLAS behind `F.linear` runs this
batch-1 product well on one thread but gains little from a second one. Here each thread takes a contiguous run of
output rows and reads 4 weight rows side by side against the input held in L1, in float32 or bfloat16 weights
(widened in registers), so the threads together stream the weights near the machine's read bandwidth
(`linear_rows.c`; `docs/kernels.md` has the measured figures). It is built on first use by
`cpu_build.CpuKernel` and registered as a custom op, so compiled decode steps keep one graph.

The sum over the input dimension runs in another order than the BLAS's (vector lanes), so results can differ from
`F.linear` in the last bits. Without a C compiler (or with `HYBRID_INDEXPOOL_CPU_KERNELS=0` or
`HYBRID_INDEXPOOL_BACKEND=torch`) `F.linear` runs.
"""

import ctypes
from pathlib import Path

import torch
import torch.nn.functional as F

from ..cpu_build import CpuKernel, op_namespace

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch built without distributed support: no DTensor can reach here
    DTensor = ()

# Input rows (tokens) up to which the streaming product beats the BLAS (beyond it the BLAS runs a real GEMM).
MAX_ROWS = 8


def _declare(library) -> None:
    library.linear_rows.restype = None
    library.linear_rows.argtypes = ([ctypes.c_void_p] * 2 + [ctypes.c_int, ctypes.c_int64] + [ctypes.c_void_p] * 2
                                    + [ctypes.c_int64] * 3 + [ctypes.c_int])


KERNEL = CpuKernel("linear_rows", Path(__file__).with_name("linear_rows.c"), _declare)


def decode_linear_applies(hidden_states: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the compiled CPU product serves this call: CPU, float32 or bfloat16 weight (rows contiguous) and input
    of the same dtype, at most `MAX_ROWS` input rows, no gradient to record, no autocast (whose dtype rules
    `F.linear` applies), plain tensors (a tensor-parallel DTensor shard is `F.linear`'s to handle), and the kernel
    usable (`CpuKernel.usable`)."""
    return (hidden_states.device.type == "cpu" and weight.device.type == "cpu"
            and not isinstance(weight, DTensor) and not isinstance(hidden_states, DTensor)
            and not torch.is_autocast_enabled("cpu")
            and weight.dtype in (torch.float32, torch.bfloat16) and hidden_states.dtype == weight.dtype
            and weight.dim() == 2 and weight.stride(-1) == 1 and hidden_states.shape[-1] == weight.shape[1]
            and hidden_states.numel() <= MAX_ROWS * weight.shape[1]
            and not (torch.is_grad_enabled() and (hidden_states.requires_grad or weight.requires_grad))
            and KERNEL.usable())


def run_linear_rows(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`input @ weight.T + bias` in float32 by the compiled kernel: `input` `[rows, in_features]`, `weight`
    `[out_features, in_features]` float32 or bfloat16 with contiguous rows, `bias` `[out_features]` or None; returns
    `[rows, out_features]` float32."""
    rows, in_features = input.shape
    out_features = weight.shape[0]
    if weight.stride(-1) != 1 or weight.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError("linear_rows needs a float32 or bfloat16 weight with contiguous rows.")
    if weight.shape[1] != in_features:
        raise ValueError(f"linear_rows: input has {in_features} features, the weight takes {weight.shape[1]}.")
    input = input.float().contiguous()
    bias = None if bias is None else bias.float().contiguous()
    library = KERNEL.load()
    if library is None:  # a compiled graph chose the op before its build failed
        return F.linear(input, weight.float(), bias)
    out = torch.empty(rows, out_features, dtype=torch.float32)
    library.linear_rows(
        input.data_ptr(), weight.data_ptr(), int(weight.dtype == torch.bfloat16), weight.stride(0),
        None if bias is None else bias.data_ptr(), out.data_ptr(), rows, in_features, out_features,
        torch.get_num_threads())
    return out


@torch.library.custom_op(f"{op_namespace(__name__)}::linear_rows", mutates_args=(), device_types="cpu")
def linear_rows(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`run_linear_rows` as a custom op, so that a compiled step keeps one graph."""
    return run_linear_rows(input, weight, bias)


@linear_rows.register_fake
def _(input, weight, bias):
    return input.new_empty(input.shape[0], weight.shape[0], dtype=torch.float32)


def decode_linear_cpu(hidden_states, weight, bias=None):
    """`decode_linear_torch` by the compiled streaming product; same arguments and result (dtype of the input)."""
    # Eager code calls the kernel directly, skipping the custom op's per-call dispatch cost (a decode step makes
    # dozens of these products; docs/kernels.md has the figures); compiled code needs the op.
    product = KERNEL.dispatch(run_linear_rows, linear_rows)
    out = product(hidden_states.reshape(-1, weight.shape[1]), weight, bias)
    return out.to(hidden_states.dtype).reshape(*hidden_states.shape[:-1], weight.shape[0])
