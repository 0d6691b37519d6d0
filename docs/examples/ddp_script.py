"""A plain DDP training script of a user's own, launched by the kit:

    python -m launch submit --mode ddp --nodes 1 -- python docs/examples/ddp_script.py --epochs 3

It is an ordinary torch.distributed program (it runs under torchrun too): its own model, loss,
Dataset and DataLoader with a DistributedSampler, and learning-rate schedule. What it asks of the
kit is three calls of `slurm_ddp_kit`, each harmless without it: where to save and find its
checkpoint, whether to stop (the time limit is near, or the job is preempted), and a record per
epoch that `launch status` and `analysis summarize` read.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import slurm_ddp_kit as kit


def blobs(samples: int, seed: int) -> TensorDataset:
    """Two well-apart Gaussian blobs in 8 dimensions: a task a tiny model learns in an epoch."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 2, (samples,), generator=generator)
    inputs = torch.randn(samples, 8, generator=generator) + labels[:, None] * 3.0
    return TensorDataset(inputs, labels)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--pause", type=float, default=0.0, help="seconds to sleep per step")
    args = parser.parse_args()

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")  # env://
    rank, local_rank = dist.get_rank(), int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = DistributedDataParallel(
        nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)).to(device),
        device_ids=[local_rank] if device.type == "cuda" else None,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    loss_of = nn.CrossEntropyLoss(label_smoothing=0.05)
    train = blobs(1024, seed=1)
    sampler = DistributedSampler(train, shuffle=True, seed=0)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler)

    first_epoch = 1
    saved = kit.checkpoint_dir() / "last.pt"
    if saved.exists():  # a requeued or resumed run goes on where it saved
        state = torch.load(saved, map_location=device, weights_only=True)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        first_epoch = state["epoch"] + 1

    for epoch in range(first_epoch, args.epochs + 1):
        sampler.set_epoch(epoch)
        total, count = torch.zeros((), device=device), 0
        for inputs, labels in loader:
            optimizer.zero_grad()
            loss = loss_of(model(inputs.to(device)), labels.to(device))
            loss.backward()
            optimizer.step()
            total, count = total + loss.detach(), count + 1
            time.sleep(args.pause)  # a longer step, for a test that stops the run mid-way
        schedule.step()
        accuracy = evaluate(model, device)
        kit.log(
            epoch=epoch, loss=float(total / count), accuracy=accuracy, lr=schedule.get_last_lr()[0]
        )
        if rank == 0:  # one copy of the weights: DDP keeps the ranks equal
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "schedule": schedule.state_dict(), "epoch": epoch}  # fmt: skip
            torch.save(state, saved.with_suffix(".partial"))
            os.replace(saved.with_suffix(".partial"), saved)  # whole or not at all
        # Every rank stops at the same epoch: the signal reaches each at its own moment, and a
        # rank that stopped alone would leave the others waiting in their next all-reduce.
        stop = torch.tensor(float(kit.stop_requested()), device=device)
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if stop.item() and epoch < args.epochs:
            break  # saved: exit 0, and the kit requeues the job
    dist.barrier()  # every rank's last collective done before any rank tears the group down
    dist.destroy_process_group()


@torch.no_grad()
def evaluate(model: nn.Module, device: torch.device) -> float:
    test = blobs(256, seed=2)
    predicted = model(test.tensors[0].to(device)).argmax(1).cpu()
    return float((predicted == test.tensors[1]).float().mean())


if __name__ == "__main__":
    main()
