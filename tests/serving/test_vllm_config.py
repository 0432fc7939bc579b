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


@pytest.mark.parametrize("change, named", [
    ({"hc_count": 2}, "hc_count"),
    ({"ple_layers": [0], "eos_token_id": 2}, "ple_layers"),
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
    (dict(attention_type="mla", q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16,
          qk_rope_head_dim=0), "attention_type = 'mla'"),
    (dict(linear_attention_type="kimi_delta", linear_num_value_heads=2, linear_num_key_heads=2),
     "linear_attention_type = 'kimi_delta'"),
    (dict(hc_type="sinkhorn"), "hc_type = 'sinkhorn'"),
    (dict(index_rope=False), "index_rope = False"),
    (dict(index_key_norm="layer_norm_before_pool"), "index_key_norm"),
    (dict(indexer_types=["full"] * 4 + ["shared"] * 4), "shared indexer layers"),
    (dict(num_experts=4, moe_router_type="sigmoid_grouped", n_group=2, topk_group=1), "moe_router_type"),
    (dict(num_experts=4, mlp_layer_types=["dense"] + ["sparse"] * 7), "mlp_layer_types"),
    (dict(swiglu_limit=7.0), "swiglu_limit"),
])
def test_glm_variants_are_refused_with_the_option_named(variant, named):
    from hybrid_indexpool import HybridIndexPoolConfig
    from hybrid_indexpool.serving.vllm_config import unsupported_options

    assert unsupported_options(HybridIndexPoolConfig()) == []
    problems = unsupported_options(HybridIndexPoolConfig(**variant))
    assert any(named in problem for problem in problems), problems
