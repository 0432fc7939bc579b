import pytest
import saved_tokenizer
from fresh_process import run_in_fresh_process
from model_factory import tiny_model
from transformers import AutoTokenizer

from hybrid_indexpool.tokenization import byte_level_tokenizer, train_bpe_tokenizer


def test_byte_level_tokenizer_round_trips_any_text_and_reloads(tmp_path):
    tokenizer = byte_level_tokenizer()
    text = "naïve café — 数学 🙂\n\ttabs"
    ids = tokenizer(text).input_ids
    assert len(tokenizer) == 259 and max(ids) < 259 and tokenizer.decode(ids) == text
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    tokenizer.save_pretrained(tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path)(text).input_ids == ids


def test_bpe_trained_on_local_text_compresses_it():
    import json
    from pathlib import Path

    text = Path(json.__file__).with_name("decoder.py").read_text()
    tokenizer = train_bpe_tokenizer([text], vocab_size=400)
    ids = tokenizer(text).input_ids
    assert len(tokenizer) == 400 and len(ids) < len(text.encode()) / 2
    assert tokenizer.decode(ids) == text


def test_byte_level_tokenizer_has_a_minimal_chat_template_that_saves(tmp_path):
    tokenizer = byte_level_tokenizer()
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "text", "text": "yo"}]}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<s>user\nhi</s>\n<s>assistant\nyo</s>\n<s>assistant\n"
    ids = tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and tokenizer.eos_token_id in ids  # the markers are special tokens
    tokenizer.save_pretrained(tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(messages, tokenize=False) == text[:-len(
        "<s>assistant\n")]



@pytest.mark.parametrize("import_package, trust_remote_code", [(True, None), (False, True)],
                         ids=["package-imported", "remote-code-only"])
def test_a_saved_checkpoints_tokenizer_loads_in_a_fresh_process_without_a_prompt(tmp_path, import_package,
                                                                                 trust_remote_code):
    # AutoTokenizer reads the model config first; this one has an IndexPool layer, whose layer type transformers'
    # generic config rejects, so the config must come from the package or from the checkpoint's remote code.
    model = tiny_model()
    assert "indexpool_attention" in model.config.layer_types
    model.save_pretrained(tmp_path)
    tokenizer = byte_level_tokenizer()
    tokenizer.save_pretrained(tmp_path)
    output = run_in_fresh_process(saved_tokenizer.__file__, "load_saved_tokenizer", str(tmp_path), import_package,
                                  trust_remote_code)
    assert "[y/N]" not in output
    assert f"ids: {tokenizer(saved_tokenizer.TEXT).input_ids}" in output
