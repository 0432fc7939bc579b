"""The passkey retrieval task: samples, and an `lm-eval` task definition over locally generated data.

A sample is `context` characters of filler text with needle lines `$L12345` (the marker `$`, a one-letter label, five
digits) inserted at line starts and asked again at the end: the model must continue `$L` with the five digits it saw
after that label. The marker appears nowhere else (it is blanked out of the filler) and the key follows the label
directly, so finding the needle is a one-character match, the associative recall that small models learn (as in the
MQAR benchmark). The earlier format `# passkey LL: DDDDD` put a two-digit label four characters before the key,
behind `: `, which code is full of; the benchmark's small model never learned it (0% even with dense attention). An
evaluation sample has one needle at a chosen relative depth; a training sample may have several, all asked at the
end (more answers per sequence to learn from, and the label to match, not just the position). The same format trains
and evaluates retrieval in `scripts/bench_quality.py`; `write_lm_eval_task` writes it as an `lm-eval` task folder,
one task per context length in the group `hybrid_indexpool_passkey`, so that

    lm_eval --model hf --model_args pretrained=CHECKPOINT,trust_remote_code=True \\
        --include_path TASK_FOLDER --tasks hybrid_indexpool_passkey

scores any checkpoint (exact match of the greedy continuation up to the end of the line). Nothing is downloaded: the
data is a JSON-lines file in the task folder.
"""

import json
import random
import string
import sysconfig
import zlib
from pathlib import Path

PASSKEY_DIGITS = 5
NEEDLE_MARKER = "$"
NEEDLE_LABELS = string.ascii_uppercase
TASK_GROUP = "hybrid_indexpool_passkey"


def stdlib_texts() -> tuple[str, str, int, int]:
    """Training text, held-out text and their file counts from the standard library's `*.py` files (ASCII)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(path for path in root.rglob("*.py") if not {"site-packages", "dist-packages"} & set(path.parts))
    if not files:
        raise RuntimeError(f"No *.py files under the standard library folder {root}; this benchmark needs its source.")
    train, held_out = [], []
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace").encode("ascii", "replace").decode("ascii")
        (held_out if zlib.crc32(str(path.relative_to(root)).encode()) % 10 == 0 else train).append(text)
    return "\n".join(train), "\n".join(held_out), len(train), len(held_out)


def text_window(text: str, length: int, rng: random.Random) -> str:
    """`length` consecutive characters of `text` from a random start."""
    if len(text) <= length:
        raise ValueError(f"The filler text has {len(text)} characters; a window of {length} needs more.")
    start = rng.randrange(len(text) - length)
    return text[start:start + length]


def needle_line(label: str, key: str) -> str:
    """`$L12345`: the marker, a one-letter label and the key (no newline)."""
    return f"{NEEDLE_MARKER}{label}{key}"


# Characters one needle takes in a sample: its line and its question, each with a newline.
NEEDLE_AND_QUESTION_CHARACTERS = 2 * (len(needle_line(NEEDLE_LABELS[0], "0" * PASSKEY_DIGITS)) + 1)


def needles_that_fit(context: int) -> int:
    """How many needles, with their questions, a sample of `context` characters holds (at least one filler
    character left), at most one per label letter."""
    return min(len(NEEDLE_LABELS), (context - 1) // NEEDLE_AND_QUESTION_CHARACTERS)


def passkey_sample(text: str, context: int, rng: random.Random, depth: float | None = None,
                   needles: int = 1) -> tuple[str, float]:
    """`context` characters of `text` with `needles` labelled needle lines at line starts and, at the end, one
    question line per needle (in random order) repeating it; the last question's digits are the sample's last
    characters. The last-asked needle goes at relative `depth` (random when None), the others anywhere. Returns the
    sample and that needle's actual relative depth (it is inserted at the next line start)."""
    if not 1 <= needles <= len(NEEDLE_LABELS):
        raise ValueError(f"needles must be between 1 and {len(NEEDLE_LABELS)} (one per label letter), not {needles}.")
    labels = rng.sample(NEEDLE_LABELS, needles)
    lines = [needle_line(label, f"{rng.randrange(10 ** PASSKEY_DIGITS):0{PASSKEY_DIGITS}d}") for label in labels]
    asked = list(range(needles))
    rng.shuffle(asked)
    questions = "".join("\n" + lines[index] for index in asked)
    filler_length = context - sum(len(line) + 1 for line in lines) - len(questions)
    if filler_length < 1:
        raise ValueError(f"{needles} needles and their questions take {context - filler_length} characters; a sample "
                         f"of {context} cannot hold them. Use fewer needles or a longer context.")
    # The marker only ever starts a needle or a question.
    filler = text_window(text, filler_length, rng).replace(NEEDLE_MARKER, " ")
    depths = [rng.random() for _ in lines]
    if depth is not None:
        depths[asked[-1]] = depth
    cuts = []
    for fraction in depths:
        cut = int(fraction * len(filler))
        cuts.append(filler.find("\n", cut) + 1 or cut)  # at a line start if any
    order = sorted(range(needles), key=lambda index: (cuts[index], index))
    pieces, previous = [], 0
    for index in order:
        pieces += [filler[previous:cuts[index]], lines[index] + "\n"]
        previous = cuts[index]
    return "".join(pieces) + filler[previous:] + questions, cuts[asked[-1]] / len(filler)


def passkey_documents(text: str, contexts: list[int], samples: int, seed: int) -> list[dict]:
    """`samples` documents per context, needle depths spread evenly over [0, 1): each has `prompt` (the sample up to
    and including the question's `$L`), `passkey`, `context` and `depth`."""
    rng = random.Random(seed)
    documents = []
    for context in contexts:
        for index in range(samples):
            sample, depth = passkey_sample(text, context, rng, depth=index / samples)
            documents.append({"prompt": sample[:-PASSKEY_DIGITS], "passkey": sample[-PASSKEY_DIGITS:],
                              "context": context, "depth": round(depth, 4)})
    return documents


def _task_yaml(name: str, data_file: Path) -> str:
    # JSON is YAML: the file holds exactly what lm-eval's task loader reads.
    task = {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data_file.resolve())}},
        "test_split": "test",
        "output_type": "generate_until",
        "doc_to_text": "{{prompt}}",
        "doc_to_target": "{{passkey}}",
        "generation_kwargs": {"until": ["\n"], "max_gen_toks": PASSKEY_DIGITS + 3, "do_sample": False},
        "filter_list": [{"name": "strip", "filter": [{"function": "remove_whitespace"},
                                                     {"function": "take_first"}]}],
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
        "metadata": {"version": 1.0},
    }
    return json.dumps(task, indent=2) + "\n"


def write_lm_eval_task(output_dir, text: str, contexts: list[int], samples: int, seed: int = 0) -> list[str]:
    """Write the passkey task folder for `lm-eval` (`--include_path output_dir`): per context a data file
    `passkey_<context>.jsonl` and a task `hybrid_indexpool_passkey_<context>`, and the group `hybrid_indexpool_passkey`
    over all of them. `output_dir` must not exist. Returns the task names."""
    output_dir = Path(output_dir)
    if output_dir.exists():
        raise FileExistsError(f"{output_dir} already exists; choose a new folder for the task (nothing was written).")
    if not contexts or samples < 1:
        raise ValueError("Give at least one context length and one sample per context.")
    if needles_that_fit(min(contexts)) < 1:
        raise ValueError(f"Context lengths must be at least {NEEDLE_AND_QUESTION_CHARACTERS + 1} characters (the "
                         "needle and the question).")
    documents = passkey_documents(text, contexts, samples, seed)
    output_dir.mkdir(parents=True)
    names = []
    for context in contexts:
        name = f"{TASK_GROUP}_{context}"
        data_file = output_dir / f"passkey_{context}.jsonl"
        with open(data_file, "w") as handle:
            for document in documents:
                if document["context"] == context:
                    handle.write(json.dumps(document) + "\n")
        (output_dir / f"{name}.yaml").write_text(_task_yaml(name, data_file))
        names.append(name)
    group = {"group": TASK_GROUP, "task": names,
             "aggregate_metric_list": [{"metric": "exact_match", "aggregation": "mean", "weight_by_size": True}],
             "metadata": {"version": 1.0}}
    (output_dir / f"{TASK_GROUP}.yaml").write_text(json.dumps(group, indent=2) + "\n")
    return names
