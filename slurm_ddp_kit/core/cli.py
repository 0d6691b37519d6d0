"""What every command line of the kit shares: the parser, the common flags, and the one wrapper.

The wrapper turns a `KitError` into one line that names the fix, with exit code 2; any other
exception is a bug and keeps its traceback (exit code 1); Ctrl-C is one line and exit code 130
(and where `interrupt_on` says so, SIGTERM and SIGHUP: 143, 129).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import re
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from importlib import metadata
from typing import Any, NoReturn

from slurm_ddp_kit.core.errors import KitError

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command ended by Ctrl-C
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, as a shell reports a writer whose reader went away
DISTRIBUTION = "slurm-ddp-kit"


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors read like the kit's: one line, where the help is, exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"error: {message} (see `{self.prog} --help`)\n")


CONFIG_HELP = (
    "a YAML file of settings merged over the defaults; repeat it to merge several in order, the "
    "later winning key by key (a cluster's file, then an experiment's)"
)


def add_common_flags(parser: argparse.ArgumentParser) -> None:
    """--version, -v and -q: the ordinary habits of a command line."""
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="say more (debug output)"
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="print errors and results only")


def command_adder(
    commands: Any,
    examples: dict[str, list[str]],
    settings: Callable[[argparse.ArgumentParser], None],
) -> Callable[..., argparse.ArgumentParser]:
    """`command(name, func, text, config=False)` for one parser's subcommands (argparse's
    subparsers): each with its help, the common flags, `settings(sub)` (--config FILE and
    key=value words) where `config`, and its examples at the end of its --help, each written
    after the subcommand's own words (`python -m launch submit`, or `slurm-ddp-kit submit`)."""

    def command(
        name: str, func: object, text: str, config: bool = False
    ) -> argparse.ArgumentParser:
        sub = commands.add_parser(
            name, help=text, description=text, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        sub.epilog = "examples:\n" + "".join(
            f"  {sub.prog} {line}".rstrip() + "\n" for line in examples[name]
        )
        add_common_flags(sub)
        sub.set_defaults(func=func)
        if config:
            settings(sub)
        return sub

    return command


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
        print(f"error: {printable(str(err))}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt as err:  # what was written stays; nothing to report but that
        with contextlib.suppress(OSError):  # a terminal that hung up takes no line
            print(interrupt_word(err), file=sys.stderr)
        return exit_status(err)
    except BrokenPipeError:  # the reader went away (`| head`): end quietly, as `yes | head` does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # for the final flush
        return EXIT_BROKEN_PIPE
    except OSError as err:
        if err.errno not in _PATH_FIXES:  # anything else is a bug: its traceback
            raise
        print(f"error: {printable(str(err.filename))}: {_PATH_FIXES[err.errno]}", file=sys.stderr)
        return EXIT_USAGE


# A path the user gave that the system refuses (a setting, a run folder, a file): what to do.
_PATH_FIXES = {
    errno.ENAMETOOLONG: "a name in this path is longer than the file system takes (255 bytes "
    "a name, 4096 a path): shorten it",
    errno.EACCES: "permission denied: pick a path this user can reach, or ask its owner for access",
}


# What a terminal acts on rather than shows (an escape sequence, a bell, a carriage return that
# writes over the line) or shows as nothing (direction and zero-width marks): a record, a log or
# a folder name may hold any of them, and the kit prints all of those. A line break and a tab
# are shown as they are.
_UNSHOWN = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]")


def printable(text: str) -> str:
    """The text as the kit prints it: each character of `_UNSHOWN` written as its escape
    (ESC as `\\x1b`), so that nothing read from a run folder can drive the terminal."""
    return _UNSHOWN.sub(_escape, text)


def _escape(found: re.Match[str]) -> str:
    return repr(found.group())[1:-1]


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP, ending a command the way Ctrl-C does: one line, what was started
    cancelled or said to go on (`interrupt_on`)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


_WORDS = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated", signal.SIGHUP: "hung up"}
ENDING = tuple(_WORDS)


def interrupt_word(err: KeyboardInterrupt) -> str:
    return _WORDS.get(signal.Signals(getattr(err, "signum", signal.SIGINT)), "interrupted")


def exit_status(err: KeyboardInterrupt) -> int:
    """128 + the signal, as a shell reports a command a signal ended (130 for Ctrl-C)."""
    return 128 + int(getattr(err, "signum", signal.SIGINT))


def _raise_interrupted(signum: int, frame: object) -> None:
    raise Interrupted(signum)


def interrupt_on(*signums: int) -> None:
    """Let these signals end the command as Ctrl-C does, rather than kill it without a word;
    one that was ignored when the command started (`nohup`) stays ignored."""
    for signum in signums:
        with contextlib.suppress(ValueError):  # not the main thread
            if signal.getsignal(signum) == signal.SIG_DFL:
                signal.signal(signum, _raise_interrupted)


class HeldSignals:
    """Ctrl-C, SIGTERM and SIGHUP held back from `hold()` to `release()`: while a job is being
    started and recorded, so that one that comes then is taken once the job can be named,
    cancelled or said to go on, never leaving a job no record knows; a second one is not held.
    `signum`: the first that came. A signal ignored before (a shell's background job ignores
    Ctrl-C) stays without effect; the job started meanwhile still hears it (a handled signal is
    reset at exec)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._before: dict[int, Any] = {}
        self._firm = False

    def hold(self) -> None:
        for signum in ENDING:
            with contextlib.suppress(ValueError):  # not the main thread: nothing held
                self._before[signum] = signal.signal(signum, self._note)

    def _note(self, signum: int, frame: object) -> None:
        if self._before.get(signum) == signal.SIG_IGN:
            return
        if self.signum is not None and not self._firm:  # asked twice (a submission that
            raise Interrupted(self.signum)  # hangs): not held again
        self.signum = self.signum or signum

    @contextlib.contextmanager
    def firmly(self) -> Iterator[None]:
        """Every signal held, a second one too: for work that is quick and must not be cut
        short (recording jobs already submitted)."""
        self._firm = True
        try:
            yield
        finally:
            self._firm = False

    def release(self) -> None:
        for signum, before in self._before.items():
            signal.signal(signum, signal.SIG_DFL if before is None else before)
        self._before = {}


VERBOSE = "KIT_VERBOSE"  # the launcher's -v, passed on to its jobs (which inherit the environment)


def setup_logging(verbose: int = 0, quiet: bool = False) -> None:
    """Messages to stderr, each line written as it happens (job logs show progress live)."""
    if verbose:
        os.environ[VERBOSE] = str(verbose)
    level = logging.WARNING if quiet else logging.DEBUG if verbose else logging.INFO
    logging.basicConfig(level=level, format="%(message)s", stream=sys.stderr, force=True)
    for handler in logging.getLogger().handlers:
        handler.setFormatter(_PrintableFormatter("%(message)s"))


class _PrintableFormatter(logging.Formatter):
    """Messages as `printable` writes them: a warning quotes records and paths."""

    def format(self, record: logging.LogRecord) -> str:
        return printable(super().format(record))


def main_of(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> int:
    """Parse argv with `parser` (whose commands set `func`) and run the command."""
    args = parser.parse_args(argv)
    return run_cli(args.func, args)
