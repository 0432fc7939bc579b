"""The command line every converter script shares: its common arguments, and running it with the report printed or
the refusal's message and exit status."""

import argparse
import signal
import sys
import warnings
from collections.abc import Callable

from ..command_line import exit_with_error
from .engine import ConversionReport, Terminated
from .errors import ConversionError


def conversion_argument_parser(description: str, source_help: str) -> argparse.ArgumentParser:
    """A converter's command line with the arguments every converter shares: `--source`, `--output`, `--overwrite`,
    `--max_shard_size` and `--no_progress`; the converter adds its own."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", required=True, help=source_help)
    parser.add_argument("--output", required=True, help="folder to write (must not exist unless --overwrite)")
    parser.add_argument("--overwrite", action="store_true", help="replace --output once the conversion succeeded")
    parser.add_argument("--max_shard_size", default="5GB", help="largest output shard (default 5GB)")
    parser.add_argument("--no_progress", action="store_true", help="no progress bar")
    return parser


def show_warning_plainly(message, category, filename, lineno, file=None, line=None) -> None:
    """Print a warning as a command line shows its messages, `warning: ...` on standard error, without the source
    line Python shows for a library's warning."""
    print(f"warning: {message}", file=sys.stderr if file is None else file, flush=True)


def run_conversion_command(parser: argparse.ArgumentParser, convert: Callable[[], "ConversionReport"]):
    """Run a converter from its command line: print the report, or exit with status 2 and the refusal's message;
    warnings along the way are printed as `warning: ...` lines."""
    try:
        with warnings.catch_warnings():
            warnings.showwarning = show_warning_plainly
            report = convert()
    except ConversionError as error:
        exit_with_error(str(error))
    except Terminated as stop:
        parser.exit(128 + signal.SIGTERM, f"{stop}: the partial output was removed\n")
    print(report.summary())
    return report




def run_export_command(description: str, family: str, export: Callable[..., "ConversionReport"], argv=None):
    """The command line of a family's export (`scripts/export_<family>.py`): the converters' shared arguments, with
    `--source` our checkpoint; runs `export(source, output, ...)` as `run_conversion_command` does."""
    parser = conversion_argument_parser(description, f"folder of our checkpoint, converted from {family}")
    args = parser.parse_args(argv)
    return run_conversion_command(parser, lambda: export(
        args.source, args.output, overwrite=args.overwrite, max_shard_size=args.max_shard_size,
        progress=not args.no_progress,
    ))
