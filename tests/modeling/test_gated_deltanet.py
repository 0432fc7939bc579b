"""Gated DeltaNet layer: chunked prefill equals recurrent decode, and equals transformers' Qwen3.5 layer."""

import pytest
import torch
from model_factory import tiny_config

from hybrid_indexpool.modeling.cache_hybrid_indexpool import LinearAttentionLayerCache
from hybrid_indexpool.modeling.linear_attention_gdn import HybridIndexPoolGatedDeltaNet

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def our_layer(seed=0):
    torch.manual_seed(seed)
    config = tiny_config(num_hidden_layers=1, layer_types=["linear_attention"])
    layer = HybridIndexPoolGatedDeltaNet(config, 0).eval()
    with torch.no_grad():
        layer.norm.weight.uniform_(0.5, 1.5)
        layer.dt_bias.uniform_(-1, 1)
    return config, layer


def test_chunked_prefill_equals_token_by_token_decode():
    config, layer = our_layer()
    hidden = torch.randn(2, 30, config.hidden_size)
    real = torch.ones(2, 30, dtype=torch.bool)
    with torch.no_grad():
        whole = layer(hidden, real)
        cache = LinearAttentionLayerCache()
        parts = [layer(hidden[:, :11], real[:, :11], cache)]
        for t in range(11, 30):
            parts.append(layer(hidden[:, t:t + 1], real[:, t:t + 1], cache))
    torch.testing.assert_close(torch.cat(parts, 1), whole, atol=1e-5, rtol=1e-4)
    assert cache.recurrent_states[0].dtype == torch.float32


def test_equals_transformers_qwen3_5_gated_deltanet_with_the_same_weights():
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    config, layer = our_layer(1)
    qwen_config = Qwen3_5TextConfig(
        hidden_size=config.hidden_size, linear_num_key_heads=config.linear_num_key_heads,
        linear_num_value_heads=config.linear_num_value_heads, linear_key_head_dim=config.linear_key_head_dim,
        linear_value_head_dim=config.linear_value_head_dim, linear_conv_kernel_dim=config.linear_conv_kernel_dim,
        num_hidden_layers=1, layer_types=["linear_attention"], rms_norm_eps=config.rms_norm_eps,
        vocab_size=config.vocab_size,
    )
    qwen = Qwen3_5GatedDeltaNet(qwen_config, 0).eval()
    assert set(qwen.state_dict()) == set(layer.state_dict())
    qwen.load_state_dict(layer.state_dict())
    hidden = torch.randn(2, 37, config.hidden_size)
    with torch.no_grad():
        ours = layer(hidden, torch.ones(2, 37, dtype=torch.bool))
        theirs = qwen(hidden)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)

    # Left padding: the padded row's real tokens match the row alone (Qwen masks padding the same way).
    mask = torch.ones(2, 37, dtype=torch.long)
    mask[1, :9] = 0
    with torch.no_grad():
        ours = layer(hidden, mask.bool())
        alone = layer(hidden[1:, 9:], torch.ones(1, 28, dtype=torch.bool))
        theirs = qwen(hidden, attention_mask=mask)
    torch.testing.assert_close(ours[1, 9:], alone[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(ours[:, 9:], theirs[:, 9:], atol=1e-5, rtol=1e-4)
