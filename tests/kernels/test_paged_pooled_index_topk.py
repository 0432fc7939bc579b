"""The paged selection (`paged_pooled_index_topk_torch`, the serving layer's scoring over vLLM's pages) against the
unpaged reference with each request's keys gathered contiguously, and the paged Triton score kernel (interpreter, in
float32) against the paged reference."""

import pytest
import torch

from hybrid_indexpool.kernels.fp8_index_keys import packed_width, quantize_pooled_keys
from hybrid_indexpool.kernels.pooled_index_topk import (
    paged_pooled_index_topk,
    paged_pooled_index_topk_torch,
    paged_pooled_index_topk_triton,
    pooled_index_topk_torch,
    reference,
)

requires_triton = pytest.mark.skipif(paged_pooled_index_topk_triton is None, reason="Triton is not installed")
R = 4


class PagedStep:
    """A step of several requests over a paged pooled-key cache: request `q` has `windows[q]` pooled keys (window `w`
    at row `w % (block_size // r)` of its `w // (block_size // r)`-th block, blocks drawn from a shuffled pool, the
    null block 0 never used) and `new_tokens[q]` queries of this step, the last one seeing every window and each
    earlier one a window less every `r` tokens. Tiles of `width` queries of one request, as the serving builder makes
    them (a short tile repeats its last token)."""

    def __init__(self, windows, new_tokens, block_size, heads=3, head_dim=16, fp8=False, ties=False,
                 table_dtype=torch.int64, weights=True, seed=0, width=None):
        generator = torch.Generator().manual_seed(seed)
        per_block = block_size // R
        draw = (lambda *shape: torch.randint(-1, 2, shape, generator=generator).float()) if ties else (
            lambda *shape: torch.randn(*shape, generator=generator))
        self.keys = [draw(count, head_dim) for count in windows]  # each request's keys, contiguous
        if fp8:
            self.keys = [quantize_pooled_keys(keys) for keys in self.keys]
        blocks_needed = [-(-count // per_block) for count in windows]
        num_blocks = sum(blocks_needed) + 3
        order = torch.randperm(num_blocks - 1, generator=generator) + 1  # block 0 is the null block
        key_width = packed_width(head_dim) if fp8 else head_dim
        # Every row not holding a key is garbage that no selection may read.
        if fp8:
            self.cache = quantize_pooled_keys(1e3 * torch.randn(num_blocks, per_block, 1, head_dim,
                                                                generator=generator))
        else:
            self.cache = 1e3 * torch.randn(num_blocks, per_block, 1, key_width, generator=generator)
        self.block_table = torch.zeros(len(windows), max(blocks_needed) + 2, dtype=table_dtype)
        used = 0
        for request, (count, needed) in enumerate(zip(windows, blocks_needed)):
            pages = order[used:used + needed]
            used += needed
            self.block_table[request, :needed] = pages.to(table_dtype)
            for window in range(count):
                self.cache[pages[window // per_block], window % per_block, 0] = self.keys[request][window]
        self.token_request = torch.repeat_interleave(torch.arange(len(windows)), torch.tensor(new_tokens))
        num_tokens = len(self.token_request)
        self.queries = draw(num_tokens, heads, head_dim)
        self.head_weights = torch.rand(num_tokens, heads, generator=generator) if weights else None
        visible = []
        for count, new in zip(windows, new_tokens):
            visible += [max(0, count - (new - 1 - i) // R) for i in range(new)]
        self.num_visible = torch.tensor(visible)
        self.windows = windows
        self._tiles(new_tokens, width or min(8, max(new_tokens)))

    def _tiles(self, new_tokens, width):
        tile_tokens, tile_request, token_tile, first = [], [], [], 0
        for request, new in enumerate(new_tokens):
            for start in range(0, new, width):
                tokens = [first + min(start + i, new - 1) for i in range(width)]
                token_tile += [len(tile_tokens) * width + i for i in range(min(width, new - start))]
                tile_tokens.append(tokens)
                tile_request.append(request)
            first += new
        self.tile_tokens = torch.tensor(tile_tokens)
        self.tile_request = torch.tensor(tile_request)
        self.token_tile = torch.tensor(token_tile)

    def args(self, window_bound):
        return (self.queries, self.cache, self.block_table, self.tile_tokens, self.tile_request, self.token_tile,
                self.num_visible, window_bound)

    def tied_at(self, topk):
        """Tokens whose `topk`-th and next best visible windows score the same."""
        tied = 0
        for token, request in enumerate(self.token_request.tolist()):
            keys = self.keys[request][: int(self.num_visible[token])]
            per_head = (keys.float() @ self.queries[token].T).relu()  # [windows, heads]
            weights = 1.0 if self.head_weights is None else self.head_weights[token]
            scores = (per_head * weights).sum(-1).sort(descending=True).values
            tied += len(scores) > topk and bool(scores[topk - 1] == scores[topk])
        return tied

    def contiguous_selection(self, topk, sink_windows=0, local_windows=0):
        """The unpaged reference, one request at a time over its keys gathered contiguously."""
        selected = torch.empty(len(self.token_request), topk, dtype=torch.long)
        for request, keys in enumerate(self.keys):
            mine = self.token_request == request
            weights = None if self.head_weights is None else self.head_weights[mine][None]
            selected[mine] = pooled_index_topk_torch(self.queries[mine][None], keys[None], self.num_visible[mine][None],
                                                     topk, weights, sink_windows=sink_windows,
                                                     local_windows=local_windows)[0]
        return selected


STEPS = {  # windows per request, new tokens per request
    "decode": ([37, 5, 0, 21], [1, 1, 1, 1]),
    "mixed": ([30, 2, 17], [11, 1, 6]),  # a prefill chunk over several tiles beside a decode
}


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("block_size", [16, 12])
@pytest.mark.parametrize("keys", ["float", "fp8", "ties"])
def test_paged_selection_is_the_contiguous_selection(step, block_size, keys):
    windows, new_tokens = STEPS[step]
    paged = PagedStep(windows, new_tokens, block_size, fp8=keys == "fp8", ties=keys == "ties",
                      table_dtype=torch.int32 if block_size == 12 else torch.int64, seed=block_size,
                      weights=keys != "ties")  # head weights of 1: integer scores, many ties
    for topk, (sinks, locals_) in ((6, (0, 0)), (6, (1, 2)), (50, (0, 0))):
        expected = paged.contiguous_selection(topk, sinks, locals_)
        got = paged_pooled_index_topk_torch(*paged.args(64), topk, paged.head_weights, sinks, locals_)
        assert torch.equal(got, expected), (topk, sinks, locals_)
    if keys == "ties":  # the case must tie: some token's 6th and 7th best windows score the same
        assert paged.tied_at(6) > 0


def test_paged_selection_in_chunks_of_tiles_and_a_bound_of_exactly_the_windows(monkeypatch):
    paged = PagedStep(*STEPS["mixed"], block_size=12, seed=5)
    expected = paged.contiguous_selection(5, 1, 1)
    monkeypatch.setattr(reference, "PAGED_SCORE_CHUNK_BYTES", 1)  # one tile per chunk
    assert torch.equal(paged_pooled_index_topk_torch(*paged.args(max(paged.windows)), 5, paged.head_weights, 1, 1),
                       expected)


def test_ties_go_to_the_lower_window_and_invisible_windows_never_count():
    paged = PagedStep([10, 3], [2, 1], block_size=12, weights=False)
    paged.queries = -paged.queries.abs() - 1  # every product negative: every score zero
    paged.cache = paged.cache.abs() + 1
    selected = paged_pooled_index_topk_torch(*paged.args(16), 4)
    assert selected.tolist() == [[0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, -1]]


@requires_triton
@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("block_size, keys, num_splits", [(16, "float", None), (12, "float", 3), (12, "fp8", 2),
                                                          (16, "fp8", None), (12, "ties", 2)])
def test_triton_selects_as_the_paged_reference(step, block_size, keys, num_splits):
    windows, new_tokens = STEPS[step]
    paged = PagedStep(windows, new_tokens, block_size, fp8=keys == "fp8", ties=keys == "ties",
                      table_dtype=torch.int32 if block_size == 12 else torch.int64, seed=block_size + 1,
                      weights=keys != "ties")
    for topk, (sinks, locals_) in ((6, (1, 2)), (9, (0, 0))):
        expected = paged_pooled_index_topk_torch(*paged.args(48), topk, paged.head_weights, sinks, locals_)
        got = paged_pooled_index_topk_triton(*paged.args(48), topk, paged.head_weights, sinks, locals_,
                                             num_splits=num_splits)
        assert torch.equal(got, expected), (topk, sinks, locals_)


@requires_triton
def test_triton_writes_the_scores_of_every_visible_window_and_no_other(monkeypatch):
    """The score scratch of a tile: every window its queries can see holds the reference's score; no window past the
    tile's largest bound is written (the scratch's NaN stays)."""
    from hybrid_indexpool.kernels.pooled_index_topk import triton_impl

    paged = PagedStep(*STEPS["mixed"], block_size=12, seed=3)
    window_bound = 40
    scores = torch.full((len(paged.tile_tokens), paged.tile_tokens.shape[1], window_bound), float("nan"))
    triton_impl.plan_paged_scores(paged.queries, paged.cache, paged.block_table, paged.tile_tokens,
                                  paged.tile_request, paged.num_visible, paged.head_weights, scores, 2).run()
    for tile, tokens in enumerate(paged.tile_tokens):
        request = int(paged.tile_request[tile])
        bound = int(paged.num_visible[tokens].max())
        keys = paged.keys[request][:bound]
        expected = torch.einsum("qhd,wd->qhw", paged.queries[tokens], keys).relu()
        expected = (expected * paged.head_weights[tokens][..., None] * 16**-0.5).sum(1)
        torch.testing.assert_close(scores[tile, :, :bound], expected, rtol=1e-5, atol=1e-5)
        assert scores[tile, :, bound:].isnan().all()


@requires_triton
def test_bfloat16_inputs_run_the_gpu_tiles_and_select_as_the_reference():
    paged = PagedStep(*STEPS["mixed"], block_size=16, heads=16, seed=7, width=16)
    paged.queries, paged.cache = paged.queries.bfloat16(), paged.cache.bfloat16()
    expected = paged_pooled_index_topk_torch(*paged.args(64), 8, paged.head_weights)
    assert torch.equal(paged_pooled_index_topk_triton(*paged.args(64), 8, paged.head_weights), expected)


def test_the_entry_point_refuses_forced_windows_beyond_the_budget():
    paged = PagedStep([5], [1], block_size=16)
    with pytest.raises(ValueError, match="must be >= 0 and fit in topk"):
        paged_pooled_index_topk(*paged.args(8), 2, sink_windows=2, local_windows=1)
