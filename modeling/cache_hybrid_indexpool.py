"""`HybridIndexPoolCache`: the generation cache of the hybrid model, in transformers' cache protocol. Its layers
(`cache_layers`) only store; the model's layers compute. Every public method of transformers' `Cache` works here, or
raises an error that names what to use instead."""

import torch
from transformers.cache_utils import Cache

from .cache_layers import IndexPoolLayerCache, LinearAttentionLayerCache, _bytes, _mark_static


def cache_layout(config) -> dict:
    """The settings that decide what a cache holds and how: two models with the same ones can share caches."""
    names = ("layer_types", "attention_type", "kv_lora_rank", "indexer_types", "index_pool_size",
             "num_key_value_heads", "head_dim", "index_head_dim", "index_pool_weighting", "index_key_cache_dtype",
             "linear_attention_type", "linear_num_key_heads", "linear_num_value_heads",
             "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", "ple_layers", "hc_count",
             "num_mtp_layers")
    return {name: (list(value) if isinstance(value := getattr(config, name), (list, tuple)) else value)
            for name in names}


class HybridIndexPoolCache(Cache):
    """Cache of a [`HybridIndexPoolModel`]: one `LinearAttentionLayerCache` or `IndexPoolLayerCache` per decoder layer,
    then one `IndexPoolLayerCache` per MTP layer (`mtp_layers`, filled when a prompt's forward runs the MTP layers and
    by MTP drafting, which crops them itself: the cache's own `crop` and past recording concern the decoder layers).
    An IndexPool layer stores each row **by position**: its real tokens (attention mask 1) in order, so padding costs
    nothing. A decode step uses fixed shapes and no host synchronisation, so with `max_cache_len` a compiled step is
    reused at every length (`is_compileable`).

    Args:
        config: the model's (text) config.
        max_cache_len: the most tokens (attention-mask columns, padding included) the cache will see. When given,
            the IndexPool storage is reserved once for that (when first written), never grows, and the cache is
            compileable; `generate()` passes prompt + new tokens. Without it the storage grows in bounded steps.
    """

    def __init__(self, config, max_cache_len: int | None = None):
        if max_cache_len is not None and max_cache_len < 1:
            raise ValueError(f"max_cache_len is {max_cache_len}; give a positive number of tokens or None.")
        fp8 = config.index_key_cache_dtype == "float8_e4m3fn"
        layer_types = list(config.layer_types) + ["indexpool_attention"] * config.num_mtp_layers
        super().__init__(layers=[
            IndexPoolLayerCache(config.index_pool_size, max_cache_len, fp8_index_keys=fp8)
            if layer_type == "indexpool_attention" else LinearAttentionLayerCache()
            for layer_type in layer_types
        ])
        self.num_decoder_layers = len(config.layer_types)
        # Views of `layers` (which never changes after this): the decoder's, its IndexPool ones, and the MTP layers'.
        self.decoder_layers = self.layers[: self.num_decoder_layers]
        self.index_layers = [layer for layer in self.decoder_layers if isinstance(layer, IndexPoolLayerCache)]
        self.mtp_layers = self.layers[self.num_decoder_layers:]
        self.max_cache_len, self.layout = max_cache_len, cache_layout(config)
        # Attention-mask columns seen (padding included): a device tensor advanced in place (so a compiled decode step
        # neither reads nor specialises on it), shared with the decoder layers.
        self.seen_tokens: torch.Tensor | None = None
        # [batch, 1] offset of each row's rotary positions from its token count after a multimodal prompt (image
        # tokens share positions), set by the multimodal model; None for text.
        self.rope_deltas: torch.Tensor | None = None

    def positions(self, token_is_real: torch.Tensor) -> torch.Tensor:
        """Where new tokens `token_is_real [batch, new]` go: their positions `[batch, new]`, each row counting its
        real tokens after those it holds (padding gets the position of the token before it, or 0). Counts the new
        attention-mask columns; called once per forward (or prefill chunk), before the layers write. A decode step
        reads nothing from the device."""
        if self.seen_tokens is None:
            self.seen_tokens = torch.zeros((), dtype=torch.long, device=token_is_real.device)
            _mark_static(self.seen_tokens)
            for layer in self.decoder_layers:
                layer.seen_tokens = self.seen_tokens
        past = next((layer.lengths for layer in self.index_layers), None)
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
            layer._reserve(max(to_come, 0))

    @property
    def batch_size(self) -> int:
        """Rows held, or -1 before the first forward (layers another pipeline stage runs stay empty)."""
        return max(layer.batch_size for layer in self.layers)

    @property
    def is_initialized(self) -> bool:
        return self.seen_tokens is not None

    def reset(self) -> None:
        super().reset()  # each layer forgets the shared count too
        self.seen_tokens = self.rope_deltas = None

    def _map_batch(self, fn) -> None:
        """Apply `fn` to every batch-first tensor the cache holds (each layer's and the rotary offsets)."""
        for layer in self.layers:
            layer._map_batch(fn)
        if self.rope_deltas is not None:
            self.rope_deltas = fn(self.rope_deltas)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder the batch for beam search, in place (the storage keeps its address)."""
        self._map_batch(lambda t: t.copy_(t.index_select(0, beam_idx.to(t.device))))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices.to(t.device)])

    def activate_past_recording(self, recurrent_states_to_keep: int | None = None) -> None:
        """Record, from the next forward on, what `crop(-n)` needs to remove the last `n` tokens, in every decoder
        layer, for `n` up to `recurrent_states_to_keep + 1` (any `n` when None) or the tokens fed since the last crop,
        if more (a long forward records only its last `recurrent_states_to_keep + 1` tokens)."""
        for layer in self.decoder_layers:
            layer.activate_past_recording(recurrent_states_to_keep)

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` tokens (transformers' convention: `crop(-n)` removes `n`), after checking
        every decoder layer: what they recorded since `activate_past_recording` or the last crop is rolled back, as if
        never fed (without a recording an IndexPool layer cuts only within its open window or on a window boundary)."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop({tokens_to_remove}): pass a negative number, crop(-n), to remove the last n tokens (the "
                "transformers convention); cropping to an absolute length is not supported."
            )
        count = -tokens_to_remove
        if count > self.get_seq_length():
            raise ValueError(f"Cannot crop {count} tokens from a cache of {self.get_seq_length()}.")
        for layer in self.decoder_layers:
            layer._check_crop(count)
        for layer in self.decoder_layers:
            layer.crop(count)
        if count:
            self.seen_tokens.sub_(count)

    def memory_footprint(self, layer_idx: int | None = None) -> dict[str, int]:
        """Bytes per component, of the layer `layer_idx` or summed over all (the MTP layers' under `mtp_*` names, and
        the cache's own counters under `bookkeeping`): in use under each component's name, reserved under
        `<name>_reserved`; `total` and `reserved` sum them; `unpooled_index_keys` is what an r = 1 indexer would hold
        for the decoder's tokens. `reserved` counts every tensor held."""
        used, reserved = {}, {}
        selected = range(len(self.layers)) if layer_idx is None else [layer_idx]
        for index in selected:
            for name, (in_use, held) in self.layers[index]._memory_footprint().items():
                name = f"mtp_{name}" if layer_idx is None and index >= self.num_decoder_layers else name
                used[name] = used.get(name, 0) + in_use
                reserved[name] = reserved.get(name, 0) + held
        if layer_idx is None:
            for sizes in (used, reserved):
                sizes["bookkeeping"] = sizes.get("bookkeeping", 0) + _bytes(self.seen_tokens, self.rope_deltas)
        footprint = {**used, **{f"{name}_reserved": size for name, size in reserved.items()}}
        footprint["total"], footprint["reserved"] = sum(used.values()), sum(reserved.values())
        footprint["unpooled_index_keys"] = sum(  # a pooled key's bytes for every token
            int(layer.lengths.sum()) * layer.pooled_storage.shape[-1] * layer.pooled_storage.element_size()
            for index in selected if (layer := self.layers[index]) in self.index_layers
            and layer.pooled_storage is not None)
        return footprint


def _refusal(name: str, error: type[Exception], advice: str):
    def refuse(self, *args, **kwargs):
        raise error(f"HybridIndexPoolCache.{name}: {advice}")

    refuse.__name__ = refuse.__qualname__ = name
    refuse.__doc__ = f"Not supported by this cache: raises {error.__name__} saying what to use instead."
    return refuse


# transformers' `Cache` methods this cache refuses, and what to use instead. Each becomes a method that raises.
_REFUSED = {
    "update": (ValueError, "an IndexPool layer stores its keys and values together with its pooled indexer keys, by "
               "position: use cache.layers[layer_idx].place_windows(...) then .update(...) (the model's IndexPool "
               "attention does), or run the model's forward with this cache."),
    "update_indexer": (ValueError, "this cache keeps pooled indexer keys (one per window of index_pool_size tokens), "
                       "written with the layer's keys by cache.layers[layer_idx].update(..., windows, pooled_keys); "
                       "read them from cache.layers[layer_idx].pooled_storage."),
    "increase_count": (ValueError, "this cache counts its tokens itself (cache.positions(token_is_real), called by "
                       "the model once per forward)."),
    "early_initialization": (ValueError, "this cache allocates each layer when it is first written, for "
                             "max_cache_len tokens: build it with HybridIndexPoolCache(config, max_cache_len=N) and "
                             "run the prompt's forward (for torch.export, export the decode step after that forward, "
                             "see docs/model.md)."),
    **dict.fromkeys(("offload", "prefetch"), (
        NotImplementedError, "this cache keeps its layers on their device (its storage is reserved once, by "
        "position); to hold less, use index_key_cache_dtype='float8_e4m3fn' or a smaller max_cache_len.")),
}
for _name, (_error, _advice) in _REFUSED.items():
    setattr(HybridIndexPoolCache, _name, _refusal(_name, _error, _advice))


__all__ = ["HybridIndexPoolCache", "IndexPoolLayerCache", "LinearAttentionLayerCache", "cache_layout"]
