"""What runs inside a job: the distributed prologue, data, model wrapping, the loop and its records.

One loop serves every strategy. Strategies differ in two places only: how the model and its
optimizer are wrapped and saved (`train.strategies`) and how many processes share the data (the
sampler's replicas = the job's world size: one process for DP, one per GPU for the others).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import itertools
import logging
import os
import platform
import signal
import socket
import time
import traceback
import typing
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DistributedSampler, TensorDataset

from train import distenv, loaders, resume, runfolder, steps, workloads
from train.config import (
    Config,
    Mode,
    Precision,
    Task,
    check_hardware,
    cpus_per_task,
    per_gpu,
    per_rank_batch,
    world_size,
)
from train.errors import KitError, setup_logging
from train.gpustats import GpuSampler
from train.strategies import STRATEGIES, bare, prepare
from train.timing import StepClock, process_start_time

log = logging.getLogger("train")


class LaunchError(KitError):
    """The processes of the job do not match its config; the message names the fix."""


class Stopped(LaunchError):
    """The job stopped early on purpose (a signal, a cancel) after saving what it could."""


@dataclass
class Context:
    cfg: Config
    env: distenv.DistEnv
    device: torch.device
    gpus: int  # GPUs this process drives (DP: all of the node's; DDP: one; CPU: 0)
    run_dir: Path
    metrics: runfolder.RecordWriter
    stops: resume.StopSignals  # caught from the job's start, acted on at a step boundary
    # Where start-up went: seconds per phase, in order (written with the start record).
    startup: dict[str, float] = dataclasses.field(default_factory=dict)
    last_mark: float = dataclasses.field(default_factory=time.time)
    parameters: int = 0  # the model's, whole

    def lap(self, phase: str) -> None:
        now = time.time()
        self.startup[phase] = round(now - self.last_mark, 3)
        self.last_mark = now


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
        setup_logging()


def run_array_element(run_dir: str) -> dict[str, Any] | None:
    """Entry point of a sweep's array element.

    An array gives all its elements the same tasks per node (the DDP count); a DP element trains
    in task 0 alone and the other tasks end at once.
    """
    cfg, env, started = _prologue(run_dir)
    if cfg.mode == Mode.dp and env.world_size > 1:
        if env.rank != 0:
            return None
        env = dataclasses.replace(env, world_size=1, local_world_size=1)
    return _run(cfg, env, Path(run_dir), started)


def _run(cfg: Config, env: distenv.DistEnv, run_dir: Path, started: float) -> dict[str, Any]:
    try:
        check_launch(cfg, env)
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        check_hardware(cfg, visible, env.local_world_size)
        entered = time.time()  # interpreter, imports and the config are behind us
        ctx = _setup(cfg, env, run_dir, resume.StopSignals())
        ctx.startup["python_and_imports"] = round(entered - started, 3)
        ctx.last_mark = entered
        ctx.lap("process_group")
        return _largest_batch(ctx, started) if cfg.task == "largest_batch" else _train(ctx, started)
    except Stopped:
        raise
    except BaseException as err:  # named in the run folder, so status can say which rank failed
        _record_failure(run_dir, env.rank, err)
        if os.environ.get("SUBMITIT_EXECUTOR") == "local" and env.world_size > 1:
            _end_silent_peers(run_dir, env.rank)
        raise
    finally:
        resume.ignore_stop_signals()  # the work is done or given up: a late warning changes nothing
        if dist.is_initialized():
            dist.destroy_process_group()


def _record_failure(run_dir: Path, rank: int, err: BaseException) -> None:
    """An `error` record naming this rank, unless the run is being cancelled: then the signal's
    exception is no failure, and nothing is written after the cancel."""
    lines = traceback.format_exception(type(err), err, err.__traceback__)
    with contextlib.suppress(OSError, KitError):
        if runfolder.read_meta(run_dir).get("cancel_requested"):
            return
    with contextlib.suppress(OSError):
        runfolder.RecordWriter(run_dir, rank).write(
            "error",
            host=socket.gethostname(),
            node=os.environ.get("SLURMD_NODENAME", socket.gethostname()),
            error=f"{type(err).__name__}: {err}"[:2000],
            traceback_tail="".join(lines)[-3000:],
            kit_error=isinstance(err, KitError),  # its message names the fix: no trace needed
        )


STOP_CHECK_EVERY = 8  # optimizer steps between two questions about a stop signal
SILENT_GRACE_S = 5.0  # time for the other failing ranks to record their own errors


def _end_silent_peers(run_dir: Path, rank: int) -> None:
    """What `srun --kill-on-bad-exit` does on Slurm, for the local backend: after a failure, end
    this machine's ranks that went silent (stalled, say) rather than leave them to the time limit."""
    time.sleep(SILENT_GRACE_S)
    host = socket.gethostname()
    for other in runfolder.rank_files(run_dir):
        view = runfolder.read_rank(run_dir, other)
        starts = runfolder.of_kind(view, "start")
        if other == rank or not runfolder.went_silent(view) or starts[-1].get("host") != host:
            continue
        with contextlib.suppress(OSError, TypeError):
            os.kill(int(starts[-1]["pid"]), signal.SIGKILL)


def check_launch(cfg: Config, env: distenv.DistEnv, environ: dict[str, str] | None = None) -> None:
    """Refuse a job whose process count disagrees with the config, naming the fix."""
    environ = dict(os.environ) if environ is None else environ
    expected = world_size(cfg)
    if env.world_size == expected:
        return
    if env.source == "single" and int(environ.get("SLURM_NTASKS", "1")) > 1:
        raise LaunchError(
            f"this job has {environ['SLURM_NTASKS']} Slurm tasks but the script started python "
            "without srun, so only one process runs: start it as `srun python -m train run RUN_DIR`"
        )
    if cfg.mode == Mode.dp:
        raise LaunchError(
            f"DataParallel drives all GPUs from one process, but {env.world_size} were started: "
            "run one task (slurm/dp.sbatch, --ntasks-per-node=1) or use --mode ddp"
        )
    raise LaunchError(
        f"--mode {cfg.mode} expects cluster.nodes × cluster.gpus_per_node = {cfg.cluster.nodes} × "
        f"{cfg.cluster.gpus_per_node} = {expected} processes, but {env.world_size} were started: "
        f"start {expected} tasks (one per GPU) or set cluster.gpus_per_node to the GPUs per node"
    )


def _setup(cfg: Config, env: distenv.DistEnv, run_dir: Path, stops: resume.StopSignals) -> Context:
    device, gpus = _pick_device(cfg, env)
    torch.set_num_threads(_cpu_threads(cfg, env))
    torch.backends.cudnn.benchmark = cfg.train.cudnn_benchmark
    # The same initial weights everywhere (DDP broadcasts rank 0's anyway).
    torch.manual_seed(cfg.train.seed)
    # The largest-batch search runs its steps in worker processes: this one keeps off the GPUs
    # (no context, no communicator) and joins the others over gloo.
    searching = cfg.task == Task.largest_batch
    if per_gpu(cfg.mode):
        env.export()
        if device.type == "cuda" and not searching:
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend="gloo" if searching else _dist_backend(cfg),
            init_method="env://",
            timeout=datetime.timedelta(seconds=cfg.dist.timeout_s),
        )
        stops.join()
    return Context(
        cfg, env, device, gpus, run_dir, runfolder.RecordWriter(run_dir, env.rank), stops
    )


def _pick_device(cfg: Config, env: distenv.DistEnv) -> tuple[torch.device, int]:
    """This process's device and how many GPUs it drives (checked by check_hardware)."""
    if not torch.cuda.is_available():
        return torch.device("cpu"), 0
    if cfg.mode == Mode.dp:
        return torch.device("cuda", 0), cfg.cluster.gpus_per_node
    if torch.cuda.device_count() == 1:  # --gpus-per-task: Slurm shows each task its own GPU
        return torch.device("cuda", 0), 1
    return torch.device("cuda", env.local_rank), 1


def _cpu_threads(cfg: Config, env: distenv.DistEnv) -> int:
    """The CPUs the job asked for per task (Slurm's word, else the config's), never more than this
    machine's cores per task: N tasks oversubscribing shared cores run at half speed or worse."""
    asked = os.environ.get("SLURM_CPUS_PER_TASK", "")
    wanted = int(asked) if asked.isdigit() else cpus_per_task(cfg)
    return max(1, min(wanted, len(os.sched_getaffinity(0)) // env.local_world_size))


def _dist_backend(cfg: Config) -> str:
    if cfg.dist.backend != "auto":
        return cfg.dist.backend.value
    return "nccl" if torch.cuda.is_available() else "gloo"


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _model_and_optimizer(
    ctx: Context, shape: workloads.Shape, classes: int
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model, built for the data's shape and wrapped by the run's strategy; its optimizer."""
    model = workloads.build_model(ctx.cfg, shape, classes)
    ctx.parameters = sum(p.numel() for p in model.parameters())  # before a strategy shards them
    return prepare(ctx.cfg, model, ctx.device, ctx.gpus)


def _step(ctx: Context, model: nn.Module, optimizer: Any, scaler: Any) -> Any:
    t = ctx.cfg.train
    if t.cuda_graph:
        cast = steps.autocast(ctx.device, t.precision.value, cache=False)
        return steps.GraphStep(
            model, optimizer, per_rank_batch(ctx.cfg), t.grad_accum_steps, cast, t.channels_last,
            compile=t.compile_mode.value if t.compile else None,
        )  # fmt: skip
    cast = steps.autocast(ctx.device, t.precision.value)
    return steps.EagerStep(model, optimizer, scaler, t.grad_accum_steps, cast, t.channels_last)


def _train(ctx: Context, started: float) -> dict[str, Any]:
    cfg, env = ctx.cfg, ctx.env
    work = workloads.load(cfg, env.local_rank, _barrier)
    train_labels, test_labels = work.train[1], work.test[1]
    sampler: DistributedSampler[Any] = DistributedSampler(
        TensorDataset(train_labels), env.world_size, env.rank, shuffle=True, seed=cfg.train.seed
    )
    batches = _ResumeSampler(sampler)
    batch = per_rank_batch(cfg)
    loader = loaders.loader(work.train, batches, batch, ctx.device, cfg, work.normalise)
    strategy = STRATEGIES[cfg.mode]
    # Evaluation takes the training batch, so no phase needs more memory per card than training.
    test, shard = loaders.evaluation_shard(
        work.test, env.rank, env.world_size, even=strategy.even_evaluation
    )
    eval_batch = batch * cfg.train.grad_accum_steps
    test_loader = loaders.loader(test, shard, eval_batch, ctx.device, cfg, work.normalise)
    ctx.lap("data")
    model, optimizer = _model_and_optimizer(ctx, work.sample_shape, work.classes)
    scaler = torch.amp.GradScaler(enabled=cfg.train.precision == Precision.fp16)
    torch.manual_seed(cfg.train.seed + env.rank)  # different dropout masks per rank
    progress = _restore(ctx, model, optimizer, scaler)
    step = _step(ctx, model, optimizer, scaler)
    gpus = GpuSampler(_driven_gpus(ctx))
    ctx.lap("model_and_state")
    ctx.metrics.write(
        "start",
        **_start_record(ctx, len(train_labels), len(test_labels)),
        **_workload_record(ctx, work.sample_shape, work.classes),
        startup_s=time.time() - started,
        startup_parts=ctx.startup,
        first_epoch=progress.epoch,
        resumed_at_batch=progress.batches,
        restarts=resume.restarts(),
    )
    epochs: list[dict[str, Any]] = []
    while progress.epoch <= cfg.train.epochs:
        sampler.set_epoch(progress.epoch)  # a new shuffle each epoch, the same on every rank
        batches.skip = progress.batches * per_rank_batch(cfg)
        gpus.resume()
        figures, stop = _train_epoch(ctx, model, loader, step, progress)
        gpus.pause()
        if stop:
            return _stop(ctx, stop, progress, (model, optimizer, scaler))
        epochs.append(_end_epoch(ctx, model, test_loader, progress, figures))
        progress = resume.Progress(epoch=progress.epoch + 1)
        if cfg.train.checkpoint:
            resume.save(ctx.run_dir, cfg, model, optimizer, scaler, progress)
    gpus.close()
    return _summary(ctx, epochs, started, model, gpus)


class _ResumeSampler(torch.utils.data.Sampler[int]):
    """The distributed sampler's order, less the first `skip` indices: a resumed epoch goes on
    with exactly the batches that were left."""

    def __init__(self, sampler: DistributedSampler[Any]) -> None:
        self.sampler = sampler
        self.skip = 0

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(iter(self.sampler), self.skip, None)

    def __len__(self) -> int:
        return max(0, len(self.sampler) - self.skip)

    def as_tensor(self) -> torch.Tensor:
        return loaders.sampler_order(self.sampler)[self.skip :]


def _restore(ctx: Context, model: nn.Module, optimizer: Any, scaler: Any) -> resume.Progress:
    """Load the run's saved state where there is one: weights, optimizer, scaler, RNG, position."""
    if not ctx.cfg.train.checkpoint:
        return resume.Progress()
    state = resume.load(ctx.run_dir, ctx.cfg, ctx.env.rank, ctx.env.world_size)
    if state is None:
        return resume.Progress()
    STRATEGIES[ctx.cfg.mode].load(model, optimizer, state)
    scaler.load_state_dict(state["scaler"])
    resume.set_rng_state(state["mine"]["rng"])
    progress = resume.Progress(**state["mine"]["progress"])
    log.info(
        "rank %d resumes at epoch %d, batch %d", ctx.env.rank, progress.epoch, progress.batches
    )
    return progress


def _end_epoch(
    ctx: Context,
    model: nn.Module,
    test_loader: Iterable[loaders.Batch],
    progress: resume.Progress,
    figures: dict[str, Any],
) -> dict[str, Any]:
    """Evaluate, write the epoch's record and log it."""
    eval_start = time.perf_counter()
    scored = STRATEGIES[ctx.cfg.mode].scored(model)
    test_loss, accuracy = _evaluate(ctx, scored, test_loader)
    record = ctx.metrics.write(
        "epoch",
        epoch=progress.epoch,
        **figures,
        test_loss=test_loss,
        test_accuracy=accuracy,
        eval_seconds=time.perf_counter() - eval_start,
    )
    log.info(
        "rank %d epoch %d/%d: %s s, train loss %.4f, test accuracy %.2f%%",
        ctx.env.rank, progress.epoch, ctx.cfg.train.epochs, _seconds(record["seconds"]),
        record["train_loss"], 100 * accuracy,
    )  # fmt: skip
    return record


def _seconds(value: float | None) -> str:
    return "n/m (split across attempts)" if value is None else f"{value:.2f}"


def _stop(
    ctx: Context, reason: int, progress: resume.Progress, state: tuple[nn.Module, Any, Any]
) -> dict[str, Any]:
    """Stopped early by a signal, after the same step on every rank: save, then requeue."""
    cfg, words = ctx.cfg, resume.REASONS[reason]
    if runfolder.read_meta(ctx.run_dir).get("cancel_requested"):
        raise Stopped("cancelled by `launch cancel`: stopped without writing")
    if cfg.train.checkpoint:  # train.checkpoint=false: nothing is saved, a new attempt starts over
        resume.save(ctx.run_dir, cfg, *state, progress)
    where = f"epoch {progress.epoch}, batch {progress.batches}"
    job_id = resume.requeue_id() if os.environ.get("SUBMITIT_EXECUTOR") != "local" else None
    if job_id is None:
        _write_stop(ctx, reason, progress)
        raise Stopped(
            f"stopped by {words} at {where}, checkpoint saved: continue with "
            f"`python -m launch resume {ctx.run_dir}`"
        )
    if resume.restarts() >= cfg.cluster.max_requeues:
        return _out_of_requeues(ctx, reason, progress, where)
    if reason == resume.PREEMPTED:
        _leave_to_slurm_if_ending(ctx, reason, progress, job_id, where)
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
    resume.wait_for_slurm(600)  # Slurm ends this process as it requeues the job
    raise Stopped(f"job {job_id} was requeued but this process was not ended")


def _requeue(ctx: Context, job_id: str) -> str:
    """submitit's own checkpoint-and-requeue where submitit started the job, else `scontrol`."""
    if os.environ.get("SUBMITIT_EXECUTOR") == "slurm":
        return ctx.stops.requeue_through_submitit()
    return resume.request_requeue(job_id)


def _leave_to_slurm_if_ending(
    ctx: Context, reason: int, progress: resume.Progress, job_id: str, where: str
) -> None:
    """SIGTERM comes from Slurm ending the job itself (`scancel`, `scontrol requeue`, preemption)
    or from elsewhere. Where Slurm is ending it, the kit only saves: Slurm requeues it or not (a
    requeue of a cancelled job would bring it back), and the saved state serves either way."""
    # Asked once, by rank 0, and shared: every rank then acts alike, and a large job does not
    # send Slurm's controller one query per rank while it is preempting.
    state = ctx.stops.from_main(resume.slurm_state(job_id) if ctx.env.is_main else "")
    if state in ("", "RUNNING"):
        return
    _write_stop(ctx, reason, progress, requeue=None, slurm_state=state)
    log.info("rank %d: SIGTERM at %s, saved; Slurm is ending job %s (%s)", ctx.env.rank, where,
             job_id, state)  # fmt: skip
    resume.wait_for_slurm(600)
    raise Stopped(f"stopped by SIGTERM at {where}, saved; Slurm ended job {job_id} ({state})")


def _write_stop(ctx: Context, reason: int, progress: resume.Progress, **more: Any) -> None:
    ctx.metrics.write(
        "stop",
        reason=resume.REASONS[reason],
        epoch=progress.epoch,
        batches=progress.batches,
        **more,
    )


def _out_of_requeues(
    ctx: Context, reason: int, progress: resume.Progress, where: str
) -> dict[str, Any]:
    limit = ctx.cfg.cluster.max_requeues
    _write_stop(ctx, reason, progress, requeue=None, requeues_used=resume.restarts())
    message = (
        f"stopped by {resume.REASONS[reason]} at {where}, saved; not requeued: the job was "
        f"already requeued {resume.restarts()} time(s), cluster.max_requeues={limit}. Continue "
        f"with `python -m launch resume {ctx.run_dir}`"
    )
    log.warning("rank %d: %s", ctx.env.rank, message)
    if reason == resume.TIME_LIMIT:
        resume.wait_for_slurm(24 * 3600)  # Slurm ends the job at its limit: TIMEOUT
    raise Stopped(message)


def _largest_batch(ctx: Context, started: float) -> dict[str, Any]:
    """The largest-batch job: no data, no epochs; real steps at growing batch sizes (GPU only)."""
    from train import maxbatch

    cfg, env = ctx.cfg, ctx.env
    shape, classes = workloads.shape(cfg, env.local_rank, _barrier)
    model = workloads.build_model(cfg, shape, classes)  # on the CPU: the workers build their own
    ctx.parameters = sum(p.numel() for p in model.parameters())
    del model
    # The backend the trial steps use (this process joins the others over gloo).
    backend = _dist_backend(cfg) if per_gpu(cfg.mode) else "none"
    ctx.metrics.write(
        "start",
        **(_start_record(ctx, 0, 0) | {"backend": backend}),
        **_workload_record(ctx, shape, classes),
        startup_s=time.time() - started,
    )
    largest: int | None = None  # on CPU: not measured (host memory is not the question)
    trials: list[dict[str, Any]] = []
    if ctx.device.type == "cuda":
        store = (env.master_addr, env.master_port) if per_gpu(cfg.mode) else None
        spec = maxbatch.Spec(
            cfg, env.rank, env.world_size, str(ctx.device), ctx.gpus, shape, classes,
            torch.get_num_threads(), store, backend,
        )  # fmt: skip
        fits = maxbatch.Trials(spec)
        largest, trials = maxbatch.search(fits, cfg.train.global_batch_size, env.world_size)
    return ctx.metrics.write(
        "summary",
        largest_global_batch=largest,
        tolerance=maxbatch.TOLERANCE,
        ceiling=maxbatch.CEILING,  # a search that fits this stops there: a lower bound
        trials=trials,
        total_seconds=time.time() - started,
        gpus=[],
    )


def _train_epoch(
    ctx: Context,
    model: nn.Module,
    loader: loaders.Loader,
    step: steps.EagerStep | steps.GraphStep,
    progress: resume.Progress,
) -> tuple[dict[str, Any], int]:
    """This rank's shard of the epoch from `progress.batches` on: its time, samples, mean loss
    and step-time percentiles, and the stop reason all ranks agreed on (0: ran to the end).

    `progress` is kept current at every optimizer step, so a stop can save it as it stands.
    """
    model.train()
    accum = ctx.cfg.train.grad_accum_steps
    total = progress.batches + len(loader)
    resumed = progress.batches > 0
    loss_sum = torch.zeros((), device=ctx.device) + progress.loss_sum
    samples = progress.samples
    clock = StepClock(ctx.device)
    _synchronize(ctx)
    start = time.perf_counter()
    for number, (x, y) in enumerate(loader, start=progress.batches + 1):
        clock.mark()
        x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
        last_micro = number % accum == 0 or number == total
        loss_sum.add_(step.micro(x, y, last_micro), alpha=len(y))
        samples += len(y)
        if last_micro:
            step.update()
            # All ranks ask at the same steps; every few steps keeps the host's share small.
            ask = (number // accum) % STOP_CHECK_EVERY == 0 or number == total
            stop = ctx.stops.agreed() if ask else resume.NONE
            if stop:
                progress.batches, progress.loss_sum, progress.samples = (
                    number,
                    loss_sum.item(),
                    samples,
                )
                return {}, stop
    clock.mark()
    _synchronize(ctx)  # the clock stops when the GPU work is done, not when it is queued
    seconds = None if resumed else time.perf_counter() - start  # a split epoch has no one time
    return {
        "seconds": seconds,
        "samples": samples,
        "samples_per_s": samples / seconds if seconds else None,
        "train_loss": loss_sum.item() / max(samples, 1),
        "resumed_at_batch": progress.batches if resumed else None,
        **clock.percentiles(),
    }, resume.NONE


def _driven_gpus(ctx: Context) -> list[int]:
    if ctx.device.type != "cuda":
        return []
    return (
        list(range(ctx.gpus)) if ctx.cfg.mode == Mode.dp else [typing.cast(int, ctx.device.index)]
    )


@torch.no_grad()
def _evaluate(
    ctx: Context, model: nn.Module, loader: Iterable[loaders.Batch]
) -> tuple[float, float]:
    """Loss and accuracy over the whole test split: each rank scores its shard, then all sum.
    A padding sample (label -1, see `loaders.evaluation_shard`) counts nowhere."""
    model.eval()
    totals = torch.zeros(3, device=ctx.device, dtype=torch.float64)
    cast = steps.autocast(ctx.device, ctx.cfg.train.precision.value)
    for x, y in loader:
        x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
        with cast():
            logits = model(x)
        totals[0] += F.cross_entropy(logits.float(), y, reduction="sum", ignore_index=-1)
        totals[1] += (logits.argmax(1) == y).sum()
        totals[2] += (y >= 0).sum()
    if dist.is_initialized():
        dist.all_reduce(totals)
    loss, correct, count = totals.tolist()
    return loss / count, correct / count


def _synchronize(ctx: Context) -> None:
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)


def _start_record(ctx: Context, train_samples: int, test_samples: int) -> dict[str, Any]:
    cfg, env = ctx.cfg, ctx.env
    cuda = ctx.device.type == "cuda"
    return {
        **env.as_dict(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        # Slurm's node name: emulated nodes (and containers) can share one hostname.
        "node": os.environ.get("SLURMD_NODENAME", socket.gethostname()),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "mode": cfg.mode,
        "backend": dist.get_backend() if dist.is_initialized() else "none",
        "device": str(ctx.device),
        "device_name": torch.cuda.get_device_name(ctx.device) if cuda else _cpu_name(),
        "gpu_count": ctx.gpus,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "per_rank_batch": per_rank_batch(cfg),
        "global_batch": cfg.train.global_batch_size,
        "epochs": cfg.train.epochs,
        "task": cfg.task,
        "precision": cfg.train.precision,
        "dataset": cfg.data.dataset,
        "train_samples": train_samples,
        "test_samples": test_samples,
    }


def _workload_record(ctx: Context, shape: workloads.Shape, classes: int) -> dict[str, Any]:
    return {"sample_shape": list(shape), "classes": classes, "parameters": ctx.parameters}


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"CPU {line.split(':', 1)[1].strip()}"
    return f"CPU {platform.processor() or platform.machine()}"


def _parameters(ctx: Context, model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole parameters (gathered where sharded: a collective every rank joins), without the
    buffers: BatchNorm's running statistics are each rank's own under DDP and FSDP."""
    names = {name for name, _ in bare(model).named_parameters()}
    weights = STRATEGIES[ctx.cfg.mode].model_state(model)
    return {name: tensor for name, tensor in weights.items() if name in names}


def parameters_sha256(weights: dict[str, torch.Tensor]) -> str:
    """A fingerprint of the weights: DDP replicas that stayed in sync have the same one."""
    digest = hashlib.sha256()
    for name, tensor in sorted(weights.items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _summary(
    ctx: Context,
    epochs: list[dict[str, Any]],
    started: float,
    model: nn.Module,
    gpus: GpuSampler,
) -> dict[str, Any]:
    """The run's end: over every attempt, each epoch once (earlier attempts from the run folder)."""
    done = runfolder.of_kind(runfolder.read_rank(ctx.run_dir, ctx.env.rank), "epoch")
    last = done[-1]
    checkpoint = runfolder.CHECKPOINT if ctx.env.is_main and ctx.cfg.train.checkpoint else None
    return ctx.metrics.write(
        "summary",
        epochs=len(done),
        train_seconds=sum(e["seconds"] or 0.0 for e in done),  # the measured parts
        total_seconds=time.time() - started,
        final_test_loss=last["test_loss"],
        final_test_accuracy=last["test_accuracy"],
        checkpoint=checkpoint,
        parameters_sha256=parameters_sha256(_parameters(ctx, model)),
        gpus=gpus.figures(),  # one entry per GPU this process drove; empty on CPU
    )
