"""The compiled CPU matrix-vector product of the decode step's linear layers against `F.linear`."""

import pytest
import torch
import torch._dynamo.testing
import torch.nn.functional as F

from hybrid_indexpool.kernels.decode_linear import cpu_impl, decode_linear, decode_linear_cpu, decode_linear_torch

requires_kernel = pytest.mark.skipif(cpu_impl.KERNEL.load() is None,
                                     reason=f"the CPU kernel could not be built: {cpu_impl.KERNEL.error}")


@requires_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("out_features, in_features", [(1, 1), (7, 13), (64, 40), (130, 257)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_float32_products_match_f_linear(rows, out_features, in_features, with_bias):
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    hidden_states = torch.randn(rows, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator) if with_bias else None
    result = decode_linear_cpu(hidden_states, weight, bias)
    assert result.shape == (rows, out_features) and result.dtype == torch.float32
    torch.testing.assert_close(result, F.linear(hidden_states, weight, bias), rtol=1e-5, atol=1e-5)


@requires_kernel
def test_exact_on_integer_data():
    # Products and sums of small integers are exact in float32 whatever the order: the kernel must agree to the bit.
    generator = torch.Generator().manual_seed(0)
    hidden_states = torch.randint(-4, 5, (3, 1, 203), generator=generator).float()
    weight = torch.randint(-4, 5, (37, 203), generator=generator).float()
    bias = torch.randint(-4, 5, (37,), generator=generator).float()
    assert torch.equal(decode_linear_cpu(hidden_states, weight, bias), F.linear(hidden_states, weight, bias))


@requires_kernel
@pytest.mark.parametrize("rows", [1, 2, 4])
def test_bfloat16_weights_round_once_like_f_linear(rows):
    generator = torch.Generator().manual_seed(rows)
    hidden_states = torch.randn(1, rows, 300, generator=generator).bfloat16()
    weight = (torch.randn(90, 300, generator=generator) / 17).bfloat16()
    bias = torch.randn(90, generator=generator).bfloat16()
    result = decode_linear_cpu(hidden_states, weight, bias)
    exact = F.linear(hidden_states.double(), weight.double(), bias.double())
    assert result.dtype == torch.bfloat16 and result.shape == (1, rows, 90)
    # One rounding of the float32 sum to bfloat16: within half a bfloat16 unit of the exact result (plus the
    # float32 sum's own error), as F.linear's.
    unit = torch.finfo(torch.bfloat16).eps * exact.abs()
    assert ((result.double() - exact).abs() <= 0.5 * unit + 1e-4).all()
    torch.testing.assert_close(result, F.linear(hidden_states, weight, bias), rtol=1.6e-2, atol=1e-2)


@requires_kernel
def test_weight_rows_with_a_larger_stride():
    storage = torch.randn(20, 64)
    weight = storage[:, :50]  # rows 64 apart
    hidden_states = torch.randn(1, 50)
    torch.testing.assert_close(decode_linear_cpu(hidden_states, weight), F.linear(hidden_states, weight))


@requires_kernel
def test_dispatch_only_for_inference_products_of_a_few_rows(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_impl, "run_linear_rows", lambda *args: calls.append(1) or torch.zeros(len(args[0]), 8))
    weight = torch.randn(8, 16)
    decode_linear(torch.randn(1, 1, 16), weight)  # a decode step: the kernel
    assert len(calls) == 1
    decode_linear(torch.randn(8, 16), weight)  # a verify forward of 8 tokens: the kernel
    assert len(calls) == 2
    decode_linear(torch.randn(9, 16), weight)  # nine rows: a GEMM for the BLAS
    decode_linear(torch.randn(1, 16).double(), weight.double())  # float64
    decode_linear(torch.randn(1, 16), weight.requires_grad_())  # training: autograd needs F.linear
    with torch.no_grad():
        decode_linear(torch.randn(1, 16), weight)  # ... but not under no_grad
    assert len(calls) == 3
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert decode_linear(torch.randn(1, 16), weight).dtype == torch.bfloat16  # autocast's rules: F.linear
    assert len(calls) == 3
    monkeypatch.setenv("HYBRID_INDEXPOOL_BACKEND", "torch")
    decode_linear(torch.randn(1, 16), weight.detach())
    assert len(calls) == 3


@requires_kernel
def test_gradients_flow_through_the_entry_point():
    weight = torch.randn(6, 10, requires_grad=True)
    hidden_states = torch.randn(1, 10, requires_grad=True)
    decode_linear(hidden_states, weight).sum().backward()
    torch.testing.assert_close(weight.grad, hidden_states.detach().expand(6, 10))


@requires_kernel
def test_one_graph_under_torch_compile():
    torch._dynamo.reset()
    graphs = []

    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    step = torch.compile(decode_linear, backend=backend, fullgraph=True)
    hidden_states, weight, bias = torch.randn(1, 1, 48), torch.randn(24, 48), torch.randn(24)
    torch.testing.assert_close(step(hidden_states, weight, bias), F.linear(hidden_states, weight, bias))
    assert len(graphs) == 1
    targets = [node.target for node in graphs[0].graph.nodes]
    assert torch.ops.hybrid_indexpool.linear_rows.default in targets  # the kernel, not F.linear, in the graph


@requires_kernel
def test_refuses_mismatched_widths():
    with pytest.raises(ValueError, match="input has 5 features, the weight takes 6"):
        cpu_impl.run_linear_rows(torch.randn(1, 5), torch.randn(3, 6), None)


def test_without_a_compiler_f_linear_runs(without_c_compiler):
    without_c_compiler(cpu_impl)
    hidden_states, weight = torch.randn(1, 32), torch.randn(8, 32)
    assert torch.equal(decode_linear(hidden_states, weight), decode_linear_torch(hidden_states, weight))


@requires_kernel
def test_a_model_decode_step_runs_every_linear_layer_on_it_and_matches_f_linear(monkeypatch):
    from tests.model_factory import tiny_model

    model = tiny_model()
    prompt = torch.randint(1, 97, (1, 21), generator=torch.Generator().manual_seed(0))
    calls = []
    original = cpu_impl.run_linear_rows
    monkeypatch.setattr(cpu_impl, "run_linear_rows", lambda *args: calls.append(1) or original(*args))

    def prefill_and_step():
        with torch.no_grad():
            output = model(prompt, use_cache=True)
            token = output.logits[:, -1:].argmax(-1)
            return model(token, cache=output.cache, use_cache=True).logits

    with_kernel = prefill_and_step()
    linear_layers = sum(isinstance(module, torch.nn.Linear) for module in model.modules())
    assert len(calls) == linear_layers  # the prefill's products are GEMMs for the BLAS; the step's all go here
    monkeypatch.setenv("HYBRID_INDEXPOOL_BACKEND", "torch")
    torch.testing.assert_close(with_kernel, prefill_and_step(), rtol=1e-4, atol=1e-5)
    assert len(calls) == linear_layers


@requires_kernel
def test_tensor_parallel_dtensor_weights_stay_with_f_linear(monkeypatch):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    calls = []
    monkeypatch.setattr(cpu_impl, "run_linear_rows", lambda *args: calls.append(1))
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        mesh = init_device_mesh("cpu", (1,))
        weight = torch.randn(8, 16)
        hidden_states = torch.randn(1, 16)
        result = decode_linear(distribute_tensor(hidden_states, mesh, [Replicate()]),
                               distribute_tensor(weight, mesh, [Replicate()]))
        torch.testing.assert_close(result.full_tensor(), F.linear(hidden_states, weight))
    finally:
        dist.destroy_process_group()
    assert calls == []
