"""Kernels of HybridIndexPool, one subpackage per operation, each with its PyTorch reference and one entry point:

- `decode_linear.decode_linear`: the decode step's linear layers (a streaming matrix-vector product on CPU).
- `gated_delta_rule.gated_delta_rule`: chunked and recurrent gated delta rule (Gated DeltaNet).
- `pooled_index_topk.pooled_index_topk`: pooled index scores and top-k window selection.
- `sparse_attention.sparse_attention`: attention over the selected windows plus the tail.
- `weighted_pool.weighted_pool`: weighted pooling of completed indexer windows.
"""
