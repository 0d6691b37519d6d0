"""How batches reach the model: whole batches gathered by index, never collated sample by sample.

Both loaders take their order from a sampler of indices (the DistributedSampler of the job, or a
fixed shard for evaluation), so the batches are the same whichever loader serves them:
- `host_loader`: a DataLoader whose every item is a whole batch (`dataset[indices]`: one gather per
  tensor), pinned and copied to the GPU without blocking;
- `DeviceLoader`: the split held once on the GPU as uint8; each batch is gathered and normalised
  there, from the sampler's indices copied once per epoch.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader

from train import data
from train.config import Config

Batch = tuple[torch.Tensor, torch.Tensor]


class _Batches(torch.utils.data.Dataset[Batch]):
    """`dataset[indices]` is the whole batch: one gather per tensor, no per-sample collation."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.images, self.labels = images, labels

    def __getitem__(self, indices: list[int]) -> Batch:
        index = torch.as_tensor(indices)
        return self.images[index], self.labels[index]

    def __len__(self) -> int:
        return len(self.labels)


def host_loader(
    images: torch.Tensor,
    labels: torch.Tensor,
    order: Iterable[int],
    batch: int,
    workers: int,
    pin: bool,
    seed: int,
) -> DataLoader[Batch]:
    """Batches of `batch` indices in the order `order` gives (the last may be smaller)."""
    return DataLoader(
        _Batches(images, labels),
        batch_size=None,  # each sampled item is already a batch
        sampler=BatchSampler(order, batch, drop_last=False),
        num_workers=workers,
        pin_memory=pin,
        persistent_workers=workers > 0,
        # Its own generator: starting an epoch must not draw from the global RNG, or a resumed
        # run's dropout masks would differ from an uninterrupted run's.
        generator=torch.Generator().manual_seed(seed),
    )


class DeviceLoader:
    """The split on the GPU (uint8, 1 byte a pixel); batches gathered and normalised there."""

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        order: Iterable[int],
        batch: int,
        device: torch.device,
    ) -> None:
        self.images = images.to(device)
        self.labels = labels.to(device)
        self.order, self.batch, self.device = order, batch, device

    def __len__(self) -> int:
        return -(-len(self.order) // self.batch)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Batch]:
        # One host-to-device copy of the epoch's indices; every batch is then a slice of it.
        indices = torch.tensor(list(self.order), dtype=torch.long).to(self.device)
        for start in range(0, len(indices), self.batch):
            index = indices[start : start + self.batch]
            yield data.normalise(self.images[index]), self.labels[index]


Loader = DataLoader[Batch] | DeviceLoader


def loader(
    images: torch.Tensor,
    labels: torch.Tensor,
    order: Any,
    batch: int,
    device: torch.device,
    cfg: Config,
) -> Loader:
    """The loader the settings ask for (`data.on_device`), over the indices `order` gives."""
    d = cfg.data
    if d.on_device:
        return DeviceLoader(images, labels, order, batch, device)
    pin = d.pin_memory and device.type == "cuda"
    return host_loader(
        data.normalise(images), labels, order, batch, d.num_workers, pin, cfg.train.seed
    )
