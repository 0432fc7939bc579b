"""The IndexPool layer's batched step outside an engine (marker `vllm`): its forward reads nothing from the device,
keeps its shapes across context lengths, compiles with `fullgraph=True`, and selects the windows the reference
selection does.

Each check runs in a fresh process (`fresh_process.py`): it starts vLLM's single-rank parallel state, which must not
leak into the other tests of the session.
"""

import pytest
from fresh_process import run_in_fresh_process
from host_sync import HostSyncGuard

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

BLOCK_SIZE = 16
NUM_BLOCKS = 64
MAX_MODEL_LEN = 1024
# One decode far beyond the budget, a prefill chunk that starts and ends inside windows, a short decode.
CONTEXTS, NEW_TOKENS = [150, 37, 9], [1, 22, 1]
# The same batch later: other context lengths (windows in another place, the same power-of-two window bound).
LATER_CONTEXTS = [230, 110, 61]


def build_layer(sink_windows: int = 0, local_windows: int = 0, fp8_index_keys: bool = False):
    """A tiny IndexPool layer (budget 16 at r = 4) with random weights and random paged caches (pooled keys packed in
    fp8 with `fp8_index_keys`), its vLLM config and the metadata builders of its three caches."""
    import socket
    import tempfile

    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    from hybrid_indexpool.configuration import HybridIndexPoolConfig
    from hybrid_indexpool.kernels.fp8_index_keys import quantize_pooled_keys
    from hybrid_indexpool.serving import register
    from hybrid_indexpool.serving.indexpool_attention import IndexPoolAttention, IndexPoolMetadataBuilder

    register()
    folder = tempfile.mkdtemp()
    HybridIndexPoolConfig(
        vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        layer_types=["linear_attention", "indexpool_attention"], num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, partial_rotary_factor=0.25, index_n_heads=2, index_head_dim=32, index_topk=16, index_pool_size=4,
        index_pool_weighting="learned", index_sink_windows=sink_windows, index_local_windows=local_windows,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
        max_position_embeddings=4096, architectures=["HybridIndexPoolForCausalLM"],
        index_key_cache_dtype="float8_e4m3fn" if fp8_index_keys else "auto",
    ).save_pretrained(folder)
    vllm_config = VllmConfig(
        model_config=ModelConfig(model=folder, dtype="bfloat16", skip_tokenizer_init=True,
                                 max_model_len=MAX_MODEL_LEN),
        cache_config=CacheConfig(block_size=BLOCK_SIZE),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=8, max_model_len=MAX_MODEL_LEN,
                                         is_encoder_decoder=False),
    )
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    torch.manual_seed(0)
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        initialize_model_parallel(1, 1)
        torch.set_default_dtype(torch.bfloat16)  # as vLLM's loader builds a model: parameters in its dtype
        layer = IndexPoolAttention(vllm_config.model_config.hf_config, vllm_config, "model.layers.1.self_attn")
        torch.set_default_dtype(torch.float32)
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.copy_(torch.randn(parameter.shape) * 0.3)
    for module in layer.modules():  # as vLLM's loader does (its CPU linear layers pick their kernel here)
        if getattr(module, "quant_method", None) is not None:
            module.quant_method.process_weights_after_loading(module)
    owners = [layer.main_cache, layer.indexer.pooled_key_cache, layer.indexer.open_window_cache]
    builders = {}
    for owner in owners:
        spec = owner.get_kv_cache_spec(vllm_config)
        rows = {0: BLOCK_SIZE, 1: BLOCK_SIZE // 4, 2: 4}[len(builders)]
        if owner is layer.main_cache:
            owner.kv_cache = torch.randn(NUM_BLOCKS, spec.num_kv_heads, BLOCK_SIZE, 2 * spec.head_size)
        elif owner.dtype == torch.uint8:
            owner.kv_cache = quantize_pooled_keys(torch.randn(NUM_BLOCKS, rows, 1, 32))
        else:
            owner.kv_cache = torch.randn(NUM_BLOCKS, rows, 1, owner.head_size)
        owner.kv_cache = owner.kv_cache.to(owner.dtype)
        builders[owner.prefix] = IndexPoolMetadataBuilder(spec, [owner.prefix], vllm_config, torch.device("cpu"))
    return layer, vllm_config, builders


def build_step(layer, builders, contexts: list[int], new_tokens: list[int], padding: int = 0,
               dummy: tuple[int, ...] = ()):
    """Positions and per-cache metadata of one step: request `i` has `contexts[i]` tokens cached and
    `new_tokens[i]` scheduled; `padding` tokens of no request follow. Request `i` owns blocks `1 + 16 i ..` in the
    paged caches (block 0 is the null block) and ring block `1 + i`; the requests in `dummy` own only the null block,
    as vLLM's warm-up and graph-capture requests do."""
    import torch
    from vllm.v1.attention.backend import CommonAttentionMetadata

    num_requests = len(contexts)
    query_lens = torch.tensor(new_tokens)
    starts = torch.cat([torch.zeros(1, dtype=torch.long), query_lens.cumsum(0)]).int()
    seq_lens = torch.tensor(contexts) + query_lens
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(contexts, new_tokens)])
    token_request = torch.repeat_interleave(torch.arange(num_requests), query_lens)
    paged = 1 + torch.arange(num_requests)[:, None] * 16 + torch.arange(16)
    ring_blocks = 1 + torch.arange(num_requests)[:, None]
    for request in dummy:
        paged[request], ring_blocks[request] = 0, 0
    main_slots = paged[token_request, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    num_tokens = len(positions) + padding
    tables = {layer.main_cache.prefix: paged, layer.indexer.pooled_key_cache.prefix: paged,
              layer.indexer.open_window_cache.prefix: ring_blocks}
    metadata = {}
    for name, builder in builders.items():
        common = CommonAttentionMetadata(
            query_start_loc=starts, query_start_loc_cpu=starts.clone(), seq_lens=seq_lens.int(),
            num_reqs=num_requests, num_actual_tokens=num_tokens, max_query_len=max(new_tokens),
            max_seq_len=int(seq_lens.max()), block_table_tensor=tables[name].int(),
            slot_mapping=torch.cat([main_slots, torch.full((padding,), -1)]),
        )
        metadata[name] = builder.build(0, common)
    return torch.cat([positions, torch.zeros(padding, dtype=torch.long)]), metadata


def run_layer(layer, vllm_config, positions, metadata, seed: int = 0):
    import torch
    from vllm.forward_context import set_forward_context

    hidden = torch.randn(len(positions), 128, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    with torch.no_grad(), set_forward_context(metadata, vllm_config):
        return layer(positions, hidden)


def fill_caches(layer, vllm_config, builders, contexts):
    """Prefill every request's context in one step, so that later steps read real pooled keys and ring rows."""
    positions, metadata = build_step(layer, builders, [0] * len(contexts), contexts)
    run_layer(layer, vllm_config, positions, metadata, seed=1)


def layer_guard() -> HostSyncGuard:
    """The guard, looking into the layer's custom operator (the step) rather than running it as one operator."""
    from hybrid_indexpool.serving import indexpool_attention

    return HostSyncGuard(look_into={"hybrid_indexpool_attention": indexpool_attention.hybrid_indexpool_attention})


def check_forward_makes_no_host_sync_and_keeps_its_shapes():
    layer, vllm_config, builders = build_layer()
    fill_caches(layer, vllm_config, builders, [max(a, b) for a, b in zip(CONTEXTS, LATER_CONTEXTS)])
    traces = []
    for contexts in (CONTEXTS, LATER_CONTEXTS):
        positions, metadata = build_step(layer, builders, contexts, NEW_TOKENS, padding=3)
        with layer_guard() as guard:
            output = run_layer(layer, vllm_config, positions, metadata)
        assert output.shape == (sum(NEW_TOKENS) + 3, 128)
        assert output.isfinite().all()
        traces.append(guard.trace)
    assert traces[0] == traces[1]  # the same operators with the same shapes at other context lengths
    decode_positions, decode_metadata = build_step(layer, builders, CONTEXTS, [1, 1, 1])
    with layer_guard() as guard:
        run_layer(layer, vllm_config, decode_positions, decode_metadata)
    print(f"operators in a 3-request decode step of one layer: {len(guard.trace)}")


def check_padding_and_dummy_requests_write_nothing(fp8_index_keys: bool):
    import torch

    layer, vllm_config, builders = build_layer(fp8_index_keys=fp8_index_keys)
    fill_caches(layer, vllm_config, builders, CONTEXTS)
    caches = [layer.main_cache, layer.indexer.pooled_key_cache, layer.indexer.open_window_cache]
    before = [owner.kv_cache.clone() for owner in caches]
    # A real decode and prefill chunk beside a dummy request, then padding: only the real requests' blocks change.
    positions, metadata = build_step(layer, builders, CONTEXTS, NEW_TOKENS, padding=3, dummy=(2,))
    run_layer(layer, vllm_config, positions, metadata)
    for owner, saved in zip(caches, before):
        assert torch.equal(owner.kv_cache[0], saved[0])  # the null block
        ring = owner is layer.indexer.open_window_cache
        assert torch.equal(owner.kv_cache[3 if ring else 33:], saved[3 if ring else 33:])  # the dummy's blocks
    # A step of dummy requests and padding only (a warm-up or capture run): nothing changes anywhere.
    before = [owner.kv_cache.clone() for owner in caches]
    positions, metadata = build_step(layer, builders, [5, 0], [1, 3], padding=2, dummy=(0, 1))
    run_layer(layer, vllm_config, positions, metadata)
    for owner, saved in zip(caches, before):
        assert torch.equal(owner.kv_cache, saved)


@pytest.mark.parametrize("fp8_index_keys", [False, True])
def test_padding_and_dummy_requests_write_nothing(fp8_index_keys):
    """Padding tokens and dummy requests (null-block rows, as in vLLM's capture runs) leave the null block and every
    block they do not own unchanged, in a step with real requests and in one without (pooled keys in the model's
    dtype or packed in fp8)."""
    run_in_fresh_process(__file__, "check_padding_and_dummy_requests_write_nothing", fp8_index_keys)


def test_forward_makes_no_host_sync_and_keeps_its_shapes():
    """After the builder ran, the whole forward of a mixed step (decodes, a prefill chunk inside windows, padding
    tokens) reads nothing from the device, and runs the same operators with the same shapes at other contexts."""
    run_in_fresh_process(__file__, "check_forward_makes_no_host_sync_and_keeps_its_shapes")


def check_compiled_step_matches_eager(backend: str):
    import torch

    layer, vllm_config, builders = build_layer()
    fill_caches(layer, vllm_config, builders, CONTEXTS)
    positions, metadata = build_step(layer, builders, CONTEXTS, NEW_TOKENS, padding=2)
    main, pooled, ring = (metadata[owner.prefix] for owner in (
        layer.main_cache, layer.indexer.pooled_key_cache, layer.indexer.open_window_cache))
    num_tokens = len(positions)
    generator = torch.Generator().manual_seed(0)
    def random(*shape):
        return torch.randn(num_tokens, *shape, generator=generator).to(torch.bfloat16)
    inputs = (random(4, 64), random(2, 64), random(2, 64), random(2, 32), random(64),
              torch.rand(num_tokens, 2, generator=generator), random(4, 64))
    caches = [layer.main_cache, layer.indexer.pooled_key_cache, layer.indexer.open_window_cache]
    before = [owner.kv_cache.clone() for owner in caches]
    with torch.no_grad():
        eager = layer.attend(*inputs, main, pooled, ring)
    eager_caches = [owner.kv_cache.clone() for owner in caches]
    for owner, saved in zip(caches, before):
        owner.kv_cache.copy_(saved)
    compiled_step = torch.compile(layer.attend, fullgraph=True, dynamic=False, backend=backend)
    with torch.no_grad():
        compiled = compiled_step(*inputs, main, pooled, ring)
    # The same operators (functionalized, the cache writes put back in place): the same bits.
    assert torch.equal(compiled, eager)
    for owner, expected in zip(caches, eager_caches):
        assert torch.equal(owner.kv_cache, expected)


def test_compiled_step_matches_eager():
    """The layer's batched step (`IndexPoolAttention.attend`, the body of its custom op) compiles as one graph
    (`torch.compile(fullgraph=True)`: Dynamo traces it without a break and AOTAutograd functionalizes its cache
    writes) and computes what the eager step does, caches included. (Inductor compiles the same graph too, in minutes
    on two cores, so the test stops at the traced graph.)"""
    run_in_fresh_process(__file__, "check_compiled_step_matches_eager", "aot_eager")


def check_selection_matches_reference(sink_windows: int, local_windows: int, tied: bool, fp8_index_keys: bool):
    import torch

    from hybrid_indexpool.kernels.pooled_index_topk.reference import pooled_index_topk_torch
    from hybrid_indexpool.serving.paged_step import PagedCaches, select_windows

    layer, vllm_config, builders = build_layer(sink_windows, local_windows, fp8_index_keys)
    fill_caches(layer, vllm_config, builders, CONTEXTS)
    positions, metadata = build_step(layer, builders, CONTEXTS, NEW_TOKENS)
    main = metadata[layer.main_cache.prefix]
    pooled = metadata[layer.indexer.pooled_key_cache.prefix]
    generator = torch.Generator().manual_seed(2)
    index_queries = torch.randn(len(positions), 2, 32, generator=generator).to(torch.bfloat16)
    if tied:  # every score 0 after the ReLU: the earliest windows win
        index_queries = -index_queries.abs()
        layer.indexer.pooled_key_cache.kv_cache.abs_()
    head_weights = torch.rand(len(positions), 2, generator=generator)
    pooled_cache = layer.indexer.pooled_key_cache.kv_cache
    # The decodes and the prefill chunk are two selection launches (one row per decode, tiles for the chunk).
    assert [tiles.tile_tokens.shape[1] for tiles in main.selection_tiles] == [1, 22]
    settings = layer.step_settings()
    assert settings.topk_windows == 4 and main.window_bound > 4  # scored, not the within-budget shortcut
    caches = PagedCaches(layer.main_cache.kv_cache, pooled_cache, layer.indexer.open_window_cache.kv_cache)
    selected = select_windows(index_queries, head_weights, caches, main, pooled, settings)
    start = 0
    for request, (context, count) in enumerate(zip(CONTEXTS, NEW_TOKENS)):
        windows = torch.arange((context + count) // 4)
        keys = pooled_cache[pooled.block_table[request, windows // (BLOCK_SIZE // 4)].long(),
                            windows % (BLOCK_SIZE // 4), 0]
        tokens = slice(start, start + count)
        expected = pooled_index_topk_torch(
            index_queries[None, tokens], keys[None], ((positions[tokens] + 1) // 4)[None], 4,
            head_weights[None, tokens], sink_windows=sink_windows, local_windows=local_windows)[0]
        assert torch.equal(selected[tokens], expected), (request, selected[tokens], expected)
        start += count


@pytest.mark.parametrize("sink_windows, local_windows, tied, fp8_index_keys",
                         [(0, 0, False, False), (1, 1, False, False), (0, 0, True, False), (0, 0, False, True)])
def test_selection_matches_reference(sink_windows, local_windows, tied, fp8_index_keys):
    """The batched selection over the paged pooled keys picks exactly the windows of the reference selection over the
    request's keys laid out in order (`pooled_index_topk_torch`, fixed-shape path), with forced sink and local
    windows, with every score tied, and on packed fp8 keys."""
    run_in_fresh_process(__file__, "check_selection_matches_reference", sink_windows, local_windows, tied,
                         fp8_index_keys)


def check_gpu_graph_settings_bound_each_step_by_its_queries():
    import tempfile

    import torch
    from vllm.config import CacheConfig, CompilationConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.attention.backend import CommonAttentionMetadata

    from hybrid_indexpool.configuration import HybridIndexPoolConfig
    from hybrid_indexpool.serving import register
    from hybrid_indexpool.serving.indexpool_attention import IndexPoolMetadataBuilder
    from hybrid_indexpool.serving.memory import main_kv_spec
    from hybrid_indexpool.serving.paged_step import selection_work

    register()
    folder = tempfile.mkdtemp()
    max_model_len, block_size = 1 << 20, 256
    HybridIndexPoolConfig(
        vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        layer_types=["linear_attention", "indexpool_attention"], num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, index_n_heads=2, index_head_dim=32, index_topk=2048, index_pool_size=4,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
        max_position_embeddings=max_model_len, architectures=["HybridIndexPoolForCausalLM"],
    ).save_pretrained(folder)
    vllm_config = VllmConfig(
        model_config=ModelConfig(model=folder, dtype="bfloat16", skip_tokenizer_init=True, max_model_len=max_model_len),
        cache_config=CacheConfig(block_size=block_size),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=16384, max_num_seqs=256, max_model_len=max_model_len,
                                         is_encoder_decoder=False),
        compilation_config=CompilationConfig(max_cudagraph_capture_size=512),
    )
    compilation = vllm_config.compilation_config
    # vLLM's CPU platform turns graphs off; a GPU's model runner resolves the default to this.
    compilation.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    spec = main_kv_spec(2, 64, block_size)
    builder = IndexPoolMetadataBuilder(spec, ["model.layers.1.self_attn.attn"], vllm_config, torch.device("cpu"))

    def build(contexts, new_tokens):
        query_lens = torch.tensor(new_tokens)
        starts = torch.cat([torch.zeros(1, dtype=torch.long), query_lens.cumsum(0)]).int()
        seq_lens = (torch.tensor(contexts) + query_lens).int()
        blocks = -(-int(seq_lens.max()) // block_size)
        table = (1 + torch.arange(len(contexts) * blocks).view(len(contexts), blocks)).int()
        positions = torch.cat([torch.arange(c, c + n) for c, n in zip(contexts, new_tokens)])
        request = torch.repeat_interleave(torch.arange(len(contexts)), query_lens)
        slots = table[request, positions // block_size].long() * block_size + positions % block_size
        common = CommonAttentionMetadata(
            query_start_loc=starts, query_start_loc_cpu=starts.clone(), seq_lens=seq_lens, num_reqs=len(contexts),
            num_actual_tokens=len(positions), max_query_len=max(new_tokens), max_seq_len=int(seq_lens.max()),
            block_table_tensor=table, slot_mapping=slots, seq_lens_cpu_upper_bound=seq_lens.clone())
        metadata = builder.build(0, common)
        visible = int(((positions + 1) // 4).sum())
        return metadata, selection_work(metadata, 512), visible

    for contexts, new_tokens in (([0], [8192]), ([8192] * 63 + [0], [1] * 63 + [8192])):
        _, work, visible = build(contexts, new_tokens)
        assert work["rows"] <= sum(new_tokens) + 64 and visible <= work["scores"] <= 2 * visible, (work, visible)
    # 64 decodes: a full graph replays them, at the captured bound ...
    metadata, work, visible = build([8192] * 64, [1] * 64)
    assert metadata.window_bound == max_model_len // 4 and work["rows"] == 64
    # ... unless the runner resolved the mode to piecewise graphs only: read at each step, not when built.
    compilation.cudagraph_mode = CUDAGraphMode.PIECEWISE
    metadata, work, visible = build([8192] * 64, [1] * 64)
    assert work == {"rows": 64, "scores": visible}, (work, visible)
    print("scores per step within 2x of the visible windows under FULL_AND_PIECEWISE")


def test_gpu_graph_settings_bound_each_step_by_its_queries():
    """The builder through vLLM's own config objects, with a GPU's default graph mode (FULL_AND_PIECEWISE, captured
    sizes up to 512) and a 1M-token model at r = 4: an 8K prefill chunk and a mixed step score at most twice their
    queries' visible windows, one row per decode; only the uniform decode batch a full graph replays keeps the
    captured bound, and the mode is read at each step (a runner that resolves it to PIECEWISE later is followed)."""
    run_in_fresh_process(__file__, "check_gpu_graph_settings_bound_each_step_by_its_queries")


def check_binding_advises_the_caches_into_huge_pages():
    import torch

    from hybrid_indexpool.serving.huge_pages import anon_huge_page_bytes, transparent_huge_page_mode

    layer, _, _ = build_layer()
    main, pooled = layer.main_cache, layer.indexer.pooled_key_cache
    # As vLLM's CPU worker allocates them: one zeroed int8 buffer under every cache, each a view of it, the pooled keys
    # as `[blocks, 1, rows, width]` (vLLM's compressed-key cache binds them transposed).
    buffer = torch.zeros(12 << 20, dtype=torch.int8)
    main_shape, pooled_shape = main.kv_cache.shape, pooled.kv_cache.shape
    main_view = buffer[:main.kv_cache.nbytes].view(main.kv_cache.dtype).view(main_shape)
    pooled_view = buffer[-pooled.kv_cache.nbytes:].view(pooled.kv_cache.dtype).view(
        pooled_shape[0], 1, pooled_shape[1], pooled_shape[3])
    main_view.copy_(main.kv_cache)
    saved = main_view.clone()
    main.bind_kv_cache(main_view)
    pooled.bind_kv_cache(pooled_view)
    assert main.kv_cache is main_view and torch.equal(main.kv_cache, saved)
    assert pooled.kv_cache.shape == pooled_shape and pooled.kv_cache.data_ptr() == pooled_view.data_ptr()
    for owner in (main, pooled):
        # The whole shared buffer, whichever view was bound.
        assert owner.huge_pages.advised_bytes >= buffer.nbytes - (4 << 20)
        assert owner.huge_pages.collapsed or owner.huge_pages.reason
    # Granted where the system has THP (this machine: `madvise`, Linux 6.18).
    if transparent_huge_page_mode() in ("always", "madvise"):
        assert main.huge_pages.collapsed and pooled.huge_pages.collapsed, main.huge_pages.reason
        assert anon_huge_page_bytes(buffer) >= main.huge_pages.advised_bytes


def test_binding_advises_the_caches_into_huge_pages():
    """vLLM binding a CPU cache to the main and pooled-key cache owners moves the buffer under it (which vLLM shares
    between all layers) into transparent huge pages, its contents unchanged (`huge_pages.advise_huge_pages`)."""
    run_in_fresh_process(__file__, "check_binding_advises_the_caches_into_huge_pages")
