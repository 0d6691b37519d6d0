"""`python -m analysis summarize`: DP against DDP, one table per group of comparable runs."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

# Neither imports pandas at the top: it loads while other processes read the runs (load_runs).
from slurm_ddp_kit.analysis.cache import path_for as cache_path
from slurm_ddp_kit.analysis.formats import FORMATS
from slurm_ddp_kit.analysis.load import load_runs, resolve_run_dirs
from slurm_ddp_kit.analysis.table import Group, group_runs
from slurm_ddp_kit.core.cli import ArgumentParser, add_common_flags, main_of, printable
from slurm_ddp_kit.core.errors import KitError

PLOT_SUFFIXES = (".png", ".svg", ".pdf")
EPILOG = """\
Figures: seconds per epoch is the median of epochs 2..N (an epoch ends when its slowest rank does);
the first epoch is shown apart. Runs that differ in any setting or in hardware are never pooled:
each group gets its own table, repeats within a group give the median per figure. A figure the run
did not record (GPU figures on CPU, say) is shown as n/m (not measured). Runs of a program of your
own (`launch submit ... -- python my_train.py`) get groups of their own, one per command: wall
time, and seconds per epoch, final loss and accuracy from the records it logged (docs/programs.md).

examples:
  python -m analysis summarize                       every run under runs/
  python -m analysis summarize runs/20261130-101500-ddp-1n4g-3f2a runs/20261130-102000-dp-1n4g-9c1e
  python -m analysis summarize --format csv > table.csv
  python -m analysis summarize --plot comparison.png
"""


class UsageError(KitError):
    """The command line asks for something this command cannot do; the message names the fix."""


def main(argv: Sequence[str] | None = None, prog: str = "python -m analysis") -> int:
    return main_of(_parser(prog), argv)


def _parser(prog: str = "python -m analysis") -> argparse.ArgumentParser:
    parser = ArgumentParser(prog=prog, description=__doc__)
    add_common_flags(parser)
    commands = parser.add_subparsers(required=True, metavar="COMMAND")
    summarize = commands.add_parser(
        "summarize",
        help="print the DP vs DDP comparison table of finished runs",
        description="Print the DP vs DDP comparison table of finished runs.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_common_flags(summarize)
    summarize.add_argument(
        "run_dirs",
        nargs="*",
        type=Path,
        metavar="RUN_DIR",
        help="a run folder, or a folder holding run folders (default: every run under --root)",
    )
    summarize.add_argument(
        "--root",
        type=Path,
        default=Path("runs"),
        help="where to look when no RUN_DIR is given (default: runs, the kit's output.root)",
    )
    summarize.add_argument(
        "--format",
        default="markdown",
        metavar="|".join(FORMATS),
        help="markdown (default): a table per group; csv or json: one record per group, figure "
        "and mode, numbers as numbers, with units, settings and hardware",
    )
    summarize.add_argument(
        "--plot",
        type=Path,
        metavar="FILE.png",
        help="also draw epoch times and throughput per strategy into this image",
    )
    summarize.add_argument(
        "--no-cache",
        action="store_true",
        help="read every run afresh; by default a run unchanged since the last summary of the "
        "same folders is not read again (the cache is under $XDG_CACHE_HOME/kit or ~/.cache/kit)",
    )
    summarize.set_defaults(func=_summarize)
    return parser


SKIPS_SHOWN = 10  # skipped runs named one by one; more (a cancelled sweep) are counted


def _shortened(notes: list[str]) -> list[str]:
    """The notes, with the skipped runs past the first SKIPS_SHOWN counted in one line."""
    skipped = [note for note in notes if note.startswith("skipped ")]
    if len(skipped) <= SKIPS_SHOWN:
        return notes
    left = set(skipped[SKIPS_SHOWN:])
    kept = [note for note in notes if note not in left]
    return [*kept, f"skipped {len(left)} more run(s) not finished: `launch status` shows each"]


def _summarize(args: argparse.Namespace) -> int:
    if args.format not in FORMATS:
        raise UsageError(f"--format {args.format} is not known: use one of {', '.join(FORMATS)}")
    if args.plot and args.plot.suffix.lower() not in PLOT_SUFFIXES:
        raise UsageError(f"--plot {args.plot}: end the name in {' or '.join(PLOT_SUFFIXES)}")
    run_dirs = resolve_run_dirs(args.run_dirs, args.root)
    cache = None if args.no_cache else cache_path(args.run_dirs or [args.root])
    runs, notes = load_runs(run_dirs, parallel=True, cache=cache)  # nothing runs on import here
    groups, alone = group_runs(runs)
    # Warnings, skipped runs, largest-batch runs in no table: on stderr, stdout stays a clean table.
    for note in _shortened([*notes, *alone]):
        print(printable(note), file=sys.stderr)
    if not groups:
        print(
            f"error: none of the {len(run_dirs)} run(s) has finished its training (why: above): "
            "nothing to summarize",
            file=sys.stderr,
        )
        return 1
    print(printable(FORMATS[args.format](groups)), end="")
    if args.plot:
        _plot(groups, args.plot)
    return 0


def _plot(groups: list[Group], path: Path) -> None:
    from slurm_ddp_kit.analysis.plot import (
        save_plot,
    )  # matplotlib is only imported when a plot is asked for

    try:
        save_plot(groups, path)
    except OSError as err:
        raise UsageError(
            f"--plot {path}: cannot write it ({err.strerror}): pick another path"
        ) from None
    print(f"plot: {path}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
