"""GLM-5.3-Flash's Sinkhorn residual streams (`hc_type="sinkhorn"`) against transformers' `glm5_next`, in float32,
and a whole tiny model with them, the grouped router and dense and sparse layers."""

import pytest
import torch
from glm_blocks import glm_text_config, glm_to_ours, our_config_of, randomize
from model_factory import tiny_model
from transformers.models.glm5_next import modeling_glm5_next as glm
from transformers.models.qwen3_next.modeling_qwen3_next import load_balancing_loss_func

from hybrid_indexpool import HybridIndexPoolForCausalLM
from hybrid_indexpool.modeling.modeling_hybrid_indexpool import HybridIndexPoolDecoderLayer
from hybrid_indexpool.modeling.moe import HybridIndexPoolSparseMoeBlock
from hybrid_indexpool.modeling.residual_streams import HybridIndexPoolSinkhornHyperConnection
from hybrid_indexpool.modeling.token_layout import TokenLayout

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

ATOL = 1e-5


def random_hyper_connection(hc_count: int, seed: int = 0) -> glm.Glm5NextTextHyperConnection:
    """GLM's hyper-connection with weights large enough that every read, write and mix differs per token."""
    hyper_connection = glm.Glm5NextTextHyperConnection(glm_text_config(hc_mult=hc_count))
    randomize(hyper_connection, seed, std=0.5)
    return hyper_connection


def streams(hc_count: int, seed: int = 1) -> torch.Tensor:
    """Random streams `[batch, seq, hc_count, hidden]` with a different scale per stream."""
    generator = torch.Generator().manual_seed(seed)
    scales = torch.rand(hc_count, 1, generator=generator) * 3 + 0.2
    return torch.randn(2, 11, hc_count, 64, generator=generator) * scales


@pytest.mark.parametrize("hc_count", [1, 2, 3, 4])
def test_sinkhorn_hyper_connection_equals_glm(hc_count):
    theirs = random_hyper_connection(hc_count, seed=hc_count)
    ours = HybridIndexPoolSinkhornHyperConnection(our_config_of(glm_text_config(), hc_type="sinkhorn",
                                                                hc_count=hc_count))
    ours.load_state_dict(theirs.state_dict())  # fn, base, scale: the same names
    residual = streams(hc_count)
    post, comb, collapsed = theirs(residual)
    block_input, write_weights = ours(residual.flatten(-2))
    torch.testing.assert_close(block_input, collapsed, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(write_weights[0], post, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(write_weights[1], comb, atol=ATOL, rtol=ATOL)
    # The Sinkhorn iterations made the mixing nearly doubly stochastic (columns exactly: they are normed last).
    torch.testing.assert_close(comb.sum(-2), torch.ones_like(comb[..., 0]), atol=1e-4, rtol=0)
    torch.testing.assert_close(comb.sum(-1), torch.ones_like(comb[..., 0]), atol=0.05, rtol=0)
    # The write, as GLM's decoder layer does it: post * output + comb^T @ streams.
    output = torch.randn(2, 11, 64, generator=torch.Generator().manual_seed(7))
    expected = post.unsqueeze(-1) * output.unsqueeze(-2) + comb.transpose(-1, -2) @ residual
    written = HybridIndexPoolSinkhornHyperConnection.inject(residual.flatten(-2), output, write_weights)
    torch.testing.assert_close(written, expected.flatten(-2), atol=ATOL, rtol=ATOL)


class FixedMixer(torch.nn.Module):
    """A stand-in token mixer for both layers (GLM's and ours take different ones): a fixed per-token map."""

    def __init__(self, hidden: int):
        super().__init__()
        self.weight = torch.randn(hidden, hidden, generator=torch.Generator().manual_seed(5)) / hidden ** 0.5

    def forward(self, hidden_states, *args, **kwargs):
        return torch.tanh(hidden_states @ self.weight)


@pytest.mark.parametrize("mlp_type", ["dense", "sparse"])
@pytest.mark.parametrize("hc_count", [1, 3])
def test_decoder_layer_streams_equal_glm(mlp_type, hc_count):
    """Read, norm, block, write, for the mixer and the feed-forward block: the whole layer but its token mixer."""
    source = glm_text_config(hc_mult=hc_count, mlp_layer_types=[mlp_type] * 4)
    theirs = glm.Glm5NextTextDecoderLayer(source, 0)
    randomize(theirs, seed=hc_count)
    theirs.self_attn = FixedMixer(64)
    config = our_config_of(source, hc_type="sinkhorn", hc_count=hc_count, mlp_layer_types=[mlp_type] * 4)
    ours = HybridIndexPoolDecoderLayer(config, 0)
    ours.linear_attn = FixedMixer(64)
    renames = {"attn_hc.": "attn_hyper_connection.", "ffn_hc.": "mlp_hyper_connection."}
    state = {}
    for name, tensor in glm_to_ours(theirs.state_dict()).items():
        for old, new in renames.items():
            name = name.replace(old, new)
        # GLM's RMSNorm scales by `weight`, ours by `1 + weight`.
        state[name] = tensor - 1 if name.endswith("layernorm.weight") else tensor
    ours.load_state_dict(state)
    residual = streams(hc_count, seed=3)
    tokens = TokenLayout.of_sequences(torch.arange(11).expand(2, -1))
    output, _, _ = ours(residual.flatten(-2), None, tokens)
    expected = theirs(residual)[0]
    torch.testing.assert_close(output, expected.flatten(-2), atol=ATOL, rtol=ATOL)
    assert isinstance(ours.mlp, HybridIndexPoolSparseMoeBlock) == (mlp_type == "sparse")


GLM_LIKE = dict(
    hc_type="sinkhorn", hc_count=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
    shared_expert_intermediate_size=32, shared_expert_gate=False, moe_router_type="sigmoid_grouped", n_group=4,
    topk_group=2, routed_scaling_factor=2.5, swiglu_limit=1.0, mlp_layer_types=["dense", "sparse", "dense", "sparse"],
)


def glm_like_model() -> HybridIndexPoolForCausalLM:
    model = tiny_model(**GLM_LIKE)
    with torch.no_grad():  # non-trivial stream mixing and expert choice
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(("hyper_connection.base", "e_score_correction_bias")):
                tensor.normal_(0.0, 0.5)
    return model


def test_final_read_is_the_norm_of_the_streams_mean():
    model = glm_like_model()
    captured = []
    model.model.layers[-1].register_forward_hook(lambda module, args, output: captured.append(output))
    input_ids = torch.randint(1, 97, (2, 9))
    with torch.no_grad():
        last_hidden_state = model.model(input_ids).last_hidden_state
    final_streams = captured[0][0].unflatten(-1, (3, 64))  # a decoder layer returns its hidden states first
    torch.testing.assert_close(last_hidden_state, model.model.norm(final_streams.mean(dim=-2)))
    assert not hasattr(model.model, "hyper_connection_mixer")


def test_glm_like_model_decodes_as_it_prefills():
    model = glm_like_model()
    input_ids = torch.randint(1, 97, (2, 14))
    with torch.no_grad():
        full = model(input_ids).logits
        prefix = model(input_ids[:, :10], use_cache=True)
        cache, steps = prefix.cache, []
        for position in range(10, 14):
            step = model(input_ids[:, position:position + 1], cache=cache, use_cache=True)
            cache = step.cache
            steps.append(step.logits[:, -1])
    torch.testing.assert_close(torch.stack(steps, dim=1), full[:, 10:], atol=1e-4, rtol=1e-4)
    generated = model.generate(input_ids, max_new_tokens=4, do_sample=False)
    assert generated.shape == (2, 18)
    with torch.no_grad():
        assert torch.equal(model(generated[:, :-1]).logits[:, 13:].argmax(-1), generated[:, 14:])


def test_glm_like_model_trains_and_returns_router_logits_of_its_sparse_layers():
    model = glm_like_model().train()
    input_ids = torch.randint(1, 97, (2, 12))
    output = model(input_ids, labels=input_ids, output_router_logits=True)
    assert len(output.router_logits) == 2 and all(logits.shape == (24, 8) for logits in output.router_logits)
    # GLM's load-balancing loss: the softmax of the pre-sigmoid logits, as transformers' MoE models compute it.
    torch.testing.assert_close(output.aux_loss, load_balancing_loss_func(output.router_logits, 8, 2))
    torch.testing.assert_close(output.aux_loss, glm.load_balancing_loss_func(output.router_logits, 8, 2))
    output.loss.backward()
    layers = model.model.layers
    for hyper_connection in (layers[0].attn_hyper_connection, layers[3].mlp_hyper_connection):
        assert all(parameter.grad.abs().sum() > 0 for parameter in hyper_connection.parameters())
    assert layers[1].mlp.gate.weight.grad.abs().sum() > 0
    assert layers[0].mlp.gate_proj.weight.grad.abs().sum() > 0
    assert not layers[1].mlp.gate.e_score_correction_bias.requires_grad  # a buffer, balanced outside the loss


def test_glm_like_model_saves_and_loads(tmp_path):
    model = glm_like_model()
    model.save_pretrained(tmp_path)
    loaded = HybridIndexPoolForCausalLM.from_pretrained(tmp_path).eval()
    input_ids = torch.randint(1, 97, (1, 8))
    torch.testing.assert_close(loaded.model.layers[1].mlp.gate.e_score_correction_bias,
                               model.model.layers[1].mlp.gate.e_score_correction_bias)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids).logits, model(input_ids).logits)
    # In half precision, what GLM-5.3-Flash keeps in float32 stays float32: the router and the streams' mixing.
    half = HybridIndexPoolForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    layer = half.model.layers[1]
    for tensor in (layer.mlp.gate.weight, layer.mlp.gate.e_score_correction_bias, layer.attn_hyper_connection.base,
                   layer.mlp_hyper_connection.scale):
        assert tensor.dtype == torch.float32
    assert layer.attn_hyper_connection.fn.dtype == layer.mlp.experts.gate_up_proj.dtype == torch.bfloat16
    assert half.model.layers[0].mlp.gate_proj.weight.dtype == torch.bfloat16
