"""`dp`: `nn.DataParallel`, one process driving every GPU of its node."""

from __future__ import annotations

import typing

from slurm_ddp_kit.core.settings.schema import Config, ConfigError
from slurm_ddp_kit.core.strategies.base import Strategy, refuse_compiled

if typing.TYPE_CHECKING:
    import torch
    from torch import nn


class DataParallel(Strategy):
    """One process drives every GPU of the node: scatter, replicate, parallel apply, gather."""

    name, label, order, colour = "dp", "DP", 0, "tab:orange"
    summary = "nn.DataParallel: one process scatters each batch over its node's GPUs"
    per_gpu = False
    program_shape = "one task per node"
    always_shown = True  # the article's comparison: DDP against DP
    cpu_label = "DP (one process, no DataParallel)"
    cpu_note = (
        "without GPUs nn.DataParallel runs the bare model in one process: this group's DP column "
        "(and the comparison with it) is one process against DDP's CPU ranks, not DataParallel"
    )

    def check(self, cfg: Config) -> None:
        super().check(cfg)
        if cfg.cluster.nodes > 1:
            raise ConfigError(
                f"DataParallel runs in one process on one node, but cluster.nodes="
                f"{cfg.cluster.nodes}: use DDP for several nodes (--mode ddp; a sweep's "
                "--modes ddp; slurm/ddp.sbatch), or one node (--nodes 1; sbatch --nodes=1)"
            )
        refuse_compiled(
            cfg, self.name, "{key}=true does not apply to DataParallel (it replicates the model "
            "and starts a thread per GPU at every step): use --mode ddp, or drop it",
        )  # fmt: skip
        if cfg.train.cudnn_benchmark:
            raise ConfigError(
                "train.cudnn_benchmark=true with DataParallel ran 15× slower on 2 × H200 (19 s "
                "per epoch against 1.3 s without it): drop it for DP"
            )

    def wrap(self, cfg: Config, model: nn.Module, device: torch.device, gpus: int) -> nn.Module:
        from torch import nn

        return nn.DataParallel(model, device_ids=list(range(gpus)) or None)  # CPU: bare module

    def scored(self, model: nn.Module) -> nn.Module:
        return model  # DP scores a batch over all its GPUs
