"""The check that a checkpoint's tokenizer and its model agree on the token ids: a tokenizer with ids beyond the
model's `vocab_size` feeds it tokens it has no embedding for, and a model with far more ids than the tokenizer
generates ids that decode to nothing (an untrained model samples them as often as any other)."""

import json
import warnings
from pathlib import Path

TOKENIZER_FILE = "tokenizer.json"


def tokenizer_id_count(folder) -> int | None:
    """One more than the largest token id of the tokenizer saved in `folder` (its `tokenizer.json`: the model's
    vocabulary and the added tokens), or None when the folder has no such file."""
    path = Path(folder) / TOKENIZER_FILE
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # not ours to judge: the tokenizer's own loader says what is wrong with the file
    vocabulary = (saved.get("model") or {}).get("vocab") or {}
    ids = list(vocabulary.values()) if isinstance(vocabulary, dict) else list(range(len(vocabulary)))
    ids += [token["id"] for token in saved.get("added_tokens") or []]
    return max(ids) + 1 if ids else None


def padding_allowance(id_count: int) -> int:
    """How many ids a model may have beyond its tokenizer's without a warning: released models pad `vocab_size` to
    a round number (Qwen3-Next: 151936 for about 151670 ids), which is the same model as far as text goes."""
    return max(128, id_count // 100)


def warn_if_tokenizer_does_not_fit(vocab_size: int, folder) -> None:
    """Warn (once per folder and size) when the tokenizer saved in `folder` does not fit a model of `vocab_size`."""
    id_count = tokenizer_id_count(folder)
    if id_count is None:
        return
    if id_count > vocab_size:
        warnings.warn(
            f"The tokenizer in {folder} has ids up to {id_count - 1}, beyond this model's vocab_size ({vocab_size}): "
            "those tokens have no embedding. Use the tokenizer the model was trained with, or build the model with "
            f"vocab_size={id_count} (e.g. HybridIndexPoolConfig(vocab_size=len(tokenizer))).", UserWarning,
            stacklevel=3,
        )
    elif vocab_size - id_count > padding_allowance(id_count):
        warnings.warn(
            f"This model's vocab_size ({vocab_size}) is far beyond the {id_count} ids of the tokenizer in {folder}: "
            f"ids {id_count} to {vocab_size - 1} decode to nothing, and an untrained model generates them. Build the "
            f"model with vocab_size={id_count} (e.g. HybridIndexPoolConfig(vocab_size=len(tokenizer))).",
            UserWarning, stacklevel=3,
        )
