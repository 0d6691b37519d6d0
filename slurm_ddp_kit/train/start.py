"""`python -m slurm_ddp_kit.train.start [-u] -m MODULE ARG…`: what each task of a submitit job runs.

submitit starts `PYTHON -u -m submitit.core._submit FOLDER` in every task; the kit hands it this
module as PYTHON's tail, so the stop signals are held (`train.early`) before submitit imports
anything, then submitit's own runner goes on as it would have.
"""

from slurm_ddp_kit.train import early

early.hold()
early.end_with_controller()
early.interrupt_once()
early.pause_gc()  # until the rank has started (`train.job`)

import runpy  # noqa: E402  (after the signals are held)
import sys  # noqa: E402


def main(argv: list[str]) -> None:
    args = argv[1:] if argv[:1] == ["-u"] else argv  # `-u` is this interpreter's already
    if len(args) < 2 or args[0] != "-m":
        raise SystemExit("usage: python -m slurm_ddp_kit.train.start [-u] -m MODULE [ARG ...]")
    if args[1] == SUBMITIT_RUNNER and len(args) > 2:
        _check_submitted(args[2])
    sys.argv = [args[1], *args[2:]]
    try:
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    except early.Interrupted:
        # A Ctrl-C or a cancel: the rank recorded it in the run folder (`train.job`), so its
        # log ends in one line, not the traceback of wherever training happened to be.
        from slurm_ddp_kit.core.cli import EXIT_INTERRUPTED  # here: a task's start stays light

        print(INTERRUPTED, file=sys.stderr, flush=True)
        raise SystemExit(EXIT_INTERRUPTED) from None
    finally:
        early.end_leftovers()  # nothing this task started outlives it


INTERRUPTED = "interrupted: this task ended on SIGINT (a Ctrl-C, or the job's cancel)"


SUBMITIT_RUNNER = "submitit.core._submit"
SUBMITTED_WAIT_S = 60  # as long as submitit's runner waits for the file


def _check_submitted(folder: str) -> None:
    """submitit's runner unpickles the job it is to run from the run's logs folder, and a pickle
    can run any code: it is loaded only where no one but this user could have written it (the
    launcher keeps that folder the user's alone), never one planted by another user."""
    import os
    import time
    from pathlib import Path

    from submitit.core.job_environment import JobEnvironment

    from slurm_ddp_kit.core import userfiles

    os.environ["SUBMITIT_FOLDER"] = folder  # where JobEnvironment's paths point
    path = JobEnvironment().paths.submitted_pickle
    deadline = time.monotonic() + SUBMITTED_WAIT_S
    while not path.exists() and time.monotonic() < deadline:  # the launcher renames it there
        time.sleep(1.0)
    why = userfiles.why_not_own(Path(path))
    if path.exists() and why:
        raise SystemExit(
            f"error: {why}: the job will not load it (a pickle runs code); make the run's logs "
            "folder writable by you alone (chmod go-w) and resume the run"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
