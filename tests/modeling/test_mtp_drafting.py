"""generate(use_mtp=True): refused in one line that says why and what to do instead, with and without MTP layers."""

import pytest
import torch
from model_factory import tiny_model


@pytest.mark.parametrize("num_mtp_layers, reason", [(1, "its 1 MTP layers ('deepseek') are kept"),
                                                    (0, "it has no MTP layers (scripts/train_mtp.py")])
def test_use_mtp_is_refused_with_the_reason(num_mtp_layers, reason):
    model = tiny_model(num_mtp_layers=num_mtp_layers)
    input_ids = torch.randint(1, 97, (1, 6), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"generate\(use_mtp=True\) is not supported") as error:
        model.generate(input_ids, use_mtp=True, max_new_tokens=3, do_sample=False)
    assert reason in str(error.value) and "\n" not in str(error.value)
    # Plain decoding of the same model is unaffected.
    assert model.generate(input_ids, max_new_tokens=3, do_sample=False).shape == (1, 9)
