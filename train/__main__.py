"""`python -m train …`: what a job runs (`run`), and the data commands."""

from __future__ import annotations

import sys

from train import early

if "run" in sys.argv[1:]:  # a job's process: its warning or preemption may come during imports
    early.hold()

import argparse
from collections.abc import Sequence
from pathlib import Path

from core.cli import ArgumentParser, add_common_flags, main_of


def main(argv: Sequence[str] | None = None) -> int:
    return main_of(_parser(), argv)


def _parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m train", description=__doc__)
    add_common_flags(parser)
    commands = parser.add_subparsers(required=True, metavar="COMMAND")
    run = commands.add_parser(
        "run", help="train into RUN_DIR (start one process per task with srun)"
    )
    run.add_argument(
        "run_dir", type=Path, help="a run folder made by `python -m launch prepare` or `submit`"
    )
    run.set_defaults(func=_run)
    add_common_flags(run)
    prepare = commands.add_parser(
        "prepare-data", help="write the synthetic dataset the config names"
    )
    prepare.add_argument("--config", dest="config_file", help="YAML file merged over the defaults")
    prepare.add_argument("overrides", nargs="*", metavar="key=value")
    prepare.set_defaults(func=_prepare)
    add_common_flags(prepare)
    check = commands.add_parser(
        "check-workload", help="try a user's dataset and model factories on the CPU, as submit does"
    )
    check.add_argument("--config", dest="config_file", help="YAML file merged over the defaults")
    check.add_argument("overrides", nargs="*", metavar="key=value")
    check.set_defaults(func=_check_workload)
    add_common_flags(check)
    fetch = commands.add_parser("fetch-mnist", help="download real MNIST (needs internet)")
    fetch.add_argument("--root", type=Path, default=Path("data"), help="data.root of the runs")
    fetch.set_defaults(func=_fetch)
    add_common_flags(fetch)
    return parser


def _run(args: argparse.Namespace) -> int:
    from train import early
    from train.job import run

    try:
        summary = run(str(args.run_dir))
    finally:
        early.end_leftovers()  # nothing this task started outlives it
    if "final_test_accuracy" in summary:
        print(f"rank {summary['rank']}: test accuracy {summary['final_test_accuracy']:.2%}")
    return 0


def _prepare(args: argparse.Namespace) -> int:
    from core import datafiles
    from core.settings.loading import load_config
    from train import data

    cfg = load_config(args.config_file, args.overrides)
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
    from core.settings.loading import load_config
    from train import workloads

    print(workloads.check(load_config(args.config_file, args.overrides)))
    return 0


def _fetch(args: argparse.Namespace) -> int:
    from train.data import fetch_mnist

    print(f"MNIST in {fetch_mnist(args.root)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
