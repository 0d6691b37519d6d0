"""Surviving Slurm: the whole training state in one checkpoint, the stop signals, and the requeue.

On the warning signal before the time limit (SIGUSR2) or on SIGTERM (preemption), a handler only
sets a flag. The loop asks all ranks at the next optimizer step whether any saw one (one small
all-reduce), so every rank stops after the same step; rank 0 then writes the checkpoint and the job
is requeued (through submitit's own handler on the submitit path, `scontrol requeue` on the sbatch
path); the restarted job resumes from the checkpoint by itself. Saving inside a signal handler can
hang a collective, and a handler on rank 0 alone leaves the others running.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import pickle
import random
import shutil
import signal
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from train import runfolder
from train.config import Config, to_yaml
from train.strategies import STRATEGIES

log = logging.getLogger("train")

# Why a job stops early, as agreed by all ranks; a larger code wins when ranks disagree.
NONE, TIME_LIMIT, PREEMPTED = 0, 1, 2
REASONS = {TIME_LIMIT: "time limit (SIGUSR2)", PREEMPTED: "preemption (SIGTERM)"}
_SIGNALS = {signal.SIGUSR2: TIME_LIMIT, signal.SIGTERM: PREEMPTED}


@dataclass
class Progress:
    """Where training stands: `batches` of `epoch` are done (0: the epoch has not started)."""

    epoch: int = 1
    batches: int = 0
    loss_sum: float = 0.0  # this rank's, over the done batches of the epoch
    samples: int = 0  # this rank's, likewise


class StopSignals:
    """Catches the stop signals in every rank and turns them into one agreed decision."""

    def __init__(self) -> None:
        self.seen = NONE
        self.group: Any = None  # the process group the flag travels on: a CPU (gloo) one
        # Under submitit these are its handlers: the loop hands the requeue back to them.
        self.before = {signum: signal.signal(signum, self._handle) for signum in _SIGNALS}

    def join(self) -> None:
        """Once the process group exists: a gloo group of all ranks for the flag, so asking at
        every step costs a few microseconds on the host and never waits for the GPU."""
        if dist.is_initialized():
            gloo = dist.get_backend() == "gloo"
            self.group = dist.group.WORLD if gloo else dist.new_group(backend="gloo")

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.seen = max(self.seen, _SIGNALS[signal.Signals(signum)])

    def agreed(self) -> int:
        """The stop reason any rank saw (NONE if none): every rank gets the same answer."""
        if self.group is None:
            return self.seen
        flag = torch.tensor([self.seen])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return int(flag.item())

    def from_main(self, value: str) -> str:
        """Rank 0's `value`, on every rank (on the flag's CPU group: no GPU sync)."""
        if self.group is None:
            return value
        shared = [value]
        dist.broadcast_object_list(shared, src=0, group=self.group)
        return str(shared[0])

    def requeue_through_submitit(self) -> str:
        """submitit's own checkpoint-and-requeue, on rank 0 once the state is saved: its handler
        calls the submitted Checkpointable's `checkpoint` (a resubmission of the same run
        folder), stores it for the restart and runs `scontrol requeue`, then raises SystemExit,
        which is ours to take. '' on success, else why the job was not requeued."""
        handler = self.before.get(signal.SIGUSR2)
        if not callable(handler):
            return "submitit's signal handler is not installed in this process"
        try:
            handler(signal.SIGUSR2, None)
        except SystemExit:
            return ""
        except Exception as err:  # `scontrol requeue` failed, or submitit declined to requeue
            return str(err) or type(err).__name__
        return "submitit did not requeue the job"


def ignore_stop_signals() -> None:
    """From here on the process only ends: a signal now must not fail a job that did its work."""
    for signum in _SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def config_hash(cfg: Config) -> str:
    return hashlib.sha256(to_yaml(cfg).encode()).hexdigest()


def rng_state() -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


def save(
    run_dir: Path,
    cfg: Config,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    progress: Progress,
) -> None:
    """Every rank's progress and RNG gathered to rank 0, which writes one file (its rename is the
    commit: a reader sees the whole previous state or the whole new one), then the bare weights.

    The model and optimizer state go into that file whole, or, for a strategy that saves shards
    (FSDP), into a new torch.distributed.checkpoint folder that every rank writes first and the
    file names; the folder of the previous save goes once the file names the new one.
    """
    # Every rank takes part: a sharded strategy gathers or writes its state here.
    strategy = STRATEGIES[cfg.mode]
    model_state = strategy.model_state(model)  # whole, for the bare model's weights file
    if strategy.saves_shards:
        shards = _save_name(progress)
        strategy.save_shards(model, optimizer, runfolder.shards_path(run_dir, shards))
        held: dict[str, Any] = {"shards": shards}
    else:
        held = {"model": model_state, "optimizer": strategy.optimizer_state(model, optimizer)}
    mine = {"progress": asdict(progress), "rng": rng_state()}
    ranks = [mine]
    if dist.is_initialized():
        ranks = [None] * dist.get_world_size()  # type: ignore[list-item]
        dist.all_gather_object(ranks, mine)  # also: every rank's shards are written by now
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    state = {
        "schema": runfolder.SCHEMA,
        "config_sha256": config_hash(cfg),
        "epoch": progress.epoch,
        "batches": progress.batches,
        **held,
        "scaler": scaler.state_dict(),
        "ranks": ranks,
    }
    _write(runfolder.state_path(run_dir), state)
    _write(runfolder.checkpoint_path(run_dir), model_state)  # weights alone, for a bare model
    if "shards" in held:
        runfolder.drop_other_shards(run_dir, keep=held["shards"])


def _write(path: Path, obj: Any) -> None:
    """torch.save through an atomic file; a full disk or quota is said in words (torch says
    "unexpected pos"), and the file saved before stays whole."""
    try:
        with runfolder.atomic_file(path) as partial:
            torch.save(obj, partial)
    except (OSError, RuntimeError) as err:
        if isinstance(err, RuntimeError) and "inline_container" not in str(err):
            raise  # not torch's file writer failing: a bug, whose traceback helps
        free = shutil.disk_usage(path.parent).free / 2**20
        raise runfolder.RunFolderError(
            f"could not save {path} ({str(err).splitlines()[0][:200]}); {free:.0f} MB free "
            "there: free space (or raise the quota), then `python -m launch resume` the run; "
            "the state saved before is kept"
        ) from None


def _save_name(progress: Progress) -> str:
    """A new shards folder's name, the same on every rank: where training stands, and rank 0's
    clock (two saves at one point, across attempts, never share a folder)."""
    stamp = [time.time_ns()]
    if dist.is_initialized():
        dist.broadcast_object_list(stamp, src=0)
    return f"epoch{progress.epoch}-batch{progress.batches}-{stamp[0]}"


def load(run_dir: Path, cfg: Config, rank: int, world_size: int) -> dict[str, Any] | None:
    """The saved state with this rank's own progress and RNG, or None where none was saved."""
    path = runfolder.state_path(run_dir)
    if not path.is_file():
        return None
    try:
        state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=False)
    except (RuntimeError, EOFError, OSError, pickle.UnpicklingError) as err:
        raise runfolder.RunFolderError(
            f"{path} cannot be read ({str(err).splitlines()[0][:200]}): it was damaged after it was "
            "saved (the kit writes it whole or not at all), so the run cannot resume; start a new "
            "run"
        ) from None
    if state.get("config_sha256") != config_hash(cfg):
        raise runfolder.RunFolderError(
            f"{path} was saved with other settings than {run_dir / runfolder.CONFIG}: a run "
            "resumes only with its own config; start a new run instead"
        )
    if len(state["ranks"]) != world_size:
        raise runfolder.RunFolderError(
            f"{path} holds {len(state['ranks'])} rank(s) but this job has {world_size}: resume "
            "with the run's own shape (its saved config)"
        )
    if "shards" in state:  # where this rank reads its own shards from
        folder = runfolder.shards_path(run_dir, state["shards"])
        if not (folder / ".metadata").is_file():
            raise runfolder.RunFolderError(
                f"{path} names the shards folder {folder}, which is missing or incomplete: the "
                "model and optimizer state are gone, so the run cannot resume; start a new run"
            )
        state["shards_folder"] = folder
    return {**state, "mine": state["ranks"][rank]}


def requeue_id() -> str | None:
    """The id `scontrol requeue` takes: an array element's own, else the job's; None off Slurm."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    if array and task:
        return f"{array}_{task}"  # the bare array id would requeue every element
    return os.environ.get("SLURM_JOB_ID")


def restarts() -> int:
    """How often Slurm has restarted this job (0 on the first run)."""
    return int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)


def request_requeue(job_id: str) -> str:
    """Ask Slurm to requeue the job; '' on success, else what went wrong."""
    try:
        done = subprocess.run(
            ["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return str(err)
    return "" if done.returncode == 0 else (done.stderr or done.stdout).strip()


def slurm_state(job_id: str) -> str:
    """The job's state as Slurm sees it now ('' where squeue cannot tell)."""
    try:
        done = subprocess.run(
            ["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip().split("\n")[0] if done.returncode == 0 else ""


def wait_for_slurm(seconds: float) -> None:
    """After a requeue or at the end of the allowed requeues: Slurm ends this process itself."""
    with contextlib.suppress(KeyboardInterrupt):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(1.0)
