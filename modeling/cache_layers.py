"""One layer's storage in a [`HybridIndexPoolCache`]: tensors and lengths, and where the next tokens go. A cache layer
never runs model code: the layer that owns it computes (pooling, norms, RoPE, quantisation, the delta rule, the replay
after a crop) and hands it tensors to keep."""

from dataclasses import dataclass

import torch
from transformers.cache_utils import CacheLayerMixin, LinearAttentionCacheLayerMixin

from .layers import FEW_TOKENS, last_real_entries

# Positions a growing (non-reserved) cache adds at least, and the fraction of its size it adds at most beyond need.
GROWTH_CHUNK = 256
GROWTH_FRACTION = 16


def _bytes(*tensors: torch.Tensor | None) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors if tensor is not None)


def _map_tensors(value, fn):
    """`value` (a tensor, None, or a dict or tuple of them) with `fn` applied to each tensor."""
    if isinstance(value, dict):
        return {key: _map_tensors(item, fn) for key, item in value.items()}
    if isinstance(value, tuple):
        return tuple(_map_tensors(item, fn) for item in value)
    return None if value is None else fn(value)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _store(current: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    """Keep `new` as the state: copied into `current` when it has the same layout and no gradient is involved (so the
    state keeps its address for CUDA graphs), otherwise `new` itself."""
    same = current is not None and (current.shape, current.dtype, current.device) == (new.shape, new.dtype, new.device)
    if same and not (torch.is_grad_enabled() and (new.requires_grad or current.requires_grad)):
        return current.copy_(new)
    return new


def _mark_static(*tensors: torch.Tensor | None) -> None:
    """Tell torch.compile that these tensors keep their address (needed for CUDA graphs of the decode step)."""
    if not torch.compiler.is_compiling():
        for tensor in tensors:
            if tensor is not None:
                torch._dynamo.mark_static_address(tensor)


class _WindowRecording:
    """A state made of the last `count` real entries of a sequence (a convolution's input window, an n-gram's token
    context), recorded since a checkpoint so that a crop can rebuild it for fewer tokens."""

    def __init__(self, checkpoint: torch.Tensor):
        self.checkpoint = checkpoint  # [batch, ..., count]
        self.entries: list[torch.Tensor] = []  # [batch, ..., new] per forward
        self.token_is_real: list[torch.Tensor] = []  # [batch, new] per forward

    @classmethod
    def resume(cls, recording, sequence: torch.Tensor, token_is_real: torch.Tensor, start: int):
        """`recording` (a new one when None or when `start > 0`) with the new columns from `start` on added, from
        `sequence [batch, ..., count + new]` (the state, then the new entries)."""
        count = sequence.shape[-1] - token_is_real.shape[1]
        # Copies of a long forward's slices, which would keep its whole input (a prompt's) alive until the crop; a
        # few tokens' own small tensors are kept as they are.
        keep = torch.clone if token_is_real.shape[1] > FEW_TOKENS else (lambda tensor: tensor)
        if recording is None or start > 0:  # the checkpoint: the window before the recorded columns
            before = sequence[..., : count + start]
            recording = cls(keep(before) if start == 0 else last_real_entries(
                before, token_is_real[:, :start].sum(dim=1), count))
        recording.entries.append(keep(sequence[..., count + start:]))
        recording.token_is_real.append(keep(token_is_real[:, start:]))
        return recording

    def nbytes(self) -> int:
        return _bytes(self.checkpoint, *self.entries, *self.token_is_real)

    def rebuild(self, kept: torch.Tensor) -> torch.Tensor:
        """The state after the recorded tokens `kept [batch, recorded]` marks: each row's last `count` kept entries."""
        count = self.checkpoint.shape[-1]
        sequence = torch.cat([self.checkpoint, *[entries.to(self.checkpoint.dtype) for entries in self.entries]], -1)
        kept = torch.cat([kept.new_ones(kept.shape[0], count), kept], dim=1)
        # A stable sort brings each row's kept entries to the front in order; the state ends at the last one.
        order = torch.sort((~kept).to(torch.uint8), dim=1, stable=True).indices
        order = order.view(order.shape[0], *([1] * (sequence.dim() - 2)), -1).expand_as(sequence)
        return last_real_entries(sequence.gather(-1, order), kept.sum(dim=1) - count, count)


class _LayerCache:
    """What every cache layer shares: its batch tensors (`_batch_tensors`, batch first, mapped by the cache's batch
    operations), transformers' past recording and the lengths it answers. `seen_tokens` is the cache's count of
    attention-mask columns (padding included), one device scalar shared by its decoder layers."""

    _batch_tensors: tuple[str, ...] = ()
    is_croppable = True
    # While `record_past`, every forward records what `crop` needs to remove its tokens again; a long forward records
    # only its last `recurrent_states_to_keep + 1` tokens (any number when None).
    record_past = False
    recurrent_states_to_keep: int | None = None
    seen_tokens: torch.Tensor | None = None
    max_cache_len: int | None = None  # the tokens an IndexPool layer's storage is reserved for (None: it grows)
    lengths: torch.Tensor | None = None  # an IndexPool layer's real tokens per row
    replay_inputs: tuple[torch.Tensor, ...] | None = None  # what a linear-attention layer's crop left to replay
    _fixed_size = True  # whether the storage keeps its shapes (an IndexPool layer's only once reserved)

    def activate_past_recording(self, recurrent_states_to_keep: int | None = None) -> None:
        self.record_past = True
        self.recurrent_states_to_keep = recurrent_states_to_keep
        self._drop_recording()

    def _drop_recording(self) -> None:
        """Forget what was recorded (a crop keeps the tokens before it for good)."""
        self._windows: dict = {}  # a _WindowRecording per recorded window of last entries
        self._kept_memo: tuple = (None,) * 4

    def recording_start(self, token_is_real: torch.Tensor) -> int | None:
        """The first of the new columns `token_is_real [batch, new]` to record (None: not recording): a forward longer
        than the `recurrent_states_to_keep + 1` tokens a crop may remove records only the columns that hold each row's
        last ones (each row's real tokens come first), from the state there. Reads the device for a long forward."""
        if not self.record_past:
            return None
        keep = None if self.recurrent_states_to_keep is None else self.recurrent_states_to_keep + 1
        if keep is None or token_is_real.shape[1] <= keep:
            return 0
        after = token_is_real.flip(1).long().cumsum(dim=1).flip(1)  # [batch, new] real tokens from each column on
        enough = (after >= after[:, :1].clamp(max=keep)).all(dim=0)  # true up to the latest column that is enough
        return int(enough.long().cumsum(dim=0).max()) - 1

    def _map_batch(self, fn) -> None:
        for name in self._batch_tensors:
            setattr(self, name, _map_tensors(getattr(self, name), fn))

    def _held(self):
        """The tensors the layer holds (lazily), one level into its dicts and tuples."""
        for value in (getattr(self, name) for name in self._batch_tensors):
            items = value.values() if isinstance(value, dict) else value if isinstance(value, tuple) else (value,)
            yield from (item for item in items if item is not None)

    @property
    def batch_size(self) -> int:
        """Rows held, or -1 before the first write."""
        return next((tensor.shape[0] for tensor in self._held()), -1)

    @property
    def is_compileable(self) -> bool:
        """Whether a compiled decode step can run on this layer: no recording (it keeps host-side lists of tensors),
        no replay pending (it runs the rule over them, eagerly) and storage that keeps its shapes."""
        return not self.record_past and self.replay_inputs is None and self._fixed_size

    def reset(self) -> None:
        """Forget everything (the next forward starts a new sequence)."""
        for name in self._batch_tensors:  # (also what a new layer starts from)
            value = getattr(self, name, None)
            setattr(self, name, dict.fromkeys(value) if isinstance(value, dict) else None)
        self.seen_tokens = None
        self._drop_recording()

    def get_seq_length(self) -> int:
        """Tokens fed so far (attention-mask columns, padding included); in a layer the cache does not count for (an
        MTP layer's), the entries of its longest row."""
        if self.seen_tokens is None and self.lengths is not None:
            return int(self.lengths.max())
        return 0 if self.seen_tokens is None else int(self.seen_tokens)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """`(kv_length, kv_offset)` of a query of `query_length` tokens: every column so far, from 0."""
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1 if self.max_cache_len is None else self.max_cache_len

    def _kept(self, tokens_to_remove: int) -> torch.Tensor:
        """`[batch, recorded]` the recorded real tokens a crop of `tokens_to_remove` keeps; raises if a row recorded
        fewer (the check `crop` makes of every layer before it cuts any)."""
        recording = next(iter(self._windows.values()))  # every window records the same columns
        if self._kept_memo[:3] == (tokens_to_remove, recording, len(recording.entries)):
            return self._kept_memo[3]  # the cache's check of every layer, then the cut
        recorded = torch.cat(recording.token_is_real, dim=1)
        counts = recorded.long().cumsum(dim=1)
        if tokens_to_remove > (fewest := int(counts[:, -1].min())):
            raise ValueError(
                f"Cannot crop {tokens_to_remove} tokens: a {type(self).__name__} recorded only {fewest} since its "
                f"last crop (a long forward records its last recurrent_states_to_keep + 1 = "
                f"{(self.recurrent_states_to_keep or 0) + 1}); activate past recording with a larger "
                "recurrent_states_to_keep."
            )
        kept = recorded & (counts <= counts[:, -1:] - tokens_to_remove)
        self._kept_memo = (tokens_to_remove, recording, len(recording.entries), kept)
        return kept


class LinearAttentionLayerCache(_LayerCache):
    """The fixed-size states of a linear-attention layer, keyed by index as transformers' linear-attention layers keep
    them. `conv_states`, windows of each sequence's last inputs: 0 the convolution state `[batch, conv_dim, kernel -
    1]` (Kimi Delta Attention's in float32); on a PLE layer also 1 the PLE convolution's input history `[batch,
    channels, history]` and 2 the last `ple_ngram_size - 1` token ids. `recurrent_states[0]`: `[batch, heads, key_dim,
    value_dim]`.

    Rollback is by checkpoint and replay: a recording keeps the recurrent state it starts from and its tokens' rule and
    window inputs; a crop rebuilds the windows and leaves `replay_state` (the checkpoint) and `replay_inputs` (`[batch,
    recorded, ...]`, removed tokens made no-ops), which the layer runs through its rule before its next tokens.
    """

    _batch_tensors = ("conv_states", "recurrent_states", "replay_state", "replay_inputs")

    def __init__(self):
        self.conv_states: dict[int, torch.Tensor | None] = {0: None}  # a PLE layer adds 1 and 2 when it first writes
        self.recurrent_states: dict[int, torch.Tensor | None] = {0: None}
        self.reset()

    @property
    def has_previous_state(self) -> dict[int, bool]:
        return {index: state is not None for index, state in self.conv_states.items()}

    def _drop_recording(self) -> None:
        super()._drop_recording()  # the windows by conv state
        self._checkpoint: torch.Tensor | None = None
        self._inputs: list[tuple[torch.Tensor, ...]] = []  # (query, key, value, log_decay, beta) per forward

    def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, checkpoint=None,
                               rule_inputs: tuple[torch.Tensor, ...] | None = None, start: int | None = None):
        """Store the recurrent state after the new tokens (any pending replay has been run). While recording, from
        column `start` (`recording_start`; None: not recording, and what was recorded is dropped), also keep the state
        there (`checkpoint`, kept when a new recording starts) and the recorded columns' rule inputs `rule_inputs`."""
        self.replay_state = self.replay_inputs = None
        if start is None:
            self._drop_recording()
        elif rule_inputs is not None:
            if start > 0 or not self._inputs:
                self._checkpoint = None if checkpoint is None else checkpoint.clone()
                self._inputs = []
            # Copies of a long forward's slices, which would keep its projections (a prompt's) alive until a crop.
            few = start == 0 and rule_inputs[0].shape[1] <= FEW_TOKENS  # the whole forward is a few tokens
            self._inputs.append(rule_inputs if few else tuple(x.clone() for x in rule_inputs))
        self.recurrent_states[state_idx] = _store(self.recurrent_states[state_idx], recurrent_states)
        return self.recurrent_states[state_idx]

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, window_input: torch.Tensor | None = None,
                          token_is_real: torch.Tensor | None = None, start: int | None = None) -> torch.Tensor:
        """Store the window `state_idx` after the new tokens; while recording, from column `start`, also its input
        `window_input [batch, ..., count + new]` (the window before, then the new entries) with `token_is_real
        [batch, new]` (each row's real tokens first)."""
        if start is not None and window_input is not None:
            self._windows[state_idx] = _WindowRecording.resume(self._windows.get(state_idx), window_input,
                                                               token_is_real, start)
        self.conv_states[state_idx] = _store(self.conv_states.get(state_idx), conv_states)
        return self.conv_states[state_idx]

    def _check_crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove <= 0 or next(self._held(), None) is None:
            return
        if not self._windows:
            raise ValueError(
                f"Cannot crop {tokens_to_remove} tokens: a linear-attention layer rolls back only the tokens fed "
                "since cache.activate_past_recording(recurrent_states_to_keep=k) (generate() calls it for assisted "
                "decoding) and the last crop; activate it before the forward whose tokens may be removed."
            )
        self._kept(tokens_to_remove)

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `tokens_to_remove` tokens of every row and forget the recording (`crop(0)` keeps every
        token for good): the windows are rebuilt now, the recurrent state at the next forward."""
        self._check_crop(tokens_to_remove)
        if tokens_to_remove > 0 and self._windows:
            kept = self._kept(tokens_to_remove)
            for index, recording in self._windows.items():
                self.conv_states[index] = _store(self.conv_states[index], recording.rebuild(kept))
            if self._inputs:
                query, key, value, log_decay, beta = (torch.cat(parts, dim=1) for parts in zip(*self._inputs))
                # A removed token becomes a no-op of the rule: it neither decays nor writes the state.
                log_decay = log_decay * kept.view(*kept.shape, *[1] * (log_decay.dim() - 2))
                beta = beta * kept.view(*kept.shape, *[1] * (beta.dim() - 2)).to(beta.dtype)
                self.replay_state, self.replay_inputs = self._checkpoint, (query, key, value, log_decay, beta)
        self._drop_recording()

    def _memory_footprint(self) -> dict[str, tuple[int, int]]:
        """`{component: (bytes in use, bytes reserved)}`, all in use: the states, what a recording holds (`rollback`;
        `recording_bytes` gives it by formula) and what a crop left to replay (`replay`)."""
        rollback = _bytes(self._checkpoint, *[x for part in self._inputs for x in part]) + sum(
            recording.nbytes() for recording in self._windows.values())
        sizes = {"conv_state": _bytes(self.conv_states[0]), "recurrent_state": _bytes(self.recurrent_states[0]),
                 "ple_state": _bytes(self.conv_states.get(1), self.conv_states.get(2)), "rollback": rollback,
                 "replay": _bytes(self.replay_state, *(self.replay_inputs or ()))}
        return {name: (size, size) for name, size in sizes.items()}


@dataclass
class WindowPlacement:
    """Where an IndexPool layer's new tokens go among its windows ([`IndexPoolLayerCache.place_windows`]).

    Attributes:
        keys: `[batch, windows, r, index_head_dim]` raw indexer keys of each row's open window followed by its new
            real tokens, by position, cut into windows (for the layer to pool).
        gate_logits: `[batch, windows, r, gate_width]` float32 pooling-gate logits (without the slot bias), or None.
        first_positions: `[streams, batch, windows]` rotary positions of each window's first token.
        complete: `[batch, windows]` bool, the windows the new tokens complete (only those are stored).
        target: `[batch, windows]` index of each window in the pooled-key storage.
        new_tokens: `(raw_index_keys, gate_logits, rope_positions, token_is_real)` as given, for the recording.
    """

    keys: torch.Tensor
    gate_logits: torch.Tensor | None
    first_positions: torch.Tensor
    complete: torch.Tensor
    target: torch.Tensor
    new_tokens: tuple


class IndexPoolLayerCache(_LayerCache):
    """One IndexPool layer's keys/values, pooled indexer keys and open windows, stored by position per row.

    Attributes:
        key_storage, value_storage: `[batch, capacity, kv_heads, head_dim]`; entry `p` of row `b` is its token at
            position `p`, valid for `p < lengths[b]`; `keys` / `values` are `[batch, kv_heads, capacity, head_dim]`
            views. MLA stores its latents as the keys (one head) and no values (None).
        pooled_storage: `[batch, capacity // r, index_head_dim]`, after norm and RoPE; window `c` at index `c`, valid
            for `c < lengths[b] // r`. With `fp8_index_keys`, packed fp8 keys `uint8 [batch, capacity // r,
            index_head_dim + 4]` (`kernels.fp8_index_keys`), quantised by the layer when the window completes.
        open_index_keys: `[batch, r - 1, index_head_dim]` raw indexer keys of the open window, the first
            `lengths[b] % r` valid; `open_gate_logits` the same for the pooling-gate logits (float32), or None.
        open_window_position: `[batch, streams]` rotary position of the open window's first token.
        lengths: `[batch]` int64, real tokens per row.

    The indexer tensors stay None in a layer whose indexer is shared. `update` decides the storage it needs as it
    writes: reserved once for `max_cache_len` (what `generate()` passes), or grown by at most 1/16 of what it holds,
    rounded up to `GROWTH_CHUNK` positions. A few tokens (a decode step, a verify forward) use fixed shapes and read
    nothing on the host.
    """

    _batch_tensors = ("key_storage", "value_storage", "pooled_storage", "open_index_keys", "open_gate_logits",
                      "open_window_position", "lengths")

    def __init__(self, pool_size: int, max_cache_len: int | None = None, fp8_index_keys: bool = False):
        self.pool_size, self.max_cache_len, self.fp8_index_keys = pool_size, max_cache_len, fp8_index_keys
        # Host-side upper bound of `lengths.max()`: decides growth without reading the device. Exact after every
        # multi-token write; a few tokens add their count (not maintained inside a compiled step, of fixed capacity).
        self._length_bound = 0
        self.reset()  # no tensors yet

    @property
    def _fixed_size(self) -> bool:
        return self.max_cache_len is not None

    @property
    def keys(self) -> torch.Tensor | None:
        return None if self.key_storage is None else self.key_storage.transpose(1, 2)

    @property
    def values(self) -> torch.Tensor | None:
        return None if self.value_storage is None else self.value_storage.transpose(1, 2)

    @property
    def capacity(self) -> int:
        """Positions reserved per row (a multiple of r)."""
        return 0 if self.key_storage is None else self.key_storage.shape[1]

    def _reserve(self, tokens_to_come: int) -> None:
        """Grow the storage, now and once, to hold `tokens_to_come` more tokens per row (reads the device)."""
        if self.lengths is not None:
            self._length_bound = int(self.lengths.max())
            self._grow_to(_round_up(self._length_bound + tokens_to_come, self.pool_size))

    def place_windows(self, raw_index_keys: torch.Tensor, gate_logits: torch.Tensor | None,
                      token_is_real: torch.Tensor, rope_positions: torch.Tensor) -> WindowPlacement:
        """The windows new tokens touch: each row's open window followed by its new real tokens, by position. Takes
        `raw_index_keys [batch, new, index_head_dim]` (before norm and RoPE), `gate_logits [batch, new, gate_width]`
        (float32, without the slot bias) or None, `token_is_real [batch, new]` (padding takes no place) and
        `rope_positions [streams, batch, new]`. A few tokens (a decode step, a verify forward) are placed with fixed
        shapes, reading nothing on the host. Changes nothing: `update` stores."""
        batch_size, num_new, index_head_dim = raw_index_keys.shape
        r, device = self.pool_size, raw_index_keys.device
        lengths = raw_index_keys.new_zeros(batch_size, dtype=torch.long) if self.lengths is None else self.lengths
        open_keys, open_logits, open_position = self.open_index_keys, self.open_gate_logits, self.open_window_position
        if open_keys is None:
            open_keys = raw_index_keys.new_zeros(batch_size, r - 1, index_head_dim)
            open_position = torch.zeros(batch_size, rope_positions.shape[0], dtype=torch.long, device=device)
        if open_logits is None and gate_logits is not None:
            open_logits = gate_logits.new_zeros(batch_size, r - 1, gate_logits.shape[-1])
        num_pooled, num_open = lengths // r, lengths % r
        num_windows = max(1, -(-(r - 1 + num_new) // r))
        # The new real tokens take the slots after their row's open window's tokens. A few tokens (a decode step, a
        # verify forward: each row's real tokens first, as the model lays them out) go by column, a padding column
        # past the row's last real token, where nothing is read; more go by count, padding to one spare slot more.
        few = num_new <= FEW_TOKENS
        spare = num_windows * r - (r - 1) - num_new + (not few)
        if few:
            slots = num_open[:, None] if num_new == 1 else num_open[:, None] + torch.arange(num_new, device=device)
        else:
            slots = torch.where(token_is_real, num_open[:, None] + token_is_real.long().cumsum(dim=1) - 1,
                                num_windows * r)
        index = slots[..., None]

        def with_new(open_part, new_part):  # [batch, windows * r, d], fixed shapes
            new_part = new_part.to(open_part.dtype)
            window = torch.cat([open_part, new_part] + [new_part.new_zeros(batch_size, spare, new_part.shape[-1])] * (
                spare > 0), dim=1).scatter(1, index.expand(-1, -1, new_part.shape[-1]), new_part)
            return window if few else window[:, : num_windows * r]  # without the spare slot

        if num_new == 1:  # decode: one window, the open one, which the token may complete
            first_positions = torch.where((num_open == 0)[None], rope_positions[:, :, 0], open_position.T)[..., None]
            complete, target = token_is_real & (num_open == r - 1)[:, None], num_pooled[:, None]
        else:
            first_positions = with_new(open_position[:, None].expand(-1, r - 1, -1), rope_positions.permute(1, 2, 0))
            first_positions = first_positions[:, ::r].permute(2, 0, 1)
            window_ids = torch.arange(num_windows, device=device)
            complete = window_ids < ((num_open + token_is_real.sum(dim=1)) // r)[:, None]
            target = num_pooled[:, None] + window_ids
        return WindowPlacement(
            keys=with_new(open_keys, raw_index_keys).view(batch_size, num_windows, r, index_head_dim),
            gate_logits=None if gate_logits is None else with_new(open_logits, gate_logits).view(
                batch_size, num_windows, r, gate_logits.shape[-1]),
            first_positions=first_positions, complete=complete, target=target,
            new_tokens=(raw_index_keys, gate_logits, rope_positions, token_is_real))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor | None, token_is_real: torch.Tensor,
               windows: WindowPlacement | None = None, pooled_keys: torch.Tensor | None = None):
        """Store the new tokens at their rows' positions and advance the lengths; with an indexer, also the pooled keys
        `[batch, windows, width]` the layer computed for `windows` (from `place_windows`; packed fp8 (uint8) with
        `fp8_index_keys`) and the new open window. `key_states, value_states`: `[batch, kv_heads, new, head_dim]` (MLA:
        its latents `[batch, 1, new, kv_lora_rank]` as keys, no values); padding (`token_is_real` false) is not stored.

        Returns the keys and values `[batch, kv_heads, capacity, head_dim]` (values None for MLA) and the pooled-key
        storage `[batch, capacity // r, width]` (None without an indexer): views of the storage whose entries beyond
        each row's length are stale or zero."""
        if self.fp8_index_keys and pooled_keys is not None and pooled_keys.dtype != torch.uint8:
            raise ValueError(
                f"This cache stores packed fp8 pooled keys, but got {pooled_keys.dtype} ones; quantise them first "
                "(HybridIndexPoolIndexer.pool_windows(..., quantize=True))."
            )
        # A decode step or a verify forward (a few tokens after the first write) writes by masked row-wise indexing
        # (`rows [batch, 1]`): fixed shapes, no host synchronisation.
        few = key_states.shape[-2] <= FEW_TOKENS and self.lengths is not None
        rows = torch.arange(key_states.shape[0], device=key_states.device)[:, None] if few else None
        self._make_room(key_states, value_states, token_is_real, windows, pooled_keys)
        self._write_keys(key_states, value_states, token_is_real, rows)
        if windows is not None:
            if self.record_past and self.pool_size > 1:  # at r = 1 every token is its own window: none reopens
                self._record(windows.new_tokens)
            else:
                self._drop_recording()
            self._store_windows(windows, pooled_keys, token_is_real, rows)
        self.lengths.add_(token_is_real.sum(dim=1))
        return self.keys, self.values, self.pooled_storage

    def _make_room(self, key_states, value_states, token_is_real, windows, pooled_keys) -> None:
        """Decide, on the host, the capacity these tokens need, and allocate or grow the storage to it. A multi-token
        input (or the first one) counts its real tokens, which reads the device once; a few tokens (a decode step, a
        verify forward) add their count to the host-side bound and read nothing."""
        batch_size, num_new = token_is_real.shape
        if num_new <= FEW_TOKENS and self.lengths is not None:
            if torch.compiler.is_compiling():
                if self.max_cache_len is None:
                    raise RuntimeError(
                        "A compiled decode step needs a cache with reserved storage: build it with "
                        "HybridIndexPoolCache(config, max_cache_len=N) (generate() does this), so that its shapes "
                        "never change."
                    )
                return  # the reserved capacity holds every token up to max_cache_len
            self._length_bound += num_new
        else:
            new_real = token_is_real.sum(dim=1)
            if self.lengths is not None:
                new_real = new_real + self.lengths.to(new_real.device)
            self._length_bound = int(new_real.max()) if batch_size else 0
        if self.lengths is None:  # empty storage of the right widths, grown below to what the rows can reach
            r, device = self.pool_size, key_states.device
            self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
            self.key_storage, self.value_storage = (None if states is None else states.new_zeros(
                batch_size, 0, states.shape[1], states.shape[-1]) for states in (key_states, value_states))
            if windows is not None:
                pooled_like = pooled_keys if self.fp8_index_keys else windows.keys
                self.pooled_storage = pooled_like.new_zeros(batch_size, 0, pooled_like.shape[-1])
                self.open_index_keys, self.open_gate_logits = (None if entries is None else entries.new_zeros(
                    batch_size, r - 1, entries.shape[-1]) for entries in (windows.keys, windows.gate_logits))
                self.open_window_position = torch.zeros(batch_size, windows.first_positions.shape[0],
                                                        dtype=torch.long, device=device)
            _mark_static(self.open_index_keys, self.open_gate_logits, self.open_window_position, self.lengths)
            if self.max_cache_len is not None:  # their real tokens plus those still to come
                needed = self._length_bound + max(0, self.max_cache_len - num_new)
            else:
                needed = _round_up(max(self._length_bound, 1), GROWTH_CHUNK)
            self._grow_to(_round_up(max(needed, 1), r))
        elif self._length_bound > self.capacity:
            # Past what was reserved (or grown) so far: grow by a bounded step. A compiled step never gets here: it
            # runs only within a reservation (generate() reserves each call's tokens up front).
            grown = max(self._length_bound, self.capacity + self.capacity // GROWTH_FRACTION)
            self._grow_to(_round_up(_round_up(grown, GROWTH_CHUNK), self.pool_size))

    def _grow_to(self, capacity: int) -> None:
        """Reallocate the storage for `capacity` positions per row, zero-filled beyond what it holds (fixed-shape
        decode steps read those entries, masked)."""
        if capacity <= self.capacity:
            return
        for name, size in (("key_storage", capacity), ("value_storage", capacity),
                           ("pooled_storage", capacity // self.pool_size)):
            old = getattr(self, name)
            if old is not None:
                grown = old.new_zeros(old.shape[0], size, *old.shape[2:])
                grown[:, : old.shape[1]] = old
                setattr(self, name, grown)
        _mark_static(self.key_storage, self.value_storage, self.pooled_storage)

    def _write_keys(self, key_states, value_states, token_is_real, rows) -> None:
        """Write the new tokens' keys and values at their positions: a few per row by masked writes at `rows`
        (decode, a verify forward: each row's real tokens first, `update` made room for every column), or any number
        (reads the device for its shapes)."""
        if rows is not None:
            num_new = token_is_real.shape[1]
            target = self.lengths[:, None] if num_new == 1 else self.lengths[:, None] + torch.arange(
                num_new, device=rows.device)
            target, real = target.clamp(max=self.capacity - 1), token_is_real[..., None, None]  # [batch, new, ...]
            for storage, new in ((self.key_storage, key_states), (self.value_storage, value_states)):
                if storage is not None:
                    new = new.transpose(1, 2).to(storage.dtype)  # [batch, new, kv_heads, head_dim]
                    storage[rows, target] = torch.where(real, new, storage[rows, target])
            return
        positions = self.lengths[:, None] + token_is_real.long().cumsum(dim=1) - 1  # of the real tokens
        rows, columns = token_is_real.nonzero(as_tuple=True)
        targets = positions[rows, columns]
        for storage, new in ((self.key_storage, key_states), (self.value_storage, value_states)):
            if storage is not None:
                storage[rows, targets] = new.transpose(1, 2)[rows, columns].to(storage.dtype)

    def _store_windows(self, windows: WindowPlacement, pooled_keys, token_is_real, rows) -> None:
        """Write the pooled keys of the complete windows and keep the tokens after the last one as the open window:
        by masked writes at `rows` for a few tokens, otherwise by reading which windows are complete."""
        r, num_new = self.pool_size, token_is_real.shape[1]
        pooled_keys = pooled_keys.to(self.pooled_storage.dtype)
        if rows is not None:  # the windows the new tokens can complete, whose indices the storage holds
            written = (r - 1 + num_new) // r
            target = windows.target[:, :written].clamp(max=self.pooled_storage.shape[1] - 1)
            self.pooled_storage[rows, target] = torch.where(windows.complete[:, :written, None],
                                                            pooled_keys[:, :written], self.pooled_storage[rows, target])
        else:
            complete_rows, complete_windows = windows.complete.nonzero(as_tuple=True)
            self.pooled_storage[complete_rows, windows.target[complete_rows, complete_windows]] = \
                pooled_keys[complete_rows, complete_windows]
        if rows is not None and num_new == 1:
            # The placement's first position is the open window's own unless the new token opens one.
            self.open_window_position.copy_(torch.where(token_is_real, windows.first_positions[:, :, 0].T,
                                                        self.open_window_position))
            # A completed window leaves stale entries behind, which its zero count makes invisible.
            if r > 1:
                self.open_index_keys.copy_(torch.where(token_is_real[..., None], windows.keys[:, 0, : r - 1],
                                                       self.open_index_keys))
                if windows.gate_logits is not None:
                    self.open_gate_logits.copy_(torch.where(
                        token_is_real[..., None], windows.gate_logits[:, 0, : r - 1], self.open_gate_logits))
            return
        # The tokens after the last complete window form the new open window.
        num_complete = windows.complete.sum(dim=1)
        batch = torch.arange(num_complete.shape[0], device=num_complete.device)
        last = num_complete.clamp(max=windows.keys.shape[1] - 1)
        self.open_window_position.copy_(windows.first_positions.permute(1, 2, 0)[batch, last])
        if r > 1:
            open_index = (num_complete[:, None] * r + torch.arange(r - 1, device=batch.device)).clamp(
                max=windows.keys.shape[1] * r - 1)
            for storage, entries in ((self.open_index_keys, windows.keys),
                                     (self.open_gate_logits, windows.gate_logits)):
                if entries is not None:
                    entries = entries.flatten(1, 2)  # [batch, width, d]
                    storage.copy_(entries.gather(1, open_index[..., None].expand(-1, -1, entries.shape[-1])))

    def _record(self, new_tokens) -> None:
        """Record the new tokens' raw indexer keys, gate logits (float32) and rotary positions, each as a window of its
        last r - 1 entries (`_WindowRecording`) that starts from the open window: what a crop needs to put back the
        open window it reopens. Called before the new tokens are stored."""
        raw_index_keys, gate_logits, rope_positions, token_is_real = new_tokens
        r, start = self.pool_size, self.recording_start(token_is_real)
        new = {"keys": (raw_index_keys, self.open_index_keys), "gate_logits": (gate_logits, self.open_gate_logits),
               "positions": (rope_positions.permute(1, 2, 0), self.open_window_position[:, None].expand(-1, r - 1, -1))}
        if start > 0 or not self._windows:  # the open window's entries last, as the window before the new tokens
            slots = (torch.arange(r - 1, device=self.lengths.device) + self.lengths[:, None] % r) % (r - 1)
        for name, (entries, opened) in new.items():
            if entries is None:
                continue
            sequence = entries.transpose(1, 2).to(opened.dtype)  # [batch, width, new]
            recording = self._windows.get(name)
            if start > 0 or recording is None:
                state = opened.gather(1, slots[..., None].expand(-1, -1, opened.shape[-1])).transpose(1, 2)
                recording, sequence = (_WindowRecording(state), sequence) if start == 0 else (
                    None, torch.cat([state, sequence], dim=-1))
            self._windows[name] = _WindowRecording.resume(recording, sequence, token_is_real, start)

    def _check_crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove <= 0 or self.lengths is None:
            return
        if self._windows:
            self._kept(tokens_to_remove)
            return
        remaining = self.lengths - tokens_to_remove
        if bool((remaining < 0).any()):
            raise ValueError(
                f"Cannot crop {tokens_to_remove} tokens: a row holds only {int(self.lengths.min())} real tokens.")
        inside_open = remaining >= (self.lengths // self.pool_size) * self.pool_size
        on_boundary = remaining % self.pool_size == 0
        if self.pooled_storage is not None and not bool((inside_open | on_boundary).all()):
            raise ValueError(
                f"Cannot crop {tokens_to_remove} tokens: the cut falls inside a window that is already pooled, whose "
                f"raw indexer keys are gone. Crop to a multiple of index_pool_size ({self.pool_size}) or within the "
                "open window, or call cache.activate_past_recording() before the forward whose tokens may be "
                "removed (generate() does for assisted decoding)."
            )

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last `tokens_to_remove` real tokens of every row and forget the recording (`crop(0)` keeps every
        token for good). Keys and values stay where they are; a cut into a pooled window puts back the open window it
        reopens from the recording (its stale pooled key lies beyond the new length, invisible)."""
        self._check_crop(tokens_to_remove)
        if tokens_to_remove > 0 and self.lengths is not None:
            if self._windows:
                # Each rebuilt window ends at the row's last kept token: the reopened window is its last `count`.
                kept, r = self._kept(tokens_to_remove), self.pool_size
                count = (self.lengths - tokens_to_remove) % r  # [batch]
                first = (r - 1 - count).clamp(max=r - 2)[:, None]
                needed = torch.arange(r - 1, device=count.device) < count[:, None]  # [batch, r - 1]
                for name, current in (("keys", self.open_index_keys), ("gate_logits", self.open_gate_logits),
                                      ("positions", self.open_window_position[:, None])):
                    if current is not None:
                        window = self._windows[name].rebuild(kept).transpose(1, 2)  # [batch, r - 1, width]
                        index = (first + torch.arange(current.shape[1], device=count.device)).clamp(max=r - 2)
                        picked = window.gather(1, index[..., None].expand(-1, -1, window.shape[-1]))
                        current.copy_(torch.where(needed[:, : current.shape[1], None], picked, current))
            self.lengths.sub_(tokens_to_remove)
            self._length_bound = max(0, self._length_bound - tokens_to_remove)
        self._drop_recording()

    def _memory_footprint(self) -> dict[str, tuple[int, int]]:
        """`{component: (bytes in use, bytes reserved)}`; `rollback` is what a recording holds (`recording_bytes` gives
        it by formula)."""
        if self.lengths is None:
            return dict.fromkeys(("key_value", "pooled_index_keys", "open_window", "bookkeeping", "rollback"), (0, 0))
        tokens, windows = int(self.lengths.sum()), int((self.lengths // self.pool_size).sum())
        open_per_token = 0 if self.open_index_keys is None else self.open_index_keys.shape[-1] * sum(
            tensor.element_size() for tensor in (self.open_index_keys, self.open_gate_logits) if tensor is not None)
        fixed = {"bookkeeping": _bytes(self.lengths, self.open_window_position),
                 "rollback": sum(recording.nbytes() for recording in self._windows.values())}
        return {
            "key_value": (tokens * _bytes(*[s[0, 0] for s in (self.key_storage, self.value_storage) if s is not None]),
                          _bytes(self.key_storage, self.value_storage)),
            "pooled_index_keys": (windows * _bytes(None if self.pooled_storage is None else self.pooled_storage[0, 0]),
                                  _bytes(self.pooled_storage)),
            "open_window": ((tokens - windows * self.pool_size) * open_per_token,
                            _bytes(self.open_index_keys, self.open_gate_logits)),
            **{name: (size, size) for name, size in fixed.items()},
        }


# transformers' `Cache` finds its layers' kinds by these classes (`get_conv_state`, `get_mask_sizes`, `is_linear`...):
# registered, our layers answer to them without inheriting the key/value and per-state storage they implement.
CacheLayerMixin.register(IndexPoolLayerCache)
LinearAttentionCacheLayerMixin.register(LinearAttentionLayerCache)
