"""The stop signals a job's ranks catch (Slurm's warning, SIGTERM, a cancel), held from the
first instruction of the process, and how often the ranks agree to ask about them; what
`train.stopping` does with them at a step boundary is its own."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from slurm_ddp_kit.core import runfolder
from slurm_ddp_kit.core.errors import KitError
from slurm_ddp_kit.train import early

log = logging.getLogger("train")

# Why a job stops early, as agreed by all ranks; a larger code wins when ranks disagree.
NONE, TIME_LIMIT, PREEMPTED = 0, 1, 2


# Where training stands, as a checkpoint saves it: (epoch, batches of it done); START: nothing.
Position = tuple[int, int]


START: Position = (1, 0)


_SIGNALS = {signal.SIGUSR2: TIME_LIMIT, signal.SIGTERM: PREEMPTED}


# The loop asks about a stop every few optimizer steps, as many as take about ASK_EVERY_S (at
# most MAX_ASK_EVERY): a stop is acted on within about a second of its signal however long a
# step takes (Slurm's SIGKILL follows SIGTERM by KillWait), while fast steps share one ask.
ASK_EVERY_S = 1.0


MAX_ASK_EVERY = 8


class StopSignals:
    """Reads the stop signals held since the process's start (`train.early`) and turns them into
    one decision that every rank agrees on."""

    def __init__(self) -> None:
        self.seen = NONE
        self.group: Any = None  # the process group the flag travels on: a CPU (gloo) one
        self.deadline: float | None = None  # a time-limit stop put off until then (`due`)
        self.every = 1  # optimizer steps between two asks, agreed by all ranks at each ask
        # Where this attempt resumed from (epoch, batches done in it): the loop sets it at its
        # start; a stop compares what it saves with it (`not_requeued`).
        self.resumed_from: Position = START
        self.asked_at: float | None = None  # time.monotonic() of the last ask
        # Under submitit these are its handlers: the loop hands the requeue back to them.
        self.before = early.hold()

    def end_at_cancel(self, run_dir: Path, rank: int) -> None:
        """End this process the moment SIGTERM comes for a run `launch cancel` marked: a cancel
        writes nothing more, so there is nothing to wait for, and a rank in a long step or a
        collective would otherwise live on until Slurm's SIGKILL (KillWait, often 30 s). A
        thread waits for the signal; any other SIGTERM it passes on to the loop, as a flag."""
        threading.Thread(
            target=_end_at_cancel, args=(run_dir, rank), daemon=True, name="cancel-watch"
        ).start()

    def join(self) -> None:
        """Once the process group exists: a gloo group of all ranks for the flag, so asking at
        every step costs a few microseconds on the host and never waits for the GPU."""
        if dist.is_initialized():
            gloo = dist.get_backend() == "gloo"
            self.group = dist.group.WORLD if gloo else dist.new_group(backend="gloo")

    def _local(self) -> int:
        for signum in early.take():
            self.seen = max(self.seen, _SIGNALS[signal.Signals(signum)])
        due = self.deadline is not None and time.time() >= self.deadline
        return max(self.seen, TIME_LIMIT if due else NONE)

    def agreed(self, steps: int = 0) -> int:
        """The stop reason any rank saw (NONE if none): every rank gets the same answer. With
        it, how many steps to the next ask: the fewest any rank proposes from the time its last
        `steps` steps took (none: the epoch's end, the count stays)."""
        proposal = self._proposal(steps)
        if self.group is None:
            reason = self._local()
        else:  # one all-reduce for both: the largest reason, the smallest count (negated)
            flag = torch.tensor([self._local(), -proposal])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            reason, proposal = int(flag[0]), -int(flag[1])
        self.every, self.asked_at = proposal, time.monotonic()
        return reason

    def _proposal(self, steps: int) -> int:
        if not steps or self.asked_at is None:
            return self.every
        per_step = max(time.monotonic() - self.asked_at, 1e-6) / steps
        return max(1, min(MAX_ASK_EVERY, int(ASK_EVERY_S / per_step)))

    def put_off(self, seconds: float) -> None:
        """Forget the warning seen so far and stop `seconds` from now instead."""
        self.seen, self.deadline = NONE, time.time() + seconds

    def from_main(self, value: str) -> str:
        """Rank 0's `value`, on every rank (on the flag's CPU group: no GPU sync)."""
        if self.group is None:
            return value
        shared = [value]
        dist.broadcast_object_list(shared, src=0, group=self.group)
        return str(shared[0])

    def requeue_through_submitit(self) -> str:
        """submitit's own checkpoint-and-requeue, on rank 0 once the state is saved
        (`early.requeue_through_submitit`); '' on success, else why the job was not requeued."""
        return early.requeue_through_submitit(self.before)


EXIT_CANCELLED = 143  # as a process ended by SIGTERM reports itself


def _end_at_cancel(run_dir: Path, rank: int) -> None:
    while True:
        signal.sigwait({signal.SIGTERM})
        early.note(signal.SIGTERM)
        with contextlib.suppress(OSError, KitError):
            if runfolder.read_meta(run_dir).get("cancel_requested"):
                log.info("rank %d: cancelled by `launch cancel`: ending now, writing nothing", rank)
                os._exit(EXIT_CANCELLED)
