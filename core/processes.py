"""The processes of a local job: its tasks are found by the environment submitit's controller
gives them, so they can be seen, waited for and ended even after the controller is gone."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

JOB_ID = b"SUBMITIT_LOCAL_JOB_ID"
RANK = b"SUBMITIT_LOCAL_GLOBALID"
COMMAND = b"SUBMITIT_LOCAL_COMMAND"  # names the job's log folder, which is in its run folder


def local_tasks(job_id: str, run_name: str | None = None) -> dict[int, list[int]]:
    """The live processes of local job `job_id` but this one, by rank: its tasks (in a container
    too, with the runtime's process that started them) and what they started. `run_name`: only a
    job whose command names that run folder, since a later job may be given the same id."""
    wanted = job_id.encode()
    found: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if wanted and os.path.isdir("/proc") else []:
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        values = _environ(int(entry))
        if values.get(JOB_ID) != wanted or RANK not in values:
            continue
        if run_name is not None and run_name.encode() not in values.get(COMMAND, b""):
            continue
        with contextlib.suppress(ValueError):
            found.setdefault(int(values[RANK]), []).append(int(entry))
    return found


def _environ(pid: int) -> dict[bytes, bytes]:
    """A process's environment; empty where it is gone, a zombie, or another user's."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(v.split(b"=", 1) for v in raw.split(b"\0") if b"=" in v)
