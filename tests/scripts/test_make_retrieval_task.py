"""`python -m hybrid_indexpool.scripts.make_retrieval_task`: writes the lm-eval task folder, refuses what it must."""

import json

import pytest

from hybrid_indexpool.scripts import make_retrieval_task


def test_writes_a_task_per_context_and_the_group(tmp_path, capsys):
    text_file = tmp_path / "filler.txt"
    text_file.write_text("".join(f"line {index} of the filler text\n" for index in range(300)))
    names = make_retrieval_task.main(["--output", str(tmp_path / "task"), "--contexts", "150,400", "--samples", "3",
                                      "--text", str(text_file)])
    assert names == ["hybrid_indexpool_passkey_150", "hybrid_indexpool_passkey_400"]
    group = json.loads((tmp_path / "task" / "hybrid_indexpool_passkey.yaml").read_text())
    assert group["task"] == names
    rows = (tmp_path / "task" / "passkey_400.jsonl").read_text().splitlines()
    assert len(rows) == 3 and all(json.loads(row)["context"] == 400 for row in rows)
    assert "lm_eval --model hf" in capsys.readouterr().out


@pytest.mark.parametrize("arguments, message", [
    (["--contexts", "2k"], "not a comma-separated list of integers"),
    (["--text", "missing.txt"], "cannot read --text"),
    (["--contexts", "10"], "at least"),
])
def test_bad_arguments_are_refused(tmp_path, capsys, arguments, message):
    with pytest.raises(SystemExit) as stop:
        make_retrieval_task.main(["--output", str(tmp_path / "task"), *arguments])
    printed = capsys.readouterr().err
    assert stop.value.code == 2 and printed.startswith("error: ") and message in printed
    assert not (tmp_path / "task").exists()


def test_an_existing_output_is_refused(tmp_path, capsys):
    (tmp_path / "task").mkdir()
    with pytest.raises(SystemExit) as stop:
        make_retrieval_task.main(["--output", str(tmp_path / "task"), "--contexts", "200"])
    assert stop.value.code == 2 and "already exists" in capsys.readouterr().err
