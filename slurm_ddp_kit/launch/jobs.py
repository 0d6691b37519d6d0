"""Operate submitted runs: their state, cancelling them, their logs.

State comes from the run's backend (`launch.backends`: Slurm's accounting, then its queue; a
local job's processes), then the run folder itself, so `status` answers even when the controller
does not. A cancel is the backend's.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Any

from slurm_ddp_kit.core import runfolder, slurmtext
from slurm_ddp_kit.core.runfolder import failures
from slurm_ddp_kit.core.settings.rules import world_size
from slurm_ddp_kit.launch import backends
from slurm_ddp_kit.launch.backends import JobError
from slurm_ddp_kit.launch.backends.slurm import SIGSTOPPED


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


def status(run_dir: Path, seen: backends.Seen | None = None) -> RunStatus:
    """A run's row; `seen`: what `backends.survey` read at once for many runs (else each run's
    backend asks for its own)."""
    meta = runfolder.read_meta(run_dir)
    job_id = str(meta.get("job_id") or "-")
    mode, backend_name = str(meta.get("mode")), str(meta.get("backend"))
    if meta.get("submit_error"):
        return RunStatus(run_dir.name, mode, backend_name, job_id, "NOT-SUBMITTED", "-", "-", "-")
    records = runfolder.read_rank(run_dir, 0)  # read once: state fall-back and last epoch
    backend = backends.recorded(meta)  # None: a word this kit does not know; the folder tells
    found = backend.state(job_id, seen) if backend and job_id != "-" else None
    state, elapsed, nodes = (
        (found.state, found.elapsed, found.nodes)
        if found
        else _folder_state(run_dir, records, meta, backend, seen)
    )
    if found and found.ended and finished(run_dir, records):
        state = "COMPLETED"  # cancelled or failed after every rank had finished: its results
        # are whole (`resume` says it has finished, `summarize` counts it)
    if state == "COMPLETED" and diverged_epoch(records) is not None:
        state = "DIVERGED"  # it ended as planned, but its loss became NaN or infinite
    start = next(iter(runfolder.of_kind(records, "start")), {})
    return RunStatus(
        run_dir.name, mode, backend_name, job_id, state, nodes, elapsed, _last_epoch(records),
        start.get("placement"),
    )  # fmt: skip


def still_held(state: str) -> bool:
    """Whether a run's job, in `status`'s word, still holds or waits for its allocation."""
    return state in slurmtext.LIVE - {"STOPPED"} or state == SIGSTOPPED


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
    """Cancel the run's job, through its backend; returns what was done, in words."""
    meta = runfolder.read_meta(run_dir)
    job_id = meta.get("job_id")
    if not job_id:
        raise JobError(f"{run_dir.name} has no job id yet: nothing to cancel")
    if runfolder.of_kind(runfolder.read_rank(run_dir, 0), "summary"):
        return f"{run_dir.name}: job {job_id} had already completed"
    return backends.to_cancel(meta).cancel(run_dir, meta, str(job_id))


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
    backend: backends.Backend | None,
    seen: backends.Seen | None,
) -> tuple[str, str, str]:
    """What the run folder says: the summary means done; a job its backend sees alive runs."""
    summary = next(iter(runfolder.of_kind(records, "summary")), None)
    elapsed = _clock(summary["total_seconds"]) if summary else "-"
    host = _hosts(run_dir, records)
    stop = next(reversed(runfolder.of_kind(records, "stop")), None)  # the last attempt's
    alive = backend is not None and backend.alive(run_dir, meta, seen)
    if summary and finished(run_dir, records):
        state = "COMPLETED"
    elif meta.get("cancel_requested") and not alive:
        state = "CANCELLED"
    elif not alive and failures.first_failure(run_dir):  # any rank's error, not rank 0's alone
        state = "FAILED"
    elif stop and not alive:
        state = _stopped_state(stop)
    else:  # neither the scheduler nor the folder places it: the backend's word (UNKNOWN: none)
        state = backend.unanswered(alive) if backend else "UNKNOWN"
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
