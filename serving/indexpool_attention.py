"""The IndexPool attention layer in vLLM's memory model, computed in PyTorch (any device vLLM runs on).

Three caches per layer, each a layer of its own in vLLM's KV-cache accounting:

- main keys/values, one entry per token: `IndexPoolKVCache` (`FullAttentionSpec`, paged like any attention layer);
- pooled indexer keys (after norm and RoPE), one entry per `r` tokens: vLLM's compressed-key cache
  (`MLAAttentionSpec` with `tokens_per_state = r`), written when a window completes;
- the open window's raw indexer keys and pooling-gate logits: vLLM's ring of the last `r` tokens of each request
  (`CircularBufferSpec`, one block per request), from which a window is pooled when its last token arrives.

A step (any mix of prefill chunks and decodes) is one batched computation over all its tokens, with shapes set by
the token count, the budget and a window bound the builder picks on the host: write the new tokens' keys/values, pool
every token's window (earlier tokens of the window from the ring) into the pooled-key cache, keep the last `r` tokens
in the ring, score every pooled key up to the bound a tile of one request's queries at a time, select the top
`index_topk // r` complete windows per query (the project's reference selection keys: ties to the earlier window),
and attend to their tokens plus the query's open window, gathering keys/values from the pages. Everything that needs
the host (token -> request, positions, destinations, tiles) is computed once per step by `IndexPoolMetadataBuilder`.
"""

import functools
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.layers.layernorm import GemmaRMSNorm
from vllm.model_executor.layers.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.models.qwen4_exp.common.qsa_cache import QSACompressedKeyCache, QSAKeyStateCache
from vllm.utils.torch_utils import (
    LayerNameType,
    _encode_layer_name,
    _resolve_layer_name,
    direct_register_custom_op,
)
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionMetadata,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_interface import CircularBufferSpec, KVCacheLayout, KVCacheSpec, MLAAttentionSpec

from ..kernels.pooled_index_topk.reference import scaled_head_weights, selection_keys, window_ids_of
from ..kernels.sparse_attention.reference import masked_softmax
from ..kernels.weighted_pool.reference import weighted_pool_torch
from .memory import main_kv_spec, open_window_spec, pooled_key_spec
from .vllm_config import ATTENTION_OP

# Queries attended at once: bounds the gathered keys/values to `QUERY_CHUNK x (budget + r - 1)` rows per step.
QUERY_CHUNK = 256
# Queries of one request scored together against its pooled keys (one tile); decode tokens are tiles of one query.
QUERY_TILE = 64
# Bytes of the per-head scores, selection keys and gathered pooled keys of the tiles scored at once.
SCORE_CHUNK_BYTES = 64 << 20
# Fewest windows scored per query: the builder rounds the longest scheduled context up to a power of two, at least
# this, so that the shapes of a step change only when the longest context crosses a power of two.
MIN_WINDOW_BOUND = 64


@dataclass
class IndexPoolMetadata(AttentionMetadata):
    """Per-step metadata of one of an IndexPool layer's caches, in device tensors the forward reads without syncing.

    Padding tokens (beyond the scheduled ones, or of dummy requests whose blocks are the null block) take every
    per-token field of the step's last real token, so their writes repeat its writes bit for bit; `write_keep` is
    False only in a step without any real token, whose writes put back what the null block's first row holds.
    """

    num_actual_tokens: int
    block_table: torch.Tensor  # [requests, blocks] of this cache
    token_request: torch.Tensor  # [tokens] int64
    token_position: torch.Tensor  # [tokens] int64
    write_token: torch.Tensor  # [tokens] int64: whose data each token writes
    write_block: torch.Tensor  # [tokens] int64
    write_row: torch.Tensor  # [tokens] int64: offset in the block (main), window row (pooled keys), ring row
    write_keep: torch.Tensor  # [tokens] bool
    # Main cache only: the selection's tiles and bound.
    num_visible_windows: torch.Tensor | None = None  # [tokens] int64: complete windows each token sees
    window_bound: int = 0  # windows scored per query, >= every request's complete windows
    tile_tokens: torch.Tensor | None = None  # [tiles, tile width] int64: each tile's queries (repeated at the end)
    tile_request: torch.Tensor | None = None  # [tiles] int64
    token_tile: torch.Tensor | None = None  # [tokens] int64: tile * tile width + row of each token
    # Open-window ring only: where the rows of each token's window come from.
    window_token: torch.Tensor | None = None  # [tokens, r] int64: this step's token holding each row, or -1
    window_ring_block: torch.Tensor | None = None  # [tokens] int64


class IndexPoolMetadataBuilder(AttentionMetadataBuilder[IndexPoolMetadata]):
    """Everything the forward needs from the host, computed once per step per cache into persistent buffers: token
    -> request, positions, write destinations, complete visible windows, the selection's tiles and window bound.

    Only host values vLLM already holds are read (`query_start_loc_cpu`, `max_seq_len`); the rest is device work.
    CUDA graphs of uniform single-token decode batches replay it: tiles are then the requests, one query each, and
    the window bound is fixed by the model's length.
    """

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        config = vllm_config.model_config.hf_config
        self.pool_size = config.index_pool_size
        self.block_size = kv_cache_spec.block_size
        self.kind = ("ring" if isinstance(kv_cache_spec, CircularBufferSpec) else
                     "pooled" if isinstance(kv_cache_spec, MLAAttentionSpec) else "main")
        max_windows = -(-vllm_config.model_config.max_model_len // self.pool_size)
        # Graph replays keep the captured shapes: every window the model's length allows is scored.
        full_graphs = vllm_config.compilation_config.cudagraph_mode.has_full_cudagraphs()
        self.fixed_window_bound = max_windows if full_graphs else None
        self.max_windows = max_windows
        max_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        max_requests = vllm_config.scheduler_config.max_num_seqs
        buffer = functools.partial(torch.empty, dtype=torch.long, device=device)
        self.token_buffers = {name: buffer(max_tokens) for name in (
            "token_request", "token_position", "write_token", "write_block", "write_row", "num_visible_windows",
            "token_tile", "window_ring_block")}
        self.write_keep_buffer = torch.empty(max_tokens, dtype=torch.bool, device=device)
        self.window_token_buffer = buffer(max_tokens, self.pool_size)
        self.tile_tokens_buffer = buffer(max_tokens + max_requests * QUERY_TILE)
        self.tile_request_buffer = buffer(max_tokens + max_requests)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> IndexPoolMetadata:
        common = common_attn_metadata
        num_tokens, num_requests, r = common.num_actual_tokens, common.num_reqs, self.pool_size
        starts_cpu = common.query_start_loc_cpu[: num_requests + 1]
        query_lens_cpu = (starts_cpu[1:] - starts_cpu[:-1]).long()
        num_scheduled = int(starts_cpu[-1])
        out = {name: buffer[:num_tokens] for name, buffer in self.token_buffers.items()}

        # Token -> request from the host copy (requests of zero tokens own none); tokens beyond them are padding.
        token_request = torch.repeat_interleave(torch.arange(num_requests), query_lens_cpu)
        token_request = torch.cat([token_request, token_request.new_full((num_tokens - num_scheduled,),
                                                                          max(num_requests - 1, 0))])
        request = out["token_request"].copy_(token_request, non_blocking=True)
        tokens = torch.arange(num_tokens, device=self.device)
        starts = common.query_start_loc.long()
        first_token, end_token = starts[request], starts[request + 1]
        position = common.seq_lens.long()[request] - (end_token - first_token) + tokens - first_token
        block_table = common.block_table_tensor
        column = 0 if self.kind == "ring" else (position // self.block_size).clamp(0, block_table.shape[1] - 1)
        # Dummy requests (warm-up and capture runs) have null-block rows: their tokens are padding too.
        real = (tokens < num_scheduled) & (position >= 0) & (block_table[request, column] > 0)
        last_real = torch.where(real, tokens, -1).amax() if num_tokens else tokens.new_tensor(-1)
        source = torch.where(real, tokens, last_real.clamp(min=0))
        request, position = out["token_request"].copy_(request[source]), position[source]
        first_token, end_token = first_token[source], end_token[source]
        out["token_position"].copy_(position)
        keep = self.write_keep_buffer[:num_tokens].copy_((last_real >= 0).expand(num_tokens))

        metadata = dict(num_actual_tokens=num_tokens, block_table=block_table, write_keep=keep)
        if self.kind == "main":
            slot = common.slot_mapping[:num_tokens].long()[source]
            write_token, block, row = source, slot // self.block_size, slot % self.block_size
            out["num_visible_windows"].copy_((position + 1) // r)
            metadata.update(self._tiles(query_lens_cpu, starts_cpu, num_tokens, num_scheduled, common.max_query_len,
                                        common.max_seq_len, out["token_tile"]))
            metadata["num_visible_windows"] = out["num_visible_windows"]
        elif self.kind == "pooled":
            # Every token writes the pooled key of its window, computed at the window's last token of the step:
            # a complete window's key, or one a later step overwrites before any query sees the window.
            write_token = torch.minimum(source + (r - 1) - position % r, end_token - 1)
            window = position // r
            column = (window * r // self.block_size).clamp(max=block_table.shape[1] - 1)
            block, row = block_table[request, column].long(), window % (self.block_size // r)
        else:
            # Of the step's tokens sharing a ring row, the last one's row stays: every earlier token writes it too.
            last_token = end_token - 1
            write_token = source + r * ((last_token - source) // r)
            block, row = block_table[request, 0].long(), position % r
            # The r rows of each token's window: this step's tokens, the earlier ones from the ring.
            rows = (position // r * r)[:, None] + torch.arange(r, device=self.device)
            step_start = position - (source - first_token)
            from_step = rows >= step_start[:, None]
            window_token = torch.minimum(first_token[:, None] + rows - step_start[:, None], last_token[:, None])
            metadata["window_token"] = self.window_token_buffer[:num_tokens].copy_(
                torch.where(from_step, window_token, -1))
            metadata["window_ring_block"] = out["window_ring_block"].copy_(block)
        no_write = ~keep
        metadata.update(
            token_request=request, token_position=out["token_position"],
            write_token=out["write_token"].copy_(write_token),
            write_block=out["write_block"].copy_(block.masked_fill(no_write, 0)),
            write_row=out["write_row"].copy_(row.masked_fill(no_write, 0)),
        )
        return IndexPoolMetadata(**metadata)

    def _tiles(self, query_lens_cpu, starts_cpu, num_tokens, num_scheduled, max_query_len, max_seq_len, token_tile):
        """Split each request's queries into tiles of `min(QUERY_TILE, max_query_len)` (host arithmetic on the
        host copies vLLM keeps); every request has at least one tile, so a decode batch has one per request."""
        width = max(1, min(QUERY_TILE, max_query_len))
        tiles_per_request = ((query_lens_cpu + width - 1) // width).clamp(min=1)
        tile_request = torch.repeat_interleave(torch.arange(len(query_lens_cpu)), tiles_per_request)
        tile_start = torch.cumsum(tiles_per_request, 0) - tiles_per_request
        tile_in_request = torch.arange(len(tile_request)) - tile_start[tile_request]
        first = starts_cpu[:-1].long()[tile_request] + tile_in_request * width
        last = (starts_cpu[1:].long()[tile_request] - 1).clamp(min=0)
        tile_tokens = torch.minimum(first[:, None] + torch.arange(width), last[:, None])
        tile_tokens = tile_tokens.clamp(max=max(num_tokens - 1, 0))
        # Each scheduled token's place in the tiles; padding tokens read the first place (their output is unused).
        places = torch.zeros(num_tokens, dtype=torch.long)
        owner = first[:, None] + torch.arange(width)
        valid = owner <= last[:, None]
        valid &= owner < num_scheduled
        places[owner[valid]] = torch.arange(tile_tokens.numel()).view_as(tile_tokens)[valid]
        num_tiles = len(tile_request)
        if self.fixed_window_bound is not None:
            window_bound = self.fixed_window_bound
        else:
            needed = max(1, -(-max_seq_len // self.pool_size))
            window_bound = min(self.max_windows, max(MIN_WINDOW_BOUND, 1 << (needed - 1).bit_length()))
        return dict(
            window_bound=window_bound,
            tile_tokens=self.tile_tokens_buffer[: num_tiles * width].view(num_tiles, width).copy_(
                tile_tokens, non_blocking=True),
            tile_request=self.tile_request_buffer[:num_tiles].copy_(tile_request, non_blocking=True),
            token_tile=token_tile.copy_(places, non_blocking=True),
        )


class IndexPoolAttentionBackend(AttentionBackend):
    """The plugin's backend for the main key/value cache: metadata only; the layer computes the attention."""

    supported_dtypes = [torch.float16, torch.bfloat16]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls():
        raise NotImplementedError("IndexPool attention is computed by the layer itself (IndexPoolAttention).")

    @staticmethod
    def get_builder_cls():
        return IndexPoolMetadataBuilder


class IndexPoolStateBackend(IndexPoolAttentionBackend):
    """Backend of the pooled-key and open-window caches: the same metadata, and the page layouts vLLM packs such
    caches in beside the main keys/values."""

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.BLNHC, KVCacheLayout.BLHNC)


class PooledKeyCache(QSACompressedKeyCache):
    """vLLM's compressed-key cache (one row per `r` tokens, paged with the request's blocks): pooled indexer keys,
    `kv_cache [blocks, block_size // r, 1, head_dim]`."""

    def get_attn_backend(self) -> type[AttentionBackend]:
        return IndexPoolStateBackend

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        return pooled_key_spec(self.head_size, self.compress_ratio, self.cache_config.block_size, self.dtype)


class OpenWindowCache(QSAKeyStateCache):
    """vLLM's ring of each request's last `r` tokens (one block per request): raw indexer keys and gate logits,
    `kv_cache [blocks, r, 1, head_dim + gate_width]`; token `p` at row `p % r`."""

    def __init__(self, gate_width: int, **kwargs):
        super().__init__(**kwargs)
        self.gate_width = gate_width

    def get_attn_backend(self) -> type[AttentionBackend]:
        return IndexPoolStateBackend

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        return open_window_spec(self.head_size - self.gate_width, self.gate_width, self.compress_ratio, self.dtype)


class IndexPoolKVCache(nn.Module, AttentionLayerBase):
    """Owner of one IndexPool layer's paged main keys/values: `kv_cache [blocks, kv_heads, block_size, 2 * head_dim]`
    (key, then value, per slot)."""

    def __init__(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        self.num_kv_heads, self.head_dim, self.dtype, self.prefix = num_kv_heads, head_dim, dtype, prefix
        self.kv_cache = torch.tensor([])
        context = vllm_config.compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"Duplicate layer name: {prefix}")
        context[prefix] = self

    def get_attn_backend(self) -> type[AttentionBackend]:
        return IndexPoolAttentionBackend

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        return main_kv_spec(self.num_kv_heads, self.head_dim, vllm_config.cache_config.block_size, self.dtype)

    def write(self, entries: torch.Tensor, metadata: IndexPoolMetadata) -> None:
        """Store each token's key and value side by side, `entries [tokens, kv_heads, 2 * head_dim]`, at its slot
        (padding tokens repeat a real token's write, see `IndexPoolMetadata`)."""
        new = entries[metadata.write_token].to(self.kv_cache.dtype)
        old = self.kv_cache[metadata.write_block, :, metadata.write_row]
        self.kv_cache[metadata.write_block, :, metadata.write_row] = torch.where(
            metadata.write_keep[:, None, None], new, old)

    def gather(self, block_table: torch.Tensor, requests: torch.Tensor,
               positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values `[tokens, slots, kv_heads, head_dim]` at `positions [tokens, slots]` (>= 0) of each
        token's request `requests [tokens]`."""
        block_size = self.kv_cache.shape[2]
        blocks = block_table[requests[:, None], positions // block_size].long()
        entries = self.kv_cache[blocks, :, positions % block_size]  # [tokens, slots, kv_heads, 2 * head_dim]
        return entries[..., : self.head_dim], entries[..., self.head_dim:]


def apply_neox_rotary(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first `rotary_dim` channels of `x` `[tokens, ..., dim]` (non-interleaved halves); `cos_sin`
    `[tokens, rotary_dim]` is vLLM's cache row (cosines, then sines) at each token's position."""
    cos, sin = cos_sin.to(x.dtype).chunk(2, dim=-1)
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    rotary_dim = 2 * cos.shape[-1]
    first, second = x[..., : rotary_dim // 2], x[..., rotary_dim // 2: rotary_dim]
    rotated = torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
    return torch.cat([rotated, x[..., rotary_dim:]], dim=-1)


class IndexPoolIndexer(nn.Module):
    """The indexer: per-token queries `RoPE(norm(W_q x))`, one raw key `W_k x` per token, learned-gate logits, and
    the pooled-key and open-window caches. Replicated under tensor parallelism (every rank selects the same windows).
    """

    def __init__(self, config, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        self.num_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.pool_size = config.index_pool_size
        self.weighting = config.index_pool_weighting
        hidden = config.hidden_size
        self.q_proj = ReplicatedLinear(hidden, self.num_heads * self.head_dim, bias=False, prefix=f"{prefix}.q_proj")
        self.k_proj = ReplicatedLinear(hidden, self.head_dim, bias=False, prefix=f"{prefix}.k_proj")
        self.q_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.gate_width = {"learned": self.head_dim, "learned_scalar": 1}.get(self.weighting, 0)
        if self.gate_width:
            self.pool_gate_proj = ReplicatedLinear(hidden, self.gate_width, bias=False,
                                                   prefix=f"{prefix}.pool_gate_proj")
            self.pool_slot_bias = nn.Parameter(torch.zeros(self.pool_size, self.gate_width))
        self.head_weights_proj = None
        if config.index_head_weights:
            self.head_weights_proj = ReplicatedLinear(hidden, self.num_heads, bias=False,
                                                      prefix=f"{prefix}.head_weights_proj")
        dtype = vllm_config.model_config.dtype
        common = dict(dtype=dtype, cache_config=vllm_config.cache_config, vllm_config=vllm_config,
                      compress_ratio=self.pool_size)
        # The ring holds each token's raw key and gate logits side by side (both exact in the model's dtype: they are
        # outputs of its linear layers).
        self.open_window_cache = OpenWindowCache(gate_width=self.gate_width,
                                                 head_size=self.head_dim + self.gate_width,
                                                 prefix=f"{prefix}.open_window_cache", **common)
        self.pooled_key_cache = PooledKeyCache(head_size=self.head_dim, prefix=f"{prefix}.pooled_key_cache",
                                                      **common)

    def project(self, hidden_states: torch.Tensor, cos_sin: torch.Tensor):
        """`[tokens, hidden]` -> queries `[tokens, heads, head_dim]`, ring rows `[tokens, head_dim + gate_width]`
        (raw key, gate logits) and head weights `[tokens, heads]` float32 or None."""
        queries, _ = self.q_proj(hidden_states)
        queries = self.q_norm(queries.view(-1, self.num_heads, self.head_dim))
        queries = apply_neox_rotary(queries, cos_sin)
        ring_rows, _ = self.k_proj(hidden_states)
        if self.gate_width:
            gate_logits, _ = self.pool_gate_proj(hidden_states)
            ring_rows = torch.cat([ring_rows, gate_logits], dim=-1)
        head_weights = None
        if self.head_weights_proj is not None:
            head_weights = self.head_weights_proj(hidden_states)[0].float() * self.num_heads**-0.5
        return queries, ring_rows, head_weights

    def pool(self, window_rows: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        """`[windows, r, head_dim + gate_width]` ring rows -> pooled keys `[windows, head_dim]`, normed and rotated
        at each window's first position (`cos_sin [windows, rotary_dim]`), with the transformers model's dtypes."""
        keys = window_rows[..., : self.head_dim]
        if self.weighting == "prenorm_mean":
            pooled = weighted_pool_torch(self.k_norm(keys), None).to(keys.dtype)
        else:
            logits = None
            if self.gate_width:
                logits = window_rows[..., self.head_dim:].float() + self.pool_slot_bias.float()
            pooled = self.k_norm(weighted_pool_torch(keys, logits).to(keys.dtype))
        return apply_neox_rotary(pooled, cos_sin)


class IndexPoolAttention(nn.Module):
    """Gated GQA attention (q/k norm, partial RoPE, sigmoid output gate) over the windows the indexer selects plus the
    open window, with vLLM's parallel linear layers and paged caches. Weight names follow the checkpoint."""

    def __init__(self, config, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        # This rank's heads (all of them without tensor parallelism); key/value heads are replicated when fewer than
        # the ranks, as QKVParallelLinear lays them out.
        tp_size = get_tensor_model_parallel_world_size()
        self.num_heads = config.num_attention_heads // tp_size
        self.num_kv_heads = max(1, config.num_key_value_heads // tp_size)
        self.head_dim = config.head_dim
        self.scaling = self.head_dim**-0.5
        self.output_gate = config.attention_output_gate
        self.pool_size = config.index_pool_size
        self.topk_windows = config.index_topk_windows
        self.sink_windows, self.local_windows = config.index_sink_windows, config.index_local_windows
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim,
                                          config.num_attention_heads * (2 if self.output_gate else 1),
                                          config.num_key_value_heads, bias=config.attention_bias,
                                          prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size,
                                        bias=config.attention_bias, prefix=f"{prefix}.o_proj")
        self.q_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.rotary_emb = get_rope(head_size=self.head_dim, max_position=config.max_position_embeddings,
                                   rope_parameters=config.rope_parameters)
        self.indexer = IndexPoolIndexer(config, vllm_config, f"{prefix}.indexer")
        self.main_cache = IndexPoolKVCache(self.num_kv_heads, self.head_dim, vllm_config.model_config.dtype,
                                         vllm_config, f"{prefix}.attn")
        # The custom op finds the layer by name in the forward context, as vLLM's own attention ops do.
        self.prefix = prefix
        context = vllm_config.compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"Duplicate layer name: {prefix}")
        context[prefix] = self

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """`positions [tokens]`, `hidden_states [tokens, hidden]` -> `[tokens, hidden]`."""
        num_tokens = hidden_states.shape[0]
        qkv, _ = self.qkv_proj(hidden_states)
        query_width = self.num_heads * self.head_dim * (2 if self.output_gate else 1)
        kv_width = self.num_kv_heads * self.head_dim
        query, key, value = qkv.split([query_width, kv_width, kv_width], dim=-1)
        gate = None
        if self.output_gate:  # each head's query and gate side by side, as in the checkpoint's q_proj
            query, gate = query.view(num_tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(num_tokens, -1)
        query = self.q_norm(query.reshape(num_tokens, self.num_heads, self.head_dim))
        key = self.k_norm(key.reshape(num_tokens, self.num_kv_heads, self.head_dim))
        cos_sin = self.rotary_emb.cos_sin_cache.index_select(0, positions)
        query, key = apply_neox_rotary(query, cos_sin), apply_neox_rotary(key, cos_sin)
        value = value.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        index_queries, ring_rows, head_weights = self.indexer.project(hidden_states, cos_sin)

        output = torch.zeros_like(query)  # [tokens, heads, head_dim]
        torch.ops.vllm.hybrid_indexpool_attention(query, key, value, index_queries, ring_rows, head_weights, output,
                                                  _encode_layer_name(self.prefix))
        output = output.reshape(num_tokens, -1)
        if gate is not None:
            output = output * torch.sigmoid(gate)
        return self.o_proj(output)[0]

    def attend(self, query, key, value, index_queries, ring_rows, head_weights, main: IndexPoolMetadata,
               pooled: IndexPoolMetadata, ring: IndexPoolMetadata) -> torch.Tensor:
        """One step of every request at once: write the new keys/values, pool every token's window into the
        pooled-key cache (complete ones are final), keep the last `r` tokens in the ring, select each query's windows
        and attend to them and to its open window. Shapes depend on the token count and the budget only; nothing is
        read from the device."""
        r = self.pool_size
        self.main_cache.write(torch.cat([key, value], dim=-1), main)
        ring_cache = self.indexer.open_window_cache.kv_cache  # [blocks, r, 1, width]
        from_step = ring.window_token >= 0
        window_rows = torch.where(from_step[..., None], ring_rows[ring.window_token.clamp(min=0)],
                                  ring_cache[ring.window_ring_block, :, 0].to(ring_rows.dtype))
        window_start = ring.token_position // r * r
        window_keys = self.indexer.pool(window_rows, self.rotary_emb.cos_sin_cache.index_select(0, window_start))
        # The ring is written after pooling, which read its rows of earlier steps.
        write_rows(self.indexer.pooled_key_cache.kv_cache, pooled, window_keys)
        write_rows(ring_cache, ring, ring_rows)
        selected = self._select(index_queries, head_weights, main, pooled)
        return self._sparse_attention(query, selected, main)

    def _select(self, index_queries, head_weights, main: IndexPoolMetadata, pooled: IndexPoolMetadata):
        """The `topk_windows` best complete windows of every query `[tokens, topk_windows]` (ascending, -1 after the
        last), scored a chunk of tiles at a time against every pooled key up to the step's window bound, with the
        reference's selection keys (ties to the earlier window, forced sink and local windows)."""
        pooled_cache = self.indexer.pooled_key_cache.kv_cache  # [blocks, block_size // r, 1, head_dim]
        num_tiles, width = main.tile_tokens.shape
        num_windows, num_heads, head_dim = main.window_bound, index_queries.shape[1], index_queries.shape[2]
        windows_per_block = pooled_cache.shape[1]
        windows = torch.arange(num_windows, device=index_queries.device)
        columns = (windows // windows_per_block).clamp(max=pooled.block_table.shape[1] - 1)
        weights = scaled_head_weights(index_queries[None], None if head_weights is None else head_weights[None])[0]
        tiles_per_chunk = max(1, SCORE_CHUNK_BYTES // (width * num_windows * (4 * num_heads + 12)
                                                       + num_windows * head_dim * 4))
        selected = []
        for start in range(0, num_tiles, tiles_per_chunk):
            tokens = main.tile_tokens[start:start + tiles_per_chunk]  # [tiles, width]
            blocks = pooled.block_table[main.tile_request[start:start + tiles_per_chunk]][:, columns].long()
            keys = pooled_cache[blocks, windows % windows_per_block, 0].float()  # [tiles, windows, head_dim]
            per_head = torch.einsum("tqhd,twd->tqhw", index_queries[tokens].float(), keys).relu_()
            # Heads summed in order, as the reference's score does.
            scores = (per_head * weights[tokens][..., None]).sum(dim=2)  # [tiles, width, windows]
            keys = selection_keys(scores, 0, main.num_visible_windows[tokens][..., None],
                                  sink_windows=self.sink_windows, local_windows=self.local_windows)
            if num_windows > self.topk_windows:
                keys = keys.topk(self.topk_windows, dim=-1, sorted=False).values
            selected.append(window_ids_of(keys, self.topk_windows))
        return torch.cat(selected).flatten(0, 1)[main.token_tile]

    def _sparse_attention(self, query, selected, main: IndexPoolMetadata):
        """Attention of every query `[tokens, heads, head_dim]` over the tokens of its selected windows
        `[tokens, topk]` (-1: none) and of its open window, gathered from the pages `QUERY_CHUNK` queries at a
        time. float32 inside."""
        r = self.pool_size
        group = self.num_heads // self.num_kv_heads
        output = torch.empty_like(query)
        window_offsets = torch.arange(r, device=query.device)
        open_offsets = torch.arange(r - 1, device=query.device)
        for start in range(0, query.shape[0], QUERY_CHUNK):
            end = min(start + QUERY_CHUNK, query.shape[0])
            windows, positions = selected[start:end], main.token_position[start:end]
            window_slots = (windows[..., None] * r + window_offsets).flatten(-2)
            window_valid = (windows >= 0).repeat_interleave(r, dim=-1)
            open_slots = ((positions + 1) // r * r)[:, None] + open_offsets
            open_valid = open_slots <= positions[:, None]
            valid = torch.cat([window_valid, open_valid], dim=-1)
            slots = torch.cat([window_slots, open_slots], dim=-1).masked_fill(~valid, 0)
            key, value = self.main_cache.gather(main.block_table, main.token_request[start:end], slots)
            chunk_query = query[start:end].view(end - start, self.num_kv_heads, group, self.head_dim).float()
            scores = torch.einsum("tkgd,tskd->tkgs", chunk_query, key.float()) * self.scaling
            probs = masked_softmax(scores, valid[:, None, None])
            chunk_output = torch.einsum("tkgs,tskd->tkgd", probs, value.float())
            output[start:end] = chunk_output.reshape(end - start, self.num_heads, self.head_dim).to(query.dtype)
        return output


def write_rows(cache: torch.Tensor, metadata: IndexPoolMetadata, rows: torch.Tensor) -> None:
    """Write each token's `rows[write_token]` `[tokens, width]` at `(write_block, write_row)` of a
    `[blocks, rows, 1, width]` cache. Tokens sharing a destination write the same bits; in a step without a real
    token, each destination gets back what it holds."""
    new = rows[metadata.write_token].to(cache.dtype)[:, None]
    old = cache[metadata.write_block, metadata.write_row]
    cache[metadata.write_block, metadata.write_row] = torch.where(metadata.write_keep[:, None, None], new, old)


def hybrid_indexpool_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               index_queries: torch.Tensor, ring_rows: torch.Tensor, head_weights: torch.Tensor | None,
                               output: torch.Tensor, layer_name: LayerNameType) -> None:
    """The step of IndexPool layer `layer_name` (`IndexPoolAttention.attend`) into `output [tokens, heads, head_dim]`.
    A custom op, opaque to `torch.compile`: the compiled model must not keep one step's host values (token count,
    tiles, window bound), and vLLM splits its piecewise CUDA graphs here (`vllm_config.py`)."""
    forward_context = get_forward_context()
    layer = forward_context.no_compile_layers[_resolve_layer_name(layer_name)]
    metadata = forward_context.attn_metadata
    if isinstance(metadata, list):
        metadata = metadata[0]
    if not isinstance(metadata, dict):  # None during vLLM's memory-profiling run: no caches yet
        return
    main = metadata[layer.main_cache.prefix]
    tokens = main.num_actual_tokens
    output[:tokens] = layer.attend(
        query[:tokens], key[:tokens], value[:tokens], index_queries[:tokens], ring_rows[:tokens],
        None if head_weights is None else head_weights[:tokens], main,
        metadata[layer.indexer.pooled_key_cache.prefix], metadata[layer.indexer.open_window_cache.prefix])


def hybrid_indexpool_attention_fake(query, key, value, index_queries, ring_rows, head_weights, output,
                                    layer_name) -> None:
    return None


direct_register_custom_op(op_name=ATTENTION_OP.removeprefix("vllm::"), op_func=hybrid_indexpool_attention,
                          mutates_args=["output"], fake_impl=hybrid_indexpool_attention_fake)
