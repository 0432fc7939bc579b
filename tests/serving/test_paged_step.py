"""The vLLM plugin's batched step without vLLM (`serving/paged_step.py`): its Triton path (the paged kernels, in
Triton's interpreter, float32) computes what its PyTorch path does, caches included, and neither reads anything back
from the device."""

import pytest
import torch

from hybrid_indexpool.kernels import pooled_index_topk, pooled_key_write, sparse_attention
from hybrid_indexpool.kernels.cpu_build import ENABLE_VARIABLE
from hybrid_indexpool.serving.synthetic_step import OperationCounter, StepSizes, count_step_operations, synthetic_step

pytest.importorskip("triton", reason="Triton is not installed: the step's kernels have nothing to run")

SIZES = dict(heads=4, kv_heads=2, head_dim=32, index_heads=2, index_head_dim=16, topk=16, block_size=12)
# A decode far beyond the budget, a prefill chunk starting and ending inside windows (attended in tiles by the PyTorch
# path), a decode within the budget, a prefill chunk beyond it.
CONTEXTS, NEW_TOKENS = [150, 37, 9, 90], [1, 40, 1, 7]


@pytest.fixture
def triton_path(monkeypatch):
    """The step's kernel entries take their Triton path on CPU tensors (Triton's interpreter)."""
    for module in (pooled_index_topk, pooled_key_write, sparse_attention):
        monkeypatch.setattr(module, "use_fast_path", lambda *tensors: True)


def run_step(fp8_index_keys: bool, weighting: str):
    step = synthetic_step(CONTEXTS, NEW_TOKENS, StepSizes(**SIZES, weighting=weighting, fp8_index_keys=fp8_index_keys),
                          dtype=torch.float32, padding=2, seed=3)
    with torch.no_grad():
        return step.run()[:sum(NEW_TOKENS)], step.caches


@pytest.mark.parametrize("fp8_index_keys, weighting", [(False, "learned"), (True, "learned"), (False, "mean"),
                                                       (False, "learned_scalar"), (False, "prenorm_mean")])
def test_triton_step_computes_what_the_pytorch_step_does(fp8_index_keys, weighting, request):
    expected, expected_caches = run_step(fp8_index_keys, weighting)
    request.getfixturevalue("triton_path")
    got, caches = run_step(fp8_index_keys, weighting)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(caches.main, expected_caches.main) and torch.equal(caches.open_window,
                                                                          expected_caches.open_window)
    if fp8_index_keys:  # packed bytes: the fp8 values and the scale of each written key
        different = (caches.pooled_keys != expected_caches.pooled_keys).any(-1)
        assert different.float().mean() < 0.01
    else:
        torch.testing.assert_close(caches.pooled_keys, expected_caches.pooled_keys, atol=1e-5, rtol=1e-5)
    # The step wrote something: the caches are not the ones drawn before it.
    fresh = synthetic_step(CONTEXTS, NEW_TOKENS, StepSizes(**SIZES, weighting=weighting,
                                                           fp8_index_keys=fp8_index_keys),
                           dtype=torch.float32, padding=2, seed=3).caches
    assert not torch.equal(fresh.main, caches.main) and not torch.equal(fresh.pooled_keys, caches.pooled_keys)


@pytest.mark.parametrize("path", ["torch", "cpu_kernel", "triton"])
def test_the_step_reads_nothing_back_from_the_device(path, request, monkeypatch):
    if path == "triton":
        request.getfixturevalue("triton_path")
    if path == "torch":
        monkeypatch.setenv(ENABLE_VARIABLE, "0")
    step = synthetic_step(CONTEXTS, NEW_TOKENS, StepSizes(**SIZES), dtype=torch.float32, padding=2)
    # The builder groups queries into request tiles only for the PyTorch attention, the one that reads them.
    assert (step.main.request_tiles is None) == (path != "torch")
    with torch.no_grad(), OperationCounter() as counter:
        output = step.run()
    assert output.shape == (sum(NEW_TOKENS) + 2, SIZES["heads"], SIZES["head_dim"])
    assert counter.operators > 0 and counter.host_syncs == 0
    with OperationCounter() as counter:  # the counter itself sees a read and a boolean mask
        bool(output.sum() > 0)
        output[output > 0]
    assert counter.host_syncs == 2


def test_a_decode_steps_operators_do_not_grow_with_the_context():
    """The PyTorch path's decode step runs as many operators at 4x the context (beyond the budget both times)."""
    counts = [count_step_operations(synthetic_step([context] * 3, [1] * 3, StepSizes(**SIZES), dtype=torch.float32))
              for context in (60, 240)]
    assert counts[0] == counts[1] and counts[0]["host_syncs"] == 0, counts


def test_the_triton_decode_step_launches_three_kernels(triton_path, monkeypatch):
    """On the Triton path a decode step is the pooled-key write, the paged scoring and the paged attention (one
    launch each) around a few PyTorch operators, at any context."""
    from triton.runtime import interpreter

    launches = []
    run = interpreter.InterpretedFunction.run

    def counted_run(self, *args, **kwargs):
        launches.append(self.fn.__name__)
        with torch.utils._python_dispatch._disable_current_modes():  # the interpreter's own copies are not counted
            return run(self, *args, **kwargs)

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", counted_run)
    counts = []
    for context in (60, 240):
        launches.clear()
        counts.append(count_step_operations(synthetic_step([context] * 3, [1] * 3, StepSizes(**SIZES),
                                                            dtype=torch.float32)))
        assert launches == ["_pooled_key_write_kernel", "_pooled_index_scores_kernel",
                            "_sparse_attention_forward_kernel"], launches
    assert counts[0] == counts[1] and counts[0]["host_syncs"] == 0 and counts[0]["operators"] < 40, counts


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_within_the_budget_every_visible_window_is_selected_without_scoring(path, request, monkeypatch):
    """Where the step's window bound fits the budget, the selection is every visible window (what the scoring would
    keep), `window_bound` wide, so the attention gathers no more windows than the contexts hold; the step's output is
    the attention over the scored selection."""
    from hybrid_indexpool.kernels.pooled_index_topk import paged_pooled_index_topk
    from hybrid_indexpool.kernels.sparse_attention import paged_sparse_attention
    from hybrid_indexpool.serving import paged_step

    if path == "triton":
        request.getfixturevalue("triton_path")
    sizes = StepSizes(**{**SIZES, "topk": 1024})  # 256 windows; the longest context is 151 tokens
    step = synthetic_step(CONTEXTS, NEW_TOKENS, sizes, dtype=torch.float32, padding=2, seed=5)
    main, settings = step.main, step.settings
    assert main.window_bound < settings.topk_windows
    scored = torch.cat([paged_pooled_index_topk(
        step.inputs["index_queries"], step.caches.pooled_keys, step.metadata["pooled_keys"].block_table,
        tiles.tile_tokens, tiles.tile_request, None, main.num_visible_windows, tiles.window_bound,
        settings.topk_windows, step.inputs["head_weights"]) for tiles in main.selection_tiles])[main.token_tile]
    selections = []
    monkeypatch.setattr(paged_step, "paged_pooled_index_topk", lambda *args, **kwargs: pytest.fail("scored"))
    original = paged_step.select_windows
    monkeypatch.setattr(paged_step, "select_windows", lambda *args: selections.append(original(*args)) or
                        selections[-1])
    head_dim = sizes.head_dim
    main_cache_before = step.caches.main.clone()
    with torch.no_grad():
        output = step.run()
        selected, = selections
        assert selected.shape == (len(output), main.window_bound)
        real = sum(NEW_TOKENS)  # padding tokens' selections differ (their output is unused)
        assert torch.equal(selected[:real], scored[:real, :main.window_bound])
        assert torch.all(scored[:real, main.window_bound:] == -1)
        expected = paged_sparse_attention(
            step.inputs["query"], step.caches.main[..., :head_dim], step.caches.main[..., head_dim:], main.block_table,
            main.token_request, scored, main.token_position, settings.pool_size, settings.scaling,
            step.inputs["output_gate"], request_tiles=main.request_tiles)
    assert not torch.equal(step.caches.main, main_cache_before)  # the step wrote its keys before attending
    torch.testing.assert_close(output[:real], expected[:real], atol=1e-5, rtol=1e-5)


# vLLM's GPU defaults: CUDA graphs FULL_AND_PIECEWISE (full graphs of uniform decode batches up to 512 tokens), a
# model of 1M tokens, r = 4, a budget of 2048 tokens.
GPU_DEFAULTS = dict(pool_size=4, block_size=256, max_model_len=1 << 20, full_graphs=True, max_graph_tokens=512)
GPU_TOPK_WINDOWS = 512


def build_main_metadata(contexts: list[int], new_tokens: list[int], padding: int = 0, host_lengths: bool = True,
                        **settings):
    """The main cache's metadata of a step (request `i`: `contexts[i]` cached, `new_tokens[i]` scheduled) from the
    plugin's builder, on the host; `host_lengths`: the requests' lengths are known on the host (vLLM's
    `seq_lens_cpu_upper_bound`)."""
    from hybrid_indexpool.serving.paged_step import PagedMetadataBuilder

    settings = {**GPU_DEFAULTS, **settings}
    block_size = settings.pop("block_size")
    num_tokens = sum(new_tokens) + padding
    builder = PagedMetadataBuilder("main", settings.pop("pool_size"), block_size, settings.pop("max_model_len"),
                                   num_tokens, len(contexts), torch.device("cpu"), **settings)
    lengths = torch.tensor(contexts) + torch.tensor(new_tokens)
    blocks = -(-int(lengths.max()) // block_size)
    block_table = 1 + torch.arange(len(contexts) * blocks).view(len(contexts), blocks)
    starts = torch.tensor([0, *torch.tensor(new_tokens).cumsum(0).tolist()], dtype=torch.int32)
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(contexts, new_tokens)])
    token_request = torch.repeat_interleave(torch.arange(len(contexts)), torch.tensor(new_tokens))
    slots = block_table[token_request, positions // block_size] * block_size + positions % block_size
    return builder.build(num_tokens, len(contexts), starts, starts, lengths.int(), block_table.int(),
                         torch.cat([slots, torch.full((padding,), -1)]), max(new_tokens), int(lengths.max()),
                         seq_lens_cpu=lengths.int() if host_lengths else None)


def visible_windows(contexts: list[int], new_tokens: list[int], pool_size: int = 4) -> int:
    """Complete windows the step's queries see, summed: what a selection must at least score."""
    return sum((position + 1) // pool_size for c, n in zip(contexts, new_tokens) for position in range(c, c + n))


def check_selection_rows(main, contexts, new_tokens):
    """Every scheduled token has its own row in its request's tile, scored against a bound of its visible windows."""
    offsets = torch.tensor([0, *torch.tensor(new_tokens).cumsum(0).tolist()])
    rows = torch.cat([tiles.tile_tokens.flatten() for tiles in main.selection_tiles])
    bounds = torch.cat([torch.full((tiles.tile_tokens.numel(),), tiles.window_bound) for tiles in main.selection_tiles])
    requests = torch.cat([tiles.tile_request.repeat_interleave(tiles.tile_tokens.shape[1])
                          for tiles in main.selection_tiles])
    token_rows = main.token_tile[:sum(new_tokens)]
    assert torch.equal(rows[token_rows], torch.arange(sum(new_tokens)))
    assert torch.equal(requests[token_rows], torch.repeat_interleave(torch.arange(len(contexts)),
                                                                     torch.tensor(new_tokens)))
    assert torch.all(bounds[token_rows] >= main.num_visible_windows[:sum(new_tokens)])
    assert torch.all(rows < offsets[requests + 1]) and torch.all(rows >= offsets[requests])


@pytest.mark.parametrize("contexts, new_tokens", [
    ([0], [8192]),  # an 8K prefill chunk
    ([8192] * 64, [1] * 64),  # 64 decodes at 8K, with a full graph of a batch larger than the captured ones
    ([8192] * 63 + [0], [1] * 63 + [8192]),  # both in one step
    ([1 << 20 - 1] + [8192] * 63 + [0], [1] * 64 + [2048]),  # a decode at 1M beside decodes and a chunk at 8K
], ids=["prefill_8k", "decodes_8k", "mixed_8k", "mixed_1m_decode"])
def test_a_steps_scores_are_bounded_by_its_own_queries(contexts, new_tokens):
    """Under vLLM's GPU defaults, a step that no full graph replays (prefill chunks, mixed batches, decode batches
    beyond the captured sizes) scores at most 2x the windows its queries see (not every window of a 1M-token model):
    decodes one row each, prefill chunks their tokens plus at most one tile per chunk."""
    from hybrid_indexpool.serving.paged_step import QUERY_TILE, selection_work

    graph_tokens = {} if sum(new_tokens) > 64 else {"max_graph_tokens": 32}
    main = build_main_metadata(contexts, new_tokens, **graph_tokens)
    check_selection_rows(main, contexts, new_tokens)
    work = selection_work(main, GPU_TOPK_WINDOWS)
    prefill_requests = sum(count > 1 for count in new_tokens)
    assert sum(new_tokens) <= work["rows"] <= sum(new_tokens) + QUERY_TILE * prefill_requests, work
    visible = visible_windows(contexts, new_tokens)
    assert visible <= work["scores"] <= 2 * visible, (work, visible)


def test_a_decode_batch_a_full_graph_replays_keeps_the_captured_bound():
    """The one exception: a uniform decode batch within the captured sizes is scored against every window a request
    can reach, the shapes it was captured with, whatever its contexts; the same batch with graphs off is not."""
    from hybrid_indexpool.serving.paged_step import selection_work

    contexts, new_tokens = [8192] * 64, [1] * 64
    shapes = []
    for context in (8192, 100_000):
        main = build_main_metadata([context] * 64, new_tokens, padding=8)
        (tiles,) = main.selection_tiles
        assert tiles.window_bound == (1 << 20) // 4 and tiles.tile_tokens.shape == (64, 1)
        shapes.append((main.window_bound, tiles.tile_tokens.shape))
    assert shapes[0] == shapes[1]
    eager = build_main_metadata(contexts, new_tokens, full_graphs=False)
    assert selection_work(eager, GPU_TOPK_WINDOWS)["scores"] == 64 * 2048


def test_without_host_lengths_the_longest_context_bounds_every_tile():
    """Where the engine gives no host lengths, every tile of a kind is bounded by the step's longest context: still
    one row per decode, and the step's own bound rather than the model's."""
    main = build_main_metadata([8192] * 3 + [0], [1] * 3 + [300], host_lengths=False)
    assert [(tiles.tile_tokens.shape[1], tiles.window_bound) for tiles in main.selection_tiles] == [(1, 2048),
                                                                                                   (64, 2048)]
    check_selection_rows(main, [8192] * 3 + [0], [1] * 3 + [300])


def test_a_mixed_step_selects_what_each_request_selects_alone():
    """The selection over several launches (decodes and prefill tiles, each at its own bound) picks, for every token,
    the windows of the reference selection over its request's pooled keys laid out in order."""
    from hybrid_indexpool.kernels.pooled_index_topk.reference import pooled_index_topk_torch
    from hybrid_indexpool.serving.paged_step import select_windows

    contexts, new_tokens = [600, 0, 9, 90], [1, 300, 1, 7]
    step = synthetic_step(contexts, new_tokens, StepSizes(**SIZES), dtype=torch.float32, padding=2, seed=4,
                          max_model_len=4096)
    main, pooled, settings = step.main, step.metadata["pooled_keys"], step.settings
    bounds = [(tiles.tile_tokens.shape[1], tiles.window_bound) for tiles in main.selection_tiles]
    # Decodes at 10 and 601 tokens; the chunks' tiles (the last one's queries see 75 windows).
    assert bounds == [(1, 64), (1, 256), (64, 64), (64, 128)], bounds
    assert main.window_bound > settings.topk_windows  # scored, not the within-budget shortcut
    queries, weights = step.inputs["index_queries"], step.inputs["head_weights"]
    with torch.no_grad():
        selected = select_windows(queries, weights, step.caches, main, pooled, settings)
    windows_per_block = SIZES["block_size"] // 4
    start = 0
    for request, (context, count) in enumerate(zip(contexts, new_tokens)):
        windows = torch.arange((context + count) // 4)
        keys = step.caches.pooled_keys[pooled.block_table[request, windows // windows_per_block].long(),
                                       windows % windows_per_block, 0]
        tokens = slice(start, start + count)
        expected = pooled_index_topk_torch(queries[None, tokens], keys[None],
                                           ((torch.arange(context, context + count) + 1) // 4)[None],
                                           settings.topk_windows, weights[None, tokens])[0]
        assert torch.equal(selected[tokens], expected), request
        start += count


def test_the_profiling_reservation_is_the_one_of_the_path_that_runs():
    """At Qwen3.8-Flash-Next's widths (16 heads of 256 on 2 key/value heads, 16 index heads of 128, a budget of 2048
    tokens at r = 4), vLLM's profiling step of 8K tokens in a 1M-token model: the Triton path (on CUDA) reserves its
    selection's chunk of scores and keys and the split attention's partials, about half a GiB, where the PyTorch path's
    gathers take over 2.5 GiB (the KV cache the GPU would lose)."""
    from hybrid_indexpool.kernels.pooled_index_topk.triton_impl import SCRATCH_ELEMENTS
    from hybrid_indexpool.serving.paged_step import IndexPoolStepSettings, step_working_memory_bytes

    sizes = StepSizes()
    tokens = 8192
    meta = dict(device="meta", dtype=torch.bfloat16)
    query = torch.empty(tokens, sizes.heads, sizes.head_dim, **meta)
    key = torch.empty(tokens, sizes.kv_heads, sizes.head_dim, **meta)
    index_queries = torch.empty(tokens, sizes.index_heads, sizes.index_head_dim, **meta)
    settings = IndexPoolStepSettings(
        pool_size=4, topk_windows=sizes.topk // 4, sink_windows=0, local_windows=0, scaling=0.0625, weighting="learned",
        key_norm_weight=torch.empty(0), key_norm_eps=1e-6, pool_slot_bias=None, cos_sin_cache=torch.empty(0))
    reserved = {path: step_working_memory_bytes(query, key, index_queries, settings, (1 << 20) // 4, path == "triton")
                for path in ("triton", "torch")}
    gib = 1 << 30
    # At least a chunk's float32 scores, int32 signs and int64 keys; at most 0.6 GiB.
    assert SCRATCH_ELEMENTS * 16 <= reserved["triton"] <= 0.6 * gib, reserved
    assert reserved["torch"] >= 2.5 * gib, reserved
