"""`HybridIndexPoolCache`: the generation cache of the hybrid model.

Per Gated DeltaNet layer: the convolution state and the float32 recurrent state. Per IndexPool layer: the raw
keys/values of every cache slot; the *pooled* indexer keys of complete windows only (window `c` of a row at index
`c`, with a per-row count); and the raw indexer keys (and pooling-gate logits) of each row's open window, at most
`r - 1` tokens. A window is pooled and moved to the pooled store in the step that completes it.

Slots are physical (left padding occupies slots); windows follow each row's positions, which start at 0 on its
first real token.
"""

from collections.abc import Callable

import torch
from transformers.cache_utils import Cache


def _bytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


def _reserve(storage: torch.Tensor | None, like: torch.Tensor, used: int, needed: int, dim: int) -> torch.Tensor:
    """`storage` with room for `needed` entries along `dim`, keeping its first `used` ones.

    Capacity grows to the next power of two, so appending one token at a time copies the cache only
    logarithmically often and a decode step allocates nothing proportional to the context.
    """
    if storage is not None and storage.shape[dim] >= needed:
        return storage
    shape = list(like.shape)
    shape[dim] = max(256, 1 << (needed - 1).bit_length())
    grown = like.new_empty(shape)
    if storage is not None and used:
        grown.narrow(dim, 0, used).copy_(storage.narrow(dim, 0, used))
    return grown


class _LayerCache:
    """Shared batch bookkeeping: every tensor attribute named in `_batch_tensors` has the batch first."""

    _batch_tensors: tuple[str, ...] = ()
    is_compileable = False
    is_croppable = False
    supports_early_init = False
    is_initialized = False

    def __init__(self):
        self.num_slots = 0  # physical positions seen (left padding included)

    def _map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for name in self._batch_tensors:
            tensor = getattr(self, name)
            if tensor is not None:
                setattr(self, name, fn(tensor))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder the batch for beam search."""
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every row `repeats` times in place (expanding a prompt to beams or samples)."""
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the rows `indices`."""
        self._map_batch(lambda t: t[indices.to(t.device)])

    def reset(self) -> None:
        """Forget everything (the next forward starts a new sequence)."""
        for name in self._batch_tensors:
            setattr(self, name, None)
        self.num_slots = 0

    def offload(self) -> None:  # called by `Cache` only when offloading, which this cache does not do
        raise NotImplementedError("HybridIndexPoolCache does not support offloading.")

    prefetch = offload

    @property
    def batch_size(self) -> int:
        tensors = [getattr(self, name) for name in self._batch_tensors if getattr(self, name) is not None]
        return tensors[0].shape[0] if tensors else -1

    def get_seq_length(self) -> int:
        return self.num_slots

    def get_max_length(self) -> int:
        return -1


class LinearAttentionLayerCache(_LayerCache):
    """Convolution state `[batch, conv_dim, kernel - 1]` and recurrent state `[batch, heads, key_dim, value_dim]`;
    on a PLE layer also the last `ple_ngram_size - 1` token ids and the PLE convolution's input history."""

    _batch_tensors = ("conv_state", "recurrent_state", "ple_token_context", "ple_conv_state")

    def __init__(self):
        super().__init__()
        self.conv_state: torch.Tensor | None = None
        self.recurrent_state: torch.Tensor | None = None
        self.ple_token_context: torch.Tensor | None = None
        self.ple_conv_state: torch.Tensor | None = None

    def update(self, conv_state: torch.Tensor, recurrent_state: torch.Tensor, num_new_slots: int) -> None:
        """Store the states after `num_new_slots` more tokens."""
        self.conv_state, self.recurrent_state = conv_state, recurrent_state
        self.num_slots += num_new_slots

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(
                "HybridIndexPoolCache cannot crop a Gated DeltaNet layer: its recurrent state cannot be rolled back. "
                "Cropping works only for models whose layers are all IndexPool attention."
            )

    def memory_footprint(self) -> dict[str, int]:
        return {
            "conv_state": _bytes(self.conv_state), "recurrent_state": _bytes(self.recurrent_state),
            "ple_state": _bytes(self.ple_token_context) + _bytes(self.ple_conv_state),
        }


class IndexPoolLayerCache(_LayerCache):
    """Raw keys/values of every slot, pooled indexer keys of complete windows, the raw open window of each row.

    The keys, values and pooled keys live in storage that grows by doubling and is written in place; the attributes
    below are views of the part in use.

    Attributes:
        keys, values: `[batch, kv_heads, slots, head_dim]`.
        pooled_index_keys: `[batch, max windows, index_head_dim]`, after norm and RoPE; row `b` holds
            `num_pooled[b]` valid windows.
        open_index_keys: `[batch, pool_size - 1, index_head_dim]` raw indexer keys of the row's open window, the
            first `num_open[b]` valid.
        open_gate_logits: the same for the pooling-gate logits (float32), or None with mean pooling.
    """

    _batch_tensors = (
        "key_storage", "value_storage", "pooled_storage", "num_pooled", "open_index_keys", "open_gate_logits",
        "num_open",
    )

    def __init__(self, pool_size: int):
        super().__init__()
        self.pool_size = pool_size
        # Slot-major [batch, capacity, kv_heads, head_dim]: the sparse attention gathers whole slots (all heads) as
        # contiguous rows. `keys` / `values` present them as [batch, kv_heads, slots, head_dim] views.
        self.key_storage: torch.Tensor | None = None
        self.value_storage: torch.Tensor | None = None
        self.pooled_storage: torch.Tensor | None = None  # [batch, capacity, index_head_dim]
        self.num_pooled: torch.Tensor | None = None
        self.open_index_keys: torch.Tensor | None = None
        self.open_gate_logits: torch.Tensor | None = None
        self.num_open: torch.Tensor | None = None

    @property
    def keys(self) -> torch.Tensor | None:
        return None if self.key_storage is None else self.key_storage[:, : self.num_slots].transpose(1, 2)

    @property
    def values(self) -> torch.Tensor | None:
        return None if self.value_storage is None else self.value_storage[:, : self.num_slots].transpose(1, 2)

    @property
    def pooled_index_keys(self) -> torch.Tensor | None:
        if self.pooled_storage is None:
            return None
        return self.pooled_storage[:, : int(self.num_pooled.max()) if self.num_pooled.numel() else 0]

    @property
    def num_positions(self) -> torch.Tensor | None:
        """`[batch]` real tokens seen by each row (the next position), or None before the first update."""
        return None if self.num_pooled is None else self.num_pooled * self.pool_size + self.num_open

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append `[batch, kv_heads, new, head_dim]` keys/values in place and return views of all of them."""
        end = self.num_slots + key_states.shape[-2]
        key_states, value_states = key_states.transpose(1, 2), value_states.transpose(1, 2)
        self.key_storage = _reserve(self.key_storage, key_states, self.num_slots, end, dim=1)
        self.value_storage = _reserve(self.value_storage, value_states, self.num_slots, end, dim=1)
        self.key_storage[:, self.num_slots:end] = key_states
        self.value_storage[:, self.num_slots:end] = value_states
        self.num_slots = end
        return self.keys, self.values

    def update_index(
        self,
        raw_index_keys: torch.Tensor,
        gate_logits: torch.Tensor | None,
        positions: torch.Tensor,
        is_real: torch.Tensor,
        pool_windows: Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor], torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Add new tokens to the open windows, pool every window they complete, and return the pooled store.

        Args:
            raw_index_keys: `[batch, new, index_head_dim]` indexer keys before norm and RoPE.
            gate_logits: `[batch, new, index_head_dim]` float32 pooling-gate logits (without the slot bias) or None.
            positions: `[batch, new]` position of each token.
            is_real: `[batch, new]` False for padding, which never enters a window.
            pool_windows: `(window_keys [b, w, r, d], window_gate_logits or None, window_ids [b, w]) -> [b, w, d]`,
                the indexer's pooling with norm and RoPE.

        Returns:
            The pooled store `[batch, windows, index_head_dim]` and `num_pooled` `[batch]` after the update.
        """
        batch_size, _, index_head_dim = raw_index_keys.shape
        r = self.pool_size
        device = raw_index_keys.device
        if self.num_pooled is None:
            self.num_pooled = torch.zeros(batch_size, dtype=torch.long, device=device)
            self.num_open = torch.zeros(batch_size, dtype=torch.long, device=device)
            self.open_index_keys = raw_index_keys.new_zeros(batch_size, r - 1, index_head_dim)
            if gate_logits is not None:
                self.open_gate_logits = gate_logits.new_zeros(batch_size, r - 1, index_head_dim)

        # Lay the open window and the new real tokens side by side by position, starting at the open window.
        relative = positions - self.num_pooled[:, None] * r
        total_open = self.num_open + is_real.sum(dim=1)
        num_complete = total_open // r
        num_windows = max(1, -(-int(total_open.max()) // r))
        width = num_windows * r
        scatter_index = torch.where(is_real, relative, width)[..., None].expand(-1, -1, index_head_dim)

        def lay_out(open_part: torch.Tensor, new_part: torch.Tensor) -> torch.Tensor:
            buffer = new_part.new_zeros(batch_size, width + 1, index_head_dim)  # last column absorbs padding
            buffer[:, : r - 1] = open_part
            return buffer.scatter(1, scatter_index, new_part)

        key_buffer = lay_out(self.open_index_keys, raw_index_keys)
        logit_buffer = None if gate_logits is None else lay_out(self.open_gate_logits, gate_logits)

        if int(num_complete.max()) > 0:
            window_ids = self.num_pooled[:, None] + torch.arange(num_windows, device=device)
            window_keys = key_buffer[:, :width].view(batch_size, num_windows, r, index_head_dim)
            window_logits = None
            if logit_buffer is not None:
                window_logits = logit_buffer[:, :width].view(batch_size, num_windows, r, index_head_dim)
            pooled = pool_windows(window_keys, window_logits, window_ids)
            # Write each row's new windows after its own; the last storage column absorbs the rows' extras.
            new_width = int((self.num_pooled + num_complete).max())
            used = int(self.num_pooled.max())
            self.pooled_storage = _reserve(self.pooled_storage, pooled, used, new_width + 1, dim=1)
            dump = self.pooled_storage.shape[1] - 1
            target = torch.where(torch.arange(num_windows, device=device) < num_complete[:, None], window_ids, dump)
            self.pooled_storage.scatter_(1, target[..., None].expand(-1, -1, index_head_dim),
                                         pooled.to(self.pooled_storage.dtype))
        elif self.pooled_storage is None:
            self.pooled_storage = raw_index_keys.new_zeros(batch_size, 1, index_head_dim)

        # The tokens after the last complete window form the new open window.
        open_index = (num_complete[:, None] * r + torch.arange(r - 1, device=device)).clamp(max=width)
        open_index = open_index[..., None].expand(-1, -1, index_head_dim)
        self.open_index_keys = key_buffer.gather(1, open_index)
        if logit_buffer is not None:
            self.open_gate_logits = logit_buffer.gather(1, open_index)
        self.num_pooled = self.num_pooled + num_complete
        self.num_open = total_open - num_complete * r
        return self.pooled_index_keys, self.num_pooled

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last `tokens_to_remove` slots (real tokens, as generated ones are).

        Pooled windows keep no raw keys, so a cut must fall inside each row's open window or on a window boundary.
        """
        if tokens_to_remove <= 0 or self.key_storage is None:
            return
        if tokens_to_remove > self.num_slots:
            raise ValueError(f"Cannot crop {tokens_to_remove} tokens from a cache of {self.num_slots}.")
        remaining = self.num_positions - tokens_to_remove
        inside_open = remaining >= self.num_pooled * self.pool_size
        on_boundary = remaining % self.pool_size == 0
        if not bool((inside_open | on_boundary).all()):
            raise ValueError(
                f"Cannot crop {tokens_to_remove} tokens: the cut falls inside a window that is already pooled, whose "
                f"raw indexer keys are gone. Crop to a multiple of index_pool_size ({self.pool_size}) or within the "
                "open window."
            )
        self.num_slots -= tokens_to_remove
        self.num_open = torch.where(inside_open, self.num_open - tokens_to_remove, torch.zeros_like(self.num_open))
        self.num_pooled = torch.where(inside_open, self.num_pooled, remaining // self.pool_size)

    def memory_footprint(self) -> dict[str, int]:
        return {
            "key_value": _bytes(self.keys) + _bytes(self.values),
            "pooled_index_keys": _bytes(self.pooled_index_keys),
            "open_window": _bytes(self.open_index_keys) + _bytes(self.open_gate_logits),
        }

    def unpooled_index_bytes(self) -> int:
        """Bytes a per-token (r = 1) indexer key cache would hold for the same rows and positions."""
        if self.num_pooled is None:
            return 0
        batch_size, _, index_head_dim = self.pooled_index_keys.shape
        return batch_size * int(self.num_positions.max()) * index_head_dim * self.pooled_index_keys.element_size()


class HybridIndexPoolCache(Cache):
    """Cache of a [`HybridIndexPoolModel`]: one `LinearAttentionLayerCache` or `IndexPoolLayerCache` per layer.

    Built by `generate()` and by `forward(use_cache=True)`; supports beam-search reordering,
    `batch_repeat_interleave`, `batch_select_indices`, `reset`, and `crop` where the layers allow it.
    `memory_footprint()` reports its size in bytes per component.
    """

    def __init__(self, config):
        layers = [
            IndexPoolLayerCache(config.index_pool_size) if layer_type == "indexpool_attention"
            else LinearAttentionLayerCache()
            for layer_type in config.layer_types
        ]
        super().__init__(layers=layers)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Slots seen so far (padding included), the same for every layer."""
        return self.layers[layer_idx].get_seq_length() if layer_idx < len(self.layers) else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length(layer_idx) + query_length, 0

    def num_positions(self) -> torch.Tensor | None:
        """`[batch]` real tokens seen by each row, from the first IndexPool layer (None without one, or empty)."""
        for layer in self.layers:
            if isinstance(layer, IndexPoolLayerCache):
                return layer.num_positions
        return None

    def memory_footprint(self) -> dict[str, int]:
        """Bytes held per component, summed over layers; `unpooled_index_keys` is what an r = 1 indexer would hold."""
        totals = {
            "key_value": 0, "pooled_index_keys": 0, "open_window": 0, "conv_state": 0, "recurrent_state": 0,
            "ple_state": 0,
        }
        unpooled = 0
        for layer in self.layers:
            for name, size in layer.memory_footprint().items():
                totals[name] += size
            if isinstance(layer, IndexPoolLayerCache):
                unpooled += layer.unpooled_index_bytes()
        totals["total"] = sum(totals.values())
        totals["unpooled_index_keys"] = unpooled
        return totals


__all__ = ["HybridIndexPoolCache", "IndexPoolLayerCache", "LinearAttentionLayerCache"]
