"""`python -m train …`: what a job runs (`run`), and the data commands."""

from __future__ import annotations

import sys

from slurm_ddp_kit.train import early

if "run" in sys.argv[1:]:  # a job's process: its warning or preemption may come during imports
    early.hold()
    early.pause_gc()  # until the rank has started (`train.job`)

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from slurm_ddp_kit.core.cli import (
    CONFIG_HELP,
    ArgumentParser,
    add_common_flags,
    command_adder,
    main_of,
)


def main(argv: Sequence[str] | None = None) -> int:
    return main_of(_parser(), argv)


# What each command's --help ends with, after the command's own words.
EXAMPLES = {
    "run": ['"$run_dir"    (under srun, one process per task: what slurm/ddp.sbatch runs)'],
    "prepare-data": ["data.train_size=12000 data.test_size=2000"],
    "check-workload": ["model.name=mypackage.workload:model data.dataset=mypackage.workload:data"],
    "fetch-mnist": ["--root data"],
}


def _parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m train", description=__doc__)
    add_common_flags(parser)
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    command = command_adder(commands, EXAMPLES, _add_settings)
    run = command(
        "run", _run, "train into RUN_DIR, or run its program (one process per task, with srun)"
    )
    run.add_argument(
        "run_dir", type=Path, help="a run folder made by `python -m launch prepare` or `submit`"
    )
    command("prepare-data", _prepare, "write the synthetic dataset the config names", config=True)
    command(
        "check-workload",
        _check_workload,
        "try a user's dataset and model factories on the CPU, as submit does",
        config=True,
    )
    fetch = command("fetch-mnist", _fetch, "download real MNIST (needs internet)")
    fetch.add_argument("--root", type=Path, default=Path("data"), help="data.root of the runs")
    return parser


def _add_settings(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", dest="config_files", action="append", default=[], metavar="FILE",
        help=CONFIG_HELP,
    )  # fmt: skip
    parser.add_argument("overrides", nargs="*", metavar="key=value")


def _run(args: argparse.Namespace) -> int:
    from slurm_ddp_kit.train import early

    try:
        summary = _task_of(args.run_dir)(str(args.run_dir))
    finally:
        early.end_leftovers()  # nothing this task started outlives it
    if "final_test_accuracy" in summary:
        print(f"rank {summary['rank']}: test accuracy {summary['final_test_accuracy']:.2%}")
    return 0


def _task_of(run_dir: Path) -> Callable[[str], dict[str, Any]]:
    """What this task runs, by the run's config: the user's program where it names one
    (`launch prepare … -- PROGRAM`, as the sbatch scripts pass it on), else the kit's loop. Chosen
    before the loop is imported, so that a program's task never pays for importing torch."""
    from slurm_ddp_kit.core import runfolder

    if runfolder.load_job_config(run_dir).program:
        from slurm_ddp_kit.train import program

        return program.run
    from slurm_ddp_kit.train import job

    return job.run


def _prepare(args: argparse.Namespace) -> int:
    from slurm_ddp_kit.core import datafiles
    from slurm_ddp_kit.core.settings.loading import load_config
    from slurm_ddp_kit.train import data

    cfg = load_config(args.config_files, args.overrides)
    d = cfg.data
    if d.dataset == "mnist":
        datafiles.verify(Path(d.root), d.dataset)
        print(f"{d.root}: MNIST is in place")
        return 0
    if d.dataset != "synthetic":
        print(f"data.dataset={d.dataset} is made in each job's memory: nothing to prepare")
        return 0
    folder = datafiles.dataset_dir(d.dataset, d.root, cfg.train.seed, d.train_size, d.test_size)
    written = data.prepare_synthetic(folder, cfg.train.seed, d.train_size, d.test_size)
    print(f"synthetic digits in {written}")
    return 0


def _check_workload(args: argparse.Namespace) -> int:
    from slurm_ddp_kit.core.settings.loading import load_config
    from slurm_ddp_kit.train import workloads

    print(workloads.check(load_config(args.config_files, args.overrides)))
    return 0


def _fetch(args: argparse.Namespace) -> int:
    from slurm_ddp_kit.train.data import fetch_mnist

    print(f"MNIST in {fetch_mnist(args.root)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
