"""The processes of local jobs: their tasks are found by the environment submitit's controller
gives them, so they can be seen, waited for and ended even after the controller is gone."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

JOB_ID = b"SUBMITIT_LOCAL_JOB_ID"
RANK = b"SUBMITIT_LOCAL_GLOBALID"
COMMAND = b"SUBMITIT_LOCAL_COMMAND"  # names the job's log folder, which is in its run folder

# Per local job id: (rank, pid, command) of each of its processes on this machine.
Table = dict[str, list[tuple[int, int, str]]]


def task_table() -> Table:
    """Every local job's task processes but this one, read from /proc at once: a command that
    looks at many runs (`status` of a sweep) reads it once, not once per run."""
    table: Table = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        values = _environ(int(entry))
        if JOB_ID not in values or RANK not in values:
            continue
        with contextlib.suppress(ValueError):
            task = (
                int(values[RANK]),
                int(entry),
                values.get(COMMAND, b"").decode(errors="replace"),
            )
            table.setdefault(values[JOB_ID].decode(errors="replace"), []).append(task)
    return table


def local_tasks(
    job_id: str, run_name: str | None = None, table: Table | None = None
) -> dict[int, list[int]]:
    """The live processes of local job `job_id` but this one, by rank: its tasks (in a container
    too, with the runtime's process that started them) and what they started. `run_name`: only a
    job whose command names that run folder, since a later job may be given the same id.
    `table`: a `task_table()` read before, else /proc is read now."""
    found: dict[int, list[int]] = {}
    for rank, pid, command in (task_table() if table is None else table).get(job_id, []):
        if run_name is None or run_name in command:
            found.setdefault(rank, []).append(pid)
    return found


def _environ(pid: int) -> dict[bytes, bytes]:
    """A process's environment; empty where it is gone, a zombie, or another user's."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(v.split(b"=", 1) for v in raw.split(b"\0") if b"=" in v)
