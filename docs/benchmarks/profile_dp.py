"""Where DataParallel's step goes, by its own phases, on every GPU of this machine.

`nn.DataParallel.forward` is scatter → replicate → parallel_apply → gather; its backward reduces the
replicas' gradients onto the first GPU (the replicas' Broadcast backward: ReduceAddCoalesced).
Each phase is wrapped in a `torch.profiler.record_function` label, and the time of each label (host)
and of the kernels under it (device) is printed per step, with the backward and the optimizer.
Article settings: global batch 512, fp32, the kit's host loader's batches (copied to GPU 0).

Usage (on a machine with 2 or more CUDA GPUs, from the repository root):
    PYTHONPATH=. python docs/benchmarks/profile_dp.py
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.profiler import ProfilerActivity, profile, record_function

from slurm_ddp_kit.train.model import build

BATCH, STEPS = 512, 20
PHASES = ("scatter", "replicate", "parallel_apply", "gather")


def labelled(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        with record_function(f"dp.{name}"):
            return method(*args, **kwargs)

    return call


def main() -> None:
    gpus = torch.cuda.device_count()
    model = nn.DataParallel(build("convnet").cuda(), device_ids=list(range(gpus)))
    for phase in PHASES:  # instance attributes shadow the class's methods: only this model
        setattr(model, phase, labelled(phase, getattr(model, phase)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(BATCH, 1, 28, 28).pin_memory()
    y = torch.randint(0, 10, (BATCH,)).pin_memory()

    def step() -> None:
        with record_function("dp.copy_in"):
            xs, ys = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
        loss = F.cross_entropy(model(xs), ys)
        with record_function("dp.backward"):
            loss.backward()
        with record_function("dp.optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            step()
        torch.cuda.synchronize()
    print(f"{gpus} GPUs, global batch {BATCH}, per step over {STEPS} steps:")
    for event in prof.key_averages():
        if event.key.startswith("dp.") or "ReduceAdd" in event.key or "Broadcast" in event.key:
            print(
                f"  {event.key:38s} host {event.cpu_time_total / STEPS / 1e3:7.3f} ms"
                f"   device {event.device_time_total / STEPS / 1e3:7.3f} ms"
            )
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=20))


if __name__ == "__main__":
    main()
