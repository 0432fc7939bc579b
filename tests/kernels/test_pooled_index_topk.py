import pytest
import torch

from hybrid_indexpool.kernels.pooled_index_topk import pooled_index_topk, reference


def slow_topk(index_queries, pooled_keys, num_visible, topk, head_weights, sink_windows=0, local_windows=0):
    """One query at a time: the forced windows (first `sink_windows`, last `local_windows` visible), then every other
    visible window scored, best first, ties to the lower id."""
    batch, queries, heads, dim = index_queries.shape
    result = torch.full((batch, queries, topk), -1, dtype=torch.long)
    for b in range(batch):
        for t in range(queries):
            visible = int(num_visible[b, t])
            forced = {c for c in range(visible) if c < sink_windows or c >= visible - local_windows}
            scored = []
            for c in range(visible):
                if c in forced:
                    continue
                per_head = [max(0.0, float(index_queries[b, t, h] @ pooled_keys[b, c])) for h in range(heads)]
                weights = [1.0] * heads if head_weights is None else head_weights[b, t].tolist()
                scored.append((-sum(w * s for w, s in zip(weights, per_head)) / dim**0.5, c))
            chosen = sorted(forced | {c for _, c in sorted(scored)[: topk - len(forced)]})
            result[b, t, : len(chosen)] = torch.tensor(chosen, dtype=torch.long)
    return result


# Both ways to the selection: fixed shapes with packed keys (decode), float top-k with host bounds (prefill).
PATHS = pytest.mark.parametrize("host_bounds", [False, True], ids=["packed_keys", "host_bounds"])


def select(index_queries, pooled_keys, num_visible, topk, head_weights=None, host_bounds=False):
    limit = pooled_keys.shape[1] if host_bounds else None
    return pooled_index_topk(index_queries, pooled_keys, num_visible, topk, head_weights, window_limit=limit)


@PATHS
@pytest.mark.parametrize("with_head_weights", [False, True])
@pytest.mark.parametrize("topk", [1, 3, 8])
def test_matches_one_query_at_a_time(with_head_weights, topk, host_bounds):
    generator = torch.Generator().manual_seed(topk)
    batch, queries, heads, dim, windows = 2, 9, 3, 8, 12
    index_queries = torch.randn(batch, queries, heads, dim, generator=generator, dtype=torch.float64)
    pooled_keys = torch.randn(batch, windows, dim, generator=generator, dtype=torch.float64)
    num_visible = torch.randint(0, windows + 1, (batch, queries), generator=generator)
    head_weights = torch.randn(batch, queries, heads, generator=generator) if with_head_weights else None
    ours = select(index_queries, pooled_keys, num_visible, topk, head_weights, host_bounds)
    assert torch.equal(ours, slow_topk(index_queries, pooled_keys, num_visible, topk, head_weights))


@PATHS
def test_chunked_candidates_and_queries_give_the_same_selection(monkeypatch, host_bounds):
    generator = torch.Generator().manual_seed(0)
    index_queries = torch.randn(2, 40, 2, 8, generator=generator)
    pooled_keys = torch.randn(2, 300, 8, generator=generator)
    num_visible = torch.randint(0, 301, (2, 40), generator=generator)
    whole = select(index_queries, pooled_keys, num_visible, 16, host_bounds=host_bounds)
    monkeypatch.setattr(reference, "_chunk_sizes", lambda *args: (7, 33))
    chunked = select(index_queries, pooled_keys, num_visible, 16, host_bounds=host_bounds)
    assert torch.equal(whole, chunked)


@PATHS
def test_ties_go_to_the_lower_window_and_invisible_windows_are_never_chosen(host_bounds):
    # Every score is zero (ReLU of negative products): the lowest ids win.
    index_queries = -torch.ones(1, 2, 1, 4)
    pooled_keys = torch.ones(1, 10, 4)
    num_visible = torch.tensor([[10, 2]])
    selected = select(index_queries, pooled_keys, num_visible, 3, host_bounds=host_bounds)
    assert selected.tolist() == [[[0, 1, 2], [0, 1, -1]]]


@PATHS
@pytest.mark.parametrize("window_chunk", [3, 5, 64])
def test_many_ties_across_chunks_match_one_query_at_a_time(monkeypatch, window_chunk, host_bounds):
    # Small integer keys and queries: many windows score exactly the same, in every chunk.
    generator = torch.Generator().manual_seed(window_chunk)
    index_queries = torch.randint(-1, 2, (2, 6, 2, 4), generator=generator).double()
    pooled_keys = torch.randint(-1, 2, (2, 40, 4), generator=generator).double()
    num_visible = torch.randint(0, 41, (2, 6), generator=generator)
    monkeypatch.setattr(reference, "_chunk_sizes", lambda *args: (4, window_chunk))
    for topk in (1, 4, 9):
        selected = select(index_queries, pooled_keys, num_visible, topk, host_bounds=host_bounds)
        assert torch.equal(selected, slow_topk(index_queries, pooled_keys, num_visible, topk, None))


@PATHS
def test_a_row_of_nan_never_changes_another_rows_selection(host_bounds):
    generator = torch.Generator().manual_seed(3)
    index_queries = torch.randint(-1, 2, (2, 5, 2, 4), generator=generator).float()  # many tied scores
    pooled_keys = torch.randint(-1, 2, (2, 30, 4), generator=generator).float()
    num_visible = torch.full((2, 5), 30)
    clean = select(index_queries, pooled_keys, num_visible, 6, host_bounds=host_bounds)
    broken = pooled_keys.clone()
    broken[0] = float("nan")
    assert torch.equal(select(index_queries, broken, num_visible, 6, host_bounds=host_bounds)[1], clean[1])


@PATHS
@pytest.mark.parametrize("sink_windows, local_windows", [(1, 0), (0, 2), (2, 3), (3, 3)])
def test_sink_and_local_windows_are_always_selected_inside_the_budget(sink_windows, local_windows, host_bounds,
                                                                        monkeypatch):
    generator = torch.Generator().manual_seed(sink_windows * 10 + local_windows)
    batch, queries, heads, dim, windows, topk = 2, 11, 2, 8, 40, 6
    index_queries = torch.randn(batch, queries, heads, dim, generator=generator, dtype=torch.float64)
    pooled_keys = torch.randn(batch, windows, dim, generator=generator, dtype=torch.float64)
    num_visible = torch.randint(0, windows + 1, (batch, queries), generator=generator)
    expected = slow_topk(index_queries, pooled_keys, num_visible, topk, None, sink_windows, local_windows)
    limit = windows if host_bounds else None
    ours = pooled_index_topk(index_queries, pooled_keys, num_visible, topk, window_limit=limit,
                             sink_windows=sink_windows, local_windows=local_windows)
    assert torch.equal(ours, expected)
    monkeypatch.setattr(reference, "_chunk_sizes", lambda *args: (4, 7))  # forced windows across window chunks
    chunked = pooled_index_topk(index_queries, pooled_keys, num_visible, topk, window_limit=limit,
                                sink_windows=sink_windows, local_windows=local_windows)
    assert torch.equal(chunked, expected)


def test_forced_windows_beyond_the_budget_are_refused():
    index_queries, pooled_keys = torch.randn(1, 1, 1, 4), torch.randn(1, 10, 4)
    with pytest.raises(ValueError, match="must be >= 0 and fit in topk"):
        pooled_index_topk(index_queries, pooled_keys, torch.tensor([[10]]), 3, sink_windows=2, local_windows=2)
