"""What runs inside a job: the distributed prologue, data, model wrapping, the loop and its records.

One loop serves every strategy. DP and DDP differ in two places only: how the model is wrapped
(`_wrap`) and how many processes share the data (the sampler's replicas = the job's world size).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import logging
import os
import platform
import socket
import time
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset

from train import data, distenv, runfolder
from train.config import (
    Config,
    Mode,
    Precision,
    check_hardware,
    cpus_per_task,
    per_rank_batch,
    world_size,
)
from train.errors import KitError, setup_logging
from train.gpustats import GpuSampler
from train.model import build
from train.timing import StepClock, process_start_time

log = logging.getLogger("train")


class LaunchError(KitError):
    """The processes of the job do not match its config; the message names the fix."""


@dataclass
class Context:
    cfg: Config
    env: distenv.DistEnv
    device: torch.device
    gpus: int  # GPUs this process drives (DP: all of the node's; DDP: one; CPU: 0)
    run_dir: Path
    metrics: runfolder.RecordWriter


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
    check_launch(cfg, env)
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    check_hardware(cfg, visible, env.local_world_size)
    ctx = _setup(cfg, env, run_dir)
    try:
        return _largest_batch(ctx, started) if cfg.task == "largest_batch" else _train(ctx, started)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


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
        f"DDP expects cluster.nodes × cluster.gpus_per_node = {cfg.cluster.nodes} × "
        f"{cfg.cluster.gpus_per_node} = {expected} processes, but {env.world_size} were started: "
        f"start {expected} tasks (one per GPU) or set cluster.gpus_per_node to the GPUs per node"
    )


def _setup(cfg: Config, env: distenv.DistEnv, run_dir: Path) -> Context:
    device, gpus = _pick_device(cfg, env)
    torch.set_num_threads(_cpu_threads(cfg, env))
    # The same initial weights everywhere (DDP broadcasts rank 0's anyway).
    torch.manual_seed(cfg.train.seed)
    if cfg.mode == Mode.ddp:
        env.export()
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend=_dist_backend(cfg),
            init_method="env://",
            timeout=datetime.timedelta(seconds=cfg.dist.timeout_s),
        )
    return Context(cfg, env, device, gpus, run_dir, runfolder.RecordWriter(run_dir, env.rank))


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


def _load_data(ctx: Context) -> tuple[TensorDataset, TensorDataset]:
    d, t = ctx.cfg.data, ctx.cfg.train
    folder = data.dataset_dir(d.dataset, d.root, t.seed, d.train_size, d.test_size)
    if d.dataset == "synthetic" and ctx.env.local_rank == 0:
        data.prepare_synthetic(folder, t.seed, d.train_size, d.test_size)
    if dist.is_initialized():
        dist.barrier()  # the other ranks of a node wait for its copy to be written
    return data.load_split(folder, d.dataset, train=True), data.load_split(
        folder, d.dataset, train=False
    )


def _wrap(ctx: Context, model: nn.Module) -> nn.Module:
    if ctx.cfg.mode == Mode.dp:  # without GPUs DataParallel runs the bare module
        return nn.DataParallel(model, device_ids=list(range(ctx.gpus)) or None)
    ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=ids)


def _model_and_optimizer(ctx: Context) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _wrap(ctx, build(ctx.cfg.model.name, ctx.cfg.model.dropout).to(ctx.device))
    t = ctx.cfg.train
    return model, torch.optim.SGD(model.parameters(), lr=t.lr, momentum=t.momentum)


def _train(ctx: Context, started: float) -> dict[str, Any]:
    cfg, env = ctx.cfg, ctx.env
    train_set, test_set = _load_data(ctx)
    sampler: DistributedSampler[Any] = DistributedSampler(
        train_set, env.world_size, env.rank, shuffle=True, seed=cfg.train.seed
    )
    loader = _loader(ctx, train_set, per_rank_batch(cfg), sampler)
    # Evaluation takes the training batch, so no phase needs more memory per card than training.
    test_shard = Subset(test_set, range(env.rank, len(test_set), env.world_size))
    test_loader = _loader(ctx, test_shard, per_rank_batch(cfg) * cfg.train.grad_accum_steps)
    model, optimizer = _model_and_optimizer(ctx)
    raw_model = typing.cast(nn.Module, model.module)  # the bare model inside DP/DDP
    scaler = torch.amp.GradScaler(enabled=cfg.train.precision == Precision.fp16)
    torch.manual_seed(cfg.train.seed + env.rank)  # different dropout masks per rank
    gpus = GpuSampler(_driven_gpus(ctx))
    ctx.metrics.write(
        "start",
        **_start_record(ctx, len(train_set), len(test_set)),
        startup_s=time.time() - started,
    )
    epochs: list[dict[str, Any]] = []
    for epoch in range(1, cfg.train.epochs + 1):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        gpus.resume()
        figures = _train_epoch(ctx, model, loader, optimizer, scaler)
        gpus.pause()
        eval_start = time.perf_counter()
        test_loss, accuracy = _evaluate(
            ctx, model if cfg.mode == Mode.dp else raw_model, test_loader
        )
        record = ctx.metrics.write(
            "epoch",
            epoch=epoch,
            **figures,
            test_loss=test_loss,
            test_accuracy=accuracy,
            eval_seconds=time.perf_counter() - eval_start,
        )
        epochs.append(record)
        log.info(
            "rank %d epoch %d/%d: %.2f s, train loss %.4f, test accuracy %.2f%%",
            env.rank, epoch, cfg.train.epochs, record["seconds"], record["train_loss"], 100 * accuracy,
        )  # fmt: skip
        if env.is_main and cfg.train.checkpoint:
            save_checkpoint(raw_model, runfolder.checkpoint_path(ctx.run_dir))
    gpus.close()
    return _summary(ctx, epochs, started, raw_model, gpus)


def _largest_batch(ctx: Context, started: float) -> dict[str, Any]:
    """The largest-batch job: no data, no epochs; real steps at growing batch sizes (GPU only)."""
    from train import maxbatch

    ctx.metrics.write("start", **_start_record(ctx, 0, 0), startup_s=time.time() - started)
    largest: int | None = None  # on CPU: not measured (host memory is not the question)
    trials: list[dict[str, Any]] = []
    if ctx.device.type == "cuda":
        model, optimizer = _model_and_optimizer(ctx)
        fits = maxbatch.make_trial(model, ctx.device, ctx.env.world_size, optimizer)
        largest, trials = maxbatch.search(
            fits, ctx.cfg.train.global_batch_size, unit=ctx.env.world_size
        )
    return ctx.metrics.write(
        "summary",
        largest_global_batch=largest,
        tolerance=maxbatch.TOLERANCE,
        trials=trials,
        total_seconds=time.time() - started,
        gpus=[],
    )


def _loader(ctx: Context, dataset: Any, batch: int, sampler: Any = None) -> DataLoader:
    workers = ctx.cfg.data.num_workers
    return DataLoader(
        dataset,
        batch_size=batch,
        sampler=sampler,
        num_workers=workers,
        pin_memory=ctx.cfg.data.pin_memory and ctx.device.type == "cuda",
        persistent_workers=workers > 0,
    )


def _autocast(ctx: Context) -> contextlib.AbstractContextManager[Any]:
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(ctx.cfg.train.precision.value)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(ctx.device.type, dtype=dtype)


def _train_epoch(
    ctx: Context, model: nn.Module, loader: DataLoader, optimizer: Any, scaler: Any
) -> dict[str, Any]:
    """One pass over this rank's shard: its time, samples, mean loss and step-time percentiles."""
    model.train()
    accum = ctx.cfg.train.grad_accum_steps
    loss_sum = torch.zeros((), device=ctx.device)
    samples = 0
    clock = StepClock(ctx.device)
    _synchronize(ctx)
    start = time.perf_counter()
    for step, (x, y) in enumerate(loader, start=1):
        clock.mark()
        x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
        last_micro = step % accum == 0 or step == len(loader)
        # DDP all-reduces gradients only on the last micro-step of an accumulation group.
        skip_sync = isinstance(model, nn.parallel.DistributedDataParallel) and not last_micro
        with model.no_sync() if skip_sync else contextlib.nullcontext():  # type: ignore[operator]
            with _autocast(ctx):
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss / accum).backward()
        if last_micro:
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
        loss_sum += loss.detach() * len(y)
        samples += len(y)
    clock.mark()
    _synchronize(ctx)  # the clock stops when the GPU work is done, not when it is queued
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "samples": samples,
        "samples_per_s": samples / seconds,
        "train_loss": loss_sum.item() / max(samples, 1),
        **clock.percentiles(),
    }


def _driven_gpus(ctx: Context) -> list[int]:
    if ctx.device.type != "cuda":
        return []
    return (
        list(range(ctx.gpus)) if ctx.cfg.mode == Mode.dp else [typing.cast(int, ctx.device.index)]
    )


@torch.no_grad()
def _evaluate(ctx: Context, model: nn.Module, loader: DataLoader) -> tuple[float, float]:
    """Loss and accuracy over the whole test split: each rank scores its shard, then all sum."""
    model.eval()
    totals = torch.zeros(3, device=ctx.device, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
        with _autocast(ctx):
            logits = model(x)
        totals[0] += F.cross_entropy(logits.float(), y, reduction="sum")
        totals[1] += (logits.argmax(1) == y).sum()
        totals[2] += len(y)
    if dist.is_initialized():
        dist.all_reduce(totals)
    loss, correct, count = totals.tolist()
    return loss / count, correct / count


def _synchronize(ctx: Context) -> None:
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)


def save_checkpoint(raw_model: nn.Module, path: Path) -> None:
    """Save the bare model's weights (no `module.` prefix) atomically: a crash leaves the old file."""
    with runfolder.atomic_file(path) as partial:
        torch.save(raw_model.state_dict(), partial)


def _start_record(ctx: Context, train_samples: int, test_samples: int) -> dict[str, Any]:
    cfg, env = ctx.cfg, ctx.env
    cuda = ctx.device.type == "cuda"
    return {
        **env.as_dict(),
        "host": socket.gethostname(),
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


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"CPU {line.split(':', 1)[1].strip()}"
    return f"CPU {platform.processor() or platform.machine()}"


def parameters_sha256(model: nn.Module) -> str:
    """A fingerprint of the weights: DDP replicas that stayed in sync have the same one."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _summary(
    ctx: Context,
    epochs: list[dict[str, Any]],
    started: float,
    raw_model: nn.Module,
    gpus: GpuSampler,
) -> dict[str, Any]:
    last = epochs[-1]
    checkpoint = runfolder.CHECKPOINT if ctx.env.is_main and ctx.cfg.train.checkpoint else None
    return ctx.metrics.write(
        "summary",
        epochs=len(epochs),
        train_seconds=sum(e["seconds"] for e in epochs),
        total_seconds=time.time() - started,
        final_test_loss=last["test_loss"],
        final_test_accuracy=last["test_accuracy"],
        checkpoint=checkpoint,
        parameters_sha256=parameters_sha256(raw_model),
        gpus=gpus.figures(),  # one entry per GPU this process drove; empty on CPU
    )
