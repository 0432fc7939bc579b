"""Tokenizers that work offline: a byte-level tokenizer (nothing to train) and a small BPE trained on local text.

Both are ordinary `PreTrainedTokenizerFast` objects: they save with `save_pretrained` next to a checkpoint and
load back with `AutoTokenizer.from_pretrained`, and carry a minimal chat template (`CHAT_TEMPLATE`). Any Hugging Face
tokenizer works with the model and the scripts.
"""

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>"}

# A minimal chat format for tokenizers without one of their own (chat serving and `apply_chat_template` need one):
# each turn is `<s>role` on a line, the text, then `</s>`; the generation prompt opens an assistant turn, whose `</s>`
# ends generation. Message content is text, or a list of text parts as OpenAI clients send them.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ bos_token + message['role'] + '\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] if part['type'] == 'text' -%}{{ part['text'] }}{%- endfor -%}"
    "{%- endif -%}"
    "{{ eos_token + '\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ bos_token + 'assistant\n' }}{%- endif -%}"
)


def _wrap(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    # Left padding: what generation wants (the model accepts either side).
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, model_max_length=1 << 30, padding_side="left",
                                   chat_template=CHAT_TEMPLATE, **SPECIAL_TOKENS)


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """259 tokens: `<pad>`, `<s>`, `</s>` (ids 0-2), then one token per byte. Any text round-trips exactly."""
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS.values())}
    for character in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[character] = len(vocab)
    return _wrap(Tokenizer(models.BPE(vocab=vocab, merges=[])))


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 4096) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE of `vocab_size` tokens (special tokens at ids 0-2) on an iterable of local texts."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return _wrap(tokenizer)
