"""The plugin's batched IndexPool step (`serving/paged_step.py`, no vLLM) under speculative decoding and prefix caching:
verify steps whose rejected drafts wrote keys, pooled windows and ring rows leave every later output as plain
decoding computes it, with a ring of `ring_capacity` rows; a request resuming at a block boundary (a prefix-cache hit)
reads nothing of its ring."""

import random

import pytest
import torch

from hybrid_indexpool.serving.paged_step import (
    IndexPoolStepSettings,
    PagedCaches,
    PagedMetadataBuilder,
    indexpool_step,
    ring_capacity,
)
from hybrid_indexpool.serving.synthetic_step import neox_cos_sin_cache

R, BLOCK, HEADS, KV_HEADS, HEAD_DIM, INDEX_HEADS, INDEX_DIM = 4, 16, 4, 2, 16, 2, 16
TOPK_WINDOWS, MAX_LEN = 3, 256  # a budget of 12 tokens: beyond it from the 16th token on


@pytest.mark.parametrize("pool_size, drafts", [(4, 1), (4, 3), (4, 6), (2, 5)])
def test_ring_capacity_holds_the_open_window_and_every_draft(pool_size, drafts):
    capacity = ring_capacity(pool_size, drafts)
    windows = capacity // pool_size  # a power of two: the ring's rows divide vLLM's power-of-two block sizes
    assert capacity % pool_size == 0 and windows & (windows - 1) == 0 and capacity >= pool_size + drafts - 1
    assert ring_capacity(pool_size, 0) == pool_size


class Layer:
    """One IndexPool layer's random inputs per (position, token) and empty paged caches for one request."""

    def __init__(self, weighting: str, ring_rows: int, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.generator = generator
        gate_width = {"learned": INDEX_DIM, "learned_scalar": 1}.get(weighting, 0)
        self.width = INDEX_DIM + gate_width
        blocks = 1 + MAX_LEN // BLOCK
        self.caches = PagedCaches(main=torch.zeros(blocks, KV_HEADS, BLOCK, 2 * HEAD_DIM),
                                  pooled_keys=torch.zeros(blocks, BLOCK // R, 1, INDEX_DIM),
                                  open_window=torch.zeros(2, ring_rows, 1, self.width))
        self.block_table = torch.arange(1, blocks)[None]  # block 0 is the null block
        self.ring_table = torch.ones(1, 1, dtype=torch.long)
        self.builders = {kind: PagedMetadataBuilder(kind, R, ring_rows if kind == "open_window" else BLOCK, MAX_LEN,
                                                    MAX_LEN, 1, torch.device("cpu"))
                         for kind in ("main", "pooled_keys", "open_window")}
        self.settings = IndexPoolStepSettings(
            pool_size=R, topk_windows=TOPK_WINDOWS, sink_windows=0, local_windows=0, scaling=HEAD_DIM**-0.5,
            weighting=weighting, key_norm_weight=torch.randn(INDEX_DIM, generator=generator) * 0.3, key_norm_eps=1e-6,
            pool_slot_bias=torch.randn(R, gate_width, generator=generator) * 0.5 if gate_width else None,
            cos_sin_cache=neox_cos_sin_cache(MAX_LEN, INDEX_DIM // 2, "cpu"))

    def token_inputs(self, count: int) -> dict:
        """Random projections of `count` tokens."""
        def draw(*shape):
            return torch.randn(count, *shape, generator=self.generator)

        return dict(query=draw(HEADS, HEAD_DIM), key=draw(KV_HEADS, HEAD_DIM), value=draw(KV_HEADS, HEAD_DIM),
                    index_queries=draw(INDEX_HEADS, INDEX_DIM), ring_rows=draw(self.width),
                    head_weights=torch.rand(count, INDEX_HEADS, generator=self.generator),
                    output_gate=draw(HEADS, HEAD_DIM))

    def step(self, inputs: dict, start: int) -> torch.Tensor:
        """The step of the request's tokens `start .. start + len - 1` (`inputs` their projections)."""
        count = inputs["query"].shape[0]
        positions = torch.arange(start, start + count)
        slots = self.block_table[0, positions // BLOCK] * BLOCK + positions % BLOCK
        starts = torch.tensor([0, count], dtype=torch.int32)
        seq_lens = torch.tensor([start + count], dtype=torch.int32)
        metadata = {kind: builder.build(count, 1, starts, starts, seq_lens,
                                        self.ring_table if kind == "open_window" else self.block_table, slots, count,
                                        start + count, seq_lens_cpu=seq_lens)
                    for kind, builder in self.builders.items()}
        with torch.no_grad():
            return indexpool_step(**inputs, caches=self.caches, main=metadata["main"], pooled=metadata["pooled_keys"],
                                  ring=metadata["open_window"], settings=self.settings)


def draft_and_decode(weighting: str, max_drafts: int, capacity: int):
    """A prompt, then verify steps of 0 to `max_drafts` drafts with random acceptance (rejected drafts' projections are
    noise), and plain decoding of the same tokens one at a time, both with rings of `capacity` rows: (drafting's
    outputs at the real tokens, plain decoding's, the two layers, the rejected drafts)."""
    choices = random.Random(max_drafts)
    prompt, generated = 21, 60
    plain, drafted = Layer(weighting, capacity), Layer(weighting, capacity)
    inputs = plain.token_inputs(prompt + generated)

    def rows(first, last):
        return {name: tensor[first:last] for name, tensor in inputs.items()}

    expected = [plain.step(rows(0, prompt), 0)]
    expected += [plain.step(rows(position, position + 1), position) for position in range(prompt, prompt + generated)]
    outputs = [drafted.step(rows(0, prompt), 0)]
    position, rejected = prompt, 0
    while position < prompt + generated:
        drafts = choices.randint(0, max_drafts)
        good = min(choices.randint(0, drafts), prompt + generated - position - 1)
        noise = drafted.token_inputs(drafts - good)
        step_inputs = {name: torch.cat([rows(position, position + 1 + good)[name], noise[name]])
                       for name in inputs}
        outputs.append(drafted.step(step_inputs, position)[: 1 + good])
        position, rejected = position + 1 + good, rejected + drafts - good
    return torch.cat(outputs), torch.cat(expected), plain, drafted, rejected


@pytest.mark.parametrize("weighting", ["learned", "mean"])
@pytest.mark.parametrize("max_drafts", [3, 6])
def test_rejected_drafts_leave_plain_decodings_outputs(weighting, max_drafts):
    """Every real token's output is plain decoding's, and so are the complete windows' pooled keys and the open
    window's ring rows at the end."""
    capacity = ring_capacity(R, max_drafts)
    outputs, expected, plain, drafted, rejected = draft_and_decode(weighting, max_drafts, capacity)
    assert rejected > 20
    torch.testing.assert_close(outputs, expected, atol=1e-5, rtol=1e-5)
    length = expected.shape[0]
    windows = length // R
    torch.testing.assert_close(drafted.caches.pooled_keys.flatten(0, 1)[BLOCK // R: BLOCK // R + windows],
                               plain.caches.pooled_keys.flatten(0, 1)[BLOCK // R: BLOCK // R + windows])
    open_rows = torch.arange(windows * R, length) % capacity
    torch.testing.assert_close(drafted.caches.open_window[1, open_rows], plain.caches.open_window[1, open_rows])


def test_a_ring_of_r_rows_keeps_a_rejected_drafts_row():
    """With the ring plain decoding keeps (r rows) and drafts of up to 3, a rejected draft's raw key overwrites a row
    of the open window that the next step pools: outputs leave plain decoding's (what `ring_capacity` prevents)."""
    outputs, expected, _, _, _ = draft_and_decode("learned", 3, R)
    assert not torch.allclose(outputs, expected, atol=1e-3, rtol=1e-3)


def test_a_request_resuming_at_a_block_boundary_reads_nothing_of_its_ring():
    """A prefix-cache hit: a request whose first step starts at a block boundary (a multiple of r) over pages another
    request filled, with a ring of garbage (a fresh ring block), computes what the request that filled them computes
    from there on."""
    first, second = Layer("learned", R, seed=1), Layer("learned", R, seed=1)
    inputs = first.token_inputs(2 * BLOCK + 9)

    def rows(begin, end):
        return {name: tensor[begin:end] for name, tensor in inputs.items()}

    first.step(rows(0, 2 * BLOCK), 0)
    expected = first.step(rows(2 * BLOCK, 2 * BLOCK + 9), 2 * BLOCK)
    # The second request shares the two full blocks (main keys/values and pooled keys): copied, as vLLM shares them.
    second.caches.main.copy_(first.caches.main)
    second.caches.pooled_keys.copy_(first.caches.pooled_keys)
    second.caches.open_window.normal_(generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(second.step(rows(2 * BLOCK, 2 * BLOCK + 9), 2 * BLOCK), expected)
