"""The example command lines in each script's `--help` are shown as written (one command per example, its `\\`
continuations kept) and each parses: argparse's default formatter would reflow them into one paragraph."""

import importlib
import shlex
from pathlib import Path

import pytest

# `serve`'s help is typer's (transformers serve's options), and its docstring's line is a synopsis with [optional]
# parts, not a command.
SCRIPTS = sorted(path.stem for path in (Path(__file__).parents[2] / "scripts").glob("*.py")
                 if path.name not in ("__init__.py", "serve.py"))


def examples(docstring: str, name: str) -> list[tuple[str, list[str]]]:
    """Each example command of `docstring` that runs the script `name` (`python -m hybrid_indexpool.scripts.NAME` or
    `accelerate launch ... -m hybrid_indexpool.scripts.NAME`): its lines as written, and the arguments after the module
    (continuation lines joined, comments dropped)."""
    found, lines = [], docstring.splitlines()
    module = f"hybrid_indexpool.scripts.{name}"
    for index, line in enumerate(lines):
        words = line.split()
        if module not in words or not (line.lstrip().startswith(("python -m", "accelerate launch"))):
            continue
        written = [line]
        while written[-1].rstrip().endswith("\\"):
            written.append(lines[index + len(written)])
        command = " ".join(part.rstrip().rstrip("\\") for part in written)
        arguments = shlex.split(command, comments=True)
        found.append(("\n".join(written), arguments[arguments.index(module) + 1:]))
    return found


def help_text(script, capsys) -> str:
    with pytest.raises(SystemExit) as stop:
        script.main(["--help"])
    assert stop.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("name", ["finetune", "train_indexer", "train_mtp"])
def test_the_training_commands_show_their_examples_as_written_and_each_parses(name, capsys):
    script = importlib.import_module(f"hybrid_indexpool.scripts.{name}")
    found = examples(script.__doc__, name)
    assert found, f"{name} has no example"
    printed = help_text(script, capsys)
    for written, arguments in found:
        assert written in printed, written
        args, training_args = script.parse_arguments(arguments)
        assert training_args.output_dir == arguments[arguments.index("--output_dir") + 1]
        assert args.train_files == ["data.txt"]


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_scripts_examples_are_shown_as_written(name, capsys):
    script = importlib.import_module(f"hybrid_indexpool.scripts.{name}")
    found = examples(script.__doc__, name)
    assert found, f"{name}'s docstring shows no example command"
    printed = help_text(script, capsys)
    for written, arguments in found:
        assert written in printed, f"{name}: the example is not shown as written:\n{written}"
        if hasattr(script, "parse_arguments"):
            script.parse_arguments(arguments)  # every example parses (a SystemExit here would fail the test)
