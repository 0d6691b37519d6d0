"""What a run's job is (the kit's loop, a sweep's element, a user's program) and the submitit
executor that runs it: Slurm's parameters, the local executor's GPUs, and sbatch's refusals in
words."""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import logging
import os
import re
import shlex
import sys
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import submitit

from slurm_ddp_kit.core import (
    container,
    runfolder,
    slurm,
    strategies,
    userfiles,
)
from slurm_ddp_kit.core.errors import KitError
from slurm_ddp_kit.core.settings.rules import (
    cpus_per_task,
    signal_delay_s,
    tasks_per_node,
    world_size,
)
from slurm_ddp_kit.core.settings.schema import (
    Backend,
    Config,
    GpuBinding,
    Requeue,
)

log = logging.getLogger("kit")


# What a job runs, named rather than imported: the launcher never loads the job's code (nor
# torch); the job's own interpreter does, as `python -m train run` does under sbatch.
JOB_MODULE = "slurm_ddp_kit.train.job"


def task_python(cfg: Config) -> str:
    """What submitit starts in each task, ahead of its own runner: the kit's start, which holds
    the stop signals before anything loads (a warning during start-up must not end the job),
    started by the shell that ignores them until then; inside the container, if one is set."""
    python = [*container.wrapper(cfg), container.python(cfg, sys.executable)]
    return shlex.join([*slurm.TASK_START, *python, "-u", "-m", "slurm_ddp_kit.train.start"])


class Training(submitit.helpers.Checkpointable):
    """What `launch submit` hands to submitit: the training job of one run folder.

    Checkpointable, so submitit's own handler requeues it: the job saves its whole state at an
    agreed step first, and `checkpoint` resubmits the same run folder, which resumes from it.
    """

    entry = "run"
    module = JOB_MODULE

    def __call__(self, run_dir: str) -> dict[str, Any] | None:
        job = importlib.import_module(self.module)
        return typing.cast("dict[str, Any] | None", getattr(job, self.entry)(run_dir))


class ArrayElement(Training):
    """One element of a sweep's array (see `train.job.run_array_element`)."""

    entry = "run_array_element"


class ProgramRun(Training):
    """A user's program in each task (`train.program`): a sweep's element too, as its allocation
    is its own run's shape."""

    module = "slurm_ddp_kit.train.program"


def job_of(cfg: Config, element: bool = False) -> Training:
    """What submitit runs in each task of `cfg`'s job."""
    if cfg.program:
        return ProgramRun()
    return ArrayElement() if element else Training()


def resolve_backend(name: Backend) -> Backend:
    """`auto` means Slurm where its client is installed and configured, else the local executor."""
    if name != Backend.auto:
        return name
    return Backend.slurm if slurm.available() else Backend.local


def local_gpus() -> int:
    """The CUDA GPUs a job started here would see, without importing torch (4 s of the
    launcher's 5 on the GPU machine): NVML's count, narrowed by CUDA_VISIBLE_DEVICES as CUDA
    narrows it. The job checks again with torch before it trains."""
    return visible_count(_nvml_count(), os.environ.get("CUDA_VISIBLE_DEVICES"))


@functools.cache  # the machine's GPUs: one NVML start-up per launcher, not one per question
def _nvml_count() -> int:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVIDIA driver (or no NVML library): no GPU
        return 0


def visible_count(count: int, visible: str | None) -> int:
    """How many of `count` GPUs CUDA_VISIBLE_DEVICES leaves, as torch counts them: its entries
    up to the first that names no device; UUIDs (GPU-…, MIG-…) count as named; a device named
    twice leaves none."""
    if visible is None:
        return count
    named: list[str] = []
    for entry in (e.strip() for e in visible.split(",")):
        if not (entry.startswith(("GPU-", "MIG-")) or (entry.isdigit() and int(entry) < count)):
            break
        named.append(str(int(entry)) if entry.isdigit() else entry)
    return 0 if len(set(named)) < len(named) else len(named)


def slurm_parameters(cfg: Config, run_name: str) -> dict[str, Any]:
    """SlurmExecutor parameters; DP is one task holding the node's GPUs, DDP one task per GPU."""
    c = cfg.cluster
    typed = f"{c.gpu_type}:" if c.gpu_type else ""  # a cluster's GPU model: gpu:a100:4
    gpus = (
        {"gpus_per_task": f"{typed}1"}
        if strategies.of(cfg).per_gpu and c.gpu_binding == GpuBinding.task
        else {"gpus_per_node": f"{typed}{c.gpus_per_node}"}
    )
    optional = {
        "partition": c.partition,
        "account": c.account,
        "qos": c.qos,
        "constraint": c.constraint,
    }
    return {
        "job_name": f"kit-{run_name}",
        "nodes": c.nodes,
        "ntasks_per_node": tasks_per_node(cfg),
        "cpus_per_task": cpus_per_task(cfg),
        "time": c.timeout_min,
        "signal_delay_s": signal_delay_s(cfg),
        "setup": [slurm.BATCH_START, *container.setup_lines(cfg), *c.setup],
        # One rank failing ends the job, not a hang. A typed --gpus-per-task reaches the step
        # untyped: under Slurm 22.05 a step that inherits `a100:1` is bound to no GPU at all
        # (measured on the test cluster); the allocation already holds the type.
        # srun is told the CPUs per task: Slurm 22.05 and 23.02 do not pass the job's on to
        # it, and where tasks are bound an exact step then gives each task one CPU.
        "srun_args": [
            "--kill-on-bad-exit=1",
            f"--cpus-per-task={cpus_per_task(cfg)}",
            *(["--gpus-per-task=1"] if "gpus_per_task" in gpus and typed else []),
            *container.srun_options(cfg),
        ],
        # Requeueable: on the warning signal the job saves and asks Slurm to requeue it.
        "additional_parameters": {"requeue": _REQUEUE[c.requeue], **c.sbatch_extra},
        **gpus,
        **({"mem": f"{c.mem_gb}GB"} if c.mem_gb else {}),
        **({"exclusive": True} if c.exclusive else {}),
        **{k: v for k, v in optional.items() if v},
    }


# sbatch's --requeue (a bare flag) or --requeue=expedite, by cluster.requeue.
_REQUEUE: dict[Requeue, bool | str] = {Requeue.normal: True, Requeue.expedite: "expedite"}


def make_executor(cfg: Config, run_dir: Path, backend: Backend) -> submitit.Executor:
    logs = runfolder.logs_to_write(run_dir)
    keep_logs_private(logs)
    if backend == Backend.slurm:
        # submitit's count of requeues (its max_num_timeout) falls only in the handler the
        # kit calls, after its own checks (`train.stopping.not_requeued`): the kit decides.
        slurm = submitit.SlurmExecutor(
            folder=logs, max_num_timeout=cfg.cluster.max_requeues, python=task_python(cfg)
        )
        parameters = slurm_parameters(cfg, run_dir.name)
        log.debug("sbatch parameters: %s", parameters)
        slurm.update_parameters(**parameters)
        return slurm
    local = submitit.LocalExecutor(folder=logs, python=task_python(cfg))
    local.update_parameters(
        timeout_min=cfg.cluster.timeout_min,
        tasks_per_node=world_size(cfg),
        gpus_per_node=cfg.cluster.gpus_per_node if local_gpus() else 0,
        signal_delay_s=signal_delay_s(cfg),
        setup=[*container.setup_lines(cfg), *cfg.cluster.setup],
    )
    return local


# What a Slurm job or step sets, beside the settings a user may keep in the environment.
_USER_SLURM = ("SLURM_CONF", "SLURM_CLUSTERS", "SLURM_TIME_FORMAT")


_TORCH_DIST = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@contextlib.contextmanager
def without_enclosing_job() -> Iterator[None]:
    """Submit without the variables of a job this launcher runs in (salloc, a batch job) or of a
    launch by hand: sbatch passes the environment on, where they contradict the new job's own
    (srun: "SLURM_MEM_PER_CPU, SLURM_MEM_PER_GPU, and SLURM_MEM_PER_NODE are mutually
    exclusive"). Outside a job, a user's SLURM_* settings stay."""
    in_job = "SLURM_JOB_ID" in os.environ
    names = [
        name
        for name in os.environ
        if name in _TORCH_DIST
        or name.startswith("SUBMITIT_")
        or (in_job and name.startswith(("SLURM_", "SLURMD_", "SRUN_")) and name not in _USER_SLURM)
    ]
    saved = {name: os.environ.pop(name) for name in names}
    try:
        yield
    finally:
        os.environ.update(saved)


EXIT_FAILED = 1


class SubmitError(KitError):
    """The scheduler refused the job; the message carries its reason."""


# sbatch's words when it found no controller to ask (no slurm.conf, a controller down).
_UNREACHED = re.compile(
    r"fetch config|contact slurm controller|Socket timed out|Zero Bytes were transmitted"
    r"|Connection refused|Unable to establish|slurm\.conf",
    re.IGNORECASE,
)


def refusal(err: Exception, what: str = "the job") -> str:
    """Why sbatch did not take a job, and what to look at: the cluster's reach, or its sizes."""
    words = _scheduler_words(err)
    if _UNREACHED.search(words):
        return (
            f"sbatch could not reach Slurm: {words}. Run from a machine of the cluster (where "
            "`sinfo` answers), or use cluster.backend=local to run on this one"
        )
    return (
        f"Slurm refused {what}: {words}. Compare cluster.partition, nodes, gpus_per_node, "
        "gpu_type, cpus_per_task and mem_gb with what the cluster has: "
        "`sinfo -o '%P %D %c %m %G'`"
    )


def _scheduler_words(err: Exception) -> str:
    """sbatch's own error line(s), without submitit's wrapping."""
    lines = [line.strip() for line in str(err).splitlines() if "error" in line.lower()]
    return " ".join(dict.fromkeys(lines)) or str(err).strip()


def keep_logs_private(logs: Path) -> None:
    """The logs folder holds the pickles submitit's runner loads (`train.start`): writable by
    the user alone, whatever the umask."""
    logs.mkdir(parents=True, exist_ok=True)
    userfiles.keep_private(logs)
