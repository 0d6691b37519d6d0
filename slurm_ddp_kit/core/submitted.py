"""Which of submitit's executors started this process: the one reader of SUBMITIT_EXECUTOR.

The job side cannot ask the launcher's backends (`launch.backends`: train imports core alone), so
the little it must know of its backend (a local controller or Slurm runs it) is read here, the
variable spelled once. Standard library only: `train.early` asks it before anything else loads.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

_EXECUTOR = "SUBMITIT_EXECUTOR"  # submitit's word in each task it starts: "slurm" or "local"


def by_submitit(env: Mapping[str, str] | None = None) -> bool:
    """Whether submitit started this task, through either executor. `env`: the environment to
    read (this process's where None), as each function here takes it."""
    return _EXECUTOR in _environment(env)


def by_slurm_executor(env: Mapping[str, str] | None = None) -> bool:
    """Whether submitit's SlurmExecutor started it (a task of an sbatch script's srun, or of no
    launcher, is not: it has no submitit job to requeue through)."""
    return _environment(env).get(_EXECUTOR) == "slurm"


def by_local_executor(env: Mapping[str, str] | None = None) -> bool:
    """Whether submitit's LocalExecutor started it: a controller on this machine, no Slurm."""
    return _environment(env).get(_EXECUTOR) == "local"


def _environment(env: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if env is None else env
