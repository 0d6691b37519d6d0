"""A check of the largest-batch and largest-model figures apart from the kit's search: plain
PyTorch, a fresh set of processes for every size, two training steps (forward, backward with DDP's
all-reduce or FSDP's gathers where they apply, SGD with momentum; AdamW for the GPT) on random
data. Prints `fits` or `oom` per size.

Usage: python docs/benchmarks/check_largest.py dp|ddp convnet|resnet18|many-classes BATCH [BATCH …]
(BATCH: the global batch, split over every GPU of the machine), or
python docs/benchmarks/check_largest.py ddp|fsdp gpt WIDTH [WIDTH …] (the GPT of the largest-model
GPU test: depth 6, 8 heads, sequences of 256 from 512 tokens, global batch 64)
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from slurm_ddp_kit.core.strategies.fsdp import shard_units
from slurm_ddp_kit.train.model import GPT, ConvNet, resnet18

WORKLOADS = {  # sample shape, classes, model
    "convnet": ((1, 28, 28), 10, lambda: ConvNet()),
    "resnet18": ((3, 32, 32), 10, lambda: resnet18((3, 32, 32), 10)),
    "many-classes": ((1, 28, 28), 100_000, lambda: ConvNet((1, 28, 28), 100_000)),
}
WAIT_S = 300
GPT_BATCH = 64


def steps(model: nn.Module, workload: str, size: int, device: torch.device) -> None:
    if workload == "gpt":
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=0.001)
        x, y = (torch.randint(512, (size, 256), device=device) for _ in "xy")
    else:
        shape, classes, _ = WORKLOADS[workload]
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        x = torch.randn(size, *shape, device=device)
        y = torch.randint(0, classes, (size,), device=device)
    for _ in range(2):
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    for index in range(torch.cuda.device_count()):
        torch.cuda.synchronize(index)


def rank_main(mode: str, workload: str, size: int, rank: int, world: int, out: Any) -> None:
    try:
        torch.cuda.set_device(rank)
        if workload == "gpt":  # `size` is the width; built on its GPU, as the kit builds it
            with torch.device("cuda", rank):
                model: nn.Module = GPT(256, 512, size, depth=6, heads=8)
        else:
            model = WORKLOADS[workload][2]().cuda(rank)
        if mode == "dp":
            model = nn.DataParallel(model)
        else:
            dist.init_process_group("nccl", rank=rank, world_size=world)
            model = wrap(mode, model, rank)
        batch = GPT_BATCH if workload == "gpt" else size
        steps(model, workload, batch // world, torch.device("cuda", rank))
        out.put("fits")
    except torch.OutOfMemoryError:
        out.put("oom")
    except Exception as err:  # an out-of-memory inside NCCL reads as a DistBackendError
        out.put("oom" if "out of memory" in str(err).lower() else f"error: {err}")


def wrap(mode: str, model: nn.Module, rank: int) -> nn.Module:
    if mode == "ddp":
        return nn.parallel.DistributedDataParallel(model, device_ids=[rank])
    from torch.distributed.fsdp import fully_shard

    for unit in shard_units(model):  # the kit's units: block by block
        if next(unit.parameters(), None) is not None:
            fully_shard(unit)
    fully_shard(model)
    return model


def check(mode: str, workload: str, size: int) -> str:
    world = 1 if mode == "dp" else torch.cuda.device_count()
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free.getsockname()[1]))
    ranks = [
        context.Process(target=rank_main, args=(mode, workload, size, r, world, out))
        for r in range(world)
    ]
    for process in ranks:
        process.start()
    said: list[str] = []
    try:
        while len(said) < world:
            said.append(out.get(timeout=WAIT_S))
            if said[-1] != "fits":
                break  # one rank failed: the others wait in a collective that never completes
    finally:
        for process in ranks:
            process.kill()
            process.join()
    return "fits" if said == ["fits"] * world else next(s for s in said if s != "fits")


def main() -> None:
    mode, workload, *sizes = sys.argv[1:]
    for size in map(int, sizes):
        what = (
            f"width {size} at global batch {GPT_BATCH}"
            if workload == "gpt"
            else f"global batch {size}"
        )
        print(f"{mode} {workload} {what}: {check(mode, workload, size)}", flush=True)


if __name__ == "__main__":
    main()
