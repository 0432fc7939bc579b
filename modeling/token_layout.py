"""Where each input token sits while the layers run: every sequence's real tokens first, in order.

The attention mask says which tokens exist; padding (on either side) and holes do not. The recurrent and
convolutional layers need a sequence's real tokens to be contiguous, so the model moves them into a *grid* whose every
row holds one sequence's real tokens from column 0, padding after, runs the layers there, and moves the outputs back.
A row of packed sequences (positions restarting at 0, as `DataCollatorWithFlattening` makes) becomes one grid row per
sequence, so nothing crosses a sequence boundary. Without padding or packing there is no layout and nothing moves.
"""

from dataclasses import dataclass

import torch


@dataclass
class TokenLayout:
    """A map between the input `[batch, seq]` and the grid `[rows, width]` the layers run on.

    Attributes:
        rows, columns: `[rows, width]` input row and column of each grid cell (padding cells point at some input
            token; their content is never read by a real token).
        token_is_real: `[rows, width]` bool, each grid row's real tokens first.
        source_rows, source_columns: `[batch, seq]` the grid cell each input token's output comes from; a padding
            token takes the output of the last real token before it in its row (so `logits[:, -1]` is every row's
            next-token prediction, whichever side it was padded on).
    """

    rows: torch.Tensor
    columns: torch.Tensor
    token_is_real: torch.Tensor
    source_rows: torch.Tensor
    source_columns: torch.Tensor

    @classmethod
    def compact(cls, token_is_real: torch.Tensor) -> "TokenLayout | None":
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
    def unpack(cls, position_ids: torch.Tensor, token_is_real: torch.Tensor) -> "TokenLayout":
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
