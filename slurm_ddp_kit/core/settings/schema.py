"""The settings' schema: typed dataclasses and the choices of each setting.

The single source of truth for what a setting is called and what type it has: OmegaConf checks
types against these dataclasses (`core.settings.loading`), argparse takes its choices from the
enums, and the strategies (`core.strategies`) name the valid modes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum

from slurm_ddp_kit.core.errors import KitError


class ConfigError(KitError):
    """A setting is unknown, of the wrong type or out of range; the message names the fix."""


class Choice(str, Enum):
    """A setting with a fixed set of values; compares equal to its plain string."""

    def __str__(self) -> str:
        return str(self.value)

    @classmethod
    def values(cls) -> list[str]:
        return [member.value for member in cls]


class CommHook(Choice):
    """What DDP's gradient all-reduce sends (DDP's communication hooks; ddp and zero only)."""

    none = "none"  # the gradients as they are
    fp16 = "fp16"  # cast to float16 for the all-reduce, back after
    bf16 = "bf16"  # cast to bfloat16 likewise
    powersgd = "powersgd"  # low-rank approximations (PowerSGD, rank 1, with error feedback)


class Task(Choice):
    train = "train"
    largest_batch = "largest_batch"  # search the largest global batch that fits
    largest_model = "largest_model"  # search the widest model.name=gpt that trains at the batch


class Optimizer(Choice):
    sgd = "sgd"  # with train.momentum: the article's
    adamw = "adamw"  # AdamW (betas 0.9, 0.999): what transformers train with; twice SGD's state


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
    "tokens": "embedded token sequences of data.seq_len from data.vocab, for model.name=gpt",
}

MODELS = {
    "convnet": "the pytorch/examples MNIST ConvNet (1.2 M parameters on 28×28 digits)",
    "resnet18": "torchvision's ResNet-18 (11 M parameters), a 3×3 stem for images under 96²",
    "gpt": "a decoder-only transformer of model.width/depth/heads, for data.dataset=tokens",
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


class ContainerRuntime(Choice):
    apptainer = "apptainer"  # `apptainer exec IMAGE` wraps each task's command (Singularity too)
    pyxis = "pyxis"  # srun --container-image (pyxis/enroot, on clusters that have the plugin)


class Requeue(Choice):
    """How Slurm holds the job after a requeue (sbatch's --requeue[=expedite])."""

    normal = "normal"  # eligible again after the cluster's hold (cred_expire or requeue_delay)
    # Slurm 25.11 and later, where SlurmctldParameters has enable_expedited_requeue: eligible at
    # once, first in the queue, and requeued by Slurm itself when its node fails.
    expedite = "expedite"


class Snapshot(Choice):
    """Whether a run's jobs run a copy of the code made at submission (`core.snapshot`)."""

    auto = "auto"  # copy where the copy is at most code.max_mb, else run the live code, warned
    on = "on"  # always copy: over code.max_mb is an error
    off = "off"  # run the live code: an edit after submission changes what the jobs run


class DistBackend(Choice):
    auto = "auto"  # nccl with CUDA, else gloo
    nccl = "nccl"
    gloo = "gloo"


@dataclass
class TrainConfig:
    epochs: int = 10
    global_batch_size: int = 512  # split over all GPUs (DP) or all ranks (DDP)
    lr: float = 0.01
    optimizer: Optimizer = Optimizer.sgd
    momentum: float = 0.9  # SGD's
    weight_decay: float = 0.0
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
    # The test accuracy whose first reaching the table times (time to accuracy, as MLPerf counts).
    target_accuracy: float = 0.985


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
    # The shape of data.dataset=tokens: sequences of seq_len tokens from a vocabulary of vocab.
    seq_len: int = 128
    vocab: int = 256
    num_workers: int = 0
    pin_memory: bool = True  # only where CUDA is available
    # Each GPU holds the whole split as uint8, normalises and gathers its batches itself, in the
    # order DistributedSampler gives: no host work per batch (GPU only).
    on_device: bool = False


@dataclass
class ModelConfig:
    name: str = "convnet"  # one of MODELS, or a factory package.module:function
    dropout: bool = True
    # The size of model.name=gpt: its embedding width, its number of blocks and of attention heads.
    width: int = 256
    depth: int = 4
    heads: int = 4


@dataclass
class ContainerConfig:
    """Each task inside a container (`image` empty: none). The image needs Python with torch,
    submitit, omegaconf and pandas; the kit's checkout, the user's code (the launching
    PYTHONPATH's folders, the factories' folders), output.root and data.root are mounted."""

    image: str = ""  # apptainer: a .sif path or docker://…; pyxis: an enroot image or registry#name
    runtime: ContainerRuntime = ContainerRuntime.apptainer
    python: str = "python3"  # the interpreter inside the image
    mounts: list[str] = field(default_factory=list)  # more host paths: PATH or PATH:INSIDE
    options: list[str] = field(default_factory=list)  # more words for apptainer exec / srun


@dataclass
class ClusterConfig:
    backend: Backend = Backend.auto
    nodes: int = 1
    gpus_per_node: int = 4  # on a machine without GPUs: that many CPU (gloo) workers for DDP
    # The cluster's name for the GPU model, where it asks for one (--gpus-per-node=a100:4); on
    # the local backend it is only recorded.
    gpu_type: str | None = None
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
    # On the warning signal (or SIGTERM while Slurm runs the job) the job saves and requeues
    # itself for as long as its attempts save progress: it stops, at its time limit (TIMEOUT),
    # once this many requeues in a row followed attempts that saved nothing new. 2: one retry
    # for a passing cause (a slow node or file system, a cold cache) and one more for bad luck
    # twice; a third attempt that saves nothing means the run cannot progress in its limit
    # (with train.checkpoint=false it never can), and each more would spend a whole allocation.
    requeues_without_progress: int = 2
    # A hard cap on requeues whatever the progress (0: never requeue). High, so that only
    # progress decides: a 2-day run on a 1-hour partition needs 48.
    max_requeues: int = 1000
    requeue: Requeue = Requeue.normal
    setup: list[str] = field(default_factory=list)  # shell lines before the job, e.g. module load
    sbatch_extra: dict[str, str] = field(default_factory=dict)  # any other #SBATCH --key=value
    container: ContainerConfig = field(default_factory=ContainerConfig)


@dataclass
class DistConfig:
    backend: DistBackend = DistBackend.auto
    # 0: on Slurm derived from the job id, so two jobs on one node never collide; a local job's
    # store binds a free port the system picks
    port: int = 0
    timeout_s: int = 300
    comm_hook: CommHook = CommHook.none


@dataclass
class OutputConfig:
    root: str = "runs"
    name: str = ""  # appended to the run folder's name
    # Rank 0 records where an epoch is this often while it runs (`--wait` shows it); 0: never.
    progress_s: int = 30


@dataclass
class CodeConfig:
    """The copy of the code a run's queued, requeued and resumed jobs run (`core.snapshot`): the
    kit, the launching folder's git repository (its files as git lists them) and these folders."""

    snapshot: Snapshot = Snapshot.auto
    # More folders of code to copy besides the repository: absolute, or relative to where the
    # launcher starts (a library of the user's outside the repository, say).
    folders: list[str] = field(default_factory=list)
    # The most the copy may be, in MB (2**20 bytes), counted before anything is copied: a copy
    # is made per submission (a sweep's runs share one), so a large one costs time and quota.
    max_mb: int = 64


@dataclass
class Config:
    mode: str = "ddp"  # a strategy's name (core.strategies), checked by core.settings.rules
    task: Task = Task.train
    # A program of the user's own run in every task instead of the kit's loop, with its
    # arguments (`launch submit … -- python my_train.py ARGS`); `{group.key}` in an argument is
    # the run's setting. --mode ddp: one task per GPU; --mode dp: one per node.
    program: list[str] = field(default_factory=list)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    code: CodeConfig = field(default_factory=CodeConfig)
