"""Why a run failed, from its run folder and from Slurm: the first failure (a rank's error, a
signal, a stall), a peer lost, a rank gone silent, srun's own words."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import Any

from slurm_ddp_kit.core import slurmtext
from slurm_ddp_kit.core.errors import KitError
from slurm_ddp_kit.core.runfolder import (
    ENDS,
    SRUN_LOG,
    RunFolderError,
    log_files,
    log_inside,
    logs_dir,
    of_kind,
    rank_files,
    read_config,
    read_rank,
)
from slurm_ddp_kit.core.runfolder.checks import MAX_RANKS
from slurm_ddp_kit.core.settings.rules import world_size


def first_failure(run_dir: Path) -> dict[str, Any] | None:
    """What failed first, as an `error` record of the rank to look at.

    Where srun saw a task end by a signal first (killed, aborted, a segfault: it could write
    nothing), that rank; else the earliest `error` that is not a mere echo of a lost peer; with
    no error at all, the task srun saw end first; else a rank that stood still (stopped dead,
    its error written once Slurm woke it to end it); else a rank that started and then went
    silent (killed or stalled); else the earliest error. srun's word comes first for signals:
    a rank it ended for the job's sake is reported after the step's end, and a peer's error may
    read as its own.
    """
    views = {rank: read_rank(run_dir, rank) for rank in rank_files(run_dir, _ranks(run_dir))}
    errors = [r for view in views.values() for r in of_kind(view, "error")]
    ended = slurmtext.first_bad_exit(srun_output(run_dir))
    if ended and ended.by_signal:
        return _ended_by_slurm(views, ended)
    primary = [r for r in errors if not lost_peer(r)]
    if primary:
        return min(primary, key=lambda r: r.get("time", 0.0))
    if not errors:
        return _ended_by_slurm(views, ended) if ended else None
    still = max(errors, key=lambda r: float(r.get("stood_still_s") or 0))
    if float(still.get("stood_still_s") or 0) >= STOOD_STILL_S:
        return {
            **still,
            "error": f"stopped answering: it stood still for {still['stood_still_s']:.0f} s "
            "(stopped dead, SIGSTOP, or frozen), and the other ranks timed out waiting for it",
        }
    silent = [rank for rank, view in sorted(views.items()) if went_silent(view)]
    # A stalled rank that Slurm wakes to end it (SIGCONT, SIGTERM) writes an error of its own,
    # but never a timeout: the timeouts are the ranks that waited for it.
    waited = {r.get("rank") for r in errors if _WAITED.search(str(r.get("error", "")))}
    woken = [rank for rank, view in sorted(views.items()) if waited and rank not in waited]
    silent = silent or [rank for rank in woken if of_kind(views[rank], "start")]
    if silent:
        start = of_kind(views[silent[0]], "start")[-1]
        return {
            "rank": silent[0],
            "node": start.get("node"),
            "host": start.get("host"),
            "error": "stopped answering (killed or stalled: it recorded no error); the other "
            "ranks lost it",
        }
    return min(errors, key=lambda r: r.get("time", 0.0))


STOOD_STILL_S = 5.0  # a rank that did not run for this long was stopped, not merely slow


def _ranks(run_dir: Path) -> int:
    """The run's world size, as its settings make it (the bound of its rank files)."""
    try:
        return world_size(read_config(run_dir))
    except KitError:  # the caller reports the damaged run.json; files alone bound nothing more
        return MAX_RANKS


def _ended_by_slurm(
    views: dict[int, list[dict[str, Any]]], ended: slurmtext.TaskEnd
) -> dict[str, Any]:
    rank = ended.tasks[0]
    start = (of_kind(views.get(rank, []), "start") or [{}])[-1]
    own = of_kind(views.get(rank, []), "error")
    said = f"; its last words: {own[-1].get('error')}" if own else ": it recorded no error"
    return {
        "rank": rank,
        "node": ended.node,
        "host": start.get("host"),
        "error": f"{ended.what.lower()} (as srun reports it){said}",
        "recorded": bool(own),  # False: srun's word alone (a cancel's SIGTERM reads so too)
    }


def srun_output(run_dir: Path) -> str:
    """srun's own messages for the run's job: the sbatch scripts copy them into the run folder;
    under submitit they are in the job's first stderr log (the batch step's is task 0's). The
    stdout logs, which hold the whole training's output, are not read. Logs that lead out of
    the run folder are passed over here (`launch logs` names them): one hostile folder must not
    stop `status` of the others."""
    try:
        errs = [p for p in log_files(run_dir, 0, earlier_jobs=False) if p.suffix == ".err"]
        paths = [log_inside(run_dir, logs_dir(run_dir) / SRUN_LOG), *errs]
    except RunFolderError:
        return ""
    texts = []
    for path in paths:
        with contextlib.suppress(OSError):
            texts.append(path.read_text(errors="replace"))
    return "\n".join(texts)


# Errors a rank raises because a peer went away: they follow a failure, they are not it.
_LOST_PEER = re.compile(
    r"closed by peer|reset by peer|broken pipe|timed out|timeout|remote process exited|"
    r"communicator was aborted|connection refused",
    re.IGNORECASE,
)


_WAITED = re.compile(r"timed out|timeout", re.IGNORECASE)


def lost_peer(error: dict[str, Any]) -> bool:
    """An error that only says a peer went away (its backend traceback tells nothing more)."""
    return bool(_LOST_PEER.search(str(error.get("error", ""))))


def went_silent(view: list[dict[str, Any]]) -> bool:
    """A rank that started and then wrote nothing more of its end: no error, stop or summary."""
    kinds = {r.get("kind") for r in view}
    return "start" in kinds and not kinds & set(ENDS)


def nodes_of(run_dir: Path) -> list[str]:
    """The nodes the ranks of the run's last attempt started on (from their start records)."""
    ranks = rank_files(run_dir, _ranks(run_dir))
    starts = (of_kind(read_rank(run_dir, rank), "start") for rank in ranks)
    return sorted({str(s[-1]["node"]) for s in starts if s and s[-1].get("node")})


def failure_words(error: dict[str, Any]) -> str:
    return f"rank {error.get('rank')} on {error.get('node') or error.get('host')} failed first: {error.get('error')}"
