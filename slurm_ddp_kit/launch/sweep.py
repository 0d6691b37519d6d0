"""`launch sweep`: a grid of runs, submitted as their backend runs a sweep (`launch.backends`:
locally one after another, on Slurm as arrays, one per allocation shape), its dry run, and what
it says when it ends."""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import submitit

from slurm_ddp_kit.core import (
    runfolder,
    strategies,
)
from slurm_ddp_kit.core.cli import (
    exit_status,
    interrupt_word,
    printable,
)
from slurm_ddp_kit.core.settings.loading import (
    read_override,
)
from slurm_ddp_kit.core.settings.schema import (
    Config,
    ConfigError,
)
from slurm_ddp_kit.launch import backends
from slurm_ddp_kit.launch.checks import check_submission
from slurm_ddp_kit.launch.code import CodeCopy
from slurm_ddp_kit.launch.follow import result_words


def sweep(
    cfgs: list[Config], commands: list[list[str]], parallel: int | None = None
) -> Iterator[tuple[Path, submitit.Job[Any]]]:
    """Submit a grid of configs (each run folder records its own point's command) as their
    backend runs a sweep: on Slurm arrays (at most `parallel` elements at once); locally one
    run after another (or `parallel` at a time), each waited for before the next starts."""
    for cfg in cfgs:
        check_submission(cfg)
    code = CodeCopy(cfgs[0])  # one copy for every run, planned before any is made
    yield from backends.chosen(cfgs[0]).sweep(cfgs, commands, parallel, code)


def sweep_dry_run(cfgs: list[Config], parallel: int | None = None) -> str:
    """What `sweep` would do, refusing what it would refuse: each run's grid point and folder,
    and the backend's part (on Slurm each array's exact batch script). Nothing is created."""
    for cfg in cfgs:
        check_submission(cfg, dry_run=True)
    run_dirs = [runfolder.check_root(c.output.root) / runfolder.new_name(c) for c in cfgs]
    head = "".join(f"run folder (made on submit): {d}\n" for d in run_dirs)
    return head + backends.chosen(cfgs[0]).sweep_dry_run(cfgs, run_dirs, parallel)


def points(args: argparse.Namespace) -> list[tuple[str, ...]]:
    """The sweep's runs, each as its words (`mode=…` and one value of each --grid setting)."""
    if args.parallel is not None and args.parallel < 1:
        raise ConfigError(f"--parallel {args.parallel}: give at least 1")
    modes = _sweep_modes(args)
    _check_grid_against_overrides(args.grid, args.overrides)
    return [(f"mode={mode}", *point) for mode in modes for point in grid(args.grid, len(modes))]


def run(args: argparse.Namespace, points: list[tuple[str, ...]], cfgs: list[Config]) -> int:
    """`launch sweep`: each point's config submitted (or shown, with --dry-run); locally, the
    runs' results once they end."""
    if args.dry_run:
        print("".join(f"point {n}: {' '.join(p)}\n" for n, p in enumerate(points)), end="")
        print(sweep_dry_run(cfgs, args.parallel), end="")
        return 0
    submitted: list[tuple[Path, Any]] = []
    try:
        for (run_dir, job), point in zip(
            sweep(cfgs, [_point_command(p) for p in points], args.parallel), points, strict=False
        ):
            submitted.append((run_dir, job))
            print(
                f"submitted job {job.job_id}  {' '.join(point)}  run folder: {run_dir}", flush=True
            )
    except KeyboardInterrupt as err:  # locally the sweep waits for its runs: ends them cleanly
        _say_interrupted(err, submitted, len(cfgs))
        return exit_status(err)
    return _sweep_result(submitted)


def _say_interrupted(err: KeyboardInterrupt, submitted: list[tuple[Path, Any]], runs: int) -> None:
    """An interrupted sweep, in words: what became of its submitted runs (the backend's: local
    runs ended cleanly, Slurm's going on), and how many were not submitted."""
    if submitted:
        for line in backends.of_job(submitted[0][1]).sweep_interrupted(err, submitted):
            print(printable(line), file=sys.stderr, flush=True)
    if len(submitted) < runs:
        print(
            f"{interrupt_word(err)}: {runs - len(submitted)} of the sweep's "
            f"{runs} runs were not submitted",
            file=sys.stderr,
        )


def _sweep_result(submitted: list[tuple[Path, Any]]) -> int:
    """A sweep whose backend waited for its runs (locally): 1, with a line per failed run, if
    any failed. (A Slurm sweep's runs are still queued: `launch status` follows them.)"""
    from slurm_ddp_kit.launch.jobs import failure_line

    ended = [d for d, job in submitted if backends.of_job(job).sweep_waits]
    summaries = {d: runfolder.of_kind(runfolder.read_rank(d, 0), "summary") for d in ended}
    for run_dir, summary in summaries.items():  # each run's result, in the order submitted
        if summary:
            print(printable(f"{run_dir.name}: {result_words(summary[-1])}"), flush=True)
    failed = [d for d, s in summaries.items() if not s or s[-1].get("diverged_epoch") is not None]
    for run_dir in failed:
        if not summaries[run_dir]:  # a diverged run has said so above
            line = failure_line(run_dir) or f"{run_dir.name}: ended without a summary"
            print(printable(line), file=sys.stderr)
    if ended:
        print(f"{len(ended) - len(failed)} of the sweep's {len(ended)} runs completed", flush=True)
    if failed:
        print(
            f"{len(failed)} of the sweep's {len(ended)} runs failed: see "
            "`python -m launch logs RUN`",
            file=sys.stderr,
        )
    return 1 if failed else 0


def _sweep_modes(args: argparse.Namespace) -> list[str]:
    """The modes of a sweep come from --modes alone: another mode given (--mode, mode=…, a
    --grid over mode) would override each of them and make identical runs, so it is refused."""
    modes = args.modes.split(",")
    given = [f"--mode {args.mode}"] * (args.mode is not None) + [
        item for item in [*args.overrides, *args.grid] if item.partition("=")[0].strip() == "mode"
    ]
    if given:
        wanted = args.mode or given[0].partition("=")[2] or ",".join(strategies.names())
        raise ConfigError(
            f"{given[0]} conflicts with --modes {args.modes}: a sweep's modes come from --modes "
            f"alone, e.g. --modes {wanted}"
        )
    if len(set(modes)) < len(modes):
        raise ConfigError(
            f"--modes {args.modes} names a mode twice: give each once, e.g. "
            f"--modes {','.join(dict.fromkeys(modes))}"
        )
    return modes


def _point_command(point: tuple[str, ...]) -> list[str]:
    """A sweep run's own command, as its run folder keeps it: the sweep's, with its grid replaced by
    this run's point (a 1,000-point grid is not repeated in 1,000 files)."""
    kept, words = [], iter(sys.argv[1:])
    for word in words:
        if word in ("--grid", "--modes"):
            next(words, None)  # and its value
        elif not word.startswith(("--grid=", "--modes=")):
            kept.append(word)
    mode, *values = point
    return ["python", "-m", "launch", *kept, "--modes", mode.removeprefix("mode="),
            *(f"--grid={value}" for value in values)]  # fmt: skip


MAX_POINTS = 10_000  # Slurm's default MaxJobCount: the jobs a cluster holds at once


def grid(items: list[str], modes: int = 1) -> list[tuple[str, ...]]:
    """['a=1,2', 'b=x'] → [('a=1', 'b=x'), ('a=2', 'b=x')], for a sweep of `modes` modes."""
    axes, keys = [], set()
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or not key or not all(values.split(",")):
            raise ConfigError(
                f"--grid {item!r} is not of the form key=v1,v2, e.g. train.global_batch_size=256,512"
            )
        if key.strip() in keys:  # every point would run twice, or the later value would win
            raise ConfigError(f"--grid {key} is given twice: give its values once, in one --grid")
        listed = values.split(",")
        _check_values_differ(key, listed)
        keys.add(key.strip())
        axes.append([f"{key}={v}" for v in listed])
    count = modes * math.prod(len(axis) for axis in axes)
    if count > MAX_POINTS:
        raise ConfigError(
            f"--modes and --grid make {count:,} points: a sweep holds at most {MAX_POINTS:,} (Slurm's default "
            "limit of jobs queued at once); split it into several sweeps, or give fewer values"
        )
    return list(itertools.product(*axes))


def _check_values_differ(key: str, listed: list[str]) -> None:
    """Two values that read the same (0.1 and 0.10, true and True) would run one point twice."""
    firsts: dict[str, str] = {}  # each value as read → the first text that reads as it
    twice = []
    for text in listed:
        _, value = read_override(f"{key}={text}")
        read = json.dumps(value, sort_keys=True, default=str)
        if read in firsts:
            twice.append(f"{firsts[read]} and {text}")
        firsts.setdefault(read, text)
    if twice:
        raise ConfigError(
            f"--grid {key}={','.join(listed)} names one value twice ({twice[0]}): give each "
            f"once, e.g. {key}={','.join(firsts.values())}"
        )


def _check_grid_against_overrides(items: list[str], overrides: list[str]) -> None:
    """A key both swept and set would lose the set value to each point's without a word."""
    set_keys = {item.partition("=")[0].strip(): item for item in overrides}
    for item in items:
        key = item.partition("=")[0].strip()
        if key in set_keys:
            raise ConfigError(
                f"{set_keys[key]} and --grid {item} both set {key}: give it once, in the grid "
                "or as a setting"
            )
