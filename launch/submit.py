"""Turn a Config into a submitit executor and a job; follow it when asked."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import submitit

from launch import runs
from launch.config import Config, ConfigError, world_size
from train.metrics import metrics_path, read_records


def resolve_backend(name: str) -> str:
    """`auto` means Slurm where its client is installed and configured, else the local executor."""
    if name != "auto":
        return name
    return "slurm" if shutil.which("sbatch") and _slurm_configured() else "local"


def _slurm_configured() -> bool:
    conf = os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf")
    return Path(conf).is_file() or Path("/etc/slurm-llnl/slurm.conf").is_file()


def check_local_gpus(cfg: Config) -> None:
    """On the local backend, refuse to promise GPUs this machine does not have."""
    import torch

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible and cfg.cluster.gpus_per_node > visible:
        raise ConfigError(
            f"cluster.gpus_per_node={cfg.cluster.gpus_per_node} but this machine has {visible} "
            f"GPU(s): set cluster.gpus_per_node={visible}"
        )


def slurm_parameters(cfg: Config, run_name: str) -> dict[str, Any]:
    """SlurmExecutor parameters; DP is one task holding the node's GPUs, DDP one task per GPU."""
    c = cfg.cluster
    tasks = c.gpus_per_node if cfg.mode == "ddp" else 1
    gpus = (
        {"gpus_per_task": 1}
        if cfg.mode == "ddp" and c.gpu_binding == "task"
        else {"gpus_per_node": c.gpus_per_node}
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
        "ntasks_per_node": tasks,
        "cpus_per_task": c.cpus_per_task * (1 if cfg.mode == "ddp" else c.gpus_per_node),
        "time": c.timeout_min,
        "signal_delay_s": c.signal_delay_s,
        "setup": list(c.setup),
        "srun_args": ["--kill-on-bad-exit=1"],  # one rank failing ends the job, not a hang
        "additional_parameters": dict(c.sbatch_extra),
        **gpus,
        **({"mem": f"{c.mem_gb}GB"} if c.mem_gb else {}),
        **({"exclusive": True} if c.exclusive else {}),
        **{k: v for k, v in optional.items() if v},
    }


def make_executor(cfg: Config, run_dir: Path, backend: str) -> submitit.Executor:
    logs = run_dir / "logs"
    if backend == "slurm":
        slurm = submitit.SlurmExecutor(folder=logs, max_num_timeout=0)
        slurm.update_parameters(**slurm_parameters(cfg, run_dir.name))
        return slurm
    local = submitit.LocalExecutor(folder=logs)
    check_local_gpus(cfg)
    local.update_parameters(
        timeout_min=cfg.cluster.timeout_min,
        tasks_per_node=world_size(cfg),
        gpus_per_node=_local_gpus(cfg),
        signal_delay_s=min(cfg.cluster.signal_delay_s, cfg.cluster.timeout_min * 30),
        setup=list(cfg.cluster.setup),
    )
    return local


def submit(cfg: Config, command: list[str]) -> tuple[Path, submitit.Job[Any]]:
    """Create the run folder, then submit the training job into it."""
    from train.job import run  # imported here: torch is only needed when a job is submitted

    backend = resolve_backend(cfg.cluster.backend)
    if backend == "slurm" and not shutil.which("sbatch"):
        raise ConfigError(
            "cluster.backend=slurm but `sbatch` is not on PATH: use cluster.backend=local"
        )
    if backend == "local" and cfg.cluster.nodes > 1:
        raise ConfigError(
            f"the local backend runs on one machine; cluster.nodes={cfg.cluster.nodes} needs Slurm"
        )
    run_dir = runs.create(cfg, launcher="launch", backend=backend, command=command)
    executor = make_executor(cfg, run_dir, backend)
    try:
        # submitit echoes sbatch's errors to stderr; the error below says them once.
        with contextlib.redirect_stderr(io.StringIO()):
            job = executor.submit(run, str(run_dir))
    except (submitit.core.utils.FailedSubmissionError, submitit.core.utils.FailedJobError) as err:
        runs.update_meta(run_dir, submit_error=str(err))
        raise SubmitError(
            f"Slurm refused the job: {_scheduler_words(err)} (run folder kept: {run_dir})"
        ) from None
    runs.update_meta(run_dir, job_id=str(job.job_id))
    return run_dir, job


class SubmitError(RuntimeError):
    """The scheduler refused the job; the message carries its reason."""


def _scheduler_words(err: Exception) -> str:
    """sbatch's own error line(s), without submitit's wrapping."""
    lines = [line.strip() for line in str(err).splitlines() if "error" in line.lower()]
    return " ".join(dict.fromkeys(lines)) or str(err).strip()


def follow(job: submitit.Job[Any], run_dir: Path, say: Callable[[str], None] = print) -> bool:
    """Print one line per finished epoch until the job ends; then its result or its error."""
    shown = 0
    while not job.done():
        shown = _show_epochs(run_dir, shown, say)
        time.sleep(1.0)
    _show_epochs(run_dir, shown, say)
    try:
        result = job.results()[0]  # every task must succeed; rank 0 holds the summary
    except Exception as err:  # submitit re-raises the task's error with its traceback
        say(f"job {job.job_id} failed: {err}")
        say(f"logs: {run_dir / 'logs'}")
        return False
    say(f"job {job.job_id} done: {_result_words(result)}")
    return True


def _result_words(result: dict[str, Any]) -> str:
    if "largest_global_batch" in result:
        largest = result["largest_global_batch"]
        return (
            f"largest global batch that fits: {largest} (within 5 %)"
            if largest
            else "largest batch not measured (no GPU)"
        )
    return (
        f"test accuracy {result['final_test_accuracy']:.2%}, test loss {result['final_test_loss']:.4f}, "
        f"{result['train_seconds']:.1f} s training"
    )


def _show_epochs(run_dir: Path, shown: int, say: Callable[[str], None]) -> int:
    path = metrics_path(run_dir, 0)
    if not path.is_file():
        return shown
    records, _ = read_records(path)
    start = next((r for r in records if r["kind"] == "start"), None)
    epochs = [r for r in records if r["kind"] == "epoch"]
    for r in epochs[shown:]:
        world = start["world_size"] if start else 1
        total = start["epochs"] if start else "?"
        say(
            f"epoch {r['epoch']}/{total}: {r['seconds']:.2f} s, "
            f"{r['samples'] * world / r['seconds']:.0f} samples/s, train loss {r['train_loss']:.4f}, "
            f"test loss {r['test_loss']:.4f}, accuracy {r['test_accuracy']:.2%}"
        )
    return len(epochs)


def _local_gpus(cfg: Config) -> int:
    import torch

    return cfg.cluster.gpus_per_node if torch.cuda.is_available() else 0


def dry_run(cfg: Config) -> str:
    """The parameters and, on Slurm, the exact batch script `submit` would send; nothing is created."""
    from submitit.slurm.slurm import _make_sbatch_string

    backend = resolve_backend(cfg.cluster.backend)
    logs = f"{Path(cfg.output.root).resolve()}/<new run folder>/logs"
    if backend == "local":
        tasks = world_size(cfg)
        return f"backend: local (submitit LocalExecutor)\ntasks: {tasks}\ntimeout_min: {cfg.cluster.timeout_min}\nlogs: {logs}\n"
    params = slurm_parameters(cfg, "<new run folder>")
    command = f"{sys.executable} -u -m submitit.core._submit {logs}"
    script = _make_sbatch_string(command=command, folder=logs, **params)
    lines = [f"  {k}: {v}" for k, v in sorted(params.items())]
    return (
        "backend: slurm (submitit SlurmExecutor)\nparameters:\n"
        + "\n".join(lines)
        + "\n\n"
        + script
    )


def sweep(cfgs: list[Config], command: list[str]) -> list[tuple[Path, submitit.Job[Any]]]:
    """Submit a grid of configs as one Slurm array (locally: one job after another)."""
    from train.job import run_array_element

    backend = resolve_backend(cfgs[0].cluster.backend)
    if backend == "local":
        return [submit(cfg, command) for cfg in cfgs]
    shape = _array_shape(cfgs)
    run_dirs = [
        runs.create(cfg, launcher="launch sweep", backend=backend, command=command) for cfg in cfgs
    ]
    executor = submitit.SlurmExecutor(
        folder=run_dirs[0].parent / "sweeps" / run_dirs[0].name, max_num_timeout=0
    )
    executor.update_parameters(**slurm_parameters(shape, f"sweep-{run_dirs[0].name}"))
    jobs = executor.map_array(run_array_element, [str(d) for d in run_dirs])
    for run_dir, job in zip(run_dirs, jobs, strict=True):
        runs.update_meta(run_dir, job_id=str(job.job_id))
        _link_logs(run_dir, Path(executor.folder))
    return list(zip(run_dirs, jobs, strict=True))


def _array_shape(cfgs: list[Config]) -> Config:
    """One allocation fits every element: the DDP shape (DP elements use task 0 alone)."""
    shapes = {(c.cluster.nodes, c.cluster.gpus_per_node, c.cluster.gpu_binding) for c in cfgs}
    if len(shapes) > 1:
        raise ConfigError(
            f"a sweep's elements must share nodes, GPUs per node and binding; got {sorted(shapes)}"
        )
    ddp = next((c for c in cfgs if c.mode == "ddp"), cfgs[0])
    if any(c.mode == "dp" for c in cfgs) and ddp.cluster.gpu_binding == "task":
        raise ConfigError(
            "a sweep with DP needs cluster.gpu_binding=node: DP's task must see all GPUs"
        )
    return ddp


def _link_logs(run_dir: Path, array_logs: Path) -> None:
    """Array logs live in one folder; each run folder points at it so `launch logs` finds them."""
    link = run_dir / "logs"
    if not link.exists():
        link.symlink_to(array_logs, target_is_directory=True)
