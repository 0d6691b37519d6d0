"""`launch sweep`: a grid of runs, locally one after another or as Slurm arrays (one per
allocation shape), its dry run, and what it says when it ends."""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import math
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import submitit

from slurm_ddp_kit.core import (
    runfolder,
    slurm,
    strategies,
)
from slurm_ddp_kit.core.cli import (
    HeldSignals,
    Interrupted,
    exit_status,
    interrupt_word,
    printable,
)
from slurm_ddp_kit.core.runfolder import failures
from slurm_ddp_kit.core.settings.loading import (
    read_override,
)
from slurm_ddp_kit.core.settings.schema import (
    Backend,
    Config,
    ConfigError,
)
from slurm_ddp_kit.launch.checks import check_submission
from slurm_ddp_kit.launch.dryrun import stand_in_sbatch
from slurm_ddp_kit.launch.executor import (
    SubmitError,
    job_of,
    keep_logs_private,
    refusal,
    resolve_backend,
    slurm_parameters,
    task_python,
    without_enclosing_job,
)
from slurm_ddp_kit.launch.follow import interrupted, result_words
from slurm_ddp_kit.launch.submit import record_job, submit


def sweep(
    cfgs: list[Config], commands: list[list[str]], parallel: int | None = None
) -> Iterator[tuple[Path, submitit.Job[Any]]]:
    """Submit a grid of configs (each run folder records its own point's command): on Slurm
    one array (at most `parallel` elements at once); locally one run after another (or
    `parallel` at a time), each waited for before the next starts."""
    for cfg in cfgs:
        check_submission(cfg)
    if resolve_backend(cfgs[0].cluster.backend) == Backend.local:
        yield from _local_sweep(cfgs, commands, parallel or 1)
    else:
        yield from _slurm_sweep(cfgs, commands, parallel)


def _local_sweep(
    cfgs: list[Config], commands: list[list[str]], parallel: int
) -> Iterator[tuple[Path, submitit.Job[Any]]]:
    running: list[submitit.Job[Any]] = []
    for cfg, command in zip(cfgs, commands, strict=True):
        while len(running) >= parallel:
            running = [job for job in running if not job.done()]
            time.sleep(0.5)
        held = HeldSignals()  # until the caller has the run: it names the run on a signal
        try:
            run_dir, job = submit(cfg, command, held=held)
            running.append(job)
            yield run_dir, job
        finally:
            held.release()
        if held.signum is not None:
            raise Interrupted(held.signum)
    while not all(job.done() for job in running):
        time.sleep(0.5)


def _slurm_sweep(
    cfgs: list[Config], commands: list[list[str]], parallel: int | None
) -> Iterator[tuple[Path, submitit.Job[Any]]]:
    """One array per allocation shape and MaxArraySize runs (`_arrays`), each made,
    submitted and recorded in turn; an array Slurm refuses takes its run folders with it, and
    says how many went in. A signal ends the sweep before the next run folder; the runs in the
    queue are the caller's (yielded) and recorded by then. A second signal ends it at once
    (a hanging sbatch), but never between an array's submission and its runs' records."""
    made = runfolder.folders_to_make(cfgs[0].output.root)
    held = HeldSignals()  # from the first run folder until the caller has every run
    held.hold()
    try:
        for start, end in _arrays(cfgs, slurm.max_array_size() or len(cfgs)):
            part = _array_folders(cfgs[start:end], commands[start:end], held)
            if held.signum is not None:  # the caller says how many went in
                _discard_array(part, made)
                break
            try:
                jobs = _array(cfgs[start:end], part, parallel)
            except SubmitError as err:
                _discard_array(part, made)
                went = f"; the first {start} runs were submitted (`launch status`)" if start else ""
                raise SubmitError(f"{err}{went}") from None
            with held.firmly():
                for run_dir, job in zip(part, jobs, strict=True):
                    record_job(run_dir, job)
            yield from zip(part, jobs, strict=True)
    finally:
        held.release()
    if held.signum is not None:
        raise Interrupted(held.signum)


def _arrays(cfgs: list[Config], size: int) -> Iterator[tuple[int, int]]:
    """The sweep's arrays, as (first, end) of its points: points in a row that ask Slurm for the
    same allocation share one, cut at the cluster's MaxArraySize (its limit on an array's
    indices). A sweep of dp,ddp is a DP array (one task per node with all of its CPUs, as a lone
    `submit --mode dp` gets) and a DDP array (a task per GPU), whose figures compare alike."""
    first = 0
    while first < len(cfgs):
        end, shape = first + 1, _allocation(cfgs[first])
        while end < len(cfgs) and end - first < size and _allocation(cfgs[end]) == shape:
            end += 1
        yield first, end
        first = end


def _allocation(cfg: Config) -> str:
    """What an element asks sbatch for, its name aside: elements alike share an array."""
    asked = slurm_parameters(cfg, "")
    return repr(sorted((key, value) for key, value in asked.items() if key != "job_name"))


def _array_folders(cfgs: list[Config], commands: list[list[str]], held: HeldSignals) -> list[Path]:
    """An array's run folders, made until a signal comes (a second one: none left behind)."""
    part: list[Path] = []
    try:
        for cfg, command in zip(cfgs, commands, strict=True):
            if held.signum is not None:
                break
            part.append(runfolder.create(cfg, "launch sweep", "slurm", command))
    except KeyboardInterrupt:
        _discard_array(part, [])
        raise
    return part


def _discard_array(run_dirs: list[Path], made: list[Path]) -> None:
    """An array's run folders that no job runs in, and its logs' folder (`sweeps/` too where
    nothing else is left in it)."""
    logs = [runfolder.sweep_logs_dir(run_dirs[0])] if run_dirs else []
    runfolder.discard([*run_dirs, *logs], [*(path.parent for path in logs), *made])


def _array(
    cfgs: list[Config], run_dirs: list[Path], parallel: int | None
) -> list[submitit.Job[Any]]:
    """One Slurm array of these runs; SubmitError with sbatch's words if Slurm refuses it."""
    logs = runfolder.sweep_logs_dir(run_dirs[0])
    executor = _array_executor(cfgs, logs, run_dirs[0], parallel)
    try:
        with without_enclosing_job(), contextlib.redirect_stderr(io.StringIO()):
            return executor.map_array(job_of(cfgs[0], element=True), [str(d) for d in run_dirs])
    except (submitit.core.utils.FailedSubmissionError, submitit.core.utils.FailedJobError) as err:
        raise SubmitError(refusal(err, f"the sweep's array of {len(run_dirs)} runs")) from None


def _array_executor(
    cfgs: list[Config], logs: Path, first: Path, parallel: int | None
) -> submitit.SlurmExecutor:
    """One array's executor (its elements ask for one allocation alike: `_arrays`), its
    elements started as every job's tasks are."""
    # Each element checks its own cluster.max_requeues first; submitit's count must not end it sooner.
    most = max(c.cluster.max_requeues for c in cfgs)
    shape = cfgs[0]
    keep_logs_private(logs)
    executor = submitit.SlurmExecutor(folder=logs, max_num_timeout=most, python=task_python(shape))
    executor.update_parameters(**slurm_parameters(shape, f"sweep-{first.name}"))
    # No --parallel: every element may run at once (submitit's own default caps an array at 256).
    executor.update_parameters(array_parallelism=parallel or len(cfgs))
    return executor


def sweep_dry_run(cfgs: list[Config], parallel: int | None = None) -> str:
    """What `sweep` would do, refusing what it would refuse: each run's grid point and folder,
    and on Slurm the array's exact batch script. Nothing is created."""
    for cfg in cfgs:
        check_submission(cfg, dry_run=True)
    run_dirs = [runfolder.check_root(c.output.root) / runfolder.new_name(c) for c in cfgs]
    head = "".join(f"run folder (made on submit): {d}\n" for d in run_dirs)
    if resolve_backend(cfgs[0].cluster.backend) == Backend.local:
        at_once = parallel or 1
        return f"{head}backend: local (submitit LocalExecutor), {at_once} run(s) at a time\n"
    arrays = list(_arrays(cfgs, len(cfgs)))  # the cluster's MaxArraySize is not asked for
    said = [f"{head}backend: slurm (submitit SlurmExecutor), {len(arrays)} array(s)\n"]
    for first, end in arrays:
        script = _array_script(cfgs[first:end], run_dirs[first:end], parallel)
        said.append(f"\narray of points {first}-{end - 1}:\n{script}")
    return "".join(said)


def _array_script(cfgs: list[Config], run_dirs: list[Path], parallel: int | None) -> str:
    with (
        tempfile.TemporaryDirectory(prefix="kit-dry-run-") as scratch,
        stand_in_sbatch(Path(scratch)) as captured,
    ):
        logs = Path(scratch) / "logs"
        executor = _array_executor(cfgs, logs, run_dirs[0], parallel)
        executor.map_array(job_of(cfgs[0], element=True), [str(d) for d in run_dirs])
        return captured.read_text().replace(str(logs), str(runfolder.sweep_logs_dir(run_dirs[0])))


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
    return _local_sweep_result(submitted)


def _say_interrupted(err: KeyboardInterrupt, submitted: list[tuple[Path, Any]], runs: int) -> None:
    """An interrupted sweep: its local runs ended cleanly, and what goes on of it, in words."""
    queued = [run_dir for run_dir, job in submitted if isinstance(job, submitit.SlurmJob)]
    for run_dir, job in submitted:
        if isinstance(job, submitit.LocalJob) and _in_flight(run_dir, job):
            print(printable(interrupted(job, run_dir, err)), file=sys.stderr, flush=True)
    if queued:  # one line, not a Slurm query and a line per run
        print(f"{interrupt_word(err)}: {_queued_words(queued, submitted)}", file=sys.stderr)
    if len(submitted) < runs:
        print(
            f"{interrupt_word(err)}: {runs - len(submitted)} of the sweep's "
            f"{runs} runs were not submitted",
            file=sys.stderr,
        )


SWEEP_RUNS_NAMED = 6  # an interrupted sweep's hint names its run folders up to this many


def _queued_words(queued: list[Path], submitted: list[tuple[Path, Any]]) -> str:
    """What goes on of an interrupted Slurm sweep, and how to follow or cancel it alone (its
    root may hold other runs): its run folders, or, for many, its job arrays."""
    if len(queued) <= SWEEP_RUNS_NAMED:
        runs = " ".join(map(str, queued))
        return (
            f"the sweep's {len(queued)} submitted Slurm job(s) go on: `python -m launch status "
            f"{runs}`, `python -m launch cancel {runs}`"
        )
    arrays = " ".join(dict.fromkeys(str(job.job_id).split("_")[0] for _, job in submitted))
    return (
        f"the sweep's {len(queued)} submitted Slurm job(s) go on, in job array(s) {arrays}: "
        f"`python -m launch status {queued[0].parent}` lists them among that folder's runs; "
        f"`scancel {arrays}` cancels them alone"
    )


def _in_flight(run_dir: Path, job: Any) -> bool:
    """A local run that an interrupt may have ended: still running, or ended with neither a
    summary nor a failure of its own (the terminal's Ctrl-C reached its controller and ranks
    before this process could cancel it)."""
    if not job.done():
        return True
    if runfolder.of_kind(runfolder.read_rank(run_dir, 0), "summary"):
        return False
    first = failures.first_failure(run_dir)
    return first is None or str(first.get("error", "")).startswith("KeyboardInterrupt")


def _local_sweep_result(submitted: list[tuple[Path, Any]]) -> int:
    """A local sweep has waited for its runs: 1, with a line per failed run, if any failed.
    (A Slurm sweep's runs are still queued: `launch status` follows them.)"""
    import submitit

    from slurm_ddp_kit.launch.jobs import failure_line

    local = [run_dir for run_dir, job in submitted if isinstance(job, submitit.LocalJob)]
    summaries = {d: runfolder.of_kind(runfolder.read_rank(d, 0), "summary") for d in local}
    for run_dir, summary in summaries.items():  # each run's result, in the order submitted
        if summary:
            print(printable(f"{run_dir.name}: {result_words(summary[-1])}"), flush=True)
    failed = [d for d, s in summaries.items() if not s or s[-1].get("diverged_epoch") is not None]
    for run_dir in failed:
        if not summaries[run_dir]:  # a diverged run has said so above
            line = failure_line(run_dir) or f"{run_dir.name}: ended without a summary"
            print(printable(line), file=sys.stderr)
    if local:
        print(f"{len(local) - len(failed)} of the sweep's {len(local)} runs completed", flush=True)
    if failed:
        print(
            f"{len(failed)} of the sweep's {len(local)} runs failed: see "
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
