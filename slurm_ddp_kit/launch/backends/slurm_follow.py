"""What `--wait` asks Slurm of a job it follows: why the job waits, whether Slurm still runs or
requeues it once rank 0 has ended, and whether Slurm ended it (without accounting submitit cannot
see the end of a job that left no result)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import submitit

from slurm_ddp_kit.core import runfolder, slurm
from slurm_ddp_kit.core.runfolder import failures
from slurm_ddp_kit.launch.backends import Watch
from slurm_ddp_kit.launch.follow import saved_words

PENDING_LOOK_S = 10  # how often --wait asks Slurm why a job has not started


END_LOOK_S = 10  # how often --wait asks Slurm whether a job whose results are missing has ended


END_GRACE_S = 10  # and how long after Slurm's word it waits for the results' files


class SlurmWatch(Watch):
    """A Slurm job, followed: its wait in the queue said, Slurm's word on its end asked."""

    def __init__(self, job: submitit.Job[Any], run_dir: Path, say: Callable[[str], None]) -> None:
        super().__init__(job, run_dir, say)
        self.pending, self.look = "", time.monotonic() + PENDING_LOOK_S
        self.verdict, self.end = _SlurmWord(job, run_dir, say), _SlurmEnd(job)

    def waiting(self, say: Callable[[str], None]) -> None:
        if time.monotonic() > self.look:
            self.pending = _say_pending(self.job, self.run_dir, self.pending, say)
            self.look += PENDING_LOOK_S

    def going_on(self) -> bool:
        return self.verdict.still_running()

    def ended(self) -> bool:
        seen = self.end.seen()
        self.end_state = self.end.state
        return seen

    def cancelled(self) -> bool:
        """Cancelled with scancel, so in Slurm's words."""
        found = slurm.state(str(self.job.job_id))
        return bool(found and found.state.startswith("CANCELLED"))


class _SlurmEnd:
    """Slurm's word that a job has ended. submitit reads a job's end from accounting (sacct)
    alone: where that does not answer, a job that ended without every task's result file
    (cancelled, stopped, its node lost) would be followed for ever."""

    def __init__(self, job: submitit.Job[Any]) -> None:
        self.job, self.state = job, ""
        self.look = self.since = time.monotonic()

    def seen(self) -> bool:
        """Whether Slurm ended the job END_GRACE_S ago or more (time for the tasks' result
        files to appear on a shared file system; for a lost node or a preemption, time for
        Slurm to requeue the job)."""
        now = time.monotonic()
        if now >= self.look:
            self.look = now + END_LOOK_S
            state = slurm.end_of(str(self.job.job_id)) or ""
            if state != self.state:
                self.since = now
            self.state = state
        grace = MAYBE_BACK_S if self.state in _MAYBE_BACK else END_GRACE_S
        return bool(self.state) and now - self.since >= grace


_STILL = (
    "RUNNING",
    "COMPLETING",
    "PENDING",
    "REQUEUED",
    "REQUEUE_HOLD",
    "CONFIGURING",
    "SUSPENDED",
)


class _SlurmWord:
    """Slurm's verdict on a job whose rank 0 has ended: its result file says it failed while
    Slurm may still run it (a node it cannot reach keeps the step alive until Slurm marks the
    node down) and then requeue it. `--wait` follows the job until Slurm ends it, not rank 0."""

    def __init__(self, job: submitit.Job[Any], run_dir: Path, say: Callable[[str], None]) -> None:
        self.job, self.run_dir, self.say = job, run_dir, say
        self.since: float | None = None  # when rank 0's end was first seen
        self.last = ""
        # Until when a job ended by a node's failure may still come back (requeued).
        self.back_by: float | None = None

    def still_running(self) -> bool:
        found = slurm.state(str(self.job.job_id))
        state = found.state if found else ""  # Slurm unreachable: rank 0's word stands
        now = time.monotonic()
        self.since = self.since or now
        if state in _MAYBE_BACK:  # with --requeue, Slurm brings such a job back as PENDING
            self.back_by = self.back_by or now + MAYBE_BACK_S
            self._tell(state, "waiting to see whether Slurm requeues it")
            return now < self.back_by
        self.back_by = None
        if state in _STILL and now - self.since > FOLLOW_GRACE_S:
            running = state in ("RUNNING", "COMPLETING")
            self._tell(state, "following it" if running else "requeued; following its next attempt")
        return state in _STILL

    def _tell(self, state: str, doing: str) -> None:
        if state == self.last:
            return
        first = failures.first_failure(self.run_dir)
        said = f" ({failures.failure_words(first).splitlines()[0][:300]})" if first else ""
        lost = slurm.unanswering(failures.nodes_of(self.run_dir))
        why = "".join(f"; node {node} is not answering Slurm ({w})" for node, w in lost.items())
        self.say(
            f"job {self.job.job_id}: rank 0 has ended{said}, but Slurm says {state}{why}: {doing}"
        )
        self.last = state


_MAYBE_BACK = ("NODE_FAIL", "PREEMPTED")


MAYBE_BACK_S = 120


FOLLOW_GRACE_S = 10  # a job whose rank failed is COMPLETING for a moment: no word on that


def _say_pending(
    job: submitit.Job[Any], run_dir: Path, said: str, say: Callable[[str], None]
) -> str:
    """Say why the job waits, when that changes (a job that can never start waits silently);
    for one that ran and waits again, that Slurm requeued it, why, and where it goes on."""
    reason = slurm.pending_reason(str(job.job_id)) or ""
    if reason and reason != said:
        again = _requeued(run_dir)
        say(f"job {job.job_id} {again}pending: {reason} (`python -m launch cancel {run_dir}`)")
    return reason


def _requeued(run_dir: Path) -> str:
    """'requeued (…), ' for a job whose ranks have started before, else ''."""
    records = runfolder.read_rank(run_dir, 0)
    if not runfolder.of_kind(records, "start"):
        return ""
    lost = slurm.unanswering(failures.nodes_of(run_dir))
    why = [f"node {node} is not answering Slurm ({word})" for node, word in lost.items()]
    stops = runfolder.of_kind(records, "stop")
    if stops:
        why.append(saved_words(stops[-1]))
    else:
        why.append("it goes on from its last checkpoint")
    return f"requeued ({'; '.join(why)}), "
