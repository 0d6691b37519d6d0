"""The Slurm backend: the job is a Slurm job, submitted through submitit's SlurmExecutor (or by
an sbatch script of the kit's, which runs `launch prepare`).

Here: Slurm's rules on the settings' text (what sbatch reads: names, the GRES type, the options
of cluster.sbatch_extra), its checks before a submission, the executor's parameters, sbatch's
refusals in words, a job's state as Slurm answers it, and its cancel. Submitting (the executor,
a dry run's script, a sweep's arrays) is `slurm_submit.py`, and what `--wait` asks of a job
`slurm_follow.py`: both load submitit, which `status` and `cancel` never do. Every Slurm command
itself runs in `core.slurm`.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slurm_ddp_kit.core import container, runfolder, slurm, slurmtext, snapshot, strategies
from slurm_ddp_kit.core.cli import interrupt_word
from slurm_ddp_kit.core.settings import schema
from slurm_ddp_kit.core.settings.rules import cpus_per_task, signal_delay_s, tasks_per_node
from slurm_ddp_kit.core.settings.schema import (
    Config,
    ConfigError,
    ContainerRuntime,
    GpuBinding,
    Requeue,
)
from slurm_ddp_kit.launch.backends import Backend, JobError, SchedulerState, Seen, Watch
from slurm_ddp_kit.launch.code import CodeCopy, inside, job_setup

if TYPE_CHECKING:
    import submitit

    from slurm_ddp_kit.launch.backends import Job


class Slurm(Backend):
    """A Slurm cluster, through submitit's SlurmExecutor."""

    name = schema.Backend.slurm.value
    sweep_waits = False  # its runs wait in the queue: `launch status` follows them

    def check_settings(self, cfg: Config) -> None:
        """What sbatch reads from the settings, whichever backend runs this config."""
        c = cfg.cluster
        for key in _SLURM_NAMES:
            _check_slurm_name(f"cluster.{key}", getattr(c, key))
        if c.gpu_type and not _GRES_TYPE.fullmatch(c.gpu_type):
            raise ConfigError(
                f"cluster.gpu_type={c.gpu_type!r} is not a GPU type name: letters, digits, '.', "
                "'_' and '-', as `sinfo -o '%G'` lists them (gpu:TYPE:COUNT), e.g. "
                "cluster.gpu_type=a100"
            )
        _check_sbatch_extra(c.sbatch_extra)
        memory = [key for key in ("mem-per-cpu", "mem-per-gpu") if key in c.sbatch_extra]
        if memory and c.mem_gb:
            raise ConfigError(
                f"cluster.sbatch_extra sets {memory[0]} and cluster.mem_gb={c.mem_gb} sets --mem: "
                "Slurm takes one of them; drop one"
            )

    def check_reach(self, cfg: Config, dry_run: bool) -> None:
        if dry_run:
            return
        if not shutil.which("sbatch"):
            raise ConfigError(
                "cluster.backend=slurm but `sbatch` is not on PATH: use cluster.backend=local"
            )
        missing = slurm.named_conf_missing()
        if missing:
            raise ConfigError(
                f"SLURM_CONF={missing} names no file, so sbatch cannot reach Slurm (it would "
                "retry for a minute): point SLURM_CONF at the cluster's slurm.conf or unset it, "
                "or use cluster.backend=local"
            )

    def check_runtime(self, cfg: Config, dry_run: bool) -> None:
        """What this cluster's srun and sbatch take (a dry run shows the lines regardless)."""
        c = cfg.cluster
        pyxis = c.container.image and c.container.runtime == ContainerRuntime.pyxis
        if pyxis and not dry_run and not slurm.srun_takes("--container-image"):
            raise ConfigError(
                "cluster.container.runtime=pyxis, but this cluster's srun has no "
                "--container-image (the pyxis plugin is not installed): use "
                "cluster.container.runtime=apptainer, or ask the cluster's admins for pyxis"
            )
        refused = "" if c.requeue != Requeue.expedite or dry_run else slurm.expedite_refused()
        if refused:
            raise ConfigError(
                f"cluster.requeue=expedite, but {refused}: drop it (cluster.requeue=normal), or "
                "ask the cluster's admins for SlurmctldParameters=enable_expedited_requeue on "
                "Slurm 25.11+"
            )

    def check_machine(self, cfg: Config) -> None:
        """Nothing: the job runs on the cluster's nodes, not here; it checks them itself."""

    def executor(self, cfg: Config, run_dir: Path) -> submitit.Executor:
        from slurm_ddp_kit.launch.backends import slurm_submit

        return slurm_submit.executor(cfg, run_dir)

    def refusal(self, err: Exception, what: str = "the job") -> str:
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

    def owns(self, job: Job) -> bool:
        import submitit

        return isinstance(job, submitit.SlurmJob)

    def survey(self, metas: list[dict[str, Any]], seen: Seen) -> None:
        """Every Slurm job of these runs, asked all at once (a few calls for thousands)."""
        ids = [str(m["job_id"]) for m in metas if m.get("backend") == self.name and m.get("job_id")]
        seen[self.name] = slurm.states(ids) if ids else {}

    def state(self, job_id: str, seen: Seen | None) -> SchedulerState | None:
        known = seen.get(self.name) if seen is not None else None
        found = known.get(job_id) if known is not None else slurm.state(job_id)
        if found is None:  # Slurm did not answer for it: the run folder tells
            return None
        return SchedulerState(
            _word(found.state), found.elapsed, found.nodes, found.state in slurmtext.ENDED
        )

    def unanswered(self, alive: bool) -> str:
        return "UNKNOWN"  # Slurm did not answer and the run folder holds no summary

    def cancel(self, run_dir: Path, meta: dict[str, Any], job_id: str) -> str:
        marked_before = bool(meta.get("cancel_requested"))
        # Marked first: ranks that catch the cancel's SIGTERM stop without writing anything.
        runfolder.update_meta(run_dir, cancel_requested=True)
        problem = slurm.cancel(job_id)
        if problem == slurm.ALREADY_ENDED:  # a failed run stays FAILED; a cancelled one, CANCELLED
            runfolder.update_meta(run_dir, cancel_requested=marked_before or None)
            return f"{run_dir.name}: Slurm job {job_id} had already ended"
        if problem:
            # Unmarked: the job runs on, and must still save at its time limit and requeue.
            runfolder.update_meta(run_dir, cancel_requested=None)
            raise JobError(
                f"scancel {job_id} failed ({problem}): the job was not cancelled; is Slurm "
                "reachable from here? Try again, or `scancel` it where Slurm answers"
            )
        return f"{run_dir.name}: cancelled Slurm job {job_id}"

    def watch(self, job: Job, run_dir: Path, say: Callable[[str], None]) -> Watch:
        from slurm_ddp_kit.launch.backends import slurm_follow

        return slurm_follow.SlurmWatch(job, run_dir, say)

    def interrupted(self, job: Job, run_dir: Path, word: str) -> str:
        """A Slurm job is not in this terminal: it goes on."""
        return (
            f"{word}: stopped following; job {job.job_id} goes on: "
            f"`python -m launch status {run_dir}`, `python -m launch cancel {run_dir}`"
        )

    def dry_run(self, cfg: Config, run_dir: Path, planned: snapshot.Plan) -> str:
        """The executor's parameters, then the exact batch script."""
        from slurm_ddp_kit.launch.backends import slurm_submit

        code = snapshot.planned_job_code(planned, run_dir)
        params = parameters(cfg, run_dir.name, code)
        lines = [f"  {k}: {v}" for k, v in sorted(params.items())]
        script = slurm_submit.script(cfg, run_dir, code)
        return (
            "backend: slurm (submitit SlurmExecutor)\nparameters:\n"
            + "\n".join(lines)
            + (f"\n\n{script}")
        )

    def sweep(
        self, cfgs: list[Config], commands: list[list[str]], parallel: int | None, code: CodeCopy
    ) -> Iterator[tuple[Path, Job]]:
        """One array per allocation shape (`slurm_submit.sweep`)."""
        from slurm_ddp_kit.launch.backends import slurm_submit

        return slurm_submit.sweep(self, cfgs, commands, parallel, code)

    def sweep_dry_run(self, cfgs: list[Config], run_dirs: list[Path], parallel: int | None) -> str:
        from slurm_ddp_kit.launch.backends import slurm_submit

        return slurm_submit.sweep_dry_run(cfgs, run_dirs, parallel)

    def sweep_interrupted(
        self, err: KeyboardInterrupt, submitted: list[tuple[Path, Job]]
    ) -> Iterator[str]:
        """Its submitted jobs go on: one line, not a Slurm query and a line per run."""
        if submitted:
            queued = [run_dir for run_dir, _ in submitted]
            yield f"{interrupt_word(err)}: {_queued_words(queued, submitted)}"


SWEEP_RUNS_NAMED = 6  # an interrupted sweep's hint names its run folders up to this many


def _queued_words(queued: list[Path], submitted: list[tuple[Path, Any]]) -> str:
    """What goes on of an interrupted Slurm sweep, and how to follow or cancel it alone (its
    root may hold other runs): its run folders, or, for many, its job arrays."""
    if len(queued) <= SWEEP_RUNS_NAMED:
        runs = " ".join(map(str, queued))
        return (
            f"the sweep's {len(queued)} submitted Slurm job(s) go on: `python -m launch status "
            f"{runs}`, `python -m launch cancel {runs}`"
        )
    arrays = " ".join(dict.fromkeys(str(job.job_id).split("_")[0] for _, job in submitted))
    return (
        f"the sweep's {len(queued)} submitted Slurm job(s) go on, in job array(s) {arrays}: "
        f"`python -m launch status {queued[0].parent}` lists them among that folder's runs; "
        f"`scancel {arrays}` cancels them alone"
    )


SIGSTOPPED = "SIGSTOPPED"


def _word(state: str) -> str:
    """Slurm's state as `status` shows it: Slurm's STOPPED (SIGSTOPped in place, its nodes held,
    nothing saved) is not the kit's STOPPED (saved, ended, waiting for `launch resume`)."""
    return SIGSTOPPED if state == "STOPPED" else state


# --- what goes to sbatch --------------------------------------------------------------------


def parameters(cfg: Config, run_name: str, code: snapshot.JobCode | None = None) -> dict[str, Any]:
    """SlurmExecutor parameters; DP is one task holding the node's GPUs, DDP one task per GPU.
    `code`: the run's code copy, where its tasks start (`launch.code.job_setup`)."""
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
        "setup": [slurm.BATCH_START, *job_setup(cfg, code)],
        # One rank failing ends the job, not a hang. A typed --gpus-per-task reaches the step
        # untyped: under Slurm 22.05 a step that inherits `a100:1` is bound to no GPU at all
        # (measured on the test cluster); the allocation already holds the type.
        # srun is told the CPUs per task: Slurm 22.05 and 23.02 do not pass the job's on to
        # it, and where tasks are bound an exact step then gives each task one CPU.
        "srun_args": [
            "--kill-on-bad-exit=1",
            f"--cpus-per-task={cpus_per_task(cfg)}",
            *(["--gpus-per-task=1"] if "gpus_per_task" in gpus and typed else []),
            *container.srun_options(cfg, inside(cfg, code)),
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


# sbatch's words when it found no controller to ask (no slurm.conf, a controller down).
_UNREACHED = re.compile(
    r"fetch config|contact slurm controller|Socket timed out|Zero Bytes were transmitted"
    r"|Connection refused|Unable to establish|slurm\.conf",
    re.IGNORECASE,
)


def _scheduler_words(err: Exception) -> str:
    """sbatch's own error line(s), without submitit's wrapping."""
    lines = [line.strip() for line in str(err).splitlines() if "error" in line.lower()]
    return " ".join(dict.fromkeys(lines)) or str(err).strip()


# --- the settings' text, as sbatch reads it -------------------------------------------------

# Settings Slurm takes as names (comma lists, and for a constraint & | [ ] * ! ( )): no space,
# quote, backslash or comment sign, which would change how sbatch reads the line.
_SLURM_NAMES = ("partition", "account", "qos", "constraint")
_NAME_BREAKERS = re.compile(r"""[\s'"\\#`$]""")
_GRES_TYPE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_SBATCH_KEY = re.compile(r"[a-z][a-z0-9_-]*")

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
    "requeue": "cluster.requeue (normal or expedite) and cluster.max_requeues",
    "no-requeue": "cluster.max_requeues=0",
    # Options that would contradict the kit's own lines or the one task layout it writes.
    "ntasks-per-gpu": "--mode and cluster.gpus_per_node",
    "n": "--mode and cluster.gpus_per_node",
    "gpus": "cluster.gpus_per_node",
    "G": "cluster.gpus_per_node",
    "gpus-per-task": "cluster.gpu_binding=task",
    "cpus-per-gpu": "cluster.cpus_per_task",
    "q": "cluster.qos",
    "o": "output.root (the kit names the logs)",
    "e": "output.root (the kit names the logs)",
    "J": "output.name",
    "array": "`launch sweep` (it writes the array)",
    "a": "`launch sweep` (it writes the array)",
    "wrap": "the kit's batch script (it is the job's command)",
}


def _check_slurm_name(key: str, value: str | None) -> None:
    if value and _NAME_BREAKERS.search(value):  # empty: the default, as when unset
        raise ConfigError(
            f"{key}={value!r} is not a Slurm name: no spaces, quotes, backslashes, '#', '$' or "
            f"'`' (a list is comma-separated, e.g. {key}=a,b), or drop {key} for the default"
        )


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
