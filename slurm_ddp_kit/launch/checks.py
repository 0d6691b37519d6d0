"""What the launcher checks before it makes a file: the backend's own checks (`launch.backends`),
a user's program, the container, and a user's workload tried on the CPU (a trial that passed is
remembered)."""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import json
import multiprocessing
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from slurm_ddp_kit.core import (
    container,
    datafiles,
    factories,
    runfolder,
    userfiles,
)
from slurm_ddp_kit.core.settings.loading import program_arguments, to_dict
from slurm_ddp_kit.core.settings.rules import check_batch_fits_data
from slurm_ddp_kit.core.settings.schema import (
    DATASETS,
    MODELS,
    Config,
    ConfigError,
    ContainerRuntime,
)
from slurm_ddp_kit.launch import backends
from slurm_ddp_kit.launch.backends import Backend
from slurm_ddp_kit.launch.executor import log


def check_submission(cfg: Config, dry_run: bool = False) -> Backend:
    """Everything the launcher can check before a file is made; returns the backend to use.

    A dry run needs no Slurm client: it shows the script on any machine. It does import a
    user's factories, as a submission from here would.
    """
    backend = backends.chosen(cfg)
    backend.check_reach(cfg, dry_run)
    runfolder.check_root(cfg.output.root)
    _check_container(cfg)
    backend.check_runtime(cfg, dry_run)
    check_inputs(cfg)
    backend.check_machine(cfg)
    return backend


def check_inputs(cfg: Config, trial: bool = True) -> None:
    """What a new run's job will start from: the user's program, found here; else the kit's
    data and factories (`trial`: the factories also tried on the CPU). A program brings its own
    data and model, so the kit's are not looked at."""
    if cfg.program:
        _check_program(cfg)
    else:
        datafiles.check_data(cfg)
        check_factories(cfg, trial=trial)


def _check_program(cfg: Config) -> None:
    """The program's command must be found here as the job will look for it: a path, or a name
    on PATH (the job inherits this environment and starts in this folder); so must the script
    a Python is given (a typo found now, not after the queue wait)."""
    words = program_arguments(cfg)
    command = words[0]
    found = Path(command).is_file() if os.sep in command else shutil.which(command)
    if not found:
        raise ConfigError(
            f"the program `{command}` is not found here (the job looks for it the same way): give "
            "a path, or a command on PATH (e.g. `-- python my_train.py`)"
        )
    script = container.python_script(words)
    if script is not None and not Path(script).is_file():
        raise ConfigError(
            f"the program's script {script} is not a file in {Path.cwd()} (the job starts the "
            "program from this folder): check its path"
        )


def _check_container(cfg: Config) -> None:
    """What the launcher can see of the container, whatever runs it: the code's folders, and the
    image if it is a file (the backend checks its runtime)."""
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
        return  # an image pyxis pulls: nothing of it to see here
    if "://" not in c.image and not Path(c.image).expanduser().exists():
        raise ConfigError(
            f"cluster.container.image={c.image} does not exist: give a .sif file (or a sandbox "
            "folder) on a file system the nodes share, or a docker:// or oras:// address"
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
