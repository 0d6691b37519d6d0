"""How a job's ranks stop: how often they ask about a stop, and how many attempts in a row
saved nothing new."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import pytest
import torch.distributed as dist
from kit import spawned_ranks

from slurm_ddp_kit.train import stopping, stopsignals
from slurm_ddp_kit.train.stopsignals import StopSignals


def _asking_rank(rank: int, world: int, port: int, out: Any) -> None:
    """One rank of a gloo group of two: rank 0's steps take 2 s, rank 1's 5 ms, and rank 1 holds
    a real SIGTERM; what each rank agrees at three asks."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank))
    os.environ["WORLD_SIZE"] = str(world)
    dist.init_process_group("gloo", init_method="env://")
    try:
        stops = StopSignals()
        stops.join()
        if rank == 1:  # held from StopSignals() on: noted, not fatal. Sent to this thread, which
            # blocks it: threads started before (torch's, gloo's) do not, and one of them would
            # take a process-wide SIGTERM, noted only once this thread runs the handler.
            signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
        seen = []
        for steps, per_step in ((4, (2.0, 0.005)[rank]), (0, 0.0), (8, 0.005)):
            stops.asked_at = time.monotonic() - steps * per_step
            seen.append((stops.agreed(steps), stops.every))
        out.put((rank, seen))
    finally:
        dist.destroy_process_group()


def test_ranks_agree_to_ask_about_a_stop_as_often_as_the_slowest_steps_need() -> None:
    """Slow steps ask at every step, so a SIGTERM is acted on within a step of it (Slurm kills
    KillWait after); fast ones every MAX_ASK_EVERY; the epoch's end keeps the count. Every rank
    agrees on both the stop and the count, the slowest rank's, as the next ask must be shared."""
    seen = dict(spawned_ranks(_asking_rank, 2, answers=2))
    preempted = stopping.PREEMPTED  # seen once, it stands at every later ask
    expected = [(preempted, 1), (preempted, 1), (preempted, stopsignals.MAX_ASK_EVERY)]
    assert seen == {0: expected, 1: expected}


def _start(first_epoch: object, batch: object = 0, job: str = "7") -> dict[str, object]:
    return {"kind": "start", "job_id": job, "first_epoch": first_epoch, "resumed_at_batch": batch}


REQUEUED = {"kind": "stop", "requeue": "7"}  # the kit requeued the attempt


PREEMPTED = {"kind": "stop", "requeue": None, "slurm_state": "PREEMPTED"}  # Slurm ended it


@pytest.mark.parametrize(
    ("records", "resumed_from", "saved", "expected"),
    [
        ([_start(3, 2)], (3, 2), (3, 5), 0),  # this attempt saved beyond where it resumed
        ([_start(3, 2)], (3, 2), (4, 0), 0),
        ([_start(1)], (1, 0), (1, 0), 1),  # saved nothing (train.checkpoint=false: (1, 0))
        ([_start(2), REQUEUED, _start(2), REQUEUED, _start(2)], (2, 0), (2, 0), 3),
        # the row ends at the attempt that progressed (it saved epoch 1 whole)
        ([_start(1), REQUEUED, _start(2), REQUEUED, _start(2)], (2, 0), (2, 0), 2),
        # an earlier save lost: the attempt after it resumed from less, so that one saved nothing
        ([_start(3), REQUEUED, _start(2)], (2, 0), (2, 0), 2),
        # an attempt Slurm ended itself (a preemption) neither counts nor ends the row
        ([_start(2), REQUEUED, _start(2), PREEMPTED, _start(2)], (2, 0), (2, 0), 2),
        # only this job's attempts: an earlier job of the run folder (before a resume) is not
        ([_start(2, job="6"), _start(2, job="6"), _start(2)], (2, 0), (2, 0), 1),
        # a record of the wrong shape (a hand edit, a damaged file) tells nothing: the row ends
        ([_start(2), _start("two"), _start(2)], (2, 0), (2, 0), 1),
        ([_start(2), _start(2, batch=True), _start(2)], (2, 0), (2, 0), 1),
        ([_start(2), {"kind": "start"}, _start(2)], (2, 0), (2, 0), 1),
        ([], (2, 0), (2, 0), 1),  # no records at all: this attempt alone
    ],
)
def test_attempts_without_progress_counts_the_row_this_attempt_ends(
    records: list[dict[str, object]],
    resumed_from: tuple[int, int],
    saved: tuple[int, int],
    expected: int,
) -> None:
    assert stopping.attempts_without_progress(records, "7", resumed_from, saved) == expected
