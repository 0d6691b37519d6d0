"""Turn a Config into a submitit executor and a job; follow it when asked."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib
import importlib.util
import io
import json
import logging
import multiprocessing
import os
import re
import shlex
import shutil
import signal
import sys
import tempfile
import time
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import submitit

from slurm_ddp_kit.core import (
    container,
    datafiles,
    factories,
    runfolder,
    slurm,
    strategies,
    userfiles,
)
from slurm_ddp_kit.core.cli import (
    ENDING,
    EXIT_INTERRUPTED,
    HeldSignals,
    Interrupted,
    interrupt_word,
    printable,
)
from slurm_ddp_kit.core.errors import KitError
from slurm_ddp_kit.core.settings.loading import program_arguments, to_dict
from slurm_ddp_kit.core.settings.rules import (
    check_batch_fits_data,
    check_hardware,
    cpus_per_task,
    signal_delay_s,
    tasks_per_node,
    world_size,
)
from slurm_ddp_kit.core.settings.schema import (
    DATASETS,
    MODELS,
    Backend,
    Config,
    ConfigError,
    ContainerRuntime,
    GpuBinding,
    Requeue,
)
from slurm_ddp_kit.launch.jobs import diverged_words, process_identity

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


def check_submission(cfg: Config, dry_run: bool = False) -> Backend:
    """Everything the launcher can check before a file is made; returns the backend to use.

    A dry run needs no Slurm client: it shows the script on any machine. It does import a
    user's factories, as a submission from here would.
    """
    backend = resolve_backend(cfg.cluster.backend)
    if backend == Backend.slurm and not shutil.which("sbatch") and not dry_run:
        raise ConfigError(
            "cluster.backend=slurm but `sbatch` is not on PATH: use cluster.backend=local"
        )
    missing = slurm.named_conf_missing() if backend == Backend.slurm and not dry_run else None
    if missing:
        raise ConfigError(
            f"SLURM_CONF={missing} names no file, so sbatch cannot reach Slurm (it would retry "
            "for a minute): point SLURM_CONF at the cluster's slurm.conf or unset it, or use "
            "cluster.backend=local"
        )
    if backend == Backend.local and cfg.cluster.nodes > 1:
        raise ConfigError(
            f"the local backend runs on one machine; cluster.nodes={cfg.cluster.nodes} needs Slurm"
        )
    runfolder.check_root(cfg.output.root)
    _check_container(cfg, backend, dry_run)
    _check_requeue(cfg, backend, dry_run)
    if cfg.program:  # the program brings its own data and model
        _check_program(cfg)
    else:
        datafiles.check_data(cfg)
        check_factories(cfg)
    if backend == Backend.local:
        check_hardware(cfg, _local_gpus(), tasks_per_node(cfg))
    return backend


def _check_program(cfg: Config) -> None:
    """The program's command must be found here as the job will look for it: a path, or a name
    on PATH (the job inherits this environment)."""
    command = cfg.program[0]
    found = Path(command).is_file() if os.sep in command else shutil.which(command)
    if not found:
        raise ConfigError(
            f"the program `{command}` is not found here (the job looks for it the same way): give "
            "a path, or a command on PATH (e.g. `-- python my_train.py`)"
        )


def _check_requeue(cfg: Config, backend: Backend, dry_run: bool) -> None:
    """An expedited requeue where this cluster takes it (a dry run shows the line regardless)."""
    if cfg.cluster.requeue != Requeue.expedite:
        return
    if backend == Backend.local:
        raise ConfigError(
            "cluster.requeue=expedite asks Slurm for an expedited requeue; the local backend "
            "requeues nothing: drop it, or use cluster.backend=slurm"
        )
    refused = "" if dry_run else slurm.expedite_refused()
    if refused:
        raise ConfigError(
            f"cluster.requeue=expedite, but {refused}: drop it (cluster.requeue=normal), or ask "
            "the cluster's admins for SlurmctldParameters=enable_expedited_requeue on Slurm 25.11+"
        )


def _check_container(cfg: Config, backend: Backend, dry_run: bool) -> None:
    """What the launcher can see of the container: the runtime here, the image if it is a file."""
    c = cfg.cluster.container
    if not c.image:
        return
    container.check_code_folders(cfg)
    for module in container.installed_factories(cfg):
        log.warning(
            "%s is installed in this machine's site-packages, which the container does not "
            "mount: the image must have it too (or launch with its source folder on PYTHONPATH)",
            module,
        )
    if c.runtime == ContainerRuntime.pyxis:
        if backend == Backend.local:
            raise ConfigError(
                "cluster.container.runtime=pyxis runs through srun: it needs the Slurm backend; "
                "locally use cluster.container.runtime=apptainer, or no container"
            )
        if not dry_run and not slurm.srun_takes("--container-image"):
            raise ConfigError(
                "cluster.container.runtime=pyxis, but this cluster's srun has no "
                "--container-image (the pyxis plugin is not installed): use "
                "cluster.container.runtime=apptainer, or ask the cluster's admins for pyxis"
            )
        return
    if "://" not in c.image and not Path(c.image).expanduser().exists():
        raise ConfigError(
            f"cluster.container.image={c.image} does not exist: give a .sif file (or a sandbox "
            "folder) on a file system the nodes share, or a docker:// or oras:// address"
        )
    if backend == Backend.local and not shutil.which("apptainer") and not dry_run:
        raise ConfigError(
            "cluster.container.runtime=apptainer, but `apptainer` is not on PATH: load it "
            "(e.g. `module load apptainer`), or drop cluster.container.image"
        )


def check_factories(cfg: Config, trial: bool = True) -> None:
    """A user's model or dataset factory is imported here first: a wrong name or path fails now,
    not in a queued job. Imported from this process's path, which the job inherits; `trial`:
    then tried on the CPU (`_try_workload`)."""
    for key, value, built_in in (
        ("model.name", cfg.model.name, MODELS),
        ("data.dataset", cfg.data.dataset, DATASETS),
    ):
        if value not in built_in:
            factories.check(key, value)
    if trial and (cfg.model.name not in MODELS or cfg.data.dataset not in DATASETS):
        _try_workload(cfg)


def _try_workload(cfg: Config) -> None:
    """A user's dataset and model tried on this machine's CPU, in a process of its own (the
    launcher imports no torch): labels, shapes and the class count are one-line errors now,
    not after the queue wait."""
    values = to_dict(cfg)
    # What the trial depends on: a sweep's points that differ only in other settings are tried once.
    parts = [values["model"], values["data"], cfg.train.channels_last]
    workload = json.dumps(parts, sort_keys=True)
    if workload not in _TRIED:
        passed = _passed_mark(cfg, parts)
        remembered = _remembered(passed) if passed is not None else None
        if remembered is not None:
            log.debug("workload tried before, its factories unchanged: %s", passed)
            _TRIED[workload] = remembered
        else:
            _TRIED[workload] = _trial_problem(cfg, values)
            if not _TRIED[workload][0] and passed is not None:
                _remember(passed, _TRIED[workload][1])
    problem, samples = _TRIED[workload]
    if problem:
        raise ConfigError(problem)
    if samples is not None:  # a user's dataset: its training split's size is known now
        check_batch_fits_data(cfg, samples)


# The workloads tried in this process: what each trial said ('' if it passed), and its
# training split's size where it loaded a user's dataset.
_TRIED: dict[str, tuple[str, int | None]] = {}


def _passed_mark(cfg: Config, workload: list[Any]) -> Path | None:
    """Where a trial that passed is remembered across launches (a file in the user's cache),
    keyed by the workload's settings (not data.root: the trial reads no files) and the files of
    the trial's code and of each factory's module as they are now. A change to one of those
    files tries it again; a change in a module a factory imports is only caught by the job,
    which checks the same. None where a factory's file cannot be told."""
    trial = importlib.util.find_spec(WORKLOAD_MODULE)  # the trial's own code, found, not loaded
    files = [_stamp(trial.origin)] if trial and trial.origin else []
    for spec in (cfg.model.name, cfg.data.dataset):
        if ":" in spec:
            module = sys.modules.get(spec.partition(":")[0])  # imported by check_factories
            source = getattr(module, "__file__", None)
            if not source:
                return None
            files.append(_stamp(source))
    model, data, channels_last = workload
    data = {k: v for k, v in data.items() if k != "root"}
    key = json.dumps([model, data, channels_last, files], sort_keys=True)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "slurm-ddp-kit" / "tried" / hashlib.sha256(key.encode()).hexdigest()


def _stamp(path: str) -> list[Any]:
    stat = os.stat(path)
    return [path, stat.st_mtime_ns, stat.st_size]


def _remembered(mark: Path) -> tuple[str, int | None] | None:
    """A passed trial remembered in `mark` ('', its training split's size), or None: not tried
    yet, remembered in a form this kit does not read, or in a file another user could have
    planted (`core.userfiles`: a forged mark would skip the trial)."""
    handle = userfiles.open_own(mark)
    if handle is None:
        return None
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError), handle:
        samples = json.loads(handle.read())["train_samples"]
        if samples is None or (isinstance(samples, int) and samples > 0):
            return "", samples
    return None


def _remember(mark: Path, samples: int | None) -> None:
    """Best effort: a cache that cannot be written only means the next launch tries again."""
    try:
        mark.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        userfiles.keep_private(mark.parent)
        with runfolder.atomic_file(mark) as partial:  # replaces a planted link, never follows it
            partial.chmod(0o600)
            partial.write_text(json.dumps({"train_samples": samples}))
    except OSError as err:
        log.debug("cannot remember the trial in %s: %s", mark, err)


def _trial_problem(cfg: Config, values: dict[str, Any]) -> tuple[str, int | None]:
    """What the trial said: ('' if the workload passed, else the error line; the training
    split's size where it loaded a user's dataset)."""
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: torch is only there
    receive, send = context.Pipe(duplex=False)
    trial = context.Process(target=_trial, args=(values, send), daemon=True)
    trial.start()
    send.close()
    try:
        if not receive.poll(WORKLOAD_CHECK_S):
            raise ConfigError(
                f"trying data.dataset={cfg.data.dataset} and model.name={cfg.model.name} on the "
                f"CPU took over {WORKLOAD_CHECK_S} s: make the factories quicker to call"
            )
        problem, samples = receive.recv()
    except EOFError:
        trial.join()
        problem = f"trying the workload on the CPU failed: its process ended ({trial.exitcode})"
        samples = None
    finally:
        trial.kill()
        trial.join()
    return str(problem), samples


WORKLOAD_CHECK_S = 600
WORKLOAD_MODULE = (
    "slurm_ddp_kit.train.workloads"  # imported by name in the trial's process, as JOB_MODULE is
)


def _trial(values: dict[str, Any], send: Any) -> None:
    """In the trial's process: what `train.workloads.trial` says, sent back."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the check runs on the CPU, before torch starts
    send.send(importlib.import_module(WORKLOAD_MODULE).trial(values))


def _local_gpus() -> int:
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
    _keep_logs_private(logs)
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
        gpus_per_node=cfg.cluster.gpus_per_node if _local_gpus() else 0,
        signal_delay_s=signal_delay_s(cfg),
        setup=[*container.setup_lines(cfg), *cfg.cluster.setup],
    )
    return local


def submit(
    cfg: Config, command: list[str], held: HeldSignals | None = None
) -> tuple[Path, submitit.Job[Any]]:
    """Check, create the run folder, then submit the training job into it; `held`: the ending
    signals, held from the folder's making on (the caller releases them once it has named the
    job)."""
    backend = check_submission(cfg)
    if held:
        held.hold()
    made = runfolder.folders_to_make(cfg.output.root)
    run_dir = runfolder.create(cfg, launcher="launch", backend=backend.value, command=command)
    log.debug("backend %s, run folder %s, data under %s", backend.value, run_dir, cfg.data.root)
    try:
        return run_dir, _submit_into(cfg, run_dir, backend)
    except SubmitError:
        runfolder.discard([run_dir], made)  # made for this job alone: nothing ran in it
        raise


def _submit_into(cfg: Config, run_dir: Path, backend: Backend) -> submitit.Job[Any]:
    """The training job of an existing run folder: submitted, and recorded in the folder."""
    executor = make_executor(cfg, run_dir, backend)
    try:
        # submitit echoes sbatch's errors to stderr; the error below says them once.
        with (
            _without_enclosing_job(),
            contextlib.redirect_stderr(io.StringIO()),
            _detached_output(backend),
        ):
            job = executor.submit(job_of(cfg), str(run_dir))
    except (submitit.core.utils.FailedSubmissionError, submitit.core.utils.FailedJobError) as err:
        runfolder.update_meta(run_dir, submit_error=str(err))
        raise SubmitError(refusal(err)) from None
    _record_job(run_dir, job)
    return job


# What a Slurm job or step sets, beside the settings a user may keep in the environment.
_USER_SLURM = ("SLURM_CONF", "SLURM_CLUSTERS", "SLURM_TIME_FORMAT")
_TORCH_DIST = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@contextlib.contextmanager
def _without_enclosing_job() -> Iterator[None]:
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


@contextlib.contextmanager
def _detached_output(backend: Backend) -> Iterator[None]:
    """The local controller inherits stdout/stderr at its start: give it /dev/null, so a caller
    reading our output through a pipe is not held open until the job ends (tasks log to files).
    It also inherits ignored signals: SIGINT, which cancels it, is made heard."""
    if backend != Backend.local:
        yield
        return
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


def _record_job(run_dir: Path, job: submitit.Job[Any]) -> None:
    """The job id, and where each task's stdout and stderr go (submitit names them)."""
    tasks = [job.task(rank) for rank in range(job.num_tasks)]
    logs = [[str(t.paths.stdout), str(t.paths.stderr)] for t in tasks]
    meta = runfolder.read_meta(run_dir)
    jobs = [*meta.get("jobs", []), str(job.job_id)]  # every job that ran in this folder
    # A local job's id is its controller's PID: recorded with what tells that process from a
    # later one given the same PID, so `status` and `cancel` never take a stranger for the job.
    local = isinstance(job, submitit.LocalJob)
    process = process_identity(int(job.job_id)) if local else None
    runfolder.update_meta(
        run_dir, job_id=str(job.job_id), logs=logs, jobs=jobs, job_process=process
    )


def resume(run_dir: Path, held: HeldSignals | None = None) -> submitit.Job[Any]:
    """Submit a new job into an existing run folder; it resumes from the folder's checkpoint.
    `held`: as for `submit`, held from the submission on."""
    runfolder.read_meta(run_dir)  # a run folder, whole: before the claim leaves a file in it
    runfolder.check_writable(run_dir)  # before anything is written into it
    if not os.access(run_dir, os.W_OK | os.X_OK):  # also a read-only mount
        raise SubmitError(
            f"{run_dir} is not writable here: the resumed job writes its records and checkpoints "
            "into it; make it writable, or copy the run folder somewhere writable and resume the copy"
        )
    with runfolder.claimed(run_dir):
        return _resume_claimed(run_dir, held)


def _resume_claimed(run_dir: Path, held: HeldSignals | None) -> submitit.Job[Any]:
    from slurm_ddp_kit.launch.jobs import finished, status, still_held

    now = status(run_dir)
    if still_held(now.state):  # suspended or SIGSTOPped too: it goes on when Slurm resumes it
        raise SubmitError(
            f"{run_dir.name} is {now.state} as job {now.job_id}: one job at a time writes a run "
            "folder; wait for it, or cancel it first (`python -m launch cancel`)"
        )
    if finished(run_dir, runfolder.read_rank(run_dir, 0)):
        raise SubmitError(f"{run_dir.name} has finished: there is nothing to resume")
    runfolder.saved_state(run_dir)  # one that is no file is refused, not taken for none
    cfg = runfolder.load_job_config(run_dir)
    backend = check_submission(cfg)
    # Cleared first: the new job must not take the last job's cancel as its own.
    runfolder.update_meta(run_dir, cancel_requested=None, submit_error=None, backend=backend.value)
    if held:
        held.hold()
    return _submit_into(cfg, run_dir, backend)


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


def _say(line: str) -> None:
    print(printable(line), flush=True)  # each line as it happens, also into a pipe or a file


def follow(
    job: submitit.Job[Any],
    run_dir: Path,
    say: Callable[[str], None] = _say,
    quiet: bool = False,
    resumed: bool = False,
) -> int:
    """Print one line per finished epoch (unless quiet) until the job ends; then its result or
    its error; returns the exit status: 0 done, 1 failed or stopped, 130 cancelled. `resumed`:
    a job resumed into the folder; the epochs done before are not shown again, and where it
    goes on from is said once it starts."""
    view = runfolder.read_rank(run_dir, 0) if resumed else []
    earlier = runfolder.of_kind(view, "start")  # the last attempt's start, if any
    said = runfolder.of_kind(view, "progress")[-1:]  # the stopped attempt's: not the new one's
    shown = _Shown(
        len(runfolder.of_kind(view, "epoch")),
        earlier[0]["time"] if earlier else None,
        said[0]["time"] if said else 0.0,
    )
    progress = (lambda line: None) if quiet else say
    # A local job starts at once: say what it does until rank 0 has started (a Slurm job's
    # wait in the queue is said by _say_pending, its start by the start line).
    if shown.attempt is None and isinstance(job, submitit.LocalJob):
        cfg = runfolder.read_config(run_dir)
        progress(
            f"starting {job.num_tasks} task(s) of the program"
            if cfg.program
            else f"starting {job.num_tasks} task(s): Python and torch, the process group, the "
            f"model{_warm_up_words(cfg)}, the data (the first epoch follows)"
        )
    pending, look = "", time.monotonic() + PENDING_LOOK_S
    slurm_says, slurm_end = _SlurmWord(job, run_dir, say), _SlurmEnd(job)
    while not job.done() or slurm_says.still_running() or _tasks_left(job, run_dir):
        if slurm_end.seen():
            break
        _show_epochs(run_dir, shown, progress)
        if isinstance(job, submitit.SlurmJob) and time.monotonic() > look:
            pending, look = _say_pending(job, run_dir, pending, progress), look + PENDING_LOOK_S
        time.sleep(1.0)
    _show_epochs(run_dir, shown, progress)
    if _cancelled(job, run_dir):  # by `launch cancel` (or scancel) from elsewhere
        say(f"job {job.job_id} was cancelled; {continue_words(run_dir)}")
        return EXIT_INTERRUPTED
    if isinstance(job, submitit.LocalJob) and not runfolder.log_files(run_dir, 0, False):
        # No task ever started (no task log): submitit would wait for a result, then name a
        # log file that does not exist.
        say(
            f"job {job.job_id} ended before it started its tasks (its controller was killed, "
            f"or a cluster.setup line ended it); {continue_words(run_dir)}"
        )
        return EXIT_FAILED
    if slurm_end.state and not job.done():  # no result from every task; submitit cannot see
        # the end without accounting, and would wait for the results for ever
        summary = runfolder.of_kind(runfolder.read_rank(run_dir, 0), "summary")
        if not summary:
            return _failed(job, run_dir, f"it ended ({slurm_end.state}) without results", say)
        result = summary[-1]
    else:
        try:
            result = _result(job)  # every task must succeed; rank 0 holds the summary
        except SubmitError as err:
            return _failed(job, run_dir, str(err), say)
    if result.get("diverged_epoch") is not None:
        say(f"job {job.job_id} diverged: {diverged_words(result)}")
        return EXIT_FAILED
    say(f"job {job.job_id} done: {result_words(result)}")
    return 0


RESULT_WAIT_S = 30  # for a task's result file after its job ended (a slow shared file system)


def _result(job: submitit.Job[Any]) -> dict[str, Any]:
    """Rank 0's result once every task succeeded, read from submitit's result files as plain
    data (`userfiles.plain_data`: a pickle another user planted in the logs folder builds no
    object, where submitit's own reader would run its code); SubmitError naming a task that
    failed or left no result."""
    results = [_task_result(job.task(rank)) for rank in range(job.num_tasks)]
    return typing.cast("dict[str, Any]", results[0])


def _task_result(task: submitit.Job[Any]) -> Any:
    path = task.paths.result_pickle
    deadline = time.monotonic() + RESULT_WAIT_S
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(1.0)
    try:
        outcome, value = userfiles.plain_data(path)
    except (OSError, ValueError, TypeError) as err:
        raise SubmitError(f"task {task.task_id} left no result to read ({err})") from None
    if outcome != "success":
        raise SubmitError(f"task {task.task_id} failed:\n{value}")
    return value


def _keep_logs_private(logs: Path) -> None:
    """The logs folder holds the pickles submitit's runner loads (`train.start`): writable by
    the user alone, whatever the umask."""
    logs.mkdir(parents=True, exist_ok=True)
    userfiles.keep_private(logs)


def saved_words(stop: dict[str, Any]) -> str:
    """What a stopped attempt saved: where the kit's loop stood, or whether a user's program
    saved anything new in its checkpoint folder."""
    if "epoch" in stop:
        return f"saved in epoch {stop['epoch']} after batch {stop.get('batches', 0)}"
    return "its program saved" if stop.get("saved") else "its program saved nothing new"


def _failed(job: submitit.Job[Any], run_dir: Path, error: str, say: Callable[[str], None]) -> int:
    """Say how a job that did not finish ended: stopped and saved, or its first failure (else
    `error`, what submitit or Slurm said)."""
    stop = _planned_stop(run_dir)
    if stop:  # stopped on purpose and saved: no failure, and no traceback
        why = f"; not requeued: {stop['not_requeued']}" if stop.get("not_requeued") else ""
        say(
            f"job {job.job_id} stopped ({stop['reason']}), {saved_words(stop)}{why}; "
            f"{continue_words(run_dir)}"
        )
        return EXIT_FAILED
    first = runfolder.first_failure(run_dir)
    if first:  # the rank that failed first, not a peer that lost its connection to it
        say(f"job {job.job_id} failed: {runfolder.failure_words(first)}")
        # A bug's traceback helps; a setting's message, or a lost peer's, says it all.
        if not first.get("kit_error") and not runfolder.lost_peer(first):
            say(first.get("traceback_tail", "").rstrip())
    else:
        say(f"job {job.job_id} failed: {error}")
    say(f"logs: python -m launch logs {run_dir}")
    return EXIT_FAILED


END_LOOK_S = 10  # how often --wait asks Slurm whether a job whose results are missing has ended
END_GRACE_S = 10  # and how long after Slurm's word it waits for the results' files


class _SlurmEnd:
    """Slurm's word that a job has ended. submitit reads a job's end from accounting (sacct)
    alone: where that does not answer, a job that ended without every task's result file
    (cancelled, stopped, its node lost) would be followed for ever."""

    def __init__(self, job: submitit.Job[Any]) -> None:
        self.job, self.state = job, ""
        self.look = self.since = time.monotonic()

    def seen(self) -> bool:
        """Whether Slurm ended the job END_GRACE_S ago or more (time for the tasks' result
        files to appear on a shared file system; for a lost node or a preemption, time for
        Slurm to requeue the job)."""
        now = time.monotonic()
        if isinstance(self.job, submitit.SlurmJob) and now >= self.look:
            self.look = now + END_LOOK_S
            state = slurm.end_of(str(self.job.job_id)) or ""
            if state != self.state:
                self.since = now
            self.state = state
        grace = MAYBE_BACK_S if self.state in _MAYBE_BACK else END_GRACE_S
        return bool(self.state) and now - self.since >= grace


def _tasks_left(job: submitit.Job[Any], run_dir: Path) -> bool:
    """A local job's tasks that outlive their controller (killed): the job is not over yet."""
    from slurm_ddp_kit.launch.jobs import local_job_alive

    return isinstance(job, submitit.LocalJob) and local_job_alive(run_dir)


def _cancelled(job: submitit.Job[Any], run_dir: Path) -> bool:
    """The job ended by a cancel, not of itself: marked by `launch cancel`, or, for a Slurm job
    cancelled with scancel, so in Slurm's words."""
    if runfolder.of_kind(runfolder.read_rank(run_dir, 0), "summary"):
        return False
    if runfolder.read_meta(run_dir).get("cancel_requested"):
        return True
    found = slurm.state(str(job.job_id)) if isinstance(job, submitit.SlurmJob) else None
    return bool(found and found.state.startswith("CANCELLED"))


def _planned_stop(run_dir: Path) -> dict[str, Any] | None:
    """The last attempt's stop record where it ended so (a signal, the time limit), unless it
    asked Slurm to requeue it (then the job goes on)."""
    view = runfolder.read_rank(run_dir, 0)
    stops = runfolder.of_kind(view, "stop")
    if not stops or runfolder.of_kind(view, "summary") or stops[-1].get("requeue"):
        return None
    return stops[-1]


PENDING_LOOK_S = 10  # how often --wait asks Slurm why a job has not started
_STILL = (
    "RUNNING",
    "COMPLETING",
    "PENDING",
    "REQUEUED",
    "REQUEUE_HOLD",
    "CONFIGURING",
    "SUSPENDED",
)


class _SlurmWord:
    """Slurm's verdict on a job whose rank 0 has ended: its result file says it failed while
    Slurm may still run it (a node it cannot reach keeps the step alive until Slurm marks the
    node down) and then requeue it. `--wait` follows the job until Slurm ends it, not rank 0."""

    def __init__(self, job: submitit.Job[Any], run_dir: Path, say: Callable[[str], None]) -> None:
        self.job, self.run_dir, self.say = job, run_dir, say
        self.since: float | None = None  # when rank 0's end was first seen
        self.last = ""
        # Until when a job ended by a node's failure may still come back (requeued).
        self.back_by: float | None = None

    def still_running(self) -> bool:
        if not isinstance(self.job, submitit.SlurmJob):
            return False
        found = slurm.state(str(self.job.job_id))
        state = found.state if found else ""  # Slurm unreachable: rank 0's word stands
        now = time.monotonic()
        self.since = self.since or now
        if state in _MAYBE_BACK:  # with --requeue, Slurm brings such a job back as PENDING
            self.back_by = self.back_by or now + MAYBE_BACK_S
            self._tell(state, "waiting to see whether Slurm requeues it")
            return now < self.back_by
        self.back_by = None
        if state in _STILL and now - self.since > FOLLOW_GRACE_S:
            running = state in ("RUNNING", "COMPLETING")
            self._tell(state, "following it" if running else "requeued; following its next attempt")
        return state in _STILL

    def _tell(self, state: str, doing: str) -> None:
        if state == self.last:
            return
        first = runfolder.first_failure(self.run_dir)
        said = f" ({runfolder.failure_words(first).splitlines()[0][:300]})" if first else ""
        lost = slurm.unanswering(runfolder.nodes_of(self.run_dir))
        why = "".join(f"; node {node} is not answering Slurm ({w})" for node, w in lost.items())
        self.say(
            f"job {self.job.job_id}: rank 0 has ended{said}, but Slurm says {state}{why}: {doing}"
        )
        self.last = state


_MAYBE_BACK = ("NODE_FAIL", "PREEMPTED")
MAYBE_BACK_S = 120
FOLLOW_GRACE_S = 10  # a job whose rank failed is COMPLETING for a moment: no word on that


def _say_pending(
    job: submitit.Job[Any], run_dir: Path, said: str, say: Callable[[str], None]
) -> str:
    """Say why the job waits, when that changes (a job that can never start waits silently);
    for one that ran and waits again, that Slurm requeued it, why, and where it goes on."""
    reason = slurm.pending_reason(str(job.job_id)) or ""
    if reason and reason != said:
        again = _requeued(run_dir)
        say(f"job {job.job_id} {again}pending: {reason} (`python -m launch cancel {run_dir}`)")
    return reason


def _requeued(run_dir: Path) -> str:
    """'requeued (…), ' for a job whose ranks have started before, else ''."""
    records = runfolder.read_rank(run_dir, 0)
    if not runfolder.of_kind(records, "start"):
        return ""
    lost = slurm.unanswering(runfolder.nodes_of(run_dir))
    why = [f"node {node} is not answering Slurm ({word})" for node, word in lost.items()]
    stops = runfolder.of_kind(records, "stop")
    if stops:
        why.append(saved_words(stops[-1]))
    else:
        why.append("it goes on from its last checkpoint")
    return f"requeued ({'; '.join(why)}), "


def interrupted(job: submitit.Job[Any], run_dir: Path, err: KeyboardInterrupt | None = None) -> str:
    """After Ctrl-C (or SIGTERM, SIGHUP: `err`) while following a job: what became of it, in
    one line.

    A local job runs in the terminal's process group, so the terminal's Ctrl-C reached its
    controller and ranks as well: it is cancelled as `launch cancel` would (marked, so `status`
    reads CANCELLED and names no failure; its checkpoints kept for `launch resume`), and waited
    for until none of its processes is left. A signal to this process alone, which cannot be
    told apart, ends the job the same way. A Slurm job is not in this terminal: it goes on.
    """
    from slurm_ddp_kit.launch.jobs import cancel, wait_local_end

    for signum in ENDING:  # a second Ctrl-C does not cut this short
        with contextlib.suppress(ValueError):
            signal.signal(signum, signal.SIG_IGN)
    word = interrupt_word(err or KeyboardInterrupt())
    if not isinstance(job, submitit.LocalJob):
        return (
            f"{word}: stopped following; job {job.job_id} goes on: "
            f"`python -m launch status {run_dir}`, `python -m launch cancel {run_dir}`"
        )
    if runfolder.of_kind(runfolder.read_rank(run_dir, 0), "summary"):
        return f"{word}: job {job.job_id} had already completed"
    # Marked here too: the terminal's Ctrl-C may have ended the job before `cancel` looks.
    runfolder.update_meta(run_dir, cancel_requested=True)
    cancel(run_dir)
    deadline = time.monotonic() + 30  # the controller ends its tasks within seconds
    while not job.done() and time.monotonic() < deadline:
        time.sleep(0.2)
    wait_local_end(run_dir)  # tasks a second Ctrl-C kept the controller from ending
    return f"{word}: cancelled local job {job.job_id}; {continue_words(run_dir)}"


def continue_words(run_dir: Path) -> str:
    """How a stopped run goes on, said from what is on disk: a Ctrl-C in the middle of the first
    save leaves no checkpoint (the partial file is removed)."""
    if runfolder.state_path(run_dir).is_file():
        return f"continue it from its last checkpoint with `python -m launch resume {run_dir}`"
    return f"it had saved no checkpoint yet: `python -m launch resume {run_dir}` starts it over"


def _widest_words(result: dict[str, Any]) -> str:
    """A largest-model search's result in words."""
    widest, trials = result["largest_width"], result.get("trials") or []
    at = f"at a global batch of {result.get('global_batch')}"
    if not trials:
        return "largest model not measured (no GPU)"
    if not widest:
        return (
            f"no width trains {at}: model.width={min(t['width'] for t in trials)} ran out of memory"
        )
    bound = "at least " if widest >= result.get("ceiling", float("inf")) else ""
    parameters = result.get("largest_model_parameters") or 0
    return (
        f"widest model that trains {at}: {bound}model.width={widest} "
        f"({parameters / 1e6:,.1f} M parameters, within 5 %)"
    )


def result_words(result: dict[str, Any]) -> str:
    """A finished run's result in words, from its first rank's summary."""
    if result.get("diverged_epoch") is not None:
        return f"diverged: {diverged_words(result)}"
    if "largest_global_batch" in result:
        largest, trials = result["largest_global_batch"], result.get("trials") or []
        if not trials:
            return "largest batch not measured (no GPU)"
        if not largest:
            smallest = min(t["global_batch"] for t in trials)
            return f"no batch fits: {smallest} samples ran out of memory"
        if largest >= result.get("ceiling", float("inf")):
            return f"largest global batch that fits: at least {largest} (where the search stops)"
        return f"largest global batch that fits: {largest} (within 5 %)"
    if "largest_width" in result:
        return _widest_words(result)
    if "program" in result:
        return f"the program ended with status 0 after {result.get('total_seconds') or 0:.1f} s"
    return (
        f"test accuracy {result['final_test_accuracy']:.2%}, test loss {result['final_test_loss']:.4f}, "
        f"{result['train_seconds']:.1f} s training{_over_attempts(result)}"
    )


def _over_attempts(result: dict[str, Any]) -> str:
    """A resumed run's training time is its epochs' over every attempt: said so."""
    attempts, untimed = result.get("attempts") or 1, result.get("untimed") or 0
    if attempts < 2:
        return ""
    split = f"; {untimed} epoch(s) split across attempts not timed" if untimed else ""
    return f" (its epochs over {attempts} attempts, each epoch once{split})"


def _show_program(
    records: list[dict[str, Any]], start: dict[str, Any], shown: _Shown, say: Callable[[str], None]
) -> None:
    """A program's run: each attempt's start, then each record it logged (`slurm_ddp_kit.log`)."""
    if start["time"] != shown.attempt:
        if shown.attempt is not None:
            say("started again (requeued or resumed)")
        words = shlex.join(start.get("program") or [])
        say(f"{start.get('world_size', '?')} rank(s) started `{words}`")
        shown.attempt, shown.last = start["time"], 0
    logs = [r for r in runfolder.of_kind(records, "log") if r["time"] >= start["time"]]
    for record in logs[shown.last :]:
        say(", ".join(f"{key} {_value_words(value)}" for key, value in record["fields"].items()))
    shown.last = max(shown.last, len(logs))


def _value_words(value: object) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _started_words(start: dict[str, Any]) -> str:
    """What the job did before its first step, from rank 0's start record."""
    parts = start.get("startup_parts") or {}
    spent = ", ".join(
        f"{name.replace('_', ' ')} {seconds:.1f} s" for name, seconds in parts.items()
    )
    took = (
        f" in {start['startup_s']:.1f} s" if isinstance(start.get("startup_s"), int | float) else ""
    )
    return (
        f"{start.get('world_size', '?')} rank(s) started{took}" + (f" ({spent})" if spent else "")
        + f"; training on {start.get('device', '?')}"
        + (_NO_BYTECODE if start.get("bytecode_cached") is False else "")
    )  # fmt: skip


_NO_BYTECODE = (
    "; torch was compiled from its sources as each rank started (Python writes no bytecode "
    "here: PYTHONDONTWRITEBYTECODE or -B, and none was cached), seconds of every start: unset "
    "it in the job's environment, with PYTHONPYCACHEPREFIX set to a writable folder where "
    "site-packages is read-only"
)


def _warm_up_words(cfg: Config) -> str:
    """What the start-up does beyond the plain path, so a long start is not taken for a hang:
    the compile and the capture, on a random batch before the data (train.steps.warm_up)."""
    t = cfg.train
    done = [
        "compiled (torch.compile: minutes on a cold compile cache)" if t.compile else "",
        "its step captured as CUDA graphs" if t.cuda_graph else "",
    ]
    return f" {' and '.join(filter(None, done))} on a random batch" if any(done) else ""


def _cache_words(cache: object) -> str:
    """What the start line says of the compile cache (with train.compile)."""
    if cache == "warm":
        return "; its compile came from the compile cache"
    if cache == "cold":
        return "; compiled afresh, and saved to the compile cache for the next job"
    return ""


@dataclasses.dataclass
class _Shown:
    """What `--wait` has said: epochs 1..last, of the attempt that started at `attempt`."""

    last: int = 0
    attempt: float | None = None
    progress: float = 0.0  # the time of the last progress record said


def _show_epochs(run_dir: Path, shown: _Shown, say: Callable[[str], None]) -> None:
    """Say each epoch past the last one said. A new attempt (a requeue, a resume) is said with
    where it goes on from; one that goes on from an earlier epoch (its checkpoint was older)
    has those epochs said again."""
    records = runfolder.read_rank(run_dir, 0)
    start = next(iter(runfolder.of_kind(records, "start")), None)
    if start and start.get("task") == "program":
        _show_program(records, start, shown, say)
        return
    epochs = runfolder.of_kind(records, "epoch")
    if start and start["time"] != shown.attempt:
        first, batch = start.get("first_epoch", 1), start.get("resumed_at_batch", 0)
        if shown.attempt is not None:
            say(f"resumed at epoch {first}, batch {batch}")
        say(_started_words(start) + _cache_words(start.get("compile_cache")))
        if start.get("placement"):
            say(f"warning: {start['placement']}")
        shown.attempt, shown.last = start["time"], min(shown.last, first - 1)
    world, total = (start["world_size"], start.get("epochs", "?")) if start else (1, "?")
    for r in epochs[shown.last :]:
        timing = (
            f"{r['seconds']:.2f} s, {r['samples'] * world / r['seconds']:.0f} samples/s"
            if r["seconds"]
            else "time n/m (split across attempts)"
        )
        say(
            f"epoch {r['epoch']}/{total}: {timing}, train loss {r['train_loss']:.4f}, "
            f"test loss {r['test_loss']:.4f}, accuracy {r['test_accuracy']:.2%}"
        )
    shown.last = max(shown.last, len(epochs))
    _show_progress(records, epochs, shown, say, total)


def _show_progress(
    records: list[dict[str, Any]],
    epochs: list[dict[str, Any]],
    shown: _Shown,
    say: Callable[[str], None],
    total: object,
) -> None:
    """Where the running epoch is (output.progress_s), said once per record, indented: only the
    latest, and none once its epoch has ended."""
    done = epochs[-1]["time"] if epochs else 0.0
    latest = next(iter(runfolder.of_kind(records, "progress")[-1:]), None)
    if latest is None or latest["time"] <= max(done, shown.progress):
        return
    shown.progress = latest["time"]
    b, n, e = latest["batch"], latest["batches"], latest["epoch"]
    say(f"  batch {b}/{n} of epoch {e}/{total} ({b / n:.0%}), {latest['seconds']:.0f} s in")


def dry_run(cfg: Config) -> str:
    """What `submit` would do, refusing what it would refuse; on Slurm the exact batch script.

    Nothing is created: the script comes from submitit's own submission path, run against a
    stand-in `sbatch` that only keeps the script, in a scratch folder named back to the run's.
    """
    backend = check_submission(cfg, dry_run=True)
    run_dir = runfolder.check_root(cfg.output.root) / runfolder.new_name(cfg)
    head = f"run folder (made on submit, named then): {run_dir}\n"
    if cfg.program:
        head += f"program in each task: {shlex.join(program_arguments(cfg))}\n"
    if backend == Backend.local:
        return (
            f"{head}backend: local (submitit LocalExecutor)\ntasks: {world_size(cfg)}\n"
            f"timeout_min: {cfg.cluster.timeout_min}\nlogs: {runfolder.logs_dir(run_dir)}\n"
        )
    params = slurm_parameters(cfg, run_dir.name)
    lines = [f"  {k}: {v}" for k, v in sorted(params.items())]
    return (
        f"{head}backend: slurm (submitit SlurmExecutor)\nparameters:\n"
        + "\n".join(lines)
        + "\n\n"
        + _script_for(cfg, run_dir)
    )


_STAND_IN_SBATCH = """#!/bin/sh
# Keeps the batch script submitit hands to sbatch; submits nothing.
cp "$1" "$KIT_DRY_RUN_SCRIPT"
echo "Submitted batch job 1"
"""


def _script_for(cfg: Config, run_dir: Path) -> str:
    with (
        tempfile.TemporaryDirectory(prefix="kit-dry-run-") as scratch,
        _stand_in_sbatch(Path(scratch)) as captured,
    ):
        folder = Path(scratch) / "run"
        executor = make_executor(cfg, folder, Backend.slurm)
        executor.update_parameters(job_name=f"kit-{run_dir.name}")
        executor.submit(job_of(cfg), str(run_dir))
        return captured.read_text().replace(str(folder), str(run_dir))


@contextlib.contextmanager
def _stand_in_sbatch(scratch: Path) -> Iterator[Path]:
    """While inside, `sbatch` is a stand-in that keeps the script (at the path yielded)."""
    bin_dir = scratch / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(_STAND_IN_SBATCH)
    (bin_dir / "sbatch").chmod(0o755)
    captured = scratch / "script.sh"
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    with _environment(env | {"KIT_DRY_RUN_SCRIPT": str(captured)}):
        yield captured


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def sweep(
    cfgs: list[Config], commands: list[list[str]], parallel: int | None = None
) -> Iterator[tuple[Path, submitit.Job[Any]]]:
    """Submit a grid of configs (each run folder records its own point's command): on Slurm
    one array (at most `parallel` elements at once); locally one run after another (or
    `parallel` at a time), each waited for before the next starts."""
    for cfg in cfgs:
        check_submission(cfg)
    if resolve_backend(cfgs[0].cluster.backend) == Backend.local:
        yield from _local_sweep(cfgs, commands, parallel or 1)
    else:
        yield from _slurm_sweep(cfgs, commands, parallel)


def _local_sweep(
    cfgs: list[Config], commands: list[list[str]], parallel: int
) -> Iterator[tuple[Path, submitit.Job[Any]]]:
    running: list[submitit.Job[Any]] = []
    for cfg, command in zip(cfgs, commands, strict=True):
        while len(running) >= parallel:
            running = [job for job in running if not job.done()]
            time.sleep(0.5)
        held = HeldSignals()  # until the caller has the run: it names the run on a signal
        try:
            run_dir, job = submit(cfg, command, held=held)
            running.append(job)
            yield run_dir, job
        finally:
            held.release()
        if held.signum is not None:
            raise Interrupted(held.signum)
    while not all(job.done() for job in running):
        time.sleep(0.5)


def _slurm_sweep(
    cfgs: list[Config], commands: list[list[str]], parallel: int | None
) -> Iterator[tuple[Path, submitit.Job[Any]]]:
    """One array per allocation shape and MaxArraySize runs (`_arrays`), each made,
    submitted and recorded in turn; an array Slurm refuses takes its run folders with it, and
    says how many went in. A signal ends the sweep before the next run folder; the runs in the
    queue are the caller's (yielded) and recorded by then. A second signal ends it at once
    (a hanging sbatch), but never between an array's submission and its runs' records."""
    made = runfolder.folders_to_make(cfgs[0].output.root)
    held = HeldSignals()  # from the first run folder until the caller has every run
    held.hold()
    try:
        for start, end in _arrays(cfgs, slurm.max_array_size() or len(cfgs)):
            part = _array_folders(cfgs[start:end], commands[start:end], held)
            if held.signum is not None:  # the caller says how many went in
                _discard_array(part, made)
                break
            try:
                jobs = _array(cfgs[start:end], part, parallel)
            except SubmitError as err:
                _discard_array(part, made)
                went = f"; the first {start} runs were submitted (`launch status`)" if start else ""
                raise SubmitError(f"{err}{went}") from None
            with held.firmly():
                for run_dir, job in zip(part, jobs, strict=True):
                    _record_job(run_dir, job)
            yield from zip(part, jobs, strict=True)
    finally:
        held.release()
    if held.signum is not None:
        raise Interrupted(held.signum)


def _arrays(cfgs: list[Config], size: int) -> Iterator[tuple[int, int]]:
    """The sweep's arrays, as (first, end) of its points: points in a row that ask Slurm for the
    same allocation share one, cut at the cluster's MaxArraySize (its limit on an array's
    indices). A sweep of dp,ddp is a DP array (one task per node with all of its CPUs, as a lone
    `submit --mode dp` gets) and a DDP array (a task per GPU), whose figures compare alike."""
    first = 0
    while first < len(cfgs):
        end, shape = first + 1, _allocation(cfgs[first])
        while end < len(cfgs) and end - first < size and _allocation(cfgs[end]) == shape:
            end += 1
        yield first, end
        first = end


def _allocation(cfg: Config) -> str:
    """What an element asks sbatch for, its name aside: elements alike share an array."""
    asked = slurm_parameters(cfg, "")
    return repr(sorted((key, value) for key, value in asked.items() if key != "job_name"))


def _array_folders(cfgs: list[Config], commands: list[list[str]], held: HeldSignals) -> list[Path]:
    """An array's run folders, made until a signal comes (a second one: none left behind)."""
    part: list[Path] = []
    try:
        for cfg, command in zip(cfgs, commands, strict=True):
            if held.signum is not None:
                break
            part.append(runfolder.create(cfg, "launch sweep", "slurm", command))
    except KeyboardInterrupt:
        _discard_array(part, [])
        raise
    return part


def _discard_array(run_dirs: list[Path], made: list[Path]) -> None:
    """An array's run folders that no job runs in, and its logs' folder (`sweeps/` too where
    nothing else is left in it)."""
    logs = [runfolder.sweep_logs_dir(run_dirs[0])] if run_dirs else []
    runfolder.discard([*run_dirs, *logs], [*(path.parent for path in logs), *made])


def _array(
    cfgs: list[Config], run_dirs: list[Path], parallel: int | None
) -> list[submitit.Job[Any]]:
    """One Slurm array of these runs; SubmitError with sbatch's words if Slurm refuses it."""
    logs = runfolder.sweep_logs_dir(run_dirs[0])
    executor = _array_executor(cfgs, logs, run_dirs[0], parallel)
    try:
        with _without_enclosing_job(), contextlib.redirect_stderr(io.StringIO()):
            return executor.map_array(job_of(cfgs[0], element=True), [str(d) for d in run_dirs])
    except (submitit.core.utils.FailedSubmissionError, submitit.core.utils.FailedJobError) as err:
        raise SubmitError(refusal(err, f"the sweep's array of {len(run_dirs)} runs")) from None


def _array_executor(
    cfgs: list[Config], logs: Path, first: Path, parallel: int | None
) -> submitit.SlurmExecutor:
    """One array's executor (its elements ask for one allocation alike: `_arrays`), its
    elements started as every job's tasks are."""
    # Each element checks its own cluster.max_requeues first; submitit's count must not end it sooner.
    most = max(c.cluster.max_requeues for c in cfgs)
    shape = cfgs[0]
    _keep_logs_private(logs)
    executor = submitit.SlurmExecutor(folder=logs, max_num_timeout=most, python=task_python(shape))
    executor.update_parameters(**slurm_parameters(shape, f"sweep-{first.name}"))
    # No --parallel: every element may run at once (submitit's own default caps an array at 256).
    executor.update_parameters(array_parallelism=parallel or len(cfgs))
    return executor


def sweep_dry_run(cfgs: list[Config], parallel: int | None = None) -> str:
    """What `sweep` would do, refusing what it would refuse: each run's grid point and folder,
    and on Slurm the array's exact batch script. Nothing is created."""
    for cfg in cfgs:
        check_submission(cfg, dry_run=True)
    run_dirs = [runfolder.check_root(c.output.root) / runfolder.new_name(c) for c in cfgs]
    head = "".join(f"run folder (made on submit): {d}\n" for d in run_dirs)
    if resolve_backend(cfgs[0].cluster.backend) == Backend.local:
        at_once = parallel or 1
        return f"{head}backend: local (submitit LocalExecutor), {at_once} run(s) at a time\n"
    arrays = list(_arrays(cfgs, len(cfgs)))  # the cluster's MaxArraySize is not asked for
    said = [f"{head}backend: slurm (submitit SlurmExecutor), {len(arrays)} array(s)\n"]
    for first, end in arrays:
        script = _array_script(cfgs[first:end], run_dirs[first:end], parallel)
        said.append(f"\narray of points {first}-{end - 1}:\n{script}")
    return "".join(said)


def _array_script(cfgs: list[Config], run_dirs: list[Path], parallel: int | None) -> str:
    with (
        tempfile.TemporaryDirectory(prefix="kit-dry-run-") as scratch,
        _stand_in_sbatch(Path(scratch)) as captured,
    ):
        logs = Path(scratch) / "logs"
        executor = _array_executor(cfgs, logs, run_dirs[0], parallel)
        executor.map_array(job_of(cfgs[0], element=True), [str(d) for d in run_dirs])
        return captured.read_text().replace(str(logs), str(runfolder.sweep_logs_dir(run_dirs[0])))
