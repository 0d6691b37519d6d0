"""`python -m launch …`: config, submit (and the job-operation commands)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from launch.config import Config, ConfigError, load_config, to_yaml


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    # argparse stops collecting key=value at the first flag; take the ones that follow flags too.
    unknown = [e for e in extra if e.startswith("-") or "overrides" not in args]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    try:
        return int(args.func(args))
    except (ConfigError, FileNotFoundError, RuntimeError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m launch", description=__doc__)
    commands = parser.add_subparsers(required=True, metavar="COMMAND")
    config = commands.add_parser("config", help="print the resolved config as YAML")
    _add_config_arguments(config)
    config.set_defaults(func=_config)
    submit = commands.add_parser("submit", help="create a run folder and submit the training job")
    _add_config_arguments(submit)
    submit.add_argument("--wait", action="store_true", help="follow the job, one line per epoch")
    submit.set_defaults(func=_submit)
    return parser


def _add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--mode", choices=("dp", "ddp"), help="DataParallel or DistributedDataParallel"
    )
    parser.add_argument("--nodes", type=int, help="number of nodes (DDP only above 1)")
    parser.add_argument("--config", dest="config_file", help="YAML file merged over the defaults")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. train.epochs=3")


def _resolve(args: argparse.Namespace) -> Config:
    return load_config(args.config_file, args.overrides, mode=args.mode, nodes=args.nodes)


def _config(args: argparse.Namespace) -> int:
    print(to_yaml(_resolve(args)), end="")
    return 0


def _submit(args: argparse.Namespace) -> int:
    from launch.submit import follow, submit

    run_dir, job = submit(_resolve(args), command=["python", "-m", "launch", *sys.argv[1:]])
    print(f"submitted job {job.job_id}")
    print(f"run folder: {run_dir}")
    if args.wait:
        return 0 if follow(job, run_dir) else 1
    return 0
