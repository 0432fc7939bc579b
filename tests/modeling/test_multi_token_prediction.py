"""Multi-token prediction: both MTP variants against their definition written out step by step, padding and packing,
the loss and its gradients, saving and loading, and the refusals."""

import pytest
import torch
import torch.nn.functional as F
from model_factory import KIMI_DELTA, MLA, randomize_parameters, tiny_model

from hybrid_indexpool import HybridIndexPoolForCausalLM
from hybrid_indexpool.modeling.token_layout import TokenLayout

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

QWEN4_MTP = dict(num_mtp_layers=2, mtp_type="qwen4_exp", hc_count=3, hc_lowrank=8, num_experts=4,
                 moe_intermediate_size=32)
GLM_MTP = dict(num_mtp_layers=1, hc_type="sinkhorn", hc_count=2, **MLA, **KIMI_DELTA)


def mtp_model(seed=0, **overrides) -> HybridIndexPoolForCausalLM:
    """A tiny MTP model whose norms (zero-centred, so they start as the identity) are random."""
    model = tiny_model(seed, **overrides)
    randomize_parameters(model, lambda name: "mtp" in name and "norm" in name, seed + 1, 0.3)
    return model


def run_block(model, layer, hidden_states):
    """One decoder layer of `model` over an unpadded row `[1, seq, width]` on its own (no cache, positions from 0)."""
    tokens = TokenLayout.of_sequences(torch.arange(hidden_states.shape[1])[None])
    return layer(hidden_states, model.model.position_embeddings(hidden_states, tokens), tokens)[0]


@pytest.mark.parametrize("settings", [dict(num_mtp_layers=2), GLM_MTP], ids=["gqa", "glm"])
def test_deepseek_mtp_is_its_definition(settings):
    model = mtp_model(**settings)
    mtp, ids = model.model.mtp, torch.randint(1, 97, (1, 14))
    with torch.no_grad():
        output = model(ids, output_mtp_logits=True, use_cache=False)
        hidden = model.model(ids, use_cache=False).last_hidden_state
        embeds = model.model.embed_tokens(ids)
        for depth, layer in enumerate(mtp.layers):
            length = ids.shape[1] - depth - 1
            next_embeds = embeds[:, depth + 1:].clone()
            next_embeds[:, 0] = 0  # the entry at position 0 reads no embedding
            joined = torch.cat([layer.embedding_norm(next_embeds), layer.hidden_norm(hidden[:, :length])], dim=-1)
            hidden = layer.output_norm(run_block(model, layer.block, layer.input_proj(joined)))
            expected = model.lm_head(hidden)
            torch.testing.assert_close(output.mtp_logits[depth][:, :length], expected, rtol=1e-5, atol=1e-5)


def test_qwen4_exp_mtp_is_its_definition():
    model = mtp_model(**QWEN4_MTP)
    mtp, ids = model.model.mtp, torch.randint(1, 97, (1, 14))
    with torch.no_grad():
        output = model(ids, output_mtp_logits=True, use_cache=False)
        # The main model's residual streams before its final mix: every layer, without the mixer.
        streams = model.model.embed_tokens(ids).repeat(1, 1, 3)
        for layer in model.model.layers:
            streams = run_block(model, layer, streams)
        # What drafting feeds the MTP layers: those streams, from any forward.
        torch.testing.assert_close(model(ids, output_mtp_inputs=True).mtp_inputs, streams, rtol=1e-5, atol=1e-5)
        embeds = model.model.embed_tokens(ids)
        for depth, layer in enumerate(mtp.layers):
            length = ids.shape[1] - depth - 1
            embedded = mtp.embedding_proj(mtp.embedding_norm(embeds[:, depth + 1:]))
            normed = mtp.streams_norm(streams[:, :length]).unflatten(-1, (3, 64))
            streams = run_block(model, layer, (mtp.stream_proj(normed) + embedded.unsqueeze(-2)).flatten(-2))
            expected = model.lm_head(mtp.hyper_connection_mixer(streams)[0])
            torch.testing.assert_close(output.mtp_logits[depth][:, :length], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("settings", [QWEN4_MTP, GLM_MTP], ids=["qwen4_exp", "glm"])
def test_padding_packing_and_chunked_prefill_change_nothing(settings):
    model = mtp_model(**settings)
    first, second = torch.randint(1, 97, (1, 9)), torch.randint(1, 97, (1, 6))
    with torch.no_grad():
        alone = [model(row, output_mtp_logits=True, use_cache=False).mtp_logits for row in (first, second)]
        padded = torch.cat([first, F.pad(second, (3, 0))])  # the second row left-padded
        mask = (torch.arange(9) >= torch.tensor([[0], [3]])).long()
        batch = model(padded, attention_mask=mask, output_mtp_logits=True, use_cache=False).mtp_logits
        packed = torch.cat([first, second], dim=1)
        positions = torch.cat([torch.arange(9), torch.arange(6)])[None]
        packed_logits = model(packed, position_ids=positions, output_mtp_logits=True, use_cache=False).mtp_logits
        model.config.prefill_chunk_length = 4  # with a cache, the stack runs 4 tokens at a time
        chunked = model(first, output_mtp_logits=True).mtp_logits
    for depth in range(model.config.num_mtp_layers):
        valid = 9 - depth - 1  # entries whose token `depth + 1` ahead exists
        torch.testing.assert_close(batch[depth][0, :valid], alone[0][depth][0, :valid], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(batch[depth][1, 3:3 + 6 - depth - 1], alone[1][depth][0, :6 - depth - 1],
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed_logits[depth][0, :valid], alone[0][depth][0, :valid], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed_logits[depth][0, 9:9 + 6 - depth - 1], alone[1][depth][0, :6 - depth - 1],
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(chunked[depth], alone[0][depth], rtol=1e-5, atol=1e-5)


def test_the_mtp_loss_is_the_next_next_token_loss_and_trains_the_mtp_layers():
    model = mtp_model(**QWEN4_MTP, mtp_loss_weight=0.3).train()
    ids = torch.randint(1, 97, (2, 12))
    labels = ids.clone()
    labels[0, 5] = -100
    output = model(ids, labels=labels, use_cache=False)  # a labelled forward with a weight computes the MTP
    expected = torch.stack([
        F.cross_entropy(logits[:, :-depth - 2].flatten(0, 1), labels[:, depth + 2:].flatten(), ignore_index=-100)
        for depth, logits in enumerate(output.mtp_logits)
    ]).mean()
    torch.testing.assert_close(output.mtp_loss, expected)
    main = F.cross_entropy(output.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    torch.testing.assert_close(output.loss, main + 0.3 * expected)
    output.loss.backward()
    # Every MTP weight but the indexers', which no language-model loss reaches (their selection is discrete).
    mtp_gradients = [parameter.grad for name, parameter in model.named_parameters()
                     if name.startswith("model.mtp.") and ".indexer." not in name]
    assert mtp_gradients and all(gradient is not None for gradient in mtp_gradients)
    assert all(bool(gradient.abs().sum() > 0) for gradient in mtp_gradients if gradient.numel() > 1)

    model.config.mtp_loss_weight = 0.0  # without a weight a labelled forward leaves the MTP layers out
    assert model(ids, labels=labels, use_cache=False).mtp_logits is None


def test_mtp_layers_are_saved_loaded_and_counted(tmp_path):
    model = mtp_model(**GLM_MTP)
    without = tiny_model(**{**GLM_MTP, "num_mtp_layers": 0})
    mtp_parameters = sum(parameter.numel() for parameter in model.model.mtp.parameters())
    assert model.num_parameters() == without.num_parameters() + mtp_parameters > without.num_parameters()
    model.save_pretrained(tmp_path / "saved")
    loaded = HybridIndexPoolForCausalLM.from_pretrained(tmp_path / "saved").eval()
    ids = torch.randint(1, 97, (1, 10))
    with torch.no_grad():
        expected = model(ids, output_mtp_logits=True, use_cache=False).mtp_logits[0]
        assert torch.equal(loaded(ids, output_mtp_logits=True, use_cache=False).mtp_logits[0], expected)
        generated = loaded.generate(ids, max_new_tokens=3, do_sample=False)  # the MTP layers stay out of decoding
    assert generated.shape == (1, 13)


def test_refusals():
    plain = tiny_model()
    with pytest.raises(ValueError, match="no multi-token-prediction layers"):
        plain(torch.randint(1, 97, (1, 6)), output_mtp_logits=True)
    model = mtp_model(num_mtp_layers=1)
    ids = torch.randint(1, 97, (1, 6))
    cache = model(ids).cache
    with pytest.raises(ValueError, match="keep no cache"):
        model(ids[:, :1], cache=cache, output_mtp_logits=True)
    with pytest.raises(ValueError, match="mtp_type` 'qwen4_exp' reads Qwen4-Exp's residual streams"):
        tiny_model(num_mtp_layers=1, mtp_type="qwen4_exp")
    with pytest.raises(ValueError, match="mtp_type"):
        tiny_model(num_mtp_layers=1, mtp_type="medusa")
