"""What a strategy is: its process shape, the options it takes, how the job wraps and saves its
model, and how the table labels it.

A strategy is one module of this package defining one `Strategy` subclass; the registry
(`core.strategies`) finds it by itself. The description (class attributes, `check`) is torch-free,
for the launcher and the analysis; the job-side methods import torch when a job calls them.

Checkpoints hold whole state dicts in the bare model's layout whatever the strategy (a sharded one
gathers them first), so the saved weights load into a plain model everywhere.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from slurm_ddp_kit.core.settings.schema import CommHook, Config, ConfigError, Optimizer

if typing.TYPE_CHECKING:
    import torch
    from torch import nn

# What a communication hook is called in the table (DDP's hooks: ddp and zero take them).
HOOK_LABELS = {
    CommHook.fp16: "fp16 hook",
    CommHook.bf16: "bf16 hook",
    CommHook.powersgd: "PowerSGD",
}
OTHER_COLOUR = "tab:gray"


@dataclass(frozen=True)
class Column:
    """One column of the comparison table: a strategy, or a strategy with a communication hook
    (`key` is what `analysis` files a run under: the mode, `+hook` where one is set)."""

    key: str
    label: str
    colour: str
    always_shown: bool  # shown even where a group ran none of it
    # Its heading and a note under the table where the runs had no GPU, if it then runs as
    # something other than what its label says ("" where it does not).
    cpu_label: str = ""
    cpu_note: str = ""


class Strategy:
    """The base every strategy derives from; its job-side defaults keep the state whole."""

    name: ClassVar[str]  # the value of --mode
    label: ClassVar[str]  # its column in the table and the plots
    summary: ClassVar[str]  # one line for --help
    order: ClassVar[int]  # its place among the table's columns
    colour: ClassVar[str] = OTHER_COLOUR  # its colour in the plots
    hook_colours: ClassVar[dict[CommHook, str]] = {}  # its columns with a communication hook
    # Process shape: one process per GPU, or one per node driving all the node's GPUs.
    per_gpu: ClassVar[bool] = True
    always_shown: ClassVar[bool] = False  # a column even where no run of it is in a group
    # A shape for a user's program (`program`): its tasks, and nothing of the kit's wrapping.
    program_shape: ClassVar[str] = ""
    # Where it runs without GPUs as something its label does not say: its heading then, and why.
    cpu_label: ClassVar[str] = ""
    cpu_note: ClassVar[str] = ""
    takes_comm_hook: ClassVar[bool] = False  # whether dist.comm_hook applies
    # Whether every rank must score the same number of batches of the same sizes (a forward is a
    # collective that every rank joins): its share of the test split is then padded.
    even_evaluation: ClassVar[bool] = False
    # Whether a checkpoint keeps the model and optimizer state as each rank's shards (a
    # torch.distributed.checkpoint folder) rather than whole in state.pt.
    saves_shards: ClassVar[bool] = False

    # --- the description: torch-free ---------------------------------------------------------

    def check(self, cfg: Config) -> None:
        """Refuse the settings this strategy cannot run, naming the fix (ConfigError)."""
        hook = cfg.dist.comm_hook
        if hook != CommHook.none and not self.takes_comm_hook:
            raise ConfigError(
                f"dist.comm_hook={hook} compresses DistributedDataParallel's all-reduce; --mode "
                f"{self.name} has none: use --mode ddp (or zero), or drop dist.comm_hook"
            )

    def tasks_per_node(self, gpus_per_node: int) -> int:
        return gpus_per_node if self.per_gpu else 1

    def gpus_per_task(self, gpus_per_node: int) -> int:
        return 1 if self.per_gpu else gpus_per_node

    def columns(self) -> list[Column]:
        """This strategy's columns in the table: its own, then one per communication hook."""
        hooks = HOOK_LABELS if self.takes_comm_hook else {}
        own = Column(
            self.name, self.label, self.colour, self.always_shown, self.cpu_label, self.cpu_note
        )
        return [own] + [
            Column(self.column_key(hook), f"{self.label} + {text}",
                   self.hook_colours.get(hook, OTHER_COLOUR), False)
            for hook, text in hooks.items()
        ]  # fmt: skip

    def column_key(self, hook: CommHook) -> str:
        """The column a run of this strategy with `hook` is filed under."""
        return self.name if hook == CommHook.none else f"{self.name}+{hook}"

    # --- the job side: imports torch where called ----------------------------------------------

    def wrap(self, cfg: Config, model: nn.Module, device: torch.device, gpus: int) -> nn.Module:
        raise NotImplementedError

    def optimizer(self, cfg: Config, model: nn.Module) -> torch.optim.Optimizer:
        kind, options = optimizer_of(cfg)
        return kind(model.parameters(), **options)

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


def bare(model: nn.Module) -> nn.Module:
    """The model inside its wrappers (compile's, then DP's or DDP's)."""
    model = getattr(model, "_orig_mod", model)
    return typing.cast("nn.Module", getattr(model, "module", model))


def refuse_compiled(cfg: Config, name: str, why: str) -> None:
    """Refuse train.compile and train.cuda_graph for a strategy whose step they do not cover."""
    t = cfg.train
    if t.compile or t.cuda_graph:
        key = "train.compile" if t.compile else "train.cuda_graph"
        raise ConfigError(why.format(key=key, name=name))


def optimizer_of(cfg: Config) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """The run's optimizer class and its settings (every strategy's, ZeRO's sharded too)."""
    import torch

    t = cfg.train
    # The captured step's update is fused: one kernel for all parameters (the default, foreach,
    # takes two), the same arithmetic, and for AdamW its step count on the GPU, as a graph
    # needs. GPU only, as the captured step is.
    fused = True if t.cuda_graph else None
    if t.optimizer == Optimizer.adamw:
        adamw = {"capturable": True} if t.cuda_graph else {}
        options = {"lr": t.lr, "weight_decay": t.weight_decay, "fused": fused, **adamw}
        return torch.optim.AdamW, options
    options = {"lr": t.lr, "momentum": t.momentum, "weight_decay": t.weight_decay, "fused": fused}
    return torch.optim.SGD, options
