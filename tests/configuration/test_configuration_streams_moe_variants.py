"""The residual-stream and feed-forward variants of the config (GLM-5.3-Flash's Sinkhorn streams, grouped router,
ungated shared expert, SwiGLU clamp, dense and sparse layers): defaults, validation and the parallel plans."""

import pytest

from hybrid_indexpool import HybridIndexPoolConfig

MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)


def test_defaults_are_the_qwen_variants():
    config = HybridIndexPoolConfig(num_hidden_layers=4, **MOE)
    assert config.hc_type == "qwen4_exp" and not config.has_hyper_connections
    assert config.moe_router_type == "softmax" and config.shared_expert_gate is True
    assert config.swiglu_limit is None and config.mlp_layer_types is None
    assert config.mlp_types == ["sparse"] * 4
    assert HybridIndexPoolConfig(num_hidden_layers=2).mlp_types == ["dense"] * 2


def test_sinkhorn_streams_are_hyper_connections_at_any_count():
    assert HybridIndexPoolConfig(hc_type="sinkhorn", hc_count=1).has_hyper_connections
    assert HybridIndexPoolConfig(hc_count=2).has_hyper_connections


def test_glm_settings_round_trip(tmp_path):
    config = HybridIndexPoolConfig(
        num_hidden_layers=4, hc_type="sinkhorn", hc_count=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
        moe_router_type="sigmoid_grouped", n_group=4, topk_group=2, routed_scaling_factor=2.5,
        shared_expert_gate=False, swiglu_limit=10.0, mlp_layer_types=["dense", "sparse", "sparse", "sparse"], **MOE,
    )
    config.save_pretrained(tmp_path)
    loaded = HybridIndexPoolConfig.from_pretrained(tmp_path)
    assert loaded.to_dict() == config.to_dict()
    assert loaded.mlp_types == ["dense", "sparse", "sparse", "sparse"]


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(hc_type="deepseek"), "`hc_type` is 'deepseek'"),
        (dict(hc_type="sinkhorn", hc_sinkhorn_iters=0), "`hc_sinkhorn_iters` is 0"),
        (dict(hc_type="sinkhorn", hc_eps=-1.0), "`hc_eps` is -1.0"),
        (dict(num_hidden_layers=2, mlp_layer_types=["dense"]), "`mlp_layer_types` has 1 entries"),
        (dict(num_hidden_layers=2, mlp_layer_types=["dense", "moe"], **MOE), "`mlp_layer_types[1]` is 'moe'"),
        (dict(num_hidden_layers=2, mlp_layer_types=["dense", "sparse"]), "'sparse' layers but `num_experts` is 0"),
        (dict(swiglu_limit=0.0), "`swiglu_limit` is 0.0"),
        (dict(moe_router_type="sigmoid"), "`moe_router_type` is 'sigmoid'"),
        (dict(n_group=2, **MOE), "n_group = 2 apply to the 'sigmoid_grouped' router only"),
        (dict(routed_scaling_factor=2.5, **MOE), "routed_scaling_factor = 2.5 apply to the 'sigmoid_grouped'"),
        (dict(moe_router_type="sigmoid_grouped", routed_scaling_factor=0.0, **MOE),
         "`routed_scaling_factor` is 0.0"),
        (dict(moe_router_type="sigmoid_grouped", n_group=2, topk_group=3, **MOE),
         "`n_group` is 2 and `topk_group` 3"),
        (dict(moe_router_type="sigmoid_grouped", n_group=3, **MOE), "must split into `n_group` (3) equal groups"),
        (dict(moe_router_type="sigmoid_grouped", n_group=8, **MOE), "must split into `n_group` (8) equal groups"),
        (dict(moe_router_type="sigmoid_grouped", n_group=4, topk_group=1, num_experts=8, num_experts_per_tok=3),
         "`num_experts_per_tok` (3) exceeds the 2 experts"),
    ],
)
def test_invalid_settings_raise_value_error_naming_field(settings, message):
    with pytest.raises(ValueError) as error:
        HybridIndexPoolConfig(**settings)
    assert message in str(error.value)


def test_tensor_parallel_plan_follows_the_variants():
    qwen = HybridIndexPoolConfig(num_hidden_layers=4, hc_count=2, **MOE).base_model_tp_plan
    assert "layers.*.attn_hyper_connection.input_mix_weight_down" in qwen and "layers.*.mlp.gate_proj" not in qwen
    glm = HybridIndexPoolConfig(
        num_hidden_layers=4, hc_type="sinkhorn", hc_count=2, mlp_layer_types=["dense", "sparse", "dense", "sparse"],
        moe_router_type="sigmoid_grouped", n_group=2, **MOE,
    ).base_model_tp_plan
    # No Qwen4-Exp mixing weights to split; both the dense MLP and the experts are split.
    assert not any("hyper_connection" in rule for rule in glm)
    expected = {"layers.*.mlp.gate_proj", "layers.*.mlp.experts.gate_up_proj", "layers.*.mlp.shared_expert.up_proj"}
    assert expected <= set(glm)
