"""`zero`: DDP with the optimizer state sharded over the ranks (`ZeroRedundancyOptimizer`)."""

from __future__ import annotations

import typing
from typing import Any

from slurm_ddp_kit.core.settings.schema import CommHook, Config
from slurm_ddp_kit.core.strategies.base import optimizer_of, refuse_compiled
from slurm_ddp_kit.core.strategies.ddp import DDP

if typing.TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.optim import ZeroRedundancyOptimizer

SHARDED_STEP = (
    "{key}=true is not measured with --mode {name} (its step gathers or broadcasts parameters): "
    "drop {key}, or use --mode ddp"
)


class Zero(DDP):
    """DDP's gradients, with each rank keeping and updating only its share of the optimizer
    state (ZeRO stage 1); the updated parameters are broadcast from their owners."""

    program_shape = ""  # a program on ZeRO's tasks is DDP's shape: --mode ddp

    name, label, order, colour = "zero", "ZeRO", 2, "tab:purple"
    summary = "DDP with the optimizer state sharded over the ranks (ZeroRedundancyOptimizer)"
    always_shown = False
    hook_colours: typing.ClassVar[dict[CommHook, str]] = {}  # its hooked columns in grey

    def check(self, cfg: Config) -> None:
        refuse_compiled(cfg, self.name, SHARDED_STEP)
        super().check(cfg)

    def optimizer(self, cfg: Config, model: nn.Module) -> torch.optim.Optimizer:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        kind, options = optimizer_of(cfg)
        return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=kind, **options)

    def optimizer_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any] | None:
        import torch.distributed as dist

        zero = typing.cast("ZeroRedundancyOptimizer", optimizer)
        zero.consolidate_state_dict(to=0)  # every rank sends its shard to rank 0
        return zero.state_dict() if dist.get_rank() == 0 else None
