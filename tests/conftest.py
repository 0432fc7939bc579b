import os

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's CPU interpreter. It must be chosen before any kernel module is
# imported (Triton reads it when the kernels are decorated), hence here, before the tests import the package.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _deterministic():
    """Every test starts from the same random state."""
    torch.manual_seed(1234)
    yield
