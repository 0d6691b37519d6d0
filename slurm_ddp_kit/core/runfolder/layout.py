"""The run folder's names (its files and folders, the record kinds), its error, and the readers and
writers of its bytes that every part of the package shares."""

from __future__ import annotations

import contextlib
import errno
import functools
import glob
import json
import logging
import os
import re
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from slurm_ddp_kit.core.errors import KitError

SCHEMA = 1  # of run.json and of every record; a reader refuses a newer one, naming the fix


CONFIG = "config.yaml"  # the resolved settings, for people and for the job


SWEEPS = "sweeps"  # beside a sweep's run folders: its array's logs, one folder per sweep


META = "run.json"  # who made the run, its job, and the settings again as JSON for fast readers


METRICS = "metrics"  # one JSON-lines file per rank


LOGS = "logs"


SRUN_LOG = "srun.err"  # under logs/: srun's own messages, copied there by the sbatch scripts


CHECKPOINT = "checkpoints/model.pt"  # the bare model's weights


STATE = "checkpoints/state.pt"  # the whole training state a job resumes from


# A sharded strategy's (FSDP's) model and optimizer state: one torch.distributed.checkpoint
# folder per save, each rank writing its own shards; state.pt names the one it belongs to.
SHARDS = "checkpoints/shards"


PROGRAM_CHECKPOINTS = "checkpoints/program"  # a user's program saves here (slurm_ddp_kit)


# Under logs/: the port a local job's rendezvous store took, for its other processes to read.
STORE_PORT = "store-{job}.port"


# The code the run's jobs run, copied at submission (core.snapshot): kit/, project/, folders/.
CODE = "code"


CODE_MANIFEST = "code/manifest.json"  # written last: a code/ without it is cut short, never used


CLAIM = ".submitting"  # locked while a launcher checks the folder is free and submits into it


# `log`: a user's program's own record (`slurm_ddp_kit.log`), its values under `fields`.
KINDS = ("start", "epoch", "progress", "notice", "stop", "error", "summary", "log")


ENDS = ("error", "summary", "stop")  # the kinds a rank's attempt ends with


PLAIN_PATH = re.compile(r"[A-Za-z0-9@+=:,./_-]+")  # needs no shell quoting; no Slurm % pattern


log = logging.getLogger("kit")


class RunFolderError(KitError):
    """A path is not a readable run folder of this kit's schema; the message names the fix."""


@functools.cache
def umask() -> int:
    """This process's umask, read without changing it (os.umask sets it, racing other threads)."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        status = Path("/proc/self/status").read_text().splitlines()
        return int(next(line for line in status if line.startswith("Umask:")).split()[1], 8)
    return 0o022


def warn_once(key: Path, text: str) -> None:
    """One warning per file or folder and process: a reader may look at a run many times."""
    if key not in _warned:
        _warned.add(key)
        log.warning("warning: %s", text)


_warned: set[Path] = set()  # files whose skipped lines this process has already reported


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside `path`; once written, it is synced and renamed into place.

    A crash at any point leaves the previous file whole, and no partial file behind.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    os.fchmod(fd, 0o666 & ~umask())  # as open() makes it: the group may read the run
    os.close(fd)
    partial = Path(name)
    try:
        yield partial
        with partial.open("rb") as f:
            os.fsync(f.fileno())
        os.replace(partial, path)
        _sync_folder(path.parent)
    finally:
        partial.unlink(missing_ok=True)


def drop_partials(path: Path) -> None:
    """Remove what a writer of `path` killed outright (SIGKILL: no clean-up runs) left of it; only
    for a file that one process at a time writes (a checkpoint), never run.json."""
    for left in path.parent.glob(f".{glob.escape(path.name)}.*.partial"):
        left.unlink(missing_ok=True)


def _sync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class TooLarge(OSError):
    """A file over the size its reader takes (`read_bytes`'s limit)."""

    def __init__(self, path: Path, size: int) -> None:
        super().__init__(errno.EFBIG, "too large to read", str(path))
        self.size = size  # bytes found: the file's, or as many as were read before giving up


def read_bytes(path: Path, limit: int = 1 << 62) -> bytes:
    """The file's bytes, through the bare system calls: half the cost of open().read() (which
    readers of thousands of runs pay for every file). Over `limit` bytes: `TooLarge`, having
    read no more than that (the file may grow while it is read)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a named pipe would block until written
    try:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        if found.st_size > limit:
            raise TooLarge(path, found.st_size)
        chunks = [os.read(fd, 1 << 16)]  # a run's files are a few kB: one read, as a rule
        size = len(chunks[0])
        while len(chunks[-1]) == 1 << 16 and size <= limit:
            chunks.append(os.read(fd, 1 << 16))
            size += len(chunks[-1])
        if size > limit:
            raise TooLarge(path, size)
        return b"".join(chunks)
    finally:
        os.close(fd)


def write_json(path: Path, data: dict[str, Any]) -> None:
    with atomic_file(path) as partial:
        partial.write_text(json.dumps(data, indent=2) + "\n")
