"""Where a process learns its place in the job: one table of environment sources, one function;
and the check that the job started as many processes as its config asks (`check_launch`).

Sources, first match wins:
- torchrun     RANK/LOCAL_RANK/WORLD_SIZE/... set by torch.distributed.run
- submitit     a task started by submitit (Slurm or local executor): its JobEnvironment
- slurm        a task started by `srun` inside an sbatch script: raw SLURM_* variables
- single       none of these: one process alone
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from slurm_ddp_kit.core import slurmtext, strategies, submitted
from slurm_ddp_kit.core.errors import KitError
from slurm_ddp_kit.core.settings.rules import world_size
from slurm_ddp_kit.core.settings.schema import Config

# Variable names per environment-variable source; submitit is read through its own JobEnvironment.
SOURCES: dict[str, dict[str, str]] = {
    "torchrun": {
        "rank": "RANK",
        "local_rank": "LOCAL_RANK",
        "world_size": "WORLD_SIZE",
        "local_world_size": "LOCAL_WORLD_SIZE",
        "node_rank": "GROUP_RANK",
        "job_id": "TORCHELASTIC_RUN_ID",
        "master_addr": "MASTER_ADDR",
        "master_port": "MASTER_PORT",
    },
    "slurm": {
        "rank": "SLURM_PROCID",
        "local_rank": "SLURM_LOCALID",
        "world_size": "SLURM_NTASKS",
        "node_rank": "SLURM_NODEID",
        "job_id": "SLURM_JOB_ID",
        "nodelist": "SLURM_STEP_NODELIST",
        "tasks_per_node": "SLURM_STEP_TASKS_PER_NODE",
    },
}


class DistEnvError(KitError):
    """The job was started in a way that cannot give each process a consistent place."""


class LaunchError(KitError):
    """The processes of the job do not match its config; the message names the fix."""


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int
    job_id: str
    source: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def kit_store(self) -> bool:
        """Whether the kit serves the rendezvous store itself (Slurm's and submitit's tasks, and
        a process alone); torchrun's workers meet through env:// as torchrun expects."""
        return self.source != "torchrun"

    @property
    def serves_store(self) -> bool:
        """Whether this process serves the rendezvous store at master_addr. Under Slurm
        master_addr is the first node of the step, and the store is served by that node's first
        task, whichever rank it is: with `srun -m arbitrary` (a SLURM_HOSTFILE) rank 0 may run on
        another node. Elsewhere rank 0 (or torchrun's agent) serves it, as env:// does."""
        if self.kit_store:
            return self.node_rank == 0 and self.local_rank == 0
        return self.rank == 0

    def export(self) -> None:
        """Set the variables torch.distributed's env:// initialisation reads."""
        os.environ.update(
            RANK=str(self.rank),
            LOCAL_RANK=str(self.local_rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_WORLD_SIZE=str(self.local_world_size),
            MASTER_ADDR=self.master_addr,
            MASTER_PORT=str(self.master_port),
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def detect(environ: Mapping[str, str] | None = None, port: int = 0) -> DistEnv:
    """Map the environment to a DistEnv; `port` (when not 0) overrides any derived port."""
    env = os.environ if environ is None else environ
    source = _which_source(env)
    found = {
        "torchrun": _from_torchrun,
        "submitit": _from_submitit,
        "slurm": _from_slurm,
        "single": _single,
    }[source](env)
    if port:
        found["master_port"] = port
    return DistEnv(source=source, **found)


PICK_PORT = 0  # the store binds a free port and tells the job's other processes (local jobs)
PORT_LOW, PORT_COUNT = 20000, 12768  # 20000–32767: below Linux's ephemeral range (32768–60999)


def port_for_job(job_id: str) -> int:
    """A port in 20000–32767 from the job id ('123', or '12_3' for an array element).

    Outgoing connections take their ports from the ephemeral range, so a port there may already
    be held; this range stays below it. Jobs whose ids differ by less than 12768 get different
    ports, and so do the elements (below 997) of one array: 997 is prime and shares no factor with
    12768, so id × 997 + element runs through every port before one repeats.
    """
    job, _, element = job_id.partition("_")
    job_digits = re.sub(r"\D", "", job) or "0"
    element_digits = re.sub(r"\D", "", element) or "0"
    return PORT_LOW + (int(job_digits) * 997 + int(element_digits)) % PORT_COUNT


def first_host(nodelist: str) -> str:
    """First host of a Slurm hostlist: 'node[003-004,010],gpu1' → 'node003'."""
    try:
        return slurmtext.first_host(nodelist)
    except ValueError:
        raise DistEnvError(
            f"cannot read the Slurm node list {nodelist!r}: start the ranks with srun inside "
            "the job's allocation, so that Slurm sets its node list"
        ) from None


def tasks_on_node(tasks_per_node: str, node_rank: int) -> int:
    """Read Slurm's compressed task counts: '2(x3),1' → [2, 2, 2, 1][node_rank]."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            raise DistEnvError(
                f"cannot read Slurm's tasks per node {tasks_per_node!r}: start the ranks with "
                "srun inside the job's allocation, so that Slurm sets it"
            )
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts[node_rank]


def _which_source(env: Mapping[str, str]) -> str:
    """The launcher that started this process. RANK and MASTER_ADDR alone (env://, set by hand)
    count last: left over in a user's shell, they reach every job that inherits it."""
    if "TORCHELASTIC_RUN_ID" in env:
        return "torchrun"
    if submitted.by_submitit(env):
        return "submitit"
    if "SLURM_PROCID" in env and "SLURM_STEP_ID" in env:
        return "slurm"
    if "RANK" in env and "MASTER_ADDR" in env:
        return "torchrun"
    return "single"


def _read(env: Mapping[str, str], source: str, field: str, default: str | None = None) -> str:
    name = SOURCES[source][field]
    value = env.get(name, default)
    if value is None:
        raise DistEnvError(
            f"{name} is not set, but other {source} variables are: start the job through its "
            f"launcher alone (unset the stray {source} variables, or set {name})"
        )
    return value


def _from_torchrun(env: Mapping[str, str]) -> dict[str, Any]:
    world_size = int(_read(env, "torchrun", "world_size"))
    return {
        "rank": int(_read(env, "torchrun", "rank")),
        "local_rank": int(_read(env, "torchrun", "local_rank", "0")),
        "world_size": world_size,
        "local_world_size": int(_read(env, "torchrun", "local_world_size", str(world_size))),
        "node_rank": int(_read(env, "torchrun", "node_rank", "0")),
        "master_addr": _read(env, "torchrun", "master_addr", "127.0.0.1"),
        "master_port": int(_read(env, "torchrun", "master_port", "29500")),
        "job_id": _read(env, "torchrun", "job_id", "torchrun"),
    }


def _from_slurm(env: Mapping[str, str]) -> dict[str, Any]:
    node_rank = int(_read(env, "slurm", "node_rank"))
    job_id = _read(env, "slurm", "job_id")
    return {
        "rank": int(_read(env, "slurm", "rank")),
        "local_rank": int(_read(env, "slurm", "local_rank")),
        "world_size": int(_read(env, "slurm", "world_size")),
        "local_world_size": tasks_on_node(_read(env, "slurm", "tasks_per_node"), node_rank),
        "node_rank": node_rank,
        "master_addr": first_host(_read(env, "slurm", "nodelist")),
        "master_port": port_for_job(job_id),
        "job_id": job_id,
    }


def _from_submitit(env: Mapping[str, str]) -> dict[str, Any]:
    import submitit  # only inside submitit tasks; keeps `import train.distenv` light

    job = submitit.JobEnvironment()
    job_id = str(job.job_id)
    on_slurm = submitted.by_slurm_executor(env)
    hosts = job.hostnames if on_slurm else ["127.0.0.1"]
    return {
        "rank": job.global_rank,
        "local_rank": job.local_rank,
        "world_size": job.num_tasks,
        "local_world_size": job.num_tasks // job.num_nodes,
        "node_rank": job.node,
        "master_addr": hosts[0],
        # Slurm's own id of this job: an array element's is its own (not J_K), unique among the
        # jobs around it, so no element shares a port with the plain job Slurm numbers J+1. A
        # local job's id is a process id, which may match a Slurm job's on this machine: its store
        # takes a port the system knows is free (PICK_PORT).
        "master_port": port_for_job(env.get("SLURM_JOB_ID") or job_id) if on_slurm else PICK_PORT,
        "job_id": job_id,
    }


def _single(env: Mapping[str, str]) -> dict[str, Any]:
    return {
        "rank": 0,
        "local_rank": 0,
        "world_size": 1,
        "local_world_size": 1,
        "node_rank": 0,
        "master_addr": "127.0.0.1",
        "master_port": PICK_PORT,  # a process id may be a Slurm job's id on this machine
        "job_id": env.get("SLURM_JOB_ID", "local"),
    }


def check_launch(cfg: Config, env: DistEnv, environ: dict[str, str] | None = None) -> None:
    """Refuse a job whose process count disagrees with the config, naming the fix."""
    environ = dict(os.environ) if environ is None else environ
    expected = world_size(cfg)
    if env.world_size == expected:
        return
    if env.source == "single" and int(environ.get("SLURM_NTASKS", "1")) > 1:
        raise LaunchError(
            f"this job has {environ['SLURM_NTASKS']} Slurm tasks but the script started python "
            "without srun, so only one process runs: start it as `srun python -m train run RUN_DIR`"
        )
    if not strategies.of(cfg).per_gpu:
        raise LaunchError(
            f"DataParallel drives all GPUs from one process, but {env.world_size} were started: "
            "run one task (slurm/dp.sbatch, --ntasks-per-node=1) or use --mode ddp"
        )
    raise LaunchError(
        f"--mode {cfg.mode} expects cluster.nodes × cluster.gpus_per_node = {cfg.cluster.nodes} × "
        f"{cfg.cluster.gpus_per_node} = {expected} processes, but {env.world_size} were started: "
        f"start {expected} tasks (one per GPU) or set cluster.gpus_per_node to the GPUs per node"
    )
