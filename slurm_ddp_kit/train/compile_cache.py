"""Compile once per workload: torch.compile's caches kept where the next job of the workload finds
them.

torch.compile keeps what it compiled (Inductor's graphs, Triton's kernels, the autotuner's
choices) in a folder of the machine it ran on, and its entries carry the device index: a sweep's
next element, a requeued attempt or a resume on another node compiles again, for minutes. Here
each rank saves PyTorch's portable cache artifacts ("Mega-Cache",
`torch.compiler.save_cache_artifacts`) after its warm-up (train.steps.warm_up) into a folder on the
shared file system, and every later job of the same workload loads them before it compiles
(`load_cache_artifacts` seeds the node's own caches, so the compile is a lookup).

    <output.root>/compile-cache/<workload key>/cuda<device index>.bin

The workload key is a digest of what the compiled graphs depend on: the versions of torch and
Triton, the GPU model, the model and data shape, the per-rank batch, precision, memory format,
compile mode, strategy and CUDA-graph capture. A file is written whole beside its final name and
renamed onto it under an exclusive lock, so concurrent jobs never see half a file, and only one
writes at a time; a file that cannot be loaded (another torch, a damaged disk) is a cold start
with a notice, never a failed job. Compiled artifacts are code that the job runs: a file is
loaded only where no one else could have written it (`core.userfiles`: the user's own, writable by
no one else, in such a folder), since output.root may be a group's.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from slurm_ddp_kit.core import runfolder, userfiles
from slurm_ddp_kit.core.settings.rules import per_rank_batch
from slurm_ddp_kit.core.settings.schema import Config

log = logging.getLogger("train")

FOLDER = "compile-cache"  # under output.root


def workload_key(cfg: Config, device_name: str) -> str:
    """What the compiled graphs depend on, as 16 hex digits."""
    t, d, m = cfg.train, cfg.data, cfg.model
    parts = {
        "torch": torch.__version__,
        "triton": _triton_version(),
        "device": device_name,
        "model": [m.name, m.dropout],
        "data": [d.dataset, d.channels, d.image_size, d.classes, d.on_device],
        "batch": per_rank_batch(cfg),
        "train": [t.precision.value, t.channels_last, t.compile_mode.value, t.cuda_graph],
        "mode": cfg.mode,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def _triton_version() -> str:
    try:
        import triton
    except ImportError:  # a CPU build of torch
        return "none"
    return str(getattr(triton, "__version__", "unknown"))


def path_for(cfg: Config, device: torch.device) -> Path | None:
    """This rank's artifacts file, or None where nothing is compiled."""
    if not cfg.train.compile or device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return Path(cfg.output.root) / FOLDER / workload_key(cfg, name) / f"cuda{device.index or 0}.bin"


def load(path: Path) -> str:
    """Seed this node's compile caches from the saved artifacts (before anything compiles):
    'warm', or 'cold' when there are none or they cannot be used (said in the log; the job
    goes on and compiles)."""
    if not path.exists():
        return "cold"
    handle = userfiles.open_own(path)
    if handle is None:
        why = userfiles.why_not_own(path) or "it cannot be read"
        log.warning("compile cache not loaded: %s; compiling from scratch", why)
        return "cold"
    try:
        with handle:
            artifacts = handle.read()
    except OSError as err:
        log.warning("compile cache %s cannot be read (%s): compiling from scratch", path, err)
        return "cold"
    try:  # torch says None (and logs why) for bytes it cannot read
        loaded = torch.compiler.load_cache_artifacts(artifacts)
        why = "" if loaded is not None else "damaged, or written by another torch"
    except Exception as err:  # another torch's artifacts, or a damaged file: compile instead
        why = str(err)
    if why:
        log.warning("compile cache %s cannot be loaded (%s): compiling from scratch", path, why)
        return "cold"
    return "warm"


def save(path: Path) -> bool:
    """Save what this process compiled (all of it, loaded artifacts included) over the file, whole
    or not at all; False when there is nothing to save or the folder cannot be written."""
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return False
    try:
        _store(path, saved[0])
    except OSError as err:  # a full or read-only disk costs the next job a compile, no more
        log.warning("compile cache %s not saved (%s): the next job compiles again", path, err)
        return False
    return True


def _store(path: Path, artifacts: bytes) -> None:
    """Write the file whole (runfolder's atomic file: synced, renamed into place) while holding
    the workload folder's lock, so one job writes at a time and readers see old or new."""
    path.parent.mkdir(parents=True, exist_ok=True)
    userfiles.keep_private(path.parent)  # else its files are never loaded (see `load`)
    with _locked(path.parent / ".lock"), runfolder.atomic_file(path) as partial:
        partial.chmod(0o644)  # readable by the group, writable by this user alone
        partial.write_bytes(artifacts)


@contextlib.contextmanager
def _locked(lock: Path) -> Iterator[None]:
    """One writer at a time over the whole workload's folder (flock: released if we die)."""
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
