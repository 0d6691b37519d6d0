"""The kit's DDP training without the kit's launcher, for `torchrun`: the start-up reference.

The same work up to the first step as a kit job (process group, the embedded digits read by
the kit's IDX reader, the ConvNet wrapped in DDP, one step), and nothing else: no config, no run
folder, no records, no stop signals. Rank 0 prints the wall-clock time at which its first step starts and ends.

Usage: torchrun --standalone --nproc-per-node N docs/benchmarks/bare_ddp.py DATA_FOLDER
(DATA_FOLDER: a prepared dataset folder, as a kit run's start record names it).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from slurm_ddp_kit.train.data import load_raw, normalise
from slurm_ddp_kit.train.model import build


def main() -> None:
    folder = Path(sys.argv[1])
    cuda = torch.cuda.is_available()
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    images, labels = load_raw(folder, "synthetic", train=True)
    load_raw(folder, "synthetic", train=False)
    model = nn.parallel.DistributedDataParallel(
        build("convnet").to(device), device_ids=[local] if cuda else None
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    batch = 512 // dist.get_world_size()
    x = normalise(images[:batch]).to(device)
    y = labels[:batch].to(device)
    if cuda:
        torch.cuda.synchronize()
    if rank == 0:  # the moment a kit job writes its start record
        print(f"ready {time.time():.3f}", flush=True)
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    if cuda:
        torch.cuda.synchronize()
    if rank == 0:
        print(f"first_step_end {time.time():.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
