"""Submit a run folder's job, or resume one, through the run's backend (`launch.backends`: its
executor, what surrounds its submit, its refusal's words); the job's id is recorded in the run
folder."""

from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path
from typing import Any

import submitit

from slurm_ddp_kit.core import runfolder, snapshot
from slurm_ddp_kit.core.cli import HeldSignals
from slurm_ddp_kit.core.settings.schema import Config
from slurm_ddp_kit.core.snapshot import SnapshotError
from slurm_ddp_kit.launch import backends
from slurm_ddp_kit.launch.backends import Backend, SubmitError
from slurm_ddp_kit.launch.checks import check_submission
from slurm_ddp_kit.launch.code import CodeCopy
from slurm_ddp_kit.launch.executor import job_of, log, without_enclosing_job


def submit(
    cfg: Config, command: list[str], held: HeldSignals | None = None, code: CodeCopy | None = None
) -> tuple[Path, submitit.Job[Any]]:
    """Check, create the run folder, give it the code its job runs (`code`: a sweep's shared
    copy; else one of its own), then submit the job into it; `held`: the ending signals, held
    from the folder's making on (the caller releases them once it has named the job)."""
    backend = check_submission(cfg)
    code = code or CodeCopy(cfg)
    if held:
        held.hold()
    made = runfolder.folders_to_make(cfg.output.root)
    run_dir = runfolder.create(cfg, launcher="launch", backend=backend.name, command=command)
    log.debug("backend %s, run folder %s, data under %s", backend.name, run_dir, cfg.data.root)
    try:
        code.give(run_dir)
        return run_dir, _submit_into(cfg, run_dir, backend)
    except (SubmitError, SnapshotError):
        runfolder.discard([run_dir], made)  # made for this job alone: nothing ran in it
        raise


def _submit_into(cfg: Config, run_dir: Path, backend: Backend) -> submitit.Job[Any]:
    """The training job of an existing run folder: submitted, and recorded in the folder."""
    executor = backend.executor(cfg, run_dir)
    try:
        # submitit echoes sbatch's errors to stderr; the error below says them once.
        with (
            without_enclosing_job(),
            contextlib.redirect_stderr(io.StringIO()),
            backend.submitting(run_dir),
        ):
            job = executor.submit(job_of(cfg), str(run_dir))
    except (submitit.core.utils.FailedSubmissionError, submitit.core.utils.FailedJobError) as err:
        runfolder.update_meta(run_dir, submit_error=str(err))
        raise SubmitError(backend.refusal(err)) from None
    backend.record(run_dir, job)
    return job


def resume(run_dir: Path, held: HeldSignals | None = None) -> submitit.Job[Any]:
    """Submit a new job into an existing run folder; it resumes from the folder's checkpoint.
    `held`: as for `submit`, held from the submission on."""
    runfolder.read_meta(run_dir)  # a run folder, whole: before the claim leaves a file in it
    runfolder.check_writable(run_dir)  # before anything is written into it
    if not os.access(run_dir, os.W_OK | os.X_OK):  # also a read-only mount
        raise SubmitError(
            f"{run_dir} is not writable here: the resumed job writes its records and checkpoints "
            "into it; make it writable, or copy the run folder somewhere writable and resume the copy"
        )
    with runfolder.claimed(run_dir):
        return _resume_claimed(run_dir, held)


def _resume_claimed(run_dir: Path, held: HeldSignals | None) -> submitit.Job[Any]:
    from slurm_ddp_kit.launch.jobs import finished, status, still_held

    now = status(run_dir)
    if still_held(now.state):  # suspended or SIGSTOPped too: it goes on when Slurm resumes it
        raise SubmitError(
            f"{run_dir.name} is {now.state} as job {now.job_id}: one job at a time writes a run "
            "folder; wait for it, or cancel it first (`python -m launch cancel`)"
        )
    if finished(run_dir, runfolder.read_rank(run_dir, 0)):
        raise SubmitError(f"{run_dir.name} has finished: there is nothing to resume")
    runfolder.saved_state(run_dir)  # one that is no file is refused, not taken for none
    snapshot.read_manifest(run_dir)  # a damaged code copy is refused, not run
    cfg = runfolder.load_job_config(run_dir)
    backends.check_settings(cfg)  # the backends' own rules, which the config's load leaves out
    backend = check_submission(cfg)
    # Cleared first: the new job must not take the last job's cancel as its own.
    runfolder.update_meta(run_dir, cancel_requested=None, submit_error=None, backend=backend.name)
    if held:
        held.hold()
    return _submit_into(cfg, run_dir, backend)


def launch_command() -> list[str]:
    return ["python", "-m", "launch", *sys.argv[1:]]
