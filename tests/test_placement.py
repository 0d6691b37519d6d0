"""A rank's place (its CPUs and GPUs) and the one line said when it is not what the job asked."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from kit import REPO

from slurm_ddp_kit.core.placement import Place, cpu_list, problems


@pytest.mark.parametrize(
    ("visible", "expected"),
    [
        (None, 4),
        ("", 0),
        ("0,1", 2),
        ("3", 1),
        ("1,7,2", 1),  # CUDA stops at the first index that names no device
        ("-1", 0),
        ("GPU-8f3c,GPU-11aa", 2),
        ("0,00", 0),  # a device named twice: torch sees none
    ],
)
def test_the_launcher_counts_visible_gpus_as_torch_does(visible: str | None, expected: int) -> None:
    from slurm_ddp_kit.launch.backends.local import visible_count

    assert visible_count(4, visible) == expected


def test_cpu_lists_are_written_as_slurm_and_the_kernel_write_them() -> None:
    assert cpu_list({0, 1, 2, 3, 8}) == "0-3,8"
    assert cpu_list([5]) == "5"
    assert cpu_list([7, 1, 2, 4, 5]) == "1-2,4-5,7"
    assert cpu_list(set()) == ""


def _usable(local_tasks: int, bind_to: set[int] | None) -> int:
    """usable_cpus in a process of its own, bound to `bind_to` first as Slurm's task plugins
    bind a task (None: left on every CPU, as where nothing binds)."""
    bind = f"os.sched_setaffinity(0, {bind_to!r}); " if bind_to else ""
    code = f"import os; {bind}from slurm_ddp_kit.core.placement import usable_cpus; print(usable_cpus({local_tasks}))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True
    )
    return int(done.stdout)


def test_a_bound_task_uses_its_own_cpus_and_unbound_tasks_share_the_machine() -> None:
    every = len(os.sched_getaffinity(0))
    if every != (os.cpu_count() or 1):
        pytest.skip("this test process is bound already: nothing unbound to compare with")
    assert _usable(1, None) == every
    assert _usable(every, None) == 1  # each of the node's tasks has its share
    assert _usable(4 * every, None) == 1  # never none
    if every > 1:
        assert _usable(4, {0}) == 1  # bound: its own one CPU, however many tasks the node runs
        assert _usable(1, {0}) == 1


def _place(rank: int, usable: int = 2, asked: int | None = 2, **more: object) -> Place:
    fields: dict = {"node": "n1", "cpus": f"{2 * rank}-{2 * rank + 1}", "gpus": []} | more
    return Place(rank=rank, usable=usable, asked=asked, **fields)


def test_ranks_with_what_they_asked_for_say_nothing() -> None:
    assert problems([_place(0), _place(1)]) is None
    # Off Slurm nothing was asked: a laptop's shared cores are not a fault.
    assert problems([_place(0, usable=1, asked=None)]) is None
    # The same GPU index on two nodes, or under Slurm's renumbering, is two GPUs.
    assert problems([_place(0, gpus=["GPU-a"]), _place(1, node="n2", gpus=["GPU-b"])]) is None


def test_ranks_short_of_cpus_are_named_with_what_they_had_and_the_fix() -> None:
    said = problems([_place(0), _place(1, usable=1, cpus="3"), _place(2, usable=1, cpus="5")])
    assert said is not None
    assert said.startswith("ranks 1, 2 had fewer CPUs than the job asked for (1 of 2 per task")
    assert "CPUs 3)" in said and "--cpus-per-task" in said and "cluster.cpus_per_task" in said


def test_ranks_sharing_a_gpu_are_named_once_per_line() -> None:
    places = [
        _place(0, gpus=["GPU-a"]),
        _place(1, gpus=["GPU-a"]),
        _place(2, usable=1, gpus=["GPU-b"]),
    ]
    said = problems(places)
    assert said is not None and said.count(";") == 1  # one line, two findings
    assert "rank 2 had fewer CPUs" in said
    assert "ranks 0, 1 share one GPU (GPU-a on n1)" in said


def test_ranks_bound_to_one_cpu_set_have_their_share_of_it() -> None:
    """A step's cpuset that its tasks share (a cgroup without per-task binding): four ranks on
    the same 4 CPUs have one each, whatever each saw as its own."""
    shared = [_place(r, usable=4, cpus="0-3") for r in range(4)]
    said = problems(shared)
    assert said is not None and said.startswith("ranks 0, 1, 2, 3 had fewer CPUs than the job")
    assert "(1 of 2 per task on n1, CPUs 0-3)" in said
    assert problems([_place(r, usable=8, cpus="0-7") for r in range(4)]) is None  # 2 each
