"""Qwen4-Exp's per-layer n-gram embeddings (PLE, `ple_layers`) in the vLLM model, built from vLLM's parts.

vLLM's own Qwen4-Exp PLE layer is GPU-only (Triton lookups, pinned host tables, its n-gram context from Model Runner
V2, which needs Triton), so this layer assembles vLLM's pieces instead: its vocab-parallel embedding for the hashed
n-gram table, replicated linear layers, its Qwen4-Exp grouped RMSNorm, and its mamba state cache (the short
convolution's backend and metadata) for what a request carries from one step to the next:

- the last `ple_ngram_size - 1` token ids (int32), the n-gram context of the next step's first tokens;
- the dilated causal convolution's last `(ple_conv_kernel_size - 1) * ple_ngram_size` inputs, `[hc * hidden, len]`.

A new request (no initial state) starts from the end-of-sequence context and a zero convolution state, as our
transformers model does at the start of a sequence. The n-gram hashing is the transformers model's
(`modeling/ngram_hash.py`), so both look up the same rows. The states are whole on every rank under tensor
parallelism. The step is a custom op (`hybrid_indexpool_ple`) that reads the host's view of the step (prefill
lengths): a CPU path, not one for CUDA graphs; speculative decoding is refused at engine start.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.models.qwen4_exp.common.hyperconnection import GroupedGemmaRMSNorm
from vllm.utils.torch_utils import LayerNameType, _encode_layer_name, direct_register_custom_op
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from ..modeling.ngram_hash import hash_multipliers, head_table_sizes, shifted_in_segment
from .step_layers import register_step_layer, step_layer_and_metadata
from .vllm_config import PLE_OP


def ple_state_shapes(config) -> tuple[tuple[int], tuple[int, int]]:
    """The per-request states of one PLE layer: the n-gram context `[ngram - 1]` and the convolution's inputs
    `[hc * hidden, (kernel - 1) * ngram]`."""
    return ((config.ple_ngram_size - 1,),
            (config.hc_count * config.hidden_size, (config.ple_conv_kernel_size - 1) * config.ple_ngram_size))


def ple_state_dtypes(model_dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    """Token ids exactly (int32; the context comes first in the page, so both views stay aligned), convolution
    inputs in the model's dtype."""
    return torch.int32, model_dtype


class NGramTable(nn.Module):
    """The hashed n-gram embedding table of one PLE layer (`ple_embedding.ngram_embedding`, vLLM's vocab-parallel
    embedding) and the hashing of the transformers model: for each n-gram order 2..`ngram`, `heads_per_ngram` heads
    look the token's n-gram up in their own prime-sized part of the table."""

    def __init__(self, config, ple_index: int, prefix: str):
        super().__init__()
        self.ngram_size = config.ple_ngram_size
        self.heads_per_ngram = config.ple_heads_per_ngram
        num_heads = (self.ngram_size - 1) * self.heads_per_ngram
        self.eos_token_id = config.ple_eos_token_id
        self.multipliers = hash_multipliers(config.vocab_size, self.ngram_size, ple_index, config.ple_hash_seed)
        sizes = head_table_sizes(config.ple_ngram_vocab_size_base, ple_index * num_heads, num_heads)
        self.register_buffer("head_table_sizes", torch.tensor(sizes), persistent=False)
        self.register_buffer("head_table_offsets", torch.tensor([sum(sizes[:head]) for head in range(num_heads)]),
                             persistent=False)
        num_rows = -(-sum(sizes) // config.ple_vocab_size_multiple) * config.ple_vocab_size_multiple
        self.ngram_embedding = VocabParallelEmbedding(num_rows, config.ple_embed_dim // num_heads,
                                                      prefix=f"{prefix}.ngram_embedding")

    def rows(self, history: torch.Tensor) -> torch.Tensor:
        """`history [requests, ngram - 1 + seq]` (context, then tokens) -> table rows `[requests, seq, heads]`."""
        shifted = [shifted_in_segment(history, shift, self.eos_token_id) for shift in range(self.ngram_size)]
        rows = []
        for order in range(2, self.ngram_size + 1):
            mixed = shifted[0] * self.multipliers[0]
            for position in range(1, order):
                mixed = mixed ^ (shifted[position] * self.multipliers[position])
            heads = slice((order - 2) * self.heads_per_ngram, (order - 1) * self.heads_per_ngram)
            rows.append(torch.remainder(mixed[..., None], self.head_table_sizes[heads])
                        + self.head_table_offsets[heads])
        return torch.cat(rows, dim=-1)[:, self.ngram_size - 1:]


class PerLayerEmbedding(nn.Module, MambaBase):
    """One PLE layer: adds hashed n-gram features of the tokens to every residual stream
    (`[tokens, hc * hidden]`): each stream's normed state gates the n-gram value through a signed-square-root dot
    product with its key, and a dilated causal depthwise convolution of the normed gated values adds local context.
    Weight names follow the checkpoint (`ple_embedding.ngram_embedding`, `key_proj`, `value_proj`, `norm_key`,
    `norm_query`, `norm_conv`, `conv1d`)."""

    def __init__(self, config, vllm_config: VllmConfig, ple_index: int, prefix: str):
        super().__init__()
        self.prefix = prefix
        self.model_config = vllm_config.model_config
        self.hidden_size, self.hc_count = config.hidden_size, config.hc_count
        streams_width = self.hc_count * self.hidden_size
        dtype = vllm_config.model_config.dtype
        self.state_shapes, self.state_dtypes = ple_state_shapes(config), ple_state_dtypes(dtype)
        self.ple_embedding = NGramTable(config, ple_index, prefix=f"{prefix}.ple_embedding")
        self.key_proj = ReplicatedLinear(config.ple_embed_dim, streams_width, bias=False, prefix=f"{prefix}.key_proj")
        self.value_proj = ReplicatedLinear(config.ple_embed_dim, self.hidden_size, bias=False,
                                           prefix=f"{prefix}.value_proj")
        norm = dict(eps=config.rms_norm_eps, group_size=self.hidden_size, dtype=dtype)
        self.norm_key = GroupedGemmaRMSNorm(streams_width, **norm)
        self.norm_query = GroupedGemmaRMSNorm(streams_width, **norm)
        self.norm_conv = GroupedGemmaRMSNorm(streams_width, **norm)
        self.conv_dilation = config.ple_ngram_size
        self.conv1d = nn.Conv1d(streams_width, streams_width, config.ple_conv_kernel_size, groups=streams_width,
                                dilation=self.conv_dilation, bias=False)  # the weight's holder; applied by `run`
        self.kv_cache = (torch.tensor([]), torch.tensor([]))
        register_step_layer(vllm_config, prefix, self)

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.SHORT_CONV  # vLLM's short-convolution metadata: state slots per request

    @property
    def is_kv_cache_tp_replicated(self) -> bool:
        return True

    def get_state_shape(self):
        return self.state_shapes

    def get_state_dtype(self) -> tuple[torch.dtype, ...]:
        return self.state_dtypes

    def forward(self, streams: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """`streams [tokens, hc * hidden]`, `token_ids [tokens]` -> what the layer adds to the streams."""
        output = torch.empty_like(streams)
        torch.ops.vllm.hybrid_indexpool_ple(streams, token_ids, output, _encode_layer_name(self.prefix))
        return output

    def run(self, streams: torch.Tensor, token_ids: torch.Tensor, metadata) -> torch.Tensor:
        """One step's tokens (decodes first, then prefill chunks, as vLLM orders them), against the requests'
        states, which it advances."""
        contexts, conv_states = self.kv_cache  # [slots, ngram - 1], [slots, channels, length]
        spans = self.request_spans(metadata)
        for slot, start, end, has_initial_state in spans:
            if not has_initial_state:
                contexts[slot] = self.ple_embedding.eos_token_id
                conv_states[slot] = 0
        embeddings = self.ple_embedding.ngram_embedding(self.ngram_rows(token_ids, spans, contexts)).flatten(-2)
        keys = self.norm_key(self.key_proj(embeddings)[0]).unflatten(-1, (self.hc_count, self.hidden_size))
        queries = self.norm_query(streams).unflatten(-1, (self.hc_count, self.hidden_size))
        gate = (keys * queries).sum(dim=-1, keepdim=True) / math.sqrt(self.hidden_size)  # [tokens, hc, 1]
        gate = gate.sign() * gate.abs().clamp(min=1e-6).sqrt()
        gated_values = (torch.sigmoid(gate) * self.value_proj(embeddings)[0].unsqueeze(-2)).flatten(-2)
        convolved = self.convolve(self.norm_conv(gated_values), spans, conv_states)
        return gated_values + F.silu(convolved)

    @staticmethod
    def request_spans(metadata) -> list[tuple[int, int, int, bool]]:
        """`(state slot, first token, end token, has initial state)` of each request of the step."""
        decode_slots = metadata.state_indices_tensor_d[:, 0].tolist() if metadata.num_decodes else []
        spans = [(slot, index, index + 1, True) for index, slot in enumerate(decode_slots)]
        if metadata.num_prefills:
            starts = (metadata.query_start_loc_p + metadata.num_decode_tokens).tolist()
            slots = metadata.state_indices_tensor_p.tolist()
            initial = metadata.has_initial_states_p.tolist()
            spans += [(slot, starts[index], starts[index + 1], initial[index]) for index, slot in enumerate(slots)]
        return spans

    def ngram_rows(self, token_ids, spans, contexts) -> torch.Tensor:
        """Each token's n-gram table rows `[tokens, heads]`; the requests' contexts advanced to their last tokens."""
        rows = []
        for slot, start, end, _ in spans:
            history = torch.cat([contexts[slot].long(), token_ids[start:end].long()])[None]
            rows.append(self.ple_embedding.rows(history)[0])
            contexts[slot] = history[0, -contexts.shape[-1]:].to(contexts.dtype)
        return torch.cat(rows)

    def convolve(self, normed: torch.Tensor, spans, conv_states) -> torch.Tensor:
        """The dilated causal convolution of `normed [tokens, channels]`, each request continuing from its state."""
        outputs = []
        for slot, start, end, _ in spans:
            conv_input = torch.cat([conv_states[slot], normed[start:end].T], dim=-1)  # [channels, length + seq]
            outputs.append(F.conv1d(conv_input[None], self.conv1d.weight, dilation=self.conv_dilation,
                                    groups=conv_input.shape[0])[0].T)
            conv_states[slot] = conv_input[:, conv_input.shape[-1] - conv_states.shape[-1]:]
        return torch.cat(outputs)


def hybrid_indexpool_ple(streams: torch.Tensor, token_ids: torch.Tensor, output: torch.Tensor,
                         layer_name: LayerNameType) -> None:
    """PLE layer `layer_name`'s addition to the streams, into `output [tokens, hc * hidden]`."""
    layer, metadata = step_layer_and_metadata(layer_name)
    output.zero_()
    if metadata is None:  # vLLM's memory-profiling run: no caches yet
        return
    tokens = metadata.num_decode_tokens + metadata.num_prefill_tokens
    if tokens:
        output[:tokens] = layer.run(streams[:tokens], token_ids[:tokens], metadata)


def hybrid_indexpool_ple_fake(streams, token_ids, output, layer_name) -> None:
    return None


direct_register_custom_op(op_name=PLE_OP.removeprefix("vllm::"), op_func=hybrid_indexpool_ple,
                          mutates_args=["output"], fake_impl=hybrid_indexpool_ple_fake)
