"""The kit's settings: typed defaults ← an optional YAML file ← `key=value` overrides.

The dataclasses and enums below are the single source of truth: OmegaConf checks types against
them, argparse takes its choices from the enums, and `validate` (run by the launcher before any
file is made, and again inside the job) produces errors that name the key and the fix.
Nothing here imports torch: `launch` and `analysis` read settings without it.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from train.errors import KitError

if typing.TYPE_CHECKING:  # imported where used: readers of many runs never pay for OmegaConf
    from omegaconf import DictConfig
    from omegaconf.errors import OmegaConfBaseException


class ConfigError(KitError):
    """A setting is unknown, of the wrong type or out of range; the message names the fix."""


class Choice(str, Enum):
    """A setting with a fixed set of values; compares equal to its plain string."""

    def __str__(self) -> str:
        return str(self.value)

    @classmethod
    def values(cls) -> list[str]:
        return [member.value for member in cls]


class Mode(Choice):
    """The strategy (train.strategies): every one but DP runs one process per GPU."""

    dp = "dp"  # nn.DataParallel: one process drives every GPU of one node
    ddp = "ddp"  # DistributedDataParallel: one process per GPU, one node or many
    zero = "zero"  # DDP with the optimizer state sharded over the ranks (ZeroRedundancyOptimizer)
    fsdp = "fsdp"  # parameters, gradients and optimizer state sharded (FSDP2's fully_shard)


class CommHook(Choice):
    """What DDP's gradient all-reduce sends (DDP's communication hooks; ddp and zero only)."""

    none = "none"  # the gradients as they are
    fp16 = "fp16"  # cast to float16 for the all-reduce, back after
    bf16 = "bf16"  # cast to bfloat16 likewise
    powersgd = "powersgd"  # low-rank approximations (PowerSGD, rank 1, with error feedback)


class Task(Choice):
    train = "train"
    largest_batch = "largest_batch"  # search the largest global batch that fits


class Precision(Choice):
    fp32 = "fp32"
    bf16 = "bf16"  # autocast
    fp16 = "fp16"  # autocast with a gradient scaler; CUDA only


class CompileMode(Choice):
    """torch.compile's modes that leave CUDA graphs to the kit (train.cuda_graph captures)."""

    default = "default"
    # Inductor times several variants of each kernel and keeps the fastest: minutes of compiling
    # per shape, measured 6 % faster per epoch on the fast path (docs/benchmarks/speed-h200x2).
    max_autotune = "max-autotune-no-cudagraphs"


# What a run trains (train.workloads): a built-in name, or the user's own factory given as
# `package.module:function`, imported in the job from its Python path.
DATASETS = {
    "synthetic": "embedded digits in MNIST's format, generated from the seed: needs nothing",
    "mnist": "real MNIST: fetch it first with `python -m train fetch-mnist`",
    "patterns": "embedded images of data.channels × data.image_size², data.classes classes",
}
MODELS = {
    "convnet": "the pytorch/examples MNIST ConvNet (1.2 M parameters on 28×28 digits)",
    "resnet18": "torchvision's ResNet-18 (11 M parameters), a 3×3 stem for images under 96²",
}
FACTORY = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")
FACTORY_RULE = "a factory `package.module:function` importable in the job"


class Backend(Choice):
    auto = "auto"  # slurm where sbatch exists and is configured, else local
    slurm = "slurm"
    local = "local"


class GpuBinding(Choice):
    node = "node"  # --gpus-per-node; each task picks LOCAL_RANK
    task = "task"  # --gpus-per-task; Slurm shows each task its own GPU


class DistBackend(Choice):
    auto = "auto"  # nccl with CUDA, else gloo
    nccl = "nccl"
    gloo = "gloo"


@dataclass
class TrainConfig:
    epochs: int = 10
    global_batch_size: int = 512  # split over all GPUs (DP) or all ranks (DDP)
    lr: float = 0.01
    momentum: float = 0.9
    seed: int = 0
    precision: Precision = Precision.fp32
    grad_accum_steps: int = 1  # DDP skips the all-reduce on all but the last (no_sync)
    checkpoint: bool = True
    channels_last: bool = False  # NHWC model and inputs (faster convolutions on tensor cores)
    compile: bool = False  # torch.compile the model (GPU; DDP, or one process)
    compile_mode: CompileMode = CompileMode.default  # with train.compile=true
    # The whole DDP step (forward, backward, the kit's bucketed all-reduce, the optimizer) captured
    # as CUDA graphs and replayed: GPU, DDP, fp32 or bf16.
    cuda_graph: bool = False
    cudnn_benchmark: bool = False  # let cuDNN time its algorithms once per shape, keep the fastest


@dataclass
class DataConfig:
    dataset: str = "synthetic"  # one of DATASETS, or a factory package.module:function
    root: str = "data"
    train_size: int = 60000  # embedded datasets only
    test_size: int = 10000  # embedded datasets only
    # The shape of data.dataset=patterns (the digits and MNIST are 1 × 28², 10 classes).
    channels: int = 3
    image_size: int = 32
    classes: int = 10
    num_workers: int = 0
    pin_memory: bool = True  # only where CUDA is available
    # Each GPU holds the whole split as uint8, normalises and gathers its batches itself, in the
    # order DistributedSampler gives: no host work per batch (GPU only).
    on_device: bool = False


@dataclass
class ModelConfig:
    name: str = "convnet"  # one of MODELS, or a factory package.module:function
    dropout: bool = True


@dataclass
class ClusterConfig:
    backend: Backend = Backend.auto
    nodes: int = 1
    gpus_per_node: int = 4  # on a machine without GPUs: that many CPU (gloo) workers for DDP
    gpu_binding: GpuBinding = GpuBinding.node
    cpus_per_task: int = 2  # per GPU: DP's one task gets this × gpus_per_node
    mem_gb: int = 0  # 0: the partition's default
    timeout_min: int = 60
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    exclusive: bool = False
    signal_delay_s: int = 90  # USR2 this long before the time limit (at most half of it)
    max_requeues: int = 3  # on the warning signal: save and requeue, at most this often
    setup: list[str] = field(default_factory=list)  # shell lines before the job, e.g. module load
    sbatch_extra: dict[str, str] = field(default_factory=dict)  # any other #SBATCH --key=value


@dataclass
class DistConfig:
    backend: DistBackend = DistBackend.auto
    port: int = 0  # 0: derived from the job id, so two jobs on one node never collide
    timeout_s: int = 300
    comm_hook: CommHook = CommHook.none


@dataclass
class OutputConfig:
    root: str = "runs"
    name: str = ""  # appended to the run folder's name


@dataclass
class Config:
    mode: Mode = Mode.ddp
    task: Task = Task.train
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    output: OutputConfig = field(default_factory=OutputConfig)


# Integer settings and their allowed range (inclusive); None: no upper bound.
_RANGES: dict[str, tuple[int, int | None]] = {
    "train.epochs": (1, None),
    "train.global_batch_size": (1, None),
    "train.grad_accum_steps": (1, None),
    "train.seed": (0, 2**32 - 1),  # NumPy's seeds
    "data.train_size": (1, 1_000_000),  # the synthetic set is generated in memory
    "data.test_size": (1, 1_000_000),
    "data.num_workers": (0, 64),
    "data.channels": (1, 64),
    "data.image_size": (8, 1024),  # the ConvNet's two 3×3 convolutions and pooling need 6
    "data.classes": (2, 1_000_000),
    "cluster.nodes": (1, None),
    "cluster.gpus_per_node": (1, 64),
    "cluster.cpus_per_task": (1, None),
    "cluster.mem_gb": (0, None),
    "cluster.timeout_min": (1, None),
    "cluster.signal_delay_s": (0, None),
    "cluster.max_requeues": (0, None),
    "dist.timeout_s": (1, None),
}
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
NAME_RULE = "letters, digits, '.', '_' and '-' (at most 64, starting with a letter or digit)"
_SBATCH_KEY = re.compile(r"[a-z][a-z0-9_-]*")


def load_config(
    config_file: str | Path | None = None,
    overrides: Sequence[str] = (),
    mode: str | None = None,
    nodes: int | None = None,
) -> Config:
    """Merge defaults ← file ← overrides (← --mode/--nodes), check it, and return a typed Config."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    layers = [OmegaConf.structured(Config)]
    if config_file is not None:
        layers.append(_read_yaml(Path(config_file)))
    flags = [f"mode={mode}"] * (mode is not None) + [f"cluster.nodes={nodes}"] * (nodes is not None)
    layers.append(_parse_overrides([*overrides, *flags]))
    for layer in layers[1:]:
        _check_keys(OmegaConf.to_container(layer), Config, "")
    try:
        cfg = typing.cast(Config, OmegaConf.to_object(OmegaConf.merge(*layers)))
    except OmegaConfBaseException as err:
        raise ConfigError(_type_error_message(err)) from None
    except (TypeError, ValueError) as err:  # e.g. a list merged into a mapping
        raise ConfigError(f"a setting has the wrong shape: {err}") from None
    validate(cfg)
    return cfg


def to_yaml(cfg: Config) -> str:
    from omegaconf import OmegaConf

    # From plain values: OmegaConf writes a structured config's choices by their Python names,
    # which the reader (by value) would refuse where the two differ (compile_mode).
    return OmegaConf.to_yaml(OmegaConf.create(to_dict(cfg)))


def to_dict(cfg: Config) -> dict[str, Any]:
    """Plain JSON-ready values (choices as their strings)."""
    return typing.cast(dict[str, Any], _plain(dataclasses.asdict(cfg)))


def from_dict(values: dict[str, Any]) -> Config:
    """A Config from `to_dict`'s output, without OmegaConf: fast, for readers of many runs."""
    try:
        return typing.cast(Config, _build(Config, values))
    except (TypeError, ValueError) as err:  # TypeError: an unknown key, or no mapping
        raise ConfigError(f"stored settings do not match this kit's: {err}") from None


def validate(cfg: Config) -> None:
    """Every rule a config must meet, whoever made it; the first one broken raises."""
    for key, (low, high) in _RANGES.items():
        _check_range(key, _get(cfg, key), low, high)
    t, c = cfg.train, cfg.cluster
    if not (math.isfinite(t.lr) and t.lr > 0):
        raise ConfigError(f"train.lr={t.lr} must be a positive number, e.g. train.lr=0.01")
    if not 0 <= t.momentum < 1:
        raise ConfigError(f"train.momentum={t.momentum} must be in [0, 1), e.g. 0.9 (0: none)")
    if cfg.dist.port and not 1024 <= cfg.dist.port <= 65535:
        raise ConfigError(
            f"dist.port={cfg.dist.port} is not a usable port: pick one in 1024–65535, or 0 to "
            "derive it from the job id"
        )
    for key in ("output.root", "data.root"):
        if not str(_get(cfg, key)).strip():
            example = "runs" if key == "output.root" else "data"
            raise ConfigError(f"{key} is empty: name a folder, e.g. {key}={example}")
    if cfg.output.name and not NAME_PATTERN.fullmatch(cfg.output.name):
        raise ConfigError(
            f"output.name={cfg.output.name!r} may hold only {NAME_RULE}: it becomes part of a "
            "folder name and of Slurm's log paths, e.g. output.name=lr-0.1"
        )
    if cfg.mode == Mode.dp and c.nodes > 1:
        raise ConfigError(
            f"DataParallel runs in one process on one node, but cluster.nodes={c.nodes}: "
            "use --mode ddp for several nodes, or --nodes 1"
        )
    if c.backend == Backend.local and c.nodes > 1:
        raise ConfigError(
            f"the local backend runs on one machine; cluster.nodes={c.nodes} needs "
            "cluster.backend=slurm (or --nodes 1)"
        )
    _check_sbatch_extra(c.sbatch_extra)
    _check_setup(c.setup)
    _check_workload(cfg)
    _check_batch_split(cfg)
    _check_speed_options(cfg)
    _check_strategy(cfg)


PATTERN_BYTES = 32 << 30  # the patterns are generated in memory, in every rank


def _check_workload(cfg: Config) -> None:
    d = cfg.data
    for key, known in (("data.dataset", DATASETS), ("model.name", MODELS)):
        value = _get(cfg, key)
        if value not in known and not FACTORY.fullmatch(value):
            raise ConfigError(
                f"{key}={value!r} is neither a built-in ({', '.join(known)}) nor {FACTORY_RULE}, "
                f"e.g. {key}={next(iter(known))} or {key}=mypackage.{key.split('.')[0]}s:build"
            )
    shape = {"data.channels": 3, "data.image_size": 32, "data.classes": 10}
    changed = [key for key, default in shape.items() if _get(cfg, key) != default]
    if changed and d.dataset != "patterns":
        raise ConfigError(
            f"{changed[0]} sets the shape of data.dataset=patterns; data.dataset={d.dataset} has "
            f"its own: drop {changed[0]}, or add data.dataset=patterns"
        )
    if d.dataset == "patterns":
        size = (d.train_size + d.test_size) * d.channels * d.image_size**2
        if size > PATTERN_BYTES:
            raise ConfigError(
                f"data.dataset=patterns of {d.train_size}+{d.test_size} images × {d.channels} × "
                f"{d.image_size}² is {size / 2**30:.0f} GiB, generated in every rank's memory: "
                f"at most {PATTERN_BYTES >> 30} GiB; lower data.train_size or data.image_size"
            )


def _check_speed_options(cfg: Config) -> None:
    t = cfg.train
    if cfg.mode == Mode.dp and (t.compile or t.cuda_graph):
        key = "train.compile" if t.compile else "train.cuda_graph"
        raise ConfigError(
            f"{key}=true does not apply to DataParallel (it replicates the model and starts a "
            "thread per GPU at every step): use --mode ddp, or drop it"
        )
    if cfg.task == Task.largest_batch and (t.compile or t.cuda_graph):
        key = "train.compile" if t.compile else "train.cuda_graph"
        raise ConfigError(
            f"task=largest_batch runs eager steps at growing sizes (a graph or a compiled "
            f"model would be rebuilt at every size): drop {key}=true for the search"
        )
    if cfg.mode == Mode.dp and t.cudnn_benchmark:
        raise ConfigError(
            "train.cudnn_benchmark=true with DataParallel ran 15× slower on 2 × H200 (19 s per "
            "epoch against 1.3 s without it): drop it for DP"
        )
    if t.compile_mode != CompileMode.default and not t.compile:
        raise ConfigError(
            f"train.compile_mode={t.compile_mode} only applies to a compiled model: add "
            "train.compile=true, or drop train.compile_mode"
        )
    if t.cuda_graph and cfg.dist.backend == DistBackend.gloo:
        raise ConfigError(
            "train.cuda_graph=true captures the gradient all-reduce, which only NCCL can do "
            "inside a CUDA graph: use dist.backend=auto (NCCL on GPUs) or drop train.cuda_graph"
        )
    if t.cuda_graph and t.precision == Precision.fp16:
        raise ConfigError(
            "train.cuda_graph=true cannot capture fp16's gradient scaler (it checks for inf on "
            "the host at every step): use train.precision=bf16"
        )


def _check_strategy(cfg: Config) -> None:
    t, hook = cfg.train, cfg.dist.comm_hook
    sharded = cfg.mode in (Mode.zero, Mode.fsdp)
    if sharded and (t.cuda_graph or t.compile):
        key = "train.cuda_graph" if t.cuda_graph else "train.compile"
        raise ConfigError(
            f"{key}=true is not measured with --mode {cfg.mode} (its step gathers or broadcasts "
            f"parameters): drop {key}, or use --mode ddp"
        )
    if cfg.mode == Mode.fsdp and t.precision == Precision.fp16:
        raise ConfigError(
            "train.precision=fp16 with --mode fsdp: its gradient scaler does not handle sharded "
            "gradients; use train.precision=bf16"
        )
    if hook != CommHook.none and cfg.mode not in (Mode.ddp, Mode.zero):
        raise ConfigError(
            f"dist.comm_hook={hook} compresses DistributedDataParallel's all-reduce; --mode "
            f"{cfg.mode} has none: use --mode ddp (or zero), or drop dist.comm_hook"
        )
    if hook != CommHook.none and t.cuda_graph:
        raise ConfigError(
            f"dist.comm_hook={hook} is a hook of DistributedDataParallel, which train.cuda_graph "
            "replaces with the kit's own all-reduce: drop one of them"
        )


def world_size(cfg: Config) -> int:
    """Processes in the job: one per GPU (DDP and the strategies built on it), one for DP."""
    return cfg.cluster.nodes * tasks_per_node(cfg)


def per_gpu(mode: Mode) -> bool:
    """Whether the strategy runs one process per GPU (all but DP)."""
    return mode != Mode.dp


def tasks_per_node(cfg: Config) -> int:
    return cfg.cluster.gpus_per_node if per_gpu(cfg.mode) else 1


def cpus_per_task(cfg: Config) -> int:
    """CPUs one task asks for: per GPU it drives (DP's one task drives them all)."""
    gpus_per_task = 1 if per_gpu(cfg.mode) else cfg.cluster.gpus_per_node
    return cfg.cluster.cpus_per_task * gpus_per_task


def signal_delay_s(cfg: Config) -> int:
    """The warning signal's lead, fitted to the time limit: never more than half of it."""
    return min(cfg.cluster.signal_delay_s, cfg.cluster.timeout_min * 60 // 2)


def per_rank_batch(cfg: Config) -> int:
    """Samples one process takes per micro-step (DP then scatters it over its GPUs)."""
    return cfg.train.global_batch_size // (world_size(cfg) * cfg.train.grad_accum_steps)


def check_hardware(cfg: Config, gpus_visible: int, local_tasks: int) -> None:
    """Refuse a config this machine cannot run: the one check the launcher and the job share.

    `gpus_visible`: CUDA devices this process sees (0 without CUDA); `local_tasks`: this node's
    processes of the job.
    """
    if not gpus_visible:
        if cfg.train.precision == Precision.fp16:
            raise ConfigError("train.precision=fp16 needs CUDA; on CPU use train.precision=bf16")
        if cfg.dist.backend == DistBackend.nccl:
            raise ConfigError("dist.backend=nccl needs CUDA GPUs; on CPU use dist.backend=gloo")
        for key in ("train.compile", "train.cuda_graph", "data.on_device"):
            if _get(cfg, key):
                raise ConfigError(f"{key}=true needs a CUDA GPU and none is visible: drop it")
        return
    needed = cfg.cluster.gpus_per_node if cfg.mode == Mode.dp else local_tasks
    if gpus_visible == 1 and per_gpu(cfg.mode):
        return  # --gpus-per-task: Slurm shows each task only its own GPU
    if needed > gpus_visible:
        raise ConfigError(
            f"cluster.gpus_per_node={cfg.cluster.gpus_per_node} but {gpus_visible} GPU(s) are "
            f"visible here: set cluster.gpus_per_node={gpus_visible} or ask Slurm for more GPUs"
        )


def _check_range(key: str, value: int, low: int, high: int | None) -> None:
    if value < low or (high is not None and value > high):
        allowed = f"at least {low}" if high is None else f"between {low} and {high}"
        raise ConfigError(f"{key}={value} must be {allowed}")


# #SBATCH options the kit writes itself, and the setting that chooses each.
_SBATCH_OWNED = {
    "nodes": "cluster.nodes",
    "N": "cluster.nodes",
    "ntasks-per-node": "--mode (DP: 1 task; else one per GPU) and cluster.gpus_per_node",
    "ntasks": "--mode and cluster.gpus_per_node",
    "gpus-per-node": "cluster.gpus_per_node",
    "gres": "cluster.gpus_per_node",
    "cpus-per-task": "cluster.cpus_per_task",
    "c": "cluster.cpus_per_task",
    "mem": "cluster.mem_gb",
    "time": "cluster.timeout_min",
    "t": "cluster.timeout_min",
    "partition": "cluster.partition",
    "p": "cluster.partition",
    "account": "cluster.account",
    "A": "cluster.account",
    "qos": "cluster.qos",
    "constraint": "cluster.constraint",
    "C": "cluster.constraint",
    "exclusive": "cluster.exclusive",
    "signal": "cluster.signal_delay_s",
    "output": "output.root (the kit names the logs)",
    "error": "output.root (the kit names the logs)",
    "job-name": "output.name",
    "requeue": "cluster.max_requeues",
}


def _check_sbatch_extra(extra: dict[str, Any]) -> None:
    for key, value in extra.items():
        if key in _SBATCH_OWNED:
            raise ConfigError(
                f"cluster.sbatch_extra sets {key}, which the kit writes itself from "
                f"{_SBATCH_OWNED[key]}: set that instead, and drop {key} from cluster.sbatch_extra"
            )
        scalar = isinstance(value, str | int | float | bool)
        if (
            not scalar
            or not _SBATCH_KEY.fullmatch(key)
            or "\n" in str(value)
            or not str(value).strip()
        ):
            raise ConfigError(
                f"cluster.sbatch_extra has {key}={value!r}: keys are sbatch option names without "
                "dashes (e.g. mail-type) and values one non-empty line, e.g. 'cluster.sbatch_extra={mail-type: END}'"
            )


def _check_setup(lines: list[Any]) -> None:
    for line in lines:
        if not isinstance(line, str) or "\n" in line:
            raise ConfigError(
                f"cluster.setup holds {line!r}: it is a list of shell lines, each one string, "
                "e.g. 'cluster.setup=[\"module load cuda\"]'"
            )


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


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value.value if isinstance(value, Enum) else value


def _build(schema: type, values: dict[str, Any]) -> Any:
    """Rebuild a dataclass, the ones nested in it and its enums from plain values.

    An unknown key raises TypeError, a missing one takes its default, a bad choice ValueError.
    """
    fields = dict(values)
    for name, make in _builders(schema).items():
        if name in fields:
            fields[name] = make(fields[name])
    return schema(**fields)


@functools.cache  # once per class: type hints cost far more than building a Config
def _builders(schema: type) -> dict[str, Callable[[Any], Any]]:
    """The fields of a dataclass that are no plain value, and what rebuilds each from one."""
    builders: dict[str, Callable[[Any], Any]] = {}
    for name, hint in typing.get_type_hints(schema).items():
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            builders[name] = functools.partial(_build, hint)
        elif isinstance(hint, type) and issubclass(hint, Enum):
            builders[name] = hint
    return builders


def _read_yaml(path: Path) -> DictConfig:
    from omegaconf import DictConfig, OmegaConf

    if path.is_dir():
        raise ConfigError(
            f"config file {path} is a folder: name a YAML file, e.g. docs/examples/two-nodes.yaml"
        )
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    try:
        loaded = OmegaConf.load(path)
    except Exception as err:  # yaml's own errors carry the line and column
        raise ConfigError(f"config file {path} is not valid YAML: {_yaml_problem(err)}") from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"config file {path} must hold a mapping of settings, not a list")
    return loaded


def _parse_overrides(overrides: Sequence[str]) -> DictConfig:
    from omegaconf import OmegaConf

    items = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(
                f"override {item!r} is not of the form key=value, e.g. train.epochs=3"
            )
        items.append(item if value else f"{key}=''")  # `key=` means the empty string
    for item in items:
        try:
            OmegaConf.from_dotlist([item])
        except Exception as err:  # YAML scanner errors (a value starting with @, `, %, *, !, [ …)
            key, _, value = item.partition("=")
            raise ConfigError(
                f"cannot read the value of {item!r} ({_first_line(err)}): a value starting with a "
                f"special character needs quotes inside the argument, e.g. '{key}=\"{value}\"'"
            ) from None
    return OmegaConf.from_dotlist(items)


def _yaml_problem(err: Exception) -> str:
    """YAML's problem and where it is, on one line (its message spreads them over four)."""
    problem, mark = getattr(err, "problem", None), getattr(err, "problem_mark", None)
    if not problem or mark is None:
        return _first_line(err)
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"


def _first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def _check_keys(node: Any, schema: type, prefix: str) -> None:
    """Every key must be a field of its dataclass; the error lists the valid ones."""
    if not isinstance(node, dict):
        return
    fields = {f.name: f for f in dataclasses.fields(schema)}
    hints = typing.get_type_hints(schema)
    for key, value in node.items():
        if key not in fields:
            raise ConfigError(_unknown_key_message(f"{prefix}{key}", str(key), sorted(fields)))
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            if not isinstance(value, dict):
                raise ConfigError(
                    f"{prefix}{key}={value!r} is a group of settings, not a value: set one of its "
                    f"keys, e.g. {prefix}{key}.{dataclasses.fields(typing.cast(type, hint))[0].name}=…"
                )
            _check_keys(value, typing.cast(type, hint), f"{prefix}{key}.")
        elif typing.get_origin(hint) in (dict, list) and not isinstance(
            value, typing.get_origin(hint)
        ):
            shape = (
                "a mapping, e.g. {mail-type: END}"
                if typing.get_origin(hint) is dict
                else "a list, e.g. [a, b]"
            )
            raise ConfigError(f"{prefix}{key}={value!r} must be {shape}")
        elif isinstance(hint, type) and issubclass(hint, Choice) and value not in hint.values():
            raise ConfigError(
                f"{prefix}{key}={value!r} is not valid; choose one of: {', '.join(hint.values())}"
            )


def _unknown_key_message(full_key: str, key: str, valid: list[str]) -> str:
    close = [v for v in valid if v.startswith(key)] or difflib.get_close_matches(key, valid, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return f"unknown setting {full_key!r}.{hint} Valid keys here: {', '.join(valid)}"


def _type_error_message(err: OmegaConfBaseException) -> str:
    key = getattr(err, "full_key", None) or "?"
    return f"setting {key!r} has the wrong type: {_first_line(err)}"
