"""Where a rank runs: the CPUs it may use and the GPUs it drives, and what is wrong with that.

Each rank records its place in its start record; rank 0 gathers every rank's and records the
one line that `--wait`, `status` and `summarize` show when a rank has fewer CPUs than the job
asked for, or shares a GPU with another rank. Torch-free: the launcher and the analysis read it.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Place:
    """One rank's CPUs and GPUs, as it saw them when it started."""

    rank: int
    node: str
    cpus: str  # its CPU affinity, as Slurm writes CPU lists: "0-3,8"
    usable: int  # the CPUs it may use for itself (its share where its node's tasks share a set)
    asked: int | None  # the CPUs per task its Slurm job asked for (None off Slurm)
    gpus: list[str] = field(default_factory=list)  # the GPUs it drives, by UUID

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def cpus_asked() -> int | None:
    """The CPUs per task of this Slurm job (sbatch's --cpus-per-task, the kit's or the user's);
    None where no Slurm allocation says (the local backend, a job without -c)."""
    asked = os.environ.get("SLURM_CPUS_PER_TASK", "")
    return int(asked) if asked.isdigit() and int(asked) > 0 else None


def usable_cpus(local_tasks: int) -> int:
    """The CPUs this process may use for itself. Where Slurm bound the task (task/affinity,
    task/cgroup) its affinity is its own; where nothing did, every task of the node sees every
    CPU of the machine, and each has its share."""
    mine = os.sched_getaffinity(0)
    if len(mine) < _online_cpus():
        return len(mine)
    return max(1, len(mine) // max(local_tasks, 1))


def _online_cpus() -> int:
    return os.cpu_count() or 1


def cpu_list(cpus: set[int] | list[int]) -> str:
    """'0-3,8' for {0, 1, 2, 3, 8}: Slurm's and the kernel's way of writing a CPU list."""
    spans: list[list[int]] = []
    for cpu in sorted(cpus):
        if spans and cpu == spans[-1][1] + 1:
            spans[-1][1] = cpu
        else:
            spans.append([cpu, cpu])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


def affinity() -> str:
    return cpu_list(os.sched_getaffinity(0))


def problems(places: list[Place]) -> str | None:
    """One line naming the ranks with fewer CPUs than their job asked for and the ranks that
    share a GPU; None when every rank has what it asked for."""
    said = [s for s in (_short_of_cpus(places), _shared_gpus(places)) if s]
    return "; ".join(said) or None


def _short_of_cpus(places: list[Place]) -> str:
    had = _shares(places)
    short = [p for p in places if p.asked is not None and had[p.rank] < p.asked]
    if not short:
        return ""
    first = short[0]
    who = _ranks([p.rank for p in short])
    return (
        f"{who} had fewer CPUs than the job asked for ({had[first.rank]} of {first.asked} per task "
        f"on {first.node}, CPUs {first.cpus or 'none'}), which slows training and data loading: "
        "give srun the job's CPUs (--cpus-per-task) or ask for fewer (cluster.cpus_per_task)"
    )


def _shares(places: list[Place]) -> dict[int, int]:
    """Each rank's CPUs: what it saw as its own, and no more than its share of a CPU set that
    other ranks of its node were bound to as well (a step's cpuset that its tasks share)."""
    sharing: dict[tuple[str, str], int] = {}
    for place in places:
        sharing[place.node, place.cpus] = sharing.get((place.node, place.cpus), 0) + 1
    return {
        p.rank: min(p.usable, max(1, _count(p.cpus) // sharing[p.node, p.cpus])) for p in places
    }


def _count(cpus: str) -> int:
    """How many CPUs a list such as '0-3,8' names (0 for one that cannot be read)."""
    total = 0
    for span in cpus.split(","):
        first, _, last = span.partition("-")
        if not (first.isdigit() and (not last or last.isdigit())):
            return 0
        total += int(last or first) - int(first) + 1
    return total


def _shared_gpus(places: list[Place]) -> str:
    users: dict[tuple[str, str], list[int]] = {}
    for place in places:
        for gpu in place.gpus:
            users.setdefault((place.node, gpu), []).append(place.rank)
    shared = [(key, ranks) for key, ranks in users.items() if len(ranks) > 1]
    if not shared:
        return ""
    (node, gpu), ranks = shared[0]
    more = f" (and {len(shared) - 1} more GPU(s) shared)" if len(shared) > 1 else ""
    return (
        f"{_ranks(ranks)} share one GPU ({gpu} on {node}){more}, so their figures are not one "
        "GPU's each: give each task its own GPU (cluster.gpus_per_node equal to the node's "
        "GPUs, or cluster.gpu_binding=task)"
    )


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:8])) + (
        f" and {len(ranks) - 8} more" if len(ranks) > 8 else ""
    )
    return f"rank {shown}" if len(ranks) == 1 else f"ranks {shown}"
