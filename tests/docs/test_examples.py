"""Every code example of the README and of `docs/*.md` runs as written: each fenced `python` block in a fresh
process, in the default suite; each shell block (`bash`, `sh`, `shell`) under the `slow` marker (they install,
convert and train: minutes). Each runs in a scratch folder, with `python` the interpreter running the tests. A block
preceded by the line `<!-- not run: REASON -->` is skipped with its reason; the reason is required. A block of CI's
vLLM phase (`<!-- vllm phase: RUNNER [LABEL] -->`, see `tests/doc_blocks.py`) runs there, not here."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from doc_blocks import FENCE, NOT_RUN, PAGES, ROOT, VLLM_PHASE, VLLM_PHASE_RUNNERS, Example, examples, labelled_block

TIMEOUT_S = {"python": 300, "shell": 1200}


ALL = [example for page in PAGES for example in examples(page)]


def run(example: Example, folder: Path) -> subprocess.CompletedProcess:
    """Run the block in `folder`, `python` resolving to this interpreter, offline (tiny models need no downloads)."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-c", example.code] if example.language == "python" else \
        ["bash", "-euo", "pipefail", "-c", example.code]
    return subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S[example.language])


def check(example: Example, tmp_path: Path) -> None:
    if example.not_run is not None:
        pytest.skip(f"not run: {example.not_run}")
    if example.vllm_runner is not None:
        pytest.skip(f"runs in CI's vLLM phase, by {example.vllm_runner}")
    result = run(example, tmp_path)
    assert result.returncode == 0, f"{example.name} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"


@pytest.mark.parametrize("example", [example for example in ALL if example.language == "python"],
                         ids=lambda example: example.name)
def test_python_example_runs(example, tmp_path):
    check(example, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("example", [example for example in ALL if example.language == "shell"],
                         ids=lambda example: example.name)
def test_shell_example_runs(example, tmp_path):
    check(example, tmp_path)


def test_every_not_run_marker_gives_a_reason_and_sits_right_before_a_fence():
    for page in PAGES:
        lines = page.read_text(encoding="utf-8").splitlines()
        for number, line in enumerate(lines):
            if line.startswith("<!-- not run"):
                marker = NOT_RUN.match(line)
                assert marker is not None and marker.group(1).strip(), f"{page.name}:{number + 1}: give a reason"
                assert number + 1 < len(lines) and FENCE.match(lines[number + 1]), \
                    f"{page.name}:{number + 1}: the marker must be the line right before the fence"


def test_every_vllm_phase_block_has_a_runner_that_runs_it():
    """A block left to CI's vLLM phase names a runner that exists; `.ci/run` extracts each of its labels."""
    ci_script = (ROOT / ".ci" / "run").read_text()
    for page in PAGES:
        lines = page.read_text(encoding="utf-8").splitlines()
        for number, line in enumerate(lines):
            if line.startswith("<!-- vllm phase"):
                marker = VLLM_PHASE.match(line)
                assert marker is not None and marker.group(1) in VLLM_PHASE_RUNNERS, f"{page.name}:{number + 1}"
                assert number + 1 < len(lines) and FENCE.match(lines[number + 1]), f"{page.name}:{number + 1}"
        for example in examples(page):
            if example.vllm_runner == ".ci/run":
                page_name = str(page.relative_to(ROOT))
                assert f"doc_blocks.py {page_name} {example.vllm_label}" in ci_script, example.name
                assert labelled_block(page, example.vllm_label) == example


def test_the_readme_examples_are_run():
    # The landing page's use and long-context examples run in the default suite, its round trip under `slow`.
    readme = [example for example in ALL if example.page.name == "README.md" and example.page.parent == ROOT]
    assert sum(example.language == "python" and example.not_run is None for example in readme) >= 2
    assert any("make_tiny_source" in example.code and example.not_run is None for example in readme)
