"""Where one captured training step's time goes, on one GPU at the per-GPU batch of 2 GPUs (256):
the GPU time of the captured step replayed alone, the loop's time per step, and the kernels of
one step by `torch.profiler`. Eager and compiled model, bf16, channels_last, cudnn benchmark.

Usage (on a CUDA machine, from the repository root): PYTHONPATH=. python docs/benchmarks/profile_step.py
"""

from __future__ import annotations

import time

import torch
from torch.profiler import ProfilerActivity, profile

from slurm_ddp_kit.train import data, steps
from slurm_ddp_kit.train.model import build

BATCH, REPLAYS = 256, 300


def main() -> None:
    torch.backends.cudnn.benchmark = True
    device = torch.device("cuda", 0)
    images = torch.randint(0, 255, (60000, 1, 28, 28), dtype=torch.uint8, device=device)
    labels = torch.randint(0, 10, (60000,), device=device)
    order = torch.randperm(60000, device=device)

    def batch(k: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = (k * BATCH) % (60000 - BATCH)
        index = order[start : start + BATCH]
        return data.normalise(images[index]), labels[index]

    for compiled in (False, True):
        torch.manual_seed(0)
        raw = build("convnet").to(device).to(memory_format=torch.channels_last)
        model = torch.compile(raw) if compiled else raw
        optimizer = torch.optim.SGD(raw.parameters(), lr=0.01, momentum=0.9)
        cast = steps.autocast(device, "bf16", cache=False)
        step = steps.GraphStep(model, optimizer, BATCH, 1, cast, True)  # type: ignore[arg-type]
        for k in range(10):  # warm-up, then capture
            step.micro(*batch(k), True)
            step.update()
        assert step.micro_graph is not None and step.update_graph is not None
        torch.cuda.synchronize()
        began = time.perf_counter()
        for _ in range(REPLAYS):
            step.micro_graph.replay()
            step.update_graph.replay()
        torch.cuda.synchronize()
        replay = (time.perf_counter() - began) / REPLAYS * 1e3
        loss_sum = torch.zeros((), device=device)
        began = time.perf_counter()
        for k in range(REPLAYS):
            x, y = batch(k)
            loss_sum += step.micro(x, y, True) * len(y)
            step.update()
        torch.cuda.synchronize()
        loop = (time.perf_counter() - began) / REPLAYS * 1e3
        print(f"compiled={compiled}: replay alone {replay:.3f} ms/step, loop {loop:.3f} ms/step")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for k in range(5):
                step._forward_backward(*batch(k))
                step._reduce_and_step()
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.device_time_total]
        per_step = sum(e.device_time_total for e in events) / 5 / 1e3
        kernels = sum(e.count for e in events) / 5
        print(f"  kernels per step: {kernels:.0f}, GPU time {per_step:.3f} ms/step")
        print(prof.key_averages().table(sort_by="device_time_total", row_limit=14))


if __name__ == "__main__":
    main()
