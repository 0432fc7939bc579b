"""What the model does with its inputs before the layers run: validation with messages that name the argument and
the fix, and the [`TokenLayout`] of a pass (which tokens exist, their storage and rotary positions, the grid the token
mixers run on, the mask columns attention weights are laid over)."""

from typing import Literal

import torch
from transformers.utils.generic import TransformersKwargs

from .cache_hybrid_indexpool import HybridIndexPoolCache, cache_layout
from .token_layout import TokenGrid, TokenLayout


class HybridIndexPoolKwargs(TransformersKwargs, total=False):
    """The keyword arguments of the HybridIndexPool models' forwards beyond transformers' own (`output_attentions`,
    `output_hidden_states`, `output_router_logits`, `num_items_in_batch`, ...).

    Attributes:
        indexer_loss: `"dense"` or `"sparse"` to also compute the indexer's KL loss (DeepSeek-V3.2 style, per IndexPool
            layer) against the attention mass of every complete visible window, or of the selected ones; it trains
            only the indexer and pooling. `"dense"` also makes the attention dense (the warm-up).
        ple_input_ids: `[batch, seq]` token ids for the per-layer n-gram embeddings when `inputs_embeds` replace
            `input_ids` (models with `ple_layers` only).
        output_indexer_selections: also return the windows each full-indexer IndexPool layer selected.
        output_mtp_hidden_states: also return the multi-token-prediction layers' outputs, one `[batch, seq, hidden]`
            per depth (models with `num_mtp_layers` only; the whole sequence in one forward, from an empty cache or
            none; with a cache, the MTP layers' entries go to its MTP layers, for drafting).
        output_mtp_logits: the head's MTP logits (default: with labels, when `config.mtp_loss_weight > 0`).
        output_mtp_inputs: also return what the MTP layers read at each new token, `mtp_inputs`: the final normed
            hidden states `[batch, seq, hidden]`, or for Qwen4-Exp's MTP the residual streams before the final mix
            `[batch, seq, hc_count * hidden]` (any forward, with or without a cache).
    """

    indexer_loss: Literal["dense", "sparse"] | None
    ple_input_ids: torch.LongTensor | None
    output_indexer_selections: bool
    output_indexer_losses: bool
    output_mtp_hidden_states: bool
    output_mtp_logits: bool | None
    output_mtp_inputs: bool


def tracing() -> bool:
    """Whether torch.compile or torch.export is tracing: checks that read tensor values are skipped then (a graph
    cannot branch on them), and the eager call keeps its clear error."""
    return torch.compiler.is_compiling() or torch.compiler.is_exporting()


def token_layout(config, streams: int, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor | None,
                 position_ids: torch.Tensor | None, ple_input_ids: torch.Tensor | None,
                 cache: HybridIndexPoolCache | None, output_attentions: bool = False) -> TokenLayout:
    """The layout of one pass over `inputs_embeds [batch, seq, hidden]` (a whole forward or one prefill chunk): which
    tokens exist, the grid (each sequence's real tokens first, packed sequences apart), the storage positions (counted
    by `cache`, which this pass then continues), the rotary positions of a RoPE of `streams` position streams and the
    PLE token ids; with `output_attentions`, the mask columns attention weights are laid over."""
    batch_size, seq_len = inputs_embeds.shape[:2]
    device = inputs_embeds.device
    token_is_real = token_is_real_mask(attention_mask, cache, batch_size, seq_len, device)
    rope_positions, text_positions = rope_positions_of(position_ids, streams, batch_size, seq_len, device)
    grid = None
    if seq_len > 1 and text_positions is not None and not tracing() and is_packed(text_positions, token_is_real):
        grid = TokenGrid.unpack(text_positions, token_is_real)
    elif seq_len > 1 and attention_mask is not None:
        grid = TokenGrid.compact(token_is_real)
    # Attention weights are returned over every mask column, past and new (transformers' convention). Only read
    # when asked: the cache's count lives on the device, and a decode step must not wait for it.
    attention_columns = kv_length = None
    if output_attentions:
        kv_length = seq_len + (0 if cache is None else cache.get_seq_length())
        attention_columns = columns_of_positions(attention_mask, grid, batch_size, device)
    ple_token_ids = None
    if config.ple_layers:
        # Padding never enters an n-gram: it reads as end-of-sequence, after which the n-gram context restarts.
        ple_token_ids = ple_input_ids.to(device).masked_fill(~token_is_real, config.ple_eos_token_id)
    if grid is not None:
        token_is_real = grid.token_is_real
        if rope_positions is not None:  # [streams, batch, seq]: the streams ride along
            rope_positions = grid.to_grid(rope_positions.permute(1, 2, 0)).permute(2, 0, 1)
        text_positions = None if text_positions is None else grid.to_grid(text_positions)
        ple_token_ids = None if ple_token_ids is None else grid.to_grid(ple_token_ids)
    # Storage positions: each row counts its real tokens (after those the cache holds).
    if cache is not None:
        positions = cache.positions(token_is_real)
    else:
        positions = (token_is_real.long().cumsum(dim=1) - 1).clamp(min=0)
    if text_positions is not None and seq_len > 1 and not tracing():
        check_positions(text_positions, positions, token_is_real)
    if rope_positions is None:
        # The rotary positions count the tokens too, shifted per row after a multimodal prompt.
        rope_positions = positions
        if cache is not None and cache.rope_deltas is not None:
            rope_positions = positions + cache.rope_deltas.to(positions.device)
        rope_positions = rope_positions[None].expand(streams, -1, -1)
    return TokenLayout(token_is_real, positions, rope_positions, grid, ple_token_ids, attention_columns, kv_length)


def packed_sequences(position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None, seq_len: int) -> bool:
    """Whether `position_ids` restart at 0 inside a row: packed sequences, as `DataCollatorWithFlattening` makes
    (reads the device; only with `position_ids` of more than one token)."""
    if position_ids is None or seq_len <= 1 or tracing():
        return False
    text_positions = position_ids if position_ids.dim() == 2 else position_ids[0]
    if text_positions.shape[-1] != seq_len:
        return False  # refused with its shape when the layout is built
    token_is_real = torch.ones_like(text_positions, dtype=torch.bool)
    if attention_mask is not None and attention_mask.dim() == 2:
        token_is_real = attention_mask[:, -seq_len:].to(device=text_positions.device, dtype=torch.bool)
    return is_packed(text_positions, token_is_real.expand_as(text_positions))


def columns_of_positions(attention_mask, grid, batch_size, device) -> torch.Tensor | None:
    """`[batch, queries or 1, positions]`: the mask column (past and new) of each stored position a query can
    attend to, or None when position `p` is column `p` (no padding anywhere). Positions count a row's real
    tokens, so position `p` is its `p`-th real column; in a row of packed sequences, the `p`-th column of the
    query's own sequence."""
    if grid is not None and grid.rows.shape[0] != batch_size:  # packed: one grid row per sequence
        return grid.columns[grid.source_rows]
    if grid is None and (attention_mask is None or bool(attention_mask.all())):
        return None
    # A stable sort puts each row's real columns first, in order; its padding columns follow.
    padding = attention_mask.to(device=device) == 0
    return torch.sort(padding.to(torch.uint8), dim=1, stable=True).indices[:, None]


def check_inputs(config, input_ids, inputs_embeds, indexer_loss: str | None = None,
                 ple_input_ids: torch.Tensor | None = None) -> None:
    """Refuse malformed inputs with a message that names the argument and the fix."""
    if indexer_loss not in (None, "dense", "sparse"):
        raise ValueError(f"indexer_loss is {indexer_loss!r}; use None, 'dense' or 'sparse'.")
    if config.ple_layers and ple_input_ids is None and input_ids is None:
        raise ValueError(
            "This model has per-layer n-gram embeddings (`ple_layers`), which need the token ids: with "
            "`inputs_embeds`, also pass `ple_input_ids` [batch, seq]."
        )
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("Give exactly one of `input_ids` or `inputs_embeds`.")
    given = input_ids if input_ids is not None else inputs_embeds
    name = "input_ids" if input_ids is not None else "inputs_embeds"
    if given.dim() != (2 if input_ids is not None else 3):
        shape = "[batch, seq]" if input_ids is not None else "[batch, seq, hidden_size]"
        raise ValueError(f"`{name}` has shape {tuple(given.shape)}; give {shape} (add a batch dimension with "
                         f"{name}[None] for a single sequence).")
    if given.shape[0] == 0 or given.shape[1] == 0:
        raise ValueError(f"`{name}` has shape {tuple(given.shape)}: give at least one row of at least one token.")
    if input_ids is not None:
        if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
            raise ValueError(f"`input_ids` are {input_ids.dtype}; token ids must be integers (e.g. torch.long).")
        # Checked outside decode steps only: reading the values waits for the device (and a trace cannot branch).
        checked = input_ids.shape[1] > 1 and not tracing()
        if checked and bool((input_ids < 0).any() | (input_ids >= config.vocab_size).any()):
            raise ValueError(
                f"`input_ids` hold ids from {int(input_ids.min())} to {int(input_ids.max())}, outside the "
                f"vocabulary [0, {config.vocab_size}); check the tokenizer matches this model."
            )
    else:
        if inputs_embeds.shape[-1] != config.hidden_size:
            raise ValueError(f"`inputs_embeds` are {inputs_embeds.shape[-1]} wide; this model's hidden_size is "
                             f"{config.hidden_size}.")
        if not inputs_embeds.is_floating_point():
            raise ValueError(f"`inputs_embeds` are {inputs_embeds.dtype}; give floating-point embeddings (e.g. "
                             "model.get_input_embeddings()(input_ids)).")


def check_mtp_inputs(config, cache) -> None:
    """Refuse multi-token prediction where it cannot run: a model without MTP layers, or a forward that continues a
    cache (the MTP layers keep no cache of their own, so they read the whole sequence in one forward)."""
    if not config.num_mtp_layers:
        raise ValueError("This model has no multi-token-prediction layers (`num_mtp_layers` is 0); convert a source "
                         "checkpoint that has them, or leave out the MTP outputs.")
    if cache is not None and cache.seen_tokens is not None:
        raise ValueError(
            "The multi-token-prediction layers read the whole sequence in one forward and keep no cache of what a "
            "continued forward adds: ask for them in a forward from an empty cache (the prompt's, which fills their "
            "cache layers for drafting) or with use_cache=False, not in one that continues a cache."
        )


def cache_for_forward(config, cache: HybridIndexPoolCache | None, use_cache: bool | None, recomputing: bool,
                      batch_size: int, packed: bool) -> tuple[HybridIndexPoolCache | None, bool]:
    """The cache a forward continues (checked, or created when `use_cache`, default `config.use_cache`) and whether it
    returns it. None while gradient checkpointing `recomputing` (a layer recomputed would update it twice); refused for
    `packed` sequences when asked for, and otherwise left out."""
    use_cache_asked, use_cache = use_cache, config.use_cache if use_cache is None else use_cache
    if recomputing:
        use_cache, cache = False, None
    check_cache(config, cache, batch_size)
    if packed:
        if cache is not None or use_cache_asked:
            raise ValueError(
                "`position_ids` restart at 0 inside a row (packed sequences, as DataCollatorWithFlattening "
                "makes): that is for training without a cache; pass use_cache=False, or one sequence per row."
            )
        use_cache = False
    if use_cache and cache is None:
        cache = HybridIndexPoolCache(config)
    return cache, use_cache


def check_cache(config, cache, batch_size: int) -> None:
    """Refuse a cache that is not a `HybridIndexPoolCache`, or one built for another model (its `layout` differs
    from the config's `cache_layout`) or batch, saying what differs."""
    if cache is not None and not isinstance(cache, HybridIndexPoolCache):
        raise ValueError(
            f"`cache` is a {type(cache).__name__}; this model needs a HybridIndexPoolCache "
            "(leave it empty and one is created, or build one with HybridIndexPoolCache(model.config))."
        )
    if cache is None:
        return
    theirs, ours = cache.layout, cache_layout(config)
    differences = [f"{name}: cache {theirs[name]!r}, model {ours[name]!r}" for name in ours
                   if theirs.get(name) != ours[name]]
    if differences:
        raise ValueError("This cache was built for another model (" + "; ".join(differences) + "); build one "
                         "with HybridIndexPoolCache(model.config).")
    if cache.batch_size not in (-1, batch_size):
        raise ValueError(
            f"The cache holds {cache.batch_size} rows but the input has {batch_size}; use a new cache, or resize it "
            "with batch_repeat_interleave / batch_select_indices first."
        )


def token_is_real_mask(attention_mask, cache, batch_size, seq_len, device):
    """`[batch, seq]` bool: which new tokens exist (mask 1); padding and holes are absent for everything."""
    if attention_mask is None:
        return torch.ones(batch_size, seq_len, dtype=torch.bool, device=device)
    if attention_mask.dim() != 2:
        raise ValueError(
            f"`attention_mask` has {attention_mask.dim()} dimensions; give the 2-D padding mask "
            "`[batch, past + new tokens]` (1 = token, 0 = padding): the sparse selection builds its own."
        )
    if seq_len > 1 or cache is None or cache.seen_tokens is None:
        past = 0 if cache is None else cache.get_seq_length()
    else:  # a decode step reads only the new token's column, and nothing from the device
        past = max(attention_mask.shape[1] - seq_len, 0)
    if attention_mask.shape != (batch_size, past + seq_len):
        raise ValueError(
            f"`attention_mask` has shape {tuple(attention_mask.shape)} but the cache holds {past} tokens and "
            f"{seq_len} new ones arrive for {batch_size} rows; it must be ({batch_size}, {past + seq_len})."
        )
    return attention_mask[:, attention_mask.shape[1] - seq_len:].to(device=device, dtype=torch.bool)


def rope_positions_of(position_ids, streams: int, batch_size, seq_len, device):
    """`position_ids` as rotary positions `[streams, batch, seq]` for a RoPE of `streams` position streams and,
    where they include them, the text positions `[batch, seq]` (which count the real tokens); `(None, None)` when
    not given.

    Accepted: `[batch, seq]` text positions; `[3, batch, seq]` multimodal streams (time, height, width);
    `[4, batch, seq]`, the text positions then the three streams (what `generate()` builds for Qwen-VL models).
    """
    if position_ids is None:
        return None, None
    text_positions, multimodal = None, None
    if position_ids.dim() == 2:
        text_positions = position_ids
    elif position_ids.dim() == 3 and position_ids.shape[0] in (1, 3, 4):
        if position_ids.shape[0] in (1, 4):
            text_positions = position_ids[0]
        if position_ids.shape[0] != 1:
            multimodal = position_ids[-3:]
    else:
        raise ValueError(
            f"`position_ids` has shape {tuple(position_ids.shape)}; give [batch, seq] text positions, or "
            "[3, batch, seq] multimodal (time, height, width) positions, or [4, batch, seq] with the text "
            "positions first."
        )
    if multimodal is not None and streams == 1:
        if not tracing() and not bool((multimodal == multimodal[:1]).all()):
            raise ValueError(
                "`position_ids` has several different position streams (multimodal RoPE for images or video), "
                "but this model's rope_parameters have no 'mrope_section': give [batch, seq] positions, or use "
                "a multimodal model."
            )
        text_positions = multimodal[0] if text_positions is None else text_positions
        multimodal = None
    for name, given in (("text", text_positions), ("multimodal", multimodal)):
        if given is not None and given.shape[-2:] not in ((batch_size, seq_len), (1, seq_len)):
            raise ValueError(f"`position_ids` ({name}) has shape {tuple(given.shape)}; its last two dimensions "
                             f"must be ({batch_size}, {seq_len}).")
    if text_positions is not None:
        text_positions = text_positions.expand(batch_size, seq_len).to(device=device, dtype=torch.long)
    rope = multimodal if multimodal is not None else text_positions[None]
    rope = rope.expand(streams, batch_size, seq_len).to(device=device, dtype=torch.long)
    return rope, text_positions


def is_packed(position_ids, token_is_real) -> bool:
    """Whether some row holds several sequences: more than one real token at position 0 (reads the device)."""
    return bool((((position_ids == 0) & token_is_real).sum(dim=1) > 1).any())


def check_positions(position_ids, positions, token_is_real) -> None:
    """Refuse `position_ids` that disagree with each row's count of real tokens (reads the device; not done in
    decode steps): windows, the cache and RoPE all follow that count."""
    wrong = token_is_real & (position_ids != positions)
    if bool(wrong.any()):
        row, column = (int(index) for index in wrong.nonzero()[0])
        raise ValueError(
            f"`position_ids` give position {int(position_ids[row, column])} to a token that is real token number "
            f"{int(positions[row, column])} of its row (row {row}): positions must count each row's real tokens "
            "from 0 (from the tokens already in the cache), as attention_mask.cumsum(-1) - 1 does. Leave "
            "`position_ids` out and the model counts them; positions restarting at 0 mean packed sequences."
        )
