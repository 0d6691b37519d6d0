"""Sixteen nodes: a test cluster of 16 slurmd, each in a network namespace of its own (node1 …
node16), where the kit's reading of Slurm is checked at a size where ranks, nodes and arrays are
many. The tasks here only write their environment: the kit's mapping (`train.distenv.detect`)
is then computed from each task's own variables, exactly as it would be inside the task, without
starting torch 64 times on two cores."""

from __future__ import annotations

import collections
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import namespaced_cluster
from kit import SMALL, kit
from slurm_cluster import SlurmCluster

from slurm_ddp_kit.train.distenv import DistEnv, detect

# 16 in the suite; KIT_TEST_NODES=64 tries the same at another size (docs/benchmarks/many-nodes.md).
NODES = int(os.environ.get("KIT_TEST_NODES", "16"))
MAX_ARRAY_SIZE = 64  # the cluster's MaxArraySize: a 150-point sweep needs three arrays


@pytest.fixture(scope="module")
def many(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    yield from namespaced_cluster(
        tmp_path_factory, "many", nodes=NODES, ids_from=6_000_000, timeout=240,
        TESTCLUSTER_MAX_ARRAY_SIZE=str(MAX_ARRAY_SIZE),
    )  # fmt: skip


def _task_envs(
    cluster: SlurmCluster, folder: Path, *srun: str, env: dict[str, str] | None = None
) -> list[dict[str, str]]:
    """Run `srun ARGS` whose every task writes its environment to a file; the tasks' environments."""
    folder.mkdir()
    done = cluster.run(
        "srun", *srun, "bash", "-c", 'env -0 > "$0/$SLURM_PROCID.env"', str(folder),
        env=env, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return [_read_env(path) for path in sorted(folder.glob("*.env"))]


def _read_env(path: Path) -> dict[str, str]:
    pairs = (entry.partition("=") for entry in path.read_text().split("\0") if entry)
    return {name: value for name, _, value in pairs}


def _mapping(tasks: list[dict[str, str]]) -> list[tuple[DistEnv, str]]:
    """Each task's place as the kit reads it, and the node it ran on; checked to be one job."""
    places = [(detect(task), task["SLURMD_NODENAME"]) for task in tasks]
    world = len(tasks)
    assert sorted(env.rank for env, _ in places) == list(range(world))
    for (env, _), task in zip(places, tasks, strict=True):
        assert (env.source, env.rank, env.world_size) == ("slurm", int(task["SLURM_PROCID"]), world)
    assert len({(env.master_addr, env.master_port) for env, _ in places}) == 1
    servers = [node for env, node in places if env.serves_store]
    assert servers == [places[0][0].master_addr], "one store, served on the host MASTER_ADDR names"
    on_node = collections.defaultdict(list)
    for env, node in places:
        on_node[node].append(env)
    node_ranks = {node: {env.node_rank for env in envs} for node, envs in on_node.items()}
    assert all(len(ranks) == 1 for ranks in node_ranks.values()), node_ranks
    assert sorted(r for (r,) in node_ranks.values()) == list(range(len(on_node)))
    for node, envs in on_node.items():
        assert sorted(env.local_rank for env in envs) == list(range(len(envs))), node
        assert {env.local_world_size for env in envs} == {len(envs)}, node
    return places


DISTRIBUTIONS = {
    "block, 4 a node": [f"-N{NODES}", f"-n{4 * NODES}"],
    "uneven (4N-3 tasks)": [f"-N{NODES}", f"-n{4 * NODES - 3}"],
    "cyclic": [f"-N{NODES}", f"-n{4 * NODES}", "-m", "cyclic"],
    "plane of 3": [f"-N{NODES}", f"-n{5 * NODES // 2}", "-m", "plane=3"],
    "one GPU a task": [f"-N{NODES // 2}", "--ntasks-per-node=4", "--gpus-per-task=1"],
    "a subset, from the 5th node": ["-N4", "-n10", "-w", "node[5-8]"],
}


@pytest.mark.slurm
@pytest.mark.parametrize("name", DISTRIBUTIONS)
def test_ranks_map_under_each_distribution(many: SlurmCluster, tmp_path: Path, name: str) -> None:
    places = _mapping(_task_envs(many, tmp_path / "tasks", *DISTRIBUTIONS[name]))
    rank0_node = next(node for env, node in places if env.rank == 0)
    assert rank0_node == places[0][0].master_addr  # here rank 0 runs on the first node


@pytest.mark.slurm
def test_rank_0_elsewhere_than_the_first_node_still_meets_at_the_store(
    many: SlurmCluster, tmp_path: Path
) -> None:
    """`-m arbitrary` with a SLURM_HOSTFILE out of node order: rank 0 runs on node9, the
    first host of the step's node list is node2; the store is served on node2, where the ranks
    look for it."""
    hosts = ["node9", "node9", "node2", "node2", "node14", "node2", "node5"]
    (tmp_path / "hostfile").write_text("\n".join(hosts) + "\n")
    folder = tmp_path / "tasks"
    folder.mkdir()
    step = (
        f"SLURM_HOSTFILE={tmp_path}/hostfile srun -m arbitrary -n {len(hosts)} "
        f"bash -c 'env -0 > \"{folder}/$SLURM_PROCID.env\"'"
    )
    done = many.run(
        "sbatch", "--wait", "-w", ",".join(set(hosts)), "-n", str(len(hosts)),
        f"--output={tmp_path}/slurm.out", "--wrap", step, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, (tmp_path / "slurm.out").read_text()
    places = _mapping([_read_env(path) for path in folder.glob("*.env")])
    assert [node for env, node in sorted(places, key=lambda p: p[0].rank)] == hosts
    assert places[0][0].master_addr == "node2"


@pytest.mark.slurm
def test_a_heterogeneous_step_is_one_world(many: SlurmCluster, tmp_path: Path) -> None:
    """`srun -N2 -n3 : -N3 -n5`: two components, one step; Slurm numbers its tasks and nodes
    across both (SLURM_PROCID 0-7, SLURM_NODEID 0-4), and the kit reads one world of 8."""
    folder = tmp_path / "tasks"
    folder.mkdir()
    write = ["bash", "-c", 'env -0 > "$0/$SLURM_PROCID.env"', str(folder)]
    done = many.run("srun", "-N2", "-n3", *write, ":", "-N3", "-n5", *write, timeout=120)
    assert done.returncode == 0, done.stderr
    tasks = [_read_env(path) for path in folder.glob("*.env")]
    assert {task["SLURM_HET_SIZE"] for task in tasks} == {"2"}
    places = _mapping(tasks)
    assert len({node for _, node in places}) == 5


@pytest.mark.slurm
def test_array_elements_and_the_jobs_around_them_never_share_a_port(
    many: SlurmCluster, tmp_path: Path
) -> None:
    """A plain job, two arrays of 30 and a plain job, submitted back to back as a sweep and the
    jobs after it are: every element takes its port from its own job id, so no two of the 62
    share one (they did when an element's port came from `J_K`)."""
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    step = f"srun bash -c 'env -0 > \"{tasks}/$SLURM_JOB_ID.env\"'"
    ids = []
    for array in ([], ["--array=0-29"], ["--array=0-29"], []):
        # From tmp_path: sbatch writes each job's slurm-J.out where it was run, not the repo.
        done = many.run("sbatch", "--parsable", "-n1", *array, "--wrap", step, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        ids.append(done.stdout.strip())
    for job_id in ids:
        many.wait_job(job_id, timeout=180)
    envs = [_read_env(path) for path in tasks.glob("*.env")]
    ports = [detect(env).master_port for env in envs]
    assert len(envs) == 62 and len(set(ports)) == 62, sorted(ports)
    assert all(20000 <= port < 32768 for port in ports)  # below the ephemeral range


@pytest.mark.slurm
def test_a_sweep_past_max_array_size_reads_pending_then_cancelled(
    many: SlurmCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """150 points against MaxArraySize=64: three arrays (64, 64, 22), held an hour (--begin),
    then cancelled with one plain scancel per array. `status` reads every run PENDING, then
    CANCELLED once the queue has forgotten them, from one squeue and one sacct call each time."""
    for name, value in many.env.items():
        monkeypatch.setenv(name, value)
    values = ",".join(f"{n / 10_000:.4f}" for n in range(1, 151))
    done = kit(
        "launch", "sweep", "--modes", "ddp", "--grid", f"train.lr={values}",
        "cluster.backend=slurm", "cluster.gpus_per_node=1", "cluster.cpus_per_task=1",
        "cluster.sbatch_extra.begin=now+3600", *SMALL, f"output.root={tmp_path}/runs",
        f"data.root={tmp_path}/data",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    jobs = [line.split()[2] for line in done.stdout.splitlines()]
    arrays = collections.Counter(job.split("_")[0] for job in jobs)
    assert sorted(arrays.values()) == [22, 64, 64], arrays
    assert max(int(job.split("_")[1]) for job in jobs) == MAX_ARRAY_SIZE - 1
    _assert_status(tmp_path, ["PENDING"] * 150)
    assert many.run("scancel", *arrays).returncode == 0
    deadline = time.monotonic() + 60
    while many.run("squeue", "-h", "-j", ",".join(arrays)).stdout.strip():
        assert time.monotonic() < deadline, "the cancelled arrays stayed in the queue"
        time.sleep(1)
    _assert_status(tmp_path, ["CANCELLED"] * 150)


def _assert_status(root: Path, states: list[str]) -> None:
    status = kit("launch", "status", "--root", f"{root}/runs", "-v")
    rows = status.stdout.splitlines()[1:]
    assert [row.split()[4] for row in rows] == states, status.stdout
    calls = re.findall(r"slurm: (squeue|sacct) -", status.stderr)
    assert sorted(calls) == ["sacct", "squeue"], status.stderr
