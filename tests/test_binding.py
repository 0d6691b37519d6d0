"""The test cluster binds tasks as production GPU clusters do (proctrack/cgroup, task/affinity and
task/cgroup with ConstrainCores and ConstrainDevices): each task's CPU affinity, its cgroup's
cpuset, the GPU device files it may open, and what scancel reaches are Slurm's doing, read here
from inside the tasks."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from kit import REPO, kit, run_folder
from slurm_cluster import SlurmCluster
from test_slurm_jobs import SBATCH_SMALL

from slurm_ddp_kit.core import runfolder

pytestmark = pytest.mark.slurm

# Runs in each task and prints one JSON line: where the task is, the CPUs it may run on, the
# CPUs its cgroup allows (after asking for every CPU of the machine: only the cgroup's are
# granted), CUDA_VISIBLE_DEVICES, and what open() of each fake GPU gives: "ok" would be a real
# device, ENXIO a device file the device cgroup allows (no driver behind it), EPERM one it denies.
PROBE = r"""
import errno, json, os, sys
def opened(path):
    try:
        os.close(os.open(path, os.O_RDWR))
        return "ok"
    except OSError as error:
        return errno.errorcode[error.errno]
cpus = sorted(os.sched_getaffinity(0))
os.sched_setaffinity(0, range(os.cpu_count()))
print(json.dumps({
    "rank": int(os.environ["SLURM_PROCID"]),
    "node": os.environ["SLURMD_NODENAME"],
    "cpus": cpus,
    "widened": sorted(os.sched_getaffinity(0)),
    "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
    "devices": [opened(f"{sys.argv[1]}/nvidia{g}") for g in range(4)],
}))
"""


@pytest.fixture(autouse=True)
def _bound(slurm_cluster: SlurmCluster) -> None:
    if slurm_cluster.binding != "cgroup":
        pytest.skip("the test cluster binds nothing here (TESTCLUSTER_BINDING=none)")


def probe(cluster: SlurmCluster, *srun_args: str) -> list[dict[str, Any]]:
    """PROBE's findings in every task of `srun srun_args`, by rank."""
    done = cluster.run("srun", *srun_args, sys.executable, "-c", PROBE, str(cluster.dir / "dev"))
    assert done.returncode == 0, done.stderr
    return sorted((json.loads(line) for line in done.stdout.splitlines()), key=lambda t: t["rank"])


def node_cpus(cluster: SlurmCluster) -> int:
    done = cluster.run("sinfo", "-h", "-N", "-o", "%c")
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[0])


def test_nodes_have_the_machines_own_cpus(slurm_cluster: SlurmCluster) -> None:
    # Slurm cannot bind to CPUs that do not exist: a bound node declares the real ones.
    assert node_cpus(slurm_cluster) == os.cpu_count()


def test_each_task_is_bound_to_cpus_of_its_own(slurm_cluster: SlurmCluster) -> None:
    cpus = node_cpus(slurm_cluster)
    tasks = probe(slurm_cluster, "-N1", f"-n{cpus}")
    assert all(len(t["cpus"]) == 1 for t in tasks), tasks
    assert sorted(t["cpus"][0] for t in tasks) == list(range(cpus)), tasks


def test_a_task_is_confined_to_its_jobs_cpus_by_its_cgroup(slurm_cluster: SlurmCluster) -> None:
    # A job of one CPU: affinity alone a task could widen; its cpuset cgroup it cannot.
    (task,) = probe(slurm_cluster, "-N1", "-n1", "-c1")
    assert len(task["cpus"]) == 1
    assert task["widened"] == task["cpus"]
    (whole,) = probe(slurm_cluster, "-N1", "-n1", f"-c{node_cpus(slurm_cluster)}")
    assert whole["cpus"] == list(range(node_cpus(slurm_cluster)))


def slurm_release(cluster: SlurmCluster) -> tuple[int, int]:
    """(22, 5) for "slurm-wlm 22.05.8", (25, 11) for "slurm 25.11.7"."""
    words = cluster.run("sinfo", "--version").stdout.split()
    major, minor = words[-1].split(".")[:2]
    return int(major), int(minor)


def test_srun_takes_the_jobs_cpus_per_task_only_from_23_11(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """Slurm 22.05 and 23.02 do not pass a job's --cpus-per-task on to srun (23.11 does again):
    a step that takes only what it asks for (--exact) then binds each task to one CPU.
    `srun --cpus-per-task=$SLURM_CPUS_PER_TASK` is right on every release."""
    if node_cpus(slurm_cluster) < 2:
        pytest.skip("needs nodes of at least 2 CPUs")
    out, code = tmp_path / "job.out", tmp_path / "probe.py"
    code.write_text(PROBE)
    task = f"{sys.executable} {code} {slurm_cluster.dir}/dev"
    script = f'srun --exact {task}; srun --exact -c "$SLURM_CPUS_PER_TASK" {task}'
    done = slurm_cluster.run(
        "sbatch", "--wait", "-N1", "-n1", "-c2", f"--output={out}", "--wrap", script
    )
    assert done.returncode == 0, done.stderr + out.read_text()
    # srun's own words share the job's output (25.11: "srun: Step created for StepId=…" when
    # the second step waited for the first's CPUs to be given back): the probes' lines alone.
    lines = [line for line in out.read_text().splitlines() if line.startswith("{")]
    implicit, explicit = (json.loads(line) for line in lines)
    assert len(explicit["cpus"]) == 2
    assert len(implicit["cpus"]) == (2 if slurm_release(slurm_cluster) >= (23, 11) else 1)


def test_each_task_sees_its_gpu_as_0_and_may_open_no_other(slurm_cluster: SlurmCluster) -> None:
    tasks = probe(slurm_cluster, "-N1", "-n2", "--gpus-per-task=1")
    assert [t["cuda"] for t in tasks] == ["0", "0"]  # renumbered, as on a real node
    allowed = [[g for g, said in enumerate(t["devices"]) if said == "ENXIO"] for t in tasks]
    assert all(len(a) == 1 for a in allowed), tasks
    assert allowed[0] != allowed[1], tasks  # two different devices
    assert all(t["devices"].count("EPERM") == 3 for t in tasks), tasks


def test_a_job_may_open_its_gpus_only(slurm_cluster: SlurmCluster) -> None:
    (two,) = probe(slurm_cluster, "-N1", "-n1", "--gpus=2")
    assert two["cuda"] == "0,1"
    assert sorted(two["devices"]) == ["ENXIO", "ENXIO", "EPERM", "EPERM"]
    (none,) = probe(slurm_cluster, "-N1", "-n1")
    assert none["devices"] == ["EPERM"] * 4


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


def test_scancel_ends_a_double_forked_child(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    # The child leaves the job's process tree (a session of its own, its parent gone: it is
    # reparented to PID 1); its cgroup still holds it, so scancel ends it.
    pid_file = tmp_path / "child.pid"
    script = f"setsid sh -c 'sleep 600 & echo $! >{pid_file}'; sleep 600"
    done = slurm_cluster.run("sbatch", "--parsable", "--output=/dev/null", "--wrap", script)
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.strip()
    deadline = time.monotonic() + 60
    while not pid_file.is_file() or not pid_file.read_text().strip():
        assert time.monotonic() < deadline, f"job {job_id} never started its child"
        time.sleep(0.2)
    child = int(pid_file.read_text())
    assert alive(child)
    cgroup = Path(f"/proc/{child}/cgroup").read_text()
    assert f"/job_{job_id}/" in cgroup, cgroup
    assert slurm_cluster.run("scancel", job_id).returncode == 0
    deadline = time.monotonic() + 30
    while alive(child):
        assert time.monotonic() < deadline, f"child {child} of job {job_id} outlived scancel"
        time.sleep(0.2)


def _start(run_dir: Path) -> dict[str, Any]:
    return runfolder.of_kind(runfolder.read_rank(run_dir, 0), "start")[-1]


def test_each_rank_gets_the_cpus_its_job_asked_for_and_a_short_step_is_said(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """DP's one process, through `launch submit`, gets all of its node's CPUs (2 for 2 GPUs at
    one CPU each): srun is told them. A user's own batch script whose exact srun step leaves out
    the job's --cpus-per-task gives the rank one CPU on Slurm 22.05 and 23.02: `launch status`
    says so in one line, naming the fix (from 23.11 srun takes the job's CPUs again)."""
    if node_cpus(slurm_cluster) < 2:
        pytest.skip("needs nodes of at least 2 CPUs")
    where = [f"output.root={tmp_path}/runs", f"data.root={tmp_path}/data", *SBATCH_SMALL]
    done = kit(
        "launch", "submit", "--mode", "dp", "cluster.backend=slurm", "cluster.gpus_per_node=2",
        "cluster.cpus_per_task=1", *where, "--wait",
    )  # fmt: skip
    assert done.returncode == 0 and "warning:" not in done.stdout, done.stdout + done.stderr
    start = _start(run_folder(done.stdout))
    assert (start["cpus_asked"], start["cpus_usable"], start["threads"]) == (2, 2, 2)
    assert start["cpus"] == "0-1" and start["placement"] is None

    prepared = kit(
        "launch", "prepare", "--mode", "ddp", "cluster.gpus_per_node=1", "cluster.cpus_per_task=2",
        *where,
    )  # fmt: skip
    assert prepared.returncode == 0, prepared.stderr
    run_dir = Path(prepared.stdout.strip())
    out = tmp_path / "job.out"
    step = f"srun --exact {sys.executable} -m train run {run_dir}"
    job = slurm_cluster.run(
        "sbatch", "--wait", "-N1", "-n1", "-c2", "--gpus-per-node=1", f"--output={out}",
        "--wrap", step, cwd=REPO,
    )  # fmt: skip
    assert job.returncode == 0, job.stderr + out.read_text()
    start = _start(run_dir)
    status = kit("launch", "status", str(run_dir)).stdout
    if slurm_release(slurm_cluster) >= (23, 11):
        assert (start["cpus_usable"], start["placement"]) == (2, None)
        assert "fewer CPUs" not in status
        return
    assert (start["cpus_asked"], start["cpus_usable"], start["threads"]) == (2, 1, 1)
    said = f"{run_dir.name}: rank 0 had fewer CPUs than the job asked for (1 of 2 per task on "
    assert said in status and "(--cpus-per-task)" in status, status
