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
    scored = paged_pooled_index_topk(
        step.inputs["index_queries"], step.caches.pooled_keys, step.metadata["pooled_keys"].block_table,
        main.tile_tokens, main.tile_request, main.token_tile, main.num_visible_windows, main.window_bound,
        settings.topk_windows, step.inputs["head_weights"])
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
