"""The training loop, the same for every strategy: epochs of steps, evaluation, the records of
each epoch, a stop at a step boundary, and the run's summary."""

from __future__ import annotations

import hashlib
import itertools
import logging
import math
import time
import typing
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DistributedSampler, TensorDataset

from slurm_ddp_kit.core import runfolder, slurm, strategies
from slurm_ddp_kit.core.settings.rules import check_batch_fits_data, per_rank_batch
from slurm_ddp_kit.core.settings.schema import Precision
from slurm_ddp_kit.core.strategies import bare
from slurm_ddp_kit.train import checkpoint, compile_cache, loaders, steps, stopping, workloads
from slurm_ddp_kit.train.gpustats import GpuSampler
from slurm_ddp_kit.train.process import Context, barrier, start_record, workload_record
from slurm_ddp_kit.train.timing import StepClock

log = logging.getLogger("train")


def _model_and_optimizer(
    ctx: Context, shape: workloads.Shape, classes: int
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model, built for the data's shape and wrapped by the run's strategy; its optimizer."""
    with workloads.init_device(ctx.cfg, ctx.device):
        model = workloads.build_model(ctx.cfg, shape, classes)
    ctx.parameters = sum(p.numel() for p in model.parameters())  # before a strategy shards them
    return workloads.prepare(ctx.cfg, model, ctx.device, ctx.gpus)


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


def train(ctx: Context, started: float) -> dict[str, Any]:
    cfg, env = ctx.cfg, ctx.env
    # The model first, compiled and captured on a random batch where the settings ask for it;
    # then the data (MLPerf's order: the clock of "time to accuracy from data" starts there).
    sample_shape, classes, work = workloads.shape(cfg, env.local_rank, barrier)
    sizes_known = work is None  # the settings tell the shape and the splits' sizes
    model, optimizer = _model_and_optimizer(ctx, sample_shape, classes)
    scaler = torch.amp.GradScaler(enabled=cfg.train.precision == Precision.fp16)
    torch.manual_seed(cfg.train.seed + env.rank)  # different dropout masks per rank
    progress = _restore(ctx, model, optimizer, scaler)
    # Where a stop's progress counts from: an attempt that saves nothing new is not requeued.
    ctx.stops.resumed_from = (progress.epoch, progress.batches)
    cache = compile_cache.path_for(cfg, ctx.device)
    cache_state = compile_cache.load(cache) if cache else None  # before the first compile
    step = _step(ctx, model, optimizer, scaler)
    gpus = GpuSampler(_driven_gpus(ctx))
    ctx.lap("model_and_state")
    # Saved where every batch size has compiled: after the warm-up, where the settings tell the
    # splits' sizes (a stopped or requeued attempt then leaves it for the next), else after the
    # first epoch.
    save_cache_after = 0 if sizes_known else 1  # epochs
    if cfg.train.compile or cfg.train.cuda_graph:
        _warm_up(ctx, model, step, sample_shape, classes, sizes_known=sizes_known)
        if cache and cache_state == "cold" and not save_cache_after:
            compile_cache.save(cache)
        ctx.lap("warm_up")
    data_touched = time.time()
    work = work or workloads.load(cfg, env.local_rank, barrier)
    train_labels, test_labels = work.train[1], work.test[1]
    check_batch_fits_data(cfg, len(train_labels))  # a user's dataset may differ from its trial
    sampler: DistributedSampler[Any] = DistributedSampler(
        TensorDataset(train_labels), env.world_size, env.rank, shuffle=True, seed=cfg.train.seed
    )
    batches = _ResumeSampler(sampler)
    batch = per_rank_batch(cfg)
    loader = loaders.loader(work.train, batches, batch, ctx.device, cfg, work.normalise)
    strategy = strategies.of(cfg)
    # Evaluation takes the training batch, so no phase needs more memory per card than training.
    test, shard = loaders.evaluation_shard(
        work.test, env.rank, env.world_size, even=strategy.even_evaluation
    )
    eval_batch = batch * cfg.train.grad_accum_steps
    test_loader = loaders.loader(test, shard, eval_batch, ctx.device, cfg, work.normalise)
    ctx.lap("data")
    ctx.metrics.write(
        "start",
        **start_record(ctx, len(train_labels), len(test_labels)),
        **workload_record(ctx, work.sample_shape, work.classes),
        startup_s=time.time() - started,
        startup_parts=ctx.startup,
        first_epoch=progress.epoch,
        resumed_at_batch=progress.batches,
        restarts=slurm.restarts(),
        compile_cache=cache_state,
        data_touched=data_touched,
    )
    epochs: list[dict[str, Any]] = []
    while progress.epoch <= cfg.train.epochs:
        sampler.set_epoch(progress.epoch)  # a new shuffle each epoch, the same on every rank
        batches.skip = progress.batches * per_rank_batch(cfg)
        gpus.resume()
        figures, stop = _train_epoch(ctx, model, loader, step, progress)
        gpus.pause()
        figures["energy_j"] = gpus.phase_j if figures.get("seconds") else None
        if stop:
            return stopping.stop(ctx, stop, progress, (model, optimizer, scaler))
        epochs.append(_end_epoch(ctx, model, test_loader, progress, figures))
        if cache and cache_state == "cold" and len(epochs) == save_cache_after:
            compile_cache.save(cache)
        if not math.isfinite(epochs[-1]["test_loss"]):  # scored alike on every rank: all end here
            # Diverged: nothing more to learn, and the last sound checkpoint is kept, not this.
            gpus.close()
            return _summary(ctx, epochs, started, model, gpus, diverged=progress.epoch)
        progress = checkpoint.Progress(epoch=progress.epoch + 1)
        if cfg.train.checkpoint:
            checkpoint.save(ctx.run_dir, cfg, model, optimizer, scaler, progress)
        # A signal during the evaluation is acted on now, before the next epoch starts.
        if progress.epoch <= cfg.train.epochs and (stop := stopping.due(ctx)):
            state = (model, optimizer, scaler)
            return stopping.stop(ctx, stop, progress, state, saved=cfg.train.checkpoint)
    gpus.close()
    return _summary(ctx, epochs, started, model, gpus)


def _warm_up(
    ctx: Context,
    model: nn.Module,
    step: Any,
    shape: workloads.Shape,
    classes: int,
    sizes_known: bool,
) -> None:
    """Compile and capture before the data is touched (steps.warm_up), for the batch sizes the
    run will meet: the full one, and each split's last where the settings tell the splits'
    sizes (`sizes_known`; a user's dataset: only the full one, its last batch then compiles in
    the first epoch)."""
    cfg, env = ctx.cfg, ctx.env
    batch = per_rank_batch(cfg)
    eval_batch = batch * cfg.train.grad_accum_steps
    training, scoring = [batch], [eval_batch]
    if sizes_known:
        world, even = env.world_size, strategies.of(cfg).even_evaluation
        per_rank = -(-cfg.data.train_size // world)  # DistributedSampler pads to equal shares
        shard = loaders.shard_size(cfg.data.test_size, env.rank, world, even)
        training += [per_rank % batch] if per_rank % batch else []
        scoring += [shard % eval_batch] if shard % eval_batch else []
    largest = max(batch, eval_batch)
    sample = workloads.random_batch(cfg, shape, classes, largest, ctx.device)
    scored = strategies.of(cfg).scored(model)
    cast = steps.autocast(ctx.device, cfg.train.precision.value)
    steps.warm_up(step, model, scored, sample, cast, (training, scoring))
    _synchronize(ctx)


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


def _restore(ctx: Context, model: nn.Module, optimizer: Any, scaler: Any) -> checkpoint.Progress:
    """Load the run's saved state where there is one: weights, optimizer, scaler, RNG, position."""
    if not ctx.cfg.train.checkpoint:
        return checkpoint.Progress()
    state = checkpoint.load(ctx.run_dir, ctx.cfg, ctx.env.rank, ctx.env.world_size)
    if state is None:
        return checkpoint.Progress()
    with checkpoint.applying(runfolder.state_path(ctx.run_dir)):
        strategies.of(ctx.cfg).load(model, optimizer, state)
        scaler.load_state_dict(state["scaler"])
        checkpoint.set_rng_state(state["mine"]["rng"])
    progress = checkpoint.Progress(**state["mine"]["progress"])  # its fields checked by `load`
    log.info(
        "rank %d resumes at epoch %d, batch %d", ctx.env.rank, progress.epoch, progress.batches
    )
    return progress


def _end_epoch(
    ctx: Context,
    model: nn.Module,
    test_loader: Iterable[loaders.Batch],
    progress: checkpoint.Progress,
    figures: dict[str, Any],
) -> dict[str, Any]:
    """Evaluate, write the epoch's record and log it."""
    eval_start = time.perf_counter()
    scored = strategies.of(ctx.cfg).scored(model)
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


def _train_epoch(
    ctx: Context,
    model: nn.Module,
    loader: loaders.Loader,
    step: steps.EagerStep | steps.GraphStep,
    progress: checkpoint.Progress,
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
    report = _Progress(ctx, progress.epoch, total, start)
    since_ask = 0  # optimizer steps since the last ask about a stop
    for number, (x, y) in enumerate(loader, start=progress.batches + 1):
        clock.mark()
        x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
        last_micro = number % accum == 0 or number == total
        loss_sum.add_(step.micro(x, y, last_micro), alpha=len(y))
        samples += len(y)
        if last_micro:
            step.update()
            report.at(number)
            # All ranks ask at the same steps (ctx.stops.every, agreed at each ask): fast steps
            # share one ask, keeping the host's share small; a slow step asks at its end.
            since_ask += 1
            ask = since_ask >= ctx.stops.every or number == total
            stop = stopping.due(ctx, since_ask) if ask else stopping.NONE
            since_ask = 0 if ask else since_ask
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
    }, stopping.NONE


class _Progress:
    """Rank 0's record of where a long epoch is, every output.progress_s seconds (a clock read
    per step, no GPU sync: the batch is the one the host has queued)."""

    def __init__(self, ctx: Context, epoch: int, batches: int, start: float) -> None:
        every = ctx.cfg.output.progress_s if ctx.env.rank == 0 else 0
        self.ctx, self.epoch, self.batches, self.start = ctx, epoch, batches, start
        self.every, self.next = every, start + every

    def at(self, batch: int) -> None:
        if not self.every or (now := time.perf_counter()) < self.next or batch == self.batches:
            return
        self.next = now + self.every
        seconds = round(now - self.start, 3)
        self.ctx.metrics.write(
            "progress", epoch=self.epoch, batch=batch, batches=self.batches, seconds=seconds
        )


def _driven_gpus(ctx: Context) -> list[int]:
    if ctx.device.type != "cuda":
        return []
    return (
        list(range(ctx.gpus))
        if not strategies.of(ctx.cfg).per_gpu
        else [typing.cast(int, ctx.device.index)]
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


def _parameters(ctx: Context, model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole parameters (gathered where sharded: a collective every rank joins), without the
    buffers: BatchNorm's running statistics are each rank's own under DDP and FSDP."""
    names = {name for name, _ in bare(model).named_parameters()}
    weights = strategies.of(ctx.cfg).model_state(model)
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
    diverged: int | None = None,
) -> dict[str, Any]:
    """The run's end: over every attempt, each epoch once (earlier attempts from the run folder).
    `diverged`: the epoch whose test loss was NaN or infinite, where the run stopped."""
    done = runfolder.of_kind(runfolder.read_rank(ctx.run_dir, ctx.env.rank), "epoch")
    records, _ = runfolder.read_records(runfolder.metrics_path(ctx.run_dir, ctx.env.rank))
    last = done[-1]
    saved = ctx.cfg.train.checkpoint and runfolder.checkpoint_path(ctx.run_dir).is_file()
    checkpoint = runfolder.CHECKPOINT if ctx.env.is_main and saved else None
    if diverged is not None and ctx.env.is_main:
        log.warning(
            "the run diverged: its test loss is %s after epoch %d; it stops here, keeping the "
            "checkpoint of the epoch before (if any)",
            last["test_loss"],
            diverged,
        )
    return ctx.metrics.write(
        "summary",
        epochs=len(done),
        # Over every attempt, each epoch once; an epoch split across attempts has no one time.
        train_seconds=sum(e["seconds"] or 0.0 for e in done),
        attempts=runfolder.attempts(records),
        untimed=sum(1 for e in done if e["seconds"] is None),
        total_seconds=time.time() - started,  # this attempt's
        final_test_loss=last["test_loss"],
        final_test_accuracy=last["test_accuracy"],
        checkpoint=checkpoint,
        parameters_sha256=parameters_sha256(_parameters(ctx, model)),
        gpus=gpus.figures(),  # one entry per GPU this process drove; empty on CPU
        diverged_epoch=diverged,
    )
