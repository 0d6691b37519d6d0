"""The datasets' files on disk: where each lives and whether it is whole (torch-free).

Real MNIST and the embedded datasets share MNIST's IDX layout (ROOT/MNIST/raw/*-ubyte); the
launcher checks a real copy before it submits, the job before it reads (`train.data`).
"""

from __future__ import annotations

import struct
from pathlib import Path

from slurm_ddp_kit.core import runfolder
from slurm_ddp_kit.core.errors import KitError
from slurm_ddp_kit.core.settings.rules import check_batch_fits_data
from slurm_ddp_kit.core.settings.schema import Config, ConfigError

IMAGE_MAGIC, LABEL_MAGIC = 0x00000803, 0x00000801

FILES = {
    ("train", "images"): "train-images-idx3-ubyte",
    ("train", "labels"): "train-labels-idx1-ubyte",
    ("test", "images"): "t10k-images-idx3-ubyte",
    ("test", "labels"): "t10k-labels-idx1-ubyte",
}

SYNTHETIC_VERSION = 2  # raise it whenever `synthetic_digits` draws differently


class DataError(KitError):
    """The dataset is missing or damaged; the message says how to get a good copy."""


def dataset_dir(dataset: str, root: str | Path, seed: int, train_size: int, test_size: int) -> Path:
    """The folder that holds MNIST/raw (torchvision's MNIST(root=...) layout)."""
    if dataset == "mnist":
        return Path(root)
    # The generator's version in the name: a copy made by an older kit is never read as this one.
    return Path(root) / f"synthetic-v{SYNTHETIC_VERSION}-seed{seed}-{train_size}-{test_size}"


def verify(folder: Path, dataset: str) -> None:
    """Check the four IDX files: sound headers, the sizes they promise, one label per image,
    labels 0–9. Reads the label files whole (small); the images only by their size."""
    raw = folder / "MNIST" / "raw"
    for split in ("train", "test"):
        counts = [
            _checked_count(raw / FILES[(split, kind)], kind, folder, dataset)
            for kind in ("images", "labels")
        ]
        if counts[0] != counts[1]:
            raise DataError(
                f"{raw}: the {split} split has {counts[0]} images ({FILES[(split, 'images')]}) but "
                f"{counts[1]} labels ({FILES[(split, 'labels')]}). {_fix(folder, dataset)}"
            )
        labels = (raw / FILES[(split, "labels")]).read_bytes()[8:]  # one byte each
        if (highest := max(labels, default=0)) > 9:
            raise DataError(
                f"{raw / FILES[(split, 'labels')]} holds label {highest}; digits are 0–9. "
                f"{_fix(folder, dataset)}"
            )


def _checked_count(path: Path, kind: str, folder: Path, dataset: str) -> int:
    if not path.is_file():
        raise DataError(f"{path} is missing. {_fix(folder, dataset)}")
    magic = IMAGE_MAGIC if kind == "images" else LABEL_MAGIC
    expected = _expected_size(path, magic)
    actual = path.stat().st_size
    if expected != actual:
        promise = f"its header promises {expected}" if expected else "its header is not MNIST's"
        raise DataError(f"{path} is damaged ({actual} bytes, {promise}). {_fix(folder, dataset)}")
    with path.open("rb") as f:
        return int(struct.unpack(">I", f.read(8)[4:8])[0])


def _expected_size(path: Path, magic: int) -> int | None:
    with path.open("rb") as f:
        head = f.read(16 if magic == IMAGE_MAGIC else 8)
    if len(head) < 8 or struct.unpack(">I", head[:4])[0] != magic:
        return None
    if magic == LABEL_MAGIC:
        return 8 + struct.unpack(">I", head[4:8])[0]
    if len(head) < 16 or struct.unpack(">II", head[8:16]) != (28, 28):
        return None  # the kit's model reads 28×28 images
    return 16 + struct.unpack(">I", head[4:8])[0] * 28 * 28


def _fix(folder: Path, dataset: str) -> str:
    if dataset == "mnist":
        return (
            f"Fetch MNIST on a machine with internet: `python -m train fetch-mnist --root {folder}` "
            "(compute nodes often have none; copy the folder over if needed)."
        )
    return f"Delete {folder} and run again: the synthetic data is rewritten from its seed."


def check_data(cfg: Config) -> None:
    """What a new run's data must be before its folder is made (`launch submit`, the sbatch
    scripts' `launch prepare`): data.root a folder the job can read or make, and a dataset the
    job cannot make (real MNIST) there now. The embedded datasets are written by the job."""
    check_batch_fits_data(cfg)
    root = runfolder.expand("data.root", cfg.data.root)
    existing = next(p for p in [root, *root.parents] if p.exists())
    if not existing.is_dir():
        raise ConfigError(
            f"data.root={cfg.data.root}: {existing} is a file; point data.root at a folder, "
            "e.g. data.root=data"
        )
    if cfg.data.dataset == "mnist":
        verify(root, "mnist")
