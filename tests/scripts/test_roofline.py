import json

import pytest

from hybrid_indexpool.scripts import roofline

SMALL = roofline.DecodeWidths(
    index_layers=1, linear_layers=3, kv_heads=2, head_dim=8, index_head_dim=16, index_topk=32, linear_key_heads=2,
    linear_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, conv_kernel=4, shared_parameters=1000,
    expert_parameters=10, moe_layers=4, num_experts=8, experts_per_token=2, embedding_row_parameters=16)


def test_byte_counts_of_a_small_config_by_hand():
    fp8 = roofline.Variant("fp8", 4, 16 + 4)
    parts = roofline.step_bytes(SMALL, fp8, context=1000, batch=1)
    # bf16 weights: shared, 2 experts in each of 4 layers, one embedding row.
    assert parts["weights"] == (1000 + 2 * 10 * 4 + 16) * 2
    # 32 budget tokens + 3 tail tokens, keys and values, 2 heads of 8, bf16, in the one indexed layer.
    assert parts["key_value"] == 35 * 2 * 2 * 8 * 2
    assert parts["index_keys"] == 250 * 20  # 1000 // 4 windows of 20 bytes
    # 3 linear layers, read and written: recurrent 4 x 8 x 8 and conv (2 * 16 + 32) x 3, float32.
    assert parts["linear_states"] == 3 * 2 * (4 * 8 * 8 + 64 * 3) * 4
    assert parts["total"] == 2192 + 2240 + 5000 + 10752
    # A batch of 2 reads each cache twice, the shared weights once, 8 (1 - (6/8)^2) = 3.5 experts per layer.
    two = roofline.step_bytes(SMALL, fp8, context=1000, batch=2)
    assert two["weights"] == pytest.approx((1000 + 3.5 * 10 * 4 + 2 * 16) * 2)
    assert (two["key_value"], two["index_keys"], two["linear_states"]) == (4480, 10000, 21504)
    # Short context: attended tokens are capped by the context; r = 1 keeps no tail.
    unpooled = roofline.Variant("r1", 1, 32)
    assert roofline.step_bytes(SMALL, unpooled, context=20, batch=1)["key_value"] == 20 * 2 * 2 * 8 * 2
    assert roofline.step_bytes(SMALL, unpooled, context=100, batch=1)["index_keys"] == 100 * 32
    held = roofline.cache_bytes_held(SMALL, fp8, context=1000, batch=1)
    assert held == 1000 * 2 * 2 * 8 * 2 + 250 * 20 + 3 * (4 * 8 * 8 + 64 * 3) * 4


def test_widths_count_every_parameter_of_a_tiny_qwen4_exp_once():
    from transformers import Qwen4ExpTextConfig
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpForCausalLM

    config = Qwen4ExpTextConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, shared_expert_intermediate_size=8,
        hc_count=2, hc_lowrank=4, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
        indexer_compress_ratio=4)
    widths = roofline.widths_from_config(config)
    total = sum(p.numel() for p in Qwen4ExpForCausalLM(config).parameters())
    assert (widths.shared_parameters + widths.expert_parameters * 4 * 4 + widths.embedding_row_parameters * 100
            == total)
    assert widths.expert_parameters == 3 * 32 * 8  # gate, up and down projections of one expert
    assert (widths.index_layers, widths.linear_layers, widths.embedding_row_parameters) == (1, 3, 32)


def test_flash_next_ratios():
    widths = roofline.widths_from_config(roofline.flash_next_config())
    assert (widths.index_layers, widths.linear_layers) == (12, 36)
    rows = {(row["context"], row["batch"], row["variant"]): row for row in roofline.roofline(widths)}
    unpooled, bf16, fp8 = (variant.name for variant in roofline.variants(widths.index_head_dim))
    for batch in roofline.BATCHES:
        for context in (1 << 20, 1 << 21):
            times = [rows[(context, batch, name)]["H100_ms"] for name in (fp8, bf16, unpooled)]
            assert times == sorted(times) and times[0] < times[-1]
        # The pooled share of the unpooled time falls as the context grows.
        shares = [rows[(context, batch, bf16)]["over_unpooled"] for context in roofline.CONTEXTS]
        assert shares == sorted(shares, reverse=True)
    # Short context, one sequence: the weights are nearly all of it.
    assert rows[(131072, 1, unpooled)]["weights_fraction"] > 0.9
    # The GPUs differ by their bandwidth only.
    row = rows[(1 << 20, 8, fp8)]
    assert row["H100_ms"] / row["H200_ms"] == pytest.approx(4.8 / 3.35)


def test_main_prints_a_table_and_writes_json(tmp_path, capsys):
    report = roofline.main(["--contexts", "131072", "--batches", "1,8", "--json", str(tmp_path / "r.json")])
    printed = capsys.readouterr().out
    assert "| 128K | 8 | pooled r=4 fp8 |" in printed and "H200 ms" in printed
    assert len(report["rows"]) == 2 * 3
    assert json.loads((tmp_path / "r.json").read_text())["widths"]["index_layers"] == 12


def test_help_and_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        roofline.parse_arguments(["--help"])
    assert "HBM" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        roofline.parse_arguments(["--batches", "0"])


def test_glm_widths_count_every_parameter_of_a_tiny_glm5_next_once():
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextModel

    config = Glm5NextTextConfig(
        vocab_size=100, hidden_size=32, intermediate_size=48, moe_intermediate_size=8, num_hidden_layers=8,
        num_attention_heads=2, num_key_value_heads=2, q_lora_rank=16, kv_lora_rank=24, qk_nope_head_dim=8,
        v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, index_n_heads=2, index_head_dim=16, index_topk=32,
        linear_num_heads=2, linear_head_dim=8, hc_mult=2, pad_token_id=0)
    widths = roofline.glm_widths_from_config(config)
    total = sum(p.numel() for p in Glm5NextTextModel(config).parameters()) + 100 * 32  # and the LM head
    # 8 layers: the first 3 MLPs dense, 5 MoE layers of 4 experts.
    assert widths.moe_layers == 5
    assert (widths.shared_parameters + widths.expert_parameters * 4 * 5 + widths.embedding_row_parameters * 100
            == total)
    assert widths.expert_parameters == 3 * 32 * 8
    # Every 4th layer MLA: one latent of 24 per token, read once as key and value.
    assert (widths.index_layers, widths.linear_layers, widths.kv_heads, widths.head_dim) == (2, 6, 1, 24)
    assert widths.key_value_tensors == 1


def test_glm_flash_reads_latents_once_and_pooled_keys_of_16_tokens():
    widths = roofline.glm_widths_from_config(roofline.glm_flash_config())
    assert (widths.index_layers, widths.linear_layers, widths.head_dim, widths.index_head_dim) == (11, 34, 512, 128)
    unpooled, bf16, fp8 = roofline.variants(widths.index_head_dim, 16)
    assert (bf16.name, bf16.pool_size, fp8.index_key_bytes) == ("pooled r=16 bf16", 16, 132)
    context = 1 << 20
    parts = roofline.step_bytes(widths, bf16, context, batch=1)
    assert parts["key_value"] == 11 * (2048 + 15) * 512 * 2  # the selected windows and the open tail, bf16 latents
    assert parts["index_keys"] * 16 == roofline.step_bytes(widths, unpooled, context, batch=1)["index_keys"]
    # 34 KDA layers, 64 heads of 128: float32 states read and written.
    assert parts["linear_states"] == 34 * 2 * (64 * 128 * 128 + 3 * 64 * 128 * 3) * 4


def test_main_glm_flash_preset(capsys):
    report = roofline.main(["--preset", "glm-flash", "--contexts", "1048576", "--batches", "1"])
    assert "| 1,024K | 1 | pooled r=16 fp8 |" in capsys.readouterr().out
    assert report["preset"] == "glm-flash" and report["widths"]["index_layers"] == 11
