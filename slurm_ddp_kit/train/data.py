"""Datasets: real MNIST (fetched on a machine with internet) or the embedded synthetic digits.

Both live in MNIST's IDX layout (ROOT/MNIST/raw/*-ubyte) and are read by one reader, so the
synthetic default exercises exactly the code path real MNIST takes. The reader is the kit's own
(the tensors torchvision's MNIST class gives, tested): importing torchvision costs each rank
about 1.7 s of CPU at start-up, and only the ResNet workload needs it.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from slurm_ddp_kit.core.datafiles import (
    FILES,
    IMAGE_MAGIC,
    LABEL_MAGIC,
    SYNTHETIC_VERSION,
    DataError,
    verify,
)

if TYPE_CHECKING:  # torch is imported where data is loaded: the checks run without it
    import torch

MEAN, STD = 0.1307, 0.3081  # MNIST's pixel statistics, as in pytorch/examples

# 5×7 bitmaps of the digits 0–9: the strokes the synthetic images are drawn from.
_GLYPHS = [
    "01110 10001 10011 10101 11001 10001 01110",
    "00100 01100 00100 00100 00100 00100 01110",
    "01110 10001 00001 00010 00100 01000 11111",
    "11111 00010 00100 00010 00001 10001 01110",
    "00010 00110 01010 10010 11111 00010 00010",
    "11111 10000 11110 00001 00001 10001 01110",
    "00110 01000 10000 11110 10001 10001 01110",
    "11111 00001 00010 00100 01000 01000 01000",
    "01110 10001 10001 01110 10001 10001 01110",
    "01110 10001 10001 01111 00001 00010 01100",
]


def prepare_synthetic(folder: Path, seed: int, train_size: int, test_size: int) -> Path:
    """Write the synthetic digits once; a folder already there is checked, never rewritten."""
    if folder.exists():
        verify(folder, "synthetic")
        return folder
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=folder.parent))
    except OSError as err:
        raise _unwritable(folder, err) from None
    try:
        _write_synthetic(staging, seed, train_size, test_size)
    except BaseException as err:  # a full disk, a quota, Ctrl-C: no partial copy stays
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(err, OSError):
            raise _unwritable(folder, err) from None
        raise
    try:
        os.rename(staging, folder)  # atomic: concurrent writers of one seed end with one copy
    except OSError:
        shutil.rmtree(staging)  # another process won the race; its copy is identical
    return folder


def _write_synthetic(staging: Path, seed: int, train_size: int, test_size: int) -> None:
    rng = np.random.default_rng(seed)
    for split, size in (("train", train_size), ("test", test_size)):
        images, labels = synthetic_digits(size, rng)
        _write_idx(staging / "MNIST" / "raw", split, images, labels)
    source = {
        "generator": "train.data.synthetic_digits",
        "version": SYNTHETIC_VERSION,
        "seed": seed,
        "sizes": [train_size, test_size],
    }
    (staging / "SOURCE.json").write_text(json.dumps(source))


def _unwritable(folder: Path, err: OSError, what: str = "the synthetic digits") -> DataError:
    """The error of a data folder that cannot be written, with the fix its cause asks for."""
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = "free space there, or point data.root at another folder"
    elif err.errno in (errno.EEXIST, errno.ENOTDIR):
        fix = "a file stands where a folder must be: point data.root at a folder"
    else:
        fix = "point data.root at a folder you can write"
    return DataError(f"could not write {what} to {folder}: {err.strerror or err}; {fix}")


def synthetic_digits(count: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """MNIST-shaped uint8 images of digits drawn with random pose, warp, stroke flaws and noise.

    As hard as real MNIST for the kit's ConvNet: 99.07 and 99.10 % test accuracy after the
    article's 10 epochs (2 seeds, 60k/10k; real MNIST: about 99 %). Without the flaws and the
    warp every strategy scored 99.98–100 %, so accuracy could not tell runs apart.
    """
    labels = rng.integers(0, 10, size=count).astype(np.uint8)
    images = np.empty((count, 28, 28), dtype=np.uint8)
    for start in range(0, count, 8192):  # chunks keep the float work under ~100 MB
        chunk = labels[start : start + 8192]
        images[start : start + len(chunk)] = _draw(chunk, rng)
    return images, labels


_PIXELS = np.mgrid[0:28, 0:28].astype(np.float32) - 13.5  # (y, x) from the image's centre
_WARP_KNOTS = 4  # the warp: random offsets on a 4×4 grid, interpolated over the image
_WARP = np.maximum(0, 1 - abs(np.linspace(0, _WARP_KNOTS - 1, 28)[:, None] - np.arange(4)))


def _draw(labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    n = len(labels)
    glyphs = np.array([[list(row) for row in g.split()] for g in _GLYPHS], dtype=np.float32)
    angle = rng.uniform(-0.45, 0.45, n)
    scale = rng.uniform(2.2, 3.4, n)  # pixels per glyph cell
    aspect = np.exp(rng.uniform(-0.2, 0.2, n))  # wider or taller
    shear = rng.uniform(-0.45, 0.45, n)
    shift = rng.uniform(-2.5, 2.5, (n, 2))
    ys, xs = _PIXELS
    cos, sin = np.cos(angle)[:, None, None], np.sin(angle)[:, None, None]
    u = (cos * xs + sin * ys - shift[:, 0, None, None]) / (scale * aspect)[:, None, None]
    v = (-sin * xs + cos * ys - shift[:, 1, None, None]) / (scale / aspect)[:, None, None]
    u = u + shear[:, None, None] * v
    # A smooth random warp (in glyph cells) bends strokes as handwriting does.
    u = u + _WARP @ rng.normal(0, 0.4, (n, _WARP_KNOTS, _WARP_KNOTS)) @ _WARP.T
    v = v + _WARP @ rng.normal(0, 0.4, (n, _WARP_KNOTS, _WARP_KNOTS)) @ _WARP.T
    # Stroke flaws: 1 % of the glyph's cells flipped (a gap, a blot), some digits ambiguous.
    cells = glyphs[labels]
    cells = np.where(rng.random(cells.shape) < 0.01, 1 - cells, cells)
    col, row = np.floor(u + 2.5).astype(int), np.floor(v + 3.5).astype(int)
    inside = (col >= 0) & (col < 5) & (row >= 0) & (row < 7)
    ink = cells[np.arange(n)[:, None, None], row.clip(0, 6), col.clip(0, 4)] * inside
    ink = _blur(ink, rng.uniform(0.6, 1.4, n))
    ink = ink * rng.uniform(0.7, 1.0, (n, 1, 1)) + rng.normal(0, 0.08, ink.shape)
    return (ink.clip(0, 1) * 255).astype(np.uint8)


def _blur(ink: np.ndarray, strength: np.ndarray) -> np.ndarray:
    """A 3×3 smoothing whose weight varies per image: thinner and thicker strokes."""
    padded = np.pad(ink, ((0, 0), (1, 1), (1, 1)))
    neighbours = sum(
        padded[:, 1 + dy : 29 + dy, 1 + dx : 29 + dx] for dy in (-1, 0, 1) for dx in (-1, 0, 1)
    )
    weight = strength[:, None, None] / 9
    return np.clip(ink * (1 - weight) + neighbours * weight * 0.9, 0, 1)


PATTERN_MEAN, PATTERN_STD = 0.48, 0.19  # synthetic_patterns' pixel statistics (measured)


def pattern_grids(classes: int, channels: int, rng: np.random.Generator) -> np.ndarray:
    """Each class of `synthetic_patterns`: a random 4×4 grid of colours (16 bytes a channel: a
    million classes stay under 50 MB). Drawn once and shared by both splits."""
    return rng.integers(0, 256, (classes, channels, 4, 4), dtype=np.uint8)


def synthetic_patterns(
    count: int, grids: np.ndarray, size: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """uint8 images (count, channels, size, size) of smooth colour patterns, one per class: the
    class's grid interpolated over the image, shifted by up to a quarter of it, at a random
    contrast, with noise."""
    classes, channels = grids.shape[:2]
    labels = rng.integers(0, classes, size=count)
    images = np.empty((count, channels, size, size), dtype=np.uint8)
    step = max(1, (8 << 20) // (channels * size * size))  # ~8 M pixels of float work at once
    for start in range(0, count, step):
        chunk = labels[start : start + step]
        images[start : start + len(chunk)] = _pattern(grids[chunk], size, rng)
    return images, labels


def _pattern(grids: np.ndarray, size: int, rng: np.random.Generator) -> np.ndarray:
    n = len(grids)
    # Where each pixel falls on the 4×4 grid, shifted per image and axis.
    at = np.linspace(0, 3, size)[None, :] + rng.uniform(-0.75, 0.75, (n, 2))[:, :, None]
    weights = np.maximum(0, 1 - abs(at.clip(0, 3)[..., None] - np.arange(4)))  # (n, 2, size, 4)
    rows, cols = weights[:, None, 0].astype(np.float32), weights[:, None, 1].astype(np.float32)
    ink = rows @ (grids.astype(np.float32) / 255) @ cols.transpose(0, 1, 3, 2)
    ink = 0.5 + (ink - 0.5) * rng.uniform(0.6, 1.0, (n, 1, 1, 1)).astype(np.float32)
    ink += 0.1 * rng.standard_normal(ink.shape, dtype=np.float32)
    return (ink.clip(0, 1) * 255).astype(np.uint8)


SUCCESSORS = 4  # each token is followed by one of its 4 successors in the synthetic tokens
FOLLOW_RULE = 0.75  # how often the token before last picks which successor (else at random)


def token_successors(vocab: int, rng: np.random.Generator) -> np.ndarray:
    """The synthetic tokens' grammar: SUCCESSORS random followers per token (vocab × 4 int32),
    drawn once and shared by both splits."""
    return rng.integers(0, vocab, (vocab, SUCCESSORS), dtype=np.int32)


def synthetic_tokens(
    count: int, seq_len: int, successors: np.ndarray, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """`count` sequences (inputs, next tokens), each (count, seq_len) int64, of a learnable
    language: token t+1 is one of token t's successors, the one that token t-1 names (its value
    mod 4) 3 times in 4, else any of the 4. A model that reads two tokens back predicts 81 % of
    the tokens (a bigram model about 56 % at the defaults, a guess 1/vocab): attention has work to do."""
    vocab = len(successors)
    tokens = np.empty((count, seq_len + 1), dtype=np.int64)
    tokens[:, :2] = rng.integers(0, vocab, (count, 2))
    for t in range(2, seq_len + 1):
        named = tokens[:, t - 2] % SUCCESSORS
        pick = np.where(rng.random(count) < FOLLOW_RULE, named, rng.integers(0, SUCCESSORS, count))
        tokens[:, t] = successors[tokens[:, t - 1], pick]
    return tokens[:, :-1], tokens[:, 1:]


def _write_idx(raw: Path, split: str, images: np.ndarray, labels: np.ndarray) -> None:
    raw.mkdir(parents=True, exist_ok=True)
    header = struct.pack(">IIII", IMAGE_MAGIC, len(images), 28, 28)
    (raw / FILES[(split, "images")]).write_bytes(header + images.tobytes())
    (raw / FILES[(split, "labels")]).write_bytes(
        struct.pack(">II", LABEL_MAGIC, len(labels)) + labels.tobytes()
    )


def fetch_mnist(root: Path) -> Path:
    """Download real MNIST into ROOT/MNIST/raw (needs internet) and check it.

    The download goes to a staging folder beside ROOT and moves in only when complete: a failed
    download leaves nothing behind, and a copy already there is never touched.
    """
    from torchvision.datasets import MNIST

    raw = root / "MNIST" / "raw"
    if raw.is_dir():
        verify(root, "mnist")
        return root
    made = [p for p in [raw.parent, *raw.parent.parents] if not p.exists()]
    try:
        raw.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".fetch-", dir=raw.parent))
    except OSError as err:
        raise _unwritable(raw.parent, err, "MNIST") from None
    try:
        for train in (True, False):
            MNIST(str(staging), train=train, download=True)
        os.rename(staging / "MNIST" / "raw", raw)
    except (OSError, RuntimeError) as err:  # no route to the mirrors, or a bad download
        raise DataError(
            f"could not download MNIST ({str(err).strip().splitlines()[0]}): run "
            f"`python -m train fetch-mnist --root {root}` on a machine with internet and copy "
            "the folder over"
        ) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        for folder in made:  # deepest first: the folders this command made, if left empty
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
    verify(root, "mnist")
    return root


def load_raw(folder: Path, dataset: str, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One split as torchvision's MNIST reader gives it: uint8 images (N, 1, 28, 28), int64 labels."""
    import torch

    verify(folder, dataset)  # whole files, sound headers, 28×28: the offsets below hold
    split = "train" if train else "test"
    raw = folder / "MNIST" / "raw"
    images = np.fromfile(raw / FILES[(split, "images")], dtype=np.uint8, offset=16)
    labels = np.fromfile(raw / FILES[(split, "labels")], dtype=np.uint8, offset=8)
    pixels = torch.from_numpy(images).reshape(-1, 1, 28, 28)
    return pixels, torch.from_numpy(labels).long()


def normalise(images: torch.Tensor) -> torch.Tensor:
    """uint8 pixels → MNIST-normalised float32, the same arithmetic on any device."""
    return (images.float() / 255 - MEAN) / STD
