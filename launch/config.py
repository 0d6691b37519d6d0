"""The kit's settings: typed defaults ← an optional YAML file ← `key=value` overrides.

The dataclasses below are the single source of truth: OmegaConf checks types against them, and the
key check and the choice table below produce errors that name the key and the valid alternatives.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException


class ConfigError(ValueError):
    """A setting is unknown, of the wrong type or out of range; the message names the fix."""


@dataclass
class TrainConfig:
    epochs: int = 10
    global_batch_size: int = 512  # split over all GPUs (DP) or all ranks (DDP)
    lr: float = 0.01
    momentum: float = 0.9
    seed: int = 0
    precision: str = "fp32"  # fp32 | bf16 | fp16 (autocast; fp16 adds a gradient scaler)
    grad_accum_steps: int = 1  # DDP skips the all-reduce on all but the last (no_sync)
    checkpoint: bool = True


@dataclass
class DataConfig:
    dataset: str = "synthetic"  # synthetic (embedded, needs nothing) | mnist (fetch it first)
    root: str = "data"
    train_size: int = 60000  # synthetic only
    test_size: int = 10000  # synthetic only
    num_workers: int = 0
    pin_memory: bool = True  # only where CUDA is available


@dataclass
class ModelConfig:
    name: str = "convnet"  # the pytorch/examples MNIST ConvNet
    dropout: bool = True


@dataclass
class ClusterConfig:
    backend: str = "auto"  # auto (slurm where sbatch exists) | slurm | local
    nodes: int = 1
    gpus_per_node: int = 4  # on a machine without GPUs: that many CPU (gloo) workers for DDP
    gpu_binding: str = (
        "node"  # node: --gpus-per-node, task picks LOCAL_RANK | task: --gpus-per-task
    )
    cpus_per_task: int = 2
    mem_gb: int = 0  # 0: the partition's default
    timeout_min: int = 60
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    exclusive: bool = False
    signal_delay_s: int = 90  # USR2 this long before the time limit
    setup: list[str] = field(default_factory=list)  # shell lines before the job, e.g. module load
    sbatch_extra: dict[str, str] = field(default_factory=dict)  # any other #SBATCH --key=value


@dataclass
class DistConfig:
    backend: str = "auto"  # auto (nccl with CUDA, else gloo) | nccl | gloo
    port: int = 0  # 0: derived from the job id, so two jobs on one node never collide
    timeout_s: int = 300


@dataclass
class OutputConfig:
    root: str = "runs"
    name: str = ""  # appended to the run folder's name


@dataclass
class Config:
    mode: str = "ddp"  # dp | ddp
    task: str = "train"  # train | largest_batch (search the largest global batch that fits)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    output: OutputConfig = field(default_factory=OutputConfig)


CHOICES: dict[str, tuple[str, ...]] = {
    "mode": ("dp", "ddp"),
    "task": ("train", "largest_batch"),
    "train.precision": ("fp32", "bf16", "fp16"),
    "data.dataset": ("synthetic", "mnist"),
    "model.name": ("convnet",),
    "cluster.backend": ("auto", "slurm", "local"),
    "cluster.gpu_binding": ("node", "task"),
    "dist.backend": ("auto", "nccl", "gloo"),
}

_AT_LEAST_ONE = (
    "train.epochs",
    "train.global_batch_size",
    "train.grad_accum_steps",
    "data.train_size",
    "data.test_size",
    "cluster.nodes",
    "cluster.gpus_per_node",
    "cluster.cpus_per_task",
    "cluster.timeout_min",
)


def load_config(
    config_file: str | Path | None = None,
    overrides: Sequence[str] = (),
    mode: str | None = None,
    nodes: int | None = None,
) -> Config:
    """Merge defaults ← file ← overrides (← --mode/--nodes), check it, and return a typed Config."""
    layers = [OmegaConf.structured(Config)]
    if config_file is not None:
        layers.append(_read_yaml(Path(config_file)))
    flags = [f"mode={mode}"] * (mode is not None) + [f"cluster.nodes={nodes}"] * (nodes is not None)
    layers.append(_parse_overrides([*overrides, *flags]))
    for layer in layers[1:]:
        _check_keys(OmegaConf.to_container(layer), Config, "")
    try:
        merged = OmegaConf.merge(*layers)
        cfg = typing.cast(Config, OmegaConf.to_object(merged))
    except OmegaConfBaseException as err:
        raise ConfigError(_type_error_message(err)) from None
    validate(cfg)
    return cfg


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def save(cfg: Config, path: Path) -> None:
    path.write_text(to_yaml(cfg))


def load_saved(path: Path) -> Config:
    """Read a config.yaml that `save` wrote (a run folder's), checked like any other."""
    if not path.is_file():
        raise ConfigError(f"{path} does not exist: is this a run folder made by `launch submit`?")
    return load_config(config_file=path)


def validate(cfg: Config) -> None:
    for key, choices in CHOICES.items():
        value = _get(cfg, key)
        if value not in choices:
            raise ConfigError(f"{key}={value!r} is not valid; choose one of: {', '.join(choices)}")
    for key in _AT_LEAST_ONE:
        if _get(cfg, key) < 1:
            raise ConfigError(f"{key}={_get(cfg, key)} must be at least 1")
    if cfg.mode == "dp" and cfg.cluster.nodes > 1:
        raise ConfigError(
            f"DataParallel runs in one process on one node, but cluster.nodes={cfg.cluster.nodes}: "
            "use --mode ddp for several nodes, or --nodes 1"
        )
    _check_batch_split(cfg)


def world_size(cfg: Config) -> int:
    """Processes in the job: one per GPU for DDP, one in all for DP."""
    return cfg.cluster.nodes * cfg.cluster.gpus_per_node if cfg.mode == "ddp" else 1


def per_rank_batch(cfg: Config) -> int:
    """Samples one process takes per micro-step (DP then scatters it over its GPUs)."""
    return cfg.train.global_batch_size // (world_size(cfg) * cfg.train.grad_accum_steps)


def _check_batch_split(cfg: Config) -> None:
    parts = world_size(cfg) * cfg.train.grad_accum_steps
    batch = cfg.train.global_batch_size
    if batch % parts:
        nearest = max(parts, round(batch / parts) * parts)
        raise ConfigError(
            f"train.global_batch_size={batch} does not split evenly over {world_size(cfg)} rank(s) "
            f"× {cfg.train.grad_accum_steps} accumulation step(s): use a multiple of {parts}, "
            f"e.g. train.global_batch_size={nearest}"
        )


def _get(cfg: Config, dotted: str) -> Any:
    value: Any = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def _read_yaml(path: Path) -> DictConfig:
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        loaded = OmegaConf.load(path)
    except Exception as err:  # yaml's own errors carry the line and column
        raise ConfigError(f"config file {path} is not valid YAML: {err}") from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"config file {path} must hold a mapping of settings, not a list")
    return loaded


def _parse_overrides(overrides: Sequence[str]) -> DictConfig:
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(
                f"override {item!r} is not of the form key=value, e.g. train.epochs=3"
            )
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except OmegaConfBaseException as err:
        raise ConfigError(f"cannot read overrides {list(overrides)}: {err}") from None


def _check_keys(node: Any, schema: type, prefix: str) -> None:
    """Every key must be a field of its dataclass; the error lists the valid ones."""
    if not isinstance(node, dict):
        return
    fields = {f.name: f for f in dataclasses.fields(schema)}
    hints = typing.get_type_hints(schema)
    for key, value in node.items():
        if key not in fields:
            raise ConfigError(_unknown_key_message(f"{prefix}{key}", str(key), sorted(fields)))
        if dataclasses.is_dataclass(hints[key]):
            _check_keys(value, hints[key], f"{prefix}{key}.")


def _unknown_key_message(full_key: str, key: str, valid: list[str]) -> str:
    close = [v for v in valid if v.startswith(key)] or difflib.get_close_matches(key, valid, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return f"unknown setting {full_key!r}.{hint} Valid keys here: {', '.join(valid)}"


def _type_error_message(err: OmegaConfBaseException) -> str:
    key = getattr(err, "full_key", None) or "?"
    first_line = str(err).splitlines()[0]
    return f"setting {key!r} has the wrong type: {first_line}"
