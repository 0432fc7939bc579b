"""The IndexPool attention layer in vLLM's memory model, computed in PyTorch (any device vLLM runs on).

Three caches per layer, each a layer of its own in vLLM's KV-cache accounting:

- main keys/values, one entry per token: `IndexPoolKVCache` (`FullAttentionSpec`, paged like any attention layer);
- pooled indexer keys (after norm and RoPE), one entry per `r` tokens: vLLM's compressed-key cache
  (`MLAAttentionSpec` with `tokens_per_state = r`), written when a window completes;
- the open window's raw indexer keys and pooling-gate logits: vLLM's ring of the last `r` tokens of each request
  (`CircularBufferSpec`, one block per request), from which a window is pooled when its last token arrives.

A step (any mix of prefill chunks and decodes) writes the new tokens' keys/values, pools every window the step
completes (reading earlier tokens of that window from the ring), then, per request, scores all its complete windows,
selects the top `index_topk // r` visible ones per query (the project's reference selection: ties to the earlier
window), and attends to their tokens plus the query's open window, gathering keys/values from the pages.
"""

from dataclasses import dataclass

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
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_interface import KVCacheLayout, KVCacheSpec

from ..kernels.pooled_index_topk.reference import pooled_index_topk_torch
from ..kernels.sparse_attention.reference import masked_softmax
from ..kernels.weighted_pool.reference import weighted_pool_torch
from .memory import main_kv_spec, open_window_spec, pooled_key_spec

# Queries attended at once: bounds the gathered keys/values to `QUERY_CHUNK x (budget + r - 1)` rows.
QUERY_CHUNK = 256


@dataclass
class IndexPoolMetadata(AttentionMetadata):
    """Per-step metadata of the main key/value cache."""

    num_actual_tokens: int
    query_start_loc: list[int]  # [requests + 1], host
    seq_lens: list[int]  # [requests], host: tokens of each request after this step
    block_table: torch.Tensor  # [requests, blocks]
    slot_mapping: torch.Tensor  # [tokens]


class IndexPoolMetadataBuilder(AttentionMetadataBuilder[IndexPoolMetadata]):
    """Host copies of the batch layout (the computation loops over requests) and the paging tensors."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):  # abstract in vLLM's base class
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> IndexPoolMetadata:
        metadata = common_attn_metadata
        return IndexPoolMetadata(
            num_actual_tokens=metadata.num_actual_tokens,
            query_start_loc=metadata.query_start_loc_cpu[: metadata.num_reqs + 1].tolist(),
            seq_lens=metadata.seq_lens[: metadata.num_reqs].cpu().tolist(),
            block_table=metadata.block_table_tensor,
            slot_mapping=metadata.slot_mapping,
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

    def write(self, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store `key`/`value` `[tokens, kv_heads, head_dim]` at their slots (negative slots are skipped)."""
        keep = slot_mapping >= 0
        slots = slot_mapping[keep]
        block_size = self.kv_cache.shape[2]
        blocks, offsets = slots // block_size, slots % block_size
        self.kv_cache[blocks, :, offsets, : self.head_dim] = key[keep]
        self.kv_cache[blocks, :, offsets, self.head_dim:] = value[keep]

    def gather(self, block_table: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values `[..., kv_heads, head_dim]` of one request's `positions` `[...]` (>= 0)."""
        block_size = self.kv_cache.shape[2]
        blocks = block_table[positions // block_size].long()
        entries = self.kv_cache[blocks, :, positions % block_size]  # [..., kv_heads, 2 * head_dim]
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
        metadata = get_forward_context().attn_metadata
        if isinstance(metadata, list):
            metadata = metadata[0]
        if isinstance(metadata, dict):  # None during vLLM's memory-profiling run: no caches yet
            self._attend(metadata, query, key, value, index_queries, ring_rows, head_weights, output)
        output = output.reshape(num_tokens, -1)
        if gate is not None:
            output = output * torch.sigmoid(gate)
        return self.o_proj(output)[0]

    def _attend(self, metadata, query, key, value, index_queries, ring_rows, head_weights, output):
        main = metadata[self.main_cache.prefix]
        ring = metadata[self.indexer.open_window_cache.prefix]
        pooled = metadata[self.indexer.pooled_key_cache.prefix]
        num_tokens = main.num_actual_tokens
        self.main_cache.write(key[:num_tokens], value[:num_tokens], main.slot_mapping[:num_tokens])
        r = self.pool_size
        ring_cache = self.indexer.open_window_cache.kv_cache  # [blocks, r, 1, width]
        pooled_cache = self.indexer.pooled_key_cache.kv_cache  # [blocks, block_size // r, 1, head_dim]
        windows_per_block = pooled_cache.shape[1]
        for request, seq_len in enumerate(main.seq_lens):
            start_token, end_token = main.query_start_loc[request], main.query_start_loc[request + 1]
            if end_token == start_token:
                continue
            first_position = seq_len - (end_token - start_token)
            # Pool the windows this step completes: their tokens before this step come from the ring.
            first_window, end_window = first_position // r, seq_len // r
            ring_block = ring.block_table[request, 0].long()
            if end_window > first_window:
                earlier = torch.arange(first_window * r, first_position, device=key.device)
                rows = torch.cat([ring_cache[ring_block, earlier % ring_cache.shape[1], 0],
                                  ring_rows[start_token:start_token + (end_window * r - first_position)]])
                window_ids = torch.arange(first_window, end_window, device=key.device)
                keys = self.indexer.pool(rows.view(-1, r, rows.shape[-1]),
                                         self.rotary_emb.cos_sin_cache.index_select(0, window_ids * r))
                blocks = pooled.block_table[request, window_ids // windows_per_block].long()
                pooled_cache[blocks, window_ids % windows_per_block, 0] = keys.to(pooled_cache.dtype)
            tokens = slice(start_token, end_token)
            positions = torch.arange(first_position, seq_len, device=key.device)
            all_windows = torch.arange(end_window, device=key.device)
            pooled_keys = pooled_cache[pooled.block_table[request, all_windows // windows_per_block].long(),
                                       all_windows % windows_per_block, 0]
            selected = pooled_index_topk_torch(
                index_queries[None, tokens], pooled_keys[None], ((positions + 1) // r)[None], self.topk_windows,
                None if head_weights is None else head_weights[None, tokens], window_limit=end_window,
                sink_windows=self.sink_windows, local_windows=self.local_windows,
            )[0]
            output[tokens] = self._sparse_attention(query[tokens], selected, positions, main.block_table[request])
            # The ring keeps the request's last r tokens; written after pooling, which read the earlier ones.
            last = positions[-ring_cache.shape[1]:]
            ring_cache[ring_block, last % ring_cache.shape[1], 0] = ring_rows[tokens][-len(last):].to(ring_cache.dtype)

    def _sparse_attention(self, query, selected, positions, block_table):
        """Attention of one request's queries `[queries, heads, head_dim]` over the tokens of their selected windows
        `[queries, topk]` (-1: none) and of their open windows, gathered from the pages. float32 inside."""
        r = self.pool_size
        group = self.num_heads // self.num_kv_heads
        output = torch.empty_like(query)
        for start in range(0, query.shape[0], QUERY_CHUNK):
            end = min(start + QUERY_CHUNK, query.shape[0])
            windows, chunk_positions = selected[start:end], positions[start:end]
            window_slots = (windows[..., None] * r + torch.arange(r, device=windows.device)).flatten(-2)
            window_valid = (windows >= 0).repeat_interleave(r, dim=-1)
            open_start = (chunk_positions + 1) // r * r
            open_slots = open_start[:, None] + torch.arange(r - 1, device=windows.device)
            open_valid = open_slots <= chunk_positions[:, None]
            slots = torch.cat([window_slots, open_slots], dim=-1)
            valid = torch.cat([window_valid, open_valid], dim=-1)
            slots = slots.clamp(min=0).masked_fill(~valid, 0)
            key, value = self.main_cache.gather(block_table, slots)  # [queries, slots, kv_heads, head_dim]
            chunk_query = query[start:end].view(end - start, self.num_kv_heads, group, self.head_dim).float()
            scores = torch.einsum("tkgd,tskd->tkgs", chunk_query, key.float()) * self.scaling
            probs = masked_softmax(scores, valid[:, None, None])
            chunk_output = torch.einsum("tkgs,tskd->tkgd", probs, value.float())
            output[start:end] = chunk_output.reshape(end - start, self.num_heads, self.head_dim).to(query.dtype)
        return output
