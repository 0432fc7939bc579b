"""The IndexPool attention of GLM-5.3-Flash conversions in vLLM: multi-head latent attention (MLA, NoPE) whose windows
the indexer selects over its latent cache, and shared-indexer layers that reuse the selection of the layer before
them within the step.

Caches, each a layer of its own in vLLM's KV-cache accounting (as vLLM's `models/glm5next` lays them out):

- latents, one normed `kv_lora_rank` row per token: `LatentKVCache` (`MLAAttentionSpec`, vLLM's MLA layout,
  `kv_cache [blocks, 1, block_size, kv_lora_rank]`), in every MLA layer;
- pooled indexer keys, one per `r` tokens, and the open window's normed keys and gate logits: the GQA layer's caches
  (`indexpool_attention.PooledKeyCache`, `OpenWindowCache`), only in layers with their own indexer.

The step is the custom op `hybrid_indexpool_latent_attention` over `latent_step.latent_indexpool_step`; the metadata is
the GQA layer's (`IndexPoolMetadataBuilder`), the latent cache taking the main cache's.
"""

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.layers.layernorm import GemmaRMSNorm, LayerNorm, RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.model_executor.model_loader.weight_utils import sharded_weight_loader
from vllm.model_executor.utils import set_weight_attrs
from vllm.utils.torch_utils import LayerNameType, _encode_layer_name, _resolve_layer_name, direct_register_custom_op
from vllm.v1.attention.backend import AttentionBackend
from vllm.v1.kv_cache_interface import KVCacheSpec, MLAAttentionSpec

from ..kernels.sparse_attention import paged_attention_reads_request_tiles
from .indexpool_attention import (
    IndexPoolAttentionBackend,
    IndexPoolMetadataBuilder,
    OpenWindowCache,
    PooledKeyCache,
)
from .latent_step import LatentCaches, LatentStepSettings, latent_indexpool_step
from .paged_step import pooled_key_width, step_working_memory_bytes
from .step_layers import register_step_layer
from .vllm_config import GLM_OPS

LATENT_ATTENTION_OP = GLM_OPS[1]


def rms_norm_class(config) -> type[nn.Module]:
    """vLLM's RMSNorm of the checkpoint's convention: scaling by the weight (GLM), or by `1 + weight` (Qwen)."""
    return GemmaRMSNorm if config.rms_norm_unit_offset else RMSNorm


class LatentMetadataBuilder(IndexPoolMetadataBuilder):
    """The main cache's metadata (positions, write slots, the selection's tiles) for an MLA layer's latent cache."""

    @staticmethod
    def cache_kind(kv_cache_spec) -> str:
        return "main"


class LatentAttentionBackend(IndexPoolAttentionBackend):
    """Backend of the latent caches: the main cache's metadata; the layer computes the attention."""

    @staticmethod
    def get_builder_cls():
        return LatentMetadataBuilder


class LatentKVCache(nn.Module, AttentionLayerBase):
    """Owner of one MLA layer's paged latents: `kv_cache [blocks, 1, block_size, kv_lora_rank]`."""

    def __init__(self, kv_lora_rank: int, dtype: torch.dtype, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        self.kv_lora_rank, self.dtype, self.prefix = kv_lora_rank, dtype, prefix
        self.kv_cache = torch.tensor([])
        register_step_layer(vllm_config, prefix, self)

    def get_attn_backend(self) -> type[AttentionBackend]:
        return LatentAttentionBackend

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        return MLAAttentionSpec(block_size=vllm_config.cache_config.block_size, num_kv_heads=1,
                                head_size=self.kv_lora_rank, dtype=self.dtype)


class LatentIndexer(nn.Module):
    """GLM-5.3-Flash's indexer: queries `W_q c_q` from the MLA query latent (normed already), one key `LayerNorm(W_k
    x)` per token (the ring holds it normed), learned-gate logits, head weights; no RoPE. Replicated under tensor
    parallelism (every rank selects the same windows)."""

    def __init__(self, config, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        self.num_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.pool_size = config.index_pool_size
        self.weighting = config.index_pool_weighting
        hidden = config.hidden_size
        self.q_proj = ReplicatedLinear(config.q_lora_rank, self.num_heads * self.head_dim, bias=False,
                                       prefix=f"{prefix}.q_proj")
        self.k_proj = ReplicatedLinear(hidden, self.head_dim, bias=False, prefix=f"{prefix}.k_proj")
        self.k_norm = LayerNorm(self.head_dim, eps=1e-6)  # transformers' GLM indexer: nn.LayerNorm(eps=1e-6)
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
        self.open_window_cache = OpenWindowCache(gate_width=self.gate_width,
                                                 head_size=self.head_dim + self.gate_width,
                                                 prefix=f"{prefix}.open_window_cache", **common)
        width, pooled_dtype = pooled_key_width(self.head_dim, config.index_key_cache_dtype)
        self.pooled_key_cache = PooledKeyCache(head_size=width, prefix=f"{prefix}.pooled_key_cache",
                                               **(common | dict(dtype=pooled_dtype or dtype)))

    def project(self, hidden_states: torch.Tensor, query_latent: torch.Tensor):
        """-> queries `[tokens, heads, head_dim]`, ring rows `[tokens, head_dim + gate_width]` (normed key, gate
        logits) and head weights `[tokens, heads]` float32 or None."""
        queries = self.q_proj(query_latent)[0].view(-1, self.num_heads, self.head_dim)
        ring_rows = self.k_norm(self.k_proj(hidden_states)[0])
        if self.gate_width:
            ring_rows = torch.cat([ring_rows, self.pool_gate_proj(hidden_states)[0]], dim=-1)
        head_weights = None
        if self.head_weights_proj is not None:
            head_weights = self.head_weights_proj(hidden_states)[0].float() * self.num_heads**-0.5
        return queries, ring_rows, head_weights


class LatentExpansion(nn.Module):
    """`kv_b_proj`, the per-head expansion of a latent into key and value, kept as a weight `[heads * (qk_head_dim +
    v_head_dim), kv_lora_rank]` (this rank's heads): the absorbed attention folds it into the queries and outputs,
    never multiplies latents by it (so it is not a linear layer, whose weight vLLM's CPU build repacks)."""

    def __init__(self, num_heads: int, qk_head_dim: int, v_head_dim: int, kv_lora_rank: int):
        super().__init__()
        self.num_heads, self.qk_head_dim, self.v_head_dim = num_heads, qk_head_dim, v_head_dim
        self.weight = nn.Parameter(torch.empty(num_heads * (qk_head_dim + v_head_dim), kv_lora_rank))
        set_weight_attrs(self.weight, {"weight_loader": sharded_weight_loader(0)})

    def per_head(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`[heads, qk_head_dim, kv_lora_rank]` and `[heads, v_head_dim, kv_lora_rank]`."""
        per_head = self.weight.unflatten(0, (self.num_heads, self.qk_head_dim + self.v_head_dim))
        return per_head.split([self.qk_head_dim, self.v_head_dim], dim=1)


class IndexPoolMLAAttention(nn.Module):
    """MLA (NoPE, low-rank queries) over the windows its indexer selects, or the previous full layer's selection in a
    shared-indexer layer, plus each query's open window, in the absorbed form: `q'_h = W_k^h^T q_h` scores the
    latents, and `W_v^h` maps the attended latent. Query heads and `kv_b_proj` split under tensor parallelism; the
    latents and the low-rank projections that make them are replicated. Weight names follow the checkpoint
    (`q_a_proj` and `kv_a_proj_with_mqa` are loaded into one fused `fused_qkv_a_proj`)."""

    def __init__(self, config, vllm_config: VllmConfig, prefix: str, shared_indexer: bool):
        super().__init__()
        tp_size = get_tensor_model_parallel_world_size()
        self.num_heads = config.num_attention_heads // tp_size
        self.q_lora_rank, self.kv_lora_rank = config.q_lora_rank, config.kv_lora_rank
        self.qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.scaling = self.qk_head_dim**-0.5
        self.pool_size = config.index_pool_size
        self.topk_windows = config.index_topk_windows
        self.sink_windows, self.local_windows = config.index_sink_windows, config.index_local_windows
        self.max_windows = -(-vllm_config.model_config.max_model_len // self.pool_size)
        hidden, heads = config.hidden_size, config.num_attention_heads
        norm = rms_norm_class(config)
        self.fused_qkv_a_proj = MergedColumnParallelLinear(hidden, [self.q_lora_rank, self.kv_lora_rank],
                                                           bias=config.attention_bias, disable_tp=True,
                                                           prefix=f"{prefix}.fused_qkv_a_proj")
        self.q_a_layernorm = norm(self.q_lora_rank, eps=config.rms_norm_eps)
        self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, heads * self.qk_head_dim, bias=False,
                                             prefix=f"{prefix}.q_b_proj")
        self.kv_a_layernorm = norm(self.kv_lora_rank, eps=config.rms_norm_eps)
        self.kv_b_proj = LatentExpansion(self.num_heads, self.qk_head_dim, self.v_head_dim, self.kv_lora_rank)
        self.o_proj = RowParallelLinear(heads * self.v_head_dim, hidden, bias=config.attention_bias,
                                        prefix=f"{prefix}.o_proj")
        self.indexer = None if shared_indexer else LatentIndexer(config, vllm_config, f"{prefix}.indexer")
        self.latent_cache = LatentKVCache(self.kv_lora_rank, vllm_config.model_config.dtype, vllm_config,
                                          f"{prefix}.attn")
        self.prefix = prefix
        register_step_layer(vllm_config, prefix, self)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, selection: torch.Tensor) -> torch.Tensor:
        """`hidden_states [tokens, hidden]` -> `[tokens, hidden]`. `selection [tokens, topk_windows]` int64: this
        layer's selected windows are written there (a shared-indexer layer reads the previous full layer's)."""
        num_tokens = hidden_states.shape[0]
        query_latent, latent = self.fused_qkv_a_proj(hidden_states)[0].split([self.q_lora_rank, self.kv_lora_rank],
                                                                            dim=-1)
        query_latent = self.q_a_layernorm(query_latent.contiguous())
        latent = self.kv_a_layernorm(latent.contiguous())
        query = self.q_b_proj(query_latent)[0].view(num_tokens, self.num_heads, self.qk_head_dim)
        key_weight, value_weight = self.kv_b_proj.per_head()
        absorbed = torch.einsum("thn,hnc->thc", query, key_weight)  # [tokens, heads, kv_lora_rank]
        index_queries = ring_rows = head_weights = None
        if self.indexer is not None:
            index_queries, ring_rows, head_weights = self.indexer.project(hidden_states, query_latent)
        attended = torch.zeros_like(absorbed)
        torch.ops.vllm.hybrid_indexpool_latent_attention(absorbed, latent, index_queries, ring_rows, head_weights,
                                                         selection, attended, _encode_layer_name(self.prefix))
        output = torch.einsum("thc,hvc->thv", attended, value_weight)  # [tokens, heads, v_head_dim]
        return self.o_proj(output.reshape(num_tokens, -1))[0]

    def step_settings(self) -> LatentStepSettings:
        indexer = self.indexer
        return LatentStepSettings(
            pool_size=self.pool_size, topk_windows=self.topk_windows, sink_windows=self.sink_windows,
            local_windows=self.local_windows, scaling=self.scaling,
            weighting=None if indexer is None else indexer.weighting,
            pool_slot_bias=indexer.pool_slot_bias if indexer is not None and indexer.gate_width else None)

    def attend(self, absorbed, latent, index_queries, ring_rows, head_weights, selection, metadata: dict):
        """`latent_indexpool_step` over this layer's caches and their metadata (by cache name)."""
        indexer = self.indexer
        caches = LatentCaches(self.latent_cache.kv_cache)
        pooled = ring = None
        if indexer is not None:
            caches.pooled_keys, caches.open_window = (indexer.pooled_key_cache.kv_cache,
                                                      indexer.open_window_cache.kv_cache)
            pooled, ring = metadata[indexer.pooled_key_cache.prefix], metadata[indexer.open_window_cache.prefix]
        return latent_indexpool_step(absorbed, latent, index_queries, ring_rows, head_weights, selection, caches,
                                     metadata[self.latent_cache.prefix], pooled, ring, self.step_settings())


def hybrid_indexpool_latent_attention(absorbed_query: torch.Tensor, latent: torch.Tensor,
                                      index_queries: torch.Tensor | None, ring_rows: torch.Tensor | None,
                                      head_weights: torch.Tensor | None, selection: torch.Tensor,
                                      output: torch.Tensor, layer_name: LayerNameType) -> None:
    """The step of MLA IndexPool layer `layer_name` (`IndexPoolMLAAttention.attend`) into `output [tokens, heads,
    kv_lora_rank]`; a layer with an indexer writes its selection into `selection`. A custom op, opaque to
    `torch.compile` and a split point of vLLM's piecewise graphs (`vllm_config.py`)."""
    forward_context = get_forward_context()
    layer = forward_context.no_compile_layers[_resolve_layer_name(layer_name)]
    metadata = forward_context.attn_metadata
    if isinstance(metadata, list):
        metadata = metadata[0]
    if not isinstance(metadata, dict):
        # vLLM's memory-profiling run (no caches yet): take the step's largest working memory once, so that the
        # profile counts it before the KV cache is sized.
        triton_path = not paged_attention_reads_request_tiles(absorbed_query.device)
        torch.empty(step_working_memory_bytes(absorbed_query, latent[:, None], absorbed_query, layer.step_settings(),
                                              layer.max_windows, triton_path),
                    dtype=torch.uint8, device=absorbed_query.device)
        return
    tokens = metadata[layer.latent_cache.prefix].num_actual_tokens

    def first(tensor):
        return None if tensor is None else tensor[:tokens]
    output[:tokens] = layer.attend(absorbed_query[:tokens], latent[:tokens], first(index_queries), first(ring_rows),
                                   first(head_weights), selection[:tokens], metadata)


def hybrid_indexpool_latent_attention_fake(absorbed_query, latent, index_queries, ring_rows, head_weights, selection,
                                           output, layer_name) -> None:
    return None


direct_register_custom_op(op_name=LATENT_ATTENTION_OP.removeprefix("vllm::"), op_func=hybrid_indexpool_latent_attention,
                          mutates_args=["output", "selection"], fake_impl=hybrid_indexpool_latent_attention_fake)
