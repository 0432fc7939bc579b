"""The indexer's GLM-5.3-Flash variant against transformers' `Glm5NextTextIndexer` (pooled keys and the tokens it
selects), and shared-indexer layers in the GQA shape."""

import pytest
import torch
from model_factory import tiny_config, tiny_model

from hybrid_indexpool.modeling.indexer import HybridIndexPoolIndexer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

GLM_INDEXER_TO_OURS = {
    "wq_b.weight": "q_proj.weight",
    "wk.weight": "k_proj.weight",
    "k_norm.weight": "k_norm.weight",
    "k_norm.bias": "k_norm.bias",
    "weights_proj.weight": "head_weights_proj.weight",
    "index_kpool_compress_gate": "pool_gate_proj.weight",
    "index_kpool_compress_ape": "pool_slot_bias",
}


def glm_and_our_indexer(pool_size: int, topk: int):
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextIndexer

    config = tiny_config(attention_type="mla", q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16,
                         index_n_heads=16, index_head_dim=16, index_pool_size=pool_size, index_topk=topk,
                         index_head_weights=True, index_query_source="q_lora",
                         index_key_norm="layer_norm_before_pool", index_rope=False)
    glm_config = Glm5NextTextConfig(hidden_size=config.hidden_size, q_lora_rank=32, index_n_heads=16,
                                    index_head_dim=16, index_topk=topk, index_kpool=pool_size, num_hidden_layers=1,
                                    layer_types=["indexed_attention"], mlp_layer_types=["dense"])
    torch.manual_seed(0)
    glm = Glm5NextTextIndexer(glm_config, 0).eval()
    with torch.no_grad():
        for name, parameter in glm.named_parameters():
            scale = 0.5 if name.startswith(("k_norm", "index_kpool")) else parameter.shape[-1] ** -0.5
            parameter.copy_(torch.randn_like(parameter) * scale + (1.0 if name == "k_norm.weight" else 0.0))
    ours = HybridIndexPoolIndexer(config).eval()
    source = glm.state_dict()
    ours.load_state_dict({ours_name: source[name] for name, ours_name in GLM_INDEXER_TO_OURS.items()}, strict=True)
    return config, glm, ours


@pytest.mark.parametrize("pool_size, topk, length", [(4, 8, 41), (16, 32, 100)])
@torch.no_grad()
def test_pooled_keys_and_selected_tokens_match_glms_indexer_with_left_padding(pool_size, topk, length):
    from hybrid_indexpool.kernels.pooled_index_topk import pooled_index_topk_torch

    config, glm, ours = glm_and_our_indexer(pool_size, topk)
    hidden = torch.randn(2, length, config.hidden_size)
    query_latent = torch.randn(2, length, config.q_lora_rank)
    mask = torch.ones(2, length, dtype=torch.bool)
    padding = pool_size + 2
    mask[1, :padding] = False
    glm_tokens = glm(hidden, query_latent, mask, None)
    keys = glm.k_norm(glm.wk(hidden))
    gates = torch.nn.functional.linear(hidden, glm.index_kpool_compress_gate)
    glm_pooled, _, glm_pool_valid = glm.get_pooled_states(torch.cat([keys, gates, mask[..., None].float()], -1))
    queries, raw_keys, gate_logits, head_weights = ours(hidden, None, None, query_latent)
    for row, first in enumerate((0, padding)):
        real = slice(first, length)
        num_windows = (length - first) // pool_size
        window_keys = raw_keys[row, real][: num_windows * pool_size].unflatten(0, (num_windows, pool_size))
        window_logits = gate_logits[row, real][: num_windows * pool_size].unflatten(0, (num_windows, pool_size))
        pooled = ours.pool_windows(window_keys[None], window_logits[None], None)[0]
        assert int(glm_pool_valid[row].sum()) == num_windows
        torch.testing.assert_close(pooled, glm_pooled[row, :num_windows], atol=1e-5, rtol=1e-5)
        positions = torch.arange(length - first)
        num_visible = ((positions + 1) // pool_size)[None]
        selected = pooled_index_topk_torch(queries[row:row + 1, real], pooled[None], num_visible,
                                           topk // pool_size, head_weights[row:row + 1, real])[0]
        for query in range(length - first):
            windows = selected[query][selected[query] >= 0]
            expected = {int(token) - first for token in glm_tokens[row, first + query] if token >= 0}
            tail_start = (query + 1) // pool_size * pool_size
            attended = {int(w) * pool_size + j for w in windows for j in range(pool_size)}
            assert attended | set(range(tail_start, query + 1)) == expected, (row, query)


def test_gqa_shared_indexer_layers_reuse_the_selection_through_chunked_prefill_and_decode():
    model = tiny_model(num_hidden_layers=8, indexer_types=["full"] * 4 + ["shared"] * 4, prefill_chunk_length=16)
    assert model.model.layers[7].self_attn.indexer is None and model.model.layers[3].self_attn.indexer is not None
    input_ids = torch.randint(1, 97, (2, 44))
    mask = torch.ones_like(input_ids)
    mask[0, :5] = 0
    with torch.no_grad():
        whole = model(input_ids, attention_mask=mask, use_cache=False).logits
        prefill = model(input_ids[:, :37], attention_mask=mask[:, :37], use_cache=True)
        steps, cache = [prefill.logits], prefill.cache
        for t in range(37, 44):
            steps.append(model(input_ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=cache).logits)
    torch.testing.assert_close(torch.cat(steps, dim=1)[mask.bool()], whole[mask.bool()], atol=1e-4, rtol=0)
    shared_layer = cache.layers[7]
    assert shared_layer.pooled_storage is None and shared_layer.open_index_keys is None
    assert cache.layers[3].pooled_storage is not None
