"""Each task of a job inside a container (`cluster.container`): what the batch script runs.

Apptainer (or Singularity) wraps the task's command: `apptainer exec [--nv] --bind … IMAGE
PYTHON …`. Pyxis is srun's own: `srun --container-image=IMAGE --container-mounts=… PYTHON …`.
Either way the kit's checkout, output.root and data.root are mounted at the same paths, and
PYTHONPATH names the checkout, so the image's Python imports the kit from it (the image brings
torch, submitit, omegaconf and pandas). Both launch paths use these words: submitit's batch
script, and the sbatch scripts through `launch prepare --shell`.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from core.settings.schema import Config, ContainerRuntime

REPO = Path(__file__).resolve().parents[1]  # the checkout the job's Python imports the kit from


def used(cfg: Config) -> bool:
    return bool(cfg.cluster.container.image)


def mounts(cfg: Config) -> list[str]:
    """Host paths the task sees at the same place (and the user's own, as given), once each."""
    own = [str(REPO), _absolute(cfg.output.root), _absolute(cfg.data.root)]
    return list(dict.fromkeys([*own, *cfg.cluster.container.mounts]))


def _absolute(path: str) -> str:
    return str(Path(path).expanduser().absolute())


def wrapper(cfg: Config) -> list[str]:
    """The words before the task's Python: Apptainer's `exec`; none for pyxis or no container."""
    c = cfg.cluster.container
    if not c.image or c.runtime != ContainerRuntime.apptainer:
        return []
    nv = ["--nv"] if cfg.cluster.gpus_per_node else []  # the host's NVIDIA driver and devices
    image = c.image if "://" in c.image else _absolute(c.image)  # the task's folder may differ
    return [
        "apptainer", "exec", *nv, f"--env=PYTHONPATH={REPO}", f"--bind={','.join(mounts(cfg))}",
        *c.options, image,
    ]  # fmt: skip


def srun_options(cfg: Config) -> list[str]:
    """srun's options for pyxis; none otherwise."""
    c = cfg.cluster.container
    if not c.image or c.runtime != ContainerRuntime.pyxis:
        return []
    binds = ",".join(m if ":" in m else f"{m}:{m}" for m in mounts(cfg))
    return [
        f"--container-image={c.image}", f"--container-mounts={binds}",
        "--container-env=PYTHONPATH", *c.options,
    ]  # fmt: skip


def python(cfg: Config, host_python: str) -> str:
    """The task's interpreter: the image's, or the host's where there is no container."""
    return cfg.cluster.container.python if used(cfg) else host_python


def setup_lines(cfg: Config) -> list[str]:
    """Shell lines before the tasks start: pyxis hands srun's PYTHONPATH to the container."""
    return [f"export PYTHONPATH={shlex.quote(str(REPO))}"] if used(cfg) else []


def shell_assignments(cfg: Config) -> str:
    """What `launch prepare --shell` adds for the sbatch scripts: bash arrays of srun's options and
    of the task's command before `-m train run`; empty without a container, where the script
    runs its own $KIT_PYTHON."""
    srun = shlex.join(srun_options(cfg))
    task = shlex.join([*wrapper(cfg), cfg.cluster.container.python]) if used(cfg) else ""
    lines = [*setup_lines(cfg), f"container_srun=({srun})", f"task_python=({task})"]
    return "".join(line + "\n" for line in lines)
