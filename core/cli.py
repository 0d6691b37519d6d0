"""What every command line of the kit shares: the parser, the common flags, and the one wrapper.

The wrapper turns a `KitError` into one line that names the fix, with exit code 2; any other
exception is a bug and keeps its traceback (exit code 1); Ctrl-C is one line and exit code 130.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from importlib import metadata
from typing import NoReturn

from core.errors import KitError

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command ended by Ctrl-C
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, as a shell reports a writer whose reader went away
DISTRIBUTION = "slurm-ddp-kit"


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors read like the kit's: one line, where the help is, exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"error: {message} (see `{self.prog} --help`)\n")


def add_common_flags(parser: argparse.ArgumentParser) -> None:
    """--version, -v and -q: the ordinary habits of a command line."""
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="say more (debug output)"
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="print errors and results only")


def version() -> str:
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def run_cli(func: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run a parsed command: a KitError becomes one line and exit 2; anything else propagates."""
    setup_logging(getattr(args, "verbose", 0), getattr(args, "quiet", False))
    try:
        return int(func(args))
    except KitError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:  # Ctrl-C: what was written stays; nothing to report but that
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # the reader went away (`| head`): end quietly, as `yes | head` does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # for the final flush
        return EXIT_BROKEN_PIPE


VERBOSE = "KIT_VERBOSE"  # the launcher's -v, passed on to its jobs (which inherit the environment)


def setup_logging(verbose: int = 0, quiet: bool = False) -> None:
    """Messages to stderr, each line written as it happens (job logs show progress live)."""
    if verbose:
        os.environ[VERBOSE] = str(verbose)
    level = logging.WARNING if quiet else logging.DEBUG if verbose else logging.INFO
    logging.basicConfig(level=level, format="%(message)s", stream=sys.stderr, force=True)


def main_of(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> int:
    """Parse argv with `parser` (whose commands set `func`) and run the command."""
    args = parser.parse_args(argv)
    return run_cli(args.func, args)
