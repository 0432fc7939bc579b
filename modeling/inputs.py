"""What the model does with its inputs before the layers run, and with the layers' outputs after: validation with
messages that name the argument and the fix, the padding mask as per-token flags, rotary and storage positions,
the token layout (real tokens first, packed sequences apart), and attention weights laid back over mask columns."""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .cache_hybrid_indexpool import HybridIndexPoolCache
from .token_layout import TokenLayout


@dataclass
class LayerStep:
    """What every decoder layer of one pass over (a chunk of) the input reads besides its hidden states, and the
    IndexPool layers' records that are not model outputs.

    Attributes:
        positions: `[batch, seq]` storage positions: each row counts its real tokens (after the cached ones).
        rope_positions: `[streams, batch, seq]` rotary positions.
        token_is_real: `[batch, seq]` bool, False for padding.
        output_attentions: whether IndexPool layers return their attention weights.
        indexer_loss: None, `"dense"` or `"sparse"` (see `HybridIndexPoolModel.forward`).
        ple_token_ids: `[batch, seq]` token ids for per-layer n-gram embeddings (padding as end-of-sequence), or None.
        selections: each full IndexPool layer's selection by layer index, which the shared-indexer layers after it
            reuse (filled as the pass goes; recomputing a layer under gradient checkpointing rewrites the same entry).
        indexer_losses: each IndexPool layer's indexer KL loss by layer index, when `indexer_loss` asks for it.
        final_streams: `[batch, seq, hc_count * hidden]` the residual streams after the last layer, before the final
            mix, when the pass keeps them (for Qwen4-Exp's multi-token prediction).
    """

    positions: torch.Tensor
    rope_positions: torch.Tensor
    token_is_real: torch.Tensor
    output_attentions: bool = False
    indexer_loss: str | None = None
    ple_token_ids: torch.Tensor | None = None
    selections: dict = field(default_factory=dict)
    indexer_losses: dict = field(default_factory=dict)
    final_streams: torch.Tensor | None = None

    def chunk(self, start: int, end: int) -> "LayerStep":
        """The same pass over tokens `start:end` of the grid, with fresh records."""
        return LayerStep(
            self.positions[:, start:end], self.rope_positions[:, :, start:end], self.token_is_real[:, start:end],
            self.output_attentions, self.indexer_loss,
            None if self.ple_token_ids is None else self.ple_token_ids[:, start:end],
        )


@dataclass
class PreparedInputs:
    """The model's inputs on the layers' grid (see `prepare_inputs`)."""

    inputs_embeds: torch.Tensor
    step: LayerStep
    cache: HybridIndexPoolCache | None
    use_cache: bool
    layout: TokenLayout | None
    kv_length: int | None


def prepare_inputs(model, inputs_embeds, attention_mask, position_ids, cache, use_cache, use_cache_asked,
                   output_attentions, indexer_loss, ple_input_ids) -> PreparedInputs:
    """Everything position-related for one forward of `model` (a `HybridIndexPoolModel`): which tokens are real,
    the token layout, the cache's planning and storage positions, the rotary positions and the PLE token ids."""
    config = model.config
    batch_size, seq_len = inputs_embeds.shape[:2]
    device = inputs_embeds.device
    token_is_real = token_is_real_mask(attention_mask, cache, batch_size, seq_len, device)
    num_streams = model.rotary_emb.num_streams
    rope_positions, text_positions = rope_positions_of(position_ids, num_streams, batch_size, seq_len, device)
    # The layers run on a grid where every sequence's real tokens come first (see TokenLayout): padding and
    # holes then cost the recurrent layers nothing, and packed sequences never see each other.
    layout = None
    if seq_len > 1 and text_positions is not None and is_packed(text_positions, token_is_real):
        if cache is not None or use_cache_asked:
            raise ValueError(
                "`position_ids` restart at 0 inside a row (packed sequences, as DataCollatorWithFlattening "
                "makes): that is for training without a cache; pass use_cache=False, or one sequence per row."
            )
        use_cache = False
        layout = TokenLayout.unpack(text_positions, token_is_real)
    elif seq_len > 1:
        layout = TokenLayout.compact(token_is_real)
    # Attention weights are returned over every mask column, past and new (transformers' convention). Only read
    # when asked: the cache's count lives on the device, and a decode step must not wait for it.
    kv_length = None
    if output_attentions:
        kv_length = seq_len + (0 if cache is None else cache.get_seq_length())
    if use_cache and cache is None:
        cache = HybridIndexPoolCache(config)
    ple_token_ids = None
    if config.ple_layers:
        # Padding never enters an n-gram: it reads as end-of-sequence, after which the n-gram context restarts.
        ple_token_ids = ple_input_ids.to(device).masked_fill(~token_is_real, config.ple_eos_token_id)
    if layout is not None:
        inputs_embeds, token_is_real = layout.to_grid(inputs_embeds), layout.token_is_real
        if rope_positions is not None:  # [streams, batch, seq]: the streams ride along
            rope_positions = layout.to_grid(rope_positions.permute(1, 2, 0)).permute(2, 0, 1)
        text_positions = None if text_positions is None else layout.to_grid(text_positions)
        ple_token_ids = None if ple_token_ids is None else layout.to_grid(ple_token_ids)
    # Storage positions: each row counts its real tokens (the cache's per-row lengths come first).
    if cache is not None:
        positions = cache.positions(token_is_real)
    else:
        positions = (token_is_real.long().cumsum(dim=1) - 1).clamp(min=0)
    if text_positions is not None and seq_len > 1:
        check_positions(text_positions, positions, token_is_real)
    if rope_positions is None:
        # The rotary positions count the tokens too, shifted per row after a multimodal prompt.
        rope_positions = positions
        if cache is not None and cache.rope_deltas is not None:
            rope_positions = positions + cache.rope_deltas.to(positions.device)
        rope_positions = rope_positions[None].expand(num_streams, -1, -1)
    step = LayerStep(positions, rope_positions, token_is_real, output_attentions, indexer_loss, ple_token_ids)
    return PreparedInputs(inputs_embeds, step, cache, use_cache, layout, kv_length)


def columns_of_positions(attention_mask, layout, batch_size, kv_length, device) -> torch.Tensor | None:
    """`[batch, queries or 1, positions]`: the mask column (past and new) of each stored position a query can
    attend to, or None when position `p` is column `p` (no padding anywhere). Positions count a row's real
    tokens, so position `p` is its `p`-th real column; in a row of packed sequences, the `p`-th column of the
    query's own sequence."""
    if layout is not None and layout.rows.shape[0] != batch_size:  # packed: one grid row per sequence
        return layout.columns[layout.source_rows]
    if layout is None and (attention_mask is None or bool(attention_mask.all())):
        return None
    # A stable sort puts each row's real columns first, in order; its padding columns follow.
    padding = attention_mask.to(device=device) == 0
    return torch.sort(padding.to(torch.uint8), dim=1, stable=True).indices[:, None]

def attention_by_column(weights, columns, kv_length) -> torch.Tensor:
    """Attention weights `[batch, heads, queries, positions]` laid out over the mask columns instead,
    `[batch, heads, queries, kv_length]`, zero where nothing was attended (padding, unselected windows)."""
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

def check_inputs(config, input_ids, inputs_embeds) -> None:
    """Refuse malformed inputs with a message that names the argument and the fix."""
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
        # Checked outside decode steps only: reading the values waits for the device.
        if input_ids.shape[1] > 1 and bool((input_ids < 0).any() | (input_ids >= config.vocab_size).any()):
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
            "The multi-token-prediction layers read the whole sequence in one forward and keep no cache: ask for "
            "them in a forward from an empty cache (or use_cache=False), not in one that continues a cache."
        )


def check_cache(config, cache, batch_size: int) -> None:
    """Refuse a cache that is not a `HybridIndexPoolCache`, or one built for another model or batch."""
    if cache is not None and not isinstance(cache, HybridIndexPoolCache):
        raise ValueError(
            f"`cache` is a {type(cache).__name__}; this model needs a HybridIndexPoolCache "
            "(leave it empty and one is created, or build one with HybridIndexPoolCache(model.config))."
        )
    if cache is not None:
        cache.check_compatible(config, batch_size)


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
        if not bool((multimodal == multimodal[:1]).all()):
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


def joined(tensors: list) -> torch.Tensor:
    """Pieces of one tensor over consecutive chunks of the grid `[rows, chunk, ...]`, concatenated along the chunks
    (the piece itself when there is one)."""
    return torch.cat(tensors, dim=1) if len(tensors) > 1 else tensors[0]


def gather_pieces(pieces: list, layout: TokenLayout | None, record_layout: TokenLayout | None):
    """One model output from the outputs of the stack's passes over consecutive chunks of the grid (one pass unless
    a long prompt was prefilled in chunks), laid back in the input's token order: final states, per-layer states,
    attention weights `[rows, heads, queries, positions]` (one pass only) and router logits flattened to
    `[batch * seq, num_experts]`."""
    first = pieces[0]
    hidden_states = joined([piece.last_hidden_state for piece in pieces])
    all_hidden_states = None
    if first.hidden_states is not None:
        all_hidden_states = tuple(joined(states) for states in zip(*(piece.hidden_states for piece in pieces)))
    all_attentions = first.attentions
    all_router_logits = None
    if first.router_logits:
        all_router_logits = tuple(joined(logits) for logits in zip(*(piece.router_logits for piece in pieces)))
    if layout is not None:
        hidden_states = layout.from_grid(hidden_states)
        if all_hidden_states is not None and record_layout is None:
            all_hidden_states = tuple(layout.from_grid(states) for states in all_hidden_states)
        if all_attentions is not None:  # [rows, heads, queries, positions]: move the queries
            all_attentions = tuple(layout.from_grid(weights.transpose(1, 2)).transpose(1, 2)
                                   for weights in all_attentions)
        if all_router_logits is not None:  # back in the input's order, so that its padding mask lines up
            all_router_logits = tuple(layout.from_grid(logits) for logits in all_router_logits)
    if all_router_logits is not None:
        all_router_logits = tuple(logits.flatten(0, 1) for logits in all_router_logits)
    return type(first)(last_hidden_state=hidden_states, hidden_states=all_hidden_states, attentions=all_attentions,
                       router_logits=all_router_logits, indexer_loss=first.indexer_loss)
