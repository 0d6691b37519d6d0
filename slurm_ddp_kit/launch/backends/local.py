"""The local backend: the job runs on this machine, under submitit's LocalExecutor.

Its job id is its controller's PID, recorded with what tells that process from a later one given
the same PID; its state is read from this machine's processes (`core.processes`), which its
cancel signals; it runs in the terminal's process group, so Ctrl-C while following it cancels it.
A sweep runs one run after another (or `parallel` at a time) and waits for each.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slurm_ddp_kit.core import container, processes, runfolder, snapshot
from slurm_ddp_kit.core.cli import HeldSignals, Interrupted
from slurm_ddp_kit.core.runfolder import failures
from slurm_ddp_kit.core.settings import rules, schema
from slurm_ddp_kit.core.settings.schema import Config, ConfigError, ContainerRuntime, Requeue
from slurm_ddp_kit.launch.backends import Backend, SchedulerState, Seen, Watch
from slurm_ddp_kit.launch.code import CodeCopy, inside, started_in_copy

if TYPE_CHECKING:
    import submitit

    from slurm_ddp_kit.launch.backends import Job


class Local(Backend):
    """This machine, through submitit's LocalExecutor."""

    name = schema.Backend.local.value
    sweep_waits = True

    def check_settings(self, cfg: Config) -> None:
        c = cfg.cluster
        if c.backend == schema.Backend.local and c.nodes > 1:
            raise ConfigError(
                f"the local backend runs on one machine; cluster.nodes={c.nodes} needs "
                "cluster.backend=slurm (or --nodes 1)"
            )

    def check_reach(self, cfg: Config, dry_run: bool) -> None:
        if cfg.cluster.nodes > 1:  # cluster.backend=auto, on a machine without Slurm
            raise ConfigError(
                f"the local backend runs on one machine; cluster.nodes={cfg.cluster.nodes} needs "
                "Slurm"
            )

    def check_runtime(self, cfg: Config, dry_run: bool) -> None:
        image = cfg.cluster.container
        if image.image and image.runtime == ContainerRuntime.pyxis:
            raise ConfigError(
                "cluster.container.runtime=pyxis runs through srun: it needs the Slurm backend; "
                "locally use cluster.container.runtime=apptainer, or no container"
            )
        if image.image and not shutil.which("apptainer") and not dry_run:
            raise ConfigError(
                "cluster.container.runtime=apptainer, but `apptainer` is not on PATH: load it "
                "(e.g. `module load apptainer`), or drop cluster.container.image"
            )
        if cfg.cluster.requeue == Requeue.expedite:
            raise ConfigError(
                "cluster.requeue=expedite asks Slurm for an expedited requeue; the local backend "
                "requeues nothing: drop it, or use cluster.backend=slurm"
            )

    def check_machine(self, cfg: Config) -> None:
        rules.check_hardware(cfg, local_gpus(), rules.tasks_per_node(cfg))

    def executor(self, cfg: Config, run_dir: Path) -> submitit.Executor:
        import submitit  # here: `status` and `cancel` start without it

        from slurm_ddp_kit.launch.executor import logs_folder, task_python

        within = inside(cfg, snapshot.job_code(run_dir))  # a container's tasks, in the copy
        local = submitit.LocalExecutor(folder=logs_folder(run_dir), python=task_python(cfg, within))
        local.update_parameters(
            timeout_min=cfg.cluster.timeout_min,
            tasks_per_node=rules.world_size(cfg),
            gpus_per_node=cfg.cluster.gpus_per_node if local_gpus() else 0,
            signal_delay_s=rules.signal_delay_s(cfg),
            setup=[*container.setup_lines(cfg, within), *cfg.cluster.setup],
        )
        return local

    @contextlib.contextmanager
    def submitting(self, run_dir: Path) -> Iterator[None]:
        """The controller starts from here without a shell (its PID is the job's: `cancel`
        signals it), so it inherits the run's code copy as this process's folder and PYTHONPATH
        (`launch.code.started_in_copy`), and /dev/null for output."""
        with started_in_copy(run_dir), _detached_output():
            yield

    def refusal(self, err: Exception, what: str = "the job") -> str:
        return f"the local executor could not start {what}: {err}"

    def owns(self, job: Job) -> bool:
        import submitit

        return isinstance(job, submitit.LocalJob)

    def job_process(self, job: Job) -> Any:
        # The id is the controller's PID: recorded with what tells that process from a later one
        # given the same PID, so `status` and `cancel` never take a stranger for the job.
        return processes.identity(int(job.job_id))

    def survey(self, metas: list[dict[str, Any]], seen: Seen) -> None:
        if any(meta.get("backend") == self.name for meta in metas):
            seen[self.name] = processes.task_table()  # every local job's processes, read once

    def state(self, job_id: str, seen: Seen | None) -> SchedulerState | None:
        return None  # no scheduler: the run folder and the processes tell

    def alive(self, run_dir: Path, meta: dict[str, Any], seen: Seen | None) -> bool:
        return local_job_alive(run_dir, meta, (seen or {}).get(self.name))

    def unanswered(self, alive: bool) -> str:
        return "RUNNING" if alive else "ENDED-WITHOUT-SUMMARY"

    def cancel(self, run_dir: Path, meta: dict[str, Any], job_id: str) -> str:
        if not local_job_alive(run_dir, meta):  # nor is its PID another's to signal
            return f"{run_dir.name}: local job {job_id} had already ended"  # and not marked:
            # a failed run stays FAILED
        # Marked first: ranks that catch the cancel's signal stop without writing anything.
        runfolder.update_meta(run_dir, cancel_requested=True)
        # SIGINT, as submitit's own cancel: the controller stops every task (its tasks ignore a
        # forwarded SIGTERM, which submitit reserves for preemption); tasks whose controller is
        # gone are told themselves.
        controller = [int(job_id)] if _controller_alive(meta, run_dir) else []
        processes.signal_all([*controller, *_task_pids(run_dir, meta)], signal.SIGINT)
        return f"{run_dir.name}: cancelled local job {job_id}"

    def watch(self, job: Job, run_dir: Path, say: Callable[[str], None]) -> Watch:
        return _LocalWatch(job, run_dir, say)

    def interrupted(self, job: Job, run_dir: Path, word: str) -> str:
        """The terminal's Ctrl-C reached the job's controller and ranks as well (they run in its
        process group): the job is cancelled as `launch cancel` would (marked, so `status` reads
        CANCELLED and names no failure; its checkpoints kept for `launch resume`), and waited
        for until none of its processes is left. A signal to the launcher alone, which cannot be
        told apart, ends the job the same way."""
        from slurm_ddp_kit.launch.follow import continue_words  # loaded by then: it follows

        if runfolder.of_kind(runfolder.read_rank(run_dir, 0), "summary"):
            return f"{word}: job {job.job_id} had already completed"
        # Marked here too: the terminal's Ctrl-C may have ended the job before `cancel` looks.
        runfolder.update_meta(run_dir, cancel_requested=True)
        self.cancel(run_dir, runfolder.read_meta(run_dir), str(job.job_id))
        deadline = time.monotonic() + 30  # the controller ends its tasks within seconds
        while not job.done() and time.monotonic() < deadline:
            time.sleep(0.2)
        wait_end(run_dir)  # tasks a second Ctrl-C kept the controller from ending
        return f"{word}: cancelled local job {job.job_id}; {continue_words(run_dir)}"

    def dry_run(self, cfg: Config, run_dir: Path, planned: snapshot.Plan) -> str:
        return (
            f"backend: local (submitit LocalExecutor)\ntasks: {rules.world_size(cfg)}\n"
            f"timeout_min: {cfg.cluster.timeout_min}\nlogs: {runfolder.logs_dir(run_dir)}\n"
        )

    def sweep(
        self, cfgs: list[Config], commands: list[list[str]], parallel: int | None, code: CodeCopy
    ) -> Iterator[tuple[Path, Job]]:
        """Each run submitted as `launch submit` submits it, at most `parallel` (default 1)
        running at once; returns once every run has ended."""
        from slurm_ddp_kit.launch.submit import submit  # it asks this package: loaded by then

        running: list[Job] = []
        for cfg, command in zip(cfgs, commands, strict=True):
            while len(running) >= (parallel or 1):
                running = [job for job in running if not job.done()]
                time.sleep(0.5)
            held = HeldSignals()  # until the caller has the run: it names the run on a signal
            try:
                run_dir, job = submit(cfg, command, held=held, code=code)
                running.append(job)
                yield run_dir, job
            finally:
                held.release()
            if held.signum is not None:
                raise Interrupted(held.signum)
        while not all(job.done() for job in running):
            time.sleep(0.5)

    def sweep_dry_run(self, cfgs: list[Config], run_dirs: list[Path], parallel: int | None) -> str:
        return f"backend: local (submitit LocalExecutor), {parallel or 1} run(s) at a time\n"

    def sweep_interrupted(
        self, err: KeyboardInterrupt, submitted: list[tuple[Path, Job]]
    ) -> Iterator[str]:
        """Each run the interrupt may have ended, cancelled cleanly (`interrupted`)."""
        from slurm_ddp_kit.launch.follow import interrupted  # loaded by then: the sweep's

        for run_dir, job in submitted:
            if _in_flight(run_dir, job):
                yield interrupted(job, run_dir, err)


class _LocalWatch(Watch):
    """A local job starts at once; its tasks may outlive a killed controller; and one whose
    controller ended before any task started left no task log."""

    starts_at_once = True

    def going_on(self) -> bool:
        return local_job_alive(self.run_dir)  # tasks that outlive their (killed) controller

    def unstarted(self) -> str:
        # No task ever started (no task log): submitit would wait for a result, then name a log
        # file that does not exist.
        if runfolder.log_files(self.run_dir, 0, False):
            return ""
        return "its controller was killed, or a cluster.setup line ended it"


def _in_flight(run_dir: Path, job: Job) -> bool:
    """A sweep's run that an interrupt may have ended: still running, or ended with neither a
    summary nor a failure of its own (the terminal's Ctrl-C reached its controller and ranks
    before this process could cancel it)."""
    if not job.done():
        return True
    if runfolder.of_kind(runfolder.read_rank(run_dir, 0), "summary"):
        return False
    first = failures.first_failure(run_dir)
    return first is None or str(first.get("error", "")).startswith("KeyboardInterrupt")


# --- what a job started here would see ------------------------------------------------------


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


# --- submitting -----------------------------------------------------------------------------


@contextlib.contextmanager
def _detached_output() -> Iterator[None]:
    """The local controller inherits stdout/stderr at its start: give it /dev/null, so a caller
    reading our output through a pipe is not held open until the job ends (tasks log to files).
    It also inherits ignored signals: SIGINT, which cancels it, is made heard."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        with _sigint_heard():
            yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, devnull):
            os.close(fd)


@contextlib.contextmanager
def _sigint_heard() -> Iterator[None]:
    """Started from a shell's background (`launch submit … &` in a script), this process ignores
    SIGINT, and the controller started here would inherit that and never hear `launch cancel`."""
    try:
        ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        if ignored:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    except ValueError:  # not the main thread: leave the signals alone
        ignored = False
    try:
        yield
    finally:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


# --- a submitted job's processes ------------------------------------------------------------


END_WAIT_S = 10.0  # a cancelled task ends within a second or two; past this, it is killed


def wait_end(run_dir: Path, timeout_s: float = END_WAIT_S) -> None:
    """Return once a local job's controller and tasks have all ended, killing the tasks still
    there after `timeout_s`: a command that says a job was cancelled leaves nothing behind."""
    meta = runfolder.read_meta(run_dir)
    deadline = time.monotonic() + timeout_s
    while local_job_alive(run_dir, meta) and time.monotonic() < deadline:
        time.sleep(0.1)
    processes.signal_all(_task_pids(run_dir, meta), signal.SIGKILL)


def local_job_alive(
    run_dir: Path, meta: dict[str, Any] | None = None, table: processes.Table | None = None
) -> bool:
    """Whether the run's local job runs: its controller, or a task of it (one whose controller
    was killed). `meta`: its metadata read before; `table`: `processes.task_table()` read before."""
    meta = runfolder.read_meta(run_dir) if meta is None else meta
    return _controller_alive(meta, run_dir) or bool(_tasks(run_dir, meta, table))


def _tasks(
    run_dir: Path, meta: dict[str, Any], table: processes.Table | None = None
) -> dict[int, list[int]]:
    """The job's live task processes, by rank (named by the job id and the run folder)."""
    job_id = str(meta.get("job_id") or "")
    if not job_id.isdigit():
        return {}
    return processes.local_tasks(job_id, runfolder.logs_dir(run_dir), table)


def _task_pids(run_dir: Path, meta: dict[str, Any]) -> list[int]:
    return [pid for pids in _tasks(run_dir, meta).values() for pid in pids]


def _controller_alive(meta: dict[str, Any], run_dir: Path) -> bool:
    """The local job's controller still runs: its PID is alive, is still that process (a PID is
    reused once its process ends: the identity recorded at submission), and is provably this
    run's (`processes.started_for`: this user's, started for the run's logs folder). The PID and
    identity the run folder records prove nothing alone: anyone who can write the folder can name
    any process, which `cancel` would then signal and `status` call RUNNING."""
    pid = str(meta.get("job_id"))
    if not pid.isdigit() or not processes.alive(int(pid)):
        return False
    recorded = meta.get("job_process")
    if recorded and processes.identity(int(pid)) != recorded:
        return False
    return processes.started_for(int(pid), runfolder.logs_dir(run_dir))
