"""Each task of a job inside a container (`cluster.container`): what the batch script runs.

Apptainer (or Singularity) wraps the task's command: `apptainer exec [--nv] --bind … IMAGE
PYTHON …`. Pyxis is srun's own: `srun --container-image=IMAGE --container-mounts=… PYTHON …`.
Either way the code the task needs (`code_folders`: the kit's checkout, the folders the user's
factories are found in, the launching PYTHONPATH's folders; a program's script's folder and the
working folder it starts in), output.root and data.root are mounted at the same paths. Where the
run has a code copy (`core.snapshot`, inside output.root), the task starts in the copy and its
PYTHONPATH names the copy's folders (`Inside`); without one, the mounted code folders. The image
brings torch, submitit, omegaconf and pandas. Both launch paths use these words: submitit's batch
script, and the sbatch scripts through `launch prepare --shell`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import shlex
import sysconfig
from pathlib import Path

from slurm_ddp_kit.core.settings.loading import program_arguments
from slurm_ddp_kit.core.settings.schema import Config, ConfigError, ContainerRuntime

REPO = Path(__file__).resolve().parents[2]  # the checkout the job's Python imports the kit from


@dataclasses.dataclass(frozen=True)
class Inside:
    """Where a task starts inside the container and its PYTHONPATH there, where the run has a code
    copy (`launch.code.inside`): the copy, which output.root's mount brings in."""

    workdir: Path
    pythonpath: list[str]


def used(cfg: Config) -> bool:
    return bool(cfg.cluster.container.image)


def mounts(cfg: Config) -> list[str]:
    """Host paths the task sees at the same place (and the user's own, as given), once each:
    the code, the folder the job starts in (relative paths in the settings and a program's
    arguments are read from it) and a program's script's folder, output.root and data.root."""
    own = [*code_folders(cfg), *_program_folders(cfg)]
    own += [_absolute(cfg.output.root), _absolute(cfg.data.root)]
    return list(dict.fromkeys([*own, *cfg.cluster.container.mounts]))


def python_script(program: list[str]) -> str | None:
    """The script a user's program runs where it is `python SCRIPT …` (options before it
    passed over; `-m`/`-c` name no file): the file the job must find."""
    command, *args = program or [""]
    if not Path(command).name.startswith("python"):
        return None
    for at, word in enumerate(args):
        if word in ("-m", "-c") or (word.startswith(("-m", "-c")) and len(word) > 2):
            return None
        if not word.startswith("-"):
            return word if at == 0 or args[at - 1] not in ("-W", "-X") else None
    return None


def _program_folders(cfg: Config) -> list[str]:
    """The working folder, and the folder of a program's script (which may lie elsewhere)."""
    if not cfg.program:
        return [str(Path.cwd())]
    script = python_script(program_arguments(cfg))
    return [str(Path.cwd()), *([_absolute(str(Path(script).parent))] if script else [])]


def code_folders(cfg: Config) -> list[str]:
    """The folders the task's Python imports from, in order, once each: the kit's checkout
    first (a user's own `train.py` must not stand in for the kit's package), the folders on
    the launching PYTHONPATH, then those the user's factories were found in here (the working
    folder, say, which is no one's PYTHONPATH). A factory installed in this machine's
    site-packages is left to the image (`installed_factories`)."""
    launching = [_absolute(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return list(dict.fromkeys([str(REPO), *launching, *factory_folders(cfg)]))


def factory_folders(cfg: Config) -> list[str]:
    """The folders the user's factories were found in here, but for this machine's
    site-packages (`installed_factories`)."""
    found = [root for spec in _factories(cfg) for root in _roots(spec)]
    return [root for root in found if not _installed(root)]


def installed_factories(cfg: Config) -> list[str]:
    """The user's factory modules that this machine has installed in its site-packages, which
    the image's Python does not see unless the image has them too."""
    return [spec for spec in _factories(cfg) if any(_installed(r) for r in _roots(spec))]


def check_code_folders(cfg: Config) -> None:
    """Each folder must be writable in a bind list: Apptainer and pyxis split it on `,` and `:`."""
    for folder in code_folders(cfg):
        if "," in folder or ":" in folder:
            raise ConfigError(
                f"the job needs {folder} inside the container, but a folder whose path holds "
                "',' or ':' cannot be mounted (the runtimes split mount lists on them): move or "
                "link the code to a path without them"
            )


def _factories(cfg: Config) -> list[str]:
    """The user's factories' module names (a built-in name has no ':')."""
    specs = (cfg.model.name, cfg.data.dataset)
    return [spec.partition(":")[0] for spec in specs if ":" in spec]


def _roots(module: str) -> list[str]:
    """The folders the module's top-level package is found in from here (found, not imported:
    the launcher has checked the factory itself, `launch.submit`)."""
    with_errors = (ImportError, ValueError)  # no such package, or an odd name: nothing to mount
    try:
        spec = importlib.util.find_spec(module.partition(".")[0])
    except with_errors:
        return []
    if spec is None:
        return []
    if spec.submodule_search_locations:  # a package (a namespace package has several)
        return [str(Path(p).parent) for p in spec.submodule_search_locations]
    return [str(Path(spec.origin).parent)] if spec.origin else []


def _installed(folder: str) -> bool:
    paths = sysconfig.get_paths()
    return folder in (paths["purelib"], paths["platlib"])


def _absolute(path: str) -> str:
    return str(Path(path).expanduser().absolute())


def wrapper(cfg: Config, inside: Inside | None = None) -> list[str]:
    """The words before the task's Python: Apptainer's `exec`; none for pyxis or no container.
    With a code copy (`inside`), the task starts in it and imports it."""
    c = cfg.cluster.container
    if not c.image or c.runtime != ContainerRuntime.apptainer:
        return []
    nv = ["--nv"] if cfg.cluster.gpus_per_node else []  # the host's NVIDIA driver and devices
    image = c.image if "://" in c.image else _absolute(c.image)  # the task's folder may differ
    pwd = [f"--pwd={inside.workdir}"] if inside else []
    return [
        "apptainer", "exec", *nv, f"--env=PYTHONPATH={_pythonpath(cfg, inside)}", *pwd,
        f"--bind={','.join(mounts(cfg))}",
        *c.options, image,
    ]  # fmt: skip


def srun_options(cfg: Config, inside: Inside | None = None) -> list[str]:
    """srun's options for pyxis; none otherwise."""
    c = cfg.cluster.container
    if not c.image or c.runtime != ContainerRuntime.pyxis:
        return []
    binds = ",".join(m if ":" in m else f"{m}:{m}" for m in mounts(cfg))
    workdir = inside.workdir if inside else Path.cwd()
    return [
        f"--container-image={c.image}", f"--container-mounts={binds}",
        f"--container-workdir={workdir}", "--container-env=PYTHONPATH", *c.options,
    ]  # fmt: skip


def python(cfg: Config, host_python: str) -> str:
    """The task's interpreter: the image's, or the host's where there is no container."""
    return cfg.cluster.container.python if used(cfg) else host_python


def setup_lines(cfg: Config, inside: Inside | None = None) -> list[str]:
    """Shell lines before the tasks start: pyxis hands srun's PYTHONPATH to the container."""
    return [f"export PYTHONPATH={shlex.quote(_pythonpath(cfg, inside))}"] if used(cfg) else []


def _pythonpath(cfg: Config, inside: Inside | None) -> str:
    return os.pathsep.join(inside.pythonpath if inside else code_folders(cfg))


def shell_assignments(cfg: Config, inside: Inside | None = None) -> str:
    """What `launch prepare --shell` adds for the sbatch scripts: bash arrays of srun's options and
    of the task's command before `-m train run`; empty without a container, where the script
    runs its own $KIT_PYTHON."""
    srun = shlex.join(srun_options(cfg, inside))
    task = shlex.join([*wrapper(cfg, inside), cfg.cluster.container.python]) if used(cfg) else ""
    lines = [*setup_lines(cfg, inside), f"container_srun=({srun})", f"task_python=({task})"]
    return "".join(line + "\n" for line in lines)
