"""`ddp`: `DistributedDataParallel`, one process per GPU; `dist.comm_hook` compresses its
all-reduce (fp16, bf16, PowerSGD)."""

from __future__ import annotations

import typing

from slurm_ddp_kit.core.settings.schema import CommHook, Config
from slurm_ddp_kit.core.strategies.base import Strategy

if typing.TYPE_CHECKING:
    import torch
    from torch import nn

# PowerSGD's settings: rank-1 approximations after 10 steps of plain all-reduce (its error
# feedback needs a few exact steps first); tensors it would not shrink 2× are sent whole.
POWERSGD_RANK, POWERSGD_START, POWERSGD_MIN_RATE = 1, 10, 2


class DDP(Strategy):
    """One process per GPU; DDP's reducer averages the gradients. With train.cuda_graph the bare
    model is returned: the kit's captured step does DDP's work itself (train.steps)."""

    name, label, order, colour = "ddp", "DDP", 1, "tab:blue"
    summary = "DistributedDataParallel: gradients averaged by all-reduce, one process per GPU"
    program_shape = "one task per GPU"
    always_shown = True  # the article's comparison, and the one every other strategy is held to
    takes_comm_hook = True
    hook_colours: typing.ClassVar[dict[CommHook, str]] = {
        CommHook.fp16: "tab:cyan", CommHook.bf16: "tab:green", CommHook.powersgd: "tab:olive"
    }  # fmt: skip

    def wrap(self, cfg: Config, model: nn.Module, device: torch.device, gpus: int) -> nn.Module:
        import torch
        from torch import nn

        t = cfg.train
        if t.cuda_graph:
            return model
        ids = [device.index] if device.type == "cuda" else None
        wrapped = nn.parallel.DistributedDataParallel(model, device_ids=ids)
        register_hook(wrapped, cfg.dist.comm_hook)
        if not t.compile:
            return wrapped
        return typing.cast("nn.Module", torch.compile(wrapped, mode=t.compile_mode.value))


def register_hook(model: nn.parallel.DistributedDataParallel, hook: CommHook) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

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
