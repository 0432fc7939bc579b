"""The tokens of one pass through the decoder layers: which exist, their positions, and where they sit while the token
mixers run.

The attention mask says which tokens exist; padding (on either side) and holes do not. The recurrent and
convolutional layers need a sequence's real tokens to be contiguous, so the token mixers run on a *grid* whose every
row holds one sequence's real tokens from column 0, padding after. A row of packed sequences (positions restarting at
0, as `DataCollatorWithFlattening` makes) becomes one grid row per sequence, so nothing crosses a sequence boundary.
Everything between the layers (hidden states, router logits, attention weights, selections) stays in the input's
layout; without padding or packing there is no grid and nothing moves.
"""

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F


@dataclass
class TokenGrid:
    """A map between the input `[batch, seq]` and the grid `[rows, width]` the token mixers run on.

    Attributes:
        rows, columns: `[rows, width]` input row and column of each grid cell (padding cells point at some input
            token; their content is never read by a real token).
        token_is_real: `[rows, width]` bool, each grid row's real tokens first.
        source_rows, source_columns: `[batch, seq]` the grid cell each input token's output comes from; a padding
            token takes the output of the last real token before it in its row.
    """

    rows: torch.Tensor
    columns: torch.Tensor
    token_is_real: torch.Tensor
    source_rows: torch.Tensor
    source_columns: torch.Tensor

    @classmethod
    def compact(cls, token_is_real: torch.Tensor) -> "TokenGrid | None":
        """Each row's real tokens moved to its front (the grid has the input's shape); None when they already are
        everywhere (no padding at all, reads the device once)."""
        if bool(token_is_real.all()):
            return None
        batch_size, seq_len = token_is_real.shape
        device = token_is_real.device
        real = token_is_real.long()
        real_before = real.cumsum(dim=1) - 1  # rank of a real token; for padding, of the last real token before it
        num_real = real.sum(dim=1, keepdim=True)
        grid_column = torch.where(token_is_real, real_before, num_real + (1 - real).cumsum(dim=1) - 1)
        columns = torch.empty_like(grid_column).scatter_(
            1, grid_column, torch.arange(seq_len, device=device).expand(batch_size, -1))
        rows = torch.arange(batch_size, device=device)[:, None].expand(-1, seq_len)
        grid_real = torch.arange(seq_len, device=device) < num_real
        source_columns = torch.where(real_before >= 0, real_before, grid_column)
        return cls(rows, columns, grid_real, rows, source_columns)

    @classmethod
    def unpack(cls, position_ids: torch.Tensor, token_is_real: torch.Tensor) -> "TokenGrid":
        """One grid row per packed sequence: a sequence starts wherever a row's position is 0 (reads the device)."""
        batch_size, seq_len = position_ids.shape
        device = position_ids.device
        starts = (position_ids == 0) & token_is_real
        starts[:, 0] = True
        # Sequence number of every token across the batch, and its column within its sequence.
        sequence = starts.flatten().long().cumsum(0).view(batch_size, seq_len) - 1
        first_column = torch.zeros(int(sequence.max()) + 1, dtype=torch.long, device=device)
        columns_in_row = torch.arange(seq_len, device=device).expand(batch_size, -1)
        first_column.scatter_(0, sequence[starts], columns_in_row[starts])
        within = columns_in_row - first_column[sequence]
        num_sequences, width = first_column.numel(), int(within.max()) + 1
        input_rows = torch.arange(batch_size, device=device)[:, None].expand(-1, seq_len)
        rows = torch.zeros(num_sequences, width, dtype=torch.long, device=device)
        columns = torch.zeros(num_sequences, width, dtype=torch.long, device=device)
        grid_real = torch.zeros(num_sequences, width, dtype=torch.bool, device=device)
        rows[sequence, within] = input_rows
        columns[sequence, within] = columns_in_row
        grid_real[sequence, within] = token_is_real
        # Cells past a sequence's end read its first token (never used by a real one).
        length = grid_real.sum(dim=1, keepdim=True)
        outside = torch.arange(width, device=device) >= length
        rows = torch.where(outside, rows[:, :1], rows)
        columns = torch.where(outside, columns[:, :1], columns)
        return cls(rows, columns, grid_real, sequence, within)

    def to_grid(self, tensor: torch.Tensor) -> torch.Tensor:
        """`[batch, seq, ...]` -> `[rows, width, ...]`."""
        return tensor[self.rows, self.columns]

    def from_grid(self, tensor: torch.Tensor) -> torch.Tensor:
        """`[rows, width, ...]` -> `[batch, seq, ...]`."""
        return tensor[self.source_rows, self.source_columns]


@dataclass(frozen=True)
class TokenLayout:
    """What every decoder layer of one pass reads besides its hidden states (built once per pass, never written).

    Attributes:
        token_is_real: `[rows, width]` bool on the grid, False for padding.
        positions: `[rows, width]` storage positions: each row counts its real tokens (after the cached ones).
        rope_positions: `[streams, rows, width]` rotary positions.
        grid: the map to the grid the token mixers run on, or None when the input is its own grid.
        ple_token_ids: `[rows, width]` token ids for per-layer n-gram embeddings (padding as end-of-sequence), or None.
        attention_columns: `[batch, queries or 1, positions]` the mask column of each stored position, for attention
            weights over mask columns (None: position `p` is column `p`).
        kv_length: the mask columns (past and new) attention weights cover, when they are asked for.
    """

    token_is_real: torch.Tensor
    positions: torch.Tensor
    rope_positions: torch.Tensor
    grid: TokenGrid | None = None
    ple_token_ids: torch.Tensor | None = None
    attention_columns: torch.Tensor | None = None
    kv_length: int | None = None

    @classmethod
    def of_sequences(cls, positions: torch.Tensor, token_is_real: torch.Tensor | None = None,
                     streams: int = 1) -> "TokenLayout":
        """A pass over rows that hold their real tokens first at `positions [batch, seq]` (the rotary positions too),
        with no grid: e.g. a few entries of one sequence, or a stack of layers run by hand."""
        token_is_real = torch.ones_like(positions, dtype=torch.bool) if token_is_real is None else token_is_real
        return cls(token_is_real, positions, positions[None].expand(streams, -1, -1))

    def to_grid(self, tensor: torch.Tensor) -> torch.Tensor:
        """`[batch, seq, ...]` in the input's layout -> `[rows, width, ...]` on the grid."""
        return tensor if self.grid is None else self.grid.to_grid(tensor)

    def from_grid(self, tensor: torch.Tensor) -> torch.Tensor:
        """`[rows, width, ...]` on the grid -> `[batch, seq, ...]` in the input's layout (a padding token gets the
        value of the last real token before it)."""
        return tensor if self.grid is None else self.grid.from_grid(tensor)

    def shifted(self, depth: int) -> "TokenLayout":
        """The pass of multi-token-prediction depth `depth`: the same positions, with the last `depth + 1` real tokens
        of each grid row no longer real (their token `i + depth + 1` does not exist)."""
        shifted = self.token_is_real[:, depth + 1:]
        token_is_real = torch.cat([shifted, shifted.new_zeros(shifted.shape[0], depth + 1)], dim=1)
        return replace(self, token_is_real=token_is_real, ple_token_ids=None, attention_columns=None, kv_length=None)

    def attention_by_column(self, weights: torch.Tensor) -> torch.Tensor:
        """Attention weights `[rows, heads, queries, positions]` on the grid laid out over the input's queries and
        mask columns, `[batch, heads, seq, kv_length]`, zero where nothing was attended (padding, unselected windows).
        """
        if self.grid is not None:  # move the queries
            weights = self.grid.from_grid(weights.transpose(1, 2)).transpose(1, 2)
        columns, kv_length = self.attention_columns, self.kv_length
        if columns is None and weights.shape[-1] == kv_length:
            return weights  # the very weights the output used (their gradient can be retained)
        if columns is None:  # a decode step's weights cover the cache's reserved positions
            return F.pad(weights, (0, kv_length - weights.shape[-1]))[..., :kv_length]
        batch_size, num_heads, num_queries, _ = weights.shape
        num_positions = min(weights.shape[-1], columns.shape[-1], kv_length)
        index = columns[..., :num_positions].expand(batch_size, num_queries, num_positions)
        index = index[:, None].expand(batch_size, num_heads, num_queries, num_positions)
        # Added, not written: cells past the end of a packed sequence repeat a column with zero weight.
        return weights.new_zeros(batch_size, num_heads, num_queries, kv_length).scatter_add_(
            -1, index, weights[..., :num_positions])


def fill_padding(hidden_states: torch.Tensor, token_is_real: torch.Tensor) -> torch.Tensor:
    """`hidden_states [batch, seq, ...]` with every padding token's value replaced by that of the last real token
    before it in its row (a padding token before every real one keeps its own), so that `[:, -1]` is each row's last
    real token whichever side the row was padded on."""
    columns = torch.arange(token_is_real.shape[1], device=token_is_real.device)
    last_real = torch.where(token_is_real, columns, -1).cummax(dim=1).values
    source = torch.where(last_real >= 0, last_real, columns)
    return hidden_states.gather(1, source.view(*source.shape, *[1] * (hidden_states.dim() - 2)).expand_as(
        hidden_states))
