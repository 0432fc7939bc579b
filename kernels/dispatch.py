"""Which implementation runs: Triton (and flash-linear-attention) on CUDA tensors when importable, PyTorch otherwise.

Set the environment variable `HYBRID_INDEXPOOL_BACKEND=torch` to force the PyTorch path everywhere (for debugging or
to compare); the default `auto` picks the fast path whenever it applies.
"""

import os

BACKEND_VARIABLE = "HYBRID_INDEXPOOL_BACKEND"
BACKENDS = ("auto", "torch")


def kernel_backend() -> str:
    """The requested backend, `auto` or `torch`."""
    backend = os.environ.get(BACKEND_VARIABLE, "auto").lower()
    if backend not in BACKENDS:
        raise ValueError(f"{BACKEND_VARIABLE}={backend!r} is not a backend; use one of {list(BACKENDS)}.")
    return backend


def use_fast_path(*tensors) -> bool:
    """True when every tensor is on a CUDA device and the PyTorch path is not forced."""
    return kernel_backend() == "auto" and all(tensor.is_cuda for tensor in tensors)


def triton_interpreted() -> bool:
    """Triton runs in its CPU interpreter (`TRITON_INTERPRET=1`), whose bfloat16 arithmetic is wrong: the kernels
    then compute in float32."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
