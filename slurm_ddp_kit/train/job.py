"""A job's life in each of its processes: start, place in the job, process group, then training
(`train.loop`) or the largest-batch search, and a failure recorded under the rank that failed.

One loop serves every strategy. Strategies differ in two places only: how the model and its
optimizer are wrapped and saved (`core.strategies`) and how many processes share the data (the
sampler's replicas = the job's world size: one process for DP, one per GPU for the others).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
import signal
import socket
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from slurm_ddp_kit.core import placement, processes, runfolder, strategies, submitted
from slurm_ddp_kit.core.cli import VERBOSE, setup_logging
from slurm_ddp_kit.core.errors import KitError
from slurm_ddp_kit.core.settings.rules import check_hardware, cpus_per_task
from slurm_ddp_kit.core.settings.schema import Config, Task
from slurm_ddp_kit.train import distenv, early, loop, stopping, stopsignals
from slurm_ddp_kit.train.distenv import check_launch
from slurm_ddp_kit.train.process import Context, Stopped, dist_backend
from slurm_ddp_kit.train.timing import process_start_time

log = logging.getLogger("train")


def run(run_dir: str) -> dict[str, Any]:
    """Entry point submitted by `launch submit` (and called by `python -m train run`)."""
    cfg, env, started = _prologue(run_dir)
    return _run(cfg, env, Path(run_dir), started)


def _prologue(run_dir: str) -> tuple[Config, distenv.DistEnv, float]:
    """What every entry point does first: note the start, log live, read the config and the
    process's place in the job."""
    started = process_start_time()
    _log_to_stderr()
    cfg = runfolder.load_job_config(Path(run_dir))
    return cfg, distenv.detect(port=cfg.dist.port), started


def _log_to_stderr() -> None:
    """A job's progress lines reach its log as they happen (submitit calls `run` directly)."""
    if not logging.getLogger().handlers:
        setup_logging(int(os.environ.get(VERBOSE, "0") or 0))  # the launcher's -v, passed on


def run_array_element(run_dir: str) -> dict[str, Any] | None:
    """Entry point of a sweep's array element: an element's allocation is its own run's shape
    (`launch.sweep._arrays`), so it runs as any job does."""
    return run(run_dir)


class _StandStill:
    """The longest this process stood still: a thread that wakes every second sees the gap a
    SIGSTOP (or a frozen machine) leaves. A rank stopped dead and woken by Slurm to be ended
    then times out like the ranks that waited for it; its error record says it stood still."""

    def __init__(self) -> None:
        self.gaps, self.last = 0.0, time.monotonic()
        threading.Thread(target=self._tick, daemon=True, name="stand-still").start()

    def _tick(self) -> None:
        while True:
            time.sleep(1.0)
            now = time.monotonic()
            self.gaps, self.last = max(self.gaps, now - self.last - 1.0), now

    @property
    def longest(self) -> float:
        """Counting the gap the thread has not woken to see yet: a rank woken from a stop may
        write its error before the thread runs again (under load, it often does)."""
        return max(self.gaps, time.monotonic() - self.last - 1.0)


def _run(cfg: Config, env: distenv.DistEnv, run_dir: Path, started: float) -> dict[str, Any]:
    still = _StandStill()
    try:
        check_launch(cfg, env)
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        check_hardware(cfg, visible, env.local_world_size)
        entered = time.time()  # interpreter, imports and the config are behind us
        stops = stopsignals.StopSignals()
        stops.end_at_cancel(run_dir, env.rank)
        ctx = _setup(cfg, env, run_dir, stops, started, entered)
        stopping.arm(ctx)
        if cfg.task != Task.train:
            from slurm_ddp_kit.train import (
                largest_batch,
            )  # its worker machinery only where it searches

            return largest_batch.run(ctx, started)
        return loop.train(ctx, started)
    except Stopped:
        raise
    except BaseException as err:  # named in the run folder, so status can say which rank failed
        failed = _record_failure(run_dir, env.rank, err, still.longest)
        # A Ctrl-C or a cancel reached every task (the controller passes SIGINT to all).
        peers_told = isinstance(err, KeyboardInterrupt)
        local = submitted.by_local_executor()
        if failed and local and env.world_size > 1 and not peers_told:
            _end_silent_peers(run_dir, env.rank)
        raise
    finally:
        early.ignore()  # the work is done or given up: a late warning changes nothing
        if dist.is_initialized():
            dist.destroy_process_group()


def _record_failure(run_dir: Path, rank: int, err: BaseException, stood_still_s: float) -> bool:
    """An `error` record naming this rank, unless the run is being cancelled: then the signal's
    exception is no failure, and nothing is written after the cancel. True: a failure."""
    lines = traceback.format_exception(type(err), err, err.__traceback__)
    with contextlib.suppress(OSError, KitError):
        if runfolder.read_meta(run_dir).get("cancel_requested"):
            return False
    with contextlib.suppress(OSError):
        runfolder.RecordWriter(run_dir, rank).write(
            "error",
            host=socket.gethostname(),
            node=os.environ.get("SLURMD_NODENAME", socket.gethostname()),
            error=_interrupted_words(run_dir, err) or f"{type(err).__name__}: {err}"[:2000],
            traceback_tail="".join(lines)[-3000:],
            # Its message names the fix: no trace needed.
            kit_error=isinstance(err, KitError | early.Interrupted),
            stood_still_s=round(stood_still_s, 1),
        )
    return True


def _interrupted_words(run_dir: Path, err: BaseException) -> str:
    """A SIGINT's error, in words ('' for any other error). It starts as a KeyboardInterrupt's
    does: readers tell the cancel's own end by that (`launch.jobs.failure_line`)."""
    if not isinstance(err, early.Interrupted):
        return ""
    return (
        "KeyboardInterrupt: interrupted by SIGINT (a Ctrl-C, or a cancel, reached this rank); "
        f"`python -m launch resume {run_dir}` goes on from its last checkpoint"
    )


SILENT_GRACE_S = 5.0  # time for the other failing ranks to record their own errors


def _end_silent_peers(run_dir: Path, rank: int) -> None:
    """What `srun --kill-on-bad-exit` does on Slurm, for the local backend: after a failure, end
    the job's other tasks that have not ended of themselves in this attempt (stalled, or still
    starting: waiting for a store or a peer that will never come) rather than leave them to the
    time limit."""
    time.sleep(SILENT_GRACE_S)
    attempt = process_start_time() - 1.0  # the controller starts a local job's tasks together
    job = os.environ.get("SUBMITIT_LOCAL_JOB_ID", "")
    for other, pids in processes.local_tasks(job).items():
        records = runfolder.read_rank(run_dir, other)
        ended = [r for r in records if r.get("kind") in runfolder.ENDS and r["time"] >= attempt]
        if other == rank or ended:
            continue
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def _setup(
    cfg: Config,
    env: distenv.DistEnv,
    run_dir: Path,
    stops: stopsignals.StopSignals,
    started: float,
    entered: float,
) -> Context:
    """The run's context: its device (with the CUDA context made, a start-up part of its own)
    and, for a strategy of one process per GPU, the process group; the start-up parts so far
    (the process `started`, and `entered` the kit's code with its imports done)."""
    device, gpus = _pick_device(cfg, env)
    torch.set_num_threads(_cpu_threads(cfg, env))
    log.debug(
        "rank %d: %s (from %s), device %s driving %d GPU(s), %d CPU thread(s), "
        "CUDA_VISIBLE_DEVICES=%s, data under %s",
        env.rank, env, env.source, device, gpus, torch.get_num_threads(),
        os.environ.get("CUDA_VISIBLE_DEVICES", "unset"), cfg.data.root,
    )  # fmt: skip
    torch.backends.cudnn.benchmark = cfg.train.cudnn_benchmark
    # The same initial weights everywhere (DDP broadcasts rank 0's anyway).
    torch.manual_seed(cfg.train.seed)
    writer = runfolder.RecordWriter(run_dir, env.rank)
    imports = {"python_and_imports": round(entered - started, 3)}
    ctx = Context(cfg, env, device, gpus, run_dir, writer, stops, imports, last_mark=entered)
    # The largest-batch and largest-model searches run their steps in worker processes: this one
    # keeps off the GPUs (no context, no communicator) and joins the others over gloo.
    searching = cfg.task != Task.train
    dynamo = _import_dynamo_aside() if strategies.of(cfg).per_gpu and not searching else None
    if device.type == "cuda" and not searching:
        torch.cuda.set_device(device)
        torch.empty(0, device=device)  # the CUDA context, made here rather than by the data
        ctx.lap("cuda_context")
    if strategies.of(cfg).per_gpu:
        timeout = datetime.timedelta(seconds=cfg.dist.timeout_s)
        ctx.env, meet = _rendezvous(env, run_dir, timeout)
        ctx.env.export()
        log.debug(
            "rank %d: rendezvous at %s:%s, %d rank(s), timeout %d s",
            env.rank, env.master_addr, ctx.env.master_port, env.world_size, cfg.dist.timeout_s,
        )  # fmt: skip
        dist.init_process_group(
            backend="gloo" if searching else dist_backend(cfg), timeout=timeout, **meet
        )
        stops.join()
        if dist.get_backend() == "nccl":  # its communicator now, while torch._dynamo imports
            dist.all_reduce(torch.zeros(1, device=device))
    ctx.placement = _placement_problems(ctx, with_gpus=not searching)
    ctx.lap("process_group")
    if dynamo:  # its remainder counts with the model, as it did when DDP's constructor waited
        dynamo.join()
    early.resume_gc()  # the imports are done
    return ctx


def _import_dynamo_aside() -> threading.Thread:
    """`torch._dynamo`, which the constructors of DDP and FSDP import, is 0.8 s of Python on the
    GPU machine, most of a rank's start-up after `import torch`. Imported on a thread, it
    overlaps what this one waits on with the GIL let go: the GPU's driver, the other ranks at the
    rendezvous, NCCL making its communicator. The caller joins the thread before it imports
    anything more, so the two never import one module at once (a cycle of module locks across
    threads is an import error); an import that fails here fails again where it is needed."""

    def _import() -> None:
        with contextlib.suppress(Exception):
            import torch._dynamo  # noqa: F401

    thread = threading.Thread(target=_import, daemon=True, name="import-dynamo")
    thread.start()
    return thread


def _rendezvous(
    env: distenv.DistEnv, run_dir: Path, timeout: datetime.timedelta
) -> tuple[distenv.DistEnv, dict[str, Any]]:
    """How the process group meets, and the environment with the store's port: under Slurm and
    submitit (and for a process alone) a store served on master_addr by the first task there
    (`DistEnv.serves_store`), not by rank 0 wherever it runs; torchrun's through env://, as
    torchrun expects. A local job's store binds a port the system picks and publishes it in the
    run folder (a port derived from its process id could be a Slurm job's on this machine)."""
    if not env.kit_store:
        return env, {"init_method": "env://"}
    picked = env.master_port == distenv.PICK_PORT
    port = env.master_port
    if picked and not env.serves_store:
        port = _published_port(run_dir, env.job_id, timeout)
    try:  # multi_tenant: as env:// makes it (one port, several stores in a process: the search's)
        store = dist.TCPStore(
            env.master_addr, port, env.world_size, env.serves_store, timeout=timeout,
            multi_tenant=True, wait_for_workers=not picked,
        )  # fmt: skip
    except dist.DistNetworkError as err:
        if "EADDRINUSE" not in str(err) and "address already in use" not in str(err).lower():
            raise  # (the message of torch's libuv store, and of its older one)
        raise distenv.DistEnvError(
            f"port {port} on {socket.gethostname()} is taken (another job's rendezvous, or "
            "another program), so this job's processes cannot meet there: set dist.port to a "
            "free port in 20000-32767 (or, with dist.port=0, submit again: a new job id gives "
            "another port)"
        ) from None
    if picked:
        _meet_at_the_picked_port(store, env, run_dir, timeout)
    env = dataclasses.replace(env, master_port=store.port)
    return env, {"store": store, "rank": env.rank, "world_size": env.world_size}


def _meet_at_the_picked_port(
    store: dist.TCPStore, env: distenv.DistEnv, run_dir: Path, timeout: datetime.timedelta
) -> None:
    """The store publishes its port; each other process says it has come; once all have, the
    port is forgotten (a requeued attempt of the same job publishes anew, and no process can
    read a port from an attempt before). A process that never comes fails the job here."""
    if not env.serves_store:
        store.set(f"kit/joined/{env.rank}", "1")
        return
    runfolder.publish_store_port(run_dir, env.job_id, store.port)
    others = {rank: f"kit/joined/{rank}" for rank in range(env.world_size) if rank != env.rank}
    try:
        _wait_for_peers(store, others, run_dir, timeout)
    finally:
        runfolder.forget_store_port(run_dir, env.job_id)


def _wait_for_peers(
    store: dist.TCPStore, others: dict[int, str], run_dir: Path, timeout: datetime.timedelta
) -> None:
    """Wait until every other rank has come. Locally, a rank whose process is gone (killed while
    it started: it could write nothing) is named at once, in its own record, rather than after
    `timeout` in the words of the rank that waited (Slurm's srun names such a task itself)."""
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        left = max(deadline - time.monotonic(), 0.001)
        try:
            store.wait(list(others.values()), datetime.timedelta(seconds=min(left, 1.0)))
            return
        except dist.DistStoreError:
            missing = [rank for rank, key in others.items() if not store.check([key])]
        _check_not_gone(run_dir, missing)
        if time.monotonic() >= deadline:
            break
    raise distenv.DistEnvError(
        f"rank(s) {', '.join(map(str, missing))} did not come to the rendezvous within "
        f"{timeout.total_seconds():.0f} s: their logs say why (`python -m launch logs {run_dir} "
        f"--rank {missing[0] if missing else 1}`)"
    )


def _check_not_gone(run_dir: Path, waited_for: list[int]) -> None:
    """Raise, naming them, where ranks this one waits for are gone (locally)."""
    gone = _gone_before_rendezvous(run_dir, waited_for)
    if gone:
        raise distenv.DistEnvError(
            f"rank(s) {', '.join(map(str, gone))} ended while starting, before the rendezvous "
            f"(killed, or its interpreter failed): `python -m launch logs {run_dir} --rank "
            f"{gone[0]}`"
        )


def _gone_before_rendezvous(run_dir: Path, missing: list[int]) -> list[int]:
    """The missing ranks of this local job with no process left (none under Slurm, whose srun
    names such a task itself); each gets an error record of its own (it wrote none), so that it
    is the rank named as failed first."""
    if not submitted.by_local_executor() or not missing:
        return []
    running = processes.local_tasks(os.environ.get("SUBMITIT_LOCAL_JOB_ID", ""))
    gone = [rank for rank in missing if rank not in running]
    for rank in gone:
        with contextlib.suppress(OSError):
            runfolder.RecordWriter(run_dir, rank).write(
                "error",
                host=socket.gethostname(),
                node=socket.gethostname(),
                error="ended while starting, before the rendezvous, without a word (killed by a "
                "signal, or its interpreter failed: its log may say which)",
                recorded=False,
            )
    return gone


def _published_port(run_dir: Path, job_id: str, timeout: datetime.timedelta) -> int:
    """The port a local job's store published, waited for as long as a rendezvous may take, or
    until the process that serves it (rank 0) is seen to be gone."""
    deadline = time.monotonic() + timeout.total_seconds()
    look = time.monotonic() + 1.0
    while (port := runfolder.published_store_port(run_dir, job_id)) is None:
        if time.monotonic() > look:
            _check_not_gone(run_dir, [0])
            look += 1.0
        if time.monotonic() > deadline:
            raise distenv.DistEnvError(
                f"the job's first process published no rendezvous port within "
                f"{timeout.total_seconds():.0f} s: it did not start or failed first; its log "
                f"says why (`python -m launch logs {run_dir} --rank 0`)"
            )
        time.sleep(0.05)
    return port


def _pick_device(cfg: Config, env: distenv.DistEnv) -> tuple[torch.device, int]:
    """This process's device and how many GPUs it drives (checked by check_hardware)."""
    if not torch.cuda.is_available():
        return torch.device("cpu"), 0
    if not strategies.of(cfg).per_gpu:
        return torch.device("cuda", 0), cfg.cluster.gpus_per_node
    if torch.cuda.device_count() == 1:  # --gpus-per-task: Slurm shows each task its own GPU
        return torch.device("cuda", 0), 1
    return torch.device("cuda", env.local_rank), 1


def _cpu_threads(cfg: Config, env: distenv.DistEnv) -> int:
    """The CPUs the job asked for per task (Slurm's word, else the config's), never more than
    this process may use for itself: tasks oversubscribing shared cores run at half speed or worse."""
    wanted = placement.cpus_asked() or cpus_per_task(cfg)
    return max(1, min(wanted, placement.usable_cpus(env.local_world_size)))


def _place(ctx: Context, with_gpus: bool) -> placement.Place:
    """Where this rank runs: its CPUs, and the GPUs it drives by UUID (an index means nothing
    across ranks where Slurm shows each task its own GPUs from 0)."""
    gpus = []
    if ctx.device.type == "cuda" and with_gpus:  # a search's process keeps off the GPUs
        first = 0 if ctx.gpus > 1 else ctx.device.index or 0
        for index in range(first, first + max(ctx.gpus, 1)):
            gpus.append(str(torch.cuda.get_device_properties(index).uuid))
    return placement.Place(
        rank=ctx.env.rank,
        node=os.environ.get("SLURMD_NODENAME", socket.gethostname()),
        cpus=placement.affinity(),
        usable=placement.usable_cpus(ctx.env.local_world_size),
        asked=placement.cpus_asked(),
        gpus=gpus,
    )


def _placement_problems(ctx: Context, with_gpus: bool) -> str | None:
    """Rank 0's one line on every rank's place (None elsewhere, and where all is well): the
    ranks' places gathered over the process group, one small message each."""
    place = _place(ctx, with_gpus)
    ctx.place = place.as_dict()
    places = [place]
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, place)
        places = gathered
    return placement.problems(places) if ctx.env.is_main else None
