"""The decode step compiles whole (`torch.compile(fullgraph=True)`): same logits and tokens as eager, one graph for
every step, also through `generate()`'s compiled decoding.

Each check runs in a fresh process with an empty kernel cache and compiles before anything runs eagerly: a compiled
step must work as the first thing a process does (no CPU kernel built or loaded yet)."""

import pytest
import torch
import torch._dynamo.testing
from fresh_process import run_in_fresh_process
from model_factory import KIMI_DELTA, tiny_model
from transformers import CompileConfig

from hybrid_indexpool import HybridIndexPoolCache
from hybrid_indexpool.kernels.decode_linear.cpu_impl import KERNEL as LINEAR_KERNEL
from hybrid_indexpool.kernels.pooled_index_topk.cpu_impl import KERNEL as TOPK_KERNEL

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
CPU_KERNELS = (LINEAR_KERNEL, TOPK_KERNEL)


def greedy_decode(forward, model, input_ids, mask, steps):
    """Prefill eagerly into a reserved cache, then `steps` greedy steps through `forward`: logits and tokens."""
    cache = HybridIndexPoolCache(model.config, max_cache_len=input_ids.shape[1] + steps)
    with torch.no_grad():
        logits = model(input_ids, attention_mask=mask, cache=cache).logits[:, -1:]
        all_logits, tokens = [], []
        for _ in range(steps):
            token = logits.argmax(-1)
            tokens.append(token)
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            torch._dynamo.maybe_mark_dynamic(mask, 1)  # what generate() does for this cache
            logits = forward(token, attention_mask=mask, cache=cache).logits
            all_logits.append(logits)
    return torch.cat(all_logits, dim=1), torch.cat(tokens, dim=1)


def check_compiled_decode(backend: str, steps: int = 50, frozen: bool = False, fp8_keys: bool = False,
                          kimi_delta: bool = False):
    """Compiled greedy decoding (first in the process), then eager: same logits and tokens, one graph."""
    from hybrid_indexpool.scripts.bench_decode import FROZEN_OPTIONS

    options = FROZEN_OPTIONS if frozen else None
    torch._dynamo.reset()
    torch.manual_seed(1234)
    model = tiny_model(index_topk=8, index_head_weights=True,
                       index_key_cache_dtype="float8_e4m3fn" if fp8_keys else "auto",
                       **(KIMI_DELTA if kimi_delta else {}))
    input_ids = torch.randint(1, 97, (2, 30))
    mask = torch.ones(2, 30, dtype=torch.long)
    mask[1, :6] = 0  # left padding: row 1 has 24 real tokens
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    if options is None:
        compiled = torch.compile(model, fullgraph=True, backend=counter)
    else:  # inductor with options: count the compiled frames from dynamo's statistics instead
        torch._dynamo.utils.counters.clear()
        compiled = torch.compile(model, fullgraph=True, backend=backend, options=options)
    assert not any(kernel.is_loaded for kernel in CPU_KERNELS)  # cold: the compiled step is the first to need them
    compiled_logits, compiled_tokens = greedy_decode(compiled, model, input_ids, mask, steps)
    assert all(kernel.is_loaded for kernel in CPU_KERNELS)  # built and loaded by the compiled graph's custom ops
    eager_logits, eager_tokens = greedy_decode(model, model, input_ids, mask, steps)
    torch.testing.assert_close(compiled_logits, eager_logits, atol=1e-5, rtol=0)
    assert torch.equal(compiled_tokens, eager_tokens)
    frames = counter.frame_count if options is None else torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert frames == 1  # one graph served all 50 steps: nothing recompiled as the context grew


def test_the_decode_step_compiles_whole_and_one_graph_serves_every_step():
    # aot_eager: dynamo's whole-graph capture and AOT autograd, without inductor's (slow on CPU) code generation.
    run_in_fresh_process(__file__, "check_compiled_decode", "aot_eager")


def test_the_decode_step_with_fp8_index_keys_compiles_whole():
    # Quantising a completed window (rotation, scale, fp8 bytes) and scoring packed keys are in the graph too.
    run_in_fresh_process(__file__, "check_compiled_decode", "aot_eager", 30, False, True)


def test_the_decode_step_with_kimi_delta_attention_compiles_whole():
    run_in_fresh_process(__file__, "check_compiled_decode", "aot_eager", 30, False, False, True)


@pytest.mark.slow
def test_the_decode_step_compiled_by_inductor_matches_eager():
    run_in_fresh_process(__file__, "check_compiled_decode", "inductor")


@pytest.mark.slow
def test_the_decode_step_compiled_for_cpu_inference_matches_eager():
    run_in_fresh_process(__file__, "check_compiled_decode", "inductor", 50, True)


def test_generate_compiles_its_decode_steps_and_gives_the_eager_tokens():
    run_in_fresh_process(__file__, "check_compiled_generate")


def check_compiled_generate():
    """`generate(compile_config=...)` as the first decoding of the process, then eager: the same tokens, one graph."""
    torch._dynamo.reset()
    torch.manual_seed(1234)
    model = tiny_model(index_topk=8)
    input_ids = torch.randint(1, 97, (2, 30))
    mask = torch.ones(2, 30, dtype=torch.long)
    mask[0, :3] = 0
    graphs = []

    def counting_backend(graph_module, example_inputs):  # a function: CompileConfig deep-copies its settings
        graphs.append(graph_module)
        return torch._dynamo.lookup_backend("aot_eager")(graph_module, example_inputs)

    config = CompileConfig(fullgraph=True, backend=counting_backend, mode=None)
    config._compile_all_devices = True  # generate() compiles only on accelerators unless told otherwise
    compiled = model.generate(input_ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                              compile_config=config)
    eager = model.generate(input_ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    assert torch.equal(compiled, eager)
    assert len(graphs) == 1
