"""The one way every command ends on bad input: `error: ...` (what is wrong and the fix) on standard error, exit
status 2, as argparse ends a bad command line; no traceback."""

import sys
from typing import NoReturn


def exit_with_error(message: str) -> NoReturn:
    """End the command with `error: message` on standard error and exit status 2."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)
