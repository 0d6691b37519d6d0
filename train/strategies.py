"""Strategies: how a process wraps the model and its optimizer, and how their state is saved.

One class per strategy, picked by `--mode` (`STRATEGIES[cfg.mode]`); the loop only calls these
methods. The next strategy is one class here, one `Mode` member and its validation in
`train.config`.

- `dp`: `nn.DataParallel`, one process driving every GPU of its node;
- `ddp`: `DistributedDataParallel`, one process per GPU; `dist.comm_hook` compresses its
  all-reduce (fp16, bf16, PowerSGD);
- `zero`: DDP with the optimizer state sharded over the ranks (`ZeroRedundancyOptimizer`);
- `fsdp`: parameters, gradients and optimizer state sharded (PyTorch's `fully_shard`, FSDP2).

Checkpoints hold whole state dicts in the bare model's layout whatever the strategy (a sharded
strategy gathers them first), so the saved weights load into a plain model everywhere.
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from train.config import CommHook, Config, Mode

# Imported where used: these packages pull in DTensor and FSDP, 2 s of every job's start-up
# that only the strategies needing them should pay.
if typing.TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    from torch.distributed.optim import ZeroRedundancyOptimizer

# PowerSGD's settings: rank-1 approximations after 10 steps of plain all-reduce (its error
# feedback needs a few exact steps first); tensors it would not shrink 2× are sent whole.
POWERSGD_RANK, POWERSGD_START, POWERSGD_MIN_RATE = 1, 10, 2


class DDP:
    """One process per GPU; DDP's reducer averages the gradients. With train.cuda_graph the bare
    model is returned: the kit's captured step does DDP's work itself (train.steps)."""

    # Whether every rank must score the same number of batches of the same sizes (a forward is
    # a collective that every rank joins): its share of the test split is then padded.
    even_evaluation = False
    # Whether a checkpoint keeps the model and optimizer state as each rank's shards (a
    # torch.distributed.checkpoint folder) rather than whole in state.pt.
    saves_shards = False

    def wrap(self, cfg: Config, model: nn.Module, device: torch.device, gpus: int) -> nn.Module:
        t = cfg.train
        if t.cuda_graph:
            return model
        ids = [device.index] if device.type == "cuda" else None
        wrapped = nn.parallel.DistributedDataParallel(model, device_ids=ids)
        _register_hook(wrapped, cfg.dist.comm_hook)
        if not t.compile:
            return wrapped
        return typing.cast(nn.Module, torch.compile(wrapped, mode=t.compile_mode.value))

    def optimizer(self, cfg: Config, model: nn.Module) -> torch.optim.Optimizer:
        t = cfg.train
        # The captured step's update is PyTorch's fused SGD: one kernel for all parameters (the
        # default, foreach, takes two); the same arithmetic. GPU only, as the captured step is.
        fused = True if t.cuda_graph else None
        return torch.optim.SGD(model.parameters(), lr=t.lr, momentum=t.momentum, fused=fused)

    def scored(self, model: nn.Module) -> nn.Module:
        """The module evaluation runs: each rank scores its shard with the bare model."""
        return bare(model)

    def model_state(self, model: nn.Module) -> dict[str, Any]:
        """The whole weights in the bare model's layout. Called on every rank (a collective
        where they are sharded)."""
        return bare(model).state_dict()

    def optimizer_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any] | None:
        """Called on every rank (a collective where the state is sharded); rank 0's result is
        the whole state, the one a checkpoint holds."""
        return optimizer.state_dict()

    def load(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        """A checkpoint's whole state back into this rank's model and optimizer."""
        bare(model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    def save_shards(self, model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
        raise NotImplementedError(f"{type(self).__name__} saves its state whole")


class DataParallel(DDP):
    """One process drives every GPU of the node: scatter, replicate, parallel apply, gather."""

    def wrap(self, cfg: Config, model: nn.Module, device: torch.device, gpus: int) -> nn.Module:
        return nn.DataParallel(model, device_ids=list(range(gpus)) or None)  # CPU: bare module

    def scored(self, model: nn.Module) -> nn.Module:
        return model  # DP scores a batch over all its GPUs


class Zero(DDP):
    """DDP's gradients, with each rank keeping and updating only its share of the optimizer
    state (ZeRO stage 1); the updated parameters are broadcast from their owners."""

    def optimizer(self, cfg: Config, model: nn.Module) -> torch.optim.Optimizer:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        t = cfg.train
        return ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.SGD, lr=t.lr, momentum=t.momentum
        )

    def optimizer_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any] | None:
        zero = typing.cast("ZeroRedundancyOptimizer", optimizer)
        zero.consolidate_state_dict(to=0)  # every rank sends its shard to rank 0
        return zero.state_dict() if dist.get_rank() == 0 else None


class FSDP(DDP):
    """Each layer's parameters sharded over the ranks (FSDP2's `fully_shard`, one unit per
    child module that has parameters, then the root): gathered for the layer's forward and
    backward, its gradients reduce-scattered, the optimizer updating the local shard only."""

    even_evaluation = True  # every forward gathers: all ranks must run the same batches
    saves_shards = True  # no rank ever holds the whole state for a checkpoint

    def wrap(self, cfg: Config, model: nn.Module, device: torch.device, gpus: int) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for layer in model.children():
            if next(layer.parameters(), None) is not None:
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    def scored(self, model: nn.Module) -> nn.Module:
        """The model with rank 0's buffers on every rank (every rank calls). FSDP leaves
        buffers, such as BatchNorm's running statistics, to each rank (DDP broadcasts rank 0's
        at every forward): the ranks then score, and a checkpoint saves, one model."""
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
        model_state, optimizer_state = get_state_dict(model, optimizer)
        # In place: each rank's tensors are filled with its own shards.
        dcp.load({"model": model_state, "optimizer": optimizer_state},
                 checkpoint_id=state["shards_folder"])  # fmt: skip
        set_state_dict(model, optimizer, model_state_dict=model_state,
                       optim_state_dict=optimizer_state)  # fmt: skip


def _whole() -> StateDictOptions:
    """Whole (unsharded) state dicts on every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True)


STRATEGIES: dict[Mode, DDP] = {
    Mode.dp: DataParallel(),
    Mode.ddp: DDP(),
    Mode.zero: Zero(),
    Mode.fsdp: FSDP(),
}


def prepare(
    cfg: Config, model: nn.Module, device: torch.device, gpus: int
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The bare model on its device, in the run's memory layout, wrapped by the run's strategy;
    and its optimizer."""
    model = model.to(device)
    if cfg.train.channels_last:
        model = model.to(memory_format=torch.channels_last)
    strategy = STRATEGIES[cfg.mode]
    wrapped = strategy.wrap(cfg, model, device, gpus)
    return wrapped, strategy.optimizer(cfg, wrapped)


def bare(model: nn.Module) -> nn.Module:
    """The model inside its wrappers (compile's, then DP's or DDP's)."""
    model = getattr(model, "_orig_mod", model)
    return typing.cast(nn.Module, getattr(model, "module", model))


def _register_hook(model: nn.parallel.DistributedDataParallel, hook: CommHook) -> None:
    if hook == CommHook.fp16:
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == CommHook.bf16:
        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif hook == CommHook.powersgd:
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=POWERSGD_RANK,
            start_powerSGD_iter=POWERSGD_START,
            min_compression_rate=POWERSGD_MIN_RATE,
        )
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
