"""One training step, two ways: eager (DP, DDP, one process) and captured in CUDA graphs (DDP).

A step is `micro(x, y, last)` per micro-batch (forward and backward; `last` ends an accumulation
group) and `update()` once per group (the optimizer step). The loop does not know which it drives.

`GraphStep` exists because `DistributedDataParallel` cannot be captured (its reducer waits on
streams from the host), and at this model's size launching kernels, not running them, is what takes
the time. It does what DDP does, in a form that captures: gradients are views of a few flat
buffers (buckets, as DDP's `gradient_as_bucket_view`), averaged with one all-reduce per bucket
after backward; the forward+backward of a full micro-batch is one graph, the all-reduce and the
optimizer step another. A micro-batch of another size (the epoch's last) runs eagerly on the same
buffers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

BUCKET_MB = 25  # DDP's default bucket cap
WARMUP_STEPS = 3  # eager steps before capture: lazy initialisation must not happen in a graph

Autocast = Callable[[], contextlib.AbstractContextManager[Any]]


class EagerStep:
    """The plain step: DDP skips its all-reduce on all but the last micro-step (`no_sync`)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler,
        accum: int,
        autocast: Autocast,
        channels_last: bool = False,
    ) -> None:
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.accum, self.autocast, self.channels_last = accum, autocast, channels_last

    def micro(self, x: torch.Tensor, y: torch.Tensor, last: bool) -> torch.Tensor:
        """Forward and backward of one micro-batch; its mean loss, detached."""
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        model = getattr(self.model, "_orig_mod", self.model)  # under torch.compile: the DDP inside
        ddp = isinstance(model, nn.parallel.DistributedDataParallel)
        with contextlib.nullcontext() if last or not ddp else model.no_sync():  # type: ignore[operator]
            with self.autocast():
                loss = F.cross_entropy(self.model(x), y)
            self.scaler.scale(loss / self.accum).backward()
        return loss.detach()

    def update(self) -> None:
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)


class GraphStep:
    """DDP's arithmetic (gradients averaged over ranks, the same update everywhere), replayed
    from CUDA graphs once warm. `model` is the bare model; ranks start from rank 0's weights.
    `compile`: torch.compile's mode for the forward and the loss together (None: eager)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        batch: int,
        accum: int,
        autocast: Autocast,
        channels_last: bool = False,
        compile: str | None = None,
    ) -> None:
        self.optimizer, self.accum, self.autocast = optimizer, accum, autocast
        self.batch, self.channels_last = batch, channels_last
        self.side = torch.cuda.Stream()
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.nccl = dist.is_initialized() and dist.get_backend() == "nccl"
        params = [p for p in model.parameters() if p.requires_grad]
        if dist.is_initialized():
            for tensor in model.state_dict().values():
                dist.broadcast(tensor, 0)  # as DDP does when it wraps a model
        self.buckets = _bucket_gradients(params)
        self.steps = 0
        self.micro_graph: torch.cuda.CUDAGraph | None = None
        self.update_graph: torch.cuda.CUDAGraph | None = None
        self.static: dict[str, torch.Tensor] = {}

        def losses(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            loss = F.cross_entropy(model(x), y)
            return loss, loss / accum  # the mean, and the share backward accumulates

        # Compiled with the loss (not the model alone): the loss's kernels fuse with the model's.
        self.losses = torch.compile(losses, mode=compile) if compile else losses

    # --- the step the loop calls ------------------------------------------------------------

    def micro(self, x: torch.Tensor, y: torch.Tensor, last: bool) -> torch.Tensor:
        if self.micro_graph is None:
            if self.steps >= WARMUP_STEPS and len(x) == self.batch:
                return self._capture_and_replay(x, y)
            return self._on_side_stream(lambda: self._forward_backward(x, y).detach())
        if x.shape != self.static["x"].shape:  # the epoch's short last batch
            return self._forward_backward(x, y).detach()
        self.static["x"].copy_(x)
        self.static["y"].copy_(y)
        self.micro_graph.replay()
        return self.static["loss"]

    def update(self) -> None:
        self.steps += 1
        if self.update_graph is not None:
            self.update_graph.replay()
        else:
            self._on_side_stream(self._reduce_and_step)

    def _on_side_stream(self, work: Callable[[], Any]) -> Any:
        """Warm-up steps run on a side stream, as CUDA graph capture requires of the work that
        initialises lazily (cuBLAS, cuDNN, NCCL, autograd); in order with the main stream."""
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            out = work()
        torch.cuda.current_stream().wait_stream(self.side)
        return out

    # --- what the graphs hold -----------------------------------------------------------------

    def _forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        with self.autocast():
            loss, share = self.losses(x, y)
        share.backward()  # accumulates into the bucket views
        return loss

    def _reduce_and_step(self) -> None:
        for bucket in self.buckets:
            if self.world > 1 and self.nccl:  # NCCL averages as it sums: one kernel fewer
                dist.all_reduce(bucket, op=dist.ReduceOp.AVG)
            elif self.world > 1:
                dist.all_reduce(bucket)
                bucket.div_(self.world)
        self.optimizer.step()
        for bucket in self.buckets:
            bucket.zero_()

    def _capture_and_replay(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Capture both graphs, then replay the micro graph for this micro-batch. Capturing
        records the kernels without running them, so the order of the two captures is free."""
        self.static = {"x": x.clone(), "y": y.clone()}
        update, micro = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(update):
            self._reduce_and_step()
        with torch.cuda.graph(micro):
            self.static["loss"] = self._forward_backward(
                self.static["x"], self.static["y"]
            ).detach()
        self.micro_graph, self.update_graph = micro, update
        micro.replay()
        return self.static["loss"]


def warm_up(
    step: EagerStep | GraphStep,
    model: nn.Module,
    scored: nn.Module,
    sample: tuple[torch.Tensor, torch.Tensor],
    autocast: Autocast,
    sizes: tuple[list[int], list[int]],
) -> None:
    """Compile (torch.compile) and capture (CUDA graphs) on a random batch, before the real data is
    touched: what the first epoch would otherwise pay, counted as start-up (MLPerf's rule; the
    time to accuracy from the first touch of data is then training alone).

    `sizes`: the micro-batch sizes training meets (the full one first, then an epoch's shorter
    last one) and those scoring meets; each is compiled here. Afterwards every weight, buffer
    and optimizer state and the random generators are as they were, so training starts as it
    would have without the warm-up. An optimizer state made here (SGD's momentum) stays
    allocated, as a graph holds its address, and is zeroed: SGD's first step from a zero
    buffer is its first step.
    """
    x, y = sample
    training, scoring = sizes
    weights = {name: t.detach().clone() for name, t in model.state_dict().items()}
    state = step.optimizer.state
    before = {
        p: {k: v.clone() for k, v in s.items() if torch.is_tensor(v)} for p, s in state.items()
    }
    was_training = model.training
    devices = [x.device] if x.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        model.train()
        # GraphStep: eager steps, then the capture; EagerStep: the compiled forward and backward
        graph = isinstance(step, GraphStep)
        for n in [training[0]] * (WARMUP_STEPS if graph else 0) + training:
            step.micro(x[:n], y[:n], last=True)
            if graph:
                step.update()
        scored.eval()
        with torch.no_grad(), autocast():
            for n in scoring:
                scored(x[:n])
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            tensor.copy_(weights[name])
        for param, kept in state.items():
            for key, value in kept.items():
                if key in before.get(param, {}):
                    value.copy_(before[param][key])
                elif torch.is_tensor(value):
                    value.zero_()
    if not graph:
        step.optimizer.zero_grad(set_to_none=True)
    model.train(was_training)


def _bucket_gradients(params: list[nn.Parameter]) -> list[torch.Tensor]:
    """Flat gradient buffers of at most BUCKET_MB each (one dtype each); every parameter's `.grad`
    becomes a view into one, so backward writes straight into what the all-reduce sends."""
    buckets: list[torch.Tensor] = []
    group: list[nn.Parameter] = []
    cap = BUCKET_MB * 2**20

    def close() -> None:
        if not group:
            return
        flat = torch.zeros(
            sum(p.numel() for p in group), dtype=group[0].dtype, device=group[0].device
        )
        offset = 0
        for p in group:
            # The parameter's own strides: a channels_last weight gets a channels_last gradient,
            # which backward adds into without a transposing copy.
            p.grad = flat.as_strided(p.shape, p.stride(), offset)
            offset += p.numel()
        buckets.append(flat)
        group.clear()

    for p in reversed(params):  # backward produces the last layers' gradients first
        size = sum(q.numel() * q.element_size() for q in group)
        if group and (p.dtype != group[0].dtype or size + p.numel() * p.element_size() > cap):
            close()
        group.append(p)
    close()
    return buckets


def autocast(device: torch.device, precision: str, cache: bool = True) -> Autocast:
    """The autocast context of a precision (fp32: none). A captured region must not use
    autocast's weight cache: the cached casts would be stale on replay."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    if dtype is None:
        return contextlib.nullcontext
    return lambda: torch.autocast(device.type, dtype=dtype, cache_enabled=cache)
