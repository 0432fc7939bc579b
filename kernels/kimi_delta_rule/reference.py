"""PyTorch reference of the Kimi delta rule (KDA's recurrence), chunked and token by token.

KDA is the gated delta rule with a decay per key channel instead of per head. State `S` has shape
`[key_dim, value_dim]` per head; one step with log decays `g` (a vector over the key channels), write strength
`beta`, key `k`, value `v` and query `q`:

    S <- diag(exp(g)) S
    S <- S + k (beta * (v - S^T k))^T
    o  = S^T q

The chunked form handles `C` tokens at a time with matrix products. With `G_i` the per-channel log decay accumulated
from the chunk start through token `i` and `S_0` the state before the chunk, the corrections
`u_i = beta_i (v_i - (diag(exp(g_i)) S_{i-1})^T k_i)` solve the unit lower-triangular system

    (I + A) U = diag(beta) (V - (K * exp(G)) S_0),     A_ij = beta_i sum_c k_ic k_jc exp(G_ic - G_jc), j < i

and then `o_i = (q_i * exp(G_i))^T S_0 + sum_{j <= i} (sum_c q_ic k_jc exp(G_ic - G_jc)) u_j` and
`S_C = diag(exp(G_C)) S_0 + sum_j (k_j * exp(G_C - G_j)) u_j^T`.

The pairwise decays `exp(G_ic - G_jc)` are per channel, so they do not factor into one matrix product without
overflow risk (`exp(-G_j)` grows without bound). They are split as flash-linear-attention does: the chunk is cut into
sub-chunks of 16 tokens; a pair in different sub-chunks factors through the start `s` of the later one,
`exp(G_i - G_s) * exp(G_s - G_j)`, both factors at most 1; a pair inside one sub-chunk is computed channel by
channel. Memory is bounded by one chunk: nothing grows with the sequence but the output.
"""

import torch
import torch.nn.functional as F

from ..gated_delta_rule.reference import delta_rule_steps, l2_normalize

SUB_CHUNK = 16


def _prepare(query, key, value, log_decay, beta, use_qk_l2norm):
    """Move heads first and compute in float32; queries (normalised when asked) carry the `key_dim ** -0.5` scale."""
    # [batch, seq, heads, dim] -> [batch, heads, seq, dim]; beta [batch, seq, heads] -> [batch, heads, seq]
    query, key, value, log_decay = (x.transpose(1, 2).float() for x in (query, key, value, log_decay))
    beta = beta.transpose(1, 2).float()
    if use_qk_l2norm:
        query, key = l2_normalize(query), l2_normalize(key)
    return query * query.shape[-1] ** -0.5, key, value, log_decay, beta


def _zero_state(key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    batch_size, num_heads, _, key_dim = key.shape
    return torch.zeros(batch_size, num_heads, key_dim, value.shape[-1], dtype=torch.float32, device=value.device)


def recurrent_kimi_delta_rule_torch(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    log_decay: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token Kimi delta rule (the decode form).

    Args:
        query, key: `[batch, seq, heads, key_dim]`.
        value: `[batch, seq, heads, value_dim]`.
        log_decay: `[batch, seq, heads, key_dim]`, entries <= 0 (one decay per key channel).
        beta: `[batch, seq, heads]`.
        initial_state: `[batch, heads, key_dim, value_dim]` or None for zeros.
        use_qk_l2norm: L2-normalise queries and keys first.

    Returns:
        Output `[batch, seq, heads, value_dim]` in the input dtype and the final state in float32.
    """
    output_dtype = value.dtype
    query, key, value, log_decay, beta = _prepare(query, key, value, log_decay, beta, use_qk_l2norm)
    output, state = delta_rule_steps(query, key, value, log_decay.exp(), beta, initial_state)
    return output.transpose(1, 2).to(output_dtype), state


def _decayed_products(
    query: torch.Tensor, key: torch.Tensor, cumulative: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`P[i, j] = sum_c x_ic k_jc exp(G_ic - G_jc)` for `j <= i` (zero above the diagonal) with `x` the queries and
    with `x` the keys, without forming any `exp` above 1.

    Args:
        query, key, cumulative: `[batch, heads, C, key_dim]`, `C` a multiple of `SUB_CHUNK`; `cumulative` is `G`.

    Returns:
        Query-key and key-key products, `[batch, heads, C, C]` each.
    """
    *lead, chunk_size, key_dim = key.shape
    subs = chunk_size // SUB_CHUNK
    position = torch.arange(chunk_size, device=key.device)
    by_sub = cumulative.reshape(*lead, subs, SUB_CHUNK, key_dim)
    reference = by_sub[..., :1, :]  # G at each sub-chunk's first token, [b, h, subs, 1, key_dim]

    # Pairs across sub-chunks: row i in sub-chunk a, column j before a's start, through the reference G_s of a.
    row_decay = (by_sub - reference).exp()  # [b, h, subs, S, key_dim]
    earlier = position[None, :] < position[::SUB_CHUNK, None]  # [subs, C]: column j lies before sub-chunk a
    column_decay = (reference - cumulative[..., None, :, :]).masked_fill(~earlier[..., None], -torch.inf)
    columns = (key[..., None, :, :] * column_decay.exp()).transpose(-1, -2)  # [b, h, subs, key_dim, C]

    # Pairs inside a sub-chunk, channel by channel: [b, h, subs, S, S, key_dim].
    causal = torch.ones(SUB_CHUNK, SUB_CHUNK, dtype=torch.bool, device=key.device).tril()
    pair_decay = (by_sub[..., :, None, :] - by_sub[..., None, :, :]).masked_fill(~causal[..., None], -torch.inf).exp()
    keys_inside = key.reshape(*lead, subs, 1, SUB_CHUNK, key_dim) * pair_decay
    same_sub = (position[:, None] // SUB_CHUNK) == (position[None, :] // SUB_CHUNK)

    products = []
    for left in (query, key):
        left = left.reshape(*lead, subs, SUB_CHUNK, key_dim)
        across = ((left * row_decay) @ columns).reshape(*lead, chunk_size, chunk_size)
        inside = (left[..., :, None, :] * keys_inside).sum(dim=-1)  # [b, h, subs, S, S]
        # Row-major order of the same-sub-chunk entries is (sub-chunk, row, column): `inside` flattened.
        products.append(across.masked_scatter(same_sub, inside.reshape(*lead, -1)))
    return products[0], products[1]


def chunk_kimi_delta_rule_torch(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    log_decay: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked Kimi delta rule (the prefill and training form); same arguments and results as the recurrent one."""
    if chunk_size % SUB_CHUNK != 0:
        raise ValueError(f"chunk_kimi_delta_rule_torch: chunk_size is {chunk_size}; use a multiple of {SUB_CHUNK}.")
    output_dtype = value.dtype
    query, key, value, log_decay, beta = _prepare(query, key, value, log_decay, beta, use_qk_l2norm)
    seq_len = key.shape[2]

    # Zero padding at the end is inert: beta = 0 writes nothing and log_decay = 0 keeps the state.
    pad = (-seq_len) % chunk_size
    if pad:
        query, key, value, log_decay = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value, log_decay))
        beta = F.pad(beta, (0, pad))
    identity = torch.eye(chunk_size, dtype=torch.float32, device=key.device)

    state = _zero_state(key, value) if initial_state is None else initial_state.float()
    outputs = []
    for start in range(0, seq_len + pad, chunk_size):
        chunk = slice(start, start + chunk_size)
        q, k, v, b = query[:, :, chunk], key[:, :, chunk], value[:, :, chunk], beta[:, :, chunk, None]
        cumulative = log_decay[:, :, chunk].cumsum(dim=2)  # G, [b, h, C, key_dim]
        # Unit lower-triangular system for the corrections U, [b, h, C, value_dim].
        query_key, key_key = _decayed_products(q, k, cumulative)
        system = identity + (key_key * b).tril(diagonal=-1)
        target = b * (v - (k * cumulative.exp()) @ state)
        corrections = torch.linalg.solve_triangular(system, target, upper=False, unitriangular=True)
        outputs.append((q * cumulative.exp()) @ state + query_key @ corrections)
        total = cumulative[:, :, -1:]  # G_C, [b, h, 1, key_dim]
        keys_to_end = k * (total - cumulative).exp()
        state = state * total.transpose(-1, -2).exp() + keys_to_end.transpose(-1, -2) @ corrections
    output = torch.cat(outputs, dim=2)[:, :, :seq_len]
    return output.transpose(1, 2).to(output_dtype), state
