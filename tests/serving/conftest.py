import importlib.util
import os

# The package's tests run Triton kernels in Triton's interpreter on CPU (tests/conftest.py); vLLM's engine processes
# must not: its CPU build checks for a Triton CPU backend and falls back to PyTorch only when Triton is left alone.
# Only where vLLM is installed (an environment that runs just these tests): a session without vLLM collects this file
# too, and its kernel tests need the interpreter.
if importlib.util.find_spec("vllm") is not None:
    os.environ.pop("TRITON_INTERPRET", None)
# vLLM's CPU worker otherwise reserves 90% of the machine's memory for the KV cache and refuses to start when less is
# free; the tiny checkpoint needs far less.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# `vllm_reference.fill_caches` sends a function to the engine's processes (`LLM.apply_model`), which vLLM pickles only
# when allowed.
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
