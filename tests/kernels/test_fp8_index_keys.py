"""fp8 pooled index keys: the rotation, the power-of-two scales, the packed layout, and every selection path (the
PyTorch reference, the CPU kernel, Triton in its interpreter) scoring packed keys the same way."""

import math

import pytest
import torch

from hybrid_indexpool.kernels.fp8_index_keys import (
    FP8_DTYPE,
    dequantize_pooled_keys,
    fp8_round_trip_unrotated,
    hadamard_transform,
    packed_width,
    quantize_pooled_keys,
    rotate_queries,
    unpack,
)
from hybrid_indexpool.kernels.fp8_index_keys.reference import FP8_MAX, power_of_two_scales
from hybrid_indexpool.kernels.pooled_index_topk import (
    cpu_impl,
    pooled_index_scores_torch,
    pooled_index_topk,
    pooled_index_topk_torch,
    pooled_index_topk_triton,
)

requires_cpu_kernel = pytest.mark.skipif(cpu_impl.KERNEL.load() is None,
                                         reason=f"the CPU kernel could not be built: {cpu_impl.KERNEL.error}")
requires_triton = pytest.mark.skipif(pooled_index_topk_triton is None, reason="Triton is not installed")
# Every float8_e4m3fn code but the two NaNs.
FINITE_CODES = torch.tensor([code for code in range(256) if code & 0x7F != 0x7F], dtype=torch.uint8)


def sylvester_hadamard(dim: int) -> torch.Tensor:
    matrix = torch.ones(1, 1)
    while matrix.shape[0] < dim:
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)], 0)
    return matrix / math.sqrt(dim)


def test_the_rotation_is_the_orthonormal_walsh_hadamard_matrix():
    x = torch.randn(3, 5, 64)
    torch.testing.assert_close(hadamard_transform(x), x @ sylvester_hadamard(64), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hadamard_transform(hadamard_transform(x)), x, atol=1e-5, rtol=1e-5)
    query, key = torch.randn(64), torch.randn(64)
    torch.testing.assert_close(hadamard_transform(query) @ hadamard_transform(key), query @ key, atol=1e-4, rtol=1e-5)


def test_the_rotation_refuses_a_head_dimension_that_is_not_a_power_of_two():
    with pytest.raises(ValueError, match="power-of-two head dimension, got 48"):
        hadamard_transform(torch.randn(2, 48))


def test_scales_are_the_smallest_powers_of_two_that_fit_fp8():
    keys = torch.randn(200, 128) * torch.logspace(-6, 3, 200)[:, None]
    keys[0] = 0.0
    keys[1, :] = 0.0
    keys[1, 7] = 448.0 * 2.0**-3  # an exact power of two times 448: its own scale, not twice it
    scales = power_of_two_scales(keys)
    assert scales[0] == 1.0 and scales[1] == 2.0**-3
    mantissa, _ = torch.frexp(scales)
    assert torch.all(mantissa == 0.5)  # powers of two
    amax = keys.abs().amax(dim=-1)
    assert torch.all(amax / scales <= FP8_MAX) and torch.all(amax[2:] / scales[2:] > FP8_MAX / 2)


def test_packed_keys_hold_fp8_values_and_scales_and_dequantize_exactly():
    keys = torch.randn(2, 33, 128) * 3
    packed = quantize_pooled_keys(keys)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 33, packed_width(128)) == (2, 33, 132)
    values, scales = unpack(packed)
    assert values.dtype == FP8_DTYPE and scales.shape == (2, 33)
    rotated = hadamard_transform(keys)
    torch.testing.assert_close(values.float() * scales[..., None], dequantize_pooled_keys(packed), atol=0, rtol=0)
    # Rounding to 3 mantissa bits: within 1/16 of each key's largest value.
    error = (dequantize_pooled_keys(packed) - rotated).abs().amax(dim=-1) / rotated.abs().amax(dim=-1)
    assert error.max() <= 1 / 16
    sliced_values, sliced_scales = unpack(packed[:, 5:9])  # views of a window range work too
    assert torch.equal(sliced_scales, scales[:, 5:9]) and torch.equal(sliced_values.view(torch.uint8),
                                                                       packed[:, 5:9, :128])


def test_the_unrotated_round_trip_is_the_packed_scheme_without_the_rotation():
    keys = torch.randn(3, 40, 64) * 5
    keys[0, 0, 3] = 900.0  # an outlier channel: without the rotation its key's scale flattens the other channels
    round_trip = fp8_round_trip_unrotated(keys)
    scales = power_of_two_scales(keys)
    # The same fp8 codes and scale the packed keys would hold, taken in the unrotated basis.
    assert torch.equal(round_trip, (keys / scales[..., None]).to(FP8_DTYPE).float() * scales[..., None])
    error = (round_trip - keys).abs().amax(dim=-1) / keys.abs().amax(dim=-1)
    assert error.max() <= 1 / 16 and round_trip.dtype == torch.float32
    # Rotating the packed keys back gives keys in the same basis, within fp8 rounding of each other.
    rotated_back = hadamard_transform(dequantize_pooled_keys(quantize_pooled_keys(keys)))
    assert (rotated_back - round_trip)[1:].abs().max() <= 0.2 * keys[1:].abs().max()


def test_scores_against_packed_keys_are_the_full_precision_scores_up_to_fp8_rounding():
    queries, keys = torch.randn(2, 6, 4, 128), torch.randn(2, 50, 128)
    exact = pooled_index_scores_torch(queries, keys, None)
    quantized = pooled_index_scores_torch(queries, quantize_pooled_keys(keys), None)
    assert (quantized - exact).abs().max() <= 0.05 * exact.abs().max()


def test_the_reference_scores_packed_keys_as_rotated_queries_against_dequantized_keys():
    generator = torch.Generator().manual_seed(3)
    queries, keys = torch.randn(2, 9, 4, 64, generator=generator), torch.randn(2, 120, 64, generator=generator)
    visible = torch.randint(1, 120, (2, 9), generator=generator)
    weights = torch.rand(2, 9, 4, generator=generator)
    packed = quantize_pooled_keys(keys)
    expected = pooled_index_topk_torch(rotate_queries(queries), dequantize_pooled_keys(packed), visible, 16, weights)
    assert torch.equal(pooled_index_topk_torch(queries, packed, visible, 16, weights), expected)
    assert torch.equal(pooled_index_topk_torch(queries, packed, visible, 16, weights, window_limit=120), expected)


def code_keys(head_dim: int) -> torch.Tensor:
    """Packed keys `[1, codes, head_dim + 4]`: key c holds the c-th finite fp8 code in channel 0, zeros elsewhere,
    scale 2^-3."""
    values = torch.zeros(len(FINITE_CODES), head_dim, dtype=torch.uint8)
    values[:, 0] = FINITE_CODES
    scales = torch.full((len(FINITE_CODES), 1), 2.0**-3).view(torch.uint8)
    return torch.cat([values, scales], dim=-1)[None]


def channel_zero_queries(head_dim: int) -> torch.Tensor:
    """Two heads reading channel 0 with opposite signs (unrotated: they meet the stored values as they are)."""
    queries = torch.zeros(1, 1, 2, head_dim)
    queries[0, 0, 0, 0], queries[0, 0, 1, 0] = 1.0, -1.0
    return queries


@requires_cpu_kernel
@pytest.mark.parametrize("windows, head_dim, sinks, locals_", [(300, 128, 0, 0), (20000, 64, 1, 2), (77, 16, 0, 1)])
def test_the_cpu_kernel_selects_as_the_reference_on_packed_keys(windows, head_dim, sinks, locals_):
    generator = torch.Generator().manual_seed(windows)
    packed = quantize_pooled_keys(torch.randn(2, windows, head_dim, generator=generator))
    queries = torch.randn(2, 1, 4, head_dim, generator=generator)
    visible = torch.tensor([[windows - 2], [windows // 3]])
    weights = torch.rand(2, 1, 4, generator=generator)
    assert cpu_impl.fused_topk_applies(4, packed)
    expected = pooled_index_topk_torch(queries, packed, visible, 32, weights, None, sinks, locals_)
    assert torch.equal(cpu_impl.pooled_index_topk_cpu(queries, packed, visible, 32, weights, sinks, locals_), expected)
    assert torch.equal(pooled_index_topk(queries, packed, visible, 32, weights, None, sinks, locals_), expected)


@requires_cpu_kernel
def test_the_cpu_kernel_widens_every_fp8_code_as_torch_does():
    # Scores relu(v) + 2 relu(-v) of every finite code v order the keys; the selections of every size reveal that
    # order, which must be the reference's (torch's own fp8 conversion).
    keys, head_dim = code_keys(16), 16
    head_weights = torch.tensor([[[1.0, 2.0]]]) * math.sqrt(head_dim)
    weights = head_weights / math.sqrt(head_dim)
    queries = channel_zero_queries(head_dim).reshape(1, 2, head_dim)
    visible = torch.tensor([[keys.shape[1]]])
    for topk in (1, 5, 50, 120, 200, 253):
        expected = cpu_impl.select_with_keys(queries.reshape(1, 1, 2, head_dim), keys, visible, topk, weights, 0, 0)
        assert torch.equal(cpu_impl.run_pooled_topk_windows(queries, keys, weights, visible, topk, 1, 0, 0), expected)


@requires_triton
def test_triton_widens_every_fp8_code_exactly():
    from hybrid_indexpool.kernels.pooled_index_topk.triton_impl import plan_scores

    head_dim = 16
    keys = code_keys(head_dim)
    queries = channel_zero_queries(head_dim) * math.sqrt(head_dim)
    head_weights = torch.tensor([[[1.0, 2.0]]])
    visible = torch.tensor([[keys.shape[1]]])
    scores = torch.empty(1, 1, keys.shape[1])
    plan_scores(queries, keys, visible, head_weights, scores, num_splits=2).run()
    values = FINITE_CODES.view(FP8_DTYPE).float() * 2.0**-3
    assert torch.equal(scores[0, 0], values.relu() + 2 * (-values).relu())


@requires_triton
@pytest.mark.parametrize("queries_count, window_limit", [(1, None), (7, 90)])
def test_triton_selects_as_the_reference_on_packed_keys(queries_count, window_limit):
    generator = torch.Generator().manual_seed(queries_count)
    packed = quantize_pooled_keys(torch.randn(2, 100, 32, generator=generator))
    queries = torch.randn(2, queries_count, 4, 32, generator=generator)
    visible = torch.randint(1, 91, (2, queries_count), generator=generator)
    weights = torch.rand(2, queries_count, 4, generator=generator)
    expected = pooled_index_topk_torch(queries, packed, visible, 12, weights, window_limit, 1, 1)
    selected = pooled_index_topk_triton(queries, packed, visible, 12, weights, num_splits=3,
                                        window_limit=window_limit, sink_windows=1, local_windows=1)
    assert torch.equal(selected, expected)
