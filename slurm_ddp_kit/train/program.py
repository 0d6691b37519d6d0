"""A user's program as each task of a job (`launch submit … -- python my_train.py ARGS`, or
`sbatch slurm/ddp.sbatch … -- python my_train.py ARGS`, whose tasks run `python -m train run`).

The task's start (this module, in the process submitit or srun started) gives the program what the
kit's own loop gets: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT
(for `torch.distributed.init_process_group`'s env://), the task's GPUs and CPUs as Slurm bound
them, and the run folder's places (`slurm_ddp_kit`'s variables). It records the start, times the
program from outside and records how it ended: a summary, or an error naming the rank and its exit
status, which `--wait` and `status` report as for the kit's loop.

Stops: the stop signals stay held in this process (`train.early`). The program starts with them
unblocked and SIGUSR2 ignored (Slurm sends its time-limit warning to every process of the step; a
program that never heard of it must not die of it). On a stop signal this process passes it on
and writes the stop file `slurm_ddp_kit.stop_requested` looks for. A program that then saves and
exits with status 0 is requeued on Slurm (rank 0 asks, as the kit's loop does) for as long as its
attempts save something new in its checkpoint folder.

Torch-free: a task that runs a program does not pay for importing torch.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from slurm_ddp_kit.core import placement, runfolder, slurm, snapshot, submitted
from slurm_ddp_kit.core.errors import KitError
from slurm_ddp_kit.core.settings.loading import program_arguments
from slurm_ddp_kit.core.settings.schema import Config
from slurm_ddp_kit.train import distenv, early
from slurm_ddp_kit.train.outside import OutsideSampler

log = logging.getLogger("train")

POLL_S = 0.5  # how often the task looks at its program and its held signals


class ProgramError(KitError):
    """The program ended with a non-zero status, or could not be started."""


def run(run_dir: str) -> dict[str, Any]:
    """What each task of a program run runs: submitted by `launch submit`
    (`launch.executor.ProgramRun`), or started by srun in the sbatch scripts (`python -m train
    run`)."""
    started = time.time()
    early.resume_gc()  # this process imports little more: it follows the program's
    folder = Path(run_dir)
    cfg = runfolder.load_job_config(folder)
    env = distenv.detect(port=cfg.dist.port)
    distenv.check_launch(cfg, env)  # the kit's loop's check: a task count that names its fix
    env = _with_port(env, folder)
    before = early.hold()  # submitit's own handlers, if it installed any: its requeue
    records = runfolder.RecordWriter(folder, env.rank)
    checkpoints = runfolder.program_checkpoints(folder)
    stop_file = runfolder.no_links(
        folder, runfolder.logs_dir(folder) / f".stop-{env.job_id}-{env.rank}"
    )
    stop_file.unlink(missing_ok=True)  # an earlier attempt's
    # A script named by its absolute path runs from the run's code copy, as a relative one does.
    argv = snapshot.program_in_copy(snapshot.job_code(folder), program_arguments(cfg))
    records.write("start", **_start_fields(cfg, env, argv, started))
    saved_before = _newest(checkpoints)
    child = _start(argv, _environment(env, folder, checkpoints, records.path, stop_file))
    sampler = OutsideSampler(child.pid)  # the cards it uses, seen from here (`train.outside`)
    stop = _follow(cfg, child, stop_file)
    seconds = time.time() - started
    gpus = sampler.close()
    if stop and child.returncode in (0, -stop):  # saved and exited, or ended by the signal
        saved = _newest(checkpoints) > saved_before
        return _stopped(cfg, env, folder, records, stop, saved, before)
    if child.returncode != 0:
        words = _exit_words(argv, child.returncode)
        records.write(
            "error", **_where(), error=words, kit_error=False, exit_code=child.returncode,
            traceback_tail=_last_words(),
        )  # fmt: skip
        raise ProgramError(f"rank {env.rank}: {words}")
    cards = {"gpus": gpus} if gpus else {}
    return records.write("summary", total_seconds=seconds, exit_code=0, program=argv, **cards)


def _with_port(env: distenv.DistEnv, run_dir: Path) -> distenv.DistEnv:
    """A local job's port: rank 0 takes one the system says is free and publishes it; the other
    tasks read it (Slurm's jobs derive theirs from the job id)."""
    if env.master_port != distenv.PICK_PORT:
        return env
    if env.is_main:
        with socket.socket() as probe:
            probe.bind((env.master_addr, 0))
            port = probe.getsockname()[1]
        runfolder.publish_store_port(run_dir, env.job_id, port)
    else:
        deadline = time.monotonic() + 120
        while (port := runfolder.published_store_port(run_dir, env.job_id) or 0) == 0:
            if time.monotonic() > deadline:
                raise ProgramError("rank 0 published no port within 120 s: its log says why")
            time.sleep(0.2)
    return distenv.DistEnv(**{**env.as_dict(), "master_port": port})


def _start_fields(
    cfg: Config, env: distenv.DistEnv, argv: list[str], started: float
) -> dict[str, Any]:
    return {
        **env.as_dict(),
        **_where(),
        "pid": os.getpid(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "mode": cfg.mode,
        "task": "program",
        "program": argv,
        "cpus": placement.affinity(),
        "cpus_usable": placement.usable_cpus(env.local_world_size),
        "cpus_asked": placement.cpus_asked(),
        "restarts": slurm.restarts(),
        "startup_s": time.time() - started,
    }


def _where() -> dict[str, Any]:
    return {"host": socket.gethostname(), "node": os.environ.get("SLURMD_NODENAME")}


def _environment(
    env: distenv.DistEnv, run_dir: Path, checkpoints: Path, records: Path, stop_file: Path
) -> dict[str, str]:
    """The program's environment: this task's, with its place in the job and the kit's places."""
    return {
        **os.environ,
        "RANK": str(env.rank),
        "LOCAL_RANK": str(env.local_rank),
        "WORLD_SIZE": str(env.world_size),
        "LOCAL_WORLD_SIZE": str(env.local_world_size),
        "MASTER_ADDR": env.master_addr,
        "MASTER_PORT": str(env.master_port),
        "KIT_RUN_DIR": str(run_dir),
        "KIT_CHECKPOINT_DIR": str(checkpoints),
        "KIT_RECORDS": str(records),
        "KIT_STOP_FILE": str(stop_file),
    }


def _start(argv: list[str], environment: dict[str, str]) -> subprocess.Popen[bytes]:
    try:
        return subprocess.Popen(argv, env=environment, preexec_fn=_program_signals)
    except OSError as err:
        raise ProgramError(f"cannot start {argv[0]}: {err.strerror}") from None


def _program_signals() -> None:
    """In the program's process, before its exec: the stop signals unblocked, SIGUSR2 ignored
    until the program takes it (`slurm_ddp_kit.stop_requested`, or a handler of its own)."""
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, early.STOP_SIGNALS)


def _follow(cfg: Config, child: subprocess.Popen[bytes], stop_file: Path) -> int:
    """Wait for the program; a stop signal that comes meanwhile is passed on to it and said in
    the stop file, a time-limit warning that came early only once the lead is left (as the
    kit's loop puts it off, `train.stopping.due`). Returns the stop signal acted on (0: none)."""
    stop, due = 0, None
    while child.poll() is None:
        for signum in early.take():
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signum)
            if signum == signal.SIGTERM:
                stop, due = signum, time.time()
            elif due is None:
                stop, due = signum, time.time() + _put_off_by(cfg)
        if due is not None and time.time() >= due and not stop_file.exists():
            stop_file.touch()
        time.sleep(POLL_S)
    return stop if due is not None and time.time() >= due else 0


EARLY_S = 60  # Slurm sends its warning on a periodic check: up to this much before the lead


def _put_off_by(cfg: Config) -> float:
    """Seconds until the job must stop for its time limit: Slurm's warning may come up to a
    minute before the lead asked (cluster.signal_delay_s, at most half the limit), which would
    stop every attempt of a short limit after its first save. 0 where Slurm cannot tell."""
    job_id = slurm.job_to_requeue()
    times = slurm.time_left(job_id) if job_id else None
    if times is None:
        return 0.0
    left, limit = times
    lead = min(cfg.cluster.signal_delay_s, limit // 2)
    return float(max(left - lead, 0)) if left <= lead + EARLY_S else 0.0


TAIL_BYTES = 2000


def _last_words() -> str:
    """The end of this task's error log, where the program's own traceback went (it inherits
    the task's stderr): the lines `--wait` shows under the failure."""
    with contextlib.suppress(OSError):
        log_file = Path(os.readlink("/proc/self/fd/2"))
        if log_file.is_file():
            with log_file.open("rb") as f:
                at = max(log_file.stat().st_size - TAIL_BYTES, 0)
                f.seek(at)
                lines = f.read().decode(errors="replace").splitlines()[1 if at else 0 :]
            return "\n".join(lines[-12:])
    return ""


def _newest(folder: Path) -> float:
    """When anything in the checkpoint folder last changed (0: nothing there)."""
    times = [0.0]
    for path in folder.rglob("*"):
        with contextlib.suppress(OSError):
            times.append(path.lstat().st_mtime)
    return max(times)


def _exit_words(argv: list[str], code: int) -> str:
    if code < 0:
        return f"{argv[0]} was ended by {signal.Signals(-code).name}"
    return f"{argv[0]} exited with status {code}"


def _stopped(
    cfg: Config,
    env: distenv.DistEnv,
    run_dir: Path,
    records: runfolder.RecordWriter,
    stop: int,
    saved: bool,
    before: dict[int, Any],
) -> dict[str, Any]:
    """The program saved and exited on a stop: requeue the job (rank 0, on Slurm) while its
    attempts save something new; locally, say how to go on."""
    reason = signal.Signals(stop).name
    if runfolder.read_meta(run_dir).get("cancel_requested"):
        raise ProgramError("cancelled by `launch cancel`: stopped without writing")
    job_id = slurm.job_to_requeue()
    if job_id is None:
        records.write("stop", reason=reason, saved=saved)
        raise ProgramError(
            f"stopped by {reason}: continue with `python -m launch resume {run_dir}`"
        )
    state = slurm.queue_state(job_id) if stop == signal.SIGTERM else ""
    if state not in ("", "RUNNING"):  # Slurm is ending the job itself: it decides what comes next
        records.write("stop", reason=reason, saved=saved, requeue=None, slurm_state=state)
        time.sleep(600)
        raise ProgramError(f"stopped by {reason}; Slurm ended job {job_id} ({state})")
    why_not = _not_requeued(cfg, run_dir, job_id, saved) if env.is_main else ""
    if why_not:
        records.write("stop", reason=reason, saved=saved, not_requeued=why_not)
        raise ProgramError(f"stopped by {reason}; not requeued: {why_not}")
    problem = _requeue(job_id, before) if env.is_main else ""
    records.write("stop", reason=reason, saved=saved, requeue=job_id)
    if problem:
        raise ProgramError(
            f"stopped by {reason}, but the requeue of job {job_id} failed: {problem}"
        )
    time.sleep(600)  # Slurm ends this process as it requeues the job
    raise ProgramError(f"job {job_id} was requeued but this process was not ended")


def _not_requeued(cfg: Config, run_dir: Path, job_id: str, saved: bool) -> str:
    """Why the job must not requeue itself ('' to requeue): too many attempts in a row saved
    nothing new in the checkpoint folder, or the hard cap."""
    c = cfg.cluster
    if saved:
        stalled = 0
    else:
        stops = runfolder.read_records(runfolder.metrics_path(run_dir, 0))[0]
        earlier = [r.get("saved") for r in stops if r.get("kind") == "stop"]
        stalled = 1
        for was_saved in reversed(earlier):
            if was_saved is not False:
                break
            stalled += 1
    if stalled > c.requeues_without_progress:
        return (
            f"{stalled} attempts in a row saved nothing new in the checkpoint folder "
            f"(cluster.requeues_without_progress={c.requeues_without_progress})"
        )
    if slurm.restarts() >= c.max_requeues:
        return f"the job was requeued {slurm.restarts()} time(s) already (cluster.max_requeues)"
    return ""


def _requeue(job_id: str, before: dict[int, Any]) -> str:
    """submitit's own checkpoint-and-requeue where submitit started the job (it resubmits the
    same run folder), else `scontrol requeue`; '' on success, else what went wrong."""
    if not submitted.by_slurm_executor():
        return slurm.requeue(job_id)
    return early.requeue_through_submitit(before)
