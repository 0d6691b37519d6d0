"""`--dry-run`: the batch script and parameters a submission would use, made by submitit itself
with a stand-in sbatch; nothing is submitted."""

from __future__ import annotations

import contextlib
import os
import shlex
import tempfile
from collections.abc import Iterator
from pathlib import Path

from slurm_ddp_kit.core import (
    runfolder,
)
from slurm_ddp_kit.core.settings.loading import program_arguments
from slurm_ddp_kit.core.settings.rules import (
    world_size,
)
from slurm_ddp_kit.core.settings.schema import (
    Backend,
    Config,
)
from slurm_ddp_kit.launch.checks import check_submission
from slurm_ddp_kit.launch.executor import job_of, make_executor, slurm_parameters


def dry_run(cfg: Config) -> str:
    """What `submit` would do, refusing what it would refuse; on Slurm the exact batch script.

    Nothing is created: the script comes from submitit's own submission path, run against a
    stand-in `sbatch` that only keeps the script, in a scratch folder named back to the run's.
    """
    backend = check_submission(cfg, dry_run=True)
    run_dir = runfolder.check_root(cfg.output.root) / runfolder.new_name(cfg)
    head = f"run folder (made on submit, named then): {run_dir}\n"
    if cfg.program:
        head += f"program in each task: {shlex.join(program_arguments(cfg))}\n"
    if backend == Backend.local:
        return (
            f"{head}backend: local (submitit LocalExecutor)\ntasks: {world_size(cfg)}\n"
            f"timeout_min: {cfg.cluster.timeout_min}\nlogs: {runfolder.logs_dir(run_dir)}\n"
        )
    params = slurm_parameters(cfg, run_dir.name)
    lines = [f"  {k}: {v}" for k, v in sorted(params.items())]
    return (
        f"{head}backend: slurm (submitit SlurmExecutor)\nparameters:\n"
        + "\n".join(lines)
        + "\n\n"
        + _script_for(cfg, run_dir)
    )


_STAND_IN_SBATCH = """#!/bin/sh
# Keeps the batch script submitit hands to sbatch; submits nothing.
cp "$1" "$KIT_DRY_RUN_SCRIPT"
echo "Submitted batch job 1"
"""


def _script_for(cfg: Config, run_dir: Path) -> str:
    with (
        tempfile.TemporaryDirectory(prefix="kit-dry-run-") as scratch,
        stand_in_sbatch(Path(scratch)) as captured,
    ):
        folder = Path(scratch) / "run"
        executor = make_executor(cfg, folder, Backend.slurm)
        executor.update_parameters(job_name=f"kit-{run_dir.name}")
        executor.submit(job_of(cfg), str(run_dir))
        return captured.read_text().replace(str(folder), str(run_dir))


@contextlib.contextmanager
def stand_in_sbatch(scratch: Path) -> Iterator[Path]:
    """While inside, `sbatch` is a stand-in that keeps the script (at the path yielded)."""
    bin_dir = scratch / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(_STAND_IN_SBATCH)
    (bin_dir / "sbatch").chmod(0o755)
    captured = scratch / "script.sh"
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    with _environment(env | {"KIT_DRY_RUN_SCRIPT": str(captured)}):
        yield captured


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
