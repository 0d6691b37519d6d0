"""Where a run's job runs: on this machine (submitit's LocalExecutor) or on Slurm (its
SlurmExecutor). Nothing outside this package asks which one runs a job: the launcher asks the
job's backend itself.

A backend is one `Backend` subclass in a module of its own (`local.py`, `slurm.py`; Slurm's
submission and following are `slurm_submit.py` and `slurm_follow.py`, loaded where used). The
launcher gets one from a config's `cluster.backend` (`chosen`), from the word a run folder's
metadata records (`recorded`, `to_cancel`), or from a submitted submitit job (`of_job`). What a
backend answers: its rules on the settings and its checks before a submission; the executor and
what surrounds its submit; what the run folder records of the job; the job's state for `status`,
its cancel; what `--wait` asks of it (`Watch`) and what Ctrl-C while following does; the dry
run's text; a sweep's shape.

submitit is loaded where a job is submitted or followed, never by this package's import:
`launch status` and `launch cancel` start without it.
"""

from __future__ import annotations

import abc
import contextlib
import functools
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from slurm_ddp_kit.core import runfolder, snapshot

# Aliased: once the backends load, this package's own name `slurm` is its Slurm backend module.
from slurm_ddp_kit.core import slurm as slurm_commands
from slurm_ddp_kit.core.errors import KitError
from slurm_ddp_kit.core.settings import schema
from slurm_ddp_kit.core.settings.schema import Config

if TYPE_CHECKING:
    import submitit

    from slurm_ddp_kit.launch.code import CodeCopy

    Job = submitit.Job[Any]

__all__ = [
    "Backend",
    "JobError",
    "SchedulerState",
    "Seen",
    "SubmitError",
    "Watch",
    "check_settings",
    "chosen",
    "of_job",
    "of_sbatch_scripts",
    "recorded",
    "survey",
    "to_cancel",
]


class SubmitError(KitError):
    """The scheduler refused the job; the message carries its reason."""


class JobError(KitError):
    """A job cannot be operated as asked; the message says why and what to do."""


# What `status` read once for many runs (`survey`), by backend name: each backend keeps and
# reads its own entry (Slurm: its jobs' states; local: this machine's processes).
Seen = dict[str, Any]


@dataclass(frozen=True)
class SchedulerState:
    """A job's state as its scheduler answered it, in `status`'s words."""

    state: str
    elapsed: str
    nodes: str
    ended: bool  # the scheduler ended the job (done, failed, cancelled, …)


class Watch:
    """What `--wait` asks a job's backend while it follows the job (`launch.follow`). These
    defaults answer for a job that starts at once and whose end submitit alone tells."""

    starts_at_once: ClassVar[bool] = False  # no queue: what its start-up does is worth saying

    def __init__(self, job: Job, run_dir: Path, say: Callable[[str], None]) -> None:
        self.job, self.run_dir, self.say = job, run_dir, say
        self.end_state = ""  # the scheduler's word for the job's end, once `ended` saw one

    def waiting(self, say: Callable[[str], None]) -> None:
        """Say why the job waits, when that changes (asked every second)."""

    def going_on(self) -> bool:
        """Whether the job goes on though submitit reads it as done (asked only then)."""
        return False

    def ended(self) -> bool:
        """Whether the scheduler ended the job, whatever submitit reads: its results may never
        come (then `end_state` says how it ended)."""
        return False

    def cancelled(self) -> bool:
        """Whether the scheduler's own command cancelled the job (`launch cancel` marks the run
        folder instead, which `--wait` reads first)."""
        return False

    def unstarted(self) -> str:
        """Why the job ended before it started a task, in words; '' where it started (or where
        this cannot be told)."""
        return ""


class Backend(abc.ABC):
    """What the launcher asks of the machine or cluster that runs a job."""

    name: ClassVar[str]  # cluster.backend's value, and the word a run's metadata records
    sweep_waits: ClassVar[bool]  # a sweep waits for its runs' ends (so it can say their results)

    # --- checks --------------------------------------------------------------------------------

    @abc.abstractmethod
    def check_settings(self, cfg: Config) -> None:
        """This backend's rules on a config's settings, asked of every config the launcher reads
        whatever its cluster.backend (one config file serves both); the first broken raises
        ConfigError."""

    @abc.abstractmethod
    def check_reach(self, cfg: Config, dry_run: bool) -> None:
        """Before anything else of a submission: what it needs to reach (a client, a controller)
        and the nodes it has. A dry run reaches nothing: it shows the script on any machine."""

    @abc.abstractmethod
    def check_runtime(self, cfg: Config, dry_run: bool) -> None:
        """The container's runtime (the image itself is checked already) and the requeue asked."""

    @abc.abstractmethod
    def check_machine(self, cfg: Config) -> None:
        """Last, once the job's inputs passed: whether the machine the job runs on can run it,
        where it can be told from here."""

    # --- submitting ----------------------------------------------------------------------------

    @abc.abstractmethod
    def executor(self, cfg: Config, run_dir: Path) -> submitit.Executor:
        """The submitit executor of a run's job, its logs in the run folder."""

    def submitting(self, run_dir: Path) -> contextlib.AbstractContextManager[None]:
        """What surrounds the submission of a run's job (the shared parts aside:
        `launch.submit`)."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    def refusal(self, err: Exception, what: str = "the job") -> str:
        """Why the job was not taken, and what to look at, from the submission's error."""

    @abc.abstractmethod
    def owns(self, job: Job) -> bool:
        """Whether this backend's executor submitted `job`."""

    def job_process(self, job: Job) -> Any:
        """What tells the job's process from a later one given its id; None where its id is the
        scheduler's own (never reused while a run folder names it)."""
        return None

    def record(self, run_dir: Path, job: Job) -> None:
        """The job id, and where each task's stdout and stderr go (submitit names them)."""
        tasks = [job.task(rank) for rank in range(job.num_tasks)]
        logs = [[str(t.paths.stdout), str(t.paths.stderr)] for t in tasks]
        meta = runfolder.read_meta(run_dir)
        jobs = [*meta.get("jobs", []), str(job.job_id)]  # every job that ran in this folder
        runfolder.update_meta(
            run_dir, job_id=str(job.job_id), logs=logs, jobs=jobs,
            job_process=self.job_process(job),
        )  # fmt: skip

    # --- a submitted job -----------------------------------------------------------------------

    @abc.abstractmethod
    def survey(self, metas: list[dict[str, Any]], seen: Seen) -> None:
        """Read at once, into seen[name], what `state` and `alive` ask of many runs (`status`
        lists thousands); `metas`: the readable runs' metadata, of every backend."""

    @abc.abstractmethod
    def state(self, job_id: str, seen: Seen | None) -> SchedulerState | None:
        """The job's state, where a scheduler answers for it; None: the run folder tells."""

    def alive(self, run_dir: Path, meta: dict[str, Any], seen: Seen | None) -> bool:
        """Whether the run's job is seen to run here (its processes); False where no process of
        it can be seen from here."""
        return False

    @abc.abstractmethod
    def unanswered(self, alive: bool) -> str:
        """`status`'s word for a job that neither its scheduler nor its run folder places."""

    @abc.abstractmethod
    def cancel(self, run_dir: Path, meta: dict[str, Any], job_id: str) -> str:
        """Cancel the run's job (one that has not completed); returns what was done, in words."""

    @abc.abstractmethod
    def watch(self, job: Job, run_dir: Path, say: Callable[[str], None]) -> Watch:
        """What `--wait` asks of the job while it follows it."""

    @abc.abstractmethod
    def interrupted(self, job: Job, run_dir: Path, word: str) -> str:
        """What Ctrl-C (`word`) while following the job does to it, said in one line."""

    # --- dry runs and sweeps -------------------------------------------------------------------

    @abc.abstractmethod
    def dry_run(self, cfg: Config, run_dir: Path, planned: snapshot.Plan) -> str:
        """The dry run's text past the run folder: the backend, and what it would be handed
        (`planned`: the code copy the run would get, planned once by the caller)."""

    @abc.abstractmethod
    def sweep(
        self, cfgs: list[Config], commands: list[list[str]], parallel: int | None, code: CodeCopy
    ) -> Iterator[tuple[Path, Job]]:
        """Submit a sweep's checked configs (`parallel`: at most that many at once), each run
        folder recording its own point's command and given the sweep's one code copy (`code`);
        yields each run as it is submitted."""

    @abc.abstractmethod
    def sweep_dry_run(self, cfgs: list[Config], run_dirs: list[Path], parallel: int | None) -> str:
        """A sweep's dry run past its run folders."""

    @abc.abstractmethod
    def sweep_interrupted(
        self, err: KeyboardInterrupt, submitted: list[tuple[Path, Job]]
    ) -> Iterator[str]:
        """What an interrupt (`err`) did to the sweep's submitted runs, in lines, each as it is
        done."""


@functools.cache
def _registry() -> dict[str, Backend]:
    """One instance of each backend, by name, in _MODULES' order: each module named there
    defines one."""
    modules = [importlib.import_module(f"{__name__}.{name}").__name__ for name in _MODULES]
    found = sorted(Backend.__subclasses__(), key=lambda cls: modules.index(cls.__module__))
    return {cls.name: cls() for cls in found}


_MODULES = ("local", "slurm")  # slurm_submit and slurm_follow are Slurm's, loaded where used


def chosen(cfg: Config) -> Backend:
    """The backend `cfg` runs on: `auto` is Slurm where its client is installed and configured,
    else this machine."""
    name = cfg.cluster.backend
    if name == schema.Backend.auto:
        name = schema.Backend.slurm if slurm_commands.available() else schema.Backend.local
    return _registry()[name.value]


def recorded(meta: dict[str, Any]) -> Backend | None:
    """The backend a run folder's metadata names; None where it names none this kit knows
    (`status` then reads the run folder alone, and calls a run it cannot place UNKNOWN)."""
    return _registry().get(str(meta.get("backend")))


def to_cancel(meta: dict[str, Any]) -> Backend:
    """The backend that cancels a run's job: the one its metadata names, and where it names none
    this kit knows, the local one (whose cancel signals only processes proven to be the run's)."""
    return recorded(meta) or _registry()[schema.Backend.local.value]


def of_job(job: Job) -> Backend:
    """The backend whose executor submitted `job`."""
    return next(backend for backend in _registry().values() if backend.owns(job))


def of_sbatch_scripts() -> Backend:
    """The backend of the runs the sbatch scripts make (`launch prepare`): Slurm's."""
    return _registry()[schema.Backend.slurm.value]


def check_settings(cfg: Config) -> None:
    """Every backend's rules on a config's settings (`Backend.check_settings`): the launcher asks
    them of each config it loads or reads, before anything is made."""
    for backend in _registry().values():
        backend.check_settings(cfg)


def survey(run_dirs: list[Path]) -> Seen:
    """What `status` asks of these runs' jobs, read at once (a few calls for thousands of runs);
    a folder whose metadata cannot be read is left to `status` to report."""
    metas = []
    for run_dir in run_dirs:
        with contextlib.suppress(runfolder.RunFolderError):
            metas.append(runfolder.read_meta(run_dir))
    seen: Seen = {}
    for backend in _registry().values():
        backend.survey(metas, seen)
    return seen
