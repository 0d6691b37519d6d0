"""One process of a job: what it knows (config, place, device, run folder) and what it records
first (the start record); the errors that end a job on purpose."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import platform
import socket
import time
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from slurm_ddp_kit.core import runfolder
from slurm_ddp_kit.core.settings.rules import per_rank_batch
from slurm_ddp_kit.core.settings.schema import Config
from slurm_ddp_kit.train import distenv
from slurm_ddp_kit.train.distenv import LaunchError

if typing.TYPE_CHECKING:
    from slurm_ddp_kit.train import stopsignals, workloads


class Stopped(LaunchError):
    """The job stopped early on purpose (a signal, a cancel) after saving what it could."""


@dataclass
class Context:
    cfg: Config
    env: distenv.DistEnv
    device: torch.device
    gpus: int  # GPUs this process drives (DP: all of the node's; DDP: one; CPU: 0)
    run_dir: Path
    metrics: runfolder.RecordWriter
    stops: stopsignals.StopSignals  # caught from the job's start, acted on at a step boundary
    # Where start-up went: seconds per phase, in order (written with the start record).
    startup: dict[str, float] = dataclasses.field(default_factory=dict)
    last_mark: float = dataclasses.field(default_factory=time.time)
    parameters: int = 0  # the model's, whole
    place: dict[str, Any] = dataclasses.field(default_factory=dict)  # its CPUs and GPUs
    placement: str | None = None  # rank 0: what is wrong with the ranks' places, if anything

    def lap(self, phase: str) -> None:
        now = time.time()
        self.startup[phase] = round(now - self.last_mark, 3)
        self.last_mark = now


def dist_backend(cfg: Config) -> str:
    if cfg.dist.backend != "auto":
        return cfg.dist.backend.value
    return "nccl" if torch.cuda.is_available() else "gloo"


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def start_record(ctx: Context, train_samples: int, test_samples: int) -> dict[str, Any]:
    cfg, env = ctx.cfg, ctx.env
    cuda = ctx.device.type == "cuda"
    return {
        **env.as_dict(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        # Slurm's node name: emulated nodes (and containers) can share one hostname.
        "node": os.environ.get("SLURMD_NODENAME", socket.gethostname()),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "mode": cfg.mode,
        "backend": dist.get_backend() if dist.is_initialized() else "none",
        "device": str(ctx.device),
        "device_name": torch.cuda.get_device_name(ctx.device) if cuda else _cpu_name(),
        "gpu_count": ctx.gpus,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "cpus": ctx.place.get("cpus"),
        "cpus_usable": ctx.place.get("usable"),
        "cpus_asked": ctx.place.get("asked"),
        "gpu_ids": ctx.place.get("gpus"),
        "placement": ctx.placement,
        "per_rank_batch": per_rank_batch(cfg),
        "global_batch": cfg.train.global_batch_size,
        "epochs": cfg.train.epochs,
        "task": cfg.task,
        "precision": cfg.train.precision,
        "dataset": cfg.data.dataset,
        "train_samples": train_samples,
        "test_samples": test_samples,
        "bytecode_cached": bytecode_cached(),
    }


def bytecode_cached() -> bool:
    """Whether torch was imported from Python's bytecode cache. Where Python writes none
    (PYTHONDONTWRITEBYTECODE, `python -B`) and finds none, every rank compiles torch's sources as it
    starts: on the H200 machine, 9.5 s from `launch submit` to the first step against 4.6 s
    (docs/benchmarks/startup-h200x1.md)."""
    cached = importlib.util.cache_from_source(torch.__file__)  # where PYTHONPYCACHEPREFIX says
    return os.path.exists(cached)


def workload_record(ctx: Context, shape: workloads.Shape, classes: int) -> dict[str, Any]:
    return {"sample_shape": list(shape), "classes": classes, "parameters": ctx.parameters}


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"CPU {line.split(':', 1)[1].strip()}"
    return f"CPU {platform.processor() or platform.machine()}"
