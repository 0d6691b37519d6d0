"""How a run is named in the table: its strategy, model, dataset and optimizer in words, its speed
options, and the settings that set it apart from the defaults (the group a row belongs to)."""

from __future__ import annotations

import enum
import functools
from typing import Any

from slurm_ddp_kit.core import strategies
from slurm_ddp_kit.core.settings.schema import CompileMode, Config

# Settings that change a run's figures and have no words of their own in a group's heading: runs
# that differ in one are never pooled, and the heading names those not at their defaults.
OTHER_SETTINGS = (
    "train.lr",
    "train.momentum",
    "train.seed",
    "model.dropout",
    "data.num_workers",
    "data.pin_memory",
    "dist.backend",
)


def other_settings(cfg: Config) -> str:
    """'train.lr=0.02, train.seed=3': the OTHER_SETTINGS the run changed ('' for none)."""
    changed = [key for key in OTHER_SETTINGS if _setting(cfg, key) != _default(key)]
    return ", ".join(f"{key}={_setting(cfg, key)}" for key in changed)


@functools.cache
def _default(key: str) -> Any:
    return _setting(Config(), key)


def _setting(cfg: Config, key: str) -> Any:
    value: Any = functools.reduce(getattr, key.split("."), cfg)
    return value.value if isinstance(value, enum.Enum) else value


def dataset_label(cfg: Config) -> str:
    """The dataset as the table names it: with its shape where the settings choose one."""
    d = cfg.data
    if d.dataset == "patterns":
        return f"patterns {d.channels}×{d.image_size}² ({d.classes} classes)"
    if d.dataset == "tokens":
        return f"tokens (sequences of {d.seq_len}, vocabulary {d.vocab})"
    return d.dataset


def optimizer_label(cfg: Config) -> str:
    """The optimizer and its weight decay where one is set ('sgd': the article's)."""
    t = cfg.train
    return f"{t.optimizer}{f' (weight decay {t.weight_decay:g})' if t.weight_decay else ''}"


def model_label(cfg: Config, width: bool = True) -> str:
    """The model as the table names it: with its size where the settings choose one (without
    the width: the family a largest-model search searched)."""
    m = cfg.model
    if m.name == "gpt":
        return f"gpt {f'width {m.width}, ' if width else ''}depth {m.depth}, {m.heads} heads"
    return m.name


def strategy_key(cfg: Config) -> str:
    """The run's column in the table: its mode, and the communication hook where one is set."""
    return strategies.of(cfg).column_key(cfg.dist.comm_hook)


def _compiled(cfg: Config) -> str:
    mode = cfg.train.compile_mode
    return "compile" if mode == CompileMode.default else f"compile ({mode})"


def speed_options(cfg: Config) -> str:
    """The speed settings a run turned on, in words ('none': the plain path)."""
    chosen = [
        name
        for name, on in (
            ("data on device", cfg.data.on_device),
            ("channels_last", cfg.train.channels_last),
            ("cudnn benchmark", cfg.train.cudnn_benchmark),
            (_compiled(cfg), cfg.train.compile),
            ("CUDA graph", cfg.train.cuda_graph),
        )
        if on
    ]
    return ", ".join(chosen) or "none"
