import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic():
    """Every test starts from the same random state."""
    torch.manual_seed(1234)
    yield
