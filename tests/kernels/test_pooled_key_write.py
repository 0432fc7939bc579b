"""The pooled-key write: the reference against the serving layer's inline computation (bfloat16, bit for bit) and
against pooling the whole token sequence, and the Triton kernel (interpreter, float32) against the reference for every
weighting, a float32 and a packed fp8 cache, windows mixed from the step and the ring, shuffled pages."""

import math

import pytest
import torch
from host_sync import HostSyncGuard

from hybrid_indexpool.kernels.fp8_index_keys import FP8_DTYPE, packed_width
from hybrid_indexpool.kernels.pooled_key_write import (
    WEIGHTINGS,
    gemma_rms_norm,
    neox_rotary,
    pool_window_rows,
    write_pooled_keys,
    write_pooled_keys_torch,
    write_pooled_keys_triton,
)
from hybrid_indexpool.kernels.pooled_key_write.reference import gate_width_of

requires_triton = pytest.mark.skipif(write_pooled_keys_triton is None, reason="Triton is not installed")
R, HEAD_DIM, ROTARY_DIM, BLOCK_SIZE = 4, 32, 16, 16


if write_pooled_keys_triton is not None:
    import triton
    import triton.language as tl

    from hybrid_indexpool.kernels.pooled_key_write.triton_impl import _float32_to_fp8_e4m3, _store_packed

    @triton.jit
    def _convert_to_fp8(source, target, count, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(target + offsets, _float32_to_fp8_e4m3(tl.load(source + offsets, mask=offsets < count)),
                 mask=offsets < count)

    @triton.jit
    def _pack_keys(keys, packed, count, HALF: tl.constexpr, HEAD_DIM: tl.constexpr):
        """16 keys `[count, HEAD_DIM]` float32 packed by the write kernel's `_store_packed` into `packed`."""
        rows = tl.arange(0, 16)
        row_mask = rows < count
        first_channels = tl.arange(0, 16)
        first_mask = first_channels < HALF
        rest_channels = 2 * HALF + tl.arange(0, 16)
        rest_mask = rest_channels < HEAD_DIM
        base = keys + rows[:, None] * HEAD_DIM
        first = tl.load(base + first_channels[None, :], mask=row_mask[:, None] & first_mask[None, :], other=0.0)
        second = tl.load(base + HALF + first_channels[None, :], mask=row_mask[:, None] & first_mask[None, :],
                         other=0.0)
        rest = tl.load(base + rest_channels[None, :], mask=row_mask[:, None] & rest_mask[None, :], other=0.0)
        _store_packed(packed + rows * (HEAD_DIM + 4), row_mask, first, second, rest, first_channels, first_mask,
                      rest_channels, rest_mask, HALF, HEAD_DIM, tl.float32, True, "ieee", 32)


class WriteStep:
    """A serving step as `IndexPoolMetadataBuilder` lays it out: requests with `context` earlier tokens and `new`
    tokens now; their raw rows `all_rows` (earlier tokens' last ones in each request's ring block), pooled-key blocks
    drawn from a shuffled pool (null block 0 unused), the window rows, window starts and write destinations."""

    def __init__(self, contexts, new_tokens, weighting, dtype=torch.float32, fp8=False, seed=0, own_rows=False,
                 head_dim=HEAD_DIM, rotary_dim=ROTARY_DIM):
        generator = torch.Generator().manual_seed(seed)
        self.weighting = weighting
        gate_width = gate_width_of(weighting, head_dim)
        width = head_dim + gate_width
        per_block = BLOCK_SIZE // R
        self.all_rows = [torch.randn(context + new, width, generator=generator).to(dtype)
                         for context, new in zip(contexts, new_tokens)]
        self.step_rows = torch.cat([rows[context:] for rows, context in zip(self.all_rows, contexts)])
        # The ring: one block per request (shuffled, block 0 unused), token p at row p % r; rows not of the last r
        # earlier tokens are garbage.
        ring_blocks = torch.randperm(len(contexts), generator=generator) + 1
        self.ring_cache = 100 * torch.randn(len(contexts) + 2, R, 1, width, generator=generator).to(dtype)
        for request, context in enumerate(contexts):
            for position in range(max(0, context - R), context):
                self.ring_cache[ring_blocks[request], position % R, 0] = self.all_rows[request][position]
        # Pooled-key pages: enough blocks for every window of each request, from a shuffled pool.
        blocks_needed = [-(-(context + new) // BLOCK_SIZE) for context, new in zip(contexts, new_tokens)]
        order = torch.randperm(sum(blocks_needed) + 2, generator=generator) + 1
        self.block_table = torch.zeros(len(contexts), max(blocks_needed) + 1, dtype=torch.int32)
        used = 0
        for request, needed in enumerate(blocks_needed):
            self.block_table[request, :needed] = order[used:used + needed].int()
            used += needed
        num_blocks = int(order.max()) + 1
        if fp8:
            self.cache = torch.randint(0, 256, (num_blocks, per_block, 1, packed_width(head_dim)), dtype=torch.uint8,
                                       generator=generator)
        else:
            self.cache = torch.randn(num_blocks, per_block, 1, head_dim, generator=generator)
        self.norm_weight = 0.5 * torch.randn(head_dim, generator=generator)
        self.slot_bias = torch.randn(R, gate_width, generator=generator) if gate_width else None
        self.cos_sin_cache = torch.randn(128, rotary_dim, generator=generator)
        self._metadata(contexts, new_tokens, ring_blocks, per_block, own_rows)

    def _metadata(self, contexts, new_tokens, ring_blocks, per_block, own_rows):
        window_token, ring_block, start, write_token, write_block, write_row = [], [], [], [], [], []
        first = 0
        for request, (context, new) in enumerate(zip(contexts, new_tokens)):
            last = first + new - 1
            for index in range(new):
                position = context + index
                window_start = position // R * R
                window_token.append([first + p - context if p >= context else -1 for p in
                                     range(window_start, window_start + R)])
                # The builder's rows: the step's tokens up to its last one (so every token of a window pools the
                # same rows); `own_rows`: only up to the token itself, so that each token's pool differs and only
                # `write_token`'s is the one to store.
                window_token[-1] = [min(token, first + index if own_rows else last) for token in window_token[-1]]
                ring_block.append(int(ring_blocks[request]))
                start.append(window_start)
                write_token.append(min(first + index + (R - 1) - position % R, last))
                window = position // R
                write_block.append(int(self.block_table[request, window // per_block]))
                write_row.append(window % per_block)
            first += new
        self.window_token = torch.tensor(window_token)
        self.window_ring_block = torch.tensor(ring_block)
        self.window_start = torch.tensor(start)
        self.write_token = torch.tensor(write_token)
        self.write_block = torch.tensor(write_block)
        self.write_row = torch.tensor(write_row)
        self.write_keep = torch.ones(len(write_token), dtype=torch.bool)

    def args(self, cache=None):
        return (self.cache if cache is None else cache, self.step_rows, self.ring_cache, self.window_token,
                self.window_ring_block, self.window_start, self.cos_sin_cache, self.norm_weight, 1e-6,
                self.slot_bias, self.weighting, self.write_token, self.write_block, self.write_row, self.write_keep)


# Windows reaching back into the ring (contexts not multiples of r), starting in the step, one token, a new request.
CONTEXTS, NEW_TOKENS = [6, 13, 0, 8], [5, 1, 7, 9]


def reference_cache(step):
    cache = step.cache.clone()
    write_pooled_keys_torch(*step.args(cache))
    return cache


def test_the_reference_pools_each_window_of_the_whole_token_sequence():
    """Rows from the step and from the ring give the key of the window pooled from the request's whole sequence of
    rows, written at the window's row of its page (every window the step touches)."""
    step = WriteStep(CONTEXTS, NEW_TOKENS, "learned", seed=1)
    cache = reference_cache(step)
    per_block = BLOCK_SIZE // R
    checked = 0
    for request, (context, new) in enumerate(zip(CONTEXTS, NEW_TOKENS)):
        rows = step.all_rows[request]
        for window in range(context // R, (context + new - 1) // R + 1):
            last = min(window * R + R, context + new) - 1  # the step's last token of the window
            positions = [min(p, last) for p in range(window * R, window * R + R)]
            pooled = pool_window_rows(rows[positions][None], step.norm_weight, 1e-6, step.slot_bias, "learned")
            expected = neox_rotary(pooled, step.cos_sin_cache[window * R][None])[0]
            block = step.block_table[request, window // per_block]
            torch.testing.assert_close(cache[block, window % per_block, 0], expected, rtol=0, atol=0)
            checked += 1
    assert checked == 8
    assert (step.window_token == -1).any() and (step.window_token >= 0).any()  # both sources are exercised


def vllm_gemma_rms_norm(x, weight, eps):
    """vLLM's `GemmaRMSNorm.forward_static` (without a residual), transcribed: the serving layer's key norm."""
    orig_dtype = x.dtype
    x = x.float()
    variance = x.pow(2).mean(dim=-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    x = x * (1.0 + weight.float())
    return x.to(orig_dtype)


def test_the_norm_is_vllms_gemma_rms_norm_bit_for_bit_in_bfloat16():
    """The serving layer's pooled keys were normed by vLLM's GemmaRMSNorm before the write moved here: the
    reference's norm is that computation, bit for bit."""
    x, weight = torch.randn(5, 3, HEAD_DIM).bfloat16(), torch.randn(HEAD_DIM)
    assert torch.equal(gemma_rms_norm(x, weight, 1e-6), vllm_gemma_rms_norm(x, weight, 1e-6))
    assert not torch.equal(gemma_rms_norm(x, weight, 1e-6), gemma_rms_norm(x, weight + 1, 1e-6))


@pytest.mark.parametrize("fp8", [False, True], ids=["float_cache", "fp8_cache"])
def test_write_keep_false_leaves_every_row_unchanged(fp8):
    step = WriteStep(CONTEXTS, NEW_TOKENS, "mean", fp8=fp8, seed=3)
    step.write_keep[:] = False
    writers = [write_pooled_keys_torch] + ([write_pooled_keys_triton] if write_pooled_keys_triton else [])
    for write in writers:
        cache = step.cache.clone()
        write(*step.args(cache))
        assert torch.equal(cache, step.cache), write.__name__
    step.write_keep[::2] = True  # only the kept tokens' destinations change
    cache = reference_cache(step)
    kept = torch.zeros(cache.shape[:2], dtype=torch.bool)
    kept[step.write_block[step.write_keep], step.write_row[step.write_keep]] = True
    assert torch.equal(cache[~kept], step.cache[~kept])
    assert not torch.equal(cache[kept], step.cache[kept])


def triton_cache_matching_the_reference(step, fp8: bool) -> torch.Tensor:
    """The step's cache after the Triton write, checked against the reference's: equal bytes for fp8 (the rotation's
    sums differ from the butterflies' only in their last float32 bit, which moves an fp8 rounding only for a value
    within that bit of a rounding midpoint: none here), float32 rounding otherwise."""
    expected = reference_cache(step)
    cache = step.cache.clone()
    write_pooled_keys_triton(*step.args(cache))
    if fp8:
        assert torch.equal(cache, expected)
    else:
        torch.testing.assert_close(cache, expected, rtol=2e-6, atol=2e-6)
    return cache


@requires_triton
@pytest.mark.parametrize("weighting", WEIGHTINGS)
@pytest.mark.parametrize("fp8", [False, True], ids=["float_cache", "fp8_cache"])
def test_triton_writes_what_the_reference_writes(weighting, fp8):
    step = WriteStep(CONTEXTS, NEW_TOKENS, weighting, fp8=fp8, seed=4 + fp8)
    cache = triton_cache_matching_the_reference(step, fp8)
    written = torch.zeros(cache.shape[:2], dtype=torch.bool)
    written[step.write_block, step.write_row] = True
    assert torch.equal(cache[~written], step.cache[~written])  # nothing else is touched


@requires_triton
@pytest.mark.parametrize("head_dim, rotary_dim, fp8", [
    (64, 32, True),    # the rotation in chunks of columns
    (48, 24, False),   # rotary halves and the rest not powers of two (masked lanes)
    (32, 32, False),   # every channel rotated: no rest
])
def test_triton_writes_what_the_reference_writes_at_other_widths(head_dim, rotary_dim, fp8):
    step = WriteStep(CONTEXTS, NEW_TOKENS, "learned_scalar", fp8=fp8, seed=head_dim, head_dim=head_dim,
                     rotary_dim=rotary_dim)
    cache = triton_cache_matching_the_reference(step, fp8)
    assert not torch.equal(cache, step.cache)


@requires_triton
@pytest.mark.parametrize("tiles", [(16, 32), (8, 16), (8, 8)], ids=["16_bit", "float32_d128", "float32_d64"])
def test_triton_packs_what_the_reference_packs_with_every_launch_tile(monkeypatch, tiles):
    """Every (tokens per program, rotation columns) that `tiles_of` plans for an fp8 write, each forced here at
    d = 64 (the interpreter's rows are float32 and would get one). 22 tokens: a partial last program every time;
    several chunks of columns."""
    from hybrid_indexpool.kernels.pooled_key_write import triton_impl

    planned = {triton_impl.tiles_of(dtype, True, head_dim) for dtype in (torch.bfloat16, torch.float16, torch.float32)
               for head_dim in (64, 128)}
    assert planned == {(16, 32), (8, 16), (8, 8)}
    monkeypatch.setattr(triton_impl, "tiles_of", lambda step_dtype, packed, head_dim: tiles)
    step = WriteStep(CONTEXTS, NEW_TOKENS, "learned", fp8=True, seed=10, head_dim=64, rotary_dim=32)
    assert len(step.write_token) % tiles[0] != 0
    cache = triton_cache_matching_the_reference(step, fp8=True)
    assert not torch.equal(cache, step.cache)


@requires_triton
@pytest.mark.parametrize("fp8", [False, True], ids=["float_cache", "fp8_cache"])
def test_triton_stores_the_pool_of_write_token_not_of_the_token_itself(fp8):
    step = WriteStep(CONTEXTS, NEW_TOKENS, "learned", fp8=fp8, seed=9, own_rows=True)
    assert not torch.equal(step.window_token, step.window_token[step.write_token])  # the pools do differ
    # A destination of its own for every token (shuffled rows past the null block): with shared ones the window's
    # last token, whose own pool is the one to store, would land last in the interpreter whatever the others wrote.
    num_tokens, per_block = len(step.write_token), BLOCK_SIZE // R
    destination = torch.randperm(num_tokens, generator=torch.Generator().manual_seed(9)) + per_block
    step.write_block, step.write_row = destination // per_block, destination % per_block
    step.cache = step.cache[:1].expand(-(-num_tokens // per_block) + 1, -1, -1, -1).clone()
    triton_cache_matching_the_reference(step, fp8)


@requires_triton
def test_triton_reads_a_float32_ring_into_a_bfloat16_step_as_the_reference_does():
    """Ring rows of another dtype are converted to the step's dtype first (the interpreter computes bfloat16 wrongly,
    so the step stays float32 here and the ring is float64)."""
    step = WriteStep(CONTEXTS, NEW_TOKENS, "learned_scalar", seed=6)
    step.ring_cache = step.ring_cache.double() + 1e-12
    expected = reference_cache(step)
    cache = step.cache.clone()
    write_pooled_keys_triton(*step.args(cache))
    torch.testing.assert_close(cache, expected, rtol=2e-6, atol=2e-6)


@requires_triton
def test_triton_rounds_float32_to_fp8_as_torch_does():
    """Every fp8 value, the midpoints between neighbours (ties to even), a float32 step either side of them, zeros
    and random values, positive and negative."""
    codes = torch.arange(0, 0x7F, dtype=torch.uint8)  # 0x7F is NaN
    values = codes.view(FP8_DTYPE).float()
    midpoints = (values[:-1] + values[1:]) / 2
    steps = [torch.nextafter(midpoints, torch.tensor(math.inf)), torch.nextafter(midpoints, torch.tensor(0.0))]
    samples = torch.cat([values, midpoints, *steps, torch.rand(2000) * 448, torch.rand(500) * 2.0**-6,
                         torch.tensor([0.0, 2.0**-10, 3 * 2.0**-11, 2.0**-130, 448.0, 447.99])])
    samples = torch.cat([samples, -samples])
    got = torch.empty(samples.shape, dtype=torch.uint8)
    _convert_to_fp8[(-(-len(samples) // 1024),)](samples, got, len(samples), BLOCK=1024)
    assert torch.equal(got, samples.to(FP8_DTYPE).view(torch.uint8))


@requires_triton
def test_triton_packs_keys_as_quantize_pooled_keys_does():
    """Random keys; keys whose rotated maximum over 448 is exactly a power of two (the scale is that power, not the
    next: one-hot rotated keys of 56 and 7, exact at d = 16); a zero key (scale 1); tiny and large keys."""
    from hybrid_indexpool.kernels.fp8_index_keys import quantize_pooled_keys

    head_dim = 16
    generator = torch.Generator().manual_seed(8)
    keys = torch.randn(16, head_dim, generator=generator)
    keys[0] = 14.0  # rotated: (56, 0, ..., 0)
    keys[1] = -1.75  # rotated: (-7, 0, ..., 0)
    keys[2] = 0.0
    keys[3] *= 1e-20
    keys[4] *= 1e20
    packed = torch.zeros(16, head_dim + 4, dtype=torch.uint8)
    _pack_keys[(1,)](keys, packed, 16, HALF=4, HEAD_DIM=head_dim)
    expected = quantize_pooled_keys(keys)
    assert expected[0, head_dim:].view(torch.float32).item() == 2.0**-3  # the exact power of two is its own scale
    assert torch.equal(packed, expected)


def test_the_guard_catches_host_reads():
    values = torch.tensor([3, 0, 2])
    for read in (lambda: values.max().item(), lambda: values.tolist(), lambda: bool(values[0]),
                 lambda: int(values[1]), lambda: values[values > 0], lambda: torch.nonzero(values),
                 lambda: values.nonzero(), lambda: range(values[0]), lambda: values.cpu()):
        with pytest.raises(AssertionError, match="host sync|boolean-mask"):
            with HostSyncGuard():
                read()
    assert values.max().item() == 3  # lifted afterwards


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("fp8", [False, True], ids=["float_cache", "fp8_cache"])
def test_no_host_sync_in_the_write_and_the_paged_selection(backend, fp8):
    from hybrid_indexpool.kernels.pooled_index_topk import paged_pooled_index_topk_torch, paged_pooled_index_topk_triton

    from .test_paged_pooled_index_topk import PagedStep

    if backend == "triton" and write_pooled_keys_triton is None:
        pytest.skip("Triton is not installed")
    write = write_pooled_keys_torch if backend == "torch" else write_pooled_keys_triton
    select = paged_pooled_index_topk_torch if backend == "torch" else paged_pooled_index_topk_triton
    step = WriteStep(CONTEXTS, NEW_TOKENS, "learned", fp8=fp8, seed=7)
    paged = PagedStep([30, 2, 17], [11, 1, 6], block_size=12, fp8=fp8, seed=7)
    cache = step.cache.clone()
    with HostSyncGuard():
        write(*step.args(cache))
        selected = select(*paged.args(48), 6, paged.head_weights, 1, 1)
    assert not torch.equal(cache, step.cache)
    assert selected.shape == (len(paged.num_visible), 6)


def test_the_entry_point_runs_the_reference_on_cpu_tensors(monkeypatch):
    from hybrid_indexpool.kernels import pooled_key_write

    calls = []
    monkeypatch.setattr(pooled_key_write, "write_pooled_keys_torch", lambda *args: calls.append(args))
    step = WriteStep(CONTEXTS, NEW_TOKENS, "mean")
    write_pooled_keys(*step.args())
    assert len(calls) == 1


def test_mismatched_settings_are_refused():
    step = WriteStep(CONTEXTS, NEW_TOKENS, "learned")
    args = list(step.args())
    args[10] = "mean"  # gate logits of width d for a pooling without gates
    with pytest.raises(ValueError, match="channels"):
        write_pooled_keys_torch(*args)
    args[10] = "average"
    with pytest.raises(ValueError, match="Unknown pooling weighting"):
        write_pooled_keys_torch(*args)
