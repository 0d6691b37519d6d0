"""Processes, read from /proc: the one reader of a process's state, whether it runs, the one
signaller; and the processes of local jobs, whose tasks are found by the environment submitit's
controller gives them, so they can be seen, waited for and ended after the controller is gone.

A process counts as a job's only where that proves it: it is this user's, and its environment
(which only its owner can read) holds the command submitit gave it, naming the job's folder. A
PID read from a run folder proves nothing: a run folder is data, which anyone with write access
to it could point at another process.
"""

from __future__ import annotations

import contextlib
import os
import shlex
from pathlib import Path


def stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields from the third on (state [0], ppid [1], start time [19]), read
    past the command name, which may hold spaces and ')'; None without /proc or once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    """Whether process `pid` runs: it exists (this user's or another's) and has not ended (a
    zombie has); without /proc, its existence alone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        pass
    except (OverflowError, ValueError):  # no PID at all
        return False
    fields = stat(pid)
    return fields is None or fields[0] not in ("Z", "X")


def signal_all(pids: list[int], signum: int) -> None:
    """Send `signum` to each process (one that ended meanwhile, its PID perhaps another user's
    now, is passed over)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)


def descendants(pid: int) -> set[int]:
    """The live processes `pid` started, and theirs, read from /proc at once (none without it)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        fields = stat(int(entry)) if entry.isdigit() else None
        if fields:
            children.setdefault(int(fields[1]), []).append(int(entry))
    found: set[int] = set()
    todo = list(children.get(pid, []))
    while todo:
        child = todo.pop()
        if child not in found:
            found.add(child)
            todo.extend(children.get(child, []))
    return found


def identity(pid: int) -> str | None:
    """What tells a process from a later one given the same PID: the boot and the process's start
    time; None where /proc cannot tell (not Linux, or gone)."""
    fields = stat(pid)
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None
    return f"{boot}:{fields[19]}" if fields else None


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
        if JOB_ID not in values or RANK not in values or not _own(int(entry)):
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
    job_id: str, logs: Path | None = None, table: Table | None = None
) -> dict[int, list[int]]:
    """The live processes of local job `job_id` but this one, by rank: its tasks (in a container
    too, with the runtime's process that started them) and what they started. `logs`: only a
    job whose command names that folder (the run's logs), since a later job may be given the
    same id. `table`: a `task_table()` read before, else /proc is read now."""
    found: dict[int, list[int]] = {}
    for rank, pid, command in (task_table() if table is None else table).get(job_id, []):
        if logs is None or names_folder(command, logs):
            found.setdefault(rank, []).append(pid)
    return found


def started_for(pid: int, logs: Path) -> bool:
    """Whether process `pid` is this user's and was started by submitit for the job folder
    `logs`: a local job's controller (its environment holds the command it starts the tasks
    with), or one of its tasks."""
    command = _environ(pid).get(COMMAND)
    return (
        command is not None and _own(pid) and names_folder(command.decode("utf-8", "replace"), logs)
    )


def names_folder(command: str, folder: Path) -> bool:
    """Whether one of the command's arguments is `folder`, however written (submitit's command
    ends with its job folder, as an absolute path)."""
    try:
        words = shlex.split(command)
    except ValueError:  # unbalanced quotes: no command of submitit's
        return False
    wanted = os.path.realpath(folder)
    return any(os.path.realpath(word) == wanted for word in words if word.startswith("/"))


def _own(pid: int) -> bool:
    """Whether the process is this user's (root's processes are root's alone, too)."""
    try:
        return os.stat(f"/proc/{pid}").st_uid == os.getuid()
    except OSError:
        return False


def _environ(pid: int) -> dict[bytes, bytes]:
    """A process's environment; empty where it is gone, a zombie, or another user's."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(v.split(b"=", 1) for v in raw.split(b"\0") if b"=" in v)
