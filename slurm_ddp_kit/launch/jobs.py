"""Operate submitted runs: their state, cancelling them, their logs.

State comes from Slurm (`core.slurm`: accounting, then the queue), then the run folder itself, so
`status` answers even when the controller does not.
"""

from __future__ import annotations

import signal
import time
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Any

from slurm_ddp_kit.core import processes, runfolder, slurm
from slurm_ddp_kit.core.errors import KitError
from slurm_ddp_kit.core.runfolder import failures
from slurm_ddp_kit.core.settings.rules import world_size


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
    placement: str | None = None  # what was wrong with the ranks' CPUs or GPUs: not a column

    def row(self) -> list[str]:
        return list(astuple(self))[: len(HEADER)]


HEADER = ["RUN", "MODE", "BACKEND", "JOB", "STATE", "NODES", "ELAPSED", "EPOCH"]


def slurm_states(run_dirs: list[Path]) -> dict[str, slurm.JobState]:
    """The Slurm jobs of these runs, asked all at once (a few calls for thousands of runs);
    a folder whose metadata cannot be read is left to `status` to report."""
    ids = []
    for run_dir in run_dirs:
        try:
            meta = runfolder.read_meta(run_dir)
        except runfolder.RunFolderError:
            continue
        if meta.get("backend") == "slurm" and meta.get("job_id"):
            ids.append(str(meta["job_id"]))
    return slurm.states(ids) if ids else {}


def status(
    run_dir: Path,
    known: dict[str, slurm.JobState] | None = None,
    tasks: processes.Table | None = None,
) -> RunStatus:
    """A run's row; `known`: its Slurm job's state if asked already (`slurm_states`); `tasks`:
    the local jobs' processes, if read already (`processes.task_table`)."""
    meta = runfolder.read_meta(run_dir)
    job_id = str(meta.get("job_id") or "-")
    mode, backend = str(meta.get("mode")), str(meta.get("backend"))
    if meta.get("submit_error"):
        return RunStatus(run_dir.name, mode, backend, job_id, "NOT-SUBMITTED", "-", "-", "-")
    records = runfolder.read_rank(run_dir, 0)  # read once: state fall-back and last epoch
    slurm_job = backend == "slurm" and job_id != "-"
    found = (known.get(job_id) if known is not None else slurm.state(job_id)) if slurm_job else None
    state, elapsed, nodes = (
        (_slurm_word(found.state), found.elapsed, found.nodes)
        if found
        else _folder_state(run_dir, records, meta, tasks)
    )
    if found and found.state in slurm.ENDED and finished(run_dir, records):
        state = "COMPLETED"  # cancelled or failed after every rank had finished: its results
        # are whole (`resume` says it has finished, `summarize` counts it)
    if state == "COMPLETED" and diverged_epoch(records) is not None:
        state = "DIVERGED"  # it ended as planned, but its loss became NaN or infinite
    start = next(iter(runfolder.of_kind(records, "start")), {})
    return RunStatus(
        run_dir.name, mode, backend, job_id, state, nodes, elapsed, _last_epoch(records),
        start.get("placement"),
    )  # fmt: skip


SIGSTOPPED = "SIGSTOPPED"


def _slurm_word(state: str) -> str:
    """Slurm's state as `status` shows it: Slurm's STOPPED (SIGSTOPped in place, its nodes held,
    nothing saved) is not the kit's STOPPED (saved, ended, waiting for `launch resume`)."""
    return SIGSTOPPED if state == "STOPPED" else state


def still_held(state: str) -> bool:
    """Whether a run's job, in `status`'s word, still holds or waits for its allocation."""
    return state in slurm.LIVE - {"STOPPED"} or state == SIGSTOPPED


def diverged_epoch(records: list[dict[str, Any]]) -> int | None:
    """The epoch whose test loss became NaN or infinite, where the run stopped; None if none."""
    summary = next(reversed(runfolder.of_kind(records, "summary")), None)
    return summary.get("diverged_epoch") if summary else None


def diverged_words(summary: dict[str, Any]) -> str:
    return (
        f"its test loss became {summary['final_test_loss']} in epoch {summary['diverged_epoch']}, "
        "where it stopped (the checkpoint of the epoch before is kept); lower train.lr, or look "
        "for NaN or infinite values in the data"
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
    if local and not local_job_alive(run_dir, meta):  # nor is its PID another's to signal
        return ended  # and not marked: a failed run stays FAILED
    # Marked first: ranks that catch the cancel's SIGTERM stop without writing anything.
    runfolder.update_meta(run_dir, cancel_requested=True)
    if not local:
        return _cancel_slurm(run_dir, str(job_id), bool(meta.get("cancel_requested")))
    # SIGINT, as submitit's own cancel: the controller stops every task (its tasks ignore a
    # forwarded SIGTERM, which submitit reserves for preemption); tasks whose controller is
    # gone are told themselves.
    controller = [int(job_id)] if _controller_alive(meta, run_dir) else []
    processes.signal_all([*controller, *_task_pids(run_dir, meta)], signal.SIGINT)
    return f"{run_dir.name}: cancelled local job {job_id}"


END_WAIT_S = 10.0  # a cancelled task ends within a second or two; past this, it is killed


def wait_local_end(run_dir: Path, timeout_s: float = END_WAIT_S) -> None:
    """Return once a local job's controller and tasks have all ended, killing the tasks still
    there after `timeout_s`: a command that says a job was cancelled leaves nothing behind."""
    meta = runfolder.read_meta(run_dir)
    deadline = time.monotonic() + timeout_s
    while local_job_alive(run_dir, meta) and time.monotonic() < deadline:
        time.sleep(0.1)
    processes.signal_all(_task_pids(run_dir, meta), signal.SIGKILL)


def _cancel_slurm(run_dir: Path, job_id: str, marked_before: bool) -> str:
    problem = slurm.cancel(job_id)
    if problem == slurm.ALREADY_ENDED:  # a failed run stays FAILED; a cancelled one, CANCELLED
        runfolder.update_meta(run_dir, cancel_requested=marked_before or None)
        return f"{run_dir.name}: Slurm job {job_id} had already ended"
    if problem:
        # Unmarked: the job runs on, and must still save at its time limit and requeue.
        runfolder.update_meta(run_dir, cancel_requested=None)
        raise JobError(
            f"scancel {job_id} failed ({problem}): the job was not cancelled; is Slurm reachable "
            "from here? Try again, or `scancel` it where Slurm answers"
        )
    return f"{run_dir.name}: cancelled Slurm job {job_id}"


def failure_line(run_dir: Path) -> str | None:
    """'RUN: rank R on HOST failed first: …' for a run whose ranks recorded an error."""
    first = failures.first_failure(run_dir)
    if not first:
        return None
    if runfolder.read_meta(run_dir).get("cancel_requested") and (
        str(first.get("error", "")).startswith("KeyboardInterrupt")
        or first.get("recorded") is False
    ):
        return None  # the cancel's own end (a Ctrl-C in the ranks, srun's word of its SIGTERM)
    return f"{run_dir.name}: {failures.failure_words(first)}"


def notes(run_dir: Path, state: str) -> list[str]:
    """What to know of a run that has not completed: what its last attempt noticed (a warning
    lead that did not fit the limit), and for one stopped at its time limit, how to go on."""
    records = runfolder.read_rank(run_dir, 0)
    lines = [f"{run_dir.name}: {n['text']}" for n in runfolder.of_kind(records, "notice")]
    if state == "DIVERGED":
        summary = runfolder.of_kind(records, "summary")[-1]
        lines.append(f"{run_dir.name}: diverged: {diverged_words(summary)}")
    if state == "TIMEOUT":
        lines.append(
            f"{run_dir.name}: {_timeout_words(run_dir, records)}: continue with "
            f"`python -m launch resume {run_dir}`"
        )
    return lines


def _timeout_words(run_dir: Path, records: list[dict[str, Any]]) -> str:
    """Why a run that reached its time limit was not requeued, as its last attempt said."""
    stop = next(reversed(runfolder.of_kind(records, "stop")), None)
    if stop is None:  # ended at the limit before its stop at the lead (a long start-up, a hang)
        return "reached its time limit before it could stop and save (no stop record)"
    if stop.get("not_requeued"):
        return f"stopped at its time limit, not requeued: {stop['not_requeued']}"
    # A kit before requeues went on by progress: the hard cap was its one reason.
    limit = runfolder.read_config(run_dir).cluster.max_requeues
    start = next(iter(runfolder.of_kind(records, "start")), {})
    return (
        f"stopped at its time limit after {start.get('restarts', 0)} requeue(s) "
        f"(cluster.max_requeues={limit})"
    )


def log_files(run_dir: Path, rank: int | None) -> list[Path]:
    """The stdout/stderr files of one rank (by default the rank that failed first, else rank 0)."""
    runfolder.read_meta(run_dir)  # a run folder, readable: before its records are looked at
    if rank is None:
        first = failures.first_failure(run_dir)
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


def finished(run_dir: Path, records: list[dict[str, Any]]) -> bool:
    """Whether the run ended with its results whole: rank 0's summary, and for a user's program
    (whose ranks end each on its own) no rank that failed."""
    if not runfolder.of_kind(records, "summary"):
        return False
    start = next(iter(runfolder.of_kind(records, "start")), {})
    return start.get("task") != "program" or failures.first_failure(run_dir) is None


def _folder_state(
    run_dir: Path,
    records: list[dict[str, Any]],
    meta: dict[str, Any],
    tasks: processes.Table | None = None,
) -> tuple[str, str, str]:
    """What the run folder says: the summary means done; a live local controller means running."""
    summary = next(iter(runfolder.of_kind(records, "summary")), None)
    elapsed = _clock(summary["total_seconds"]) if summary else "-"
    host = _hosts(run_dir, records)
    stop = next(reversed(runfolder.of_kind(records, "stop")), None)  # the last attempt's
    alive = meta.get("backend") == "local" and local_job_alive(run_dir, meta, tasks)
    if summary and finished(run_dir, records):
        state = "COMPLETED"
    elif meta.get("cancel_requested") and not alive:
        state = "CANCELLED"
    elif not alive and failures.first_failure(run_dir):  # any rank's error, not rank 0's alone
        state = "FAILED"
    elif stop and not alive:
        state = _stopped_state(stop)
    elif meta.get("backend") == "local":
        state = "RUNNING" if alive else "ENDED-WITHOUT-SUMMARY"
    else:
        state = "UNKNOWN"  # Slurm did not answer and the run folder holds no summary
    return state, elapsed, host


def _hosts(run_dir: Path, records: list[dict[str, Any]]) -> str:
    """The nodes the run's last attempt ran on, from the start record of each node's first rank
    (ranks fill a node before the next); '-' before rank 0 has started."""
    start = next(reversed(runfolder.of_kind(records, "start")), None)
    if not start:
        return "-"
    per_node = start.get("local_world_size") or 1
    hosts = [_node(start)]
    # The files there, not every rank the record counts: a record is read, never trusted
    for rank in runfolder.rank_files(run_dir, start.get("world_size") or 1):
        if rank and rank % per_node == 0:
            found = runfolder.of_kind(runfolder.read_rank(run_dir, rank), "start")[-1:]
            hosts += [_node(found[0])] if found else []
    return ",".join(dict.fromkeys(hosts))


def _node(start: dict[str, Any]) -> str:
    return str(start.get("node") or start.get("host") or "?")  # Slurm's: hostnames can repeat


def _stopped_state(stop: dict[str, Any]) -> str:
    """What a stop record says: requeued (it asked Slurm to), out of requeues at the time limit
    (TIMEOUT), or stopped with its state saved for `launch resume` (STOPPED)."""
    if stop.get("requeue"):
        return "REQUEUED"
    if "requeues_used" in stop and str(stop.get("reason", "")).startswith("time limit"):
        return "TIMEOUT"
    return "STOPPED"


def local_job_alive(
    run_dir: Path, meta: dict[str, Any] | None = None, table: processes.Table | None = None
) -> bool:
    """Whether the run's local job runs: its controller, or a task of it (one whose controller
    was killed). `meta`: its metadata read before; `table`: `processes.task_table()` read before."""
    meta = runfolder.read_meta(run_dir) if meta is None else meta
    return _controller_alive(meta, run_dir) or bool(_tasks(run_dir, meta, table))


def _tasks(
    run_dir: Path, meta: dict[str, Any], table: processes.Table | None = None
) -> dict[int, list[int]]:
    """The job's live task processes, by rank (named by the job id and the run folder)."""
    job_id = str(meta.get("job_id") or "")
    if not job_id.isdigit():
        return {}
    return processes.local_tasks(job_id, runfolder.logs_dir(run_dir), table)


def _task_pids(run_dir: Path, meta: dict[str, Any]) -> list[int]:
    return [pid for pids in _tasks(run_dir, meta).values() for pid in pids]


def _controller_alive(meta: dict[str, Any], run_dir: Path) -> bool:
    """The local job's controller still runs: its PID is alive, is still that process (a PID is
    reused once its process ends: the identity recorded at submission), and is provably this
    run's (`processes.started_for`: this user's, started for the run's logs folder). The PID and
    identity the run folder records prove nothing alone: anyone who can write the folder can name any process,
    which `cancel` would then signal and `status` call RUNNING."""
    pid = str(meta.get("job_id"))
    if not pid.isdigit() or not processes.alive(int(pid)):
        return False
    recorded = meta.get("job_process")
    if recorded and processes.identity(int(pid)) != recorded:
        return False
    return processes.started_for(int(pid), runfolder.logs_dir(run_dir))


def _last_epoch(records: list[dict[str, Any]]) -> str:
    epochs = runfolder.of_kind(records, "epoch")
    start = next(iter(runfolder.of_kind(records, "start")), None)
    if not epochs:
        return "-"
    return f"{epochs[-1]['epoch']}/{start['epochs'] if start else '?'}"


def _clock(seconds: object) -> str:
    if not isinstance(seconds, int | float):  # not measured
        return "-"
    total = int(seconds)
    return f"{total // 3600:02d}:{total % 3600 // 60:02d}:{total % 60:02d}"
