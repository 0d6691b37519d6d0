"""Submit a run folder's job, or resume one; the job's id is recorded in the run folder."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import submitit

from slurm_ddp_kit.core import (
    runfolder,
)
from slurm_ddp_kit.core.cli import (
    HeldSignals,
)
from slurm_ddp_kit.core.processes import identity as process_identity
from slurm_ddp_kit.core.settings.schema import (
    Backend,
    Config,
)
from slurm_ddp_kit.launch.checks import check_submission
from slurm_ddp_kit.launch.executor import (
    SubmitError,
    job_of,
    log,
    make_executor,
    refusal,
    without_enclosing_job,
)


def submit(
    cfg: Config, command: list[str], held: HeldSignals | None = None
) -> tuple[Path, submitit.Job[Any]]:
    """Check, create the run folder, then submit the training job into it; `held`: the ending
    signals, held from the folder's making on (the caller releases them once it has named the
    job)."""
    backend = check_submission(cfg)
    if held:
        held.hold()
    made = runfolder.folders_to_make(cfg.output.root)
    run_dir = runfolder.create(cfg, launcher="launch", backend=backend.value, command=command)
    log.debug("backend %s, run folder %s, data under %s", backend.value, run_dir, cfg.data.root)
    try:
        return run_dir, _submit_into(cfg, run_dir, backend)
    except SubmitError:
        runfolder.discard([run_dir], made)  # made for this job alone: nothing ran in it
        raise


def _submit_into(cfg: Config, run_dir: Path, backend: Backend) -> submitit.Job[Any]:
    """The training job of an existing run folder: submitted, and recorded in the folder."""
    executor = make_executor(cfg, run_dir, backend)
    try:
        # submitit echoes sbatch's errors to stderr; the error below says them once.
        with (
            without_enclosing_job(),
            contextlib.redirect_stderr(io.StringIO()),
            _detached_output(backend),
        ):
            job = executor.submit(job_of(cfg), str(run_dir))
    except (submitit.core.utils.FailedSubmissionError, submitit.core.utils.FailedJobError) as err:
        runfolder.update_meta(run_dir, submit_error=str(err))
        raise SubmitError(refusal(err)) from None
    record_job(run_dir, job)
    return job


@contextlib.contextmanager
def _detached_output(backend: Backend) -> Iterator[None]:
    """The local controller inherits stdout/stderr at its start: give it /dev/null, so a caller
    reading our output through a pipe is not held open until the job ends (tasks log to files).
    It also inherits ignored signals: SIGINT, which cancels it, is made heard."""
    if backend != Backend.local:
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        with _sigint_heard():
            yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, devnull):
            os.close(fd)


@contextlib.contextmanager
def _sigint_heard() -> Iterator[None]:
    """Started from a shell's background (`launch submit … &` in a script), this process ignores
    SIGINT, and the controller started here would inherit that and never hear `launch cancel`."""
    try:
        ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        if ignored:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    except ValueError:  # not the main thread: leave the signals alone
        ignored = False
    try:
        yield
    finally:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def record_job(run_dir: Path, job: submitit.Job[Any]) -> None:
    """The job id, and where each task's stdout and stderr go (submitit names them)."""
    tasks = [job.task(rank) for rank in range(job.num_tasks)]
    logs = [[str(t.paths.stdout), str(t.paths.stderr)] for t in tasks]
    meta = runfolder.read_meta(run_dir)
    jobs = [*meta.get("jobs", []), str(job.job_id)]  # every job that ran in this folder
    # A local job's id is its controller's PID: recorded with what tells that process from a
    # later one given the same PID, so `status` and `cancel` never take a stranger for the job.
    local = isinstance(job, submitit.LocalJob)
    process = process_identity(int(job.job_id)) if local else None
    runfolder.update_meta(
        run_dir, job_id=str(job.job_id), logs=logs, jobs=jobs, job_process=process
    )


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
    cfg = runfolder.load_job_config(run_dir)
    backend = check_submission(cfg)
    # Cleared first: the new job must not take the last job's cancel as its own.
    runfolder.update_meta(run_dir, cancel_requested=None, submit_error=None, backend=backend.value)
    if held:
        held.hold()
    return _submit_into(cfg, run_dir, backend)


def launch_command() -> list[str]:
    return ["python", "-m", "launch", *sys.argv[1:]]
