import pytest
import torch

from hybrid_indexpool.kernels.weighted_pool import weighted_pool


@pytest.mark.parametrize("pool_size", [1, 2, 4, 8])
def test_zero_gate_logits_equal_mean_pooling_exactly(pool_size):
    keys = torch.randn(3, 5, pool_size, 16, dtype=torch.bfloat16)
    assert torch.equal(weighted_pool(keys, torch.zeros(3, 5, pool_size, 16)), weighted_pool(keys, None))


def test_weights_are_a_per_channel_softmax_over_the_window():
    keys = torch.randn(2, 3, 4, 6)
    logits = torch.randn(2, 3, 4, 6)
    expected = (logits.softmax(dim=2) * keys).sum(dim=2)
    torch.testing.assert_close(weighted_pool(keys, logits), expected)
    # A very large logit on one slot selects that slot's key.
    logits[:, :, 2] = 1e4
    torch.testing.assert_close(weighted_pool(keys, logits), keys[:, :, 2])
