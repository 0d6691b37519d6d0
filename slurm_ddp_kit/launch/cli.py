"""`python -m launch …`: resolve configs, submit runs and sweeps, and operate their jobs."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from slurm_ddp_kit.core import container, runfolder, slurm, snapshot, strategies
from slurm_ddp_kit.core.cli import (
    CONFIG_HELP,
    ENDING,
    EXIT_USAGE,
    ArgumentParser,
    HeldSignals,
    Interrupted,
    add_common_flags,
    command_adder,
    exit_status,
    interrupt_on,
    printable,
    run_cli,
)
from slurm_ddp_kit.core.errors import KitError
from slurm_ddp_kit.core.settings.loading import load_config, to_yaml
from slurm_ddp_kit.core.settings.schema import Config, ConfigError, Requeue
from slurm_ddp_kit.core.snapshot import SnapshotError
from slurm_ddp_kit.core.strategies import STRATEGIES
from slurm_ddp_kit.launch import backends, files
from slurm_ddp_kit.launch.code import CodeCopy, inside


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


# What each command's --help ends with, after the command's own words.
EXAMPLES = {
    "config": [
        "--mode ddp train.epochs=3",
        "--config docs/examples/two-nodes.yaml --config docs/examples/quick.yaml",
    ],
    "submit": [
        "--mode ddp --nodes 1 --wait",
        "--mode ddp --nodes 2 cluster.partition=gpu cluster.account=myproj --dry-run",
        "--mode ddp cluster.backend=local --wait -- python my_train.py --epochs 3",
    ],
    "sweep": [
        "--modes dp,ddp --grid train.global_batch_size=256,512",
        "--modes ddp --grid train.lr=0.01,0.02 --parallel 2 cluster.backend=local",
    ],
    "prepare": ["--mode ddp --shell       (what slurm/ddp.sbatch runs)"],
    "status": ["", "runs/20261207-111710-ddp-1n4g-f6b3", "--root /scratch/me/runs"],
    "resume": ["runs/20261207-111710-ddp-1n4g-f6b3 --wait"],
    "cancel": ["runs/20261207-111710-ddp-1n4g-f6b3", "runs/sweep-0412   (every run of a sweep)"],
    "logs": ["runs/20261207-111710-ddp-1n4g-f6b3", "runs/20261207-111710-ddp-1n4g-f6b3 --rank 1"],
    "init": [".", "../my-project"],
}

# The console command also runs the analysis (slurm_ddp_kit/cli.py).
_ALSO = {"slurm-ddp-kit": "also: slurm-ddp-kit summarize [RUN_DIR …]: the comparison table of "
         "finished runs (`slurm-ddp-kit summarize --help`)"}  # fmt: skip


_SBATCH_USAGE = "the usage lines at the top of slurm/ddp.sbatch"


def _program_apart(argv: list[str]) -> tuple[list[str], list[str]]:
    """The kit's words, and the user's program after the first `--` (none: the kit's loop)."""
    if "--" not in argv:
        return argv, []
    at = argv.index("--")
    if at == len(argv) - 1:
        # `prepare` is what the sbatch scripts run: their user typed `sbatch … --`.
        see = _SBATCH_USAGE if "prepare" in argv[:at] else "`python -m launch submit --help`"
        sys.stderr.write(
            "error: nothing follows `--`: give the program to run, e.g. "
            f"`-- python my_train.py --epochs 3` (see {see})\n"
        )
        raise SystemExit(EXIT_USAGE)
    return argv[:at], argv[at + 1 :]


def _parser(prog: str = "python -m launch") -> argparse.ArgumentParser:
    parser = ArgumentParser(prog=prog, description=__doc__, epilog=_ALSO.get(prog))
    add_common_flags(parser)
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    command = command_adder(commands, EXAMPLES, _add_config_arguments)
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
    """The command's config, checked in full: the kit's rules (`load_config`), then the
    backends' own (`backends.check_settings`), whichever backend it names."""
    cfg = load_config(
        args.config_files, [*args.overrides, *extra], mode=args.mode, nodes=args.nodes,
        program=args.program,
    )  # fmt: skip
    backends.check_settings(cfg)
    return cfg


def _config(args: argparse.Namespace) -> int:
    print(to_yaml(_resolve(args)), end="")
    return 0


def _submit(args: argparse.Namespace) -> int:
    from slurm_ddp_kit.launch.dryrun import dry_run
    from slurm_ddp_kit.launch.submit import launch_command, submit

    cfg = _resolve(args)
    if args.dry_run:
        print(dry_run(cfg), end="")
        return 0
    held = HeldSignals()  # from the run folder's making until the job is named here
    try:
        run_dir, job = submit(cfg, command=launch_command(), held=held)
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
    """The job, its run folder, and which code it runs (a copy made at submission, or not)."""
    from slurm_ddp_kit.core import snapshot

    print(f"submitted job {job.job_id}")
    print(f"run folder: {run_dir}")
    print(snapshot.describe(run_dir), flush=True)


def _follow(
    job: Any, run_dir: Path, wait: bool, quiet: bool, resumed: bool = False, held: int | None = None
) -> int:
    """`--wait`: 0 if the job succeeded, 1 if it failed, 130 on Ctrl-C (said in one line), or
    if it was cancelled. `held`: a signal that came while the job was submitted, taken now."""
    from slurm_ddp_kit.launch.follow import follow, interrupted

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
    from slurm_ddp_kit.launch import sweep

    points = sweep.points(args)
    return sweep.run(args, points, [_resolve(args, *point) for point in points])


def _prepare(args: argparse.Namespace) -> int:
    cfg = _resolve(args)
    root = runfolder.check_root(cfg.output.root)
    job_id = os.environ.get("SLURM_JOB_ID")
    _check_expedited(cfg, job_id)
    # A requeued batch job runs its script again: it goes on in the folder its first run made.
    restarted = os.environ.get("SLURM_RESTART_COUNT", "0") not in ("", "0")
    run_dir = runfolder.find_for_job(root, job_id) if restarted and job_id else None
    if run_dir is None:
        from slurm_ddp_kit.launch.checks import check_inputs

        # What `launch submit` asks of a new run: its program found here, or its data and
        # factories (the job tries the workload itself).
        check_inputs(cfg, trial=False)
        run_dir = _prepared_folder(cfg, args.launcher, job_id)
    if args.shell:  # the paths, then the task's command (inside the container, if one is set),
        # then the lines that start the tasks in the run's code copy (a requeue's too)
        code = snapshot.job_code(run_dir)
        copy_lines = code.lines() if code else []
        words = container.shell_assignments(cfg, inside(cfg, code)) + "".join(
            f"{line}\n" for line in copy_lines
        )
        print(runfolder.shell_assignments(run_dir) + words, end="")
    else:
        print(run_dir)
    return 0


def _prepared_folder(cfg: Config, launcher: str, job_id: str | None) -> Path:
    """A batch job's new run folder, with its copy of the code: made as the job starts (the
    scripts' jobs are queued by sbatch, without the kit), so it keeps what a requeue runs."""
    code = CodeCopy(cfg)
    made = runfolder.folders_to_make(cfg.output.root)
    backend = backends.of_sbatch_scripts().name
    run_dir = runfolder.create(cfg, launcher=launcher, backend=backend, command=sys.argv)
    try:
        code.give(run_dir)
    except SnapshotError:
        runfolder.discard([run_dir], made)
        raise
    runfolder.update_meta(run_dir, job_id=job_id)
    return run_dir


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
    # Every Slurm job at once (seconds for thousands of runs), every local job's processes once.
    seen = backends.survey(folders)
    for folder in folders:
        try:
            found = status(folder, seen)
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
