"""Stopping early: the stop signals, caught from a job's start, and what the job does on one.

On the warning signal before the time limit (SIGUSR2) or on SIGTERM (preemption), a handler only
sets a flag. The loop asks all ranks, about once a second at an optimizer step, whether any saw one
(one small all-reduce), so every rank stops after the same step; the state is saved and the job is
requeued (through submitit's own handler on the submitit path, `scontrol requeue` on the sbatch
path) for as long as its attempts save progress (`not_requeued`); the restarted job resumes from
the checkpoint by itself.
Saving inside a signal handler can hang a collective, and a handler on rank 0 alone leaves the
others running.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

from slurm_ddp_kit.core import runfolder, slurm, submitted
from slurm_ddp_kit.train import checkpoint
from slurm_ddp_kit.train.distenv import LaunchError
from slurm_ddp_kit.train.process import Context, Stopped
from slurm_ddp_kit.train.stopsignals import NONE, PREEMPTED, START, TIME_LIMIT, Position

if TYPE_CHECKING:
    from torch import nn


log = logging.getLogger("train")


# SIGTERM is Slurm ending the job for any reason of its own: a preemption, an `scancel`, a
# requeue after a node was lost; the reason names the signal first, and all of them.
REASONS = {
    TIME_LIMIT: "time limit (SIGUSR2)",
    PREEMPTED: "SIGTERM (preemption, scancel or a lost node)",
}


def reason_words(reason: int) -> str:
    """Why the job stopped, in words; a local job has no Slurm to send SIGTERM: its controller
    ended (`train.early.end_with_controller`), or someone's `kill`."""
    if reason == PREEMPTED and submitted.by_local_executor():
        return "SIGTERM (its local controller ended, or a kill)"
    return REASONS[reason]


def wait_for_slurm(seconds: float) -> None:
    """After a requeue or at the end of the allowed requeues: Slurm ends this process itself."""
    with contextlib.suppress(KeyboardInterrupt):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(1.0)


LEAD_SLACK_S = 5  # within this of the lead, a warning is on time


EARLY_S = 60  # Slurm sends its warning on a periodic check (30 s), so up to this much early


def due(ctx: Context, steps: int = 0) -> int:
    """The stop every rank acts on now (NONE: train on), asked at agreed step boundaries.

    Slurm's time-limit warning may come earlier than the lead: on its periodic check, up to
    EARLY_S before it, and at once where the lead is longer than the limit allows
    (`sbatch --time=1` against the script's `--signal=USR2@90`). Acted on, it would requeue the
    job before it trained, attempt after attempt. So a warning that came early is put off until
    the lead is left (a lead of at most half the limit, the rule `launch submit` fits it by); one
    with far more time left is someone's `scancel --signal=USR2`, acted on at once. A stop put
    off (or armed at the start, `arm`) is weighed again when its time comes: the limit may have
    been extended meanwhile. `steps`: the optimizer steps since the last ask (`agreed`).
    """
    reason = ctx.stops.agreed(steps)
    if reason != TIME_LIMIT:
        return reason
    later = ctx.stops.from_main(_put_off_by(ctx) if ctx.env.is_main else "")
    if not later:
        return reason
    ctx.stops.put_off(float(later))
    return NONE


def arm(ctx: Context) -> None:
    """Stop at the lead whether or not Slurm's warning comes, where the job knows at its start
    that the warning would come early (its lead is longer than half the limit: Slurm warns at
    once or soon) or may have come already: while no step ran yet (the sbatch script's
    `launch prepare`) or while a task's interpreter started (`core.slurm.TASK_START`), where it
    is lost. A warning that does come is put off to the same instant (`due`)."""
    job_id = slurm.job_to_requeue()
    if job_id is None:
        return
    left = ctx.stops.from_main(_left_at_start(ctx, job_id) if ctx.env.is_main else "")
    if left:
        ctx.stops.deadline = time.time() + float(left)


def _left_at_start(ctx: Context, job_id: str) -> str:
    """Rank 0's word: seconds until the job must stop at its lead ('' while the warning is
    still to come and on time, or where Slurm cannot tell), said as `_put_off_by` says it."""
    times = _times(ctx, job_id)
    if times is None:
        return ""
    left, limit, asked, lead = times
    if asked > limit // 2:
        why = f"{_LONG_LEAD.format(asked=asked)} ({limit} s)"
    elif left <= asked + LEAD_SLACK_S:  # Slurm sends it once no more than `asked` is left
        why = (
            f"{left} s of the job's {limit} s are left at its start, and Slurm's warning may "
            "have come before the job could hold it"
        )
    else:
        return ""
    _say(ctx, f"{why}: the job trains on and saves {lead} s before the end, warned or not")
    return str(max(left - lead, 0))


_LONG_LEAD = (
    "its lead (cluster.signal_delay_s={asked}, the script's --signal) is longer than half the limit"
)


def _put_off_by(ctx: Context) -> str:
    """Rank 0's word: seconds to put the time-limit stop off by ('' to act now), said in the
    log and the run folder, where `launch status` shows it (once: a warning that comes for a
    stop already put off or armed at the start is put off without a word)."""
    job_id = slurm.job_to_requeue()
    times = _times(ctx, job_id) if job_id else None
    if times is None:
        return ""
    left, limit, asked, lead = times
    if left <= lead + LEAD_SLACK_S or left > max(asked, lead) + EARLY_S:
        return ""
    why = _LONG_LEAD.format(asked=asked) if asked > limit // 2 else "Slurm sent it early"
    if ctx.stops.deadline is None:
        _say(
            ctx,
            f"the time-limit warning came with {left} s of the job's {limit} s left: {why}, so "
            f"the job trains on and saves {lead} s before the end instead",
        )
    return str(left - lead)


def _times(ctx: Context, job_id: str) -> tuple[int, int, int, int] | None:
    """(seconds left, the limit, the lead asked for, the lead acted on: at most half the limit)
    of the running job; None where Slurm cannot tell."""
    times = slurm.time_left(job_id)
    if times is None:
        return None
    (left, limit), asked = times, ctx.cfg.cluster.signal_delay_s
    return left, limit, asked, min(asked, limit // 2)


def _say(ctx: Context, message: str) -> None:
    log.warning("%s", message)
    ctx.metrics.write("notice", text=message)


def stop(
    ctx: Context,
    reason: int,
    progress: checkpoint.Progress,
    state: tuple[nn.Module, Any, Any],
    saved: bool = False,
) -> dict[str, Any]:
    """Stopped early by a signal, after the same step on every rank: save (unless the state on
    disk is `progress`'s already), then requeue."""
    cfg, words = ctx.cfg, reason_words(reason)
    if runfolder.read_meta(ctx.run_dir).get("cancel_requested"):
        raise Stopped("cancelled by `launch cancel`: stopped without writing")
    if cfg.train.checkpoint and not saved:  # train.checkpoint=false: a new attempt starts over
        checkpoint.save(ctx.run_dir, cfg, *state, progress)
    where = f"epoch {progress.epoch}, batch {progress.batches}"
    job_id = slurm.job_to_requeue()
    if job_id is None:
        _write_stop(ctx, reason, progress)
        raise Stopped(
            f"stopped by {words} at {where}, checkpoint saved: continue with "
            f"`python -m launch resume {ctx.run_dir}`"
        )
    if reason == PREEMPTED:  # first: where Slurm ends the job, Slurm decides whether it comes back
        _leave_to_slurm_if_ending(ctx, reason, progress, job_id, where)
    why_not = ctx.stops.from_main(not_requeued(ctx, progress) if ctx.env.is_main else "")
    if why_not:
        return _out_of_requeues(ctx, reason, progress, where, why_not)
    problem = _requeue(ctx, job_id) if ctx.env.is_main else ""
    _write_stop(ctx, reason, progress, requeue=job_id)
    if problem:
        raise LaunchError(
            f"stopped by {words} at {where} and saved, but the requeue of job {job_id} failed "
            f"({problem}): continue with `python -m launch resume {ctx.run_dir}`"
        )
    log.info(
        "rank %d: stopped by %s at %s, saved; job %s requeued", ctx.env.rank, words, where, job_id
    )
    wait_for_slurm(600)  # Slurm ends this process as it requeues the job
    raise Stopped(f"job {job_id} was requeued but this process was not ended")


def _requeue(ctx: Context, job_id: str) -> str:
    """submitit's own checkpoint-and-requeue where submitit started the job, else `scontrol`."""
    if submitted.by_slurm_executor():
        return ctx.stops.requeue_through_submitit()
    return slurm.requeue(job_id)


def _leave_to_slurm_if_ending(
    ctx: Context, reason: int, progress: checkpoint.Progress, job_id: str, where: str
) -> None:
    """SIGTERM comes from Slurm ending the job itself (`scancel`, `scontrol requeue`, preemption)
    or from elsewhere. Where Slurm is ending it, the kit only saves: Slurm requeues it or not (a
    requeue of a cancelled job would bring it back), and the saved state serves either way."""
    # Asked once, by rank 0, and shared: every rank then acts alike, and a large job does not
    # send Slurm's controller one query per rank while it is preempting.
    state = ctx.stops.from_main(slurm.queue_state(job_id) if ctx.env.is_main else "")
    if state in ("", "RUNNING"):
        return
    _write_stop(ctx, reason, progress, requeue=None, slurm_state=state)
    log.info("rank %d: SIGTERM at %s, saved; Slurm is ending job %s (%s)", ctx.env.rank, where,
             job_id, state)  # fmt: skip
    wait_for_slurm(600)
    raise Stopped(f"stopped by SIGTERM at {where}, saved; Slurm ended job {job_id} ({state})")


def _write_stop(ctx: Context, reason: int, progress: checkpoint.Progress, **more: Any) -> None:
    ctx.metrics.write(
        "stop",
        reason=reason_words(reason),
        epoch=progress.epoch,
        batches=progress.batches,
        **more,
    )


def not_requeued(ctx: Context, progress: checkpoint.Progress) -> str:
    """Rank 0's word: why the job must not requeue itself now ('' to requeue). It goes on for as
    long as its attempts save progress; it stops after cluster.requeues_without_progress
    requeues in a row that followed attempts which saved nothing new, or at the hard cap."""
    c = ctx.cfg.cluster
    saved = (progress.epoch, progress.batches) if ctx.cfg.train.checkpoint else START
    records = runfolder.read_records(runfolder.metrics_path(ctx.run_dir, 0))[0]
    stalled = attempts_without_progress(records, ctx.env.job_id, ctx.stops.resumed_from, saved)
    if stalled > c.requeues_without_progress:
        unsaved = "; train.checkpoint=false saves nothing" if not ctx.cfg.train.checkpoint else ""
        return (
            f"{stalled} attempts in a row saved nothing new "
            f"(cluster.requeues_without_progress={c.requeues_without_progress}{unsaved})"
        )
    if slurm.restarts() >= c.max_requeues:
        limit = f"cluster.max_requeues={c.max_requeues}"
        return f"the job was requeued {slurm.restarts()} time(s) already ({limit})"
    return ""


def attempts_without_progress(
    records: list[dict[str, Any]], job_id: str, resumed_from: Position, saved: Position
) -> int:
    """How many attempts in a row, this one included, saved nothing beyond where they resumed
    from: 0 where this one saves `saved` beyond `resumed_from`.

    An earlier attempt's progress is where the next one resumed from, beyond where it did
    itself, as rank 0's start records of this job say (`records`: its file, this attempt's start
    last). The file lies on a shared file system: a record of the wrong shape tells nothing, and
    an attempt that Slurm ended itself (a preemption, a lost node: its stop record names
    Slurm's state) says nothing of whether the run can progress in its limit.
    """
    if saved > resumed_from:
        return 0
    attempts = _attempts_of(records, job_id)[:-1]  # the last start is this attempt's
    stalled, after = 1, resumed_from
    for start, ended_by_slurm in reversed(attempts):
        if start is None or after > start:
            break  # it progressed (or its start cannot tell): the row ends here
        if not ended_by_slurm:
            stalled += 1
        after = start
    return stalled


def _attempts_of(records: list[dict[str, Any]], job_id: str) -> list[tuple[Position | None, bool]]:
    """This job's attempts, oldest first: where each resumed from (None where its record cannot
    tell), and whether Slurm ended it itself. Only the job's own: an earlier job of the run
    folder (before a `launch resume`) ran under other settings, or other limits."""
    attempts: list[tuple[Position | None, bool]] = []
    for record in records:
        kind = record.get("kind")
        if kind == "start":
            if record.get("job_id") != job_id:
                attempts.clear()
                continue
            attempts.append((_position(record), False))
        elif kind == "stop" and attempts and record.get("slurm_state"):
            attempts[-1] = (attempts[-1][0], True)
    return attempts


def _position(start: dict[str, Any]) -> Position | None:
    epoch, batches = start.get("first_epoch"), start.get("resumed_at_batch") or 0
    if type(epoch) is not int or type(batches) is not int:  # bool is no count either
        return None
    return epoch, batches


def _out_of_requeues(
    ctx: Context, reason: int, progress: checkpoint.Progress, where: str, why: str
) -> dict[str, Any]:
    _write_stop(
        ctx, reason, progress, requeue=None, requeues_used=slurm.restarts(), not_requeued=why
    )
    message = (
        f"stopped by {reason_words(reason)} at {where}, saved; not requeued: {why}. Continue "
        f"with `python -m launch resume {ctx.run_dir}`"
    )
    log.warning("rank %d: %s", ctx.env.rank, message)
    if reason == TIME_LIMIT:
        wait_for_slurm(24 * 3600)  # Slurm ends the job at its limit: TIMEOUT
    raise Stopped(message)
