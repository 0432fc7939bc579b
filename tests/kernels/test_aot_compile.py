"""Every Triton kernel compiles for real GPUs (sm_90, sm_80) at the model's real sizes, with Triton's default settings,
within the target's shared memory and without register spills but for the few measured ones (`spill_allowance`).

No GPU is needed: Triton's compiler and the `ptxas` in its wheel run on the CPU (`kernels/aot.py`). The default suite
compiles a representative subset (about a minute on 2 cores with a cold Triton cache); `pytest -m slow` compiles the
whole matrix.
"""

import dataclasses

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed: there is nothing to compile")

from hybrid_indexpool.kernels import aot  # noqa: E402

KERNELS = {"pooled_index_scores", "paged_pooled_index_scores", "pooled_key_write", "sparse_attention_forward",
           "combine_splits", "sparse_attention_backward_dq", "sparse_attention_backward_dkv",
           "paged_sparse_attention_forward", "paged_combine_splits"}
# Planned in decode only: the write compiles the same at any token count; prefill is never split.
DECODE_ONLY = {"combine_splits", "paged_combine_splits", "pooled_key_write"}
DECODE_KERNELS = {"pooled_index_scores", "paged_pooled_index_scores", "pooled_key_write", "sparse_attention_forward",
                  "combine_splits", "paged_sparse_attention_forward", "paged_combine_splits"}


def spill_allowance(row) -> int:
    """Spilled 4-byte words a configuration may have: none, but for what the whole matrix measured (ptxas of Triton
    3.9; docs/kernels.md): the float32 key-major backward at head dim 256 (three tf32 products of rows
    256 wide; 40-54 words) and at head dim 64 with a group of 16 (2), the dq pass in some 16-bit and float32
    configurations (2-10), and the float32 forward with a group of 16 at head dim 256 (2, on sm_90). Every decode and
    forward kernel in 16-bit spills nothing. The paged forward (its part of the matrix alone: 468 compilations)
    spills on sm_90 only: 2-6 words at 72 registers in 16-bit at head dim 64 with groups 1-4, and 2-4 in
    float32 at head dim 256 with groups 8 and 16; none at Qwen3.8-Flash-Next's widths nor in the default subset. An
    allowance is a bound, so a regression still fails."""
    if row.kernel == "sparse_attention_backward_dkv" and row.config.startswith("fp32"):
        return 64 if "HEAD_DIM=256" in row.config else 4
    if row.kernel == "sparse_attention_backward_dq":
        return 16
    if row.kernel == "sparse_attention_forward" and row.config.startswith("fp32") and "GROUP=16 HEAD_DIM=256" in \
            row.config:
        return 4
    if row.kernel == "paged_sparse_attention_forward" and row.capability == 90:
        if row.config.startswith("fp32") and "HEAD_DIM=256" in row.config:
            return 4
        if not row.config.startswith("fp32") and "HEAD_DIM=64" in row.config:
            return 8
    return 0


def check(results):
    assert {row.capability for row in results} == set(aot.CAPABILITIES)
    for row in results:
        where = f"{row.kernel} {row.mode} sm_{row.capability} {row.config}"
        assert row.shared <= row.shared_limit, f"{where}: {row.shared} bytes of shared memory"
        assert row.registers <= 255, where
        assert row.spills <= spill_allowance(row), f"{where}: {row.spills} registers spilled"


def show(results):
    """The register table, captured: pytest shows it when the test fails, and `pytest -s` always."""
    print("\n" + aot.format_table(results))


def test_every_kernel_compiles_for_sm90_and_sm80_within_their_limits():
    results = aot.compile_sizes(aot.default_sizes())
    show(results)
    for mode, kernels in (("decode", DECODE_KERNELS), ("prefill", KERNELS - DECODE_ONLY)):
        assert {row.kernel for row in results if row.mode == mode} == kernels
    # The paged kernels at Qwen3.8-Flash-Next's widths (16 heads on 2 key/value heads of 256, r = 4), with the output
    # gate in the store of the kernel that writes the output: the combine in decode, the forward in prefill.
    flash_next = "bf16 BLOCK_N=32 GROUP=8 HEAD_DIM=256 POOL=4 PAGED=True"
    assert {(row.mode, row.capability, "GATED=True" in row.config) for row in results
            if row.kernel == "paged_sparse_attention_forward" and row.config.startswith(flash_next)} == {
        (mode, capability, mode == "prefill") for mode in ("decode", "prefill") for capability in aot.CAPABILITIES}
    assert any(row.kernel == "paged_combine_splits" and row.config.startswith("bf16 HEAD_DIM=256")
               and "GATED=True HEADS=16" in row.config for row in results)
    # Qwen3.8-Flash-Next's indexer (16 heads x 128, r = 4, learned pooling of width 128, rotary 64): both score
    # kernels in decode and prefill and the write, float and fp8 keys, compiled (and checked below, spills included).
    flash_next = [row for row in results if "HEADS=16 HEAD_DIM=128" in row.config and row.config.startswith("bf16")]
    assert {(row.kernel, row.mode, "PACKED_FP8=True" in row.config) for row in flash_next} >= {
        (kernel, mode, fp8) for kernel in ("pooled_index_scores", "paged_pooled_index_scores")
        for mode in ("decode", "prefill") for fp8 in (False, True)}
    assert {"PACKED_FP8=True" in row.config for row in results if row.kernel == "pooled_key_write"
            and "HEAD_DIM=128 HALF=32 REST=64 POOL=4 GATES=128 PRENORM=False" in row.config} == {False, True}
    check(results)


def test_glm_sizes_compile_for_sm90_and_sm80_within_their_limits():
    """GLM-5.3-Flash: the indexer's 32 heads x 128 at r = 16 (float and fp8 keys) and MLA's 64 heads on one latent of
    512, budget 2048, decode and prefill."""
    results = aot.compile_sizes(aot.glm_sizes())
    show(results)
    assert {row.kernel for row in results} == {"pooled_index_scores", "paged_pooled_index_scores", "pooled_key_write",
                                               "sparse_latent_attention", "combine_splits"}
    assert any("HEADS=64" in row.config and "LATENT_DIM=512" in row.config and "POOL=16" in row.config
               for row in results if row.kernel == "sparse_latent_attention")
    check(results)


@pytest.mark.slow
def test_the_whole_size_matrix_compiles_within_the_limits(request):
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("the whole matrix compiles for about 20 minutes on 2 cores: run it with `pytest -m slow`")
    results = aot.compile_sizes(aot.full_sizes())
    show(results)
    check(results)


def test_decode_compiles_once_for_every_batch_size():
    """A decode step's launches specialise the same way at any batch size: the split count is a runtime argument,
    and no argument that follows the batch is specialised (equal to 1, divisible by 16); the paged ones too (the
    score kernel's tiles, the write's tokens, the attention's step of one token per request)."""
    base = aot.ModelSizes("decode", torch.bfloat16, pool_size=4, kernels="all")
    keys = aot.specialisation_keys([dataclasses.replace(base, batch=batch) for batch in (1, 2, 3, 8, 64, 200)])
    assert set(keys[0]) == DECODE_KERNELS
    assert all(batch_keys == keys[0] for batch_keys in keys[1:])


def _refuse(task):
    raise UnpicklableError(f"cannot compile {task}", "a second argument")


class UnpicklableError(Exception):
    def __init__(self, message, cause):  # two arguments: pickling keeps only the message, so unpickling fails
        super().__init__(message)
        self.cause = cause


def test_a_failing_compile_worker_is_reported_not_waited_for():
    with pytest.raises(RuntimeError, match=r"Compiling 7 failed in its worker:(.|\n)*cannot compile 7"):
        aot._in_workers(_refuse, [7], workers=1)


@pytest.mark.parametrize("kernels, latent_dim", [("paged", 0), ("attention", 0)])
@pytest.mark.parametrize("pool_size, group, head_dim", [(4, 8, 256), (1, 8, 256), (16, 16, 128), (4, 1, 64)])
def test_a_batch_of_one_decode_runs_a_program_per_multiprocessor(kernels, latent_dim, pool_size, group, head_dim):
    """A decode step of one request (two key/value heads: two programs a split) is split finely enough that the
    attention runs at least one program per multiprocessor of an H100 (132); its split covers whole windows, the
    combine merges every split."""
    sizes = aot.ModelSizes("decode", torch.bfloat16, pool_size=pool_size, group=group, head_dim=head_dim,
                           kernels=kernels, batch=1, latent_dim=latent_dim)
    launches = dict(aot.size_launches(sizes))
    forward = launches["paged_sparse_attention_forward" if kernels == "paged" else "sparse_attention_forward"]
    tokens, kv_heads, splits = forward.grid
    assert tokens == 1 and kv_heads == sizes.kv_heads
    assert tokens * kv_heads * splits >= sizes.multiprocessors, forward.grid
    combine = launches["paged_combine_splits" if kernels == "paged" else "combine_splits"]
    assert combine.args[3] == splits  # num_splits of the combine
