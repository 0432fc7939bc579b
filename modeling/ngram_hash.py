"""Hashing of token n-grams into embedding-table rows for per-layer n-gram embeddings (PLE, as in Qwen4-Exp).

Each PLE layer has `(ngram_size - 1) * heads_per_ngram` hash heads. Head `h` of the layer with PLE index `i` owns a
table whose size is the `(i * heads + h)`-th prime from `vocab_size_base` up (distinct primes decorrelate the heads),
and the tables sit one after another in a single embedding. An n-gram's id in a head is the XOR of its tokens times
odd per-position multipliers (drawn with splitmix64 from the seed and the layer), modulo the head's table size.
"""

import math

import torch

_MASK64 = (1 << 64) - 1
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # splitmix64 increment
_MIX_1 = 0xBF58476D1CE4E5B9
_MIX_2 = 0x94D049BB133111EB
_LAYER_SEED_STRIDE = 10007


def splitmix64(value: int) -> int:
    """One splitmix64 output for state `value` (the state is advanced by the golden gamma first)."""
    value = (value + _GOLDEN_GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * _MIX_1) & _MASK64
    value = ((value ^ (value >> 27)) * _MIX_2) & _MASK64
    return value ^ (value >> 31)


def hash_multipliers(vocab_size: int, ngram_size: int, ple_index: int, seed: int) -> list[int]:
    """Odd multipliers, one per n-gram position, small enough that `token * multiplier` fits in int64."""
    half_bound = max(1, ((1 << 63) - 1) // max(vocab_size, 1) // 2)
    layer_seed = seed + _LAYER_SEED_STRIDE * ple_index
    return [
        2 * (splitmix64((layer_seed + _GOLDEN_GAMMA * (position + 1)) & _MASK64) % half_bound) + 1
        for position in range(ngram_size)
    ]


def _is_prime(value: int) -> bool:
    if value < 2 or value % 2 == 0:
        return value == 2
    return all(value % divisor for divisor in range(3, math.isqrt(value) + 1, 2))


def head_table_sizes(vocab_size_base: int, first_head: int, num_heads: int) -> list[int]:
    """The primes number `first_head .. first_head + num_heads - 1` (from 0) among those `>= vocab_size_base`."""
    sizes, candidate, index = [], vocab_size_base, 0
    while len(sizes) < num_heads:
        if _is_prime(candidate):
            if index >= first_head:
                sizes.append(candidate)
            index += 1
        candidate += 1
    return sizes


def shifted_in_segment(token_ids: torch.Tensor, shift: int, eos_token_id: int) -> torch.Tensor:
    """`token_ids [batch, len]` shifted right by `shift`, with `eos_token_id` wherever the source lies before the
    start of the token's segment (a segment starts after each end-of-sequence token and at the beginning)."""
    if shift == 0:
        return token_ids
    length = token_ids.shape[1]
    positions = torch.arange(length, device=token_ids.device)
    eos_positions = torch.where(token_ids == eos_token_id, positions, -1)
    last_eos = torch.cummax(eos_positions, dim=1).values
    segment_start = torch.cat([last_eos.new_full((token_ids.shape[0], 1), -1), last_eos[:, :-1]], dim=1) + 1
    source = positions - shift
    shifted = token_ids.gather(1, source.clamp(min=0).expand_as(token_ids))
    return torch.where(source >= segment_start, shifted, torch.full_like(token_ids, eos_token_id))
