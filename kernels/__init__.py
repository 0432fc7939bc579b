"""Kernels of HybridIndexPool, one subpackage per operation, each with its PyTorch reference and one entry point:

- `decode_linear.decode_linear`: the decode step's linear layers (a streaming matrix-vector product on CPU).
- `gated_delta_rule.gated_delta_rule`: chunked and recurrent gated delta rule (Gated DeltaNet).
- `pooled_index_topk.pooled_index_topk`: pooled index scores and top-k window selection
  (`paged_pooled_index_topk`: over vLLM's paged pooled-key cache, a serving step's tiles).
- `pooled_key_write.write_pooled_keys`: a serving step's pooled keys (pool, norm, RoPE, fp8 packing) into vLLM's
  paged pooled-key cache.
- `sparse_attention.sparse_attention`: attention over the selected windows plus the tail.
- `weighted_pool.weighted_pool`: weighted pooling of completed indexer windows.

Installed, this folder is `hybrid_indexpool.kernels`. Run from the checkout's root (`python -m ...`, which puts the
current folder first on `sys.path`), a plain `import kernels` would find this folder before the PyPI package `kernels`
that transformers imports (its hub-kernel integration): imported under that top-level name, the folder hands the import
over to that package where it is installed (and stays an empty package otherwise, as before).
"""

if __name__ == "kernels":
    import importlib
    import os
    import sys

    _checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _path = sys.path[:]
    sys.path[:] = [entry for entry in _path if os.path.abspath(entry or os.curdir) != _checkout]
    _folder = sys.modules.pop(__name__)
    try:
        # The import system returns what `sys.modules` holds once this module has run: the PyPI package.
        importlib.import_module(__name__)
    except ModuleNotFoundError:
        sys.modules[__name__] = _folder
    finally:
        sys.path[:] = _path
