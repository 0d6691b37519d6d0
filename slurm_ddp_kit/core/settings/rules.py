"""The rules a config must meet, whoever made it, and the sizes derived from it.

`validate` runs in the launcher before any file is made and again inside the job; its errors name
the key and the fix. What a strategy accepts is the strategy's own rule (`core.strategies`); what
a backend accepts (Slurm's names, GPU type and sbatch options; the local backend's one machine)
is the backend's own, which the launcher checks of every config it reads (`launch.backends`).
"""

from __future__ import annotations

import dataclasses
import math
import re
import unicodedata
from typing import Any

from slurm_ddp_kit.core import strategies
from slurm_ddp_kit.core.settings.schema import (
    DATASETS,
    FACTORY,
    FACTORY_RULE,
    MODELS,
    CommHook,
    CompileMode,
    Config,
    ConfigError,
    ContainerConfig,
    DistBackend,
    Optimizer,
    Precision,
    Task,
)

# Integer settings and their allowed range (inclusive); None: no upper bound.
_RANGES: dict[str, tuple[int, int | None]] = {
    "train.epochs": (1, 1_000_000),
    "train.global_batch_size": (1, 2**31 - 1),
    "train.grad_accum_steps": (1, 2**20),
    "train.seed": (0, 2**32 - 1),  # NumPy's seeds
    "data.train_size": (1, 1_000_000),  # the synthetic set is generated in memory
    "data.test_size": (1, 1_000_000),
    "data.num_workers": (0, 64),
    "data.channels": (1, 64),
    "data.image_size": (8, 1024),  # the ConvNet's two 3×3 convolutions and pooling need 6
    "data.classes": (2, 1_000_000),
    "data.seq_len": (2, 1 << 20),
    "data.vocab": (2, 1 << 24),
    "model.width": (1, 1 << 16),
    "model.depth": (1, 4096),
    "model.heads": (1, 4096),
    # What Slurm takes: beyond these no cluster has the node, and sbatch refuses or overflows.
    "cluster.nodes": (1, 100_000),
    "cluster.gpus_per_node": (1, 64),
    "cluster.cpus_per_task": (1, 4096),
    "cluster.mem_gb": (0, 1 << 20),  # a PiB
    "cluster.timeout_min": (1, 366 * 24 * 60),
    "cluster.signal_delay_s": (0, 65535),  # --signal's largest lead
    "cluster.max_requeues": (0, 10_000),
    "cluster.requeues_without_progress": (0, 1000),
    "dist.timeout_s": (1, 7 * 24 * 3600),
    "output.progress_s": (0, 24 * 3600),
    "code.max_mb": (1, 1 << 20),  # a TiB: a copy made at every submission
}

# What to do instead, for a range whose bound alone does not say it.
_RANGE_FIXES = {"code.max_mb": "to copy no code at all, set code.snapshot=off"}

_DEFAULTS = Config()  # a setting equal to its value here was left unset

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")

NAME_RULE = "letters, digits, '.', '_' and '-' (at most 64, starting with a letter or digit)"


def check_ranges(cfg: Config) -> None:
    """Every count and size within what the kit runs with (the first one out of range raises):
    checked again where settings are read back, as a hand-edited run folder may break them."""
    for key, (low, high) in _RANGES.items():
        _check_range(key, _get(cfg, key), low, high)


def _check_code_folders(folders: list[str]) -> None:
    """Each folder of code.folders a path (whether it is a folder is asked where the launcher
    copies it: the job may start elsewhere)."""
    for folder in folders:
        if not folder.strip():
            raise ConfigError(
                "code.folders holds an empty path: give each folder of code to copy, absolute or "
                "relative to where you launch, e.g. 'code.folders=[../mylib]'"
            )


def _check_program(cfg: Config) -> None:
    """A program decides its own strategy: the kit gives it a shape of tasks, and trains nothing
    of its own (the largest-batch searches are the kit's loop's)."""
    if not strategies.of(cfg).program_shape:
        shapes = [s for s in strategies.STRATEGIES.values() if s.program_shape]
        choices = " or ".join(f"--mode {s.name} ({s.program_shape})" for s in reversed(shapes))
        raise ConfigError(
            f"--mode {cfg.mode} wraps the kit's own loop; a program of yours chooses its strategy "
            f"itself: give {choices}"
        )
    if cfg.task != Task.train:
        raise ConfigError(
            f"task={cfg.task} searches with the kit's own loop, not a program: drop task, or the "
            "program after `--`"
        )
    if not cfg.program[0].strip():
        raise ConfigError("program's first word is empty: give the command to run, e.g. python")


def validate(cfg: Config) -> None:
    """Every rule a config must meet, whoever made it, a backend's own aside; the first one
    broken raises."""
    strategy = strategies.of(cfg)  # an unknown mode first: it names the valid ones
    check_ranges(cfg)
    _check_text(dataclasses.asdict(cfg), "")
    _check_code_folders(cfg.code.folders)
    t, c = cfg.train, cfg.cluster
    if cfg.program:
        _check_program(cfg)
    if not (math.isfinite(t.lr) and t.lr > 0):
        raise ConfigError(f"train.lr={t.lr} must be a positive number, e.g. train.lr=0.01")
    if not 0 < t.target_accuracy <= 1:
        raise ConfigError(
            f"train.target_accuracy={t.target_accuracy} must be in (0, 1], a share of the test "
            "set, e.g. train.target_accuracy=0.985"
        )
    if not 0 <= t.momentum < 1:
        raise ConfigError(f"train.momentum={t.momentum} must be in [0, 1), e.g. 0.9 (0: none)")
    if t.optimizer != Optimizer.sgd and t.momentum != _DEFAULTS.train.momentum:
        raise ConfigError(
            f"train.momentum is SGD's; train.optimizer={t.optimizer} has its own (betas 0.9, "
            "0.999): drop train.momentum, or add train.optimizer=sgd"
        )
    if not (math.isfinite(t.weight_decay) and 0 <= t.weight_decay < 1):
        raise ConfigError(
            f"train.weight_decay={t.weight_decay} must be in [0, 1), e.g. 0.1 (0: none)"
        )
    if cfg.dist.port and not 1024 <= cfg.dist.port <= 65535:
        raise ConfigError(
            f"dist.port={cfg.dist.port} is not a usable port: pick one in 1024–65535, or 0 for the kit's "
            "choice (derived from the job id on Slurm, a free one locally)"
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
    # The strategy's own rules (an unknown mode, DP on several nodes, …); a program's DP shape
    # is one task per node, on as many nodes as it asks.
    if not cfg.program:
        strategy.check(cfg)
    _check_setup(c.setup)
    _check_container(c.container)
    if cfg.program:
        return  # the program brings its own workload, batch and speed options
    _check_workload(cfg)
    _check_batch_split(cfg)
    _check_speed_options(cfg)
    _check_hook(cfg)


DATA_BYTES = 32 << 30  # the embedded patterns and tokens are generated in every rank's memory


def _check_workload(cfg: Config) -> None:
    d = cfg.data
    for key, known in (("data.dataset", DATASETS), ("model.name", MODELS)):
        value = _get(cfg, key)
        if value not in known and not FACTORY.fullmatch(value):
            raise ConfigError(
                f"{key}={value!r} is neither a built-in ({', '.join(known)}) nor {FACTORY_RULE}, "
                f"e.g. {key}={next(iter(known))} or {key}=mypackage.{key.split('.')[0]}s:build"
            )
    _check_shape_settings(cfg)
    sizes = {"data.train_size": 60000, "data.test_size": 10000}
    resized = [key for key, default in sizes.items() if _get(cfg, key) != default]
    if resized and FACTORY.fullmatch(d.dataset):
        raise ConfigError(
            f"{resized[0]} sizes the embedded datasets; data.dataset={d.dataset} gives its own "
            f"samples: drop {resized[0]} (or size the splits in the factory)"
        )
    per_sample = {"patterns": d.channels * d.image_size**2, "tokens": 8 * d.seq_len}
    if (
        d.dataset in per_sample
        and (size := (d.train_size + d.test_size) * per_sample[d.dataset]) > DATA_BYTES
    ):
        fix = "data.image_size" if d.dataset == "patterns" else "data.seq_len"
        raise ConfigError(
            f"data.dataset={d.dataset} of {d.train_size}+{d.test_size} samples is "
            f"{size / 2**30:.0f} GiB, generated in every rank's memory: at most "
            f"{DATA_BYTES >> 30} GiB; lower data.train_size or {fix}"
        )


# Settings that shape one built-in workload, and the dataset or model they belong to.
_SHAPE_SETTINGS = {
    "data.dataset=patterns": ("data.channels", "data.image_size", "data.classes"),
    "data.dataset=tokens": ("data.seq_len", "data.vocab"),
    "model.name=gpt": ("model.width", "model.depth", "model.heads"),
}


def _check_shape_settings(cfg: Config) -> None:
    """A shape setting only where its workload runs; the token model and data only together."""
    for owner, names in _SHAPE_SETTINGS.items():
        key, value = owner.split("=")
        changed = [name for name in names if _get(cfg, name) != _get(_DEFAULTS, name)]
        if changed and _get(cfg, key) != value:
            raise ConfigError(
                f"{changed[0]} sets the shape of {owner}; {key}={_get(cfg, key)} has its own: "
                f"drop {changed[0]}, or add {owner}"
            )
    d, m = cfg.data, cfg.model
    if m.name == "gpt" and d.dataset != "tokens":
        raise ConfigError(
            f"model.name=gpt predicts the next token of data.dataset=tokens; "
            f"data.dataset={d.dataset} gives labelled samples: add data.dataset=tokens"
        )
    if d.dataset == "tokens" and m.name in MODELS and m.name != "gpt":
        raise ConfigError(
            f"data.dataset=tokens gives token sequences, which model.name={m.name} cannot read: "
            "add model.name=gpt (or a factory of your own)"
        )
    if d.dataset == "tokens" and cfg.train.channels_last:
        raise ConfigError(
            "train.channels_last=true lays out images (channels, height, width), but "
            "data.dataset=tokens gives token sequences: drop it"
        )
    if m.width % m.heads:
        raise ConfigError(
            f"model.width={m.width} must split evenly over model.heads={m.heads} attention "
            f"heads: e.g. model.width={m.heads * max(1, m.width // m.heads)}"
        )


def _check_speed_options(cfg: Config) -> None:
    t = cfg.train
    if cfg.task != Task.train and (t.compile or t.cuda_graph):
        key = "train.compile" if t.compile else "train.cuda_graph"
        raise ConfigError(
            f"task={cfg.task} runs eager steps at growing sizes (a graph or a compiled "
            f"model would be rebuilt at every size): drop {key}=true for the search"
        )
    if cfg.task == Task.largest_model and cfg.model.name != "gpt":
        raise ConfigError(
            f"task=largest_model searches the widest model.name=gpt (model.width) that trains; "
            f"model.name={cfg.model.name} has no width to search: add model.name=gpt "
            "data.dataset=tokens"
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


def _check_hook(cfg: Config) -> None:
    t, hook = cfg.train, cfg.dist.comm_hook
    if hook != CommHook.none and t.cuda_graph:
        raise ConfigError(
            f"dist.comm_hook={hook} is a hook of DistributedDataParallel, which train.cuda_graph "
            "replaces with the kit's own all-reduce: drop one of them"
        )


def world_size(cfg: Config) -> int:
    """Processes in the job: one per GPU (DDP and the strategies built on it), one for DP."""
    return cfg.cluster.nodes * tasks_per_node(cfg)


def tasks_per_node(cfg: Config) -> int:
    return strategies.of(cfg).tasks_per_node(cfg.cluster.gpus_per_node)


def cpus_per_task(cfg: Config) -> int:
    """CPUs one task asks for: per GPU it drives (DP's one task drives them all)."""
    return cfg.cluster.cpus_per_task * strategies.of(cfg).gpus_per_task(cfg.cluster.gpus_per_node)


def signal_delay_s(cfg: Config) -> int:
    """The warning signal's lead, fitted to the time limit: never more than half of it."""
    return min(cfg.cluster.signal_delay_s, cfg.cluster.timeout_min * 60 // 2)


def per_rank_batch(cfg: Config) -> int:
    """Samples one process takes per micro-step (DP then scatters it over its GPUs)."""
    return cfg.train.global_batch_size // _batch_parts(cfg)


def _batch_parts(cfg: Config) -> int:
    """The micro-batches a global batch splits into: one per process and accumulation step."""
    return world_size(cfg) * cfg.train.grad_accum_steps


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
    per_gpu = strategies.of(cfg).per_gpu
    needed = local_tasks if per_gpu else cfg.cluster.gpus_per_node
    if gpus_visible == 1 and per_gpu:
        return  # --gpus-per-task: Slurm shows each task only its own GPU
    if needed > gpus_visible:
        raise ConfigError(
            f"cluster.gpus_per_node={cfg.cluster.gpus_per_node} but {gpus_visible} GPU(s) are "
            f"visible here: set cluster.gpus_per_node={gpus_visible} or ask Slurm for more GPUs"
        )


def _check_range(key: str, value: int, low: int, high: int | None) -> None:
    if value < low or (high is not None and value > high):
        allowed = f"at least {low}" if high is None else f"between {low} and {high}"
        fix = f"; {_RANGE_FIXES[key]}" if key in _RANGE_FIXES and value < low else ""
        raise ConfigError(f"{key}={value} must be {allowed}{fix}")


def _check_text(values: Any, key: str) -> None:
    """No setting holds a control character or an invisible one: settings are written into the
    job's batch script, where a line break would start a line (a command) of its own, and a
    zero-width or direction mark would go unseen into an account or partition name."""
    if isinstance(values, dict):
        for name, value in values.items():
            _check_text(name, key)
            _check_text(value, f"{key}.{name}".strip("."))
    elif isinstance(values, list):
        for value in values:
            _check_text(value, key)
    elif isinstance(values, str):
        check_written(key, values)


_UNSEEN = {"Cc", "Cf", "Zl", "Zp"}  # controls, format marks (zero-width, direction), line breaks


def check_written(key: str, text: str) -> None:
    """Refuse a setting's text that holds a character one cannot see in a batch script."""
    bad = next((c for c in text if unicodedata.category(c) in _UNSEEN), None)
    if bad is not None:
        which = (
            f"the control character {bad!r}"
            if unicodedata.category(bad) == "Cc"
            else f"the invisible character U+{ord(bad):04X}"
        )
        raise ConfigError(
            f"{key}={text!r} holds {which}: settings go into the job's batch script; write the "
            "value on one line, in characters that can be seen"
        )


def _check_setup(lines: list[Any]) -> None:
    for line in lines:
        if not isinstance(line, str) or "\n" in line:
            raise ConfigError(
                f"cluster.setup holds {line!r}: it is a list of shell lines, each one string, "
                "e.g. 'cluster.setup=[\"module load cuda\"]'"
            )


def _check_container(c: ContainerConfig) -> None:
    """The words the container's runtime is given: each one word, as the runtime reads them."""
    if c.image.startswith("-") or "," in c.image:
        raise ConfigError(
            f"cluster.container.image={c.image!r} is not an image: a .sif path, a sandbox folder, "
            "or an address such as docker://nvcr.io/nvidia/pytorch:24.05-py3"
        )
    if not c.python.strip():
        raise ConfigError(
            "cluster.container.python is empty: name the image's Python, e.g. python3"
        )
    for mount in c.mounts:
        if "," in mount or not mount.startswith("/"):
            raise ConfigError(
                f"cluster.container.mounts holds {mount!r}: each is one absolute host path, "
                "PATH or PATH:INSIDE, without commas, e.g. 'cluster.container.mounts=[/scratch]'"
            )
    for option in c.options:
        if not option.startswith("-"):
            raise ConfigError(
                f"cluster.container.options holds {option!r}: options only, each one word with "
                "its value, e.g. 'cluster.container.options=[--cleanenv]' or [--container-writable]"
            )


def _check_batch_split(cfg: Config) -> None:
    parts = _batch_parts(cfg)
    batch = cfg.train.global_batch_size
    if batch % parts:
        nearest = max(parts, round(batch / parts) * parts)
        raise ConfigError(
            f"train.global_batch_size={batch} does not split evenly over {world_size(cfg)} rank(s) "
            f"× {cfg.train.grad_accum_steps} accumulation step(s): use a multiple of {parts}, "
            f"e.g. train.global_batch_size={nearest}"
        )


MNIST_TRAIN = 60000  # real MNIST's training split, whatever data.train_size says


def check_batch_fits_data(cfg: Config, samples: int | None = None) -> None:
    """A training run's batch no larger than its training split: a larger one would train on
    the split once an epoch while the run and its table said the larger batch. Asked where a
    run is submitted (preparing the data trains nothing) and by the job; searches run on random
    batches. `samples`: the split's size where it was loaded (a user's dataset's is known only
    from its factory); else the settings tell it."""
    d, batch = cfg.data, cfg.train.global_batch_size
    if cfg.task != Task.train or (samples is None and FACTORY.fullmatch(d.dataset)):
        return
    parts = _batch_parts(cfg)
    if samples is None:
        samples = MNIST_TRAIN if d.dataset == "mnist" else d.train_size
    if batch <= samples:
        return
    fix = f"train.global_batch_size={samples // parts * parts} (a whole epoch a step)"
    if samples < parts and FACTORY.fullmatch(d.dataset):
        fix = f"a training split of {parts} samples or more"
    elif samples < parts:
        fix = f"data.train_size={parts} or more"
    raise ConfigError(
        f"train.global_batch_size={batch} is larger than the {samples} training samples of "
        f"data.dataset={d.dataset}: every epoch would be one step of {samples}; use {fix}"
    )


def _get(cfg: Config, dotted: str) -> Any:
    value: Any = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value
