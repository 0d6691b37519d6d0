"""The largest global batch that fits: double until out of memory, then bisect to within 5 %.

Each trial runs real training steps (forward, backward, optimizer step) of the wrapped model on
random data of the workload's shape, and recovers from an out-of-memory error inside the same process. DDP
ranks agree on every trial's outcome through an all-reduce, so they always try the same size.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

TOLERANCE = 0.05
CEILING = 1 << 24  # a global batch of 16 M samples: past this the search stops, whatever fits
STEPS_PER_TRIAL = 2


def search(
    fits: Callable[[int], bool], start: int, unit: int
) -> tuple[int | None, list[dict[str, Any]]]:
    """Largest multiple of `unit` for which fits() holds, within TOLERANCE; and every trial made."""
    trials: list[dict[str, Any]] = []

    def attempt(batch: int) -> bool:
        ok = fits(batch)
        trials.append({"global_batch": batch, "fits": ok})
        return ok

    low, high = 0, None
    batch = max(unit, start // unit * unit)
    while high is None and batch <= CEILING:
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


def make_trial(
    model: nn.Module,
    device: torch.device,
    world_size: int,
    optimizer: Any,
    shape: tuple[int, ...],
    classes: int,
) -> Callable[[int], bool]:
    """A fits(global_batch) for this process: real steps, OOM caught, outcome agreed by all ranks."""
    ddp = isinstance(model, nn.parallel.DistributedDataParallel)

    def batch(size: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(size, *shape, device=device)
        return x, torch.randint(0, classes, (size,), device=device)

    def fits(global_batch: int) -> bool:
        per_rank = global_batch // world_size
        ok = _steps(model, batch, per_rank, optimizer, ddp)
        return _all_agree(ok, device)

    return fits


def _steps(
    model: nn.Module,
    make: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    batch: int,
    optimizer: Any,
    ddp: bool,
) -> bool:
    x = y = None
    try:
        x, y = make(batch)
        for _ in range(STEPS_PER_TRIAL):
            # No gradient all-reduce inside a step that may run out of memory: a rank stuck in a
            # collective while another recovers would hang. Gradients are reduced after agreeing.
            with model.no_sync() if ddp else contextlib.nullcontext():  # type: ignore[operator]
                F.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        del x, y
        optimizer.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()


def _all_agree(ok: bool, device: torch.device) -> bool:
    if not dist.is_initialized():
        return ok
    flag = torch.tensor([1 if ok else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())
