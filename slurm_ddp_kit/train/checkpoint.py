"""The whole training state in one checkpoint: saved by every rank together, loaded by each.

A checkpoint holds the model, optimizer and scaler state (whole, or as the strategy's shards),
every rank's progress and RNG, and the hash of the config it was saved under; its rename is the
commit, so a reader sees the previous state whole or the new one whole.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import pickle
import random
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from slurm_ddp_kit.core import runfolder, strategies
from slurm_ddp_kit.core.settings.schema import Config

log = logging.getLogger("train")


@dataclass
class Progress:
    """Where training stands: `batches` of `epoch` are done (0: the epoch has not started)."""

    epoch: int = 1
    batches: int = 0
    loss_sum: float = 0.0  # this rank's, over the done batches of the epoch
    samples: int = 0  # this rank's, likewise


def config_hash(run_dir: Path) -> str:
    """The run's own settings as its folder keeps them (the config file, written once when the
    run was made): a newer kit, whose schema holds settings that file does not name, still
    resumes the run, and a hand edit of the file is refused. (Older kits hashed the same text,
    the config written back as YAML.)"""
    return hashlib.sha256((run_dir / runfolder.CONFIG).read_bytes()).hexdigest()


def rng_state() -> dict[str, Any]:
    """Every generator's state as tensors and plain lists: a checkpoint loads with torch's
    weights_only unpickler, which builds nothing else (NumPy's own array would need allowing)."""
    name, keys, position, has_gauss, gauss = np.random.get_state(legacy=True)
    assert isinstance(keys, np.ndarray)  # the legacy form: a tuple, never a dict
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": random.getstate(),
        "numpy": [name, keys.tolist(), position, has_gauss, gauss],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]  # an array in checkpoints of earlier kits; a list now
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *rest))


def save(
    run_dir: Path,
    cfg: Config,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    progress: Progress,
) -> None:
    """Every rank's progress and RNG gathered to rank 0, which writes one file (its rename is the
    commit: a reader sees the whole previous state or the whole new one), then the bare weights.

    The model and optimizer state go into that file whole, or, for a strategy that saves shards
    (FSDP), into a new torch.distributed.checkpoint folder that every rank writes first and the
    file names; the folder of the previous save goes once the file names the new one.
    """
    # Every rank takes part: a sharded strategy gathers or writes its state here.
    strategy = strategies.of(cfg)
    model_state = strategy.model_state(model)  # whole, for the bare model's weights file
    if strategy.saves_shards:
        shards = _save_name(progress)
        folder = runfolder.no_links(run_dir, runfolder.shards_path(run_dir, shards))
        strategy.save_shards(model, optimizer, folder)
        held: dict[str, Any] = {"shards": shards}
    else:
        held = {"model": model_state, "optimizer": strategy.optimizer_state(model, optimizer)}
    mine = {"progress": asdict(progress), "rng": rng_state()}
    ranks = [mine]
    if dist.is_initialized():
        ranks = [None] * dist.get_world_size()  # type: ignore[list-item]
        dist.all_gather_object(ranks, mine)  # also: every rank's shards are written by now
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    state = {
        "schema": runfolder.SCHEMA,
        "config_sha256": config_hash(run_dir),
        "epoch": progress.epoch,
        "batches": progress.batches,
        **held,
        "scaler": scaler.state_dict(),
        "ranks": ranks,
    }
    _write(runfolder.no_links(run_dir, runfolder.state_path(run_dir)), state)
    weights = runfolder.no_links(run_dir, runfolder.checkpoint_path(run_dir))
    _write(weights, model_state)  # weights alone, for a bare model
    if "shards" in held:
        runfolder.drop_other_shards(run_dir, keep=held["shards"])


def _write(path: Path, obj: Any) -> None:
    """torch.save through an atomic file; a full disk or quota is said in words (torch says
    "unexpected pos"), and the file saved before stays whole."""
    runfolder.drop_partials(path)  # an attempt killed in the middle of its save
    try:
        with runfolder.atomic_file(path) as partial:
            torch.save(obj, partial)
    except (OSError, RuntimeError) as err:
        if isinstance(err, RuntimeError) and "inline_container" not in str(err):
            raise  # not torch's file writer failing: a bug, whose traceback helps
        free = shutil.disk_usage(path.parent).free / 2**20
        raise runfolder.RunFolderError(
            f"could not save {path} ({str(err).splitlines()[0][:200]}); {free:.0f} MB free "
            "there: free space (or raise the quota), then `python -m launch resume` the run; "
            "the state saved before is kept"
        ) from None


def _save_name(progress: Progress) -> str:
    """A new shards folder's name, the same on every rank: where training stands, and rank 0's
    clock (two saves at one point, across attempts, never share a folder)."""
    stamp = [time.time_ns()]
    if dist.is_initialized():
        dist.broadcast_object_list(stamp, src=0)
    return f"epoch{progress.epoch}-batch{progress.batches}-{stamp[0]}"


def load(run_dir: Path, cfg: Config, rank: int, world_size: int) -> dict[str, Any] | None:
    """The saved state with this rank's own progress and RNG, or None where none was saved."""
    path = runfolder.saved_state(run_dir)  # a state.pt that is no file is refused, not ignored
    if path is None:
        return None
    try:
        state: dict[str, Any] = _load_data(path)
    except (RuntimeError, EOFError, OSError, pickle.UnpicklingError) as err:
        raise runfolder.RunFolderError(
            f"{path} cannot be read ({str(err).splitlines()[0][:200]}): it was damaged after it was "
            "saved (the kit writes it whole or not at all), so the run cannot resume; start a new "
            "run"
        ) from None
    if misfit := _misfit_layout(state):
        raise runfolder.RunFolderError(unusable(path, misfit))
    if state["config_sha256"] != config_hash(run_dir):
        raise runfolder.RunFolderError(
            f"{path} was saved with other settings than {run_dir / runfolder.CONFIG}: a run "
            "resumes only with its own config; start a new run instead"
        )
    if len(state["ranks"]) != world_size:
        raise runfolder.RunFolderError(
            f"{path} holds {len(state['ranks'])} rank(s) but this job has {world_size}: resume "
            "with the run's own shape (its saved config)"
        )
    if "shards" in state:  # where this rank reads its own shards from
        folder = runfolder.shards_path(run_dir, state["shards"])
        if not (folder / ".metadata").is_file():
            raise runfolder.RunFolderError(
                f"{path} names the shards folder {folder}, which is missing or incomplete: the "
                "model and optimizer state are gone, so the run cannot resume; start a new run"
            )
        state["shards_folder"] = folder
    return {**state, "mine": state["ranks"][rank]}


# Beyond tensors and plain data, what checkpoints of earlier kits hold: NumPy's RNG state, an
# array (rebuilt by NumPy's own reconstructor, which makes arrays and nothing else).
_EARLIER_KITS: list[Any] = [
    np.ndarray((0,)).__reduce__()[0], np.ndarray, np.dtype, type(np.dtype(np.uint32)),
]  # fmt: skip


def _load_data(path: Path) -> dict[str, Any]:
    """The checkpoint's contents, unpickled by torch's weights_only loader: tensors and plain
    data, never code. A run folder is data that others may write, and a crafted state.pt loaded
    in full would run what it names in every rank."""
    try:
        with torch.serialization.safe_globals(_EARLIER_KITS):
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        named = _unsafe_globals(path) if "Weights only load failed" in str(err) else ""
        if not named:
            raise  # not a checkpoint at all: damaged
        raise runfolder.RunFolderError(
            f"{path} holds {named}, which a checkpoint of this kit never holds: it was not "
            "loaded, since loading it could run code; resume only a checkpoint the kit saved, "
            "or start a new run"
        ) from None
    return state  # any value torch builds safely: its layout is `_misfit_layout`'s to judge


def unusable(path: Path, why: str) -> str:
    """The line for a state.pt that loads safely but is none the kit saved for this run."""
    return (
        f"{path} is no training state this run can resume from ({why}): the kit did not save "
        "it for this run, or it was changed since; delete it to start the run over from epoch "
        "1, or put back a good copy of it and resume again"
    )


# RuntimeErrors of the machine or a peer while a state is loaded (by name: torch 2.4 lacks some).
_NOT_THE_FILE: tuple[type[BaseException], ...] = tuple(
    found
    for found in (
        torch.cuda.OutOfMemoryError,
        getattr(torch, "AcceleratorError", None),  # a CUDA error
        getattr(dist, "DistError", None),
    )
    if isinstance(found, type)
)


@contextlib.contextmanager
def applying(path: Path) -> Iterator[None]:
    """Around loading a state of the right layout into the model, optimizer, scaler and RNG:
    values that do not fit them (another model's weights, a hand edit) are said in one line
    naming the file, as a layout that does not fit is, not as a traceback from deep in torch."""
    try:
        yield
    except _NOT_THE_FILE:
        raise  # the machine or a peer failed, not the file
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as err:
        why = " ".join(f"{type(err).__name__}: {err}".split())  # torch's are many lines
        raise runfolder.RunFolderError(unusable(path, why[:300])) from None


# The layout `save` writes, as far as `load` and the loop read it: each field's types. A file of
# another layout loads as safely (tensors and plain data) but would fail deep in the loop.
_STATE_FIELDS: dict[str, tuple[type, ...]] = {
    "config_sha256": (str,),
    "ranks": (list,),
    "scaler": (dict,),
}
_WHOLE_FIELDS: dict[str, tuple[type, ...]] = {"model": (dict,), "optimizer": (dict,)}
_RANK_FIELDS: dict[str, tuple[type, ...]] = {"progress": (dict,), "rng": (dict,)}
_RNG_FIELDS: dict[str, tuple[type, ...]] = {
    "torch": (torch.Tensor,),
    "cuda": (list,),
    "python": (tuple, list),
    "numpy": (list, tuple),
}
_SHARDS_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")  # a folder in checkpoints/shards


def _misfit_layout(state: object) -> str:
    """'' where `state` has the layout `save` writes; else what is wrong with it, in words."""
    if not isinstance(state, dict):
        return f"a {type(state).__name__}, not the kit's saved state"
    if "shards" in state:  # the model and optimizer are in the shards folder it names
        shards = state["shards"]
        if not (isinstance(shards, str) and _SHARDS_NAME.fullmatch(shards)):
            return f"its shards folder {shards!r} is no folder name"  # '../..' leads elsewhere
        wanted = _STATE_FIELDS
    else:
        wanted = _STATE_FIELDS | _WHOLE_FIELDS
    if misfit := _misfit_fields(state, wanted, "it"):
        return misfit
    for rank, mine in enumerate(state["ranks"]):
        if misfit := _misfit_rank(mine, f"rank {rank}'s entry"):
            return misfit
    return ""


def _misfit_rank(mine: object, name: str) -> str:
    if not isinstance(mine, dict):
        return f"{name} is a {type(mine).__name__}, not a dict"
    return (
        _misfit_fields(mine, _RANK_FIELDS, name)
        or _misfit_fields(mine["rng"], _RNG_FIELDS, f"{name}'s rng")
        or _misfit_progress(mine["progress"], f"{name}'s progress")
    )


def _misfit_fields(values: dict[str, Any], wanted: dict[str, tuple[type, ...]], name: str) -> str:
    for key, types in wanted.items():
        if key not in values:
            return f"{name} has no {key!r}"
        if not isinstance(values[key], types):
            kinds = " or ".join(t.__name__ for t in types)
            return f"{name} has a {type(values[key]).__name__} as {key!r}, not a {kinds}"
    return ""


def _misfit_progress(progress: dict[str, Any], name: str) -> str:
    """Progress's fields exactly, each a number of its range (a negative count would be a
    ValueError deep in the sampler)."""
    names = [f.name for f in fields(Progress)]
    if sorted(progress) != sorted(names):
        return f"{name} names {sorted(progress)}, not {names}"
    for key in names:
        value, low = progress[key], 1 if key == "epoch" else 0
        number = (int, float) if key == "loss_sum" else (int,)  # a NaN loss is a loss
        if isinstance(value, bool) or not isinstance(value, number):
            return f"{name} has {value!r} as {key!r}, not a number"
        if key != "loss_sum" and value < low:
            return f"{name} has {value!r} as {key!r}, below {low}"
    return ""


def _unsafe_globals(path: Path) -> str:
    """What the checkpoint names beyond what the loader allows (read, not run); '' where it
    names nothing, or cannot even be listed: a damaged file."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # not a checkpoint torch can list
        return ""
    allowed = {f"{g.__module__}.{g.__qualname__}" for g in _EARLIER_KITS}
    return ", ".join([name for name in names if name not in allowed][:3])
