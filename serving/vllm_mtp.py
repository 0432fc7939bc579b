"""`HybridIndexPoolMTP`: the checkpoint's own multi-token-prediction (MTP) layers as vLLM's drafter
(`speculative_config={"method": "mtp", "num_speculative_tokens": k}`).

vLLM's MTP proposer feeds the drafter the target's final (normed) hidden state at each position `t` and the token at
`t + 1`, and reuses the drafter's output as the next depth's hidden state; one MTP layer drafts every depth (vLLM's
way, as its Qwen3-Next MTP: the first layer, also in a checkpoint with several). A layer is the transformers model's
[`HybridIndexPoolDeepSeekMTPLayer`]: normed embedding and normed hidden state, concatenated and projected, a decoder
block, a final norm; DeepSeek's kind (`mtp_type = "deepseek"`) zeroes the embedding at position 0, Qwen3-Next's keeps
it.

The block's attention here is dense gated attention over the layer's own keys and values (vLLM's attention layer, as
its Qwen3-Next MTP), not IndexPool attention: vLLM's proposer builds the attention metadata of all draft layers from
one KV-cache group, and an IndexPool layer's three caches are three groups. Within the token budget the two are the
same computation; beyond it a draft may differ from the transformers model's MTP draft. Drafts only change how many
tokens a verify step keeps (the target model verifies every one), never which tokens come out.
"""

from collections.abc import Iterable

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.model_executor.layers.layernorm import GemmaRMSNorm
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models.qwen3_next import Qwen3NextAttention, Qwen3NextMLP, Qwen3NextSparseMoeBlock

from .vllm_config import unsupported_options
from .vllm_model import load_named_weights

# MTP kinds the drafter builds: the transformers model's `mtp_type`s read without residual streams.
SERVED_MTP_TYPES = ("deepseek", "qwen3_next")


class GatedAttentionConfigView:
    """The config fields vLLM's Qwen3-Next attention reads, under its names."""

    def __init__(self, config):
        for name in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rope_parameters",
                     "max_position_embeddings", "rms_norm_eps"):
            setattr(self, name, getattr(config, name))
        self.attn_output_gate = config.attention_output_gate
        self.qkv_bias = config.attention_bias


class HybridIndexPoolMTPBlock(nn.Module):
    """The decoder block of an MTP layer: dense gated attention (q/k norm, partial RoPE, sigmoid output gate), then
    the last decoder layer's kind of feed-forward block (the mixture of experts where the model has experts), each a
    pre-norm residual block."""

    def __init__(self, config, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        self.self_attn = Qwen3NextAttention(GatedAttentionConfigView(config), vllm_config.model_config,
                                            vllm_config.cache_config, vllm_config.quant_config,
                                            prefix=f"{prefix}.self_attn")
        if config.num_experts > 0:
            self.mlp = Qwen3NextSparseMoeBlock(vllm_config, prefix=f"{prefix}.mlp")
        else:
            self.mlp = Qwen3NextMLP(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                                    hidden_act=config.hidden_act, prefix=f"{prefix}.mlp")
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        attended = self.self_attn(positions, self.input_layernorm(hidden_states))
        hidden_states, residual = self.post_attention_layernorm(attended, hidden_states)
        return self.mlp(hidden_states) + residual


class HybridIndexPoolMTPLayer(nn.Module):
    """One MTP layer: `output_norm(block(input_proj([embedding_norm(embedding), hidden_norm(hidden)])))`."""

    def __init__(self, config, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        self.zero_first_embedding = config.mtp_type == "deepseek"
        self.embedding_norm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.hidden_norm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.input_proj = ReplicatedLinear(2 * config.hidden_size, config.hidden_size, bias=False,
                                           prefix=f"{prefix}.input_proj")
        self.block = HybridIndexPoolMTPBlock(config, vllm_config, f"{prefix}.block")
        self.output_norm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        """`positions [tokens]`, `hidden_states` (the target's final hidden state, or the previous depth's output) and
        `embeddings` (of the next token) `[tokens, hidden]` -> the normed output `[tokens, hidden]`."""
        if self.zero_first_embedding:
            embeddings = embeddings.masked_fill((positions == 0).unsqueeze(-1), 0)
        projected, _ = self.input_proj(torch.cat([self.embedding_norm(embeddings), self.hidden_norm(hidden_states)],
                                                 dim=-1))
        return self.output_norm(self.block(positions, projected))


@support_torch_compile
class HybridIndexPoolMultiTokenPredictor(nn.Module):
    """The token embedding and the MTP layers (the first drafts every depth)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(HybridIndexPoolMTPLayer(config, vllm_config, f"{prefix}.layers.{depth}")
                                    for depth in range(config.num_mtp_layers))

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, hidden_states: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        embeddings = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        return self.layers[0](positions, hidden_states, embeddings)


def unsupported_mtp_options(config) -> list[str]:
    """Why vLLM cannot draft with this checkpoint's MTP layers (empty when it can)."""
    problems = list(unsupported_options(config))
    if config.num_mtp_layers == 0:
        problems.append("drafting with MTP layers the checkpoint does not have (num_mtp_layers = 0: train a head with "
                        "scripts/train_mtp.py, or draft with speculative method 'ngram')")
    if config.mtp_type not in SERVED_MTP_TYPES:
        problems.append(f"mtp_type = {config.mtp_type!r} (the vLLM drafter builds {', '.join(SERVED_MTP_TYPES)})")
    return problems


class HybridIndexPoolMTP(nn.Module):
    """vLLM's drafter for speculative method `mtp`: the MTP layers of a HybridIndexPool checkpoint and the target's
    language-model head (vLLM shares the target's head and embedding with an MTP drafter)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        problems = unsupported_mtp_options(config)
        if problems:
            raise ValueError("HybridIndexPool's vLLM drafter does not support: " + "; ".join(problems) + ".")
        self.config = config
        self.model = HybridIndexPoolMultiTokenPredictor(vllm_config=vllm_config, prefix="model.mtp")
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix="lm_head")
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, hidden_states: torch.Tensor,
                intermediate_tensors=None, inputs_embeds: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        return self.model(input_ids, positions, hidden_states, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor, spec_step_idx: int = 0) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The MTP layers (`model.mtp.layers.N.*` -> `model.layers.N.*`; their indexers, which the dense draft
        attention does not read, are skipped), the embedding and the head; the decoder's weights are the target's."""
        def drafter_weights():
            for name, tensor in weights:
                if name.startswith("model.mtp.") and ".self_attn.indexer." not in name:
                    yield name.replace("model.mtp.", "model.", 1), tensor
                elif name in ("model.embed_tokens.weight", "lm_head.weight"):
                    yield name, tensor

        return load_named_weights(self, drafter_weights())
