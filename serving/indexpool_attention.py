"""The IndexPool attention layer in vLLM's memory model: vLLM's parallel linear layers, norms and rotary embedding, and
the batched step over its paged caches (`paged_step.py`, which imports nothing of vLLM).

Three caches per layer, each a layer of its own in vLLM's KV-cache accounting:

- main keys/values, one entry per token: `IndexPoolKVCache` (`FullAttentionSpec`, paged like any attention layer);
- pooled indexer keys (after norm and RoPE; packed fp8 with `index_key_cache_dtype = "float8_e4m3fn"`), one entry per
  `r` tokens: vLLM's compressed-key cache (`MLAAttentionSpec` with `tokens_per_state = r`), written when a window
  completes;
- the open window's raw indexer keys and pooling-gate logits: vLLM's ring of the last `r` tokens of each request
  (`CircularBufferSpec`, one block per request), from which a window is pooled when its last token arrives.

`IndexPoolMetadataBuilder` computes what needs the host once per step and cache (`PagedMetadataBuilder`); the layer's
step is a custom op (`hybrid_indexpool_attention`) that runs `indexpool_step` for every request at once, with shapes
set by the token count and the budget and nothing read from the device. On CUDA its kernels are Triton's (paged
scoring, pooled-key write and sparse attention); elsewhere their PyTorch references.
"""

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

from ..kernels.pooled_key_write import neox_rotary
from ..kernels.sparse_attention import paged_attention_reads_request_tiles
from .huge_pages import HugePageAdvice, advise_huge_pages
from .memory import main_kv_spec, open_window_spec, pooled_key_spec
from .paged_step import (
    IndexPoolStepSettings,
    PagedCacheMetadata,
    PagedCaches,
    PagedMetadataBuilder,
    indexpool_step,
    pooled_key_width,
    ring_capacity,
    step_working_memory_bytes,
)
from .rope import text_rope_parameters
from .step_layers import register_step_layer
from .vllm_config import ATTENTION_OP
from .vllm_versions import qsa_cache_classes

QSACompressedKeyCache, QSARawKeyCache = qsa_cache_classes()


class IndexPoolMetadata(PagedCacheMetadata, AttentionMetadata):
    """`PagedCacheMetadata` as vLLM's attention metadata of one of an IndexPool layer's caches."""


class IndexPoolMetadataBuilder(AttentionMetadataBuilder[IndexPoolMetadata]):
    """vLLM's builder of one IndexPool cache's metadata: `PagedMetadataBuilder` fed from vLLM's common metadata
    (only the host values vLLM already holds are read: `query_start_loc_cpu`, `max_query_len`, `max_seq_len`,
    `seq_lens_cpu_upper_bound`).

    Full CUDA graphs replay uniform single-token decode batches only: tiles are then the requests, one query each, and
    the window bound is fixed by the model's length. Whether graphs are full is read at each step, from the mode the
    model runner resolved after building this builder (Model Runner V2 resolves it from the backends' support).
    """

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        kind = self.cache_kind(kv_cache_spec)
        scheduler = vllm_config.scheduler_config
        self.compilation_config = vllm_config.compilation_config
        self.step_builder = PagedMetadataBuilder(
            kind, vllm_config.model_config.hf_text_config.index_pool_size, kv_cache_spec.block_size,
            vllm_config.model_config.max_model_len, scheduler.max_num_batched_tokens, scheduler.max_num_seqs, device,
            metadata_class=IndexPoolMetadata)

    @staticmethod
    def cache_kind(kv_cache_spec) -> str:
        """Which of a layer's caches `kv_cache_spec` describes (`PagedMetadataBuilder`'s `kind`)."""
        return ("open_window" if isinstance(kv_cache_spec, CircularBufferSpec) else
                "pooled_keys" if isinstance(kv_cache_spec, MLAAttentionSpec) else "main")

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> IndexPoolMetadata:
        common, compilation = common_attn_metadata, self.compilation_config
        mode = compilation.cudagraph_mode
        self.step_builder.full_graphs = mode is not None and mode.has_full_cudagraphs()
        self.step_builder.max_graph_tokens = compilation.max_cudagraph_capture_size
        return self.step_builder.build(
            common.num_actual_tokens, common.num_reqs, common.query_start_loc_cpu, common.query_start_loc,
            common.seq_lens, common.block_table_tensor, common.slot_mapping, common.max_query_len,
            common.max_seq_len, common.seq_lens_cpu_upper_bound)


class IndexPoolAttentionBackend(AttentionBackend):
    """The plugin's backend for the main key/value cache: metadata only; the layer computes the attention."""

    supported_dtypes = [torch.float16, torch.bfloat16, torch.float32]

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
    caches in beside the main keys/values, or the layer-major one of vLLM's CPU attention (an MTP drafter's layer
    beside them: the step reads any layout through its strides)."""

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.BLNHC, KVCacheLayout.BLHNC, KVCacheLayout.LBHNC)


class PooledKeyCache(QSACompressedKeyCache):
    """vLLM's compressed-key cache (one row per `r` tokens, paged with the request's blocks): pooled indexer keys,
    `kv_cache [blocks, block_size // r, 1, width]` (`head_dim` in the model's dtype, or `head_dim + 4` bytes of a
    packed fp8 key)."""

    huge_pages: HugePageAdvice | None = None

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """vLLM's binding, then the cache's memory advised into huge pages (`IndexPoolKVCache.bind_kv_cache`)."""
        super().bind_kv_cache(kv_cache)
        self.huge_pages = advise_huge_pages(kv_cache)

    def get_attn_backend(self) -> type[AttentionBackend]:
        return IndexPoolStateBackend

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        return pooled_key_spec(self.head_size, self.compress_ratio, self.cache_config.block_size, self.dtype)


class OpenWindowCache(QSARawKeyCache):
    """vLLM's ring of each request's last `R` tokens (one block per request): raw indexer keys and gate logits,
    `kv_cache [blocks, R, 1, head_dim + gate_width]`; token `p` at row `p % R`. `R = r`, or with speculative decoding
    enough rows that a rejected draft's row is never one the next step pools (`ring_capacity`)."""

    def __init__(self, gate_width: int, **kwargs):
        super().__init__(**kwargs)
        self.gate_width = gate_width

    def get_attn_backend(self) -> type[AttentionBackend]:
        return IndexPoolStateBackend

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        return open_window_spec(self.head_size - self.gate_width, self.gate_width,
                                ring_capacity(self.compress_ratio, vllm_config.num_speculative_tokens), self.dtype)


class IndexPoolKVCache(nn.Module, AttentionLayerBase):
    """Owner of one IndexPool layer's paged main keys/values: `kv_cache [blocks, kv_heads, block_size, 2 * head_dim]`
    (key, then value, per slot). `huge_pages`: what the system granted when the cache was bound."""

    def __init__(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        self.num_kv_heads, self.head_dim, self.dtype, self.prefix = num_kv_heads, head_dim, dtype, prefix
        self.kv_cache = torch.tensor([])
        self.huge_pages: HugePageAdvice | None = None
        register_step_layer(vllm_config, prefix, self)

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """vLLM's binding, then the memory under the cache advised into transparent huge pages (on a CPU: vLLM's
        CPU worker fills its caches in 4 KiB pages, and the step reads each selected window in another one;
        `huge_pages.advise_huge_pages`, best effort). The advice covers the cache's whole storage, which vLLM shares
        between all layers: the first binding moves it into huge pages, the others find it there."""
        super().bind_kv_cache(kv_cache)
        self.huge_pages = advise_huge_pages(kv_cache)

    def get_attn_backend(self) -> type[AttentionBackend]:
        return IndexPoolAttentionBackend

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        return main_kv_spec(self.num_kv_heads, self.head_dim, vllm_config.cache_config.block_size, self.dtype)


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
        width, pooled_dtype = pooled_key_width(self.head_dim, config.index_key_cache_dtype)
        self.pooled_key_cache = PooledKeyCache(head_size=width, prefix=f"{prefix}.pooled_key_cache",
                                               **(common | dict(dtype=pooled_dtype or dtype)))

    def project(self, hidden_states: torch.Tensor, cos_sin: torch.Tensor):
        """`[tokens, hidden]` -> queries `[tokens, heads, head_dim]`, ring rows `[tokens, head_dim + gate_width]`
        (raw key, gate logits) and head weights `[tokens, heads]` float32 or None."""
        queries, _ = self.q_proj(hidden_states)
        queries = self.q_norm(queries.view(-1, self.num_heads, self.head_dim))
        queries = neox_rotary(queries, cos_sin)
        ring_rows, _ = self.k_proj(hidden_states)
        if self.gate_width:
            gate_logits, _ = self.pool_gate_proj(hidden_states)
            ring_rows = torch.cat([ring_rows, gate_logits], dim=-1)
        head_weights = None
        if self.head_weights_proj is not None:
            head_weights = self.head_weights_proj(hidden_states)[0].float() * self.num_heads**-0.5
        return queries, ring_rows, head_weights


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
        self.max_windows = -(-vllm_config.model_config.max_model_len // self.pool_size)  # the largest window bound
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim,
                                          config.num_attention_heads * (2 if self.output_gate else 1),
                                          config.num_key_value_heads, bias=config.attention_bias,
                                          prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size,
                                        bias=config.attention_bias, prefix=f"{prefix}.o_proj")
        self.q_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.rotary_emb = get_rope(head_size=self.head_dim, max_position=config.max_position_embeddings,
                                   rope_parameters=text_rope_parameters(config))
        self.indexer = IndexPoolIndexer(config, vllm_config, f"{prefix}.indexer")
        self.main_cache = IndexPoolKVCache(self.num_kv_heads, self.head_dim, vllm_config.model_config.dtype,
                                         vllm_config, f"{prefix}.attn")
        # The custom op finds the layer by name in the forward context, as vLLM's own attention ops do.
        self.prefix = prefix
        register_step_layer(vllm_config, prefix, self)

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
        query = self.q_norm(query.reshape(num_tokens, self.num_heads, self.head_dim))
        key = self.k_norm(key.reshape(num_tokens, self.num_kv_heads, self.head_dim))
        cos_sin = self.rotary_emb.cos_sin_cache.index_select(0, positions)
        query, key = neox_rotary(query, cos_sin), neox_rotary(key, cos_sin)
        value = value.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        index_queries, ring_rows, head_weights = self.indexer.project(hidden_states, cos_sin)

        output = torch.zeros_like(query)  # [tokens, heads, head_dim]
        torch.ops.vllm.hybrid_indexpool_attention(query, key, value, index_queries, ring_rows, head_weights, gate,
                                                  output, _encode_layer_name(self.prefix))
        return self.o_proj(output.reshape(num_tokens, -1))[0]

    def step_settings(self) -> IndexPoolStepSettings:
        indexer = self.indexer
        return IndexPoolStepSettings(
            pool_size=self.pool_size, topk_windows=self.topk_windows, sink_windows=self.sink_windows,
            local_windows=self.local_windows, scaling=self.scaling, weighting=indexer.weighting,
            key_norm_weight=indexer.k_norm.weight, key_norm_eps=indexer.k_norm.variance_epsilon,
            pool_slot_bias=indexer.pool_slot_bias if indexer.gate_width else None,
            cos_sin_cache=self.rotary_emb.cos_sin_cache)

    def attend(self, query, key, value, index_queries, ring_rows, head_weights, output_gate, main: IndexPoolMetadata,
               pooled: IndexPoolMetadata, ring: IndexPoolMetadata) -> torch.Tensor:
        """`indexpool_step` over this layer's caches: write the new keys/values and pooled keys, select each query's
        windows and attend to them and to its open window (gated). Shapes depend on the token count and the budget
        only; nothing is read from the device."""
        caches = PagedCaches(self.main_cache.kv_cache, self.indexer.pooled_key_cache.kv_cache,
                             self.indexer.open_window_cache.kv_cache)
        return indexpool_step(query, key, value, index_queries, ring_rows, head_weights, output_gate, caches, main,
                              pooled, ring, self.step_settings())


def hybrid_indexpool_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               index_queries: torch.Tensor, ring_rows: torch.Tensor, head_weights: torch.Tensor | None,
                               output_gate: torch.Tensor | None, output: torch.Tensor,
                               layer_name: LayerNameType) -> None:
    """The step of IndexPool layer `layer_name` (`IndexPoolAttention.attend`) into `output [tokens, heads, head_dim]`.
    A custom op, opaque to `torch.compile`: the compiled model must not keep one step's host values (token count,
    tiles, window bound), and vLLM splits its piecewise CUDA graphs here (`vllm_config.py`)."""
    forward_context = get_forward_context()
    layer = forward_context.no_compile_layers[_resolve_layer_name(layer_name)]
    metadata = forward_context.attn_metadata
    if isinstance(metadata, list):
        metadata = metadata[0]
    if not isinstance(metadata, dict):
        # vLLM's memory-profiling run (no caches yet): take the largest working memory of the path that will run
        # (Triton on CUDA), once, so that the profile counts it before the KV cache is sized.
        settings = layer.step_settings()
        triton_path = not paged_attention_reads_request_tiles(query.device)
        torch.empty(step_working_memory_bytes(query, key, index_queries, settings, layer.max_windows, triton_path),
                    dtype=torch.uint8, device=query.device)
        return
    main = metadata[layer.main_cache.prefix]
    tokens = main.num_actual_tokens
    def first(tensor):
        return None if tensor is None else tensor[:tokens]
    output[:tokens] = layer.attend(
        query[:tokens], key[:tokens], value[:tokens], index_queries[:tokens], ring_rows[:tokens], first(head_weights),
        first(output_gate), main, metadata[layer.indexer.pooled_key_cache.prefix],
        metadata[layer.indexer.open_window_cache.prefix])


def hybrid_indexpool_attention_fake(query, key, value, index_queries, ring_rows, head_weights, output_gate, output,
                                    layer_name) -> None:
    return None


direct_register_custom_op(op_name=ATTENTION_OP.removeprefix("vllm::"), op_func=hybrid_indexpool_attention,
                          mutates_args=["output"], fake_impl=hybrid_indexpool_attention_fake)
