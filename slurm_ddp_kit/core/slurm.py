"""Every Slurm command the kit runs itself, its timeout and the parsing of its answer.

submitit runs `sbatch` for a submission; everything else the kit asks or tells Slurm goes through
here: a job's state (`squeue`, then `sacct`), why it waits, which of its nodes stopped answering
(`sinfo`), its time left, cancelling (`scancel`) and requeueing it (`scontrol`), and reading
srun's report of how its tasks ended. Each command has a short timeout and an unreachable
controller is an answer ("unknown"), never a hang, so `status` and a job's stop path go on
without Slurm.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

from slurm_ddp_kit.core import submitted
from slurm_ddp_kit.core.errors import KitError
from slurm_ddp_kit.core.slurmtext import (
    ENDED,
    JobState,
    accounted,
    array_records,
    as_sacct,
    either,
    is_job_id,
    parse_sacct,
    seconds,
    unstarted,
)

log = logging.getLogger("kit")


TIMEOUT_S = 10  # a query (status, pending reason): the controller may be slow or gone


ACTION_TIMEOUT_S = 30  # scancel, scontrol requeue: worth waiting a little longer for


_SACCT_FIELDS = ("JobID", "State", "Elapsed", "NodeList")


# How each task of a job starts: a shell that ignores the stop signals, then the task's command.
# Slurm signals a step's processes at any instant: one that comes while the interpreter starts,
# before the kit holds it (`train.early`), would end the task ("User defined signal 2"). Ignored,
# it is lost instead (the disposition holds across exec), and a time-limit warning lost so the
# job makes up for from the time it has left (`train.stopping.arm`). The shell's own start,
# before its trap, is the only window left: well under a millisecond.
TASK_START = ("/bin/sh", "-c", 'trap "" USR2 TERM; exec "$@"', "kit-task")


# The batch script's first line: its own shell ignores the warning. One sent to the whole job
# (`scancel --full --signal=USR2`, `--signal=B:USR2@…`) would end that shell, and the job with it
# (FAILED, not requeued) while its tasks save. The tasks are srun's, started by Slurm's step
# daemons: they inherit nothing from this shell.
BATCH_START = "trap '' USR2  # the time-limit warning is for the tasks: they save and requeue"


# Reasons a job waits that time will not cure: it asks for more than the partition, account or
# QOS allows one job (not a group limit, which frees as other jobs end), or what no node has.
_NEVER = ("PartitionNodeLimit", "PartitionTimeLimit", "PerJob", "BadConstraints", "Invalid")


class JobIdError(KitError):
    """A job id that is not Slurm's: never passed to a Slurm command."""


def _checked(job_ids: list[str]) -> list[str]:
    """The ids, each refused unless it is a Slurm job id (see _JOB_ID)."""
    for job_id in job_ids:
        if not is_job_id(job_id):
            raise JobIdError(
                f"{job_id!r} is not a Slurm job id (digits, or J_K for an array's element): it "
                "was not passed to Slurm; pass the job's own id"
            )
    return job_ids


def _jobs(*job_ids: str) -> str:
    """squeue's and sacct's job list, attached to its option: their `-j` reads a following
    `--user=root` as an option of its own (squeue's argument is optional), `--jobs=` never."""
    return "--jobs=" + ",".join(_checked(list(job_ids)))


def available() -> bool:
    """Whether this machine can submit: `sbatch` on PATH and a Slurm config to read."""
    conf = os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf")
    configured = Path(conf).is_file() or Path("/etc/slurm-llnl/slurm.conf").is_file()
    return bool(shutil.which("sbatch")) and configured


def named_conf_missing() -> str | None:
    """SLURM_CONF where it names no file (Slurm's commands would retry reading it for a minute,
    then fail); None where it is unset (configless Slurm finds its controller by DNS) or a file."""
    conf = os.environ.get("SLURM_CONF")
    return conf if conf and not Path(conf).is_file() else None


def state(job_id: str) -> JobState | None:
    """The job's state as the queue has it, else as accounting does; None if neither answers.

    The queue first: it is the controller's own view, while accounting lags it under load (a job
    already running can still read PENDING in `sacct`). But a job that has ended reads
    COMPLETING in the queue until its processes are gone, while accounting may already hold
    how it ended. `-t all`: an ended job stays in the queue for a while (MinJobAge)."""
    queued = _from_queue(job_id)
    if queued and queued.state != "COMPLETING":
        return queued
    return either(queued, _from_accounting(job_id))


def end_of(job_id: str) -> str | None:
    """How the job ended, where Slurm says it has: its state in the queue or in accounting, or
    "ENDED" where the controller no longer knows it (it left the queue MinJobAge after it ended)
    and accounting cannot tell; None while it lives, or where Slurm does not answer."""
    found = state(job_id)
    if found:
        return found.state if found.state in ENDED else None
    squeue = _run("squeue", "-h", "-t", "all", _jobs(job_id), "-o", "%T")
    if squeue is None:
        return None
    unknown = "Invalid job id" in squeue.stderr or (squeue.returncode == 0 and not squeue.stdout)
    return "ENDED" if unknown else None


CHUNK = 4000  # job ids per squeue or sacct call: a command line of about 50 kB


def states(job_ids: list[str]) -> dict[str, JobState]:
    """Many jobs' states (ids as `J` or an array element's `J_K`) in one squeue and one sacct call
    per CHUNK ids, chosen as `state` chooses; a job neither knows is left out.

    An array element that never started has no row of its own in accounting: the array's
    pending record (`J_[3-999%256]`) stands for it, so a cancelled pending array reads CANCELLED."""
    wanted = list(dict.fromkeys(job_ids))
    queued: dict[str, JobState] = {}
    accounted: dict[str, JobState] = {}
    for chunk in (wanted[i : i + CHUNK] for i in range(0, len(wanted), CHUNK)):
        queued |= _queue_states(chunk)
        arrays = {job.partition("_")[0] for job in chunk if "_" in job}
        accounted |= _accounting_states([*chunk, *sorted(arrays - set(chunk))])
    pending = array_records(accounted)
    found = {job: either(queued.get(job), accounted.get(job) or unstarted(job, pending))
             for job in wanted}  # fmt: skip
    return {job: known for job, known in found.items() if known}


def _queue_states(job_ids: list[str]) -> dict[str, JobState]:
    """squeue's rows of these jobs (`-r`: a pending array's elements one per line)."""
    squeue = _run("squeue", "-h", "-r", "-t", "all", _jobs(*job_ids), "-o", "%i|%T|%M|%N")
    if not squeue or squeue.returncode:
        return {}
    rows = (line.split("|") for line in squeue.stdout.splitlines() if line.count("|") == 3)
    return {
        job: JobState(word, as_sacct(elapsed), nodes or "-") for job, word, elapsed, nodes in rows
    }


def _accounting_states(job_ids: list[str]) -> dict[str, JobState]:
    sacct = _run("sacct", _jobs(*job_ids), "-X", "--parsable2", "-o", ",".join(_SACCT_FIELDS))
    rows = parse_sacct(sacct.stdout) if sacct and sacct.returncode == 0 else {}
    return {job: accounted(row) for job, row in rows.items()}


def _from_queue(job_id: str) -> JobState | None:
    return _queue_states([job_id]).get(job_id)


def _from_accounting(job_id: str) -> JobState | None:
    return _accounting_states([job_id]).get(job_id)


def queue_state(job_id: str) -> str:
    """The job's state in the queue now ('' where squeue cannot tell): asked from inside a job."""
    squeue = _run("squeue", "-h", _jobs(job_id), "-o", "%T", timeout=ACTION_TIMEOUT_S)
    return squeue.stdout.strip().split("\n")[0] if squeue and squeue.returncode == 0 else ""


def requeue_id() -> str | None:
    """The id `scontrol requeue` takes: an array element's own, else the job's; None off Slurm."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    if array and task:
        return f"{array}_{task}"  # the bare array id would requeue every element
    return os.environ.get("SLURM_JOB_ID")


def job_to_requeue() -> str | None:
    """The Slurm job a task requeues or asks about; None off Slurm and under the local executor."""
    return None if submitted.by_local_executor() else requeue_id()


def restarts() -> int:
    """How often Slurm has restarted this job (0 on the first run)."""
    return int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)


def time_left(job_id: str) -> tuple[int, int] | None:
    """(seconds left, time limit in seconds) of a running job; None where squeue cannot tell or
    the job has no limit."""
    squeue = _run("squeue", "-h", _jobs(job_id), "-o", "%L|%l", timeout=ACTION_TIMEOUT_S)
    if not squeue or squeue.returncode or "|" not in squeue.stdout:
        return None
    left, limit = (seconds(word) for word in squeue.stdout.strip().splitlines()[0].split("|"))
    return (left, limit) if left is not None and limit else None


def pending_reason(job_id: str) -> str | None:
    """Why a pending job waits, in Slurm's word and ours; None once it is not pending."""
    squeue = _run("squeue", _jobs(job_id), "-h", "-o", "%T|%r")
    if not squeue or squeue.returncode or not squeue.stdout.startswith("PENDING|"):
        return None
    reason = squeue.stdout.strip().splitlines()[0].partition("|")[2]
    if any(word in reason for word in _NEVER):
        return f"{reason}: it will not start as asked; cancel it and ask for less, or elsewhere"
    return reason


def unanswering(nodes: list[str]) -> dict[str, str]:
    """Those of `nodes` that Slurm finds not answering, with its word for each: DOWN, or a
    state marked `*` (the node missed the controller's pings). {} where sinfo cannot tell."""
    if not nodes:
        return {}
    sinfo = _run("sinfo", "-h", "-N", "-n", ",".join(sorted(set(nodes))), "-o", "%N|%T")
    if not sinfo or sinfo.returncode:
        return {}
    rows = (line.partition("|") for line in sinfo.stdout.splitlines())
    return {
        name: word
        for name, _, word in rows
        if word.endswith("*") or word.startswith(("down", "fail"))
    }


def max_array_size() -> int | None:
    """The cluster's MaxArraySize (an array's indices run below it); None where Slurm does not
    say."""
    done = _run("scontrol", "show", "config")
    found = re.search(r"^MaxArraySize\s*=\s*(\d+)", done.stdout, re.M) if done else None
    return int(found[1]) if found and int(found[1]) > 0 else None


def srun_takes(option: str) -> bool:
    """Whether this cluster's srun knows an option (a SPANK plugin such as pyxis adds its own to
    srun's help); where srun cannot say, True, and srun itself refuses the job."""
    done = _run("srun", "--help")
    return done is None or done.returncode != 0 or option in done.stdout


EXPEDITE_SINCE = (25, 11)  # the release that brought sbatch --requeue=expedite


def expedite_refused() -> str:
    """Why this cluster would refuse `sbatch --requeue=expedite` ('' where it takes it, or where
    Slurm cannot say: sbatch then decides): older releases refuse the option's value, and a
    cluster that does not allow expedited requeues refuses the job."""
    version = _run("sbatch", "--version")
    found = re.search(r"(\d+)\.(\d+)\S*", version.stdout) if version else None
    if found and (int(found[1]), int(found[2])) < EXPEDITE_SINCE:
        return f"this cluster runs Slurm {found[0]}; expedited requeue came with Slurm 25.11"
    config = _run("scontrol", "show", "config")
    if not config or config.returncode != 0:
        return ""
    allowed = re.search(r"^SlurmctldParameters\s*=.*enable_expedited_requeue", config.stdout, re.M)
    if not allowed:
        return (
            "this cluster does not allow it (SlurmctldParameters has no enable_expedited_requeue)"
        )
    return ""


def expedites(job_id: str) -> bool | None:
    """Whether the job was submitted with --requeue=expedite; None where Slurm cannot say."""
    done = _run("scontrol", "show", "job", "--", *_checked([job_id]))
    if not done or done.returncode != 0:
        return None
    return "ExpeditedRequeue=Yes" in done.stdout


ALREADY_ENDED = "already ended"


def cancel(job_id: str) -> str:
    """`scancel` the job; '' on success, ALREADY_ENDED where Slurm had ended it or forgotten it
    (scancel exits 0 then, and says so only with -v), else what went wrong."""
    done = _run("scancel", "-v", "--", *_checked([job_id]), timeout=ACTION_TIMEOUT_S)
    gone = ("already completing or completed", "Invalid job id specified")
    if done and done.returncode == 0 and any(word in done.stderr for word in gone):
        return ALREADY_ENDED
    if done and done.returncode:  # its errors, not -v's account of what it tried
        errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
        done.stderr = "\n".join(errors) or done.stderr
    return _problem(done, "scancel")


def requeue(job_id: str) -> str:
    """Ask Slurm to requeue the job; '' on success, else what went wrong."""
    return _problem(
        _run("scontrol", "requeue", "--", *_checked([job_id]), timeout=ACTION_TIMEOUT_S), "scontrol"
    )


def _run(*args: str, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess[str] | None:
    """The command's result; None where it could not run or outlasted its timeout, or could
    only have retried reading a SLURM_CONF that names no file until its timeout."""
    log.debug("slurm: %s", shlex.join(args))  # `-v` shows every Slurm command the kit runs
    missing = named_conf_missing()
    if missing:
        log.debug("slurm: SLURM_CONF=%s names no file: %s not run", missing, args[0])
        return None
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as err:
        log.debug("slurm: %s: %s", args[0], err)
        return None
    log.debug(
        "slurm: %s: exit %d, %d line(s) out", args[0], done.returncode, done.stdout.count("\n")
    )
    return done


def _problem(done: subprocess.CompletedProcess[str] | None, command: str) -> str:
    if done is None:
        return f"{command} could not run or did not answer in time"
    return (
        ""
        if done.returncode == 0
        else (done.stderr or done.stdout).strip() or f"exit {done.returncode}"
    )
