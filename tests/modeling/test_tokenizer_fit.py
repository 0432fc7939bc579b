"""The warning when a checkpoint's tokenizer and its model disagree on the token ids: once when the model is saved
next to the tokenizer, once when it is loaded from such a folder; none when they fit or differ by vocabulary
padding."""

import warnings

import pytest
from model_factory import tiny_model
from transformers import AutoModelForCausalLM

from hybrid_indexpool.modeling.tokenizer_fit import padding_allowance, tokenizer_id_count
from hybrid_indexpool.tokenization import byte_level_tokenizer


def fit_warnings(caught) -> list[str]:
    return [str(warning.message) for warning in caught
            if "vocab_size" in str(warning.message) and "tokenizer in" in str(warning.message)]


def save_and_load(model, folder) -> tuple[list[str], list[str]]:
    """The fit warnings of `model.save_pretrained(folder)` and of loading it back."""
    with warnings.catch_warnings(record=True) as saving:
        warnings.simplefilter("always")
        model.save_pretrained(folder)
    with warnings.catch_warnings(record=True) as loading:
        warnings.simplefilter("always")
        AutoModelForCausalLM.from_pretrained(folder)
    return fit_warnings(saving), fit_warnings(loading)


def test_the_byte_level_tokenizer_counts_its_ids(tmp_path):
    tokenizer = byte_level_tokenizer()
    assert tokenizer_id_count(tmp_path) is None
    tokenizer.save_pretrained(tmp_path)
    assert tokenizer_id_count(tmp_path) == len(tokenizer) == 259


@pytest.mark.parametrize("vocab_size, expected", [
    (4096, "This model's vocab_size (4096) is far beyond the 259 ids of the tokenizer in {folder}: ids 259 to 4095 "
           "decode to nothing"),
    (200, "The tokenizer in {folder} has ids up to 258, beyond this model's vocab_size (200): those tokens have no "
          "embedding"),
])
def test_a_tokenizer_that_does_not_fit_is_warned_about_when_saved_and_loaded(tmp_path, vocab_size, expected):
    byte_level_tokenizer().save_pretrained(tmp_path)
    saving, loading = save_and_load(tiny_model(vocab_size=vocab_size), tmp_path)
    message = expected.format(folder=tmp_path)
    assert len(saving) == 1 and saving[0].startswith(message) and "vocab_size=259" in saving[0]
    assert len(loading) == 1 and loading[0].startswith(message)


@pytest.mark.parametrize("vocab_size", [259, 259 + padding_allowance(259)])
def test_a_tokenizer_that_fits_or_a_padded_vocabulary_is_not_warned_about(tmp_path, vocab_size):
    byte_level_tokenizer().save_pretrained(tmp_path)
    assert save_and_load(tiny_model(vocab_size=vocab_size), tmp_path) == ([], [])


def test_released_vocabulary_padding_is_within_the_allowance():
    # Qwen3-Next: 151643 tokens plus 26 added ones, vocab_size 151936.
    assert 151936 - 151669 <= padding_allowance(151669)
