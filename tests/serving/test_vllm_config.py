"""Engine-start checks (marker `vllm`): a checkpoint option or an engine setting the vLLM model does not support is
refused before any weight is read, with the option named."""

import json
import shutil
from pathlib import Path

import pytest
from vllm_reference import tiny_checkpoint

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("vllm") / "tiny-indexpool")


@pytest.mark.parametrize("change, named", [  # GLM-5.3-Flash settings the vLLM model does not implement
    ({"swiglu_limit": 7.0}, "swiglu_limit = 7.0"),
    ({"index_key_norm": "layer_norm_before_pool"}, "index_key_norm = 'layer_norm_before_pool'"),
])
def test_unsupported_checkpoint_option_is_refused_at_start(checkpoint, tmp_path, change, named):
    changed = tmp_path / "changed"
    shutil.copytree(checkpoint, changed)
    config = json.loads((changed / "config.json").read_text())
    config.update(change)
    (changed / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=named):
        vllm.LLM(str(changed), dtype="bfloat16", max_model_len=256, enforce_eager=True)


@pytest.mark.parametrize("setting, named", [
    ({"tensor_parallel_size": 3}, "tensor parallel size 3 does not divide"),
    ({"pipeline_parallel_size": 2}, "pipeline_parallel_size = 2"),
    ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype"),
    # vLLM's CPU Gated DeltaNet kernels asked for explicitly where they cannot run (the default takes the project's).
    ({"dtype": "float32", "additional_config": {"hybrid_indexpool_gdn_kernel": "vllm"}},
     r"dtype = torch.float32 \(vLLM's CPU Gated DeltaNet takes bfloat16 only\), with "
     r"additional_config\['hybrid_indexpool_gdn_kernel'\] = 'vllm'"),
    ({"additional_config": {"hybrid_indexpool_gdn_kernel": "fla"}}, r"hybrid_indexpool_gdn_kernel'\] = 'fla'"),
])
def test_unsupported_engine_setting_is_refused_at_start(checkpoint, setting, named):
    with pytest.raises(ValueError, match=named):
        vllm.LLM(str(checkpoint), **({"dtype": "bfloat16"} | setting), max_model_len=256, enforce_eager=True)


@pytest.mark.parametrize("variant, named", [
    (dict(index_rope=False), "index_rope = False"),
    (dict(index_key_norm="layer_norm_before_pool"), "index_key_norm"),
    (dict(indexer_types=["full"] * 4 + ["shared"] * 4), "shared indexer layers"),
    (dict(num_experts=4, mlp_layer_types=["dense"] + ["sparse"] * 7), "mlp_layer_types"),
    (dict(swiglu_limit=7.0), "swiglu_limit"),
])
def test_glm_options_without_glm_layers_are_refused_with_the_option_named(variant, named):
    """GLM-5.3-Flash's options on a Gated DeltaNet + GQA model (which the plugin serves with Qwen's decoder)."""
    from hybrid_indexpool import HybridIndexPoolConfig
    from hybrid_indexpool.serving.vllm_config import unsupported_options

    assert unsupported_options(HybridIndexPoolConfig()) == []
    problems = unsupported_options(HybridIndexPoolConfig(**variant))
    assert any(named in problem for problem in problems), problems


# A GLM-5.3-Flash conversion's settings (`convert_glm5_next`), at small widths.
GLM = dict(
    attention_type="mla", q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, v_head_dim=16, qk_rope_head_dim=0,
    index_query_source="q_lora", index_key_norm="layer_norm_before_pool", index_rope=False, index_head_weights=True,
    indexer_types=["full"] * 7 + ["shared"], linear_attention_type="kimi_delta", linear_num_key_heads=2,
    linear_num_value_heads=2, linear_gate_lower_bound=-5.0, hc_type="sinkhorn", hc_count=3,
    rms_norm_unit_offset=False, num_experts=4, mlp_layer_types=["dense"] + ["sparse"] * 7,
    moe_router_type="sigmoid_grouped", n_group=2, topk_group=1, routed_scaling_factor=2.5, shared_expert_gate=False,
    shared_expert_intermediate_size=32, swiglu_limit=7.0)


@pytest.mark.parametrize("change, named", [
    ({}, None),
    (dict(hc_type="qwen4_exp", hc_count=1), None),  # GLM without residual streams
    (dict(linear_attention_type="gated_deltanet", linear_gate_lower_bound=None, linear_num_value_heads=4),
     "linear_attention_type = 'gated_deltanet'"),
    (dict(attention_type="gqa", index_query_source="hidden"), "attention_type = 'gqa'"),
    (dict(index_rope=True), "index_rope = True"),
    (dict(index_key_cache_dtype="float8_e4m3fn"), "index_key_cache_dtype = 'float8_e4m3fn'"),
    (dict(shared_expert_gate=True), "shared_expert_gate"),
    (dict(moe_router_type="softmax", n_group=1, topk_group=1, routed_scaling_factor=1.0), "moe_router_type"),
    (dict(hc_type="qwen4_exp", hc_count=2), "hc_type = 'qwen4_exp'"),
])
def test_glm_conversions_are_served_and_what_they_cannot_run_is_named(change, named):
    """GLM-5.3-Flash's variants go to the GLM decoder (`serving/vllm_glm.py`), which serves a conversion's settings;
    combinations it does not implement are refused with the option named."""
    from hybrid_indexpool import HybridIndexPoolConfig
    from hybrid_indexpool.serving.vllm_config import unsupported_options

    problems = unsupported_options(HybridIndexPoolConfig(**(GLM | change)))
    if named is None:
        assert problems == []
    else:
        assert any(named in problem for problem in problems), problems
