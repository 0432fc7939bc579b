"""fp8 pooled index keys: a Hadamard rotation, one power-of-two scale per key, and the packed layout the cache holds.

A pooled key `k` (after pooling, norm and RoPE, full precision) is stored as

    k8 = fp8_e4m3(H k / s),   s = 2^ceil(log2(max|H k| / 448))

with `H` the orthonormal Walsh-Hadamard matrix of the head dimension `d` (a power of two). The rotation spreads an
outlier channel over all channels, so one scale per key loses less; queries are rotated the same way, so
`(H q) . (H k) = q . k` and the scores change only by the rounding. A power-of-two scale makes dequantisation exact
(`k8 * s` has no rounding), and since `s > 0`, `relu(q . (s k8)) = s relu(q . k8)`: a kernel may multiply the dot
product by the scale instead of every key element, with the same result.

Packed layout (what DeepSeek-V3.2's and GLM's fp8 indexer caches hold per entry): `uint8 [..., d + 4]`, the `d` fp8
bytes of `k8` followed by the 4 bytes of the float32 scale. At `d = 128` that is 132 bytes per pooled key, against 256
in bfloat16.
"""

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_BYTES = 4


def packed_width(head_dim: int) -> int:
    """Bytes of one packed key: the fp8 values and the float32 scale."""
    return head_dim + SCALE_BYTES


def is_packed(pooled_index_keys: torch.Tensor) -> bool:
    """Whether `pooled_index_keys` holds packed fp8 keys (uint8) rather than floating-point ones."""
    return pooled_index_keys.dtype == torch.uint8


def hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """`x @ H` over the last dimension (a power of two) in float32, `H` the orthonormal Walsh-Hadamard matrix
    (symmetric, its own inverse): log2(d) butterfly passes, no matrix held anywhere."""
    dim = x.shape[-1]
    if dim & (dim - 1):
        raise ValueError(f"The Hadamard rotation needs a power-of-two head dimension, got {dim}.")
    shape = x.shape
    out = x.float().reshape(-1, dim)
    half = 1
    while half < dim:
        pairs = out.view(-1, dim // (2 * half), 2, half)
        out = torch.stack((pairs[:, :, 0] + pairs[:, :, 1], pairs[:, :, 0] - pairs[:, :, 1]), dim=2).view(-1, dim)
        half *= 2
    return (out * dim**-0.5).view(shape)


def rotate_queries(index_queries: torch.Tensor) -> torch.Tensor:
    """Index queries `[..., d]` rotated as the packed keys are (same dtype), so that their scores are unchanged."""
    return hadamard_transform(index_queries).to(index_queries.dtype)


def power_of_two_scales(rotated: torch.Tensor) -> torch.Tensor:
    """`[...]` float32 scales `2^ceil(log2(max|x| / 448))` of keys `[..., d]` (1 for an all-zero key): the smallest
    power of two that brings every value into fp8's range."""
    amax = rotated.abs().amax(dim=-1).float() / FP8_MAX
    mantissa, exponent = torch.frexp(amax)  # amax = mantissa * 2^exponent, mantissa in [0.5, 1)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)  # an exact power of two is its own scale
    return torch.where(amax > 0, torch.ldexp(torch.ones_like(amax), exponent), torch.ones_like(amax))


def quantize_pooled_keys(pooled_index_keys: torch.Tensor) -> torch.Tensor:
    """Packed fp8 keys `uint8 [..., d + 4]` of full-precision pooled keys `[..., d]`: rotated, scaled, rounded."""
    rotated = hadamard_transform(pooled_index_keys)
    scales = power_of_two_scales(rotated)
    values = (rotated / scales[..., None]).to(FP8_DTYPE).view(torch.uint8)
    return torch.cat([values, scales[..., None].contiguous().view(torch.uint8)], dim=-1)


def fp8_round_trip_unrotated(pooled_index_keys: torch.Tensor) -> torch.Tensor:
    """The float32 keys `[..., d]` an fp8 store *without* the rotation would give back (same power-of-two scale per
    key, same rounding), to be scored against unrotated queries. Only for measuring what the rotation buys: the cache
    always stores rotated keys."""
    keys = pooled_index_keys.float()
    scales = power_of_two_scales(keys)[..., None]
    return (keys / scales).to(FP8_DTYPE).float() * scales


def unpack(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of packed keys `uint8 [..., d + 4]`: the fp8 values `[..., d]` and the float32 scales `[...]`."""
    head_dim = packed.shape[-1] - SCALE_BYTES
    values = packed[..., :head_dim].view(FP8_DTYPE)
    scales = packed[..., head_dim:]
    if scales.stride(-1) != 1 or (scales.dim() > 1 and scales.stride(-2) % SCALE_BYTES):
        scales = scales.contiguous()
    return values, scales.view(torch.float32)[..., 0]


def dequantize_pooled_keys(packed: torch.Tensor) -> torch.Tensor:
    """The rotated keys `[..., d]` float32 that packed fp8 keys stand for (exact: `k8 * s`)."""
    values, scales = unpack(packed)
    return values.float() * scales[..., None]
