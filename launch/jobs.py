"""Operate submitted runs: their state, cancelling them, their logs.

State comes from `sacct` (Slurm accounting), then `squeue`, then the run folder itself, each with a
short timeout, so `status` answers even when the controller does not.
"""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Any

from train import runfolder
from train.config import world_size
from train.errors import KitError

_TIMEOUT_S = 10
_SACCT_FIELDS = ("JobID", "State", "Elapsed", "NodeList")


class JobError(KitError):
    """A job cannot be operated as asked; the message says why and what to do."""


@dataclass
class RunStatus:
    run_id: str
    mode: str
    backend: str
    job_id: str
    state: str
    nodes: str
    elapsed: str
    last_epoch: str

    def row(self) -> list[str]:
        return list(astuple(self))


HEADER = ["RUN", "MODE", "BACKEND", "JOB", "STATE", "NODES", "ELAPSED", "EPOCH"]


def status(run_dir: Path) -> RunStatus:
    meta = runfolder.read_meta(run_dir)
    job_id = str(meta.get("job_id") or "-")
    mode, backend = str(meta.get("mode")), str(meta.get("backend"))
    if meta.get("submit_error"):
        return RunStatus(run_dir.name, mode, backend, job_id, "NOT-SUBMITTED", "-", "-", "-")
    records = runfolder.read_rank(run_dir, 0)  # read once: state fall-back and last epoch
    found = _slurm_state(job_id) if backend == "slurm" and job_id != "-" else None
    state, elapsed, nodes = found or _folder_state(run_dir, records, meta)
    return RunStatus(
        run_dir.name, mode, backend, job_id, state, nodes, elapsed, _last_epoch(records)
    )


def unreadable(run_dir: Path) -> RunStatus:
    """The row of a folder that cannot be read (the reason goes to stderr)."""
    return RunStatus(run_dir.name, "-", "-", "-", "UNREADABLE", "-", "-", "-")


def format_table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


def cancel(run_dir: Path) -> str:
    """Cancel the run's job; returns what was done, in words."""
    meta = runfolder.read_meta(run_dir)
    job_id = meta.get("job_id")
    if not job_id:
        raise JobError(f"{run_dir.name} has no job id yet: nothing to cancel")
    if runfolder.of_kind(runfolder.read_rank(run_dir, 0), "summary"):
        return f"{run_dir.name}: job {job_id} had already completed"
    ended = f"{run_dir.name}: local job {job_id} had already ended"
    local = meta.get("backend") != "slurm"
    if local and not _local_job_alive(run_dir, meta):  # nor is its PID another's to signal
        return ended  # and not marked: a failed run stays FAILED
    # Marked first: ranks that catch the cancel's SIGTERM stop without writing anything.
    runfolder.update_meta(run_dir, cancel_requested=True)
    if not local:
        return _cancel_slurm(run_dir, str(job_id))
    try:
        # SIGINT, as submitit's own cancel: the controller stops every task (its tasks ignore
        # a forwarded SIGTERM, which submitit reserves for preemption).
        os.kill(int(job_id), signal.SIGINT)
    except ProcessLookupError:
        return ended
    return f"{run_dir.name}: cancelled local job {job_id}"


def _cancel_slurm(run_dir: Path, job_id: str) -> str:
    import submitit

    job: submitit.SlurmJob[Any] = submitit.SlurmJob(runfolder.logs_dir(run_dir), job_id)
    try:
        job.cancel(check=True)
    except (OSError, subprocess.CalledProcessError) as err:
        raise JobError(f"scancel {job_id} failed ({err}): is Slurm reachable from here?") from None
    return f"{run_dir.name}: cancelled Slurm job {job_id}"


def failure_line(run_dir: Path) -> str | None:
    """'RUN: rank R on HOST failed first: …' for a run whose ranks recorded an error."""
    first = runfolder.first_failure(run_dir)
    if not first:
        return None
    if str(first.get("error", "")).startswith("KeyboardInterrupt") and runfolder.read_meta(
        run_dir
    ).get("cancel_requested"):
        return None  # a Ctrl-C that reached the ranks with the launcher's cancel: no failure
    return f"{run_dir.name}: {runfolder.failure_words(first)}"


def log_files(run_dir: Path, rank: int | None) -> list[Path]:
    """The stdout/stderr files of one rank (by default the rank that failed first, else rank 0)."""
    if rank is None:
        first = runfolder.first_failure(run_dir)
        rank = int(first["rank"]) if first else 0
    ranks = world_size(runfolder.read_config(run_dir))
    if not 0 <= rank < ranks:
        raise JobError(f"{run_dir.name} has rank(s) 0–{ranks - 1}: pick one with --rank")
    found = runfolder.log_files(run_dir, rank)
    if not found:
        raise JobError(
            f"no logs for rank {rank} of {run_dir.name} yet (has the job started? see "
            "`python -m launch status`)"
        )
    return found


def parse_sacct(text: str) -> dict[str, dict[str, str]]:
    """`sacct --parsable2` output (a header line, then '|'-separated rows) → JobID → fields."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return {}
    header = lines[0].split("|")
    rows = [dict(zip(header, line.split("|"), strict=False)) for line in lines[1:]]
    return {row["JobID"]: row for row in rows if "JobID" in row}


def _slurm_state(job_id: str) -> tuple[str, str, str] | None:
    """(state, elapsed, nodes) from accounting, else from the queue; None if neither answers."""
    sacct = _slurm_command(
        "sacct", "-j", job_id, "-X", "--parsable2", "-o", ",".join(_SACCT_FIELDS)
    )
    row = parse_sacct(sacct.stdout).get(job_id) if sacct and sacct.returncode == 0 else None
    if row:
        nodes = row["NodeList"] if row["NodeList"] not in ("", "None assigned") else "-"
        return row["State"].split()[0], row["Elapsed"], nodes  # State: "CANCELLED by 0"
    squeue = _slurm_command("squeue", "-j", job_id, "-h", "-o", "%T|%M|%N")
    if squeue and squeue.returncode == 0 and squeue.stdout.strip():
        state, elapsed, nodes = squeue.stdout.strip().splitlines()[0].split("|")
        return state, elapsed, nodes or "-"
    return None


# Reasons a job waits that time will not cure: it asks for more than the partition, account or
# QOS allows one job (not a group limit, which frees as other jobs end), or what no node has.
_NEVER = ("PartitionNodeLimit", "PartitionTimeLimit", "PerJob", "BadConstraints", "Invalid")


def pending_reason(job_id: str) -> str | None:
    """Why a pending Slurm job waits, in Slurm's word and ours; None once it is not pending."""
    squeue = _slurm_command("squeue", "-j", job_id, "-h", "-o", "%T|%r")
    if not squeue or squeue.returncode or not squeue.stdout.startswith("PENDING|"):
        return None
    reason = squeue.stdout.strip().splitlines()[0].partition("|")[2]
    if any(word in reason for word in _NEVER):
        return f"{reason}: it will not start as asked; cancel it and ask for less, or elsewhere"
    return reason


def _slurm_command(*args: str) -> subprocess.CompletedProcess[str] | None:
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None


def _folder_state(
    run_dir: Path, records: list[dict[str, Any]], meta: dict[str, Any]
) -> tuple[str, str, str]:
    """What the run folder says: the summary means done; a live local controller means running."""
    summary = next(iter(runfolder.of_kind(records, "summary")), None)
    start = next(iter(runfolder.of_kind(records, "start")), None)
    elapsed = _clock(summary["total_seconds"]) if summary else "-"
    host = str(start["host"]) if start else "-"
    stop = next(reversed(runfolder.of_kind(records, "stop")), None)  # the last attempt's
    alive = meta.get("backend") == "local" and _local_job_alive(run_dir, meta)
    if summary:
        state = "COMPLETED"
    elif meta.get("cancel_requested") and not alive:
        state = "CANCELLED"
    elif not alive and runfolder.first_failure(run_dir):  # any rank's error, not rank 0's alone
        state = "FAILED"
    elif stop and not alive:
        state = _stopped_state(stop)
    elif meta.get("backend") == "local":
        state = "RUNNING" if alive else "ENDED-WITHOUT-SUMMARY"
    else:
        state = "UNKNOWN"  # Slurm did not answer and the run folder holds no summary
    return state, elapsed, host


def _stopped_state(stop: dict[str, Any]) -> str:
    """What a stop record says: requeued (it asked Slurm to), out of requeues at the time limit
    (TIMEOUT), or stopped with its state saved for `launch resume` (STOPPED)."""
    if stop.get("requeue"):
        return "REQUEUED"
    if "requeues_used" in stop and str(stop.get("reason", "")).startswith("time limit"):
        return "TIMEOUT"
    return "STOPPED"


def process_identity(pid: int) -> str | None:
    """What tells a process from a later one given the same PID: the boot and the process's start
    time (field 22 of /proc/PID/stat); None where /proc cannot tell (not Linux, or gone)."""
    stat = _stat(pid)
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None
    return f"{boot}:{stat[19]}" if stat else None


def _local_job_alive(run_dir: Path, meta: dict[str, Any]) -> bool:
    """The local job's controller still runs: its PID is alive and is still that process (a PID
    is reused once its process ends), judged by the identity recorded at submission; for a run
    recorded before that, by its command line, which names the run's log folder."""
    pid = str(meta.get("job_id"))
    if not _alive(pid):
        return False
    recorded = meta.get("job_process")
    if recorded:
        return process_identity(int(pid)) == recorded
    if not Path("/proc/self/cmdline").is_file():
        return True  # no /proc here: the PID alone, as before
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False
    return "submitit" in command and run_dir.resolve().name in command


def _alive(pid: str) -> bool:
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    stat = _stat(int(pid))
    return stat is None or stat[0] != "Z"  # a zombie is not running; no /proc: the PID alone


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields from the third on (state, ppid, …; start time is [19]), read past
    the command name, which may hold spaces and ')'; None without /proc or once the PID is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _last_epoch(records: list[dict[str, Any]]) -> str:
    epochs = runfolder.of_kind(records, "epoch")
    start = next(iter(runfolder.of_kind(records, "start")), None)
    if not epochs:
        return "-"
    return f"{epochs[-1]['epoch']}/{start['epochs'] if start else '?'}"


def _clock(seconds: object) -> str:
    total = int(float(str(seconds)))
    return f"{total // 3600:02d}:{total % 3600 // 60:02d}:{total % 60:02d}"
