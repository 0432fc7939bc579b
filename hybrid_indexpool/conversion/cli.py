"""The command line every converter script shares: its common arguments, and running it with the report printed or
the refusal's message and exit status."""

import argparse
import signal
from collections.abc import Callable

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


def run_conversion_command(parser: argparse.ArgumentParser, convert: Callable[[], "ConversionReport"]):
    """Run a converter from its command line: print the report, or exit with status 2 and the refusal's message."""
    try:
        report = convert()
    except ConversionError as error:
        parser.exit(2, f"error: {error}\n")
    except Terminated as stop:
        parser.exit(128 + signal.SIGTERM, f"{stop}: the partial output was removed\n")
    print(report.summary())
    return report


