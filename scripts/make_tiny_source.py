"""Write a tiny random source checkpoint (Qwen4-Exp or GLM-5.3-Flash, with the byte-level tokenizer) to try the
conversion, training and export recipe without downloading the released models; it takes seconds.

    python -m hybrid_indexpool.scripts.make_tiny_source --family qwen4_exp tiny-qwen4-exp
    python -m hybrid_indexpool.scripts.convert_qwen4_exp --source tiny-qwen4-exp --output tiny-ours
"""

import argparse
from pathlib import Path

from hybrid_indexpool.command_line import exit_with_error
from hybrid_indexpool.tiny_sources import FAMILIES, save_tiny_source


def main(argv=None) -> Path:
    """Run the command line `argv` (default `sys.argv[1:]`); returns the folder written."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=FAMILIES, required=True, help="source family to imitate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    parser.add_argument("output", help="folder to write (must not exist, or be empty)")
    args = parser.parse_args(argv)
    try:
        folder = save_tiny_source(args.family, args.output, args.seed)
    except FileExistsError as error:
        exit_with_error(str(error))
    print(f"wrote a tiny random {args.family} checkpoint with the byte-level tokenizer to {folder}")
    return folder


if __name__ == "__main__":
    main()
