"""The embedded synthetic digits and the checks that guard any dataset folder."""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from kit import kit, load_split

from slurm_ddp_kit.core.datafiles import DataError, dataset_dir, verify
from slurm_ddp_kit.train.data import MEAN, STD, load_raw, prepare_synthetic


def _digest(folder: Path) -> str:
    raw = sorted((folder / "MNIST" / "raw").iterdir())
    return hashlib.sha256(b"".join(p.read_bytes() for p in raw)).hexdigest()


def test_synthetic_is_mnist_shaped_and_normalised_as_torchvision_would(tmp_path: Path) -> None:
    folder = prepare_synthetic(tmp_path / "s", seed=0, train_size=600, test_size=100)
    train, test = (
        load_split(folder, train=True),
        load_split(folder, train=False),
    )
    assert train.tensors[0].shape == (600, 1, 28, 28) and test.tensors[0].shape == (100, 1, 28, 28)
    assert set(train.tensors[1].tolist()) == set(range(10))
    raw = (folder / "MNIST" / "raw" / "train-images-idx3-ubyte").read_bytes()[16:]
    pixels = torch.frombuffer(bytearray(raw), dtype=torch.uint8).float().reshape(600, 1, 28, 28)
    expected = (pixels / 255 - MEAN) / STD  # torchvision's ToTensor then Normalize(MEAN, STD)
    assert torch.allclose(train.tensors[0], expected)


def test_the_kits_reader_gives_what_torchvisions_mnist_gives(tmp_path: Path) -> None:
    """The jobs read the IDX files themselves (no torchvision import at start-up): the same
    tensors, dtypes and shapes as torchvision's MNIST class reads from the same files."""
    from torchvision.datasets import MNIST

    folder = prepare_synthetic(tmp_path / "s", seed=3, train_size=300, test_size=70)
    for train in (True, False):
        images, labels = load_raw(folder, "synthetic", train=train)
        theirs = MNIST(str(folder), train=train, download=False)
        assert images.dtype == torch.uint8 and labels.dtype == torch.int64
        assert torch.equal(images, theirs.data.unsqueeze(1))
        assert torch.equal(labels, theirs.targets.long())


def test_synthetic_is_deterministic_from_its_seed(tmp_path: Path) -> None:
    a = prepare_synthetic(tmp_path / "a", seed=1, train_size=300, test_size=50)
    b = prepare_synthetic(tmp_path / "b", seed=1, train_size=300, test_size=50)
    c = prepare_synthetic(tmp_path / "c", seed=2, train_size=300, test_size=50)
    assert _digest(a) == _digest(b) != _digest(c)


def test_existing_copy_is_checked_not_rewritten(tmp_path: Path) -> None:
    folder = prepare_synthetic(tmp_path / "s", seed=0, train_size=100, test_size=10)
    stamp = (folder / "MNIST" / "raw" / "train-images-idx3-ubyte").stat().st_mtime_ns
    prepare_synthetic(folder, seed=0, train_size=100, test_size=10)
    assert (folder / "MNIST" / "raw" / "train-images-idx3-ubyte").stat().st_mtime_ns == stamp


def test_truncated_file_names_the_fix_and_is_kept(tmp_path: Path) -> None:
    folder = prepare_synthetic(tmp_path / "s", seed=0, train_size=100, test_size=10)
    images = folder / "MNIST" / "raw" / "t10k-images-idx3-ubyte"
    images.write_bytes(images.read_bytes()[:-100])
    with pytest.raises(
        DataError,
        match=r"damaged \(7756 bytes, its header promises 7856\). Delete .* and run again",
    ):
        prepare_synthetic(folder, seed=0, train_size=100, test_size=10)
    assert images.stat().st_size == 7756  # nothing is deleted behind the user's back


def test_missing_mnist_says_how_to_fetch(tmp_path: Path) -> None:
    with pytest.raises(
        DataError, match=r"train-images-idx3-ubyte is missing. Fetch MNIST .* fetch-mnist --root"
    ):
        verify(dataset_dir("mnist", tmp_path, 0, 0, 0), "mnist")


def test_prepare_data_command(tmp_path: Path) -> None:
    done = kit(
        "train", "prepare-data", f"data.root={tmp_path}", "data.train_size=200", "data.test_size=20"
    )
    assert done.returncode == 0, done.stderr
    assert (
        tmp_path / "synthetic-v2-seed0-200-20" / "MNIST" / "raw" / "t10k-labels-idx1-ubyte"
    ).is_file()
    missing = kit("train", "prepare-data", f"data.root={tmp_path}", "data.dataset=mnist")
    assert missing.returncode == 2 and "fetch-mnist" in missing.stderr


def test_metrics_reader_skips_what_it_cannot_read(tmp_path: Path) -> None:
    from slurm_ddp_kit.core.runfolder import RecordWriter, read_records

    writer = RecordWriter(tmp_path, rank=0)
    writer.write("start", mode="ddp")
    with writer.path.open("a") as f:
        f.write('3\n{"schema": 1, "kind": "epo')  # a stray value, then a line cut short
    records, problems = read_records(writer.path)
    assert [r["kind"] for r in records] == ["start"]
    assert [p.split(": ", 1)[1] for p in problems] == [
        "unreadable line skipped (cut short by a killed job?)"
    ] * 2


def test_batch_loaders_give_what_per_sample_collation_gave(tmp_path: Path) -> None:
    """The host loader (whole batches by index; normalised once, or batch by batch where they
    are copied to a GPU) and the device loader (here on the CPU) serve exactly the batches a
    DataLoader collating sample by sample serves, in its order."""
    import torch
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from slurm_ddp_kit.train import data, loaders

    folder = prepare_synthetic(tmp_path / "digits", seed=3, train_size=300, test_size=10)
    images, labels = data.load_raw(folder, "synthetic", train=True)
    reference = TensorDataset(data.normalise(images), labels)
    for rank in (0, 1):
        sampler = DistributedSampler(reference, 2, rank, shuffle=True, seed=3)
        sampler.set_epoch(4)
        expected = list(DataLoader(reference, batch_size=64, sampler=sampler))
        host = loaders.host_loader(data.normalise(images), labels, sampler, 64, 0, False, 3)
        device = loaders.DeviceLoader(images, labels, sampler, 64, torch.device("cpu"))
        raw = loaders.host_loader(images, labels, sampler, 64, 0, False, 3)
        copied = loaders.ToDevice(raw, torch.device("cpu"), data.normalise)
        for served in (list(host), list(device), list(copied)):
            assert len(served) == len(expected) == 3  # 150 per rank: 64, 64, 22
            for (x, y), (ex, ey) in zip(served, expected, strict=True):
                assert torch.equal(x, ex) and torch.equal(y, ey)


def test_a_loader_left_mid_epoch_leaves_no_thread_behind(tmp_path: Path) -> None:
    """A stop at a step boundary leaves the epoch's batches mid-way: the thread fetching the
    next batch ends with them, and a fetch that failed reaches the loop as its error."""
    import threading

    from slurm_ddp_kit.train import data, loaders

    folder = prepare_synthetic(tmp_path / "digits", seed=3, train_size=300, test_size=10)
    images, labels = data.load_raw(folder, "synthetic", train=True)
    before = threading.active_count()
    raw = loaders.host_loader(images, labels, range(300), 32, 0, False, 3)
    batches = iter(loaders.ToDevice(raw, torch.device("cpu"), data.normalise))
    next(batches), next(batches)
    assert threading.active_count() == before + 1  # fetching the third
    batches.close()  # what leaving the loop does to it
    assert threading.active_count() == before

    def failing() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        yield images[:4], labels[:4]
        raise OSError("the data's disk went away")

    broken = loaders.ToDevice(failing(), torch.device("cpu"), data.normalise)  # type: ignore[arg-type]
    with pytest.raises(OSError, match="disk went away"):
        list(broken)
    assert threading.active_count() == before


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("size", [1, 7, 300])
def test_sampler_order_is_the_distributed_samplers(world: int, size: int) -> None:
    """The tensor the device loader takes its indices from is DistributedSampler's own order,
    for every rank, with and without shuffling, padding and drop_last."""
    import torch
    from torch.utils.data import DistributedSampler, TensorDataset

    from slurm_ddp_kit.train import loaders

    dataset = TensorDataset(torch.zeros(size))
    for rank, shuffle, drop_last in itertools.product(range(world), (True, False), (False, True)):
        sampler = DistributedSampler(dataset, world, rank, shuffle, seed=5, drop_last=drop_last)
        sampler.set_epoch(4)
        assert loaders.sampler_order(sampler).tolist() == list(sampler)


@pytest.mark.parametrize("chunk", [1, 2, 32])
def test_device_loader_serves_a_resumed_epoch_in_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    """Gathered a chunk of batches at a time, from the order of a resumed epoch (its first
    batches skipped), the device loader serves exactly the batches that were left."""
    import torch
    from torch.utils.data import DistributedSampler, TensorDataset

    from slurm_ddp_kit.train import data, loaders, loop

    monkeypatch.setattr(loaders, "CHUNK_BATCHES", chunk)
    folder = prepare_synthetic(tmp_path / "digits", seed=3, train_size=300, test_size=10)
    images, labels = data.load_raw(folder, "synthetic", train=True)
    sampler = DistributedSampler(TensorDataset(labels), 2, 1, shuffle=True, seed=3)
    sampler.set_epoch(2)
    order = loop._ResumeSampler(sampler)
    order.skip = 40
    left = list(sampler)[40:]  # 110 indices: batches of 32, 32, 32, 14
    served = list(loaders.DeviceLoader(images, labels, order, 32, torch.device("cpu")))
    assert [len(y) for _, y in served] == [32, 32, 32, 14]
    for number, (x, y) in enumerate(served):
        index = torch.tensor(left[number * 32 : (number + 1) * 32])
        assert torch.equal(x, data.normalise(images[index])) and torch.equal(y, labels[index])


@pytest.mark.parametrize(("count", "world"), [(10, 3), (9, 3), (1, 4), (7, 1)])
def test_evaluation_shards_cover_the_split_once_and_even_ones_match_in_length(
    count: int, world: int
) -> None:
    from slurm_ddp_kit.train import loaders

    split = (torch.arange(count * 4.0).reshape(count, 1, 2, 2), torch.arange(count))
    seen: list[int] = []
    lengths = set()
    for rank in range(world):
        plain_split, plain = loaders.evaluation_shard(split, rank, world, even=False)
        padded_split, padded = loaders.evaluation_shard(split, rank, world, even=True)
        assert plain_split is split and list(plain) == list(range(rank, count, world))
        labels = padded_split[1][torch.as_tensor(list(padded), dtype=torch.long)]
        seen += labels[labels >= 0].tolist()
        assert (labels < 0).sum() == len(padded) - len(plain)  # the padding alone is -1
        assert not padded_split[0][torch.as_tensor(list(padded), dtype=torch.long)][
            labels < 0
        ].any()
        lengths.add(len(padded))
    assert sorted(seen) == list(range(count)) and len(lengths) == 1
