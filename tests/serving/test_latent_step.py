"""The MLA IndexPool step of GLM-5.3-Flash conversions (`serving/latent_step.py`, what the vLLM layer runs over its
latent, pooled-key and ring pages) against the transformers layers, on CPU without vLLM: a layer with GLM's indexer
(queries from the query latent, LayerNorm-ed keys pooled by a learned gate, head weights, no RoPE) and a shared-indexer
layer after it, two requests split into chunks across steps beyond the budget, give each request's outputs as the
layers give them over the whole sequence (float32)."""

import torch

from hybrid_indexpool import HybridIndexPoolConfig
from hybrid_indexpool.modeling.attention_mla import HybridIndexPoolMLAAttention
from hybrid_indexpool.serving.latent_step import LatentCaches, LatentStepSettings, latent_indexpool_step
from hybrid_indexpool.serving.paged_step import PagedMetadataBuilder

R, BLOCK_SIZE, MAX_MODEL_LEN = 4, 8, 64
LENGTHS = [30, 13]
STEPS = [[17, 5], [13, 6], [0, 2]]  # tokens of each request scheduled per step (chunks end inside windows)
CONFIG = HybridIndexPoolConfig(
    hidden_size=32, num_hidden_layers=2, layer_types=["indexpool_attention"] * 2, indexer_types=["full", "shared"],
    attention_type="mla", q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, v_head_dim=8, num_attention_heads=4,
    num_key_value_heads=4, head_dim=16, index_n_heads=4, index_head_dim=8, index_topk=8, index_pool_size=R,
    index_query_source="q_lora", index_key_norm="layer_norm_before_pool", index_rope=False, index_head_weights=True,
    rms_norm_unit_offset=False)


def served_layer_step(layer, hidden, selection, caches, metadata):
    """One MLA layer's step with the transformers layer's projections, as `vllm_mla.IndexPoolMLAAttention` runs it."""
    num_tokens = hidden.shape[0]
    query_latent = layer.q_a_layernorm(layer.q_a_proj(hidden))
    latent = layer.kv_a_layernorm(layer.kv_a_proj_with_mqa(hidden))
    query = layer.q_b_proj(query_latent).view(num_tokens, -1, layer.qk_head_dim)
    key_weight, value_weight = layer.per_head_weights()
    index_queries = ring_rows = head_weights = None
    indexer = layer.indexer
    if indexer is not None:
        index_queries = indexer.q_proj(query_latent).view(num_tokens, indexer.num_heads, indexer.head_dim)
        ring_rows = torch.cat([indexer.k_norm(indexer.k_proj(hidden)), indexer.pool_gate_proj(hidden)], dim=-1)
        head_weights = indexer.head_weights_proj(hidden).float() * indexer.num_heads**-0.5
    settings = LatentStepSettings(
        pool_size=R, topk_windows=layer.topk_windows, sink_windows=0, local_windows=0, scaling=layer.scaling,
        weighting=CONFIG.index_pool_weighting, pool_slot_bias=None if indexer is None else indexer.pool_slot_bias)
    attended = latent_indexpool_step(torch.einsum("thn,hnc->thc", query, key_weight), latent, index_queries,
                                     ring_rows, head_weights, selection, caches, metadata["main"],
                                     metadata["pooled_keys"], metadata["open_window"], settings)
    return layer.o_proj(torch.einsum("thc,hvc->thv", attended, value_weight).flatten(1))


def step_metadata(done, scheduled, block_table, ring_table):
    """The three caches' metadata of a step scheduling `scheduled[i]` tokens of request `i` after its `done[i]`."""
    requests = [i for i, count in enumerate(scheduled) if count]
    counts = torch.tensor([scheduled[i] for i in requests])
    starts = torch.cat([torch.zeros(1, dtype=torch.int32), counts.cumsum(0).int()])
    seq_lens = torch.tensor([done[i] + scheduled[i] for i in requests], dtype=torch.int32)
    positions = torch.cat([torch.arange(done[i], done[i] + scheduled[i]) for i in requests])
    token_request = torch.repeat_interleave(torch.arange(len(requests)), counts)
    tables = {"main": block_table[requests], "pooled_keys": block_table[requests], "open_window": ring_table[requests]}
    slots = tables["main"][token_request, positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE
    num_tokens = int(counts.sum())
    metadata = {}
    for kind, table in tables.items():
        builder = PagedMetadataBuilder(kind, R, R if kind == "open_window" else BLOCK_SIZE, MAX_MODEL_LEN, num_tokens,
                                       len(requests), torch.device("cpu"))
        metadata[kind] = builder.build(num_tokens, len(requests), starts, starts, seq_lens, table, slots,
                                       int(counts.max()), int(seq_lens.max()), seq_lens_cpu=seq_lens)
    return requests, metadata


def test_chunked_steps_over_pages_match_the_transformers_layers():
    torch.manual_seed(0)
    full, shared = (HybridIndexPoolMLAAttention(CONFIG, index).eval() for index in range(2))
    with torch.no_grad():
        for parameter in [*full.parameters(), *shared.parameters()]:
            parameter.copy_(torch.randn(parameter.shape) * 0.3)
    hidden = [torch.randn(length, CONFIG.hidden_size) for length in LENGTHS]
    with torch.no_grad():
        expected = []
        for states in hidden:
            positions = torch.arange(len(states))[None]
            arguments = (states[None], (None, None), positions, positions[None], torch.ones_like(positions, dtype=bool))
            out, _, _, selection = full(*arguments)
            assert selection is not None  # beyond the budget: windows are selected, not dense attention
            expected.append((out[0], shared(*arguments, shared_selection=selection)[0][0]))

    # Pages in a scrambled order (block 0 is the null block), NaN wherever nothing was written.
    blocks_per_request = [-(-length // BLOCK_SIZE) for length in LENGTHS]
    order = 1 + torch.randperm(sum(blocks_per_request))
    block_table = torch.zeros(len(LENGTHS), max(blocks_per_request), dtype=torch.int32)
    block_table[0, :blocks_per_request[0]], block_table[1, :blocks_per_request[1]] = (
        order[:blocks_per_request[0]].int(), order[blocks_per_request[0]:].int())
    ring_table = torch.tensor([[2], [1]], dtype=torch.int32)
    num_blocks = 1 + sum(blocks_per_request)
    nan = float("nan")
    caches = [LatentCaches(torch.full((num_blocks, 1, BLOCK_SIZE, CONFIG.kv_lora_rank), nan),
                           torch.full((num_blocks, BLOCK_SIZE // R, 1, CONFIG.index_head_dim), nan),
                           torch.full((3, R, 1, 2 * CONFIG.index_head_dim), nan)),
              LatentCaches(torch.full((num_blocks, 1, BLOCK_SIZE, CONFIG.kv_lora_rank), nan))]

    done, outputs = [0, 0], [([], []) for _ in LENGTHS]
    with torch.no_grad():
        for scheduled in STEPS:
            requests, metadata = step_metadata(done, scheduled, block_table, ring_table)
            rows = torch.cat([hidden[i][done[i]: done[i] + scheduled[i]] for i in requests])
            selection = torch.full((len(rows), CONFIG.index_topk_windows), -1)
            served = [served_layer_step(layer, rows, selection, layer_caches, metadata)
                      for layer, layer_caches in zip((full, shared), caches)]
            counts = [scheduled[i] for i in requests]
            for layer_index, output in enumerate(served):
                for request, piece in zip(requests, output.split(counts)):
                    outputs[request][layer_index].append(piece)
            for i in requests:
                done[i] += scheduled[i]
    assert done == LENGTHS
    for request, (full_pieces, shared_pieces) in enumerate(outputs):
        torch.testing.assert_close(torch.cat(full_pieces), expected[request][0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(torch.cat(shared_pieces), expected[request][1], rtol=1e-4, atol=1e-5)
