"""`HybridIndexPoolCache`: the generation cache of the hybrid model.

Per linear-attention layer (Gated DeltaNet or Kimi Delta Attention): the convolution state and the float32 recurrent
state, whose sizes do not depend on the context. Per IndexPool layer, every row is stored **by position**: a row's
entries are its real tokens (attention mask 1) in order, entry `p` holding the token at position `p`, so padding is
never written and costs nothing, and a row's windows are contiguous in its own storage whatever the mask looked like:

- the keys and values of every real token, `[batch, capacity, kv_heads, head_dim]`; for MLA one normed latent per
  token (`[batch, capacity, 1, kv_lora_rank]`, no separate values: the latent is expanded into both);
- the pooled indexer keys (after norm and RoPE) of complete windows, window `c` at index `c`;
- the raw indexer keys (and pooling-gate logits) of each row's open window, at most `r - 1` tokens;
- `lengths [batch]`, the real tokens of each row: `lengths // r` pooled windows and `lengths % r` open tokens.

A layer whose indexer is shared (`indexer_types`) has no indexer state: only keys/values (or latents) and lengths.

Memory is reserved, not grown by doubling. With `max_cache_len` (which `generate()` sets to prompt + new tokens) the
storage is allocated once, at the first update, for exactly what the rows can reach. Without it the storage grows by
at most 1/16 of what it holds, rounded up to `GROWTH_CHUNK` positions, so reserved bytes stay within ~6% of the bytes
in use plus one chunk. `memory_footprint()` reports both.

The cache only stores: it never pools, norms, rotates or quantises. `IndexPoolLayerCache.update` stores the new
keys/values and returns the raw indexer keys of the windows the step completes ([`CompletedWindows`]); the layer's
indexer pools them, and `store_pooled_index_keys` writes the result where those windows belong.

A decode step (one new token per row) uses fixed shapes and makes no host synchronisation: tokens are written at
each row's length with indexed writes, the window it completes (if any) is written with a masked write, and the
lengths are advanced in place. With `max_cache_len` nothing in the step depends on host-side counters, so a
compiled step is reused at every length (`is_compileable`).
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from ..kernels.fp8_index_keys import packed_width
from .layers import FEW_TOKENS, last_real_entries

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


def _compact_last(sequence: torch.Tensor, kept: torch.Tensor, count: int) -> torch.Tensor:
    """The last `count` entries of each row among those `kept [batch, n]` marks, along the last dimension of
    `sequence [batch, ..., n]` whose first `count` entries are always kept (the state before the new tokens)."""
    # A stable sort brings each row's kept entries to the front in order, then the state ends at its last kept one.
    order = torch.sort((~kept).to(torch.uint8), dim=1, stable=True).indices
    order = order.view(order.shape[0], *([1] * (sequence.dim() - 2)), -1).expand_as(sequence)
    compacted = sequence.gather(-1, order)
    index = (kept.sum(dim=1) - count)[:, None] + torch.arange(count, device=sequence.device)
    index = index.view(index.shape[0], *([1] * (sequence.dim() - 2)), count).expand(*sequence.shape[:-1], count)
    return compacted.gather(-1, index)


def _kept_tokens(token_is_real: torch.Tensor, tokens_to_remove: int) -> torch.Tensor:
    """`[batch, n]`: the real tokens of each row but its last `tokens_to_remove` ones."""
    counts = token_is_real.long().cumsum(dim=1)
    return token_is_real & (counts <= counts[:, -1:] - tokens_to_remove)


class _WindowRecording:
    """A state made of the last `count` real entries of a sequence (a convolution's input window, an n-gram's token
    context), recorded since a checkpoint so that a crop can rebuild it for fewer tokens: the checkpoint state and the
    new entries of every forward since, with their real-token masks."""

    def __init__(self, checkpoint: torch.Tensor):
        self.checkpoint = checkpoint  # [batch, ..., count]
        self.entries: list[torch.Tensor] = []  # [batch, ..., new] per forward
        self.token_is_real: list[torch.Tensor] = []  # [batch, new] per forward

    def add(self, entries: torch.Tensor, token_is_real: torch.Tensor) -> None:
        self.entries.append(entries)
        self.token_is_real.append(token_is_real)

    def rebuild(self, kept: torch.Tensor) -> torch.Tensor:
        """The state after the recorded tokens `kept [batch, recorded]` marks."""
        count = self.checkpoint.shape[-1]
        sequence = torch.cat([self.checkpoint, *[entries.to(self.checkpoint.dtype) for entries in self.entries]], -1)
        always = kept.new_ones(kept.shape[0], count)
        return _compact_last(sequence, torch.cat([always, kept], dim=1), count)


@dataclass
class _RecurrentRecording:
    """What a linear-attention layer needs to return to any point of the tokens recorded since a checkpoint: the
    recurrent state at the checkpoint and the rule's inputs of every token since (replayed by `crop`)."""

    rule: Callable  # `rule(query, key, value, log_decay, beta, initial_state, mode=...) -> (output, final_state)`
    checkpoint: torch.Tensor | None
    inputs: list[tuple[torch.Tensor, ...]]  # (query, key, value, log_decay, beta) per forward, `[batch, new, ...]`


class _LayerCache:
    """Shared batch bookkeeping: every tensor attribute named in `_batch_tensors` has the batch first."""

    _batch_tensors: tuple[str, ...] = ()
    is_compileable = True
    is_croppable = False
    supports_early_init = False
    # transformers' past recording (`Cache.activate_past_recording`): while on, every forward records what `crop`
    # needs to remove its tokens again; a long forward records only its last `recurrent_states_to_keep + 1` tokens.
    record_past = False
    recurrent_states_to_keep: int | None = None

    def activate_past_recording(self, recurrent_states_to_keep: int | None = None) -> None:
        """Record, from the next forward on, what `crop(-n)` needs to remove the last `n` tokens, for `n` up to
        `recurrent_states_to_keep + 1` (any `n` when None) or the tokens fed since the last crop, if more."""
        self.record_past = True
        self.recurrent_states_to_keep = recurrent_states_to_keep
        self._drop_recording()

    def _drop_recording(self) -> None:
        """Forget what was recorded (a crop keeps the tokens before it for good)."""

    def _recording_start(self, num_new: int, extra: int = 0) -> int:
        """The first of `num_new` new columns to record: a forward longer than the `recurrent_states_to_keep + 1`
        tokens a crop may remove (plus `extra`) records only its last ones, and restarts the recording there."""
        if self.recurrent_states_to_keep is None:
            return 0
        return max(0, num_new - self.recurrent_states_to_keep - 1 - extra)

    def _map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for name in self._batch_tensors:
            tensor = getattr(self, name)
            if tensor is not None:
                setattr(self, name, fn(tensor))

    @property
    def is_initialized(self) -> bool:
        return any(getattr(self, name) is not None for name in self._batch_tensors)

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

    def offload(self) -> None:  # called by `Cache` only when offloading, which this cache does not do
        raise NotImplementedError("HybridIndexPoolCache does not support offloading.")

    prefetch = offload

    @property
    def batch_size(self) -> int:
        tensors = [getattr(self, name) for name in self._batch_tensors if getattr(self, name) is not None]
        return tensors[0].shape[0] if tensors else -1

    def get_max_length(self) -> int:
        return -1

    def check_crop(self, tokens_to_remove: int) -> None:
        """Raise if `crop(-tokens_to_remove)` is impossible; change nothing."""

    def reserved_bytes(self) -> int:
        """Bytes of every tensor this layer holds."""
        return sum(_bytes(getattr(self, name)) for name in self._batch_tensors)


class LinearAttentionLayerCache(_LayerCache):
    """Convolution state `[batch, conv_dim, kernel - 1]` and recurrent state `[batch, heads, key_dim, value_dim]` of
    a linear-attention layer (Kimi Delta Attention keeps its convolution state in float32);
    on a PLE layer also the last `ple_ngram_size - 1` token ids and the PLE convolution's input history. Their sizes do
    not depend on the context.

    Rollback (`crop(-n)` after `activate_past_recording`) is by checkpoint and replay: the first recorded forward
    keeps the states it starts from, and every recorded forward keeps its tokens' delta-rule inputs (query, key,
    value, log decay, beta) and convolution inputs. A crop replays the rule from the checkpoint over the tokens it
    keeps (the removed ones masked to no-ops: zero beta and log decay) and rebuilds the convolution and PLE windows
    from the kept inputs; removing nothing replays nothing.
    """

    _batch_tensors = ("conv_state", "recurrent_state", "ple_token_context", "ple_conv_state")
    is_croppable = True  # with a recording (generate() activates it for assisted decoding)

    def __init__(self):
        self.conv_state: torch.Tensor | None = None
        self.recurrent_state: torch.Tensor | None = None
        self.ple_token_context: torch.Tensor | None = None
        self.ple_conv_state: torch.Tensor | None = None
        self._recurrent: _RecurrentRecording | None = None
        self._conv: _WindowRecording | None = None
        self._ple_tokens: _WindowRecording | None = None
        self._ple_conv: _WindowRecording | None = None

    @property
    def is_compileable(self) -> bool:
        # Recording keeps lists of per-forward tensors on the host side: such forwards run eagerly.
        return not self.record_past

    def _drop_recording(self) -> None:
        self._recurrent = self._conv = self._ple_tokens = self._ple_conv = None

    def update(self, conv_state: torch.Tensor, recurrent_state: torch.Tensor) -> None:
        """Store the states after the new tokens."""
        self.conv_state = _store(self.conv_state, conv_state)
        self.recurrent_state = _store(self.recurrent_state, recurrent_state)

    def run_rule(self, rule: Callable, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 log_decay: torch.Tensor, beta: torch.Tensor, conv_input: torch.Tensor, token_is_real: torch.Tensor,
                 mode: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Run a layer's delta rule `rule(query, key, value, log_decay, beta, initial_state, mode=...)` over the new
        tokens from the cached recurrent state and return its output and final state, recording (while
        `record_past`) what a crop needs: the rule's inputs, and the convolution inputs `conv_input [batch, channels,
        kernel - 1 + new]` (state, then the new tokens). A forward longer than the tokens a crop may remove runs the
        rule in two pieces, so that the state where its recording starts is known."""
        state = self.recurrent_state
        if not self.record_past:
            self._drop_recording()
            return rule(query, key, value, log_decay, beta, state, mode=mode)
        inputs = (query, key, value, log_decay, beta)
        start = self._recording_start(query.shape[1])
        width = conv_input.shape[-1] - query.shape[1]  # kernel - 1
        head = None
        if start > 0 or self._recurrent is None:
            if start > 0:
                head, state = rule(*(x[:, :start] for x in inputs), state, mode="chunk")
            elif state is not None:
                state = state.clone()  # the cache's own state is overwritten in place by `update`
            self._recurrent = _RecurrentRecording(rule, state, [])
            self._conv = _WindowRecording(
                last_real_entries(conv_input[..., : width + start], token_is_real[:, :start].sum(dim=1), width))
        tail = tuple(x[:, start:] for x in inputs)
        self._recurrent.inputs.append(tail)
        self._conv.add(conv_input[..., width + start:], token_is_real[:, start:])
        output, final_state = rule(*tail, state, mode=mode if head is None else "chunk")
        return (output if head is None else torch.cat([head, output], dim=1)), final_state

    def update_ple(self, token_history: torch.Tensor, conv_input: torch.Tensor, token_is_real: torch.Tensor) -> None:
        """Store the PLE token context and convolution history after the new tokens, from `token_history [batch,
        context + new]` (the context, then the new token ids) and `conv_input [batch, channels, history + new]`
        (recorded while `record_past`); each row's real tokens come first."""
        num_new = token_is_real.shape[1]
        context, history = token_history.shape[1] - num_new, conv_input.shape[-1] - num_new
        if not self.record_past:
            self._drop_recording()
        else:
            start = self._recording_start(num_new)
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

    def recorded_tokens(self) -> torch.Tensor | None:
        """`[batch, recorded]` the real tokens recorded since the checkpoint (None when nothing is recorded)."""
        recording = self._conv or self._ple_tokens
        return None if recording is None else torch.cat(recording.token_is_real, dim=1)

    def check_crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove <= 0 or not self.is_initialized:
            return
        recorded = self.recorded_tokens()
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
        """Remove the last `tokens_to_remove` tokens of every row (replaying the recorded ones it keeps), and forget
        the recording: `crop(0)` keeps every token for good."""
        self.check_crop(tokens_to_remove)
        recorded = self.recorded_tokens()
        if tokens_to_remove > 0 and recorded is not None:
            kept = _kept_tokens(recorded, tokens_to_remove)
            if self._conv is not None:
                self.conv_state = _store(self.conv_state, self._conv.rebuild(kept))
                query, key, value, log_decay, beta = (torch.cat(parts, dim=1) for parts in zip(*self._recurrent.inputs))
                # A removed token becomes a no-op of the rule: it neither decays nor writes the state.
                log_decay = log_decay * kept.view(*kept.shape, *[1] * (log_decay.dim() - 2))
                beta = beta * kept.view(*kept.shape, *[1] * (beta.dim() - 2)).to(beta.dtype)
                checkpoint = self._recurrent.checkpoint
                # A few tokens replay token by token, as the layers run them (the chunked form costs far more there).
                mode = "recurrent" if checkpoint is not None and query.shape[1] <= FEW_TOKENS else "chunk"
                _, state = self._recurrent.rule(query, key, value, log_decay, beta, checkpoint, mode=mode)
                self.recurrent_state = _store(self.recurrent_state, state)
            if self._ple_tokens is not None:
                self.ple_token_context = _store(self.ple_token_context, self._ple_tokens.rebuild(kept))
                self.ple_conv_state = _store(self.ple_conv_state, self._ple_conv.rebuild(kept))
        self._drop_recording()

    def memory_footprint(self) -> dict[str, tuple[int, int]]:
        """`{component: (bytes in use, bytes reserved)}`; fixed-size states are entirely in use, and so is what a
        recording holds (`rollback`)."""
        ple = _bytes(self.ple_token_context) + _bytes(self.ple_conv_state)
        conv, recurrent = _bytes(self.conv_state), _bytes(self.recurrent_state)
        rollback = self.rollback_bytes()
        return {"conv_state": (conv, conv), "recurrent_state": (recurrent, recurrent), "ple_state": (ple, ple),
                "rollback": (rollback, rollback)}

    def rollback_bytes(self) -> int:
        """Bytes the recording holds: checkpoints and the recorded tokens' inputs."""
        total = 0
        if self._recurrent is not None:
            total += _bytes(self._recurrent.checkpoint) + sum(_bytes(x) for part in self._recurrent.inputs
                                                              for x in part)
        for recording in (self._conv, self._ple_tokens, self._ple_conv):
            if recording is not None:
                total += _bytes(recording.checkpoint) + sum(_bytes(x) for x in recording.entries)
        return total


@dataclass
class _OpenWindowRecording:
    """The raw indexer keys (and pooling-gate logits, rotary positions) of the tokens an IndexPool layer received
    since a checkpoint, with their positions, plus the open window it held there: whatever a crop needs to reopen a
    window that these tokens completed and pooled. One entry per forward, each `[batch, n, ...]`."""

    keys: list[torch.Tensor]
    gate_logits: list[torch.Tensor] | None
    rope_positions: list[torch.Tensor]  # [batch, n, streams]
    positions: list[torch.Tensor]  # [batch, n]
    valid: list[torch.Tensor]  # [batch, n]

    def add(self, keys, gate_logits, rope_positions, positions, valid) -> None:
        self.keys.append(keys)
        if self.gate_logits is not None:
            self.gate_logits.append(gate_logits)
        self.rope_positions.append(rope_positions)
        self.positions.append(positions)
        self.valid.append(valid)


@dataclass
class CompletedWindows:
    """The windows an [`IndexPoolLayerCache.update`] completes: their raw indexer keys, for the indexer to pool, and
    where their pooled keys belong (given back to [`IndexPoolLayerCache.store_pooled_index_keys`] unchanged).

    Attributes:
        keys: `[batch, windows, r, index_head_dim]` raw indexer keys, each window's tokens in order.
        gate_logits: `[batch, windows, r, gate_width]` float32 pooling-gate logits (without the slot bias), or None.
        first_positions: `[streams, batch, windows]` rotary positions of each window's first token.
        source: `(rows, windows)` indexing the complete windows in `keys`; None in a decode step, whose one window
            per row is at index 0 and is stored where `complete` says.
        target: `(rows, windows)` indexing the pooled-key storage.
        complete: `[batch]` bool in a decode step (the rows whose window this token completes), else None.
    """

    keys: torch.Tensor
    gate_logits: torch.Tensor | None
    first_positions: torch.Tensor
    source: tuple[torch.Tensor, torch.Tensor] | None
    target: tuple[torch.Tensor, torch.Tensor]
    complete: torch.Tensor | None = None


class IndexPoolLayerCache(_LayerCache):
    """One IndexPool layer's keys/values, pooled indexer keys and open windows, stored by position per row.

    Attributes:
        key_storage, value_storage: `[batch, capacity, kv_heads, head_dim]`; entry `p` of row `b` is its token at
            position `p`, valid for `p < lengths[b]`. `keys` / `values` present them as `[batch, kv_heads, capacity,
            head_dim]` views. MLA stores its latents as the keys (one head) and no values (None).
        pooled_storage: `[batch, capacity // r, index_head_dim]`, after norm and RoPE; window `c` at index `c`, valid
            for `c < lengths[b] // r`. With `fp8_index_keys`, packed fp8 keys `uint8 [batch, capacity // r,
            index_head_dim + 4]` (`kernels.fp8_index_keys`: rotated, fp8 values and a float32 scale), quantised once
            when the window completes.
        open_index_keys: `[batch, r - 1, index_head_dim]` raw indexer keys of the open window, the first
            `lengths[b] % r` valid.
        open_gate_logits: the same for the pooling-gate logits (float32; width 1 for `learned_scalar`), or None
            without a learned gate.
        open_window_position: `[batch, streams]` rotary position of the open window's first token (its pooled key
            is rotated there when the window completes).
        lengths: `[batch]` int64, real tokens per row.
        capacity: positions reserved per row (a multiple of r).

    The indexer tensors stay None in a layer whose indexer is shared (it is updated with `raw_index_keys=None`).
    """

    _batch_tensors = (
        "key_storage", "value_storage", "pooled_storage", "open_index_keys", "open_gate_logits",
        "open_window_position", "lengths",
    )
    is_croppable = True

    def __init__(self, pool_size: int, max_cache_len: int | None = None, fp8_index_keys: bool = False):
        self.pool_size = pool_size
        self.max_cache_len = max_cache_len
        self.fp8_index_keys = fp8_index_keys
        self.key_storage: torch.Tensor | None = None
        self.value_storage: torch.Tensor | None = None
        self.pooled_storage: torch.Tensor | None = None
        self.open_index_keys: torch.Tensor | None = None
        self.open_gate_logits: torch.Tensor | None = None
        self.open_window_position: torch.Tensor | None = None
        self.lengths: torch.Tensor | None = None
        self.capacity = 0
        # Host-side upper bound of `lengths.max()`: decides growth without reading the device. Exact after every
        # prefill; a decode step adds one (not maintained inside a compiled step, where the capacity is fixed).
        self.length_bound = 0
        self._planned_capacity = 0
        self._open_windows: _OpenWindowRecording | None = None

    @property
    def is_compileable(self) -> bool:
        """Reserved storage (fixed shapes) and no recording (which keeps host-side lists)."""
        return self.max_cache_len is not None and not self.record_past

    def _drop_recording(self) -> None:
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

    def reset(self) -> None:
        super().reset()
        self.capacity = self.length_bound = self._planned_capacity = 0

    def plan(self, token_is_real: torch.Tensor) -> None:
        """Decide, on the host, the capacity the next update needs for the new tokens `token_is_real [batch, new]`.

        A multi-token input (or the first one) counts its real tokens, which reads the device once; a decode step
        adds one to the host-side bound and reads nothing.
        """
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
            self.length_bound += 1
        else:
            new_real = token_is_real.sum(dim=1)
            if self.lengths is not None:
                new_real = new_real + self.lengths.to(new_real.device)
            self.length_bound = int(new_real.max()) if batch_size else 0
        if self.lengths is None:
            if self.max_cache_len is not None:
                # The rows can reach their real prompt tokens plus the tokens still to come.
                needed = self.length_bound + max(0, self.max_cache_len - num_new)
            else:
                needed = _round_up(max(self.length_bound, 1), GROWTH_CHUNK)
            self._planned_capacity = _round_up(max(needed, 1), self.pool_size)
        elif self.length_bound > self.capacity:
            # Past what was reserved (or grown) so far: grow by a bounded step. A compiled step never gets here: it
            # runs only within a reservation (generate() reserves each call's tokens up front).
            grown = max(self.length_bound, self.capacity + self.capacity // GROWTH_FRACTION)
            grown = _round_up(_round_up(grown, GROWTH_CHUNK), self.pool_size)
            self._planned_capacity = max(self._planned_capacity, grown)

    def reserve(self, tokens_to_come: int) -> None:
        """Make the next update reserve room for `tokens_to_come` more tokens per row at once (reads the device)."""
        if self.lengths is None:
            return
        self.length_bound = int(self.lengths.max())
        needed = _round_up(self.length_bound + tokens_to_come, self.pool_size)
        self._planned_capacity = max(self._planned_capacity, needed) if needed > self.capacity else 0

    def _allocate(self, key_states, value_states, raw_index_keys, gate_logits, num_streams: int) -> None:
        """Allocate (first update) or grow the storage to the planned capacity, keeping what it holds."""
        capacity, r = self._planned_capacity, self.pool_size
        batch_size, kv_heads, _, head_dim = key_states.shape
        # Zero-filled: entries beyond a row's length are read (and masked) by fixed-shape decode steps.
        key_storage = key_states.new_zeros(batch_size, capacity, kv_heads, head_dim)
        value_storage = pooled_storage = None
        if value_states is not None:
            value_storage = value_states.new_zeros(batch_size, capacity, kv_heads, value_states.shape[-1])
        if raw_index_keys is not None:
            index_head_dim = raw_index_keys.shape[-1]
            if self.fp8_index_keys:
                pooled_storage = torch.zeros(batch_size, capacity // r, packed_width(index_head_dim),
                                             dtype=torch.uint8, device=raw_index_keys.device)
            else:
                pooled_storage = raw_index_keys.new_zeros(batch_size, capacity // r, index_head_dim)
        if self.key_storage is None:
            self.lengths = torch.zeros(batch_size, dtype=torch.long, device=key_states.device)
            if raw_index_keys is not None:
                self.open_index_keys = raw_index_keys.new_zeros(batch_size, r - 1, index_head_dim)
                self.open_window_position = torch.zeros(batch_size, num_streams, dtype=torch.long,
                                                        device=key_states.device)
            if gate_logits is not None:
                self.open_gate_logits = gate_logits.new_zeros(batch_size, r - 1, gate_logits.shape[-1])
        else:
            kept = self.capacity
            key_storage[:, :kept] = self.key_storage
            if value_storage is not None:
                value_storage[:, :kept] = self.value_storage
            if pooled_storage is not None:
                pooled_storage[:, : kept // r] = self.pooled_storage
        self.key_storage, self.value_storage, self.pooled_storage = key_storage, value_storage, pooled_storage
        self.capacity = capacity
        _mark_static(self.key_storage, self.value_storage, self.pooled_storage, self.open_index_keys,
                     self.open_gate_logits, self.open_window_position, self.lengths)

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor | None,
        raw_index_keys: torch.Tensor | None,
        gate_logits: torch.Tensor | None,
        token_is_real: torch.Tensor,
        rope_positions: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None, CompletedWindows | None]:
        """Store the new tokens' keys/values and open-window indexer keys at their rows' positions, and advance the
        lengths. Call `plan` first (the model does, once per forward).

        Args:
            key_states, value_states: `[batch, kv_heads, new, head_dim]`; MLA gives its latents `[batch, 1, new,
                kv_lora_rank]` as keys and no values (None).
            raw_index_keys: `[batch, new, index_head_dim]` indexer keys before norm and RoPE; None in a layer whose
                indexer is shared (then the gate logits are None too).
            gate_logits: `[batch, new, index_head_dim]` (`[batch, new, 1]` for one weight per token) float32
                pooling-gate logits (without the slot bias) or None.
            token_is_real: `[batch, new]` bool; padding is not stored.
            rope_positions: `[streams, batch, new]` rotary positions of the new tokens; the cache keeps the open
                window's first one, at which its pooled key will be rotated.

        Returns:
            Keys and values `[batch, kv_heads, capacity, head_dim]` (values None for MLA), views of the storage whose
            entries beyond each row's length are stale or zero; and the windows these tokens complete, which the
            indexer pools and `store_pooled_index_keys` stores (None without an indexer, or when a multi-token
            input completes none; a decode step always returns its one masked window per row).
        """
        if self.key_storage is None or self._planned_capacity > self.capacity:
            self._allocate(key_states, value_states, raw_index_keys, gate_logits, rope_positions.shape[0])
        if not self.record_past or raw_index_keys is None:
            self._drop_recording()
        else:
            self._record(raw_index_keys, gate_logits, token_is_real, rope_positions)
        write = self._write_one if key_states.shape[-2] == 1 else self._write_many
        completed = write(key_states, value_states, raw_index_keys, gate_logits, token_is_real, rope_positions)
        self.lengths.add_(token_is_real.sum(dim=1))
        return self.keys, self.values, completed

    def _record(self, raw_index_keys, gate_logits, token_is_real, rope_positions) -> None:
        """Record the new tokens' raw indexer keys and gate logits by position (before they are stored); the first
        recorded forward also records the open window it starts from. A long forward records its last
        `recurrent_states_to_keep + r` tokens: a crop of up to `recurrent_states_to_keep + 1` reopens a window that
        starts at most `r - 1` tokens earlier."""
        start = self._recording_start(raw_index_keys.shape[1], extra=self.pool_size - 1)
        if start > 0 or self._open_windows is None:
            logits = None if gate_logits is None else []
            self._open_windows = _OpenWindowRecording([], logits, [], [], [])
            if start == 0 and self.pool_size > 1:
                slots = torch.arange(self.pool_size - 1, device=self.lengths.device)
                self._open_windows.add(
                    self.open_index_keys.clone(), None if gate_logits is None else self.open_gate_logits.clone(),
                    self.open_window_position[:, None].expand(-1, self.pool_size - 1, -1).clone(),
                    self.num_pooled[:, None] * self.pool_size + slots, slots < self.num_open[:, None])
        positions = self.lengths[:, None] + token_is_real.long().cumsum(dim=1) - 1
        self._open_windows.add(
            raw_index_keys[:, start:], None if gate_logits is None else gate_logits[:, start:].float(),
            rope_positions[:, :, start:].permute(1, 2, 0), positions[:, start:], token_is_real[:, start:])

    def _reopened_window(self, tokens_to_remove: int):
        """Where the recording holds each row's open window after removing `tokens_to_remove` tokens: `(index
        [batch, r - 1] into the recorded entries, needed [batch, r - 1])`; raises if an entry was not recorded."""
        recording, r = self._open_windows, self.pool_size
        remaining = self.lengths - tokens_to_remove
        wanted = (remaining // r * r)[:, None] + torch.arange(r - 1, device=remaining.device)  # [batch, r - 1]
        needed = wanted < remaining[:, None]
        positions, valid = torch.cat(recording.positions, dim=1), torch.cat(recording.valid, dim=1)
        match = valid[:, None, :] & (positions[:, None, :] == wanted[..., None])  # [batch, r - 1, entries]
        if bool((needed & ~match.any(dim=-1)).any()):
            raise ValueError(
                f"Cannot crop {tokens_to_remove} tokens: the window this cut reopens starts before the tokens this "
                f"IndexPool layer recorded (a long forward records its last recurrent_states_to_keep + "
                f"index_pool_size tokens); activate past recording with a larger recurrent_states_to_keep."
            )
        return match.to(torch.uint8).argmax(dim=-1), needed

    def store_pooled_index_keys(self, windows: CompletedWindows, pooled: torch.Tensor) -> torch.Tensor:
        """Store the pooled keys `[batch, windows, width]` of `windows` (as `update` returned them) and return the
        pooled-key storage `[batch, capacity // r, width]`. With `fp8_index_keys` the keys come packed (uint8,
        `kernels.fp8_index_keys.quantize_pooled_keys`), otherwise in the storage's precision."""
        if self.fp8_index_keys and pooled.dtype != torch.uint8:
            raise ValueError(
                f"This cache stores packed fp8 pooled keys, but got {pooled.dtype} ones; quantise them first "
                "(HybridIndexPoolIndexer.pool_windows(..., quantize=True))."
            )
        pooled = pooled[:, 0] if windows.source is None else pooled[windows.source]
        pooled = pooled.to(self.pooled_storage.dtype)
        if windows.complete is not None:  # a masked write: fixed shapes, no host synchronisation
            pooled = torch.where(windows.complete[:, None], pooled, self.pooled_storage[windows.target])
        self.pooled_storage[windows.target] = pooled
        return self.pooled_storage

    def _write_one(self, key_states, value_states, raw_index_keys, gate_logits, token_is_real, rope_positions):
        """Decode: one token per row, fixed shapes, masked writes, no host synchronisation."""
        r = self.pool_size
        rows = torch.arange(key_states.shape[0], device=key_states.device)
        real = token_is_real[:, 0]
        target = self.lengths.clamp(max=self.capacity - 1)
        for storage, new in ((self.key_storage, key_states), (self.value_storage, value_states)):
            if storage is None:
                continue
            new = new[:, :, 0].to(storage.dtype)  # [batch, kv_heads, head_dim]
            storage[rows, target] = torch.where(real[:, None, None], new, storage[rows, target])
        if raw_index_keys is None:
            return None

        num_open, num_pooled = self.lengths % r, self.lengths // r
        # The open window with the new token at its place: [batch, r, d].
        slot = num_open[:, None, None].expand(-1, 1, raw_index_keys.shape[-1])

        def with_new(open_part, new_part):
            window = torch.cat([open_part, new_part.to(open_part.dtype)], dim=1)  # room for r tokens
            return window.scatter(1, slot[..., : open_part.shape[-1]], new_part.to(open_part.dtype))

        window_keys = with_new(self.open_index_keys, raw_index_keys)
        window_logits = None if gate_logits is None else with_new(self.open_gate_logits, gate_logits)
        # The window's first token is the new one when the window opens with it.
        opens = (num_open == 0)[:, None]
        first_position = torch.where(opens, rope_positions[:, :, 0].T, self.open_window_position)  # [batch, streams]
        completed = CompletedWindows(
            keys=window_keys[:, None], gate_logits=None if window_logits is None else window_logits[:, None],
            first_positions=first_position.T[:, :, None], source=None,
            target=(rows, num_pooled.clamp(max=self.pooled_storage.shape[1] - 1)),
            complete=real & (num_open == r - 1),
        )
        self.open_window_position.copy_(torch.where(opens & real[:, None], first_position,
                                                    self.open_window_position))
        # A completed window leaves stale entries behind, which its zero count makes invisible.
        if r > 1:
            self.open_index_keys.copy_(torch.where(real[:, None, None], window_keys[:, : r - 1], self.open_index_keys))
            if window_logits is not None:
                self.open_gate_logits.copy_(
                    torch.where(real[:, None, None], window_logits[:, : r - 1], self.open_gate_logits))
        return completed

    def _write_many(self, key_states, value_states, raw_index_keys, gate_logits, token_is_real, rope_positions):
        """Prefill: any number of tokens per row; may read the device for its shapes."""
        r = self.pool_size
        positions = self.lengths[:, None] + token_is_real.long().cumsum(dim=1) - 1  # of the real tokens
        rows, columns = token_is_real.nonzero(as_tuple=True)
        targets = positions[rows, columns]
        self.key_storage[rows, targets] = key_states.transpose(1, 2)[rows, columns].to(self.key_storage.dtype)
        if value_states is not None:
            self.value_storage[rows, targets] = value_states.transpose(1, 2)[rows, columns].to(
                self.value_storage.dtype)
        if raw_index_keys is None:
            return None

        batch_size, num_new, index_head_dim = raw_index_keys.shape
        device = raw_index_keys.device
        # Lay the open window and the new real tokens side by side by position, starting at the open window.
        num_pooled, num_open = self.lengths // r, self.lengths % r
        total_open = num_open + token_is_real.sum(dim=1)
        num_complete = total_open // r
        num_windows = max(1, -(-(r - 1 + num_new) // r))
        width = num_windows * r
        relative = targets - num_pooled[rows] * r  # of each real token, from its row's open window start
        key_buffer = self._scatter_rows(raw_index_keys, self.open_index_keys, rows, columns, relative, width)
        logit_buffer = None
        if gate_logits is not None:
            logit_buffer = self._scatter_rows(gate_logits, self.open_gate_logits, rows, columns, relative, width)
        # Rotary positions laid out the same way: the open window's first token's at 0, the new tokens' after.
        position_buffer = self._scatter_rows(rope_positions.permute(1, 2, 0), self.open_window_position[:, None],
                                             rows, columns, relative, width)  # [batch, width, streams]

        completed = None
        complete_rows, complete_windows = (
            torch.arange(num_windows, device=device) < num_complete[:, None]).nonzero(as_tuple=True)
        if complete_rows.numel():
            window_ids = num_pooled[:, None] + torch.arange(num_windows, device=device)
            completed = CompletedWindows(
                keys=key_buffer.view(batch_size, num_windows, r, index_head_dim),
                gate_logits=None if logit_buffer is None else logit_buffer.view(
                    batch_size, num_windows, r, logit_buffer.shape[-1]),
                first_positions=position_buffer[:, ::r].permute(2, 0, 1),  # [streams, batch, windows]
                source=(complete_rows, complete_windows),
                target=(complete_rows, window_ids[complete_rows, complete_windows]),
            )
        self.open_window_position.copy_(position_buffer[torch.arange(batch_size, device=device),
                                                        (num_complete * r).clamp(max=width - 1)])
        if r > 1:
            # The tokens after the last complete window form the new open window.
            open_index = (num_complete[:, None] * r + torch.arange(r - 1, device=device)).clamp(max=width - 1)
            open_index = open_index[..., None].expand(-1, -1, index_head_dim)
            self.open_index_keys.copy_(key_buffer.gather(1, open_index))
            if logit_buffer is not None:
                self.open_gate_logits.copy_(logit_buffer.gather(1, open_index[..., :logit_buffer.shape[-1]]))
        return completed

    @staticmethod
    def _scatter_rows(new, open_part, rows, columns, relative, width):
        """`[batch, width, d]`: each row's open window followed by its new real tokens, by position."""
        buffer = new.new_zeros(new.shape[0], width, new.shape[-1])
        buffer[:, : open_part.shape[1]] = open_part.to(buffer.dtype)
        buffer[rows, relative] = new[rows, columns].to(buffer.dtype)
        return buffer

    def extend_to(self, length: int) -> None:
        """Count every row as holding `length` tokens: whatever the storage holds up to there becomes its content
        (for benchmarks that write synthetic keys into `key_storage` / `value_storage` / `pooled_storage` to time a
        decode step at a long context without prefilling it). Reads nothing from the device."""
        if self.lengths is None or length > self.capacity:
            raise ValueError(f"extend_to({length}): the storage holds {self.capacity} positions per row; reserve "
                             "them first (HybridIndexPoolCache(config, max_cache_len=N) and one update).")
        self.lengths.fill_(length)
        self.length_bound = length

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
        recording a cut must fall inside each row's open window or on a window boundary; with one
        (`activate_past_recording`), a cut anywhere in the recorded tokens reopens its window from the recording.
        Entries beyond the new lengths stay in the storage and are overwritten by the next tokens.
        """
        self.check_crop(tokens_to_remove)
        if tokens_to_remove > 0 and self.lengths is not None:
            if self._open_windows is not None and self.pool_size > 1:
                self._reopen_window(tokens_to_remove)
            self.lengths.sub_(tokens_to_remove)
            self.length_bound = max(0, self.length_bound - tokens_to_remove)
        self._drop_recording()

    def _reopen_window(self, tokens_to_remove: int) -> None:
        """Put back, from the recording, the raw keys, gate logits and first rotary position of each row's open
        window after the cut (a window the removed tokens completed was pooled; its stale pooled key is beyond the
        new length, invisible, and overwritten when the window completes again)."""
        index, needed = self._reopened_window(tokens_to_remove)
        recording = self._open_windows

        def gathered(parts, current):
            entries = torch.cat(parts, dim=1)
            picked = entries.gather(1, index[..., None].expand(-1, -1, entries.shape[-1]))
            return torch.where(needed[..., None], picked.to(current.dtype), current)

        self.open_index_keys.copy_(gathered(recording.keys, self.open_index_keys))
        if self.open_gate_logits is not None:
            self.open_gate_logits.copy_(gathered(recording.gate_logits, self.open_gate_logits))
        rope_positions = torch.cat(recording.rope_positions, dim=1)  # [batch, entries, streams]
        first = rope_positions.gather(1, index[:, :1, None].expand(-1, 1, rope_positions.shape[-1]))[:, 0]
        self.open_window_position.copy_(torch.where(needed[:, :1], first, self.open_window_position))

    def memory_footprint(self) -> dict[str, tuple[int, int]]:
        """`{component: (bytes in use, bytes reserved)}`."""
        if self.lengths is None:
            return {"key_value": (0, 0), "pooled_index_keys": (0, 0), "open_window": (0, 0), "bookkeeping": (0, 0)}
        total_tokens = int(self.lengths.sum())
        total_windows = int((self.lengths // self.pool_size).sum())
        total_open = total_tokens - total_windows * self.pool_size
        key_value_per_token = sum(storage[0, 0].numel() * storage.element_size()
                                  for storage in (self.key_storage, self.value_storage) if storage is not None)
        pooled_bytes = open_per_token = 0
        if self.pooled_storage is not None:
            pooled_bytes = self.pooled_storage.shape[-1] * self.pooled_storage.element_size()  # per window
            open_per_token = self.open_index_keys.shape[-1] * (self.open_index_keys.element_size() + (
                0 if self.open_gate_logits is None else self.open_gate_logits.element_size()))
        bookkeeping = _bytes(self.lengths) + _bytes(self.open_window_position)
        return {
            "key_value": (total_tokens * key_value_per_token, _bytes(self.key_storage) + _bytes(self.value_storage)),
            "pooled_index_keys": (total_windows * pooled_bytes, _bytes(self.pooled_storage)),
            "open_window": (total_open * open_per_token, _bytes(self.open_index_keys) + _bytes(self.open_gate_logits)),
            "bookkeeping": (bookkeeping, bookkeeping),
        }

    def unpooled_index_bytes(self) -> int:
        """Bytes a per-token (r = 1) indexer key cache of the same storage would hold for the same tokens."""
        if self.lengths is None or self.pooled_storage is None:
            return 0
        return int(self.lengths.sum()) * self.pooled_storage.shape[-1] * self.pooled_storage.element_size()


def cache_layout(config) -> dict:
    """The settings that decide what a cache holds and how: two models with the same ones can share caches."""
    names = ("layer_types", "attention_type", "kv_lora_rank", "indexer_types", "index_pool_size",
             "num_key_value_heads", "head_dim", "index_head_dim", "index_pool_weighting", "index_key_cache_dtype",
             "linear_attention_type", "linear_num_key_heads", "linear_num_value_heads",
             "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", "ple_layers", "hc_count")
    return {name: (list(value) if isinstance(value := getattr(config, name), (list, tuple)) else value)
            for name in names}


class HybridIndexPoolCache(Cache):
    """Cache of a [`HybridIndexPoolModel`]: one `LinearAttentionLayerCache` or `IndexPoolLayerCache` per layer.

    Args:
        config: the model's config.
        max_cache_len: the most tokens (attention-mask columns, padding included) the cache will see. When given,
            the IndexPool storage is reserved once for that, never grows, and the cache is compileable; `generate()`
            passes prompt + new tokens. Without it the storage grows in bounded steps.

    Built by `generate()` and by `forward(use_cache=True)`; supports beam-search reordering,
    `batch_repeat_interleave`, `batch_select_indices`, `reset`, and `crop(-n)` where the layers allow it.
    `memory_footprint()` reports its size in bytes per component, in use and reserved.
    """

    def __init__(self, config, max_cache_len: int | None = None):
        if max_cache_len is not None and max_cache_len < 1:
            raise ValueError(f"max_cache_len is {max_cache_len}; give a positive number of tokens or None.")
        layers = [
            IndexPoolLayerCache(config.index_pool_size, max_cache_len,
                                fp8_index_keys=config.index_key_cache_dtype == "float8_e4m3fn")
            if layer_type == "indexpool_attention"
            else LinearAttentionLayerCache()
            for layer_type in config.layer_types
        ]
        super().__init__(layers=layers)
        self.max_cache_len = max_cache_len
        self.pool_size = config.index_pool_size
        self.layout = cache_layout(config)
        # Attention-mask columns seen (padding included): a device tensor advanced in place, so a compiled decode
        # step neither reads nor specialises on it.
        self.seen_tokens: torch.Tensor | None = None
        # [batch, 1] offset of each row's rotary positions from its token count after a multimodal prompt (image
        # tokens share positions), set by the multimodal model; None for text.
        self.rope_deltas: torch.Tensor | None = None

    def check_compatible(self, config, batch_size: int) -> None:
        """Raise a `ValueError` saying what differs when this cache was built for another model or batch."""
        theirs, ours = self.layout, cache_layout(config)
        differences = [f"{name}: cache {theirs[name]!r}, model {ours[name]!r}" for name in ours
                       if theirs.get(name) != ours[name]]
        if differences:
            raise ValueError("This cache was built for another model (" + "; ".join(differences) + "); build one "
                             "with HybridIndexPoolCache(model.config).")
        # Layers another pipeline stage runs stay empty here: only the filled ones say how many rows there are.
        rows = max([layer.batch_size for layer in self.layers])
        if rows not in (-1, batch_size):
            raise ValueError(
                f"The cache holds {rows} rows but the input has {batch_size}; use a new cache, or resize it with "
                "batch_repeat_interleave / batch_select_indices first."
            )

    @property
    def index_layers(self) -> list[IndexPoolLayerCache]:
        return [layer for layer in self.layers if isinstance(layer, IndexPoolLayerCache)]

    def begin_update(self, token_is_real: torch.Tensor) -> torch.Tensor:
        """Plan the storage for new tokens `token_is_real [batch, new]` and return their positions `[batch, new]`
        (each row counts its real tokens; padding gets the position of the token before it, or 0).

        Called once per forward, before the layers update; a decode step reads nothing from the device.
        """
        if self.seen_tokens is None:
            self.seen_tokens = torch.zeros((), dtype=torch.long, device=token_is_real.device)
            _mark_static(self.seen_tokens)
        past = self.num_positions()
        for layer in self.index_layers:
            layer.plan(token_is_real)
        self.seen_tokens.add_(token_is_real.shape[1])
        positions = token_is_real.long().cumsum(dim=1) - 1
        if past is not None:
            positions = positions + past.to(positions.device)[:, None]
        return positions.clamp(min=0)

    def reserve(self, max_cache_len: int) -> None:
        """Reserve storage, once, for the cache to reach `max_cache_len` attention-mask columns (what `generate()`
        calls when it continues from a cache it was given)."""
        to_come = max_cache_len - self.get_seq_length()
        self.max_cache_len = max(self.max_cache_len or 0, max_cache_len)
        for layer in self.index_layers:
            layer.max_cache_len = self.max_cache_len
            layer.reserve(max(to_come, 0))

    def extend_to(self, num_tokens: int) -> None:
        """Count every row of every IndexPool layer as holding `num_tokens` tokens, with no padding (see
        `IndexPoolLayerCache.extend_to`; the linear-attention states are whatever they hold)."""
        for layer in self.index_layers:
            layer.extend_to(num_tokens)
        self.seen_tokens.fill_(num_tokens)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Attention-mask columns seen so far (padding included), the same for every layer."""
        return 0 if self.seen_tokens is None else int(self.seen_tokens)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length(layer_idx) + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1 if self.max_cache_len is None else self.max_cache_len

    def num_positions(self) -> torch.Tensor | None:
        """`[batch]` real tokens seen by each row, from the first IndexPool layer (None without one, or empty)."""
        for layer in self.index_layers:
            return layer.lengths
        return None

    def reset(self) -> None:
        super().reset()
        self.seen_tokens = self.rope_deltas = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        if self.rope_deltas is not None:
            self.rope_deltas = self.rope_deltas.index_select(0, beam_idx.to(self.rope_deltas.device))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        if self.rope_deltas is not None:
            self.rope_deltas = self.rope_deltas.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        if self.rope_deltas is not None:
            self.rope_deltas = self.rope_deltas[indices.to(self.rope_deltas.device)]

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` tokens (transformers' convention: `crop(-n)` removes `n`).

        Every layer is checked before any changes. After `activate_past_recording(recurrent_states_to_keep=k)` every
        layer type rolls back the tokens recorded since the last crop (a long forward records its last `k + 1`), as
        if they had never been fed; a crop then forgets the recording. Without a recording a linear-attention layer
        cannot roll back, and an IndexPool layer can cut only inside its open window or on a window boundary.
        """
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop({tokens_to_remove}): pass a negative number, crop(-n), to remove the last n tokens (the "
                "transformers convention); cropping to an absolute length is not supported."
            )
        count = -tokens_to_remove
        if count == 0:  # keeps every token for good: forget what was recorded
            for layer in self.layers:
                layer._drop_recording()
            return
        if count > self.get_seq_length():
            raise ValueError(f"Cannot crop {count} tokens from a cache of {self.get_seq_length()}.")
        for layer in self.layers:
            layer.check_crop(count)
        for layer in self.layers:
            layer.crop(count)
        self.seen_tokens.sub_(count)

    def deactivate_past_recording(self) -> None:
        """Stop recording (what `activate_past_recording` started) and forget what was recorded."""
        for layer in self.layers:
            layer.record_past = False
            layer._drop_recording()

    def memory_footprint(self) -> dict[str, int]:
        """Bytes per component, summed over layers: in use under each component's name, reserved under
        `<name>_reserved`; `total` and `reserved` sum them; `unpooled_index_keys` is what an r = 1 indexer would
        hold for the same tokens. `reserved` counts every tensor the cache holds."""
        used: dict[str, int] = {}
        reserved: dict[str, int] = {}
        for layer in self.layers:
            for name, (in_use, held) in layer.memory_footprint().items():
                used[name] = used.get(name, 0) + in_use
                reserved[name] = reserved.get(name, 0) + held
        counters = _bytes(self.seen_tokens) + _bytes(self.rope_deltas)
        used["bookkeeping"] = used.get("bookkeeping", 0) + counters
        reserved["bookkeeping"] = reserved.get("bookkeeping", 0) + counters
        footprint = dict(used)
        footprint.update({f"{name}_reserved": size for name, size in reserved.items()})
        footprint["total"] = sum(used.values())
        footprint["reserved"] = sum(reserved.values())
        footprint["unpooled_index_keys"] = sum(layer.unpooled_index_bytes() for layer in self.index_layers)
        return footprint


class MultiTokenPredictionCache:
    """The cache of a model's multi-token-prediction (MTP) layers while they draft (`generate(use_mtp=True)`).

    One [`IndexPoolLayerCache`] per MTP layer in use, in `layers` under the layer's index (`num_hidden_layers + depth`,
    where the MTP decoder blocks look theirs up), each with its own length: entry `i` of a layer is its output at
    position `i` (stored by position, as the model's IndexPool layers store tokens). Every layer records from the start
    (`activate_past_recording`), so `crop(layer_idx, n)` removes its last `n` entries, the drafted ones, reopening a
    pooled window they completed. Reserved once for `max_cache_len` entries per layer.

    Args:
        config: the model's (text) config.
        num_layers: the MTP layers that draft (the first ones).
        max_cache_len: the most entries a layer will hold.
        max_crop: the most entries one crop removes.
    """

    def __init__(self, config, num_layers: int, max_cache_len: int, max_crop: int):
        self.layers = {
            config.num_hidden_layers + depth: IndexPoolLayerCache(
                config.index_pool_size, max_cache_len, fp8_index_keys=config.index_key_cache_dtype == "float8_e4m3fn")
            for depth in range(num_layers)
        }
        for layer in self.layers.values():
            layer.activate_past_recording(recurrent_states_to_keep=max_crop)

    def begin_update(self, layer_idx: int, token_is_real: torch.Tensor) -> torch.Tensor:
        """Plan layer `layer_idx`'s storage for new entries `token_is_real [batch, new]` and return their storage
        positions `[batch, new]` (each row counts its real entries)."""
        layer = self.layers[layer_idx]
        layer.plan(token_is_real)
        positions = token_is_real.long().cumsum(dim=1) - 1
        if layer.lengths is not None:
            positions = positions + layer.lengths[:, None]
        return positions.clamp(min=0)

    def crop(self, layer_idx: int, entries_to_remove: int) -> None:
        """Remove the last `entries_to_remove` entries of every row of layer `layer_idx` (0 removes nothing) and keep
        the rest for good (the recording restarts from there)."""
        self.layers[layer_idx].crop(entries_to_remove)

    def memory_footprint(self) -> dict[str, int]:
        """Bytes summed over the layers: in use under each component's name, reserved under `<name>_reserved`;
        `total` and `reserved` sum them (a recording's raw keys are not counted: they last one draft round)."""
        used: dict[str, int] = {}
        reserved: dict[str, int] = {}
        for layer in self.layers.values():
            for name, (in_use, held) in layer.memory_footprint().items():
                used[name] = used.get(name, 0) + in_use
                reserved[name] = reserved.get(name, 0) + held
        footprint = dict(used)
        footprint.update({f"{name}_reserved": size for name, size in reserved.items()})
        footprint["total"] = sum(used.values())
        footprint["reserved"] = sum(reserved.values())
        return footprint


__all__ = ["CompletedWindows", "HybridIndexPoolCache", "IndexPoolLayerCache", "LinearAttentionLayerCache",
           "MultiTokenPredictionCache"]
