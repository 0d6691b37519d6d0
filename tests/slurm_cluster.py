"""A private, real Slurm cluster for tests: a thin wrapper around slurm/testcluster/*.sh.

    cluster = SlurmCluster.start(tmp_dir, nodes=2)   # MariaDB, slurmdbd, slurmctld, 2 slurmd
    cluster.run("sbatch", "--wait", "--wrap", "true")
    cluster.stop()

Every Slurm client needs SLURM_CONF; `cluster.env` holds it, `cluster.run` passes it on.

With TESTCLUSTER_SLURM_PREFIX naming a Slurm built apart (slurm/testcluster/build-slurm.sh), the
clusters run on it, and its clients must come first on PATH for everything that talks to them:
`cluster.env` then holds that PATH too (`slurm_path` makes it).
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from slurm_ddp_kit.core import slurmtext

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "slurm" / "testcluster"

FINAL_STATES = slurmtext.ENDED  # after which a job never changes again
PREFIX_VARIABLE = "TESTCLUSTER_SLURM_PREFIX"


def slurm_prefix() -> Path | None:
    """The Slurm built apart that test clusters start on (TESTCLUSTER_SLURM_PREFIX), or None
    for the system's."""
    prefix = os.environ.get(PREFIX_VARIABLE, "").strip()
    return Path(prefix) if prefix else None


def slurm_path(path: str, prefix: Path | None) -> str:
    """`path` with the prefix's bin and sbin first (each once, however often it is applied),
    or `path` itself when there is no prefix: a client of one Slurm release cannot talk to the
    daemons of another, so every sbatch, srun, sacct... must be the prefix's."""
    if prefix is None:
        return path
    first = [str(prefix / "bin"), str(prefix / "sbin")]
    rest = [entry for entry in path.split(os.pathsep) if entry and entry not in first]
    return os.pathsep.join(first + rest)


class SlurmClusterError(RuntimeError):
    """A script of slurm/testcluster failed; the message carries its output."""


def _script(name: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPTS / name), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def install(timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """Install Slurm and MariaDB from Debian's packages unless present (needs root and apt)."""
    return _script("install.sh", timeout=timeout)


class SlurmCluster:
    """A running test cluster whose files all lie under `dir`."""

    def __init__(self, dir: Path, nodes: int, prefix: Path | None = None) -> None:
        self.dir = dir
        self.nodes = nodes
        self.prefix = prefix  # the Slurm it runs on; None: the system's

    @classmethod
    def start(cls, dir: Path | str, nodes: int = 2, timeout: float = 120) -> SlurmCluster:
        """Start a cluster of `nodes` nodes (`node_names`; 4 fake GPUs each, tasks bound through
        cgroups unless TESTCLUSTER_BINDING=none) in the empty or new folder `dir`. Returns once
        every node is idle and accounting works."""
        path = Path(dir).resolve()
        try:
            done = _script("start.sh", str(path), str(nodes), timeout=timeout)
        except subprocess.TimeoutExpired as error:
            # Killed start.sh could not clean up after itself: stop what it started.
            _script("stop.sh", str(path), timeout=120)
            raise SlurmClusterError(f"start.sh {path} {nodes} took over {timeout} s") from error
        if done.returncode != 0:
            raise SlurmClusterError(
                f"start.sh {path} {nodes} failed ({done.returncode}):\n{done.stdout}{done.stderr}"
            )
        return cls(path, nodes, slurm_prefix())

    def stop(self, timeout: float = 120) -> None:
        """Cancel all jobs and stop every daemon. Safe to call twice."""
        done = _script("stop.sh", str(self.dir), timeout=timeout)
        if done.returncode != 0:
            raise SlurmClusterError(
                f"stop.sh {self.dir} failed ({done.returncode}):\n{done.stdout}{done.stderr}"
            )

    @property
    def conf(self) -> Path:
        return self.dir / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """What a process needs in its environment to talk to this cluster."""
        if self.prefix is None:
            return {"SLURM_CONF": str(self.conf)}
        path = slurm_path(os.environ.get("PATH", os.defpath), self.prefix)
        return {"SLURM_CONF": str(self.conf), "PATH": path}

    @property
    def node_names(self) -> list[str]:
        """The nodes' names, in order: loopback addresses of this cluster's own (127.A.B.11,
        .12, ...), or node1, node2, ... in network namespaces; start.sh lists them."""
        return (self.dir / "nodes").read_text().split()

    @property
    def binding(self) -> str:
        """How tasks are bound: `cgroup` to their CPUs and GPUs (start.sh's default), or `none`,
        every task seeing everything (TESTCLUSTER_BINDING=none, network namespaces)."""
        return "cgroup" if (self.dir / "cgroup.conf").is_file() else "none"

    def run(
        self,
        *args: str,
        timeout: float = 120,
        cwd: Path | str | None = None,
        env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command (sbatch, srun, sacct, ...) against this cluster, output
        captured as text. Does not raise on a non-zero exit: check `returncode`."""
        return subprocess.run(
            list(args),
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=cwd,
            env={**os.environ, **(env or {}), **self.env},
            check=False,
        )

    def wait_job(self, job_id: str | int, timeout: float = 300) -> str:
        """`wait_job` for a job of this cluster."""
        return wait_job(job_id, timeout, env=self.env)


def job_state(job_id: str | int, env: dict[str, str] | None = None) -> str | None:
    """The job's state as accounting knows it (first word: "CANCELLED by 0" -> "CANCELLED"),
    or None while accounting has no record of it yet."""
    done = subprocess.run(
        ["sacct", "-n", "-X", "-P", "-j", str(job_id), "-o", "State"],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, **(env or {})},
        check=False,
    )
    words = done.stdout.split()
    if done.returncode != 0 or not words:
        return None
    return words[0]


def wait_job(job_id: str | int, timeout: float = 300, env: dict[str, str] | None = None) -> str:
    """Wait until the job has ended and return its final sacct state (COMPLETED, FAILED,
    CANCELLED, TIMEOUT, ...). The default timeout allows for a loaded 2-core machine, where a
    training job's start alone can take half a minute. SLURM_CONF comes from `env` or else from
    os.environ. Raises TimeoutError with the last state seen when the job has not ended in time.
    squeue is asked while the job is queued or running (half the CPU of an sacct call, which
    also wakes slurmdbd and MariaDB), sacct once it has left the queue."""
    deadline = time.monotonic() + timeout
    state = None
    while True:
        if not _queued(job_id, env):
            state = job_state(job_id, env)
            if state in FINAL_STATES:
                return state
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} still {state or 'queued'} after {timeout} s")
        time.sleep(0.2)


def _queued(job_id: str | int, env: dict[str, str] | None) -> bool:
    """Whether squeue still lists the job (pending, running, completing); a failed squeue says
    nothing, so the caller asks sacct."""
    return bool(squeue_line(job_id, "%T", env))


def squeue_line(job_id: str | int, fields: str, env: dict[str, str] | None = None) -> str:
    """squeue's line of `fields` for the job; '' once it has left the queue (or squeue failed)."""
    return subprocess.run(
        ["squeue", "-h", "-j", str(job_id), "-o", fields], capture_output=True, text=True,
        timeout=30, env={**os.environ, **(env or {})}, check=False,
    ).stdout.strip()  # fmt: skip


def wait_job_releasing_holds(
    job_id: str, timeout: float = 300, env: dict[str, str] | None = None
) -> tuple[str, int]:
    """Wait for a job that may requeue itself: Slurm holds a requeued job (BeginTime) before it
    may start again; release it at once rather than sleep that out. Returns the final state and
    how many holds were released."""
    env = {**os.environ, **(env or {})}
    deadline, released = time.monotonic() + timeout, 0
    while time.monotonic() < deadline:
        queued = squeue_line(job_id, "%T|%r", env)
        released += release_hold(job_id, env, queued)
        if not queued and (state := job_state(job_id, env)) in FINAL_STATES:
            return state, released
        time.sleep(0.5)
    raise TimeoutError(f"job {job_id} has not ended after {timeout} s (last: {queued!r})")


_HELD = {"BeginTime", "JobHeldAdmin", "JobHeldUser"}


def release_hold(job_id: str, env: dict[str, str] | None = None, queued: str | None = None) -> int:
    """Release the job if Slurm holds it (after a requeue); 1 if it did. `queued` is squeue's
    "%T|%r" line for the job where the caller has it."""
    env = {**os.environ, **(env or {})}
    if queued is None:
        queued = squeue_line(job_id, "%T|%r", env)
    if not (queued.startswith("PENDING") and queued.split("|")[1] in _HELD):
        return 0
    subprocess.run(["scontrol", "release", job_id], capture_output=True, env=env)
    subprocess.run(
        ["scontrol", "update", f"JobId={job_id}", "StartTime=now"], capture_output=True, env=env
    )
    return 1
