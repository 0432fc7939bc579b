"""fp8 pooled index keys: rotation, quantisation and the packed layout (PyTorch; it runs once per completed window,
far off the hot path, and the scoring kernels read the packed keys directly)."""

from .reference import (
    FP8_DTYPE,
    SCALE_BYTES,
    dequantize_pooled_keys,
    fp8_round_trip_unrotated,
    hadamard_transform,
    is_packed,
    packed_width,
    quantize_pooled_keys,
    rotate_queries,
    unpack,
)

__all__ = ["FP8_DTYPE", "SCALE_BYTES", "dequantize_pooled_keys", "fp8_round_trip_unrotated", "hadamard_transform",
           "is_packed", "packed_width", "quantize_pooled_keys", "rotate_queries", "unpack"]
