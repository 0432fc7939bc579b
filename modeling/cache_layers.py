"""One layer's storage in a [`HybridIndexPoolCache`]: tensors and lengths, and where the next tokens go.

A cache layer never runs model code: the layer that owns it computes (pooling, norms, RoPE, quantisation, the delta
rule, a replay after a crop) and hands it tensors to keep.

- [`LinearAttentionLayerCache`]: the convolution and recurrent states of a linear-attention layer (plus the PLE
  histories of a PLE layer). While recording (`activate_past_recording`) it also keeps the state at a checkpoint and
  every later token's delta-rule inputs; `crop(-n)` rebuilds the convolution windows at once and leaves the recurrent
  state to the layer, which replays the kept tokens' recorded inputs at its next forward (`pending_replay`).
- [`IndexPoolLayerCache`]: an IndexPool layer's keys/values by position per row, its pooled indexer keys (one per
  complete window of `r` tokens) and the raw indexer keys and gate logits of each row's open window.
  `place_windows` answers which windows the new tokens complete (their raw keys, for the layer to pool); `update`
  stores the keys/values, the pooled keys and the new open window, and decides the storage it needs when it writes:
  reserved once for `max_cache_len` (what `generate()` passes), or grown by at most 1/16 of what it holds, rounded up
  to `GROWTH_CHUNK` positions. A decode step (one token per row) uses fixed shapes and reads nothing on the host.
"""

from dataclasses import dataclass

import torch

from .layers import last_real_entries

# Positions a growing (non-reserved) cache adds at least, and the fraction of its size it adds at most beyond need.
GROWTH_CHUNK = 256
GROWTH_FRACTION = 16


def _bytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _store(current: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    """Keep `new` as the state: copied into `current` when it has the same layout and no gradient is involved (so the
    state keeps its address for CUDA graphs), otherwise `new` itself."""
    if (
        current is not None and current.shape == new.shape and current.dtype == new.dtype
        and current.device == new.device
        and not (torch.is_grad_enabled() and (new.requires_grad or current.requires_grad))
    ):
        return current.copy_(new)
    return new


def _mark_static(*tensors: torch.Tensor | None) -> None:
    """Tell torch.compile that these tensors keep their address (needed for CUDA graphs of the decode step)."""
    if torch.compiler.is_compiling():
        return
    for tensor in tensors:
        if tensor is not None:
            torch._dynamo.mark_static_address(tensor)


def _kept_tokens(token_is_real: torch.Tensor, tokens_to_remove: int) -> torch.Tensor:
    """`[batch, n]`: the real tokens of each row but its last `tokens_to_remove` ones."""
    counts = token_is_real.long().cumsum(dim=1)
    return token_is_real & (counts <= counts[:, -1:] - tokens_to_remove)


class _WindowRecording:
    """A state made of the last `count` real entries of a sequence (a convolution's input window, an n-gram's token
    context), recorded since a checkpoint so that a crop can rebuild it for fewer tokens."""

    def __init__(self, checkpoint: torch.Tensor):
        self.checkpoint = checkpoint  # [batch, ..., count]
        self.entries: list[torch.Tensor] = []  # [batch, ..., new] per forward
        self.token_is_real: list[torch.Tensor] = []  # [batch, new] per forward

    def add(self, entries: torch.Tensor, token_is_real: torch.Tensor) -> None:
        # Copies: a slice of a forward's input would keep the whole input alive until the crop.
        self.entries.append(entries.clone())
        self.token_is_real.append(token_is_real.clone())

    def nbytes(self) -> int:
        return _bytes(self.checkpoint) + sum(_bytes(x) for x in self.entries + self.token_is_real)

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
    """What every cache layer shares: batch operations over the tensors named in `_batch_tensors` (batch first),
    transformers' past recording, and the lengths a layer answers.

    `seen_tokens` is the cache's count of attention-mask columns (padding included), one device scalar shared by every
    decoder layer of a [`HybridIndexPoolCache`]; a layer outside one (or an MTP layer) counts its own entries.
    """

    _batch_tensors: tuple[str, ...] = ()
    is_croppable = True
    is_sliding = False
    supports_early_init = False  # storage is allocated when the layer first writes, for what it must hold
    # transformers' past recording (`Cache.activate_past_recording`): while on, every forward records what `crop`
    # needs to remove its tokens again; a long forward records only its last `recurrent_states_to_keep + 1` tokens.
    record_past = False
    recurrent_states_to_keep: int | None = None
    seen_tokens: torch.Tensor | None = None

    def activate_past_recording(self, recurrent_states_to_keep: int | None = None) -> None:
        """Record, from the next forward on, what `crop(-n)` needs to remove the last `n` tokens, for `n` up to
        `recurrent_states_to_keep + 1` (any `n` when None) or the tokens fed since the last crop, if more."""
        self.record_past = True
        self.recurrent_states_to_keep = recurrent_states_to_keep
        self._drop_recording()

    def _drop_recording(self) -> None:
        """Forget what was recorded (a crop keeps the tokens before it for good)."""

    def _recording_start(self, token_is_real: torch.Tensor, extra: int = 0) -> int:
        """The first of the new columns `token_is_real [batch, new]` to record: a forward longer than the
        `recurrent_states_to_keep + 1` tokens a crop may remove (plus `extra`) records only the columns that hold each
        row's last ones (padding may lie anywhere: the layers see each row's real tokens first). Reads the device for
        a long forward (recording forwards run eagerly)."""
        keep = None if self.recurrent_states_to_keep is None else self.recurrent_states_to_keep + 1 + extra
        if keep is None or token_is_real.shape[1] <= keep:
            return 0
        after = token_is_real.flip(1).long().cumsum(dim=1).flip(1)  # [batch, new] real tokens from each column on
        enough = (after >= after[:, :1].clamp(max=keep)).all(dim=0)  # true up to the latest column that is enough
        return int(enough.long().cumsum(dim=0).max()) - 1

    def _map_batch(self, fn) -> None:
        for name in self._batch_tensors:
            value = getattr(self, name)
            if isinstance(value, tuple):
                setattr(self, name, tuple(fn(tensor) for tensor in value))
            elif value is not None:
                setattr(self, name, fn(value))

    @property
    def is_initialized(self) -> bool:
        return any(getattr(self, name) is not None for name in self._batch_tensors)

    @property
    def batch_size(self) -> int:
        """Rows held, or -1 before the first write."""
        tensors = [value for name in self._batch_tensors if isinstance(value := getattr(self, name), torch.Tensor)]
        return tensors[0].shape[0] if tensors else -1

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder the batch for beam search, in place (the storage keeps its address)."""
        self._map_batch(lambda t: t.copy_(t.index_select(0, beam_idx.to(t.device))))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every row `repeats` times (expanding a prompt to beams or samples)."""
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the rows `indices`."""
        self._map_batch(lambda t: t[indices.to(t.device)])

    def reset(self) -> None:
        """Forget everything (the next forward starts a new sequence)."""
        for name in self._batch_tensors:
            setattr(self, name, None)
        self._drop_recording()

    def offload(self) -> None:
        raise NotImplementedError(
            "HybridIndexPoolCache keeps its layers on their device (its storage is reserved once, by position); to "
            "hold less, use index_key_cache_dtype='float8_e4m3fn' or a smaller max_cache_len."
        )

    prefetch = offload

    def get_seq_length(self) -> int:
        """Tokens fed so far (attention-mask columns, padding included)."""
        return 0 if self.seen_tokens is None else int(self.seen_tokens)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """`(kv_length, kv_offset)` of a query of `query_length` tokens: every column so far, from 0."""
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def check_crop(self, tokens_to_remove: int) -> None:
        """Raise if `crop(tokens_to_remove)` (a count to remove) is impossible; change nothing."""


class LinearAttentionLayerCache(_LayerCache):
    """Convolution state `[batch, conv_dim, kernel - 1]` and recurrent state `[batch, heads, key_dim, value_dim]` of
    a linear-attention layer (Kimi Delta Attention keeps its convolution state in float32); on a PLE layer also the
    last `ple_ngram_size - 1` token ids and the PLE convolution's input history. Their sizes do not depend on the
    context.

    Rollback (`crop(-n)` after `activate_past_recording`) is by checkpoint and replay: the first recorded forward keeps
    the recurrent state it starts from, and every recorded forward its tokens' delta-rule inputs (query, key, value, log
    decay, beta) and convolution inputs. A crop rebuilds the convolution and PLE windows from the kept inputs and
    leaves `pending_replay`: the checkpoint and the recorded inputs with the removed tokens made no-ops (zero beta and
    log decay), which the layer runs through its rule at its next forward, before the new tokens.
    """

    _batch_tensors = ("conv_state", "recurrent_state", "ple_token_context", "ple_conv_state", "_replay_state",
                      "_replay_inputs")

    def __init__(self):
        self.conv_state: torch.Tensor | None = None
        self.recurrent_state: torch.Tensor | None = None
        self.ple_token_context: torch.Tensor | None = None
        self.ple_conv_state: torch.Tensor | None = None
        self._replay_state: torch.Tensor | None = None
        self._replay_inputs: tuple[torch.Tensor, ...] | None = None
        self._drop_recording()

    @property
    def is_compileable(self) -> bool:
        # A recording keeps host-side lists of per-forward tensors, and a pending replay runs the rule over them:
        # such forwards run eagerly.
        return not self.record_past and self._replay_inputs is None

    def _drop_recording(self) -> None:
        self._checkpoint: torch.Tensor | None = None
        self._inputs: list[tuple[torch.Tensor, ...]] = []  # (query, key, value, log_decay, beta) per forward
        self._conv = self._ple_tokens = self._ple_conv = None

    def pending_replay(self) -> tuple[torch.Tensor | None, tuple[torch.Tensor, ...]] | None:
        """What a crop left for the layer to replay before its next tokens: `(recurrent state at the checkpoint,
        (query, key, value, log_decay, beta) [batch, recorded, ...])`, removed tokens as no-ops; None when nothing."""
        return None if self._replay_inputs is None else (self._replay_state, self._replay_inputs)

    def recording_start(self, token_is_real: torch.Tensor) -> int | None:
        """Where the recording of the new tokens `token_is_real [batch, new]` starts: None when not recording, 0 for
        all of them, or a later column (a forward longer than a crop may remove): the layer then runs its rule to
        there first, and the state it reaches is the recording's checkpoint."""
        return self._recording_start(token_is_real) if self.record_past else None

    def update(self, conv_state: torch.Tensor, recurrent_state: torch.Tensor, checkpoint: torch.Tensor | None = None,
               rule_inputs: tuple[torch.Tensor, ...] | None = None, conv_input: torch.Tensor | None = None,
               token_is_real: torch.Tensor | None = None, start: int | None = None) -> None:
        """Store the states after the new tokens (any pending replay has been run). While recording, also keep what a
        crop needs, from column `start` (`recording_start`): the state there (`checkpoint`, kept when a new recording
        starts), the rule's inputs of the recorded columns `rule_inputs`, and the convolution input `conv_input
        [batch, channels, kernel - 1 + new]` (state, then the new tokens) with `token_is_real [batch, new]`."""
        self._replay_state = self._replay_inputs = None
        if start is None:
            self._drop_recording()
        else:
            width = conv_input.shape[-1] - token_is_real.shape[1]  # kernel - 1
            if start > 0 or self._conv is None:
                self._checkpoint = None if checkpoint is None else checkpoint.clone()
                self._inputs = []
                self._conv = _WindowRecording(last_real_entries(
                    conv_input[..., : width + start], token_is_real[:, :start].sum(dim=1), width))
            # Copies: slices of the projections would keep the whole forward's buffers (a prompt's) alive until a crop.
            self._inputs.append(tuple(x.clone() for x in rule_inputs))
            self._conv.add(conv_input[..., width + start:], token_is_real[:, start:])
        self.conv_state = _store(self.conv_state, conv_state)
        self.recurrent_state = _store(self.recurrent_state, recurrent_state)

    def update_ple(self, token_history: torch.Tensor, conv_input: torch.Tensor, token_is_real: torch.Tensor) -> None:
        """Store the PLE token context and convolution history after the new tokens, from `token_history [batch,
        context + new]` (the context, then the new token ids) and `conv_input [batch, channels, history + new]`
        (recorded while `record_past`); each row's real tokens come first."""
        num_new = token_is_real.shape[1]
        context, history = token_history.shape[1] - num_new, conv_input.shape[-1] - num_new
        if self.record_past:
            start = self._recording_start(token_is_real)
            if start > 0 or self._ple_tokens is None:
                real_before = token_is_real[:, :start].sum(dim=1)
                self._ple_tokens = _WindowRecording(
                    last_real_entries(token_history[:, : context + start], real_before, context))
                self._ple_conv = _WindowRecording(
                    last_real_entries(conv_input[..., : history + start], real_before, history))
            self._ple_tokens.add(token_history[:, context + start:], token_is_real[:, start:])
            self._ple_conv.add(conv_input[..., history + start:], token_is_real[:, start:])
        num_real = token_is_real.sum(dim=1)
        self.ple_token_context = _store(self.ple_token_context, last_real_entries(token_history, num_real, context))
        self.ple_conv_state = _store(self.ple_conv_state, last_real_entries(conv_input, num_real, history))

    def _recorded_tokens(self) -> torch.Tensor | None:
        """`[batch, recorded]` the real tokens recorded since the checkpoint (None when nothing is recorded)."""
        recording = self._conv or self._ple_tokens
        return None if recording is None else torch.cat(recording.token_is_real, dim=1)

    def check_crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove <= 0 or not self.is_initialized:
            return
        recorded = self._recorded_tokens()
        if recorded is None:
            raise ValueError(
                f"Cannot crop {tokens_to_remove} tokens: a linear-attention layer rolls back only the tokens fed "
                "since cache.activate_past_recording(recurrent_states_to_keep=k) (generate() calls it for assisted "
                "decoding) and the last crop; activate it before the forward whose tokens may be removed."
            )
        fewest = int(recorded.sum(dim=1).min())
        if tokens_to_remove > fewest:
            raise ValueError(
                f"Cannot crop {tokens_to_remove} tokens: a linear-attention layer recorded only {fewest} since its "
                f"last crop (a long forward records its last recurrent_states_to_keep + 1 = "
                f"{(self.recurrent_states_to_keep or 0) + 1}); activate past recording with a larger "
                "recurrent_states_to_keep."
            )

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `tokens_to_remove` tokens of every row and forget the recording (`crop(0)` keeps every
        token for good): the convolution and PLE windows are rebuilt now, the recurrent state at the next forward."""
        self.check_crop(tokens_to_remove)
        recorded = self._recorded_tokens()
        if tokens_to_remove > 0 and recorded is not None:
            kept = _kept_tokens(recorded, tokens_to_remove)
            if self._conv is not None:
                self.conv_state = _store(self.conv_state, self._conv.rebuild(kept))
                query, key, value, log_decay, beta = (torch.cat(parts, dim=1) for parts in zip(*self._inputs))
                # A removed token becomes a no-op of the rule: it neither decays nor writes the state.
                log_decay = log_decay * kept.view(*kept.shape, *[1] * (log_decay.dim() - 2))
                beta = beta * kept.view(*kept.shape, *[1] * (beta.dim() - 2)).to(beta.dtype)
                self._replay_state, self._replay_inputs = self._checkpoint, (query, key, value, log_decay, beta)
            if self._ple_tokens is not None:
                self.ple_token_context = _store(self.ple_token_context, self._ple_tokens.rebuild(kept))
                self.ple_conv_state = _store(self.ple_conv_state, self._ple_conv.rebuild(kept))
        self._drop_recording()

    def memory_footprint(self) -> dict[str, tuple[int, int]]:
        """`{component: (bytes in use, bytes reserved)}`; fixed-size states are entirely in use, and so is what a
        recording holds (`rollback`) and what a crop left to replay (`replay`)."""
        ple = _bytes(self.ple_token_context) + _bytes(self.ple_conv_state)
        conv, recurrent = _bytes(self.conv_state), _bytes(self.recurrent_state)
        rollback = self.rollback_bytes()
        replay = _bytes(self._replay_state) + sum(_bytes(x) for x in self._replay_inputs or ())
        return {"conv_state": (conv, conv), "recurrent_state": (recurrent, recurrent), "ple_state": (ple, ple),
                "rollback": (rollback, rollback), "replay": (replay, replay)}

    def rollback_bytes(self) -> int:
        """Bytes the recording holds: the checkpoint and the recorded tokens' inputs and masks (see `recording_bytes`
        for them by formula)."""
        total = _bytes(self._checkpoint) + sum(_bytes(x) for part in self._inputs for x in part)
        return total + sum(recording.nbytes() for recording in (self._conv, self._ple_tokens, self._ple_conv)
                           if recording is not None)


@dataclass
class WindowPlacement:
    """Where an IndexPool layer's new tokens go among its windows ([`IndexPoolLayerCache.place_windows`]): the raw
    indexer keys of the windows they touch, for the layer to pool, and what `update` needs to store the result.

    Attributes:
        keys: `[batch, windows, r, index_head_dim]` raw indexer keys of each row's open window followed by its new
            real tokens, by position, cut into windows.
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
            position `p`, valid for `p < lengths[b]`. `keys` / `values` present them as `[batch, kv_heads, capacity,
            head_dim]` views. MLA stores its latents as the keys (one head) and no values (None).
        pooled_storage: `[batch, capacity // r, index_head_dim]`, after norm and RoPE; window `c` at index `c`, valid
            for `c < lengths[b] // r`. With `fp8_index_keys`, packed fp8 keys `uint8 [batch, capacity // r,
            index_head_dim + 4]` (`kernels.fp8_index_keys`), quantised by the layer when the window completes.
        open_index_keys: `[batch, r - 1, index_head_dim]` raw indexer keys of the open window, the first
            `lengths[b] % r` valid; `open_gate_logits` the same for the pooling-gate logits (float32), or None.
        open_window_position: `[batch, streams]` rotary position of the open window's first token.
        lengths: `[batch]` int64, real tokens per row.
        capacity: positions reserved per row (a multiple of r).

    The indexer tensors stay None in a layer whose indexer is shared (it is updated without a placement).
    """

    _batch_tensors = ("key_storage", "value_storage", "pooled_storage", "open_index_keys", "open_gate_logits",
                      "open_window_position", "lengths")

    def __init__(self, pool_size: int, max_cache_len: int | None = None, fp8_index_keys: bool = False):
        self.pool_size = pool_size
        self.max_cache_len = max_cache_len
        self.fp8_index_keys = fp8_index_keys
        self.key_storage = self.value_storage = self.pooled_storage = None
        self.open_index_keys = self.open_gate_logits = self.open_window_position = self.lengths = None
        self.capacity = 0
        # Host-side upper bound of `lengths.max()`: decides growth without reading the device. Exact after every
        # multi-token write; a decode step adds one (not maintained inside a compiled step, where the capacity is
        # fixed).
        self._length_bound = 0
        self._open_windows: list[tuple[torch.Tensor, ...]] | None = None

    @property
    def is_compileable(self) -> bool:
        """Reserved storage (fixed shapes) and no recording (which keeps host-side lists)."""
        return self.max_cache_len is not None and not self.record_past

    def _drop_recording(self) -> None:
        # (raw keys, gate logits, rotary positions [batch, n, streams], positions, valid) per recorded forward
        self._open_windows = None

    @property
    def keys(self) -> torch.Tensor | None:
        return None if self.key_storage is None else self.key_storage.transpose(1, 2)

    @property
    def values(self) -> torch.Tensor | None:
        return None if self.value_storage is None else self.value_storage.transpose(1, 2)

    @property
    def pooled_index_keys(self) -> torch.Tensor | None:
        return self.pooled_storage

    @property
    def num_pooled(self) -> torch.Tensor | None:
        """`[batch]` complete windows per row."""
        return None if self.lengths is None else self.lengths // self.pool_size

    @property
    def num_open(self) -> torch.Tensor | None:
        """`[batch]` tokens in each row's open window."""
        return None if self.lengths is None else self.lengths % self.pool_size

    def get_seq_length(self) -> int:
        if self.seen_tokens is not None or self.lengths is None:
            return super().get_seq_length()
        return int(self.lengths.max())  # a layer of its own (an MTP layer): the entries of its longest row

    def get_max_length(self) -> int:
        return -1 if self.max_cache_len is None else self.max_cache_len

    def reset(self) -> None:
        super().reset()
        self.capacity = self._length_bound = 0

    def reserve(self, tokens_to_come: int) -> None:
        """Grow the storage, now and once, to hold `tokens_to_come` more tokens per row (reads the device)."""
        if self.lengths is not None:
            self._length_bound = int(self.lengths.max())
            self._grow_to(_round_up(self._length_bound + tokens_to_come, self.pool_size))

    def place_windows(self, raw_index_keys: torch.Tensor, gate_logits: torch.Tensor | None,
                      token_is_real: torch.Tensor, rope_positions: torch.Tensor) -> WindowPlacement:
        """The windows new tokens touch: each row's open window followed by its new real tokens, by position.

        Args:
            raw_index_keys: `[batch, new, index_head_dim]` indexer keys before norm and RoPE.
            gate_logits: `[batch, new, gate_width]` float32 pooling-gate logits (without the slot bias) or None.
            token_is_real: `[batch, new]` bool; padding takes no place.
            rope_positions: `[streams, batch, new]` rotary positions of the new tokens.

        A decode step (one token) gives one window per row, complete where the token completes it; it reads nothing
        on the host. Changes nothing: `update` stores.
        """
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
        new_tokens = (raw_index_keys, gate_logits, rope_positions, token_is_real)
        if num_new == 1:  # decode: the open window with the new token at its place, fixed shapes
            slot = num_open[:, None, None]

            def with_new(open_part, new_part):
                window = torch.cat([open_part, new_part.to(open_part.dtype)], dim=1)  # room for r tokens
                return window.scatter(1, slot.expand(-1, 1, open_part.shape[-1]), new_part.to(open_part.dtype))

            opens = (num_open == 0)[:, None]
            first = torch.where(opens, rope_positions[:, :, 0].T, open_position)  # [batch, streams]
            return WindowPlacement(
                keys=with_new(open_keys, raw_index_keys)[:, None],
                gate_logits=None if gate_logits is None else with_new(open_logits, gate_logits)[:, None],
                first_positions=first.T[:, :, None], complete=(token_is_real[:, 0] & (num_open == r - 1))[:, None],
                target=num_pooled[:, None], new_tokens=new_tokens)
        # Any number of tokens: scatter the new real tokens after their row's open window, by position.
        num_windows = max(1, -(-(r - 1 + num_new) // r))
        width = num_windows * r
        rows, columns = token_is_real.nonzero(as_tuple=True)
        relative = num_open[rows] + token_is_real.long().cumsum(dim=1)[rows, columns] - 1

        def scattered(new, open_part):  # [batch, width, d]
            buffer = new.new_zeros(batch_size, width, new.shape[-1])
            buffer[:, : open_part.shape[1]] = open_part.to(buffer.dtype)
            buffer[rows, relative] = new[rows, columns].to(buffer.dtype)
            return buffer

        positions = scattered(rope_positions.permute(1, 2, 0), open_position[:, None])  # [batch, width, streams]
        total_open = num_open + token_is_real.sum(dim=1)
        window_ids = torch.arange(num_windows, device=device)
        return WindowPlacement(
            keys=scattered(raw_index_keys, open_keys).view(batch_size, num_windows, r, index_head_dim),
            gate_logits=None if gate_logits is None else scattered(gate_logits, open_logits).view(
                batch_size, num_windows, r, gate_logits.shape[-1]),
            first_positions=positions[:, ::r].permute(2, 0, 1), complete=window_ids < (total_open // r)[:, None],
            target=num_pooled[:, None] + window_ids, new_tokens=new_tokens)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor | None, token_is_real: torch.Tensor,
               windows: WindowPlacement | None = None, pooled_keys: torch.Tensor | None = None):
        """Store the new tokens at their rows' positions and advance the lengths; with an indexer, also the pooled keys
        `[batch, windows, width]` the layer computed for `windows` (from `place_windows`) and the new open window.

        Args:
            key_states, value_states: `[batch, kv_heads, new, head_dim]`; MLA gives its latents `[batch, 1, new,
                kv_lora_rank]` as keys and no values (None).
            token_is_real: `[batch, new]` bool; padding is not stored.
            pooled_keys: packed fp8 (uint8) with `fp8_index_keys`, otherwise in the storage's precision.

        Returns:
            Keys and values `[batch, kv_heads, capacity, head_dim]` (values None for MLA) and the pooled-key storage
            `[batch, capacity // r, width]` (None without an indexer): views of the storage whose entries beyond each
            row's length are stale or zero.
        """
        if self.fp8_index_keys and pooled_keys is not None and pooled_keys.dtype != torch.uint8:
            raise ValueError(
                f"This cache stores packed fp8 pooled keys, but got {pooled_keys.dtype} ones; quantise them first "
                "(HybridIndexPoolIndexer.pool_windows(..., quantize=True))."
            )
        self._make_room(key_states, value_states, token_is_real, windows, pooled_keys)
        decode = key_states.shape[-2] == 1
        if decode:
            self._write_one(key_states, value_states, token_is_real[:, 0])
        else:
            self._write_many(key_states, value_states, token_is_real)
        if windows is not None:
            if self.record_past and self.pool_size > 1:  # at r = 1 every token is its own window: none reopens
                self._record(windows.new_tokens)
            else:
                self._drop_recording()
            self._store_windows(windows, pooled_keys, token_is_real, decode)
        self.lengths.add_(token_is_real.sum(dim=1))
        return self.keys, self.values, self.pooled_storage

    def _make_room(self, key_states, value_states, token_is_real, windows, pooled_keys) -> None:
        """Decide, on the host, the capacity these tokens need, and allocate or grow the storage to it. A multi-token
        input (or the first one) counts its real tokens, which reads the device once; a decode step adds one to the
        host-side bound and reads nothing."""
        batch_size, num_new = token_is_real.shape
        if num_new == 1 and self.lengths is not None:
            if torch.compiler.is_compiling():
                if self.max_cache_len is None:
                    raise RuntimeError(
                        "A compiled decode step needs a cache with reserved storage: build it with "
                        "HybridIndexPoolCache(config, max_cache_len=N) (generate() does this), so that its shapes "
                        "never change."
                    )
                return  # the reserved capacity holds every token up to max_cache_len
            self._length_bound += 1
        else:
            new_real = token_is_real.sum(dim=1)
            if self.lengths is not None:
                new_real = new_real + self.lengths.to(new_real.device)
            self._length_bound = int(new_real.max()) if batch_size else 0
        if self.lengths is None:
            if self.max_cache_len is not None:  # what the rows can reach: their real tokens plus those still to come
                needed = self._length_bound + max(0, self.max_cache_len - num_new)
            else:
                needed = _round_up(max(self._length_bound, 1), GROWTH_CHUNK)
            r, device = self.pool_size, key_states.device
            capacity = _round_up(max(needed, 1), r)
            self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
            # Zero-filled: entries beyond a row's length are read (and masked) by fixed-shape decode steps.
            self.key_storage = key_states.new_zeros(batch_size, capacity, *key_states.shape[1:2], key_states.shape[-1])
            if value_states is not None:
                self.value_storage = value_states.new_zeros(batch_size, capacity, value_states.shape[1],
                                                            value_states.shape[-1])
            if windows is not None:
                keys = windows.keys
                self.pooled_storage = (pooled_keys.new_zeros(batch_size, capacity // r, pooled_keys.shape[-1])
                                       if self.fp8_index_keys else keys.new_zeros(batch_size, capacity // r,
                                                                                   keys.shape[-1]))
                self.open_index_keys = keys.new_zeros(batch_size, r - 1, keys.shape[-1])
                self.open_window_position = torch.zeros(batch_size, windows.first_positions.shape[0],
                                                        dtype=torch.long, device=device)
                if windows.gate_logits is not None:
                    self.open_gate_logits = windows.gate_logits.new_zeros(batch_size, r - 1,
                                                                          windows.gate_logits.shape[-1])
            self.capacity = capacity
            _mark_static(self.key_storage, self.value_storage, self.pooled_storage, self.open_index_keys,
                         self.open_gate_logits, self.open_window_position, self.lengths)
        elif self._length_bound > self.capacity:
            # Past what was reserved (or grown) so far: grow by a bounded step. A compiled step never gets here: it
            # runs only within a reservation (generate() reserves each call's tokens up front).
            grown = max(self._length_bound, self.capacity + self.capacity // GROWTH_FRACTION)
            self._grow_to(_round_up(_round_up(grown, GROWTH_CHUNK), self.pool_size))

    def _grow_to(self, capacity: int) -> None:
        """Reallocate the storage for `capacity` positions per row, keeping what it holds."""
        if capacity <= self.capacity:
            return
        r, kept = self.pool_size, self.capacity
        for name in ("key_storage", "value_storage", "pooled_storage"):
            old = getattr(self, name)
            if old is not None:
                size = capacity if name != "pooled_storage" else capacity // r
                grown = old.new_zeros(old.shape[0], size, *old.shape[2:])
                grown[:, : kept if name != "pooled_storage" else kept // r] = old
                setattr(self, name, grown)
        self.capacity = capacity
        _mark_static(self.key_storage, self.value_storage, self.pooled_storage)

    def _write_one(self, key_states, value_states, real) -> None:
        """Decode: one token per row, fixed shapes, masked writes, no host synchronisation."""
        rows = torch.arange(key_states.shape[0], device=key_states.device)
        target = self.lengths.clamp(max=self.capacity - 1)
        for storage, new in ((self.key_storage, key_states), (self.value_storage, value_states)):
            if storage is not None:
                new = new[:, :, 0].to(storage.dtype)  # [batch, kv_heads, head_dim]
                storage[rows, target] = torch.where(real[:, None, None], new, storage[rows, target])

    def _write_many(self, key_states, value_states, token_is_real) -> None:
        """Prefill: any number of tokens per row; reads the device for its shapes."""
        positions = self.lengths[:, None] + token_is_real.long().cumsum(dim=1) - 1  # of the real tokens
        rows, columns = token_is_real.nonzero(as_tuple=True)
        targets = positions[rows, columns]
        self.key_storage[rows, targets] = key_states.transpose(1, 2)[rows, columns].to(self.key_storage.dtype)
        if value_states is not None:
            self.value_storage[rows, targets] = value_states.transpose(1, 2)[rows, columns].to(
                self.value_storage.dtype)

    def _store_windows(self, windows: WindowPlacement, pooled_keys, token_is_real, decode: bool) -> None:
        """Write the pooled keys of the complete windows and keep the tokens after the last one as the open window."""
        r, batch_size = self.pool_size, windows.keys.shape[0]
        rows = torch.arange(batch_size, device=windows.keys.device)
        pooled_keys = pooled_keys.to(self.pooled_storage.dtype)
        if decode:  # a masked write: fixed shapes, no host synchronisation
            target = windows.target[:, 0].clamp(max=self.pooled_storage.shape[1] - 1)
            complete = windows.complete[:, 0]
            self.pooled_storage[rows, target] = torch.where(complete[:, None], pooled_keys[:, 0],
                                                            self.pooled_storage[rows, target])
            real = token_is_real[:, 0]
            opens = (self.lengths % r == 0) & real
            self.open_window_position.copy_(torch.where(opens[:, None], windows.first_positions[:, :, 0].T,
                                                        self.open_window_position))
            # A completed window leaves stale entries behind, which its zero count makes invisible.
            if r > 1:
                self.open_index_keys.copy_(torch.where(real[:, None, None], windows.keys[:, 0, : r - 1],
                                                       self.open_index_keys))
                if windows.gate_logits is not None:
                    self.open_gate_logits.copy_(torch.where(real[:, None, None], windows.gate_logits[:, 0, : r - 1],
                                                            self.open_gate_logits))
            return
        complete_rows, complete_windows = windows.complete.nonzero(as_tuple=True)
        self.pooled_storage[complete_rows, windows.target[complete_rows, complete_windows]] = \
            pooled_keys[complete_rows, complete_windows]
        num_complete = windows.complete.sum(dim=1)
        num_windows = windows.keys.shape[1]
        # The tokens after the last complete window form the new open window.
        last = num_complete.clamp(max=num_windows - 1)
        self.open_window_position.copy_(windows.first_positions.permute(1, 2, 0)[rows, last])
        if r > 1:
            flat_keys = windows.keys.flatten(1, 2)  # [batch, width, d]
            open_index = (num_complete[:, None] * r + torch.arange(r - 1, device=rows.device)).clamp(
                max=flat_keys.shape[1] - 1)
            self.open_index_keys.copy_(flat_keys.gather(1, open_index[..., None].expand(-1, -1, flat_keys.shape[-1])))
            if windows.gate_logits is not None:
                flat_logits = windows.gate_logits.flatten(1, 2)
                self.open_gate_logits.copy_(flat_logits.gather(
                    1, open_index[..., None].expand(-1, -1, flat_logits.shape[-1])))

    def _record(self, new_tokens) -> None:
        """Record the new tokens' raw indexer keys and gate logits by position (before they are stored); the first
        recorded forward also records the open window it starts from. A long forward records its last
        `recurrent_states_to_keep + r` tokens: a crop of up to `recurrent_states_to_keep + 1` reopens a window that
        starts at most `r - 1` tokens earlier."""
        raw_index_keys, gate_logits, rope_positions, token_is_real = new_tokens
        start = self._recording_start(token_is_real, extra=self.pool_size - 1)
        if start > 0 or self._open_windows is None:
            self._open_windows = []
            if start == 0:
                slots = torch.arange(self.pool_size - 1, device=self.lengths.device)
                self._open_windows.append(tuple(x.clone() for x in (
                    self.open_index_keys, self.open_gate_logits if gate_logits is not None else None,
                    self.open_window_position[:, None].expand(-1, self.pool_size - 1, -1),
                    self.num_pooled[:, None] * self.pool_size + slots, slots < self.num_open[:, None])
                    if x is not None))
        positions = self.lengths[:, None] + token_is_real.long().cumsum(dim=1) - 1
        # Copies: a slice of a forward's keys would keep all of them (a prompt's) alive until the crop.
        self._open_windows.append(tuple(x.clone() for x in (
            raw_index_keys[:, start:], None if gate_logits is None else gate_logits[:, start:].float(),
            rope_positions[:, :, start:].permute(1, 2, 0), positions[:, start:], token_is_real[:, start:])
            if x is not None))

    def _recorded(self) -> dict[str, torch.Tensor]:
        """The recording's entries concatenated: `keys`, `gate_logits` (or absent), `rope_positions`, `positions`,
        `valid`, each `[batch, entries, ...]`."""
        names = ("keys", "gate_logits", "rope_positions", "positions", "valid")
        if self.open_gate_logits is None:
            names = ("keys", "rope_positions", "positions", "valid")
        return {name: torch.cat(parts, dim=1) for name, parts in zip(names, zip(*self._open_windows))}

    def _reopened_window(self, tokens_to_remove: int):
        """Where the recording holds each row's open window after removing `tokens_to_remove` tokens: `(index
        [batch, r - 1] into the recorded entries, needed [batch, r - 1])`; raises if an entry was not recorded."""
        recorded, r = self._recorded(), self.pool_size
        remaining = self.lengths - tokens_to_remove
        wanted = (remaining // r * r)[:, None] + torch.arange(r - 1, device=remaining.device)  # [batch, r - 1]
        needed = wanted < remaining[:, None]
        match = recorded["valid"][:, None, :] & (recorded["positions"][:, None, :] == wanted[..., None])
        if bool((needed & ~match.any(dim=-1)).any()):
            raise ValueError(
                f"Cannot crop {tokens_to_remove} tokens: the window this cut reopens starts before the tokens this "
                f"IndexPool layer recorded (a long forward records its last recurrent_states_to_keep + "
                f"index_pool_size tokens); activate past recording with a larger recurrent_states_to_keep."
            )
        return match.to(torch.uint8).argmax(dim=-1), needed, recorded

    def extend_to(self, length: int) -> None:
        """Count every row as holding `length` tokens: whatever the storage holds up to there becomes its content
        (for benchmarks that write synthetic keys into the storage to time a decode step at a long context without
        prefilling it). Reads nothing from the device."""
        if self.lengths is None or length > self.capacity:
            raise ValueError(f"extend_to({length}): the storage holds {self.capacity} positions per row; reserve "
                             "them first (HybridIndexPoolCache(config, max_cache_len=N) and one update).")
        self.lengths.fill_(length)
        self._length_bound = length

    def check_crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove <= 0 or self.lengths is None:
            return
        remaining = self.lengths - tokens_to_remove
        if bool((remaining < 0).any()):
            raise ValueError(
                f"Cannot crop {tokens_to_remove} tokens: a row holds only {int(self.lengths.min())} real tokens.")
        if self._open_windows is not None:
            self._reopened_window(tokens_to_remove)
            return
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
        """Drop the last `tokens_to_remove` real tokens of every row (as generated tokens are), and forget the
        recording (`crop(0)` keeps every token for good).

        Keys and values are stored by position: nothing moves. Pooled windows keep no raw keys, so without a
        recording a cut must fall inside each row's open window or on a window boundary; with one, a cut anywhere in
        the recorded tokens puts back the raw keys, gate logits and first rotary position of the window it reopens
        (its stale pooled key is beyond the new length, invisible, and overwritten when the window completes again).
        """
        self.check_crop(tokens_to_remove)
        if tokens_to_remove > 0 and self.lengths is not None:
            if self._open_windows is not None and self.pool_size > 1:
                index, needed, recorded = self._reopened_window(tokens_to_remove)

                def gathered(entries, current):
                    picked = entries.gather(1, index[..., None].expand(-1, -1, entries.shape[-1]))
                    return torch.where(needed[..., None], picked.to(current.dtype), current)

                self.open_index_keys.copy_(gathered(recorded["keys"], self.open_index_keys))
                if self.open_gate_logits is not None:
                    self.open_gate_logits.copy_(gathered(recorded["gate_logits"], self.open_gate_logits))
                first = recorded["rope_positions"].gather(
                    1, index[:, :1, None].expand(-1, 1, recorded["rope_positions"].shape[-1]))[:, 0]
                self.open_window_position.copy_(torch.where(needed[:, :1], first, self.open_window_position))
            self.lengths.sub_(tokens_to_remove)
            self._length_bound = max(0, self._length_bound - tokens_to_remove)
        self._drop_recording()

    def memory_footprint(self) -> dict[str, tuple[int, int]]:
        """`{component: (bytes in use, bytes reserved)}`."""
        if self.lengths is None:
            return dict.fromkeys(("key_value", "pooled_index_keys", "open_window", "bookkeeping", "rollback"), (0, 0))
        total_tokens = int(self.lengths.sum())
        total_windows = int((self.lengths // self.pool_size).sum())
        key_value_per_token = sum(storage[0, 0].numel() * storage.element_size()
                                  for storage in (self.key_storage, self.value_storage) if storage is not None)
        pooled_bytes = open_per_token = 0
        if self.pooled_storage is not None:
            pooled_bytes = self.pooled_storage.shape[-1] * self.pooled_storage.element_size()  # per window
            open_per_token = self.open_index_keys.shape[-1] * (self.open_index_keys.element_size() + (
                0 if self.open_gate_logits is None else self.open_gate_logits.element_size()))
        bookkeeping = _bytes(self.lengths) + _bytes(self.open_window_position)
        rollback = self.rollback_bytes()
        return {
            "key_value": (total_tokens * key_value_per_token, _bytes(self.key_storage) + _bytes(self.value_storage)),
            "pooled_index_keys": (total_windows * pooled_bytes, _bytes(self.pooled_storage)),
            "open_window": ((total_tokens - total_windows * self.pool_size) * open_per_token,
                            _bytes(self.open_index_keys) + _bytes(self.open_gate_logits)),
            "bookkeeping": (bookkeeping, bookkeeping),
            "rollback": (rollback, rollback),
        }

    def rollback_bytes(self) -> int:
        """Bytes the recording holds: the recorded tokens' raw indexer keys, gate logits and positions, and the open
        window at the checkpoint (see `recording_bytes` for them by formula)."""
        return sum(_bytes(x) for part in self._open_windows or () for x in part)

    def unpooled_index_bytes(self) -> int:
        """Bytes a per-token (r = 1) indexer key cache of the same storage would hold for the same tokens."""
        if self.lengths is None or self.pooled_storage is None:
            return 0
        return int(self.lengths.sum()) * self.pooled_storage.shape[-1] * self.pooled_storage.element_size()
