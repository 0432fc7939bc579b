"""A batched IndexPool step over random paged caches, without an engine: what the GPU check, the benchmarks and the
tests run `indexpool_step` on where vLLM is not installed.

Each request owns blocks scattered over the caches in a random order (block 0 stays the null block, as in vLLM), its
context is already cached (random keys and values, random pooled keys, its open window in the ring) and the step
schedules `new_tokens` more tokens of it; the metadata comes from the plugin's own builder (`PagedMetadataBuilder`).
"""

from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..kernels.fp8_index_keys import quantize_pooled_keys
from .huge_pages import advise_huge_pages
from .paged_step import (
    IndexPoolStepSettings,
    PagedCacheMetadata,
    PagedCaches,
    PagedMetadataBuilder,
    indexpool_step,
    pooled_key_width,
)

# Cache blocks of packed fp8 pooled keys drawn (in float32) and quantized at once.
PACKED_BLOCKS_PER_DRAW = 4096


@dataclass
class StepSizes:
    """The layer's widths (defaults: Qwen3.8-Flash-Next's, budget 2048 tokens at r = 4)."""

    heads: int = 16
    kv_heads: int = 2
    head_dim: int = 256
    index_heads: int = 16
    index_head_dim: int = 128
    pool_size: int = 4
    topk: int = 2048  # token budget
    block_size: int = 256
    weighting: str = "learned"
    fp8_index_keys: bool = False


@dataclass
class SyntheticStep:
    """The step's inputs, caches, per-cache metadata and settings; `run()` is `indexpool_step` on them."""

    inputs: dict
    caches: PagedCaches
    metadata: dict  # cache kind -> PagedCacheMetadata
    settings: IndexPoolStepSettings
    huge_pages: dict  # cache kind -> HugePageAdvice (empty without `huge_pages`)

    def run(self) -> torch.Tensor:
        return indexpool_step(**self.inputs, caches=self.caches, main=self.metadata["main"],
                              pooled=self.metadata["pooled_keys"], ring=self.metadata["open_window"],
                              settings=self.settings)

    @property
    def main(self) -> PagedCacheMetadata:
        return self.metadata["main"]


def neox_cos_sin_cache(max_positions: int, rotary_dim: int, device, base: float = 10000.0) -> torch.Tensor:
    """`[max_positions, rotary_dim]` float32: the cosines then the sines of each position's rotary angles (vLLM's
    `cos_sin_cache` layout)."""
    inverse_frequencies = base ** -(torch.arange(0, rotary_dim, 2, device=device, dtype=torch.float32) / rotary_dim)
    angles = torch.arange(max_positions, device=device, dtype=torch.float32)[:, None] * inverse_frequencies
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def synthetic_step(contexts: list[int], new_tokens: list[int], sizes: StepSizes = StepSizes(), *,
                   dtype: torch.dtype = torch.bfloat16, device="cpu", seed: int = 0, padding: int = 0,
                   full_graphs: bool = False, max_model_len: int | None = None,
                   huge_pages: bool = True) -> SyntheticStep:
    """A step in which request `i` has `contexts[i]` tokens cached and `new_tokens[i]` scheduled, `padding` tokens
    of no request after them, built for an engine of `max_model_len` tokens (default: the longest request).
    `full_graphs`: full CUDA graphs replay uniform decode batches (their window bound is then every window a request
    may reach, `max_model_len / r`), as vLLM's builder sets it in a graph mode with full graphs. `huge_pages`: the
    main and pooled-key caches are advised into transparent huge pages before they are filled and collapsed into them
    after, as the plugin advises vLLM's (`huge_pages.advise_huge_pages`; best effort, what was granted is in
    `SyntheticStep.huge_pages`)."""
    device = torch.device(device)
    # Drawn on the device itself: the caches of long contexts are gigabytes.
    generator = torch.Generator(device=device).manual_seed(seed)
    host_generator = torch.Generator().manual_seed(seed)
    r, block_size = sizes.pool_size, sizes.block_size

    def cache(*shape, dtype=dtype) -> torch.Tensor:
        # Advised before it is filled, so that its pages come in huge pages (memory the allocator had already used
        # keeps its 4 KiB pages until the collapse after the fill).
        tensor = torch.empty(*shape, dtype=dtype, device=device)
        if huge_pages:
            advise_huge_pages(tensor, collapse=False)
        return tensor

    def random(*shape, scale=1.0, into=None):
        # Drawn in place in `dtype`: no float32 copy of a cache of gigabytes on the way.
        into = torch.empty(*shape, dtype=dtype, device=device) if into is None else into
        return into.normal_(0.0, scale, generator=generator)

    lengths = [context + count for context, count in zip(contexts, new_tokens)]
    blocks_per_request = [-(-length // block_size) for length in lengths]
    max_blocks = max(blocks_per_request)
    num_blocks = 1 + sum(blocks_per_request)
    # Every request's blocks in a random order over the cache; unused table entries point at the null block.
    order = 1 + torch.randperm(num_blocks - 1, generator=host_generator)
    block_table = torch.zeros(len(contexts), max_blocks, dtype=torch.int32)
    start = 0
    for request, count in enumerate(blocks_per_request):
        block_table[request, :count] = order[start:start + count].int()
        start += count
    ring_table = (1 + torch.randperm(len(contexts), generator=host_generator)).int()[:, None]

    gate_width = {"learned": sizes.index_head_dim, "learned_scalar": 1}.get(sizes.weighting, 0)
    width, pooled_dtype = pooled_key_width(sizes.index_head_dim, "float8_e4m3fn" if sizes.fp8_index_keys else "auto")
    pooled_shape = (num_blocks, block_size // r, 1, sizes.index_head_dim)
    if pooled_dtype is None:
        pooled_keys = random(into=cache(*pooled_shape))
    else:  # quantized from float32 rows, a block at a time: the float32 copy of the whole cache is never held
        pooled_keys = cache(*pooled_shape[:-1], width, dtype=pooled_dtype)
        for block in range(0, num_blocks, PACKED_BLOCKS_PER_DRAW):
            rows = torch.randn(*pooled_keys[block:block + PACKED_BLOCKS_PER_DRAW].shape[:-1], sizes.index_head_dim,
                               generator=generator, device=device)
            pooled_keys[block:block + PACKED_BLOCKS_PER_DRAW] = quantize_pooled_keys(rows)
    caches = PagedCaches(
        main=random(into=cache(num_blocks, sizes.kv_heads, block_size, 2 * sizes.head_dim)),
        pooled_keys=pooled_keys,
        open_window=random(len(contexts) + 1, r, 1, sizes.index_head_dim + gate_width),
    )
    assert caches.pooled_keys.shape[-1] == width
    advice = {kind: advise_huge_pages(getattr(caches, kind)) for kind in ("main", "pooled_keys") if huge_pages}

    num_scheduled = sum(new_tokens)
    num_tokens = num_scheduled + padding
    query_start_loc_cpu = torch.tensor([0, *torch.tensor(new_tokens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(contexts, new_tokens)])
    token_request = torch.repeat_interleave(torch.arange(len(contexts)), torch.tensor(new_tokens))
    slots = block_table[token_request, positions // block_size].long() * block_size + positions % block_size
    slot_mapping = torch.cat([slots, torch.full((padding,), -1)]).to(device)
    max_model_len = max_model_len or max(lengths)
    if max_model_len < max(lengths):
        raise ValueError(f"max_model_len ({max_model_len}) must hold the longest request ({max(lengths)} tokens).")
    metadata = {}
    for kind, table in (("main", block_table), ("pooled_keys", block_table), ("open_window", ring_table)):
        builder = PagedMetadataBuilder(kind, r, r if kind == "open_window" else block_size, max_model_len,
                                       num_tokens, len(contexts), device, full_graphs=full_graphs)
        metadata[kind] = builder.build(num_tokens, len(contexts), query_start_loc_cpu, query_start_loc_cpu.to(device),
                                       seq_lens.to(device), table.to(device), slot_mapping, max(new_tokens),
                                       max(lengths), seq_lens_cpu=seq_lens)

    rotary_dim = sizes.index_head_dim // 2
    settings = IndexPoolStepSettings(
        pool_size=r, topk_windows=sizes.topk // r, sink_windows=0, local_windows=0, scaling=sizes.head_dim**-0.5,
        weighting=sizes.weighting, key_norm_weight=random(sizes.index_head_dim, scale=0.3), key_norm_eps=1e-6,
        pool_slot_bias=random(r, gate_width, scale=0.5) if gate_width else None,
        cos_sin_cache=neox_cos_sin_cache(max(lengths) + 1, rotary_dim, device))
    inputs = dict(
        query=random(num_tokens, sizes.heads, sizes.head_dim), key=random(num_tokens, sizes.kv_heads, sizes.head_dim),
        value=random(num_tokens, sizes.kv_heads, sizes.head_dim),
        index_queries=random(num_tokens, sizes.index_heads, sizes.index_head_dim),
        ring_rows=random(num_tokens, sizes.index_head_dim + gate_width),
        head_weights=torch.rand(num_tokens, sizes.index_heads, generator=generator, device=device),
        output_gate=random(num_tokens, sizes.heads, sizes.head_dim),
    )
    return SyntheticStep(inputs, caches, metadata, settings, advice)


class OperationCounter(TorchDispatchMode):
    """Counts the `aten` operators run under it: `operators` those that compute or allocate (each computing one a
    kernel launch on a GPU), `views` those that only alias their input, and `host_syncs` those that read a device
    value on the host or size their output by values (each one a host synchronisation on a GPU)."""

    SYNCING = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "masked_scatter", "equal")

    def __init__(self):
        super().__init__()
        self.operators = 0
        self.views = 0
        self.host_syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if any(result.alias_info is not None for result in func._schema.returns):
            self.views += 1
        else:
            self.operators += 1
        boolean_index = name == "index" and any(index is not None and index.dtype == torch.bool for index in args[1])
        self.host_syncs += name in self.SYNCING or boolean_index
        return func(*args, **(kwargs or {}))


def count_step_operations(step: SyntheticStep) -> dict:
    """`{"operators": n, "views": v, "host_syncs": m}` of one run of `step` (`OperationCounter`; the metadata was built
    before: the builder's host work is not counted)."""
    with torch.no_grad(), OperationCounter() as counter:
        step.run()
    return {"operators": counter.operators, "views": counter.views, "host_syncs": counter.host_syncs}
