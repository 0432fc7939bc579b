"""Triton IndexPool sparse attention: forward (prefill and split decode), combine, backward (dq; dk and dv key-major).

A query's keys are a list of windows: its selected windows (all `r` positions of each) and then its tail, its own
open window `(p + 1) // r` up to its position `p` (positions `r * ((p + 1) // r) .. p`). One program serves one query
token and one key/value head, i.e. all the query heads of that GQA group (they share the selection) as the rows of
its matrix products, padded only to a power of two. It walks the list in tiles of `BLOCK_N` positions (`BLOCK_N / r`
windows) with an online softmax; products run on tensor cores in bf16/fp16 with float32 accumulation. Decode splits
a query's list over several programs (enough to fill the GPU, a runtime number: no recompilation per batch size)
and a combine kernel merges their partial outputs by log-sum-exp.

The backward recomputes the probabilities from the saved log-sum-exp. dq is query-major (the forward's walk). dk and
dv are key-major, with no atomics: the selection is inverted on the device (each (row, window) lists the queries whose
list holds it, tails included), and one program per window and key/value head accumulates the gradients of its `r`
keys over those queries and writes them once.

Every offset that can pass 2^31 (batch, position and query strides at long contexts) is computed in int64.

The paged entry (vLLM's cache) runs the same forward and combine kernels under constexprs (`PAGED`: each key/value
row through the block table; `GATED`: the model's sigmoid output gate in the store that writes the output), on the
step's flattened tokens as a batch of one; off, they compile as before.

The kernels live by concern: `triton_shared` (the list walk's `@triton.jit` helpers, the pipeline stages, the size
helpers), `triton_forward`, `triton_decode` (the split count and the combine kernel), `triton_backward` and
`triton_latent` (MLA's absorbed form). This module holds the entry points, the autograd Function and
`aot_launches`.
"""

import torch

from ..launch import Launch, multiprocessor_count
from .triton_backward import invert_selection, plan_backward
from .triton_decode import decode_splits
from .triton_forward import plan_forward
from .triton_latent import latent_splits, plan_latent_forward


def sparse_latent_attention_triton(query, latents, selected_windows, query_positions, pool_size, scaling,
                                   num_splits=None):
    """Triton version of `sparse_latent_attention_torch` (inference: no dropout, weights or gradient): output
    latents `[batch, queries, heads, latent_dim]`. Latents may be any view whose last dimension is contiguous (the
    cache's `[batch, capacity, 1, latent_dim]` storage seen as `[batch, 1, positions, latent_dim]`). `num_splits`
    as in `sparse_attention_triton`."""
    query, latents = _last_dim_contiguous(query), _last_dim_contiguous(latents)
    if num_splits is None:
        num_splits = latent_splits(query, selected_windows, pool_size, multiprocessor_count(query.device))
    launches, output = plan_latent_forward(query, latents, selected_windows, query_positions, pool_size, scaling,
                                           num_splits)
    _run(launches)
    return output


def _run(launches):
    for launch in launches:
        launch.run()


class SparseAttentionFunction(torch.autograd.Function):
    """Autograd wrapper: Triton forward, Triton backward (dq, dk, dv); the selection gets no gradient."""

    @staticmethod
    def forward(ctx, query, key, value, selected, positions, pool_size, scaling):
        launches, output, lse = plan_forward(query, key, value, selected, positions, pool_size, scaling)
        _run(launches)
        ctx.save_for_backward(query, key, value, selected, positions, output, lse)
        ctx.pool_size, ctx.scaling = pool_size, scaling
        return output

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, selected, positions, output, lse = ctx.saved_tensors
        inverted = invert_selection(selected, positions, ctx.pool_size, key.shape[2])
        launches, grad_query, grad_key, grad_value = plan_backward(
            query, key, value, selected, positions, ctx.pool_size, ctx.scaling, output, grad_output.contiguous(),
            lse, *inverted)
        _run(launches)
        return grad_query, grad_key, grad_value, None, None, None, None


def _last_dim_contiguous(tensor):
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def sparse_attention_triton(query, key, value, selected_windows, query_positions, pool_size, scaling,
                            num_splits=None):
    """Triton version of `sparse_attention_torch` (no dropout, no weights): output `[batch, queries, heads, dim]`.

    `num_splits` splits each query's list of windows over that many programs (forward without gradient only;
    default: enough programs to fill the GPU, one tile at least per split). Keys and values may be any view whose
    last dimension is contiguous (the cache's position-major storage); ids and positions are read as given.
    """
    query, key, value = (_last_dim_contiguous(t) for t in (query, key, value))
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        return SparseAttentionFunction.apply(query, key, value, selected_windows, query_positions, pool_size,
                                             scaling)
    if num_splits is None:
        num_splits = decode_splits(query, key, selected_windows, pool_size, multiprocessor_count(query.device))
    launches, output, _ = plan_forward(query, key, value, selected_windows, query_positions, pool_size, scaling,
                                       num_splits)
    _run(launches)
    return output


def paged_sparse_attention_triton(query, key_cache, value_cache, block_table, token_request, selected_windows,
                                  query_positions, pool_size, scaling, output_gate=None, num_splits=None):
    """Triton version of `paged_sparse_attention_torch` (inference): output `[tokens, heads, head_dim]` of a step's
    flattened tokens over keys and values in vLLM's pages `[num_blocks, kv_heads, block_size, head_dim]` (any views
    whose last dimension is contiguous; `block_size` any integer that `pool_size` divides or not).

    The forward kernel runs with paged addressing (a token's request from `token_request`, each key/value row
    through `block_table`) on the query as a `[1, heads, tokens, dim]` view; `output_gate` `[tokens, heads, dim]` is
    applied in the store of the kernel that writes the output. `num_splits` as in `sparse_attention_triton`; by
    default set by the shapes only (tokens, heads, topk, multiprocessors). Nothing is read back to the host and every
    allocation has a shape fixed by the arguments' shapes, so a step can be captured in a CUDA graph.
    """
    query, key_cache, value_cache = (_last_dim_contiguous(t) for t in (query, key_cache, value_cache))
    if output_gate is not None:
        output_gate = _last_dim_contiguous(output_gate)
    if query.shape[0] == 0:
        return torch.empty_like(query)
    launches, output = plan_paged_forward(query, key_cache, value_cache, block_table, token_request,
                                          selected_windows, query_positions, pool_size, scaling, output_gate,
                                          num_splits, multiprocessor_count(query.device))
    _run(launches)
    return output


def _batch_of_one(tensor):
    """`tensor` with a leading batch dimension of one whose stride is 0: never the token count, which would make the
    kernel's specialisation depend on it (equal to 1, divisible by 16) as `unsqueeze` or `expand` would."""
    return tensor.as_strided((1, *tensor.shape), (0, *tensor.stride()))


def plan_paged_forward(query, key_cache, value_cache, block_table, token_request, selected_windows, query_positions,
                       pool_size, scaling, output_gate, num_splits, multiprocessors):
    """(launches, output `[tokens, heads, head_dim]`) of `paged_sparse_attention_triton` (shapes as there; `num_splits`
    None: `decode_splits` for `multiprocessors`)."""
    batched_query = _batch_of_one(query.transpose(0, 1))  # [1, heads, tokens, dim]
    selected, positions = _batch_of_one(selected_windows), _batch_of_one(query_positions)
    if num_splits is None:
        num_splits = decode_splits(batched_query, key_cache, selected, pool_size, multiprocessors)
    launches, output, _ = plan_forward(batched_query, key_cache, value_cache, selected, positions, pool_size,
                                       scaling, num_splits, (block_table, token_request, key_cache.shape[2]),
                                       output_gate)
    return launches, output[0]


def aot_launches(sizes) -> list[tuple[str, Launch]]:
    """Every attention kernel's launch at `sizes` (an `aot.ModelSizes`), on meta tensors. Decode: one query per row
    against a cache of `context` positions, split for `sizes.multiprocessors`; prefill: `queries` queries with the
    backward too."""
    if sizes.kernels == "index":
        return []
    if sizes.latent_dim:
        return _latent_aot_launches(sizes)
    paged = _paged_aot_launches(sizes)
    if sizes.kernels == "paged":
        return paged
    return _unpaged_aot_launches(sizes) + paged


def _unpaged_aot_launches(sizes) -> list[tuple[str, Launch]]:
    """The GQA kernels' launches at `sizes` on per-row caches: the decode forward (and combine), or the prefill's
    forward and backward."""
    meta = dict(device="meta", dtype=sizes.dtype)
    num_queries = 1 if sizes.mode == "decode" else sizes.queries
    batch_size = sizes.batch if sizes.mode == "decode" else 1
    num_positions = sizes.context if sizes.mode == "decode" else num_queries
    topk = sizes.budget // sizes.pool_size
    heads = sizes.kv_heads * sizes.group
    query = torch.empty(batch_size, num_queries, heads, sizes.head_dim, **meta).transpose(1, 2)
    # The cache's layout: [batch, capacity, kv_heads, head_dim] storage seen as [batch, kv_heads, positions, dim].
    key = torch.empty(batch_size, num_positions, sizes.kv_heads, sizes.head_dim, **meta).transpose(1, 2)
    selected = torch.empty(batch_size, num_queries, topk, dtype=torch.int64, device="meta")
    positions = torch.empty(batch_size, num_queries, dtype=torch.int64, device="meta")
    names = ("sparse_attention_forward", "combine_splits")
    if sizes.mode == "decode":
        num_splits = decode_splits(query, key, selected, sizes.pool_size, sizes.multiprocessors)
        launches, _, _ = plan_forward(query, key, key, selected, positions, sizes.pool_size, 0.1, num_splits)
        return list(zip(names, launches))
    launches, output, lse = plan_forward(query, key, key, selected, positions, sizes.pool_size, 0.1)
    entries = torch.empty(batch_size * num_queries * (topk + 1), dtype=torch.int64, device="meta")
    offsets = torch.empty(batch_size * num_positions // sizes.pool_size + 1, dtype=torch.int64, device="meta")
    backward, *_ = plan_backward(query, key, key, selected, positions, sizes.pool_size, 0.1, output, output, lse,
                                 entries, entries, offsets)
    return list(zip(names[:1], launches)) + list(zip(("sparse_attention_backward_dq",
                                                      "sparse_attention_backward_dkv"), backward))


# Rows per page of the paged launches' caches. The block size is a runtime argument the kernel does not specialise on
# (nor on the block table's row stride), so any value compiles the same; this one is not a power of two.
AOT_BLOCK_SIZE = 528


def _paged_aot_launches(sizes) -> list[tuple[str, Launch]]:
    """The paged kernels' launches as the vLLM plugin runs them at `sizes`: a step's flattened tokens (decode: `batch`
    requests of one token over `context` positions, split for `sizes.multiprocessors`; prefill: `queries` tokens of
    one request, unsplit), keys and values the two halves of one `[blocks, kv_heads, block_size, 2 * head_dim]`
    cache, an int32 block table, and the output gate (the second half of each head's query projection)."""
    meta = dict(device="meta", dtype=sizes.dtype)
    decode = sizes.mode == "decode"
    num_tokens, num_requests = (sizes.batch, sizes.batch) if decode else (sizes.queries, 1)
    pages_per_request = -(-(sizes.context if decode else sizes.queries) // AOT_BLOCK_SIZE)
    heads, head_dim = sizes.kv_heads * sizes.group, sizes.head_dim
    query = torch.empty(num_tokens, heads, head_dim, **meta)
    gate = torch.empty(num_tokens, heads, 2 * head_dim, **meta)[..., head_dim:]
    cache = torch.empty(num_requests * pages_per_request + 1, sizes.kv_heads, AOT_BLOCK_SIZE, 2 * head_dim, **meta)
    block_table = torch.empty(num_requests, pages_per_request, dtype=torch.int32, device="meta")
    token_request = torch.empty(num_tokens, dtype=torch.int64, device="meta")
    selected = torch.empty(num_tokens, sizes.budget // sizes.pool_size, dtype=torch.int64, device="meta")
    positions = torch.empty(num_tokens, dtype=torch.int64, device="meta")
    launches, _ = plan_paged_forward(query, cache[..., :head_dim], cache[..., head_dim:], block_table, token_request,
                                     selected, positions, sizes.pool_size, 0.1, gate, None if decode else 1,
                                     sizes.multiprocessors)
    return list(zip(("paged_sparse_attention_forward", "paged_combine_splits"), launches))


def _latent_aot_launches(sizes) -> list[tuple[str, Launch]]:
    """The latent (MLA) kernel's launches at `sizes`: decode split for `sizes.multiprocessors`, prefill unsplit."""
    meta = dict(device="meta", dtype=sizes.dtype)
    num_queries = 1 if sizes.mode == "decode" else sizes.queries
    batch_size = sizes.batch if sizes.mode == "decode" else 1
    num_positions = sizes.context if sizes.mode == "decode" else num_queries
    heads = sizes.kv_heads * sizes.group
    query = torch.empty(batch_size, num_queries, heads, sizes.latent_dim, **meta).transpose(1, 2)
    # The cache's layout: [batch, capacity, 1, latent] storage seen as [batch, 1, positions, latent].
    latents = torch.empty(batch_size, num_positions, 1, sizes.latent_dim, **meta).transpose(1, 2)
    selected = torch.empty(batch_size, num_queries, sizes.budget // sizes.pool_size, dtype=torch.int64,
                           device="meta")
    positions = torch.empty(batch_size, num_queries, dtype=torch.int64, device="meta")
    num_splits = 1
    if sizes.mode == "decode":
        num_splits = latent_splits(query, selected, sizes.pool_size, sizes.multiprocessors)
    launches, _ = plan_latent_forward(query, latents, selected, positions, sizes.pool_size, 0.1, num_splits)
    return list(zip(("sparse_latent_attention", "combine_splits"), launches))
