import torch

from hybrid_indexpool import HybridIndexPoolConfig, HybridIndexPoolForCausalLM
from hybrid_indexpool.modeling.layers import HybridIndexPoolRMSNorm


def test_the_rms_norm_scales_by_one_plus_its_weight_or_by_its_weight():
    torch.manual_seed(0)
    hidden = torch.randn(3, 8)
    weight = torch.randn(8)
    normed = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + 1e-6)
    zero_centred, plain = HybridIndexPoolRMSNorm(8), HybridIndexPoolRMSNorm(8, unit_offset=False)
    with torch.no_grad():
        zero_centred.weight.copy_(weight)
        plain.weight.copy_(weight)
    torch.testing.assert_close(zero_centred(hidden), normed * (1 + weight), rtol=0, atol=0)
    torch.testing.assert_close(plain(hidden), normed * weight, rtol=0, atol=0)


def test_a_fresh_model_starts_every_rms_norm_at_scale_one_in_either_convention():
    for unit_offset in (True, False):
        config = HybridIndexPoolConfig(vocab_size=32, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                       layer_types=["linear_attention", "indexpool_attention"], num_attention_heads=2,
                                       num_key_value_heads=1, head_dim=16, index_n_heads=2, index_head_dim=16,
                                       linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8,
                                       linear_value_head_dim=8, rms_norm_unit_offset=unit_offset)
        norms = [module for module in HybridIndexPoolForCausalLM(config).modules()
                 if isinstance(module, HybridIndexPoolRMSNorm)]
        assert norms and all(norm.unit_offset == unit_offset for norm in norms)
        assert all(torch.equal(norm.weight, torch.full_like(norm.weight, 0.0 if unit_offset else 1.0))
                   for norm in norms)
