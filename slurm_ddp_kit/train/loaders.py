"""How batches reach the model: whole batches gathered by index, never collated sample by sample.

Both loaders take their order from a sampler of indices (the DistributedSampler of the job, or a
fixed shard for evaluation), so the batches are the same whichever loader serves them:
- `host_loader`: a DataLoader whose every item is a whole batch (`dataset[indices]`: one gather per
  tensor); for a GPU (`ToDevice`) pinned, copied as stored (uint8 pixels: a quarter of float32's
  bytes) without blocking, and normalised there;
- `DeviceLoader`: the split held once on the GPU as uint8; batches are gathered and normalised
  there, from the sampler's indices copied once per epoch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

from slurm_ddp_kit.core.settings.schema import Config
from slurm_ddp_kit.train import data

Batch = tuple[torch.Tensor, torch.Tensor]
Normalise = Callable[[torch.Tensor], torch.Tensor]  # a split's inputs as stored → the model's
CHUNK_BATCHES = 32  # batches gathered at once on the GPU (32 × 256 MNIST images: 25 MB)
CHUNK_BYTES = 256 << 20  # ... but no more than this many bytes of normalised inputs at once


class _Batches(torch.utils.data.Dataset[Batch]):
    """`dataset[indices]` is the whole batch: one gather per tensor, no per-sample collation."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.images, self.labels = images, labels

    def __getitem__(self, indices: list[int]) -> Batch:
        index = torch.as_tensor(indices)
        # index_select copies whole rows; `images[index]` (advanced indexing) took 0.2 ms a
        # batch of 512 digits on the GPU machine's host, a fifth of the default path's step.
        return self.images.index_select(0, index), self.labels.index_select(0, index)

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


class ToDevice:
    """A host loader's batches on the GPU, normalised there: the host gathers, pins and copies
    the split as stored, and does no float work (normalising all 60,000 digits on the host took
    0.4 s of the rank's start-up on the GPU machine). The numbers are the host's up to float32's
    last place, as DeviceLoader's are."""

    def __init__(self, batches: DataLoader[Batch], device: torch.device, normalise: Normalise):
        self.batches, self.device, self.normalise = batches, device, normalise

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[Batch]:
        # The next batch is gathered and pinned by a thread while this one trains (torch's ops
        # let go of the GIL): with no worker processes (data.num_workers=0, the default) the
        # host's share of a step would otherwise come on top of the step's.
        batches = iter(self.batches)
        with ThreadPoolExecutor(1, thread_name_prefix="batches") as ahead:
            coming = ahead.submit(next, batches, None)
            while (batch := coming.result()) is not None:
                coming = ahead.submit(next, batches, None)
                x, y = (t.to(self.device, non_blocking=True) for t in batch)
                yield self.normalise(x), y


class DeviceLoader:
    """The split on the GPU (uint8, 1 byte a pixel); batches gathered and normalised there."""

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        order: Iterable[int],
        batch: int,
        device: torch.device,
        normalise: Normalise = data.normalise,
    ) -> None:
        self.images = images.to(device)
        self.labels = labels.to(device)
        self.order, self.batch, self.device, self.normalise = order, batch, device, normalise

    def __len__(self) -> int:
        return -(-len(self.order) // self.batch)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Batch]:
        # One host-to-device copy of the epoch's indices; batches are gathered and normalised
        # CHUNK_BATCHES at a time (a few large kernels instead of many small ones per batch).
        indices = index_tensor(self.order).to(self.device, non_blocking=True)
        sample_bytes = 4 * self.images[0].numel()  # normalised to float32
        chunk = self.batch * max(1, min(CHUNK_BATCHES, CHUNK_BYTES // (sample_bytes * self.batch)))
        for first in range(0, len(indices), chunk):
            index = indices[first : first + chunk]
            images, labels = self.normalise(self.images[index]), self.labels[index]
            for start in range(0, len(index), self.batch):
                yield images[start : start + self.batch], labels[start : start + self.batch]


def index_tensor(order: Iterable[int]) -> torch.Tensor:
    """The indices an order gives, as a tensor: without a Python int per index where the order
    can say them as a tensor itself (`as_tensor`; measured 6 ms per epoch of 30 000 indices)."""
    if isinstance(order, range):
        return torch.arange(order.start, order.stop, order.step)
    as_tensor = getattr(order, "as_tensor", None)
    return as_tensor() if as_tensor else torch.tensor(list(order), dtype=torch.long)


def sampler_order(s: DistributedSampler[Any]) -> torch.Tensor:
    """DistributedSampler's order for its epoch as a tensor: exactly `list(s)` (tested), with
    its rules: one shuffle per epoch from `seed + epoch`, padded by repetition (or cut with
    `drop_last`) to a multiple of the replicas, every `num_replicas`-th index from `rank`."""
    n = len(s.dataset)  # type: ignore[arg-type]  # a sized dataset, as the sampler requires
    if s.shuffle:
        g = torch.Generator()
        g.manual_seed(s.seed + s.epoch)
        order = torch.randperm(n, generator=g)
    else:
        order = torch.arange(n)
    if s.drop_last:
        order = order[: s.total_size]
    elif s.total_size > n:
        order = torch.cat([order, order.repeat(-(-(s.total_size - n) // n))[: s.total_size - n]])
    return order[s.rank : s.total_size : s.num_replicas]


def evaluation_shard(split: Batch, rank: int, world: int, even: bool) -> tuple[Batch, Any]:
    """This rank's share of the test split (every `world`-th sample from `rank`) and the split it
    indexes. With `even`, every rank gets the same number of samples: the shorter shards are
    padded with a blank sample labelled -1 (each of its labels: a sequence's too), appended to
    the split, which scoring leaves out."""
    images, labels = split
    count = len(labels)
    shard = range(rank, count, world)
    short = shard_size(count, rank, world, even) - len(shard)
    if not short:
        return split, shard
    blank = (images.new_zeros((1, *images.shape[1:])), labels.new_full((1, *labels.shape[1:]), -1))
    padded = (torch.cat([images, blank[0]]), torch.cat([labels, blank[1]]))
    return padded, [*shard, *[count] * short]


def shard_size(count: int, rank: int, world: int, even: bool) -> int:
    """How many of a split's `count` samples this rank scores (evaluation_shard): every
    `world`-th from `rank`, or with `even` the largest such share (the others padded)."""
    return -(-count // world) if even else len(range(rank, count, world))


Loader = DataLoader[Batch] | ToDevice | DeviceLoader


def loader(
    split: Batch, order: Any, batch: int, device: torch.device, cfg: Config, normalise: Normalise
) -> Loader:
    """The loader the settings ask for (`data.on_device`), over the indices `order` gives;
    `normalise` turns the split's inputs as stored (uint8 pixels, say) into the model's. Its
    batches are on `device`, normalised."""
    (images, labels), d = split, cfg.data
    if d.on_device:
        return DeviceLoader(images, labels, order, batch, device, normalise)
    seed = cfg.train.seed
    if device.type != "cuda":  # the batches stay where they are: normalised once, not each epoch
        return host_loader(normalise(images), labels, order, batch, d.num_workers, False, seed)
    host = host_loader(images, labels, order, batch, d.num_workers, d.pin_memory, seed)
    return ToDevice(host, device, normalise)
