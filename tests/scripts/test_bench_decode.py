import json

import pytest

from hybrid_indexpool.scripts import bench_decode

pytestmark = pytest.mark.filterwarnings("ignore")


def test_quick_mode_runs_every_setting_and_writes_table_json_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib (in the dev extra)")
    report = bench_decode.main([
        "--quick", "--contexts", "300,600", "--topk", "32", "--hidden-size", "64", "--intermediate-size", "64",
        "--json", str(tmp_path / "bench.json"), "--plot", str(tmp_path / "bench.png"),
    ])
    printed = capsys.readouterr().out
    assert "memory bandwidth (copy)" in printed and "indexer % bw" in printed and "reserved MiB" in printed
    assert "roofline ms" in printed
    rows = {(row["setting"], row["context"]): row for row in report["results"]}
    assert set(rows) == {(setting, context) for setting in bench_decode.SETTINGS for context in (300, 600)}
    for context in (300, 600):
        pooled = rows[("pooled_r4", context)]["cache_bytes"]
        unpooled = rows[("unpooled_r1", context)]["cache_bytes"]
        qwen = rows[("qwen4_exp", context)]["cache_bytes"]
        # Same tokens and widths: the pooled indexer cache is a quarter of the per-token ones (complete windows).
        key_bytes = 32 * 4
        assert unpooled["pooled_index_keys"] == qwen["index_keys"] == pooled["unpooled_index_keys"]
        assert 0 <= unpooled["pooled_index_keys"] - 4 * pooled["pooled_index_keys"] < 4 * key_bytes
        assert pooled["key_value"] == unpooled["key_value"] == qwen["key_value"]
        assert rows[("pooled_r4", context)]["decode_ms"] > 0 and rows[("pooled_r4", context)]["indexer_ms"] > 0
    assert json.loads((tmp_path / "bench.json").read_text())["results"] == report["results"]
    assert (tmp_path / "bench.png").stat().st_size > 0


def test_synthetic_cache_has_the_bytes_of_a_real_prefill():
    args = bench_decode.parse_arguments(["--quick", "--topk", "32", "--hidden-size", "64", "--intermediate-size", "64",
                                         "--new-tokens", "2", "--repeats", "1"])
    real = bench_decode.measure("pooled_r4", 1003, args)
    args.synthetic_from = 1000
    synthetic = bench_decode.measure("pooled_r4", 1003, args)
    assert real["prefill_s"] > 0 and synthetic["prefill_s"] is None
    for component in ("key_value", "pooled_index_keys", "open_window", "conv_state", "recurrent_state", "reserved"):
        assert synthetic["cache_bytes"][component] == real["cache_bytes"][component], component
    assert synthetic["decode_ms"] > 0 and synthetic["indexer_bytes"] == real["indexer_bytes"]


def test_compiled_decode_is_timed_and_counted_beside_eager():
    args = bench_decode.parse_arguments(["--quick", "--topk", "32", "--hidden-size", "64", "--intermediate-size", "64",
                                         "--new-tokens", "2", "--compile", "--compile-backend", "aot_eager",
                                         "--compile-frozen"])
    row = bench_decode.measure("pooled_r4", 300, args)
    assert row["compiled_decode_ms"] > 0 and row["compile_s"] > 0
    assert row["frozen_decode_ms"] > 0 and row["frozen_compile_s"] > 0
    assert row["aten_calls"] > 100 and row["compiled_aten_calls"] > 0
    # Reserved once for the prompt and every decoded token: within a chunk of what is in use.
    assert row["cache_bytes"]["reserved"] <= 1.10 * row["cache_bytes"]["total"]


def test_flash_next_preset_sets_the_real_widths_and_explicit_options_win():
    args = bench_decode.parse_arguments(["--preset", "flash-next", "--topk", "64"])
    assert (args.hidden_size, args.heads, args.kv_heads, args.head_dim) == (2048, 16, 2, 256)
    assert (args.linear_key_heads, args.linear_value_heads, args.linear_head_dim) == (16, 32, 128)
    assert (args.index_heads, args.index_head_dim, args.topk) == (4, 128, 64)
    assert (args.partial_rotary_factor, args.rope_theta) == (0.25, 1e7)


def test_flash_next_reference_config_passes_validation_with_the_same_partial_rope():
    args = bench_decode.parse_arguments(["--preset", "flash-next"])
    ours, reference = bench_decode.model_config("pooled_r4", args), bench_decode.model_config("qwen4_exp", args)
    assert ours.rope_parameters == reference.rope_parameters == {
        "rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}
    assert ours.rotary_dim == 64 <= reference.indexer_head_dim


def test_roofline_counts_weights_selected_keys_values_pooled_keys_and_states():
    import torch

    from hybrid_indexpool import HybridIndexPoolCache

    args = bench_decode.parse_arguments(["--topk", "32", "--hidden-size", "64", "--intermediate-size", "64"])
    model = bench_decode.build_model("pooled_r4", args)
    cache = HybridIndexPoolCache(model.config)
    with torch.no_grad():
        model(torch.randint(1, 1000, (1, 200)), cache=cache)
    config, element = model.config, 4
    weights = sum(p.numel() for name, p in model.named_parameters() if "embed_tokens" not in name) * element
    states = 2 * sum(t.numel() * element for layer in cache.layers if hasattr(layer, "recurrent_states")
                     for t in (layer.recurrent_states[0], layer.conv_states[0]))
    attended = 2 * (32 + 3) * config.num_key_value_heads * config.head_dim * element
    pooled = 50 * config.index_head_dim * element
    embedding_row = config.hidden_size * element
    assert bench_decode.roofline_bytes(model, cache, 200) == weights + embedding_row + states + attended + pooled


def test_fp8_index_keys_run_beside_the_model_dtype(capsys):
    report = bench_decode.main(["--quick", "--contexts", "600", "--settings", "pooled_r4,qwen4_exp", "--topk", "32",
                                "--hidden-size", "64", "--intermediate-size", "64", "--new-tokens", "2",
                                "--index-key-dtypes", "auto,float8_e4m3fn"])
    rows = {(row["setting"], row["index_key_dtype"]): row for row in report["results"]}
    # Qwen4-Exp has no such option: it runs once.
    assert set(rows) == {("pooled_r4", "auto"), ("pooled_r4", "float8_e4m3fn"), ("qwen4_exp", "auto")}
    auto, fp8 = rows[("pooled_r4", "auto")], rows[("pooled_r4", "float8_e4m3fn")]
    head_dim = 32
    # The windows the prompt and the decoded tokens completed (the same for both); float32 model: 4 bytes per
    # element, packed fp8: a byte per element and a 4-byte scale per window.
    windows, rest = divmod(auto["cache_bytes"]["pooled_index_keys"], head_dim * 4)
    assert rest == 0 and windows >= 600 // 4
    assert fp8["cache_bytes"]["pooled_index_keys"] == windows * (head_dim + 4)
    assert auto["cache_bytes"]["key_value"] == fp8["cache_bytes"]["key_value"]
    # The roofline reads every pooled key as stored, everything else is the same.
    assert auto["roofline_bytes"] - fp8["roofline_bytes"] == (600 // 4) * (head_dim * 4 - (head_dim + 4))
    assert fp8["indexer_bytes"] * head_dim * 4 == auto["indexer_bytes"] * (head_dim + 4)
    assert fp8["decode_ms"] > 0 and fp8["indexer_ms"] > 0
    printed = capsys.readouterr().out
    assert "index keys" in printed and " fp8" in printed and "model dtype" in printed


def test_synthetic_fp8_cache_has_the_bytes_of_a_real_prefill():
    args = bench_decode.parse_arguments(["--quick", "--topk", "32", "--hidden-size", "64", "--intermediate-size", "64",
                                         "--new-tokens", "2", "--repeats", "1"])
    real = bench_decode.measure("pooled_r4", 1003, args, "float8_e4m3fn")
    args.synthetic_from = 1000
    synthetic = bench_decode.measure("pooled_r4", 1003, args, "float8_e4m3fn")
    assert synthetic["prefill_s"] is None
    for component in ("key_value", "pooled_index_keys", "reserved"):
        assert synthetic["cache_bytes"][component] == real["cache_bytes"][component], component
    assert synthetic["indexer_bytes"] == real["indexer_bytes"] and synthetic["decode_ms"] > 0


@pytest.mark.parametrize("arguments, message", [
    (["--contexts", "abc"], "error: --contexts 'abc': give prompt lengths in tokens, positive whole numbers "
                            "separated by commas (e.g. 8192,131072).\n"),
    (["--contexts", "2048,0"], "error: --contexts '2048,0': give prompt lengths"),
    (["--contexts", "1.5k"], "error: --contexts '1.5k': give prompt lengths"),
    (["--new-tokens", "0"], "error: --new-tokens is 0; give a positive number.\n"),
])
def test_a_context_or_count_that_is_not_a_positive_number_is_one_error_line(capsys, arguments, message):
    with pytest.raises(SystemExit) as stop:
        bench_decode.main(arguments)
    printed = capsys.readouterr().err
    assert stop.value.code == 2 and message in printed and "Traceback" not in printed


def test_unknown_index_key_dtype_is_refused(capsys):
    with pytest.raises(SystemExit):
        bench_decode.parse_arguments(["--index-key-dtypes", "auto,int4"])
    assert "int4" in capsys.readouterr().err


# glm-flash's layer kinds at tiny widths (explicit options win over the preset's): 2 layers (KDA + MLA), r = 16,
# budget 32 tokens (2 windows); 317 prompt tokens + 3 decoded = 320, a multiple of 16.
TINY_GLM = ["--preset", "glm-flash", "--layers", "2", "--hidden-size", "64", "--intermediate-size", "64",
            "--heads", "4", "--q-lora-rank", "32", "--kv-lora-rank", "24", "--qk-nope-head-dim", "16",
            "--v-head-dim", "16", "--index-heads", "4", "--index-head-dim", "16", "--topk", "32",
            "--linear-key-heads", "2", "--linear-value-heads", "2", "--linear-head-dim", "16", "--vocab-size", "256",
            "--new-tokens", "2", "--repeats", "1"]


def test_glm_flash_preset_builds_glm_5_3_flash_layers_for_ours_and_transformers():
    args = bench_decode.parse_arguments(["--preset", "glm-flash"])
    assert args.settings.split(",") == list(bench_decode.GLM_SETTINGS)
    pooled = bench_decode.model_config("pooled_r16", args)
    assert (pooled.hidden_size, pooled.num_hidden_layers, pooled.num_attention_heads) == (4096, 4, 64)
    assert (pooled.attention_type, pooled.q_lora_rank, pooled.kv_lora_rank) == ("mla", 1536, 512)
    assert (pooled.qk_nope_head_dim, pooled.qk_rope_head_dim, pooled.v_head_dim) == (256, 0, 256)
    assert (pooled.linear_attention_type, pooled.linear_num_key_heads, pooled.linear_num_value_heads) == (
        "kimi_delta", 64, 64)
    linear_widths = (pooled.linear_key_head_dim, pooled.linear_value_head_dim, pooled.linear_gate_lower_bound)
    assert linear_widths == (128, 128, -5.0)
    index_widths = (pooled.index_n_heads, pooled.index_head_dim, pooled.index_pool_size, pooled.index_topk)
    assert index_widths == (32, 128, 16, 2048)
    assert (pooled.index_query_source, pooled.index_key_norm, pooled.index_rope) == (
        "q_lora", "layer_norm_before_pool", False)
    assert pooled.index_head_weights and pooled.index_pool_weighting == "learned"
    assert pooled.layer_types == ["linear_attention"] * 3 + ["indexpool_attention"]
    unpooled, dense = (bench_decode.model_config(setting, args) for setting in ("unpooled_r1", "dense"))
    assert (unpooled.index_pool_size, unpooled.index_topk) == (1, 2048)
    assert (dense.index_pool_size, dense.index_topk) == (16, bench_decode.DENSE_BUDGET)
    theirs = bench_decode.model_config("glm5_next", args).text_config
    assert (theirs.hidden_size, theirs.num_attention_heads, theirs.q_lora_rank, theirs.kv_lora_rank) == (
        4096, 64, 1536, 512)
    assert (theirs.qk_nope_head_dim, theirs.qk_rope_head_dim, theirs.v_head_dim) == (256, 0, 256)
    assert (theirs.index_n_heads, theirs.index_head_dim, theirs.index_kpool, theirs.index_topk) == (32, 128, 16, 2048)
    assert (theirs.linear_num_heads, theirs.linear_head_dim) == (64, 128)
    assert theirs.layer_types == ["linear_attention"] * 3 + ["indexed_attention"]


def test_references_go_with_their_presets(capsys):
    with pytest.raises(SystemExit):
        bench_decode.parse_arguments(["--preset", "glm-flash", "--settings", "pooled_r16,qwen4_exp"])
    with pytest.raises(SystemExit):
        bench_decode.parse_arguments(["--settings", "pooled_r4,glm5_next"])
    assert "glm5_next does not have the tiny preset's layers" in capsys.readouterr().err


def test_glm_flash_against_transformers_reports_per_token_cache_bytes(capsys):
    report = bench_decode.main(TINY_GLM + ["--contexts", "317"])
    rows = {row["setting"]: row for row in report["results"]}
    assert set(rows) == set(bench_decode.GLM_SETTINGS)
    theirs = rows["glm5_next"]
    # Every token's packed indexer state: a key of 16, a gate of 16 and a validity flag, float32.
    assert theirs["context_cache_bytes"]["index_keys"] == 317 * (2 * 16 + 1) * 4
    assert theirs["per_token"]["index_bytes"] == (2 * 16 + 1) * 4
    unpooled = rows["unpooled_r1"]["cache_bytes"]["pooled_index_keys"]
    pooled = rows["pooled_r16"]["cache_bytes"]["pooled_index_keys"]
    assert unpooled == 320 * 16 * 4 and pooled * 16 == unpooled  # after the 3 decoded tokens: 20 complete windows
    for setting in ("pooled_r16", "unpooled_r1", "dense"):
        numbers = rows[setting]["per_token"]
        assert numbers["index_bytes"] < theirs["per_token"]["index_bytes"]
        # MLA caches one latent of 24 per token, as transformers' does.
        assert numbers["key_value_bytes"] == theirs["per_token"]["key_value_bytes"] == 24 * 4
        assert numbers["prefill_ms"] > 0 and rows[setting]["decode_ms"] > 0
    assert theirs["per_token"]["prefill_ms"] > 0 and theirs["decode_ms"] > 0
    printed = capsys.readouterr().out
    assert "per prompt token" in printed and "x ref" in printed and "glm5_next" in printed


def test_pooled_index_bytes_per_token_are_a_sixteenth_of_unpooled_after_the_prompt():
    args = bench_decode.parse_arguments(TINY_GLM)
    pooled, unpooled = (bench_decode.measure(setting, 320, args) for setting in ("pooled_r16", "unpooled_r1"))
    # 320 prompt tokens: 20 complete windows and no open one.
    assert pooled["context_cache_bytes"]["open_window"] == 0
    assert pooled["per_token"]["index_bytes"] * 16 == unpooled["per_token"]["index_bytes"] == 16 * 4


def test_synthetic_mla_cache_has_the_bytes_of_a_real_prefill_and_the_roofline_reads_latents_once():
    args = bench_decode.parse_arguments(TINY_GLM)
    real = bench_decode.measure("pooled_r16", 352, args)
    args.synthetic_from = 300
    synthetic = bench_decode.measure("pooled_r16", 352, args)
    assert synthetic["prefill_s"] is None and synthetic["per_token"]["prefill_ms"] is None
    for component in ("key_value", "pooled_index_keys", "reserved"):
        assert synthetic["cache_bytes"][component] == real["cache_bytes"][component], component
    assert synthetic["context_cache_bytes"] == real["context_cache_bytes"]
    # Budget 32 + tail 15 tokens of one latent (24 float32), read once: what a GQA layer of 2 x 24 would read twice.
    model = bench_decode.build_model("pooled_r16", args)
    weights = sum(p.numel() for name, p in model.named_parameters() if "embed_tokens" not in name) * 4
    states = real["cache_bytes"]["conv_state"] + real["cache_bytes"]["recurrent_state"]
    pooled_keys = (352 // 16) * 16 * 4
    assert real["roofline_bytes"] == weights + 64 * 4 + 2 * states + 47 * 24 * 4 + pooled_keys


def test_synthetic_context_counts_as_held_and_refuses_beyond_the_reservation():
    import torch
    from model_factory import tiny_model

    from hybrid_indexpool import HybridIndexPoolCache

    model = tiny_model()
    cache = HybridIndexPoolCache(model.config, max_cache_len=64)
    with torch.no_grad():
        model(torch.randint(1, 97, (2, 5)), cache=cache, use_cache=True)
    bench_decode.fill_cache_synthetically(cache, 40, seed=0)
    assert cache.get_seq_length() == 40
    assert all(layer.lengths.tolist() == [40, 40] for layer in cache.index_layers)
    assert cache.positions(torch.ones(2, 1, dtype=torch.bool)).tolist() == [[40], [40]]
    with pytest.raises(ValueError, match="fewer than 10000"):
        bench_decode.fill_cache_synthetically(cache, 10_000, seed=0)
