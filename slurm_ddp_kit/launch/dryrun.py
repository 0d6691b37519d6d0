"""`--dry-run`: what a submission would do, refusing what it would refuse; nothing is created.
The backend says its part (`launch.backends`): on Slurm the exact batch script, made by submitit
itself with a stand-in sbatch."""

from __future__ import annotations

import shlex

from slurm_ddp_kit.core import runfolder, snapshot
from slurm_ddp_kit.core.settings.loading import program_arguments
from slurm_ddp_kit.core.settings.schema import Config
from slurm_ddp_kit.launch.checks import check_submission


def dry_run(cfg: Config) -> str:
    """What `submit` would do: the run folder it would make (named then), the program, the code
    its job would run, and the backend's part."""
    backend = check_submission(cfg, dry_run=True)
    run_dir = runfolder.check_root(cfg.output.root) / runfolder.new_name(cfg)
    head = f"run folder (made on submit, named then): {run_dir}\n"
    if cfg.program:
        head += f"program in each task: {shlex.join(program_arguments(cfg))}\n"
    # The copy is made with the run folder; the batch script then starts the tasks in it.
    planned = snapshot.plan(cfg)  # once: it lists and stats the repository's files
    head += snapshot.describe_plan(planned) + "\n"
    return head + backend.dry_run(cfg, run_dir, planned)
