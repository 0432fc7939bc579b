"""Write the passkey retrieval task as an `lm-eval` task folder over locally generated data.

Filler text: the held-out files of the Python standard library's source on this machine (as `bench_quality`
evaluates on), or `--text FILE`. Per context length, `--samples` prompts with the needle at depths spread evenly
from the start to the end of the context; the depth of each is kept in the data (`depth`) for a breakdown.

    python -m hybrid_indexpool.scripts.make_retrieval_task --output passkey_task --contexts 2048,8192,32768
    lm_eval --model hf --model_args pretrained=CHECKPOINT,trust_remote_code=True \\
        --include_path passkey_task --tasks hybrid_indexpool_passkey

Context lengths are in characters; with the byte-level tokenizer that is tokens, with a BPE tokenizer fewer.
"""

import argparse
from pathlib import Path

from hybrid_indexpool.command_line import exit_with_error
from hybrid_indexpool.retrieval_task import stdlib_texts, write_lm_eval_task


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", required=True, help="task folder to write (must not exist)")
    parser.add_argument("--contexts", default="2048,8192", help="comma-separated context lengths in characters")
    parser.add_argument("--samples", type=int, default=50, help="prompts per context length (default 50)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--text", help="filler text file (default: the standard library's held-out source)")
    return parser.parse_args(argv)


def main(argv=None) -> list[str]:
    args = parse_arguments(argv)
    try:
        contexts = [int(value) for value in args.contexts.split(",")]
    except ValueError:
        exit_with_error(f"--contexts {args.contexts!r} is not a comma-separated list of integers, e.g. 2048,8192.")
    if args.text is None:
        text = stdlib_texts()[1]
    else:
        try:
            text = Path(args.text).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            exit_with_error(f"cannot read --text {args.text}: {error}; give a UTF-8 text file.")
    try:
        names = write_lm_eval_task(args.output, text, contexts, args.samples, args.seed)
    except (FileExistsError, ValueError) as error:
        exit_with_error(str(error))
    print(f"wrote {len(names)} tasks ({', '.join(names)}) and the group hybrid_indexpool_passkey to {args.output}")
    print(f"run: lm_eval --model hf --model_args pretrained=CHECKPOINT,trust_remote_code=True "
          f"--include_path {args.output} --tasks hybrid_indexpool_passkey")
    return names


if __name__ == "__main__":
    main()
