"""Which implementation of the delta rules runs: fla's kernels through transformers' hub-kernel helper on CUDA
tensors, the PyTorch reference elsewhere (and on CUDA when neither a Hub kernel nor fla is installed)."""

import sys
import types

import pytest
import torch
from fresh_process import run_in_fresh_process
from hub_kernel_stand_ins import run_stand_in_on_cpu


def delta_rule_inputs(key_heads=2, value_heads=4, seq=6, dim=8, per_channel_decay=False):
    torch.manual_seed(0)
    query, key = torch.randn(2, 2, seq, key_heads, dim).unbind(0)
    value = torch.randn(1, seq, value_heads, dim)
    query, key = query[:1], key[:1]
    decay_shape = (1, seq, value_heads, dim) if per_channel_decay else (1, seq, value_heads)
    log_decay = -torch.rand(decay_shape)
    beta = torch.rand(1, seq, value_heads)
    return query, key, value, log_decay, beta


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_the_fast_path_without_fla_runs_the_reference_under_flas_signature(monkeypatch, mode):
    from hybrid_indexpool.kernels import gated_delta_rule as gdn
    from hybrid_indexpool.kernels import kimi_delta_rule as kda

    query, key, value, log_decay, beta = delta_rule_inputs()
    expected = gdn.gated_delta_rule(query, key, value, log_decay, beta, mode=mode)
    monkeypatch.setattr(gdn, "use_fast_path", lambda *tensors: True)
    output, state = gdn.gated_delta_rule(query, key, value, log_decay, beta, mode=mode)
    torch.testing.assert_close((output, state), expected)

    query, key, value, log_decay, beta = delta_rule_inputs(key_heads=4, per_channel_decay=True)
    expected = kda.kimi_delta_rule(query, key, value, log_decay, beta, mode=mode, gate_lower_bound=-5.0)
    monkeypatch.setattr(kda, "use_fast_path", lambda *tensors: True)
    torch.testing.assert_close(kda.kimi_delta_rule(query, key, value, log_decay, beta, mode=mode,
                                                   gate_lower_bound=-5.0), expected)


def install_recording_fla(calls: list) -> None:
    """A stand-in `fla` package whose four kernels record their arguments and return marked outputs."""
    def kernel(name):
        def run(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, safe_gate=False, cu_seqlens=None):
            calls.append(dict(name=name, heads=(q.shape[2], k.shape[2], v.shape[2]), decay=g, beta=beta,
                              final=output_final_state, l2norm=use_qk_l2norm_in_kernel, safe_gate=safe_gate))
            return torch.full_like(v, 7.0), torch.ones(v.shape[0], v.shape[2], k.shape[3], v.shape[3],
                                                        dtype=torch.bfloat16)
        return run

    fla, ops = types.ModuleType("fla"), types.ModuleType("fla.ops")
    fla.ops = ops
    sys.modules.update({"fla": fla, "fla.ops": ops})
    for folder, names in (("gated_delta_rule", ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule")),
                          ("kda", ("chunk_kda", "fused_recurrent_kda"))):
        module = types.ModuleType(f"fla.ops.{folder}")
        for name in names:
            setattr(module, name, kernel(name))
        setattr(ops, folder, module)
        sys.modules[module.__name__] = module


def check_fla_kernels_are_called_on_the_fast_path_only():
    calls = []
    install_recording_fla(calls)
    run_stand_in_on_cpu("fla")
    from hybrid_indexpool.kernels import gated_delta_rule as gdn
    from hybrid_indexpool.kernels import kimi_delta_rule as kda

    query, key, value, log_decay, beta = delta_rule_inputs()
    gdn.gated_delta_rule(query, key, value, log_decay, beta)  # CPU tensors: the reference, fla untouched
    assert calls == []
    gdn.use_fast_path = kda.use_fast_path = lambda *tensors: True
    for mode in ("chunk", "recurrent"):
        output, state = gdn.gated_delta_rule(query, key, value, log_decay, beta, mode=mode)
        assert bool((output == 7).all()) and state.dtype == torch.float32
    assert [call["name"] for call in calls] == ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"]
    assert all(call["heads"] == (4, 4, 4) and call["final"] and call["l2norm"] for call in calls)
    assert calls[0]["decay"] is log_decay and calls[0]["beta"].dtype == value.dtype

    calls.clear()
    query, key, value, log_decay, beta = delta_rule_inputs(key_heads=4, per_channel_decay=True)
    kda.kimi_delta_rule(query, key, value, log_decay, beta, mode="chunk", gate_lower_bound=-5.0)
    kda.kimi_delta_rule(query, key, value, log_decay, beta, mode="chunk", gate_lower_bound=None)
    kda.kimi_delta_rule(query, key, value, log_decay, beta, mode="recurrent")
    assert [(call["name"], call["safe_gate"]) for call in calls] == [
        ("chunk_kda", True), ("chunk_kda", False), ("fused_recurrent_kda", False)]


def test_fla_kernels_are_called_on_the_fast_path_only():
    # A fresh process: the helper looks for fla when the kernel module is imported.
    run_in_fresh_process(__file__, "check_fla_kernels_are_called_on_the_fast_path_only")
