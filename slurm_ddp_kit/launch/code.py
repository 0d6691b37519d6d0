"""The code a submission's jobs run (`core.snapshot`): planned before any file is made, copied
into the first run folder, and shared by hard links with a sweep's others."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from slurm_ddp_kit.core import container, snapshot
from slurm_ddp_kit.core.settings.schema import Config


class CodeCopy:
    """One snapshot for the runs of one submission. Made from the first run's settings: a
    sweep's grid points share their code, whatever else they vary."""

    def __init__(self, cfg: Config) -> None:
        self.planned = snapshot.plan(cfg)  # a refusal (code.snapshot=on, over the limit) first
        self.first: Path | None = None

    def give(self, run_dir: Path) -> None:
        """The run folder's code/: copied for the first run, linked to it for the others."""
        if self.first is None:
            snapshot.take(run_dir, self.planned)
            self.first = run_dir
        else:
            snapshot.share(self.first, run_dir)


def job_setup(cfg: Config, code: snapshot.JobCode | None = None) -> list[str]:
    """The shell lines a batch job runs before its tasks start: the container's, then those
    that start the tasks in the run's code copy (`snapshot.job_code`; a dry run's:
    `snapshot.planned_job_code`), then the user's cluster.setup (which may add to
    PYTHONPATH)."""
    copy_lines = code.lines() if code else []
    return [*container.setup_lines(cfg, inside(cfg, code)), *copy_lines, *cfg.cluster.setup]


def inside(cfg: Config, code: snapshot.JobCode | None) -> container.Inside | None:
    """Where a container's tasks start and what they import, where the run has a code copy: the
    copy's folder and PYTHONPATH, then the folders the user's factories were found in that
    PYTHONPATH does not name (their copies where the copy holds them); None otherwise."""
    if code is None or not container.used(cfg):
        return None
    found = [str(code.held(folder) or folder) for folder in container.factory_folders(cfg)]
    return container.Inside(code.workdir, list(dict.fromkeys([*code.pythonpath, *found])))


@contextlib.contextmanager
def started_in_copy(run_dir: Path) -> Iterator[None]:
    """While inside, this process is in the run's code copy, its PYTHONPATH the copy's
    (`snapshot.job_code`), so that a process started here (the local controller) and its
    tasks run the copy; as it was after. Nothing changes for a run without a copy."""
    code = snapshot.job_code(run_dir)  # the manifest, read once
    if code is None:
        yield
        return
    workdir, pythonpath = code.workdir, code.pythonpath
    here, saved = os.getcwd(), os.environ.get("PYTHONPATH")
    os.chdir(workdir)
    os.environ["PYTHONPATH"] = os.pathsep.join(pythonpath)
    try:
        yield
    finally:
        os.chdir(here)
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
