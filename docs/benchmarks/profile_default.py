"""Where the default path's step goes on one GPU: the data alone, the step alone, both (the
loop), and the host's busiest operations by torch.profiler.

The default path is the article's recipe as the kit runs it with no option set: DDP on one GPU
(NCCL, one rank), fp32, the host loader (whole batches gathered by index, pinned, copied to the
GPU), SGD with momentum, global batch 512 over the 60,000 embedded digits.

Usage (on a CUDA machine, from the repository root):
    PYTHONPATH=. python docs/benchmarks/profile_default.py [DATA_ROOT] [THREADS]
THREADS: the rank's torch threads (the kit's default: cluster.cpus_per_task, 2).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile
from torch.utils.data import DistributedSampler, TensorDataset

from slurm_ddp_kit.core.settings.rules import per_rank_batch
from slurm_ddp_kit.core.settings.schema import Config
from slurm_ddp_kit.train import loaders, steps, workloads


def timed(label: str, steps_: int, work: Callable[[], None]) -> None:
    torch.cuda.synchronize()
    began = time.perf_counter()
    work()
    torch.cuda.synchronize()
    print(f"{label:<34} {(time.perf_counter() - began) / steps_ * 1e3:7.3f} ms/step")


def main() -> None:
    root = sys.argv[1] if len(sys.argv) > 1 else "/tmp/profile-default"
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", RANK="0", WORLD_SIZE="1")
    dist.init_process_group("nccl")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    cfg = Config()  # DDP, the article's settings
    cfg.data.root, cfg.cluster.gpus_per_node = root, 1
    work = workloads.load(cfg, 0, lambda: None)
    sampler = DistributedSampler(TensorDataset(work.train[1]), 1, 0, shuffle=True, seed=0)
    batch = per_rank_batch(cfg)
    loader = loaders.loader(work.train, sampler, batch, device, cfg, work.normalise)
    batches = len(loader)
    # The model wrapped as the run's strategy wraps it (DDP), with the strategy's optimizer.
    built = workloads.build_model(cfg, work.sample_shape, work.classes)
    ddp, optimizer = workloads.prepare(cfg, built, device, 1)
    scaler = torch.amp.GradScaler(enabled=False)
    step = steps.EagerStep(ddp, optimizer, scaler, 1, steps.autocast(device, "fp32"))
    x0, y0 = next(iter(loader))

    def data_only() -> None:
        for x, _ in loader:
            x.sum()  # something consumes it, as the model would

    def step_only() -> None:
        for _ in range(batches):
            step.micro(x0, y0, True)
            step.update()

    def loop() -> None:
        loss = torch.zeros((), device=device)
        for x, y in loader:
            loss.add_(step.micro(x, y, True), alpha=len(y))
            step.update()

    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, {threads} threads, "
          f"{batches} steps an epoch")  # fmt: skip
    for _ in range(2):  # the second round is the one to read
        timed("data alone (loader → GPU)", batches, data_only)
        timed("step alone (one batch, again)", batches, step_only)
        timed("loop (data and step)", batches, loop)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        loop()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
