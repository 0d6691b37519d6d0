"""Where a run's files lie (checkpoints, logs, code), each path checked to stay inside the run folder,
and the atomic writes of its checkpoints."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from pathlib import Path

from slurm_ddp_kit.core.runfolder import layout


def checkpoint_path(run_dir: Path) -> Path:
    return run_dir / layout.CHECKPOINT


def state_path(run_dir: Path) -> Path:
    return run_dir / layout.STATE


def saved_state(run_dir: Path) -> Path | None:
    """The run's saved training state, or None where none was saved; a state.pt that is no
    regular file (a folder, a named pipe) is refused, never taken as 'nothing saved', which
    would start the run over from epoch 1."""
    path = state_path(run_dir)
    try:
        mode = os.lstat(path).st_mode  # a link is no regular file: it may lead out of the folder
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as err:
        raise layout.RunFolderError(
            f"{path} cannot be read ({err.strerror}): the run cannot resume"
        ) from None
    if not stat.S_ISREG(mode):
        raise layout.RunFolderError(
            f"{path} is not a regular file (a folder, a pipe, a link …), so the run cannot resume from "
            "it: remove it to start the run over, or start a new run"
        )
    return path


def program_checkpoints(run_dir: Path) -> Path:
    """A user's program's checkpoint folder, made, reached through no link (`no_links`)."""
    folder = no_links(run_dir, run_dir / layout.PROGRAM_CHECKPOINTS)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def shards_path(run_dir: Path, name: str) -> Path:
    return run_dir / layout.SHARDS / name


def drop_other_shards(run_dir: Path, keep: str) -> None:
    """After state.pt names `keep`: the folders of earlier saves, and of any save that died before
    its state.pt, go (the one named stays whole until a later state.pt names another)."""
    for folder in no_links(run_dir, run_dir / layout.SHARDS).glob("*"):
        if folder.name != keep:
            shutil.rmtree(folder, ignore_errors=True)


def code_dir(run_dir: Path) -> Path:
    return run_dir / layout.CODE


def code_manifest(run_dir: Path) -> Path:
    return run_dir / layout.CODE_MANIFEST


def logs_dir(run_dir: Path) -> Path:
    return run_dir / layout.LOGS


def logs_to_write(run_dir: Path) -> Path:
    """The logs folder a job writes into, checked by `check_writable`."""
    return _no_links_in(run_dir, logs_dir(run_dir))


def check_writable(run_dir: Path) -> None:
    """Before a job is submitted into an existing run folder (`launch resume`): no symbolic link
    where the job writes (see `no_links`), so that it is refused now, before anything is written,
    rather than in the job."""
    for name in (
        layout.CLAIM,
        layout.META,
        layout.LOGS,
        layout.METRICS,
        os.path.dirname(layout.STATE),
        layout.SHARDS,
    ):
        _no_links_in(run_dir, run_dir / name)


def _no_links_in(run_dir: Path, folder: Path) -> Path:
    """`folder`, checked as `no_links` checks a path, and every entry in it: a link planted under
    a coming file's name (a new job's log) would carry that write elsewhere. A link that leads
    to a file of the same run folder is passed (submitit links `.submission_file_*.sh` to the
    job's script in its logs folder)."""
    no_links(run_dir, folder)
    inside = run_dir.resolve()
    with contextlib.suppress(FileNotFoundError, NotADirectoryError), os.scandir(folder) as entries:
        for entry in entries:
            if entry.is_symlink() and not Path(entry.path).resolve().is_relative_to(inside):
                no_links(run_dir, Path(entry.path))
    return folder


def no_links(run_dir: Path, path: Path) -> Path:
    """`path` (in the run folder), after checking that neither it nor a folder between the run
    folder and it is a symbolic link. Run folders sit on shared file systems: a link planted in
    one would carry the kit's writes (records, checkpoints, logs) to a file outside it."""
    current = run_dir
    for part in path.relative_to(run_dir).parts:
        current = current / part
        if current.is_symlink():
            raise layout.RunFolderError(
                f"{current} is a symbolic link: the kit writes only inside the run folder, never "
                "through a link; remove it (the kit makes what it needs), then run the command again"
            )
    return path


def open_inside(run_dir: Path, path: Path, flags: int, mode: int = 0o666) -> int:
    """os.open of a file in the run folder, through no symbolic link (see `no_links`; O_NOFOLLOW
    also refuses a link that appears at the last moment)."""
    try:
        return os.open(no_links(run_dir, path), flags | os.O_NOFOLLOW, mode)
    except OSError as err:
        if err.errno != errno.ELOOP:
            raise
        no_links(run_dir, path)  # says it in words
        raise


def sweep_logs_dir(first_run: Path) -> Path:
    """A sweep's array writes every element's logs into one folder beside its run folders."""
    return first_run.parent / layout.SWEEPS / first_run.name


def sbatch_log_pattern(run_dir: Path) -> str:
    """srun's --output for the sbatch scripts: one file per task (%t: the task's rank)."""
    return str(logs_dir(run_dir) / "rank-%t.out")


def shell_assignments(run_dir: Path) -> str:
    """What `launch prepare --shell` prints: the paths an sbatch script needs, as shell lines."""
    import shlex

    values = {
        "run_dir": str(run_dir),
        "rank_log": sbatch_log_pattern(run_dir),
        "srun_log": str(logs_dir(run_dir) / layout.SRUN_LOG),
    }
    return "".join(f"{name}={shlex.quote(value)}\n" for name, value in values.items())


def publish_store_port(run_dir: Path, job_id: str, port: int) -> None:
    """Tell the job's other processes where its store listens (written whole or not at all)."""
    path = _store_port_path(run_dir, job_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    with os.fdopen(open_inside(run_dir, staging, flags), "w") as f:
        f.write(str(port))
    os.replace(staging, path)


def published_store_port(run_dir: Path, job_id: str) -> int | None:
    """The port the job's store published, or None while it has not."""
    with contextlib.suppress(OSError, ValueError):
        return int(_store_port_path(run_dir, job_id).read_text())
    return None


def forget_store_port(run_dir: Path, job_id: str) -> None:
    """Once every process has joined: a requeued attempt of the same job publishes anew."""
    _store_port_path(run_dir, job_id).unlink(missing_ok=True)


def _store_port_path(run_dir: Path, job_id: str) -> Path:
    return run_dir / layout.LOGS / layout.STORE_PORT.format(job=job_id)
