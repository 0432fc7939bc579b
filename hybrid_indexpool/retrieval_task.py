"""The passkey retrieval task: samples, and an `lm-eval` task definition over locally generated data.

A sample is `context` characters of filler text with the line `# passkey: NNNNN` inserted at a relative depth and
repeated at the end as the question: the model must continue `# passkey: ` with the five digits it saw. The same
format trains and evaluates retrieval in `scripts/bench_quality.py`; `write_lm_eval_task` writes it as an `lm-eval`
task folder, one task per context length in the group `hybrid_indexpool_passkey`, so that

    lm_eval --model hf --model_args pretrained=CHECKPOINT,trust_remote_code=True \\
        --include_path TASK_FOLDER --tasks hybrid_indexpool_passkey

scores any checkpoint (exact match of the greedy continuation up to the end of the line). Nothing is downloaded: the
data is a JSON-lines file in the task folder.
"""

import json
import random
import sysconfig
import zlib
from pathlib import Path

PASSKEY_DIGITS = 5
NEEDLE = "# passkey: "
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


def passkey_sample(text: str, context: int, rng: random.Random, depth: float | None = None) -> tuple[str, float]:
    """`context` characters of `text` with `# passkey: NNNNN` on a line at relative `depth` (random when None) and
    again as the last line, whose digits are the answer. Returns the sample and the needle's actual relative depth
    (the line is inserted at the next line start)."""
    key = f"{rng.randrange(10 ** PASSKEY_DIGITS):0{PASSKEY_DIGITS}d}"
    needle, question = f"{NEEDLE}{key}\n", f"\n{NEEDLE}{key}"
    filler = text_window(text, context - len(needle) - len(question), rng)
    depth = rng.random() if depth is None else depth
    cut = filler.find("\n", int(depth * len(filler))) + 1 or int(depth * len(filler))  # at a line start if any
    return filler[:cut] + needle + filler[cut:] + question, cut / len(filler)


def passkey_documents(text: str, contexts: list[int], samples: int, seed: int) -> list[dict]:
    """`samples` documents per context, needle depths spread evenly over [0, 1): each has `prompt` (the sample up to
    and including the question's `# passkey: `), `passkey`, `context` and `depth`."""
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
    shortest = 2 * (len(NEEDLE) + PASSKEY_DIGITS + 1) + 1
    if min(contexts) < shortest:
        raise ValueError(f"Context lengths must be at least {shortest} characters (the needle and the question).")
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
