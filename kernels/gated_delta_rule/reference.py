"""PyTorch reference of the gated delta rule (Gated DeltaNet's recurrence), chunked and token-by-token.

State `S` has shape `[key_dim, value_dim]` per head. One step with decay `g` (log space), write strength `beta`,
key `k`, value `v` and query `q`:

    S <- exp(g) * S
    S <- S + k (beta * (v - S^T k))^T
    o  = S^T q

The chunked form computes the same thing for a chunk of `C` tokens with matrix products: inside a chunk the
corrections `u_i = beta_i (v_i - exp(g_i) S_{i-1}^T k_i)` solve a unit lower-triangular system
`(I + A) U = diag(beta) V - diag(beta * Gamma) K S_0`, with `Gamma_i` the decay accumulated since the chunk start
and `A_ij = beta_i (Gamma_i / Gamma_j) k_i . k_j` for `j < i`.
"""

import torch
import torch.nn.functional as F


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Divide the last dimension by its L2 norm (the convention of flash-linear-attention and transformers)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(query, key, value, log_decay, beta, use_qk_l2norm):
    """Expand grouped key heads to the value heads, move heads first and compute in float32."""
    num_key_heads, num_value_heads = key.shape[2], value.shape[2]
    if num_value_heads != num_key_heads:
        # Each query/key head serves `num_value_heads // num_key_heads` consecutive value heads.
        query = query.repeat_interleave(num_value_heads // num_key_heads, dim=2)
        key = key.repeat_interleave(num_value_heads // num_key_heads, dim=2)
    # [batch, seq, heads, dim] -> [batch, heads, seq, dim]
    query, key, value = (x.transpose(1, 2).float() for x in (query, key, value))
    log_decay, beta = (x.transpose(1, 2).float() for x in (log_decay, beta))
    if use_qk_l2norm:
        query, key = l2_normalize(query), l2_normalize(key)
    query = query * query.shape[-1] ** -0.5
    return query, key, value, log_decay, beta


def recurrent_gated_delta_rule_torch(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    log_decay: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token gated delta rule (the decode form).

    Args:
        query, key: `[batch, seq, key_heads, key_dim]`.
        value: `[batch, seq, value_heads, value_dim]`, `value_heads` a multiple of `key_heads`.
        log_decay: `[batch, seq, value_heads]`, entries <= 0.
        beta: `[batch, seq, value_heads]`.
        initial_state: `[batch, value_heads, key_dim, value_dim]` or None for zeros.
        use_qk_l2norm: L2-normalise queries and keys first.

    Returns:
        Output `[batch, seq, value_heads, value_dim]` in the input dtype and the final state in float32.
    """
    output_dtype = value.dtype
    query, key, value, log_decay, beta = _prepare(query, key, value, log_decay, beta, use_qk_l2norm)
    output, state = delta_rule_steps(query, key, value, log_decay.exp(), beta, initial_state)
    return output.transpose(1, 2).to(output_dtype), state


def delta_rule_steps(query, key, value, decay, beta, initial_state=None):
    """The delta rule token by token over prepared inputs (heads first, float32): `query, key [batch, heads, seq,
    key_dim]`, `value [batch, heads, seq, value_dim]`, `decay [batch, heads, seq(, key_dim)]` (what each step
    multiplies the state's rows by: one factor per head, or one per key channel as in KDA), `beta [batch, heads,
    seq]`. Returns the output `[batch, heads, seq, value_dim]` and the final state `[batch, heads, key_dim,
    value_dim]`."""
    batch_size, num_heads, seq_len, key_dim = key.shape
    value_dim = value.shape[-1]
    state = (
        torch.zeros(batch_size, num_heads, key_dim, value_dim, dtype=torch.float32, device=value.device)
        if initial_state is None
        else initial_state.float()
    )
    # Heads folded into the batch and every token's views taken at once: a step is then two batched products and
    # five elementwise operators (a decode step's time is its operators' dispatch).
    rows = batch_size * num_heads
    state = state.reshape(rows, key_dim, value_dim)
    query, key = query.reshape(rows, seq_len, 1, key_dim), key.reshape(rows, seq_len, 1, key_dim)
    value = value.reshape(rows, seq_len, 1, value_dim)
    decay = decay.reshape(rows, seq_len, decay.shape[3] if decay.dim() == 4 else 1, 1)
    beta = beta.reshape(rows, seq_len, 1, 1)
    steps = zip(*(x.unbind(1) for x in (decay, key, key.transpose(-1, -2), value, beta, query)))
    outputs = []
    for decay_t, key_t, key_column, value_t, beta_t, query_t in steps:  # [rows, 1 or key_dim, 1 or value_dim] each
        state = state * decay_t
        correction = (value_t - torch.bmm(key_t, state)) * beta_t  # [rows, 1, value_dim]
        state = state + key_column * correction
        outputs.append(torch.bmm(query_t, state))
    state = state.view(batch_size, num_heads, key_dim, value_dim)
    if not outputs:
        return value.new_zeros(batch_size, num_heads, seq_len, value_dim), state
    return torch.cat(outputs, dim=1).view(batch_size, num_heads, seq_len, value_dim), state


def chunk_gated_delta_rule_torch(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    log_decay: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked gated delta rule (the prefill and training form); same arguments and results as the recurrent one."""
    output_dtype = value.dtype
    query, key, value, log_decay, beta = _prepare(query, key, value, log_decay, beta, use_qk_l2norm)
    batch_size, num_heads, seq_len, key_dim = key.shape
    value_dim = value.shape[-1]

    # Zero padding at the end is inert: beta = 0 writes nothing and log_decay = 0 keeps the state.
    pad = (-seq_len) % chunk_size
    if pad:
        query, key, value = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
        log_decay, beta = (F.pad(x, (0, pad)) for x in (log_decay, beta))
    num_chunks = (seq_len + pad) // chunk_size

    def chunked(x):  # [b, h, n*C, ...] -> [b, h, n, C, ...]
        return x.reshape(batch_size, num_heads, num_chunks, chunk_size, *x.shape[3:])

    query, key, value, log_decay, beta = (chunked(x) for x in (query, key, value, log_decay, beta))
    cumulative_decay = log_decay.cumsum(dim=-1)  # log Gamma_i, [b, h, n, C]
    # decay_ratio[i, j] = Gamma_i / Gamma_j for j <= i, zero above the diagonal (masked before exp: no overflow)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=key.device).tril()
    decay_ratio = (cumulative_decay[..., :, None] - cumulative_decay[..., None, :]).masked_fill(~causal, float("-inf"))
    decay_ratio = decay_ratio.exp()

    strictly_lower = torch.tril(key @ key.transpose(-1, -2) * decay_ratio, diagonal=-1) * beta[..., :, None]
    identity = torch.eye(chunk_size, dtype=torch.float32, device=key.device)
    system = identity + strictly_lower
    beta_values = torch.linalg.solve_triangular(system, value * beta[..., None], upper=False, unitriangular=True)
    beta_keys = torch.linalg.solve_triangular(
        system, key * (beta * cumulative_decay.exp())[..., None], upper=False, unitriangular=True
    )
    intra_scores = query @ key.transpose(-1, -2) * decay_ratio  # includes the diagonal
    decayed_query = query * cumulative_decay.exp()[..., None]
    chunk_decay = cumulative_decay[..., -1:]  # log Gamma_C
    # keys weighted by the decay from their step to the chunk end, for the state update
    keys_to_end = key * (chunk_decay - cumulative_decay).exp()[..., None]

    state = (
        torch.zeros(batch_size, num_heads, key_dim, value_dim, dtype=torch.float32, device=value.device)
        if initial_state is None
        else initial_state.float()
    )
    outputs = []
    for n in range(num_chunks):
        corrections = beta_values[:, :, n] - beta_keys[:, :, n] @ state  # U, [b, h, C, value_dim]
        outputs.append(decayed_query[:, :, n] @ state + intra_scores[:, :, n] @ corrections)
        state = state * chunk_decay[:, :, n, :, None].exp() + keys_to_end[:, :, n].transpose(-1, -2) @ corrections
    output = torch.cat(outputs, dim=2)[:, :, :seq_len]
    return output.transpose(1, 2).to(output_dtype), state
