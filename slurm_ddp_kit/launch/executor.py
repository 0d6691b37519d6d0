"""What a run's job is (the kit's loop, a sweep's element, a user's program), and what every
backend's submitit executor shares: the Python each task starts, the private logs folder, and the
environment a submission leaves out. Each backend makes its own executor (`launch.backends`)."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os
import shlex
import sys
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import submitit

from slurm_ddp_kit.core import (
    container,
    runfolder,
    slurm,
    userfiles,
)
from slurm_ddp_kit.core.settings.schema import (
    Config,
)

log = logging.getLogger("kit")


# What a job runs, named rather than imported: the launcher never loads the job's code (nor
# torch); the job's own interpreter does, as `python -m train run` does under sbatch.
JOB_MODULE = "slurm_ddp_kit.train.job"


def task_python(cfg: Config, inside: container.Inside | None = None) -> str:
    """What submitit starts in each task, ahead of its own runner: the kit's start, which holds
    the stop signals before anything loads (a warning during start-up must not end the job),
    started by the shell that ignores them until then; inside the container, if one is set."""
    python = [*container.wrapper(cfg, inside), container.python(cfg, sys.executable)]
    return shlex.join([*slurm.TASK_START, *python, "-u", "-m", "slurm_ddp_kit.train.start"])


class Training(submitit.helpers.Checkpointable):
    """What `launch submit` hands to submitit: the training job of one run folder.

    Checkpointable, so submitit's own handler requeues it: the job saves its whole state at an
    agreed step first, and `checkpoint` resubmits the same run folder, which resumes from it.
    """

    entry = "run"
    module = JOB_MODULE

    def __call__(self, run_dir: str) -> dict[str, Any] | None:
        job = importlib.import_module(self.module)
        return typing.cast("dict[str, Any] | None", getattr(job, self.entry)(run_dir))


class ArrayElement(Training):
    """One element of a sweep's array (see `train.job.run_array_element`)."""

    entry = "run_array_element"


class ProgramRun(Training):
    """A user's program in each task (`train.program`): a sweep's element too, as its allocation
    is its own run's shape."""

    module = "slurm_ddp_kit.train.program"


def job_of(cfg: Config, element: bool = False) -> Training:
    """What submitit runs in each task of `cfg`'s job."""
    if cfg.program:
        return ProgramRun()
    return ArrayElement() if element else Training()


# What a Slurm job or step sets, beside the settings a user may keep in the environment.
_USER_SLURM = ("SLURM_CONF", "SLURM_CLUSTERS", "SLURM_TIME_FORMAT")


_TORCH_DIST = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@contextlib.contextmanager
def without_enclosing_job() -> Iterator[None]:
    """Submit without the variables of a job this launcher runs in (salloc, a batch job) or of a
    launch by hand: sbatch passes the environment on, where they contradict the new job's own
    (srun: "SLURM_MEM_PER_CPU, SLURM_MEM_PER_GPU, and SLURM_MEM_PER_NODE are mutually
    exclusive"). Outside a job, a user's SLURM_* settings stay."""
    in_job = "SLURM_JOB_ID" in os.environ
    names = [
        name
        for name in os.environ
        if name in _TORCH_DIST
        or name.startswith("SUBMITIT_")
        or (in_job and name.startswith(("SLURM_", "SLURMD_", "SRUN_")) and name not in _USER_SLURM)
    ]
    saved = {name: os.environ.pop(name) for name in names}
    try:
        yield
    finally:
        os.environ.update(saved)


EXIT_FAILED = 1


def logs_folder(run_dir: Path) -> Path:
    """A run's logs folder, made private (`keep_logs_private`): where its executor writes."""
    logs = runfolder.logs_to_write(run_dir)
    keep_logs_private(logs)
    return logs


def keep_logs_private(logs: Path) -> None:
    """The logs folder holds the pickles submitit's runner loads (`train.start`): writable by
    the user alone, whatever the umask."""
    logs.mkdir(parents=True, exist_ok=True)
    userfiles.keep_private(logs)
