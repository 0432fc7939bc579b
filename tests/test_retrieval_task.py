"""The passkey retrieval task: its samples, and the `lm-eval` task folder run by `lm_eval` on a tiny checkpoint."""

import glob
import json
import os
import random
import re
import subprocess
import sys

import pytest
import torch
from model_factory import tiny_model

from hybrid_indexpool.retrieval_task import PASSKEY_DIGITS, passkey_documents, passkey_sample, write_lm_eval_task
from hybrid_indexpool.tokenization import byte_level_tokenizer

FILLER = "".join(f"value_{index} = compute({index}, other)\n" for index in range(400))


def test_passkey_samples_have_the_context_length_and_end_with_the_key():
    sample, depth = passkey_sample(FILLER, 200, random.Random(0))
    question = sample.rsplit("\n", 1)[1]
    assert len(sample) == 200 and re.fullmatch(r"\$[A-Z]\d{5}", question)
    assert sample.count(question) == 2 and 0 <= depth <= 1


def test_the_needle_marker_only_starts_needles_and_questions():
    filler = "".join(f"price_{index} = '${index}.00'  # $HOME\n" for index in range(400))
    sample, _ = passkey_sample(filler, 600, random.Random(1), needles=4)
    lines = [line for line in sample.split("\n") if "$" in line]
    assert len(lines) == 8 and all(re.fullmatch(r"\$[A-Z]\d{5}", line) for line in lines)


@pytest.mark.parametrize("depth", [0.0, 0.5, 0.99])
def test_training_samples_ask_every_needle_and_the_last_one_sits_at_the_depth(depth):
    sample, actual = passkey_sample(FILLER, 400, random.Random(3), depth=depth, needles=6)
    lines = sample.split("\n")
    questions = lines[-6:]
    assert len(sample) == 400 and len({line[:2] for line in questions}) == 6
    body = "\n".join(lines[:-6])
    for question in questions:  # each needle once in the text before the questions
        assert re.fullmatch(r"\$[A-Z]\d{5}", question) and body.count(question) == 1
    assert abs(body.index(questions[-1]) / len(body) - depth) < 0.15 and abs(actual - depth) < 0.15
    with pytest.raises(ValueError, match="needles must be between 1 and 26"):
        passkey_sample(FILLER, 400, random.Random(3), needles=0)


def test_documents_spread_the_needle_over_the_context_and_hold_the_answer():
    documents = passkey_documents(FILLER, [300, 600], samples=5, seed=1)
    assert [document["context"] for document in documents] == [300] * 5 + [600] * 5
    for document in documents:
        assert len(document["prompt"]) + PASSKEY_DIGITS == document["context"]
        question = document["prompt"].rsplit("\n", 1)[1]
        assert re.fullmatch(r"\$[A-Z]", question) and document["passkey"].isdigit()
        assert f"{question}{document['passkey']}\n" in document["prompt"]
    depths = [document["depth"] for document in documents[:5]]
    assert depths == sorted(depths) and depths[0] < 0.2 and depths[-1] > 0.7


def test_the_task_folder_is_refused_when_it_exists_and_sizes_are_checked(tmp_path):
    (tmp_path / "task").mkdir()
    with pytest.raises(FileExistsError, match="already exists"):
        write_lm_eval_task(tmp_path / "task", FILLER, [300], 2)
    with pytest.raises(ValueError, match="at least"):
        write_lm_eval_task(tmp_path / "other", FILLER, [10], 2)
    assert not (tmp_path / "other").exists()


def greedy_continuation(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    input_ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        output = model.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(output[0, input_ids.shape[1]:], skip_special_tokens=True).split("\n")[0]


def test_lm_eval_scores_a_checkpoint_with_the_task(tmp_path):
    """`lm_eval --model hf ... --include_path TASK --tasks hybrid_indexpool_passkey` on a tiny checkpoint: its
    greedy answers are our `generate()`'s, and its exact match counts them. The tiny model cannot retrieve, so half of
    the documents get the model's own answer as their passkey: the score must then be exactly one half."""
    tokenizer = byte_level_tokenizer()
    model = tiny_model(0, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    digits = {tokenizer.convert_tokens_to_ids(tokenizer.tokenize(str(digit))[0]) for digit in range(10)}
    model.generation_config.suppress_tokens = [token for token in range(len(tokenizer)) if token not in digits]
    model.save_pretrained(tmp_path / "checkpoint")
    tokenizer.save_pretrained(tmp_path / "checkpoint")
    names = write_lm_eval_task(tmp_path / "task", FILLER, [120, 200], samples=2, seed=0)
    answers = {}
    for name, context in zip(names, (120, 200)):
        data_file = tmp_path / "task" / f"passkey_{context}.jsonl"
        documents = [json.loads(line) for line in data_file.read_text().splitlines()]
        for index, document in enumerate(documents):
            answers[document["prompt"]] = greedy_continuation(model, tokenizer, document["prompt"], PASSKEY_DIGITS + 3)
            if index % 2 == 0:
                document["passkey"] = answers[document["prompt"]]
        data_file.write_text("".join(json.dumps(document) + "\n" for document in documents))
    environment = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
               f"pretrained={tmp_path / 'checkpoint'},trust_remote_code=True,dtype=float32",
               "--include_path", str(tmp_path / "task"), "--tasks", "hybrid_indexpool_passkey", "--device", "cpu",
               "--batch_size", "2", "--output_path", str(tmp_path / "results"), "--log_samples"]
    finished = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=600)
    assert finished.returncode == 0, finished.stderr[-3000:]
    results = json.loads(open(glob.glob(str(tmp_path / "results" / "*" / "results_*.json"))[0]).read())["results"]
    assert results["hybrid_indexpool_passkey"]["exact_match,strip"] == 0.5
    for name in names:
        assert results[name]["exact_match,strip"] == 0.5
        samples = glob.glob(str(tmp_path / "results" / "*" / f"samples_{name}_*.jsonl"))[0]
        for line in open(samples).read().splitlines():
            sample = json.loads(line)
            assert sample["filtered_resps"][0] == answers[sample["doc"]["prompt"]]
