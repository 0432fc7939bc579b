"""The causal convolution's dispatch: the `causal-conv1d` kernel (through transformers' hub-kernel helper) for CUDA
prefills from no state, the PyTorch reference otherwise; and the reference against nn.Conv1d."""

import sys
import types

import pytest
import torch
import torch.nn.functional as F
from fresh_process import run_in_fresh_process
from hub_kernel_stand_ins import run_stand_in_on_cpu


def inputs(seq=7, channels=6, kernel=4):
    torch.manual_seed(0)
    return torch.randn(2, channels, seq), torch.randn(channels, kernel), torch.randn(2, channels, kernel - 1)


def test_the_reference_is_nn_conv1d_causal_from_zeros_and_continues_from_a_state():
    from hybrid_indexpool.kernels import causal_conv1d as conv

    sequence, weight, state = inputs()
    zeros = torch.zeros_like(state)
    expected = F.conv1d(sequence, weight[:, None], padding=3, groups=6)[..., :7]
    torch.testing.assert_close(conv.causal_conv1d_torch(torch.cat([zeros, sequence], -1), weight), expected)
    whole = F.conv1d(torch.cat([state, sequence], -1), weight[:, None], groups=6)
    torch.testing.assert_close(conv.causal_conv1d_torch(torch.cat([state, sequence], -1), weight, "silu"),
                               F.silu(whole))
    torch.testing.assert_close(conv.causal_conv1d_torch(torch.cat([state, sequence[..., :1]], -1), weight),
                               whole[..., :1])


def test_the_fast_path_without_the_package_runs_the_reference_under_the_kernels_signature(monkeypatch):
    from hybrid_indexpool.kernels import causal_conv1d as conv

    sequence, weight, state = inputs()
    from_zeros = torch.cat([torch.zeros_like(state), sequence], -1)
    expected = conv.causal_conv1d(from_zeros, weight, "silu", zero_state=True)
    monkeypatch.setattr(conv, "use_fast_path", lambda *tensors: True)
    torch.testing.assert_close(conv.causal_conv1d(from_zeros, weight, "silu", zero_state=True), expected)


def check_the_kernel_runs_only_for_a_prefill_from_no_state():
    calls = []
    package = types.ModuleType("causal_conv1d")
    package.causal_conv1d_fn = lambda x, weight, bias=None, activation=None, **kwargs: calls.append(activation) or (
        torch.full_like(x, 5.0))
    sys.modules["causal_conv1d"] = package
    run_stand_in_on_cpu("causal_conv1d")
    from hybrid_indexpool.kernels import causal_conv1d as conv  # imported only now: the helper looks it up then

    sequence, weight, state = inputs()
    from_zeros, from_state = torch.cat([torch.zeros_like(state), sequence], -1), torch.cat([state, sequence], -1)
    conv.causal_conv1d(from_zeros, weight, "silu", zero_state=True)  # CPU tensors: the reference
    assert calls == []
    conv.use_fast_path = lambda *tensors: True
    output = conv.causal_conv1d(from_zeros, weight, "silu", zero_state=True)
    assert output.shape == sequence.shape and bool((output == 5).all()) and calls == ["silu"]
    conv.causal_conv1d(from_state, weight, "silu")  # a cached state: the reference
    conv.causal_conv1d(from_zeros, weight, "gelu", zero_state=True)  # an activation the kernel lacks: the reference
    assert calls == ["silu"]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_kernel_runs_only_for_a_prefill_from_no_state():
    # A fresh process: the helper looks for the package when the kernel module is imported.
    run_in_fresh_process(__file__, "check_the_kernel_runs_only_for_a_prefill_from_no_state")
