"""The fenced code blocks of the README and `docs/*.md`, and the markers before them.

A block is preceded by at most one marker line:

- `<!-- not run: REASON -->`: never run (the reason is required);
- `<!-- vllm phase: RUNNER [LABEL] -->`: run in CI's vLLM phase, in vLLM's environment, by `RUNNER`: `.ci/run` (which
  extracts it by `LABEL`: `python tests/doc_blocks.py PAGE LABEL` prints the block) or
  `tests/serving/test_serving_docs.py` (which starts the servers it names and queries them).

Blocks without a marker run in the development environment (`tests/docs/test_examples.py`).
"""

import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\s*$")
NOT_RUN = re.compile(r"^<!-- not run:(.*)-->\s*$")
VLLM_PHASE = re.compile(r"^<!-- vllm phase:\s*(\S+)\s*(\S*)\s*-->\s*$")
VLLM_PHASE_RUNNERS = (".ci/run", "tests/serving/test_serving_docs.py")
LANGUAGES = {"python": "python", "bash": "shell", "sh": "shell", "shell": "shell"}


@dataclass(frozen=True)
class Example:
    """One fenced block: where it is, its language (`python` or `shell`), its code, why it is not run (None: it
    runs) and, for a block of CI's vLLM phase, its runner and label."""

    page: Path
    line: int
    language: str
    code: str
    not_run: str | None
    vllm_runner: str | None = None
    vllm_label: str = ""

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def examples(page: Path) -> list[Example]:
    """The python and shell blocks of `page`, with the marker of the line right before each fence."""
    lines = page.read_text(encoding="utf-8").splitlines()
    found, index = [], 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        end = next((at for at in range(index + 1, len(lines)) if lines[at].startswith("```")), len(lines))
        before = lines[index - 1] if index else ""
        not_run, vllm_phase = NOT_RUN.match(before), VLLM_PHASE.match(before)
        language = LANGUAGES.get(opening.group(1))
        if language is not None:
            found.append(Example(page, index + 1, language, "\n".join(lines[index + 1:end]) + "\n",
                                 not_run.group(1).strip() if not_run else None,
                                 vllm_phase.group(1) if vllm_phase else None,
                                 vllm_phase.group(2) if vllm_phase else ""))
        index = end + 1
    return found


def labelled_block(page: Path, label: str) -> Example:
    """The vLLM-phase block of `page` labelled `label`; ValueError if there is none or several."""
    found = [example for example in examples(page) if example.vllm_label == label]
    if len(found) != 1:
        raise ValueError(f"{page} has {len(found)} blocks labelled {label!r} (`<!-- vllm phase: RUNNER {label} -->`).")
    return found[0]


if __name__ == "__main__":
    page_name, block_label = sys.argv[1:]
    print(labelled_block(ROOT / page_name, block_label).code, end="")
