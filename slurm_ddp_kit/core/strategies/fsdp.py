"""`fsdp`: parameters, gradients and optimizer state sharded (PyTorch's `fully_shard`, FSDP2)."""

from __future__ import annotations

import pickle
import typing
from pathlib import Path
from typing import Any

from slurm_ddp_kit.core.settings.schema import Config, ConfigError, Precision
from slurm_ddp_kit.core.strategies.base import Strategy, refuse_compiled
from slurm_ddp_kit.core.strategies.zero import SHARDED_STEP

if typing.TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.checkpoint.state_dict import StateDictOptions


class FSDP(Strategy):
    """Each layer's parameters sharded over the ranks (FSDP2's `fully_shard`, one unit per
    child module that has parameters, then the root): gathered for the layer's forward and
    backward, its gradients reduce-scattered, the optimizer updating the local shard only."""

    name, label, order, colour = "fsdp", "FSDP", 3, "tab:red"
    summary = "parameters, gradients and optimizer state sharded (FSDP2's fully_shard)"
    even_evaluation = True  # every forward gathers: all ranks must run the same batches
    saves_shards = True  # no rank ever holds the whole state for a checkpoint

    def check(self, cfg: Config) -> None:
        refuse_compiled(cfg, self.name, SHARDED_STEP)
        if cfg.train.precision == Precision.fp16:
            raise ConfigError(
                "train.precision=fp16 with --mode fsdp: its gradient scaler does not handle "
                "sharded gradients; use train.precision=bf16"
            )
        super().check(cfg)

    def wrap(self, cfg: Config, model: nn.Module, device: torch.device, gpus: int) -> nn.Module:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for layer in shard_units(model):
            if next(layer.parameters(), None) is not None:
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    def scored(self, model: nn.Module) -> nn.Module:
        """The model with rank 0's buffers on every rank (every rank calls). FSDP leaves
        buffers, such as BatchNorm's running statistics, to each rank (DDP broadcasts rank 0's
        at every forward): the ranks then score, and a checkpoint saves, one model."""
        import torch.distributed as dist

        for buffer in model.buffers():
            dist.broadcast(buffer, 0)
        return model

    def model_state(self, model: nn.Module) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(model, options=_whole())

    def save_shards(self, model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
        """Each rank writes its own shards of the model and optimizer state (every rank calls)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=folder)

    def load(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        """From the shards folder state.pt names (each rank reads its own shards), or from the
        whole state dicts an older checkpoint holds."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        if "shards_folder" not in state:
            set_state_dict(model, optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optimizer"], options=_whole())  # fmt: skip
            return
        folder = state["shards_folder"]
        reader = shards_reader(folder)
        reader.read_metadata()  # refused here in one line, not inside dcp's collective
        model_state, optimizer_state = get_state_dict(model, optimizer)
        # In place: each rank's tensors are filled with its own shards.
        dcp.load({"model": model_state, "optimizer": optimizer_state},
                 checkpoint_id=folder, storage_reader=reader)  # fmt: skip
        set_state_dict(model, optimizer, model_state_dict=model_state,
                       optim_state_dict=optimizer_state)  # fmt: skip


def shards_reader(folder: Path) -> Any:
    """torch.distributed.checkpoint's reader of a shards folder, but for its metadata file (a
    pickle), unpickled with only the types such metadata is made of: torch's own reader
    unpickles anything, and a run folder is data that others may write."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(path, "rb") as stream:
                metadata = _MetadataUnpickler(stream, path).load()
            if getattr(metadata, "storage_meta", None) is None:  # as torch's reader does
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return _Reader(folder)


class _MetadataUnpickler(pickle.Unpickler):
    """Builds the types of a shards folder's metadata and nothing else (no function to call)."""

    _ALLOWED: typing.ClassVar[dict[str, set[str]]] = {
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
        "torch.serialization": {"_get_layout"},  # a layout by its name
        "torch": {"Size"},
        "pathlib": {"PosixPath", "PurePosixPath", "Path"},
        "collections": {"OrderedDict"},
    }

    def __init__(self, stream: Any, path: object) -> None:
        super().__init__(stream)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        import torch

        found = super().find_class(module, name) if module in self._known else None
        metadata_type = module == "torch.distributed.checkpoint.metadata" and isinstance(
            found, type
        )
        if metadata_type or name in self._ALLOWED.get(module, ()) or isinstance(found, torch.dtype):
            return found
        from slurm_ddp_kit.core.runfolder import RunFolderError

        raise RunFolderError(
            f"{self.path} names {module}.{name}, which a shards folder of this kit never holds: "
            "it was not loaded, since loading it could run code; resume only shards the kit "
            "saved, or start a new run"
        )

    _known: typing.ClassVar[frozenset[str]] = frozenset(
        {"torch.distributed.checkpoint.metadata", "torch", *_ALLOWED}
    )


def _whole() -> StateDictOptions:
    """Whole (unsharded) state dicts on every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True)


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The model's layers, each a unit gathered for its own forward and backward: its children,
    and a list of blocks (a ModuleList, which has no forward of its own) block by block, so that
    a transformer holds one whole block at a time."""
    from torch import nn

    units: list[nn.Module] = []
    for child in model.children():
        units += list(child.children()) if isinstance(child, nn.ModuleList) else [child]
    return units
