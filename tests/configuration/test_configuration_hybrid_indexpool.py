import pytest

from hybrid_indexpool import HybridIndexPoolConfig, HybridIndexPoolMultimodalConfig


def test_defaults_interleave_three_linear_then_one_indexpool():
    config = HybridIndexPoolConfig(num_hidden_layers=8)
    assert config.layer_types == ["linear_attention"] * 3 + ["indexpool_attention"] + \
        ["linear_attention"] * 3 + ["indexpool_attention"]
    assert config.index_pool_size == 4 and config.index_pool_weighting == "learned"
    assert config.index_topk_windows == config.index_topk // 4
    assert config.rope_parameters["partial_rotary_factor"] == config.partial_rotary_factor


def test_router_outputs_are_off_by_default_with_qwens_coefficient():
    config = HybridIndexPoolConfig(num_experts=4)
    assert config.output_router_logits is False and config.router_aux_loss_coef == 0.001


def test_linear_attention_defaults_to_gated_deltanet_and_kimi_delta_to_its_sigmoid_gate(tmp_path):
    config = HybridIndexPoolConfig()
    assert config.linear_attention_type == "gated_deltanet" and config.linear_gate_lower_bound is None
    assert config.linear_output_gate_act == "silu"
    kimi = HybridIndexPoolConfig(linear_attention_type="kimi_delta", linear_num_value_heads=8,
                                 linear_gate_lower_bound=-5.0)
    assert kimi.linear_output_gate_act == "sigmoid"
    kimi.save_pretrained(tmp_path)
    assert HybridIndexPoolConfig.from_pretrained(tmp_path).to_dict() == kimi.to_dict()


def test_a_config_saved_before_the_linear_attention_variants_loads_as_gated_deltanet(tmp_path):
    config = HybridIndexPoolConfig(num_hidden_layers=2, layer_types=["linear_attention", "indexpool_attention"])
    saved = config.to_dict()
    for key in ("linear_attention_type", "linear_gate_lower_bound", "linear_output_gate_act"):
        del saved[key]
    loaded = HybridIndexPoolConfig.from_dict(saved)
    assert loaded.to_dict() == config.to_dict()


def test_save_and_load_round_trip(tmp_path):
    config = HybridIndexPoolConfig(num_hidden_layers=2, layer_types=["indexpool_attention", "linear_attention"],
                                   index_topk=64, index_pool_size=8, index_head_weights=True)
    config.save_pretrained(tmp_path)
    loaded = HybridIndexPoolConfig.from_pretrained(tmp_path)
    assert loaded.to_dict() == config.to_dict()


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(index_topk=10, index_pool_size=4), "`index_topk` (10) is not a multiple of `index_pool_size` (4)"),
        (dict(num_attention_heads=6, num_key_value_heads=4), "`num_attention_heads` (6) is not a multiple"),
        (dict(linear_num_key_heads=3, linear_num_value_heads=4), "`linear_num_value_heads` (4) is not a multiple"),
        (dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"]),
         "`layer_types[1]` is 'full_attention'"),
        (dict(num_hidden_layers=3, layer_types=["linear_attention"] * 2), "`layer_types` has 2 entries"),
        (dict(index_pool_weighting="max"), "`index_pool_weighting` is 'max'"),
        (dict(index_pool_size=0), "`index_pool_size` is 0"),
        (dict(head_dim=64, partial_rotary_factor=1.0, index_head_dim=32), "`index_head_dim` (32) is smaller"),
        (dict(head_dim=10, partial_rotary_factor=0.5), "odd number of rotated channels"),
        (dict(num_experts=4, num_experts_per_tok=5), "`num_experts_per_tok` (5) must lie between 1"),
        (dict(attention_dropout=1.5), "`attention_dropout` is 1.5"),
        (dict(router_aux_loss_coef=-0.01), "`router_aux_loss_coef` is -0.01"),
        (dict(router_aux_loss_coef=float("inf")), "`router_aux_loss_coef` is inf"),
        (dict(partial_rotary_factor=0.0), "`partial_rotary_factor` is 0.0"),
        (dict(index_sink_windows=-1), "`index_sink_windows` is -1"),
        (dict(index_local_windows=-2), "`index_local_windows` is -2"),
        (dict(index_topk=16, index_pool_size=4, index_sink_windows=3, index_local_windows=2),
         "exceed the budget of 4 windows"),
        (dict(linear_attention_type="kda"), "`linear_attention_type` is 'kda'; it must be one of"),
        (dict(linear_attention_type="kimi_delta", linear_num_key_heads=8, linear_num_value_heads=16),
         "'kimi_delta' needs as many value heads as key heads, but `linear_num_value_heads` is 16"),
        (dict(linear_attention_type="kimi_delta", linear_num_value_heads=8, linear_value_head_dim=32),
         "'kimi_delta' needs value heads as wide as key heads, but `linear_value_head_dim` is 32"),
        (dict(linear_attention_type="kimi_delta", linear_num_value_heads=8, linear_gate_lower_bound=0.5),
         "`linear_gate_lower_bound` is 0.5; it must lie in (-inf, 0)"),
        (dict(linear_gate_lower_bound=-5.0),
         "linear_gate_lower_bound = -5.0 apply to Kimi Delta Attention's forget gate only"),
    ],
)
def test_invalid_settings_raise_value_error_naming_field(settings, message):
    with pytest.raises(ValueError) as error:
        HybridIndexPoolConfig(**settings)
    assert message in str(error.value)


def test_settings_changed_after_construction_are_checked_when_a_model_is_built():
    from hybrid_indexpool import HybridIndexPoolModel

    config = HybridIndexPoolConfig(num_hidden_layers=1, hidden_size=32, layer_types=["indexpool_attention"])
    config.index_topk = 6
    with pytest.raises(ValueError, match="not a multiple of `index_pool_size`"):
        HybridIndexPoolModel(config)


NOPE_MLA = dict(attention_type="mla", q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=16, v_head_dim=16,
                index_query_source="q_lora", index_rope=False)


def test_the_multimodal_config_builds_the_vision_tower_its_model_type_names(tmp_path):
    from transformers import Glm5NextVisionConfig, Qwen4ExpVisionConfig

    text = dict(hidden_size=64, num_hidden_layers=2, vocab_size=248320,
                rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [4, 4, 8]})
    default = HybridIndexPoolMultimodalConfig(text_config=text, vision_config={"out_hidden_size": 64})
    assert isinstance(default.vision_config, Qwen4ExpVisionConfig)
    glm = HybridIndexPoolMultimodalConfig(text_config={**text, **NOPE_MLA}, vision_config=Glm5NextVisionConfig(
        out_hidden_size=64).to_dict())
    assert isinstance(glm.vision_config, Glm5NextVisionConfig)
    glm.save_pretrained(tmp_path)
    assert isinstance(HybridIndexPoolMultimodalConfig.from_pretrained(tmp_path).vision_config, Glm5NextVisionConfig)


def test_only_a_text_model_with_rope_needs_multimodal_rope_sections():
    vision = {"model_type": "glm5_next_vision", "out_hidden_size": 64}
    text = dict(hidden_size=64, num_hidden_layers=2, vocab_size=248320)  # the default vision tokens inside
    nope = HybridIndexPoolMultimodalConfig(text_config={**text, **NOPE_MLA}, vision_config=vision)
    assert not nope.multimodal_rope
    with pytest.raises(ValueError, match="rope_parameters need 'mrope_section'"):
        HybridIndexPoolMultimodalConfig(text_config={**text, **NOPE_MLA, "index_rope": True}, vision_config=vision)
    with pytest.raises(ValueError, match="rope_parameters need 'mrope_section'"):
        HybridIndexPoolMultimodalConfig(text_config=text, vision_config=vision)


GLM_MLA = dict(attention_type="mla", q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16)


def test_gqa_and_the_current_indexer_are_the_defaults():
    config = HybridIndexPoolConfig()
    assert (config.attention_type, config.index_query_source, config.index_key_norm, config.index_rope,
            config.indexer_types) == ("gqa", "hidden", "rms_after_pool", True, None)
    assert not any(config.is_shared_indexer_layer(index) for index in range(config.num_hidden_layers))


def test_glm_variant_round_trips_and_plans_tensor_parallelism_for_mla_modules(tmp_path):
    config = HybridIndexPoolConfig(**GLM_MLA, index_query_source="q_lora", index_key_norm="layer_norm_before_pool",
                                   index_rope=False, indexer_types=["full"] * 4 + ["shared"] * 4)
    config.save_pretrained(tmp_path)
    loaded = HybridIndexPoolConfig.from_pretrained(tmp_path)
    assert loaded.indexer_types == config.indexer_types and loaded.kv_lora_rank == 32
    assert loaded.is_shared_indexer_layer(7) and not loaded.is_shared_indexer_layer(3)
    plan = loaded.base_model_tp_plan
    assert {"layers.*.self_attn.q_b_proj", "layers.*.self_attn.kv_b_proj", "layers.*.self_attn.o_proj"} <= set(plan)
    assert "layers.*.self_attn.q_proj" not in plan and "layers.*.self_attn.k_norm" not in plan


@pytest.mark.parametrize("settings, message", [
    (dict(attention_type="mha"), "`attention_type` is 'mha'"),
    (dict(attention_type="mla"), "`q_lora_rank` is None; attention_type 'mla' needs it"),
    (dict(GLM_MLA, v_head_dim=0), "`v_head_dim` is 0"),
    (dict(GLM_MLA, qk_rope_head_dim=64), "`qk_rope_head_dim` is 64; it must lie in [0, 0]"),
    (dict(index_query_source="q_lora"), "`index_query_source` 'q_lora' reads the MLA query latent"),
    (dict(index_query_source="latent"), "`index_query_source` is 'latent'"),
    (dict(index_key_norm="layer_norm"), "`index_key_norm` is 'layer_norm'"),
    (dict(index_key_norm="layer_norm_before_pool", index_pool_weighting="prenorm_mean"), "both norm the keys"),
    (dict(indexer_types=["full"] * 3), "`indexer_types` has 3 entries but `num_hidden_layers` is 8"),
    (dict(indexer_types=["full"] * 7 + ["skip"]), "`indexer_types[7]` is 'skip'"),
    (dict(indexer_types=["full"] * 3 + ["shared"] + ["full"] * 4), "the first IndexPool layer must be 'full'"),
])
def test_invalid_mla_and_indexer_variants_raise_value_error_naming_field(settings, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        HybridIndexPoolConfig(**settings)


def test_shared_entries_on_linear_layers_before_the_first_indexpool_layer_are_ignored():
    config = HybridIndexPoolConfig(indexer_types=["shared"] * 3 + ["full"] + ["shared"] * 4)
    assert config.is_shared_indexer_layer(7)


def test_every_field_the_check_tables_name_exists_and_its_default_passes():
    from dataclasses import fields

    from hybrid_indexpool.configuration import configuration_hybrid_indexpool as tables

    names = {field.name for field in fields(HybridIndexPoolConfig)}
    variant_fields = {field for field, _ in tables.VARIANT_ONLY} | {
        name for _, neutral in tables.VARIANT_ONLY.values() for name in neutral}
    named = (set(tables.CHOICES) | set(tables.LAYER_CHOICES) | set(tables.RANGES) | set(tables.NULLABLE)
             | set(tables.READ_WHEN) | {field for field, _ in tables.READ_WHEN.values()} | variant_fields
             | set(tables.MULTIPLES) | {divisor for divisor, _ in tables.MULTIPLES.values()})
    assert named <= names, named - names
    default = HybridIndexPoolConfig()
    assert all(getattr(default, name) in allowed for name, allowed in tables.CHOICES.items())


@pytest.mark.parametrize("settings, message", [
    (dict(router_aux_loss_coef=float("nan")), "`router_aux_loss_coef` is nan; it must lie in [0, inf)"),
    (dict(GLM_MLA, kv_lora_rank=None), "`kv_lora_rank` is None; attention_type 'mla' needs it in [1, inf)"),
    (dict(prefill_chunk_length=0), "`prefill_chunk_length` is 0; it must lie in [1, inf)"),
    (dict(hc_type="sinkhorn", hc_eps=float("inf")), "`hc_eps` is inf"),
])
def test_ranges_refuse_nan_infinity_and_missing_variant_fields(settings, message):
    with pytest.raises(ValueError) as error:
        HybridIndexPoolConfig(**settings)
    assert message in str(error.value)


def test_a_field_only_another_variant_reads_is_not_checked():
    config = HybridIndexPoolConfig(hc_sinkhorn_iters=0, q_lora_rank=None, linear_gate_lower_bound=None)
    assert config.hc_type == "qwen4_exp" and config.hc_sinkhorn_iters == 0


def test_a_key_that_resembles_a_field_gets_one_warning_naming_the_field(tmp_path):
    with pytest.warns(UserWarning) as caught:
        config = HybridIndexPoolConfig(index_top_k=8, hiden_size=64)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "`index_top_k` (did you mean `index_topk`?)" in message
    assert "`hiden_size` (did you mean `hidden_size`?)" in message
    assert caught[0].filename == __file__  # points at the line that built the config
    assert config.index_topk == 2048  # ignored, as transformers ignores any unknown key
    # A typo saved in a config.json is named again when it loads.
    config.save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match="did you mean `index_topk`"):
        HybridIndexPoolConfig.from_pretrained(tmp_path)


def test_keys_unlike_any_field_and_saved_configs_load_without_a_warning(tmp_path, recwarn):
    config = HybridIndexPoolConfig(num_hidden_layers=4, some_other_tools_key=1, rope_theta=1e6)
    assert config.some_other_tools_key == 1 and config.rope_parameters["rope_theta"] == 1e6
    config.save_pretrained(tmp_path)
    HybridIndexPoolConfig.from_pretrained(tmp_path)
    assert not [warning for warning in recwarn if "did you mean" in str(warning.message)]
