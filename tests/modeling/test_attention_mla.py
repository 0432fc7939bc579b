"""The MLA IndexPool layer against transformers' GLM-5.3-Flash attention (`Glm5NextTextAttention`, with its DSA
k-pool indexer), weights copied in: prompts several times the budget, left padding, chunked prefill, decode steps
and shared-indexer layers. GLM selects token indices and builds a dense mask; ours selects windows: the outputs say
whether the two attend to the same tokens."""

import pytest
import torch
from model_factory import tiny_config

from hybrid_indexpool.kernels.sparse_attention import sparse_attention_torch, sparse_latent_attention_torch
from hybrid_indexpool.modeling import modeling_hybrid_indexpool as modeling
from hybrid_indexpool.modeling.attention_mla import HybridIndexPoolMLAAttention
from hybrid_indexpool.modeling.cache_hybrid_indexpool import IndexPoolLayerCache

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

# GLM names -> ours inside one attention layer; RMSNorm weights are shifted by one (ours scale by 1 + w).
GLM_TO_OURS = {
    "q_a_proj.weight": "q_a_proj.weight",
    "q_b_proj.weight": "q_b_proj.weight",
    "kv_a_proj_with_mqa.weight": "kv_a_proj_with_mqa.weight",
    "kv_b_proj.weight": "kv_b_proj.weight",
    "o_proj.weight": "o_proj.weight",
    "indexer.wq_b.weight": "indexer.q_proj.weight",
    "indexer.wk.weight": "indexer.k_proj.weight",
    "indexer.k_norm.weight": "indexer.k_norm.weight",
    "indexer.k_norm.bias": "indexer.k_norm.bias",
    "indexer.weights_proj.weight": "indexer.head_weights_proj.weight",
    "indexer.index_kpool_compress_gate": "indexer.pool_gate_proj.weight",
    "indexer.index_kpool_compress_ape": "indexer.pool_slot_bias",
}
GLM_RMS_NORMS = {"q_a_layernorm.weight": "q_a_layernorm.weight", "kv_a_layernorm.weight": "kv_a_layernorm.weight"}


def mla_config(pool_size: int, topk: int, indexer_types=None, num_layers: int = 1):
    """GLM's variant at toy sizes. 16 index heads: a window scores exactly 0 only when every head's ReLU is 0
    (probability 2^-16 here, 1/16 with 4 heads), and such ties at the cut would be broken differently (ours: the
    lower window; GLM: `torch.topk`'s arbitrary order)."""
    return tiny_config(
        num_hidden_layers=num_layers, layer_types=["indexpool_attention"] * num_layers, attention_type="mla",
        num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16,
        index_n_heads=16, index_head_dim=16, index_pool_size=pool_size, index_topk=topk, index_head_weights=True,
        index_query_source="q_lora", index_key_norm="layer_norm_before_pool", index_rope=False,
        indexer_types=indexer_types,
    )


def glm_layers(config, seed: int = 0):
    """GLM attention layers of the same sizes with random weights (norms, gate and slot bias included)."""
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextAttention

    num_layers = config.num_hidden_layers
    glm_config = Glm5NextTextConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_attention_heads,
        q_lora_rank=config.q_lora_rank, kv_lora_rank=config.kv_lora_rank, qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=0, v_head_dim=config.v_head_dim, index_n_heads=config.index_n_heads,
        index_head_dim=config.index_head_dim, index_topk=config.index_topk, index_kpool=config.index_pool_size,
        layer_types=["indexed_attention"] * num_layers, indexer_types=config.indexer_types or ["full"] * num_layers,
        mlp_layer_types=["dense"] * num_layers, rms_norm_eps=config.rms_norm_eps,
    )
    glm_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    layers = [Glm5NextTextAttention(glm_config, index).eval() for index in range(num_layers)]
    with torch.no_grad():
        for layer in layers:
            for name, parameter in layer.named_parameters():
                if name.endswith("layernorm.weight") or name.endswith("k_norm.weight"):
                    parameter.copy_(1 + 0.3 * torch.randn_like(parameter))
                elif name.endswith("k_norm.bias") or "index_kpool" in name:
                    parameter.copy_(0.5 * torch.randn_like(parameter))
                else:
                    parameter.copy_(torch.randn_like(parameter) * parameter.shape[-1] ** -0.5)
    return layers


def our_layers(config, glm):
    """Our model's attention layers with GLM's weights, and its rotary embedding."""
    model = modeling.HybridIndexPoolModel(config).eval()
    layers = [decoder.self_attn for decoder in model.layers]
    for ours, theirs in zip(layers, glm):
        source = theirs.state_dict()
        state = {our_name: source[name] for name, our_name in GLM_TO_OURS.items() if name in source}
        state.update({our_name: source[name] - 1 for name, our_name in GLM_RMS_NORMS.items()})
        missing, unexpected = ours.load_state_dict(state, strict=True), None
        assert not missing.missing_keys and not missing.unexpected_keys, (missing, unexpected)
    return layers, model.rotary_emb


def run_ours(layers, rotary, hidden, mask, chunks=None, share=True):
    """Our layers stacked as `h + attention(h)`, over the whole input or in `chunks` (lengths), with a cache (which
    stores by position: left padding as it is; without a cache the layers expect each row's real tokens first, as the
    model lays them out); without `share`, shared layers get no selection (and attend densely)."""
    positions = (mask.long().cumsum(dim=1) - 1).clamp(min=0)
    chunks = chunks or [hidden.shape[1]]
    caches = [IndexPoolLayerCache(layers[0].pool_size) for _ in layers]
    outputs, start = [], 0
    for length in chunks:
        piece = slice(start, start + length)
        states, real, chunk_positions = hidden[:, piece], mask[:, piece], positions[:, piece]
        embeddings = rotary(states, chunk_positions)
        selection = None
        for layer, cache in zip(layers, caches):
            attended, _, _, layer_selection = layer(states, embeddings, chunk_positions, chunk_positions[None], real,
                                                    cache, shared_selection=selection if share else None)
            if layer.indexer is not None:
                selection = layer_selection
            states = states + attended
        outputs.append(states)
        start += length
    return torch.cat(outputs, dim=1)


def run_glm(layers, hidden, mask):
    states, selection = hidden, None
    for layer in layers:
        attended, _, shared = layer(states, mask, prev_topk_indices=selection)
        selection = shared if shared is not None else selection
        states = states + attended
    return states


def prompts(config, length: int, padding: int, seed: int = 1):
    """Two rows, the second left-padded by `padding` tokens."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, length, config.hidden_size, generator=generator)
    mask = torch.ones(2, length, dtype=torch.bool)
    mask[1, :padding] = False
    return hidden, mask


@pytest.mark.parametrize("pool_size, topk, length", [(4, 8, 45), (16, 32, 117)])
def test_matches_glm_attention_beyond_the_budget_with_left_padding(pool_size, topk, length):
    config = mla_config(pool_size, topk)
    glm = glm_layers(config)
    ours, rotary = our_layers(config, glm)
    hidden, mask = prompts(config, length, padding=pool_size + 3)
    with torch.no_grad():
        expected = run_glm(glm, hidden, mask)
        output = run_ours(ours, rotary, hidden, mask)
    torch.testing.assert_close(output[mask], expected[mask], atol=1e-4, rtol=0)


@pytest.mark.parametrize("pool_size, topk, length, chunks", [
    (4, 8, 45, [13, 9, 1, 1, 1, 1, 19]),
    (16, 32, 117, [50, 17, 1, 1, 1, 1, 1, 45]),
])
def test_chunked_prefill_and_decode_steps_match_glm(pool_size, topk, length, chunks):
    config = mla_config(pool_size, topk)
    glm = glm_layers(config, seed=2)
    ours, rotary = our_layers(config, glm)
    hidden, mask = prompts(config, length, padding=5, seed=3)
    with torch.no_grad():
        expected = run_glm(glm, hidden, mask)
        output = run_ours(ours, rotary, hidden, mask, chunks)
    torch.testing.assert_close(output[mask], expected[mask], atol=1e-4, rtol=0)


@pytest.mark.parametrize("chunks", [None, [30, 1, 1, 1, 12]])
def test_shared_layer_reuses_the_full_layers_selection_as_glm_does(chunks):
    config = mla_config(4, 8, indexer_types=["full", "shared"], num_layers=2)
    glm = glm_layers(config, seed=4)
    ours, rotary = our_layers(config, glm)
    assert ours[1].indexer is None and glm[1].indexer is None
    hidden, mask = prompts(config, 45, padding=6, seed=5)
    with torch.no_grad():
        expected = run_glm(glm, hidden, mask)
        output = run_ours(ours, rotary, hidden, mask, chunks)
        # The shared layer really attends sparsely: attending densely gives another output.
        dense_second = run_ours(ours, rotary, hidden, mask, share=False)
    torch.testing.assert_close(output[mask], expected[mask], atol=1e-4, rtol=0)
    assert (output[mask] - dense_second[mask]).abs().max() > 1e-3


def test_absorbed_latent_attention_equals_the_expanded_attention():
    config = mla_config(4, 8)
    ours, _ = our_layers(config, glm_layers(config, seed=6))
    layer = ours[0]
    generator = torch.Generator().manual_seed(7)
    batch, num_queries, num_positions = 2, 5, 40
    query = torch.randn(batch, config.num_attention_heads, num_queries, layer.qk_head_dim, generator=generator)
    latents = torch.randn(batch, 1, num_positions, config.kv_lora_rank, generator=generator)
    positions = torch.tensor([[20, 27, 33, 38, 39], [9, 18, 26, 31, 35]])
    selected = torch.tensor([[0, 3], [1, 4], [2, 7], [5, 8], [-1, 6]])[None].repeat(batch, 1, 1)
    selected[1] = torch.tensor([[0, 1], [2, 3], [0, 5], [6, -1], [7, 8]])
    key_weight, value_weight = layer.kv_b_proj.weight.unflatten(0, (config.num_attention_heads, -1)).split(
        [layer.qk_nope_head_dim, layer.v_head_dim], dim=1)
    with torch.no_grad():
        key, value = layer.expand_latents(latents)
        expected, _ = sparse_attention_torch(query, key, value, selected, positions, 4, layer.scaling)
        attended, _ = sparse_latent_attention_torch(torch.einsum("bhtn,hnc->bhtc", query, key_weight), latents,
                                                    selected, positions, 4, layer.scaling)
        output = torch.einsum("bthc,hvc->bthv", attended, value_weight)
    torch.testing.assert_close(output, expected, atol=1e-5, rtol=1e-5)


def test_cache_keeps_one_latent_per_token_and_no_indexer_state_in_shared_layers():
    config = mla_config(4, 8, indexer_types=["full", "shared"], num_layers=2)
    ours, rotary = our_layers(config, glm_layers(config, seed=8))
    hidden, mask = prompts(config, 22, padding=3, seed=9)
    caches = [IndexPoolLayerCache(4) for _ in ours]
    embeddings = rotary(hidden, (mask.long().cumsum(1) - 1).clamp(min=0))
    positions = (mask.long().cumsum(1) - 1).clamp(min=0)
    selection = None
    with torch.no_grad():
        for layer, cache in zip(ours, caches):
            _, _, _, out = layer(hidden, embeddings, positions, positions[None], mask, cache,
                                 shared_selection=selection)
            selection = out if layer.indexer is not None else selection
    full, shared = caches
    assert full.key_storage.shape[2:] == (1, config.kv_lora_rank) and full.value_storage is None
    assert full.pooled_storage is not None and shared.pooled_storage is None and shared.open_index_keys is None
    torch.testing.assert_close(full.lengths, torch.tensor([22, 19]))
    torch.testing.assert_close(shared.lengths, full.lengths)  # one latent per token, by position
    assert shared.key_storage.shape[2:] == (1, config.kv_lora_rank) and shared.value_storage is None
    assert shared.open_gate_logits is None and shared.open_window_position is None


def glm_like_model(seed: int = 0):
    """A whole tiny model with MLA IndexPool layers, GLM's indexer options and a shared-indexer layer."""
    from model_factory import randomize_indexer

    config = mla_config(4, 8, num_layers=8, indexer_types=["full"] * 7 + ["shared"])
    config.layer_types = ["linear_attention", "linear_attention", "linear_attention", "indexpool_attention"] * 2
    config.prefill_chunk_length = 16
    torch.manual_seed(seed)
    model = modeling.HybridIndexPoolForCausalLM(config).eval()
    randomize_indexer(model, seed)
    return model


def test_whole_model_runs_forward_chunked_decode_generate_and_backward():
    model = glm_like_model()
    assert isinstance(model.model.layers[7].self_attn, HybridIndexPoolMLAAttention)
    assert model.model.layers[7].self_attn.indexer is None
    input_ids = torch.randint(1, 97, (2, 40))
    mask = torch.ones_like(input_ids)
    mask[1, :6] = 0
    with torch.no_grad():
        whole = model(input_ids, attention_mask=mask, use_cache=False).logits
        prefill = model(input_ids[:, :33], attention_mask=mask[:, :33], use_cache=True)  # two prefill chunks
        steps, cache = [prefill.logits], prefill.cache
        for t in range(33, 40):
            step = model(input_ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=cache, use_cache=True)
            steps.append(step.logits)
        tokens = model.generate(input_ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    real = mask.bool()
    torch.testing.assert_close(torch.cat(steps, dim=1)[real], whole[real], atol=1e-4, rtol=0)
    assert tokens.shape == (2, 46)

    model.train()
    output = model(input_ids, attention_mask=mask, labels=input_ids, indexer_loss="sparse")
    output.loss.backward()
    attention = model.model.layers[3].self_attn
    for parameter in (attention.q_a_proj.weight, attention.kv_b_proj.weight, attention.indexer.q_proj.weight,
                      attention.indexer.k_norm.bias, attention.indexer.pool_slot_bias):
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0


def test_saves_and_loads_through_remote_code(tmp_path):
    import runpy
    import subprocess
    import sys
    from pathlib import Path

    from hybrid_indexpool.tokenization import byte_level_tokenizer

    # The loader script of the hub-export tests: the model loads and generates where the package is not importable.
    load_without_package = runpy.run_path(str(Path(__file__).with_name("test_hub_export.py")))["LOAD_WITHOUT_PACKAGE"]

    model = glm_like_model(seed=1)
    folder = tmp_path / "checkpoint"
    model.save_pretrained(folder)
    byte_level_tokenizer().save_pretrained(folder)
    input_ids = torch.randint(1, 97, (2, 30))
    torch.save(input_ids, tmp_path / "input.pt")
    env = {"HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [sys.executable, "-c", load_without_package, str(folder), str(tmp_path / "input.pt"), "hybrid_indexpool"],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    remote = torch.load(tmp_path / "input.pt.out")
    with torch.no_grad():
        torch.testing.assert_close(remote["logits"], model(input_ids).logits, atol=0, rtol=0)
        assert torch.equal(remote["tokens"], model.generate(input_ids, max_new_tokens=8, do_sample=False))
