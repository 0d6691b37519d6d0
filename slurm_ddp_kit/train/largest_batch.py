"""The largest global batch that fits, or (task=largest_model) the widest model.name=gpt that
trains at the run's global batch: double until out of memory, then bisect to within 5 %.

A trial is real training steps of the run's strategy on random data of the workload's shape:
forward, backward with every collective the strategy makes (DDP's bucketed all-reduce and its
hook, ZeRO's broadcasts, FSDP's gathers and reduce-scatters) and the optimizer step, in the run's
precision and layout.

A rank that runs out of memory inside a step leaves the others waiting in a collective that will
never complete, and a communicator cannot be trusted after that. So each trial runs in fresh
worker processes, one per rank, with a process group of their own; the job's processes hold no GPU
memory and watch them. A worker that fails answers its job process, which raises a flag in the
job's store; the others see it and stop waiting. All ranks agree on the outcome through the store,
then every worker is ended. A fresh process per trial, as a training job starts: a process that
already ran other sizes fits a few per cent more or less (its allocator's cache, its libraries'
workspaces), which showed as disagreements with a fresh-process check. Workers are forked from a
server that imported torch once, so a trial costs the CUDA and process-group start-up only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import itertools
import logging
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist

from slurm_ddp_kit.core import processes, strategies
from slurm_ddp_kit.core.errors import KitError
from slurm_ddp_kit.core.settings.schema import Config, Precision, Task
from slurm_ddp_kit.train import early, steps, workloads
from slurm_ddp_kit.train.process import (
    Context,
    barrier,
    dist_backend,
    start_record,
    workload_record,
)

log = logging.getLogger("train")

TOLERANCE = 0.05
CEILING = 1 << 24  # a global batch of 16 M samples: past this the search stops, whatever fits
STEPS_PER_TRIAL = 2  # DDP rebuilds its buckets after the first step; momentum exists after it
POLL_S = 0.05  # how often a job process looks at its worker and the store while it waits
GRACE_S = 0.2  # how long it waits for its own worker's end once another rank has failed

# A trial's outcome on one rank, worst last: the agreed outcome is the worst of all ranks'.
FITS, ENDED, OOM, ERROR = "fits", "ended", "oom", "error"  # ENDED: another rank's worker failed
WORST = (FITS, ENDED, OOM, ERROR)


class TrialError(KitError):
    """A trial failed for a reason other than memory: the search cannot go on."""


def search(
    fits: Callable[[int], bool],
    start: int,
    unit: int,
    ceiling: int | None = None,
    name: str = "global_batch",
) -> tuple[int | None, list[dict[str, Any]]]:
    """Largest multiple of `unit` for which fits() holds, within TOLERANCE, up to `ceiling`
    (CEILING where not given); and every trial made (each as {name: value, "fits": …})."""
    trials: list[dict[str, Any]] = []
    ceiling = ceiling or CEILING

    def attempt(batch: int) -> bool:
        ok = fits(batch)
        trials.append({name: batch, "fits": ok})
        return ok

    low, high = 0, None
    batch = max(unit, min(start, ceiling) // unit * unit)
    while high is None and batch <= ceiling:
        if attempt(batch):
            low, batch = batch, batch * 2
        else:
            high = batch
    if high is None:
        return low, trials  # the ceiling fits: report it as a lower bound
    while high - low > max(unit, TOLERANCE * low):
        middle = (low + high) // 2 // unit * unit
        if middle in (low, high):
            break
        low, high = (middle, high) if attempt(middle) else (low, middle)
    return low or None, trials


@dataclass(frozen=True)
class Spec:
    """What a worker needs to build this rank's part of a training step (sent to it pickled)."""

    cfg: Config
    rank: int
    world_size: int
    device: str  # this rank's device ("cuda:1"; DP: its first GPU)
    gpus: int  # GPUs the rank drives (DP: all of the node's)
    shape: tuple[int, ...]
    classes: int
    threads: int
    store: tuple[str, int] | None  # the job's store (host, port); None: the job is one process
    backend: str  # the workers' process group's (unused without a store)
    job_pid: int = field(default_factory=os.getpid)  # the job process, made in it


_SEARCHES = itertools.count()  # this process's searches so far


class Trials:
    """fits(global_batch) for `search`, for this rank: a fresh worker runs each trial, every
    rank's job process calls it with the same sizes in the same order, and all agree on each
    outcome."""

    def __init__(self, spec: Spec) -> None:
        self.spec = spec
        self.timeout_s = spec.cfg.dist.timeout_s
        self.store = _connect(spec) if spec.store else None
        # The store's keys are named by the search and the trial, counted alike on every rank:
        # a job process may search more than once (its ranks in the same order).
        self.search = next(_SEARCHES)
        self.trial = 0
        self.worker: BaseProcess | None = None
        self.conn: Connection | None = None
        # Workers are forked from a server that imported torch and the kit once (this process
        # may have touched CUDA, after which a fork could not use it). And torch._dynamo, which
        # DistributedDataParallel imports when it is built: a second of every trial otherwise.
        self.context = early.forkserver(preload=(__name__, "torch._dynamo"))

    def __call__(self, value: int) -> bool:
        """Whether the steps train at `value`: a global batch, or a model width."""
        self.trial += 1
        self._start_worker(value)
        try:
            outcome, detail = self._answer()
            if outcome in (OOM, ERROR) and self.store is not None:
                self.store.set(self._key("failed"), "1")  # the other ranks stop waiting
            agreed, details = self._agree(outcome, detail)
        finally:
            self._end_worker()  # it may wait in a collective that will never complete
        searched, what = _trial_words(self.spec.cfg, value)
        if self.spec.rank == 0:
            log.info("largest %s: %s: %s", searched, what, agreed)
        if agreed == ERROR:
            raise TrialError(
                f"the largest-{searched} search stopped at {what}: " + "; ".join(details)
            )
        return agreed == FITS

    def _start_worker(self, value: int) -> None:
        self.conn, theirs = self.context.Pipe()
        self.worker = self.context.Process(
            target=_work,
            args=(self.spec, self._key("group/"), value, theirs),
            daemon=True,
            name="maxbatch-worker",
        )
        self.worker.start()
        theirs.close()

    def _end_worker(self) -> None:
        if self.worker is not None:
            self.worker.kill()
            self.worker.join()
        if self.conn is not None:
            self.conn.close()
        self.worker = self.conn = None

    def _answer(self) -> tuple[str, str]:
        """This rank's outcome: its worker's answer or end, or that another rank's worker failed."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            if (own := self._own(POLL_S)) is not None:
                return own
            if self.store is not None and self.store.check([self._key("failed")]):
                # The other rank's failure may follow from ours (our worker was killed and broke
                # its collectives), so our worker's end, already visible then, comes first.
                return self._own(GRACE_S) or (ENDED, "")
            if time.monotonic() > deadline:
                return ERROR, (
                    f"no answer from the worker in dist.timeout_s={self.timeout_s} s (a hang, or "
                    "steps slower than that: raise dist.timeout_s)"
                )

    def _own(self, wait_s: float) -> tuple[str, str] | None:
        """The worker's answer, or that it ended without one, if either comes within wait_s."""
        assert self.worker is not None and self.conn is not None
        if self.conn.poll(wait_s):
            with contextlib.suppress(EOFError):
                outcome, detail = self.conn.recv()
                return outcome, detail
            self.worker.join(1)  # the worker closed its end: it is ending
        if not self.worker.is_alive():
            return ERROR, _ended(self.worker.exitcode)
        return None

    def _agree(self, outcome: str, detail: str) -> tuple[str, list[str]]:
        """The worst outcome of all ranks, and what the failing ones said."""
        if self.store is None:
            return outcome, [f"rank 0: {detail}"] if detail else []
        self.store.set(self._key(f"rank{self.spec.rank}"), f"{outcome}\n{detail}")
        keys = [self._key(f"rank{r}") for r in range(self.spec.world_size)]
        self.store.wait(keys, datetime.timedelta(seconds=self.timeout_s))
        said = [self.store.get(key).decode().split("\n", 1) for key in keys]
        details = [f"rank {r}: {text}" for r, (what, text) in enumerate(said) if what == ERROR]
        return max((what for what, _ in said), key=WORST.index), details

    def _key(self, name: str) -> str:
        return f"maxbatch/search{self.search}/trial{self.trial}/{name}"


def _connect(spec: Spec) -> dist.TCPStore:
    assert spec.store is not None
    host, port = spec.store
    timeout = datetime.timedelta(seconds=spec.cfg.dist.timeout_s)
    return dist.TCPStore(host, port, is_master=False, timeout=timeout)


def _ended(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        why = {
            signal.SIGKILL: " (the host out of memory?)",
            signal.SIGTERM: " (the job cancelled, preempted or at its time limit?)",
        }.get(signal.Signals(-exitcode), "")
        return f"the worker process was ended by {signal.Signals(-exitcode).name}{why}"
    return f"the worker process ended with exit code {exitcode} before it answered"


# --- the worker ------------------------------------------------------------------------------


def _trial(spec: Spec, value: int) -> tuple[Config, int]:
    """A trial's settings and this rank's batch: at a global batch of `value`, or with
    task=largest_model a model.width of `value` at the run's global batch."""
    cfg = spec.cfg
    if cfg.task == Task.largest_model:
        cfg, value = _at_width(cfg, value), cfg.train.global_batch_size
    return cfg, value // spec.world_size


def _trial_words(cfg: Config, value: int) -> tuple[str, str]:
    """What is searched, and a trial's value, in words."""
    if cfg.task == Task.largest_model:
        return "model", f"model.width={value} at a global batch of {cfg.train.global_batch_size}"
    return "batch", f"a global batch of {value}"


def _work(spec: Spec, prefix: str, value: int, conn: Connection) -> None:
    """One trial on one rank: build the rank's process group, model and optimizer, run the steps
    (_trial says at what), answer, and wait to be ended (after a failure the other ranks may be
    waiting in a collective; after success they may still be finishing theirs)."""
    _end_with(spec.job_pid)
    torch.set_num_threads(spec.threads)
    try:
        cfg, batch = _trial(spec, value)
        step, inputs = _build(spec, cfg, prefix)
        _steps(step, inputs, batch, torch.device(spec.device), spec.gpus)
        answer = (FITS, "")
    except BaseException as err:  # every failure is an answer: the job process decides
        answer = (OOM if out_of_memory(err) else ERROR, _describe(err))
    with contextlib.suppress(OSError, EOFError):  # the job process may be gone
        conn.send(answer)
        conn.recv()


def _build(spec: Spec, cfg: Config, prefix: str) -> tuple[steps.EagerStep, Callable[[int], Any]]:
    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if spec.store is not None:
        store = dist.PrefixStore(prefix, _connect(spec))
        dist.init_process_group(
            backend=spec.backend,
            store=store,
            rank=spec.rank,
            world_size=spec.world_size,
            timeout=datetime.timedelta(seconds=cfg.dist.timeout_s),
        )
    torch.manual_seed(cfg.train.seed)
    with workloads.init_device(cfg, device):
        model = workloads.build_model(cfg, spec.shape, spec.classes)
    wrapped, optimizer = workloads.prepare(cfg, model, device, spec.gpus)
    scaler = torch.amp.GradScaler(enabled=cfg.train.precision == Precision.fp16)
    cast = steps.autocast(device, cfg.train.precision.value)
    step = steps.EagerStep(wrapped, optimizer, scaler, 1, cast, cfg.train.channels_last)

    def inputs(size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return workloads.random_batch(cfg, spec.shape, spec.classes, size, device)

    return step, inputs


def _steps(
    step: steps.EagerStep,
    inputs: Callable[[int], Any],
    batch: int,
    device: torch.device,
    gpus: int,
) -> None:
    x, y = inputs(batch)
    for _ in range(STEPS_PER_TRIAL):
        step.micro(x, y, last=True)
        step.update()
    if device.type == "cuda":  # an error of an asynchronous kernel surfaces here
        for index in range(gpus) if gpus > 1 else [device.index]:
            torch.cuda.synchronize(index)


def out_of_memory(err: BaseException) -> bool:
    """PyTorch's allocator, a kernel, cuBLAS or NCCL failing to allocate device memory."""
    text = str(err).lower()
    return isinstance(err, torch.OutOfMemoryError) or any(
        words in text for words in ("out of memory", "cublas_status_alloc_failed")
    )


def _describe(err: BaseException) -> str:
    where = traceback.extract_tb(err.__traceback__)[-1:] if err.__traceback__ else []
    at = f" (at {where[0].filename}:{where[0].lineno})" if where else ""
    return f"{type(err).__name__}: {str(err)[:500]}{at}"


def _end_with(job_pid: int) -> None:
    """End this worker when the job process is gone, even killed outright (no handler ran, and
    the worker is the fork server's child, not the job process's): a watch every second."""

    def watch() -> None:
        while processes.alive(job_pid):
            time.sleep(1)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="job-watch").start()


WIDTH_CEILING = 1 << 16  # model.width's largest setting


def run(ctx: Context, started: float) -> dict[str, Any]:
    """The largest-batch (or largest-model) job: no data, no epochs; real steps at growing batch
    sizes (widths), GPU only."""
    cfg, env = ctx.cfg, ctx.env
    shape, classes, _ = workloads.shape(cfg, env.local_rank, barrier)
    if cfg.task == Task.largest_model:
        ctx.parameters = _parameters(cfg, shape, classes, cfg.model.width)
    else:  # on the CPU (a user's model may not build on the meta device): the workers build theirs
        ctx.parameters = sum(
            p.numel() for p in workloads.build_model(cfg, shape, classes).parameters()
        )
    # The backend the trial steps use (this process joins the others over gloo).
    backend = dist_backend(cfg) if strategies.of(cfg).per_gpu else "none"
    ctx.metrics.write(
        "start",
        **(start_record(ctx, 0, 0) | {"backend": backend}),
        **workload_record(ctx, shape, classes),
        startup_s=time.time() - started,
    )
    largest: int | None = None  # on CPU: not measured (host memory is not the question)
    trials: list[dict[str, Any]] = []
    if ctx.device.type == "cuda":
        store = (env.master_addr, env.master_port) if strategies.of(cfg).per_gpu else None
        spec = Spec(
            cfg, env.rank, env.world_size, str(ctx.device), ctx.gpus, shape, classes,
            torch.get_num_threads(), store, backend,
        )  # fmt: skip
        fits = Trials(spec)
        if cfg.task == Task.largest_model:  # widths that split over the heads
            largest, trials = search(fits, cfg.model.width, cfg.model.heads, WIDTH_CEILING, "width")
        else:
            largest, trials = search(fits, cfg.train.global_batch_size, env.world_size)
    if cfg.task == Task.largest_model:
        found = {
            "largest_width": largest,
            "largest_model_parameters": largest and _parameters(cfg, shape, classes, largest),
            "global_batch": cfg.train.global_batch_size,
            "ceiling": WIDTH_CEILING,  # a search that fits this stops there: a lower bound
        }
    else:
        found = {"largest_global_batch": largest, "ceiling": CEILING}
    return ctx.metrics.write(
        "summary",
        **found,
        tolerance=TOLERANCE,
        trials=trials,
        total_seconds=time.time() - started,
        gpus=[],
    )


def _parameters(cfg: Config, shape: tuple[int, ...], classes: int, width: int) -> int:
    """The parameters of the model at `width`, counted on the meta device (nothing allocated)."""
    with torch.device("meta"):
        model = workloads.build_model(_at_width(cfg, width), shape, classes)
    return sum(p.numel() for p in model.parameters())


def _at_width(cfg: Config, width: int) -> Config:
    """The settings with model.width set to `width`."""
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, width=width))
