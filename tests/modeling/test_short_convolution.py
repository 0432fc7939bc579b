import pytest
import torch
import torch.nn.functional as F

from hybrid_indexpool.modeling.short_convolution import HybridIndexPoolShortConvolution


def make_convolution(channels=6, kernel=4):
    torch.manual_seed(0)
    convolution = HybridIndexPoolShortConvolution(channels, kernel, "silu")
    torch.nn.init.normal_(convolution.weight)
    return convolution


def test_without_a_state_it_is_the_causal_depthwise_convolution_then_the_activation():
    convolution = make_convolution()
    mixed = torch.randn(2, 9, 6)
    output, conv_input = convolution(mixed)
    # nn.Conv1d with padding kernel - 1 on both sides: its first `seq` outputs are the causal ones.
    expected = F.silu(F.conv1d(mixed.transpose(1, 2), convolution.weight, padding=3, groups=6)[..., :9])
    torch.testing.assert_close(output, expected.transpose(1, 2))
    assert conv_input.shape == (2, 6, 3 + 9)


@pytest.mark.parametrize("split", [1, 4, 8])
def test_continuing_from_the_cached_state_equals_one_pass_decode_steps_included(split):
    convolution = make_convolution()
    mixed = torch.randn(2, 9, 6)
    real = torch.ones(2, 9, dtype=torch.bool)
    whole, _ = convolution(mixed)
    first, conv_input = convolution(mixed[:, :split])
    state = convolution.next_state(conv_input, real[:, :split])
    pieces = [first]
    for step in range(split, 9):  # one token at a time: the decode path
        piece, conv_input = convolution(mixed[:, step:step + 1], state)
        state = convolution.next_state(conv_input, real[:, step:step + 1])
        pieces.append(piece)
    torch.testing.assert_close(torch.cat(pieces, dim=1), whole)


def test_the_state_kept_ends_at_each_rows_last_real_token():
    convolution = make_convolution()
    mixed = torch.randn(2, 5, 6)
    real = torch.tensor([[True] * 5, [True, True, False, False, False]])
    _, conv_input = convolution(mixed)
    state = convolution.next_state(conv_input, real)
    torch.testing.assert_close(state[0], mixed[0, 2:].T)
    torch.testing.assert_close(state[1], torch.cat([torch.zeros(6, 1), mixed[1, :2].T], dim=-1))


def test_a_rank_convolves_only_its_channels_in_the_compute_dtype():
    convolution = make_convolution()
    mixed = torch.randn(1, 7, 6, dtype=torch.bfloat16)
    channels = torch.tensor([1, 4, 5])
    output, conv_input = convolution(mixed[..., channels], channels=channels, compute_dtype=torch.float32)
    full, _ = convolution(mixed.float())
    assert output.dtype == torch.bfloat16 and conv_input.dtype == torch.float32
    torch.testing.assert_close(output.float(), full[..., channels], atol=2e-2, rtol=2e-2)
