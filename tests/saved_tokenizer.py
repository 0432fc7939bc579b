"""Run by `tests/test_tokenization.py` in a fresh process: loads a saved checkpoint's tokenizer as a user would, in a
process where `hybrid_indexpool` is imported only when asked (this module imports nothing of the package itself)."""

import sys

from transformers import AutoTokenizer

TEXT = "a prompt — 数学"


def load_saved_tokenizer(folder: str, import_package: bool, trust_remote_code: bool | None) -> None:
    """Load the tokenizer saved in `folder` with the given call and print the ids of `TEXT`."""
    if import_package:
        import hybrid_indexpool  # noqa: F401  (registers the model type, so its config reads without remote code)
    assert ("hybrid_indexpool" in sys.modules) == import_package
    options = {} if trust_remote_code is None else {"trust_remote_code": trust_remote_code}
    tokenizer = AutoTokenizer.from_pretrained(folder, **options)
    print("ids:", tokenizer(TEXT).input_ids)
