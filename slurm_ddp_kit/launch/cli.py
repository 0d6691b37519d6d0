"""`python -m launch …`: resolve configs, submit runs and sweeps, and operate their jobs."""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from slurm_ddp_kit.core import container, datafiles, processes, runfolder, slurm, strategies
from slurm_ddp_kit.core.cli import (
    CONFIG_HELP,
    ENDING,
    EXIT_USAGE,
    ArgumentParser,
    HeldSignals,
    Interrupted,
    add_common_flags,
    exit_status,
    interrupt_on,
    interrupt_word,
    printable,
    run_cli,
)
from slurm_ddp_kit.core.errors import KitError
from slurm_ddp_kit.core.settings.loading import load_config, read_override, to_yaml
from slurm_ddp_kit.core.settings.schema import Config, ConfigError, Requeue
from slurm_ddp_kit.core.strategies import STRATEGIES
from slurm_ddp_kit.launch import files


def main(argv: Sequence[str] | None = None, prog: str = "python -m launch") -> int:
    parser = _parser(prog)
    words, program = _program_apart(sys.argv[1:] if argv is None else list(argv))
    args, extra = parser.parse_known_args(words)
    if program and "overrides" not in args:
        parser.error("`-- PROGRAM ARGS…` follows submit, sweep, prepare or config alone")
    args.program = program
    # argparse stops collecting key=value at the first flag; take the ones that follow flags too.
    unknown = [e for e in extra if e.startswith("-") or "overrides" not in args]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    interrupt_on(*ENDING)  # a SIGTERM or a closed terminal ends a command as Ctrl-C does
    return run_cli(args.func, args)


# The console command also runs the analysis (slurm_ddp_kit/cli.py).
_ALSO = {"slurm-ddp-kit": "also: slurm-ddp-kit summarize [RUN_DIR …]: the comparison table of "
         "finished runs (`slurm-ddp-kit summarize --help`)"}  # fmt: skip


def _program_apart(argv: list[str]) -> tuple[list[str], list[str]]:
    """The kit's words, and the user's program after the first `--` (none: the kit's loop)."""
    if "--" not in argv:
        return argv, []
    at = argv.index("--")
    if at == len(argv) - 1:
        sys.stderr.write(
            "error: nothing follows `--`: give the program to run, e.g. "
            "`-- python my_train.py --epochs 3` (see `python -m launch submit --help`)\n"
        )
        raise SystemExit(EXIT_USAGE)
    return argv[:at], argv[at + 1 :]


def _parser(prog: str = "python -m launch") -> argparse.ArgumentParser:
    parser = ArgumentParser(prog=prog, description=__doc__, epilog=_ALSO.get(prog))
    add_common_flags(parser)
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    def command(
        name: str, func: object, text: str, config: bool = False
    ) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=text, description=text)
        add_common_flags(sub)
        sub.set_defaults(func=func)
        if config:
            _add_config_arguments(sub)
        return sub

    command("config", _config, "print the resolved config as YAML", config=True)
    submit = command(
        "submit", _submit, "create a run folder and submit the training job", config=True
    )
    submit.add_argument("--wait", action="store_true", help="follow the job, one line per epoch")
    submit.add_argument(
        "--dry-run", action="store_true", help="print the batch script and parameters only"
    )
    sweep = command("sweep", _sweep, "submit a grid of runs as one Slurm array", config=True)
    # A sweep's modes are --modes: --mode stays only to be refused with the fix (_sweep_modes).
    _hide(sweep, "--mode")
    sweep.add_argument("--modes", default="dp,ddp", help="comma-separated modes (default: dp,ddp)")
    sweep.add_argument(
        "--parallel",
        type=int,
        metavar="N",
        help="runs at once (default: locally 1, one after another; on Slurm no limit)",
    )
    sweep.add_argument(
        "--dry-run", action="store_true", help="print each run's point and the array script only"
    )
    sweep.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="a setting to vary; repeatable",
    )
    prepare = command(
        "prepare",
        _prepare,
        "create a run folder for an sbatch script and print its path",
        config=True,
    )
    prepare.add_argument("--launcher", default="sbatch", help=argparse.SUPPRESS)
    prepare.add_argument(
        "--shell", action="store_true", help="print shell assignments (run_dir, rank_log, srun_log)"
    )
    status = command(
        "status", _status, "show each run's job, state, nodes, elapsed time and last epoch"
    )
    _add_run_arguments(status, many=True)
    resume = command(
        "resume",
        _resume,
        "continue a run whose job stopped (failed, cancelled, out of requeues) from its checkpoint",
    )
    _add_run_arguments(resume, many=False)
    resume.add_argument("--wait", action="store_true", help="follow the job, one line per epoch")
    cancel = command(
        "cancel", _cancel, "cancel runs' jobs: run folders, or a folder holding them (a sweep)"
    )
    cancel.add_argument("runs", nargs="+", type=_folder, metavar="RUN", help="what to cancel")
    logs = command("logs", _logs, "print a run's log for one rank")
    _add_run_arguments(logs, many=False)
    logs.add_argument(
        "--rank", type=int, help="which rank's log (default: the rank that failed first, else 0)"
    )
    init = command(
        "init",
        _init,
        "put the sbatch scripts and the examples (settings files, a DDP script) into a project",
    )
    init.add_argument(
        "folder", nargs="?", type=Path, default=Path("."), help="where (default: this folder)"
    )
    return parser


def _add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--mode",
        choices=strategies.names(),
        help="the strategy: " + "; ".join(f"{s.name}: {s.summary}" for s in STRATEGIES.values()),
    )
    parser.add_argument("--nodes", type=int, help="number of nodes (DDP only above 1)")
    parser.add_argument(
        "--config", dest="config_files", action="append", default=[], metavar="FILE",
        help=CONFIG_HELP,
    )  # fmt: skip
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. train.epochs=3")


def _hide(parser: argparse.ArgumentParser, flag: str) -> None:
    """Leave `flag` out of the parser's help (it is still parsed)."""
    for action in parser._actions:  # argparse has no public way to change an added argument
        if flag in action.option_strings:
            action.help = argparse.SUPPRESS


def _runs_in(path: Path) -> list[Path]:
    """A run folder, or the run folders a folder holds (a sweep's root, say); the path alone
    where it is neither, for the reader to say what it is."""
    return (runfolder.find_runs(path) if path.is_dir() else []) or [path]


def _folder(text: str) -> Path:
    """A run folder as given; `.` or `..` made whole, so that the run has a name to show."""
    path = Path(text)
    return Path(os.path.abspath(path)) if path.name in ("", "..") else path


def _add_run_arguments(parser: argparse.ArgumentParser, many: bool) -> None:
    if many:
        parser.add_argument(
            "runs", nargs="*", type=_folder, help="run folders (default: all under --root)"
        )
    else:
        parser.add_argument("run", type=_folder, help="a run folder")
    parser.add_argument(
        "--root", type=Path, default=Path("runs"), help="output root (default: runs)"
    )


def _init(args: argparse.Namespace) -> int:
    for name, written in files.copy_into(args.folder):
        print(f"{'wrote' if written else 'kept '} {args.folder / name}")
    print(f"next: sbatch {args.folder / 'slurm/ddp.sbatch'}, or see the examples' first lines")
    return 0


def _resolve(args: argparse.Namespace, *extra: str) -> Config:
    return load_config(
        args.config_files, [*args.overrides, *extra], mode=args.mode, nodes=args.nodes,
        program=args.program,
    )  # fmt: skip


def _config(args: argparse.Namespace) -> int:
    print(to_yaml(_resolve(args)), end="")
    return 0


def _submit(args: argparse.Namespace) -> int:
    from slurm_ddp_kit.launch.submit import dry_run, submit

    cfg = _resolve(args)
    if args.dry_run:
        print(dry_run(cfg), end="")
        return 0
    held = HeldSignals()  # from the run folder's making until the job is named here
    try:
        run_dir, job = submit(cfg, command=_command(), held=held)
        _say_submitted(job, run_dir)
    except KitError:
        _unless_interrupted(held)
        raise
    finally:
        held.release()
    return _follow(job, run_dir, args.wait, args.quiet, held=held.signum)


def _unless_interrupted(held: HeldSignals) -> None:
    """A submission that failed after a Ctrl-C (sbatch, in the terminal's process group, got
    it too) was interrupted, not refused."""
    if held.signum is not None:
        raise Interrupted(held.signum) from None


def _say_submitted(job: Any, run_dir: Path) -> None:
    print(f"submitted job {job.job_id}")
    print(f"run folder: {run_dir}", flush=True)


def _follow(
    job: Any, run_dir: Path, wait: bool, quiet: bool, resumed: bool = False, held: int | None = None
) -> int:
    """`--wait`: 0 if the job succeeded, 1 if it failed, 130 on Ctrl-C (said in one line), or
    if it was cancelled. `held`: a signal that came while the job was submitted, taken now."""
    from slurm_ddp_kit.launch.submit import follow, interrupted

    try:
        if held is not None:
            raise Interrupted(held)
        return follow(job, run_dir, quiet=quiet, resumed=resumed) if wait else 0
    except KeyboardInterrupt as err:
        line = interrupted(job, run_dir, err)
        with contextlib.suppress(OSError):  # a terminal that hung up takes no line
            print(printable(line), file=sys.stderr, flush=True)
        return exit_status(err)


def _sweep(args: argparse.Namespace) -> int:
    from slurm_ddp_kit.launch.submit import sweep

    if args.parallel is not None and args.parallel < 1:
        raise ConfigError(f"--parallel {args.parallel}: give at least 1")
    modes = _sweep_modes(args)
    _check_grid_against_overrides(args.grid, args.overrides)
    points = [(f"mode={mode}", *point) for mode in modes for point in grid(args.grid, len(modes))]
    cfgs = [_resolve(args, *point) for point in points]
    if args.dry_run:
        from slurm_ddp_kit.launch.submit import sweep_dry_run

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
        import submitit

        from slurm_ddp_kit.launch.submit import interrupted

        queued = [run_dir for run_dir, job in submitted if isinstance(job, submitit.SlurmJob)]
        for run_dir, job in submitted:
            if isinstance(job, submitit.LocalJob) and _in_flight(run_dir, job):
                print(printable(interrupted(job, run_dir, err)), file=sys.stderr, flush=True)
        if queued:  # one line, not a Slurm query and a line per run
            print(f"{interrupt_word(err)}: {_queued_words(queued, submitted)}", file=sys.stderr)
        if len(submitted) < len(cfgs):
            print(
                f"{interrupt_word(err)}: {len(cfgs) - len(submitted)} of the sweep's "
                f"{len(cfgs)} runs were not submitted",
                file=sys.stderr,
            )
        return exit_status(err)
    return _local_sweep_result(submitted)


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
    first = runfolder.first_failure(run_dir)
    return first is None or str(first.get("error", "")).startswith("KeyboardInterrupt")


def _local_sweep_result(submitted: list[tuple[Path, Any]]) -> int:
    """A local sweep has waited for its runs: 1, with a line per failed run, if any failed.
    (A Slurm sweep's runs are still queued: `launch status` follows them.)"""
    import submitit

    from slurm_ddp_kit.launch.jobs import failure_line
    from slurm_ddp_kit.launch.submit import result_words

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


def _command() -> list[str]:
    return ["python", "-m", "launch", *sys.argv[1:]]


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


def _prepare(args: argparse.Namespace) -> int:
    cfg = _resolve(args)
    root = runfolder.check_root(cfg.output.root)
    job_id = os.environ.get("SLURM_JOB_ID")
    _check_expedited(cfg, job_id)
    # A requeued batch job runs its script again: it goes on in the folder its first run made.
    restarted = os.environ.get("SLURM_RESTART_COUNT", "0") not in ("", "0")
    run_dir = runfolder.find_for_job(root, job_id) if restarted and job_id else None
    if run_dir is None:
        from slurm_ddp_kit.launch.submit import check_factories

        datafiles.check_data(cfg)  # what `launch submit` asks of a run's data and factories:
        check_factories(cfg, trial=False)  # a new one is made here (the job tries the workload)
        run_dir = runfolder.create(cfg, launcher=args.launcher, backend="slurm", command=sys.argv)
        runfolder.update_meta(run_dir, job_id=job_id)
    if args.shell:  # the paths, then the task's command (inside the container, if one is set)
        words = container.shell_assignments(cfg)
        print(runfolder.shell_assignments(run_dir) + words, end="")
    else:
        print(run_dir)
    return 0


def _check_expedited(cfg: Config, job_id: str | None) -> None:
    """sbatch reads its options before the script runs, so a setting given to the script cannot
    make the job expedited: refuse one the job was not submitted with, naming how it is."""
    if (
        cfg.cluster.requeue != Requeue.expedite
        or not job_id
        or slurm.expedites(job_id) is not False
    ):
        return
    raise ConfigError(
        f"cluster.requeue=expedite, but job {job_id} was submitted without it, and sbatch reads "
        "its options before the script runs: submit with `sbatch --requeue=expedite "
        "slurm/ddp.sbatch …` (Slurm 25.11+), or drop cluster.requeue=expedite"
    )


def _resume(args: argparse.Namespace) -> int:
    from slurm_ddp_kit.launch.submit import resume

    held = HeldSignals()
    try:
        job = resume(args.run, held=held)
        _say_submitted(job, args.run)
    except KitError:
        _unless_interrupted(held)
        raise
    finally:
        held.release()
    return _follow(job, args.run, args.wait, args.quiet, resumed=True, held=held.signum)


def _status(args: argparse.Namespace) -> int:
    from slurm_ddp_kit.launch.jobs import (
        HEADER,
        failure_line,
        format_table,
        notes,
        slurm_states,
        status,
        unreadable,
    )

    folders = [run for path in args.runs for run in _runs_in(path)] or runfolder.find_runs(
        args.root
    )
    if not folders and args.root.exists() and not args.root.is_dir():
        raise runfolder.RunFolderError(f"--root {args.root} is a file: name the output root")
    if not folders:
        raise runfolder.RunFolderError(
            f"no runs under {args.root}: submit one with `python -m launch submit`"
        )
    rows, failures = [HEADER], []
    known = slurm_states(folders)  # every Slurm job at once: seconds for thousands of runs
    tasks = processes.task_table()  # and every local job's processes, read once
    for folder in folders:
        try:
            found = status(folder, known, tasks)
        except runfolder.RunFolderError as err:  # one bad folder does not hide the others
            if len(folders) == 1:
                raise  # nothing else to show: an error, not a table of one unreadable row
            print(printable(f"warning: {err}"), file=sys.stderr)
            rows.append(unreadable(folder).row())
            continue
        rows.append(row := found.row())
        if found.placement:  # whatever its state: its figures are not what was asked for
            failures.append(f"{folder.name}: {found.placement}")
        state = row[HEADER.index("STATE")]
        if state not in _GOING_WELL and (line := failure_line(folder)):
            failures.append(line)  # only runs that went wrong: it reads every rank's records
        if state != "COMPLETED":
            failures.extend(notes(folder, state))
    print(printable(format_table(rows)))
    for line in failures:  # the rank to look at first, under the table
        print(printable(line))
    return 0


_GOING_WELL = ("COMPLETED", "RUNNING", "PENDING")


def _cancel(args: argparse.Namespace) -> int:
    from slurm_ddp_kit.launch.jobs import cancel

    found: list[Path] = []
    for path in args.runs:
        if not (runs := runfolder.find_runs(path) if path.is_dir() else []):
            raise runfolder.RunFolderError(f"{path} is not a run folder and holds none")
        found += runs
    if len(found) == 1:
        print(printable(cancel(found[0])), flush=True)
        return 0
    failed = 0
    for run_dir in found:  # one damaged or unreachable run does not spare the others
        try:
            print(printable(cancel(run_dir)), flush=True)
        except KitError as err:
            failed += 1
            print(printable(f"warning: {run_dir.name}: {err}"), file=sys.stderr, flush=True)
    if failed:
        raise KitError(f"{failed} of {len(found)} runs were not cancelled: see the warnings above")
    return 0


def _logs(args: argparse.Namespace) -> int:
    from slurm_ddp_kit.launch.jobs import log_files

    for path in log_files(args.run, args.rank):
        print(printable(f"==> {path} <=="))
        try:
            text = path.read_text(errors="replace")
        except OSError as err:  # one unreadable log: say so, show the rest
            print(printable(f"warning: {path} cannot be read ({err.strerror})"), file=sys.stderr)
        else:
            print(printable(text), end="")
    return 0
