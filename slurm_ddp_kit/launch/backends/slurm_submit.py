"""What the Slurm backend hands to sbatch through submitit: a run's executor, the exact batch
script of a dry run (made by submitit itself, with a stand-in sbatch that only keeps it), and a
sweep as Slurm arrays, one per allocation shape."""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import submitit

from slurm_ddp_kit.core import runfolder, slurm, snapshot
from slurm_ddp_kit.core.cli import HeldSignals, Interrupted
from slurm_ddp_kit.core.settings.schema import Config
from slurm_ddp_kit.core.snapshot import SnapshotError
from slurm_ddp_kit.launch.backends import Backend, SubmitError
from slurm_ddp_kit.launch.backends.slurm import parameters
from slurm_ddp_kit.launch.code import CodeCopy, inside
from slurm_ddp_kit.launch.executor import (
    job_of,
    keep_logs_private,
    log,
    logs_folder,
    task_python,
    without_enclosing_job,
)


def executor(cfg: Config, run_dir: Path) -> submitit.SlurmExecutor:
    """A run's executor, its tasks started in the run's code copy (if it has one)."""
    return _executor(cfg, run_dir, snapshot.job_code(run_dir))


def _executor(cfg: Config, run_dir: Path, code: snapshot.JobCode | None) -> submitit.SlurmExecutor:
    """submitit's count of requeues (its max_num_timeout) falls only in the handler the kit
    calls, after its own checks (`train.stopping.not_requeued`): the kit decides."""
    made = submitit.SlurmExecutor(
        folder=logs_folder(run_dir), max_num_timeout=cfg.cluster.max_requeues,
        python=task_python(cfg, inside(cfg, code)),
    )  # fmt: skip
    asked = parameters(cfg, run_dir.name, code)
    log.debug("sbatch parameters: %s", asked)
    made.update_parameters(**asked)
    return made


_STAND_IN_SBATCH = """#!/bin/sh
# Keeps the batch script submitit hands to sbatch; submits nothing.
cp "$1" "$KIT_DRY_RUN_SCRIPT"
echo "Submitted batch job 1"
"""


def script(cfg: Config, run_dir: Path, code: snapshot.JobCode | None) -> str:
    """The batch script a submission would hand to sbatch, in a scratch folder named back to
    the run's; `code`: the run's code copy, as it would be made."""
    with (
        tempfile.TemporaryDirectory(prefix="kit-dry-run-") as scratch,
        stand_in_sbatch(Path(scratch)) as captured,
    ):
        folder = Path(scratch) / "run"
        made = _executor(cfg, folder, code)
        made.update_parameters(job_name=f"kit-{run_dir.name}")
        made.submit(job_of(cfg), str(run_dir))
        return captured.read_text().replace(str(folder), str(run_dir))


@contextlib.contextmanager
def stand_in_sbatch(scratch: Path) -> Iterator[Path]:
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


# --- sweeps ---------------------------------------------------------------------------------


def sweep(
    backend: Backend,
    cfgs: list[Config],
    commands: list[list[str]],
    parallel: int | None,
    code: CodeCopy,
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
            part = _array_folders(backend, cfgs[start:end], commands[start:end], held, code)
            if held.signum is not None:  # the caller says how many went in
                _discard_array(part, made)
                break
            try:
                jobs = _array(backend, cfgs[start:end], part, parallel)
            except SubmitError as err:
                _discard_array(part, made)
                went = f"; the first {start} runs were submitted (`launch status`)" if start else ""
                raise SubmitError(f"{err}{went}") from None
            with held.firmly():
                for run_dir, job in zip(part, jobs, strict=True):
                    backend.record(run_dir, job)
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
    asked = parameters(cfg, "")
    return repr(sorted((key, value) for key, value in asked.items() if key != "job_name"))


def _array_folders(
    backend: Backend,
    cfgs: list[Config],
    commands: list[list[str]],
    held: HeldSignals,
    code: CodeCopy,
) -> list[Path]:
    """An array's run folders, each with the sweep's code copy, made until a signal comes (a
    second one, or a copy that fails: none left behind)."""
    part: list[Path] = []
    try:
        for cfg, command in zip(cfgs, commands, strict=True):
            if held.signum is not None:
                break
            part.append(runfolder.create(cfg, "launch sweep", backend.name, command))
            code.give(part[-1])
    except (KeyboardInterrupt, SnapshotError):
        _discard_array(part, [])
        raise
    return part


def _discard_array(run_dirs: list[Path], made: list[Path]) -> None:
    """An array's run folders that no job runs in, and its logs' folder (`sweeps/` too where
    nothing else is left in it)."""
    logs = [runfolder.sweep_logs_dir(run_dirs[0])] if run_dirs else []
    runfolder.discard([*run_dirs, *logs], [*(path.parent for path in logs), *made])


def _array(
    backend: Backend, cfgs: list[Config], run_dirs: list[Path], parallel: int | None
) -> list[submitit.Job[Any]]:
    """One Slurm array of these runs; SubmitError with sbatch's words if Slurm refuses it."""
    logs = runfolder.sweep_logs_dir(run_dirs[0])
    made = _array_executor(cfgs, logs, run_dirs[0], parallel)
    try:
        with without_enclosing_job(), contextlib.redirect_stderr(io.StringIO()):
            return made.map_array(job_of(cfgs[0], element=True), [str(d) for d in run_dirs])
    except (submitit.core.utils.FailedSubmissionError, submitit.core.utils.FailedJobError) as err:
        what = f"the sweep's array of {len(run_dirs)} runs"
        raise SubmitError(backend.refusal(err, what)) from None


def _array_executor(
    cfgs: list[Config],
    logs: Path,
    first: Path,
    parallel: int | None,
    code: snapshot.JobCode | None = None,
) -> submitit.SlurmExecutor:
    """One array's executor (its elements ask for one allocation alike: `_arrays`), its
    elements started as every job's tasks are."""
    # Each element checks its own cluster.max_requeues first; submitit's count must not end it sooner.
    most = max(c.cluster.max_requeues for c in cfgs)
    shape = cfgs[0]
    keep_logs_private(logs)
    code = code or snapshot.job_code(first)  # the first run's copy, which the others share
    python = task_python(shape, inside(shape, code))
    made = submitit.SlurmExecutor(folder=logs, max_num_timeout=most, python=python)
    made.update_parameters(**parameters(shape, f"sweep-{first.name}", code))
    # No --parallel: every element may run at once (submitit's own default caps an array at 256).
    made.update_parameters(array_parallelism=parallel or len(cfgs))
    return made


def sweep_dry_run(cfgs: list[Config], run_dirs: list[Path], parallel: int | None) -> str:
    """Each array's exact batch script."""
    arrays = list(_arrays(cfgs, len(cfgs)))  # the cluster's MaxArraySize is not asked for
    said = [f"backend: slurm (submitit SlurmExecutor), {len(arrays)} array(s)\n"]
    for first, end in arrays:
        shown = _array_script(cfgs[first:end], run_dirs[first:end], parallel)
        said.append(f"\narray of points {first}-{end - 1}:\n{shown}")
    return "".join(said)


def _array_script(cfgs: list[Config], run_dirs: list[Path], parallel: int | None) -> str:
    with (
        tempfile.TemporaryDirectory(prefix="kit-dry-run-") as scratch,
        stand_in_sbatch(Path(scratch)) as captured,
    ):
        logs = Path(scratch) / "logs"
        code = snapshot.planned_job_code(snapshot.plan(cfgs[0]), run_dirs[0])
        made = _array_executor(cfgs, logs, run_dirs[0], parallel, code)
        made.map_array(job_of(cfgs[0], element=True), [str(d) for d in run_dirs])
        return captured.read_text().replace(str(logs), str(runfolder.sweep_logs_dir(run_dirs[0])))
