"""The test Slurm cluster behaves like the real thing in the ways the kit relies on: node layout,
task ranks, fake GPUs, accounting states, a short hold after a requeue and fast turnaround. (How
it binds tasks to CPUs and GPUs: test_binding.py.)"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from slurm_cluster import SlurmCluster, job_state, wait_job

pytestmark = pytest.mark.slurm

# Prints one line per task: PROCID LOCALID NODEID NODENAME CUDA_VISIBLE_DEVICES
TASK_LINE = (
    'echo "$SLURM_PROCID $SLURM_LOCALID $SLURM_NODEID $SLURMD_NODENAME'
    ' ${CUDA_VISIBLE_DEVICES-unset}"'
)


def task_lines(cluster: SlurmCluster, *srun_args: str) -> list[list[str]]:
    """Run TASK_LINE in every task of `srun srun_args` and return the fields, by PROCID."""
    done = cluster.run("srun", *srun_args, "bash", "-c", TASK_LINE)
    assert done.returncode == 0, done.stderr
    return sorted((line.split() for line in done.stdout.splitlines()), key=lambda f: int(f[0]))


def sbatch_wait(cluster: SlurmCluster, tmp_path: Path, script: str, *args: str) -> tuple[str, str]:
    """Submit `script` with `sbatch --wait`; return the job id and what the job printed."""
    out = tmp_path / "job.out"
    done = cluster.run(
        "sbatch", "--wait", "--parsable", f"--output={out}", *args, "--wrap", script, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.strip().split(";")[0]
    return job_id, out.read_text()


def parse_env(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def test_all_nodes_idle_with_their_cpus_and_4_typed_gpus(slurm_cluster: SlurmCluster) -> None:
    # A job of an earlier test may still be completing: give the nodes a moment.
    deadline = time.monotonic() + 10
    while True:
        done = slurm_cluster.run("sinfo", "-h", "-N", "-o", "%N %t %c %m %G %P")
        assert done.returncode == 0, done.stderr
        nodes = sorted(line.split() for line in done.stdout.splitlines())
        if all(n[1] == "idle" for n in nodes) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    # Bound, a node has the machine's CPUs (Slurm binds to real ones only); else it declares 8.
    cpus = str(os.cpu_count()) if slurm_cluster.binding == "cgroup" else "8"
    first, second = slurm_cluster.node_names
    assert nodes == [
        [first, "idle", cpus, "16000", "gpu:a100:4", "debug*"],
        [second, "idle", cpus, "16000", "gpu:a100:4", "debug*"],
    ]


def test_srun_two_tasks_per_node_ranks(slurm_cluster: SlurmCluster) -> None:
    tasks = task_lines(slurm_cluster, "-N2", "-n4", "--ntasks-per-node=2")
    first, second = slurm_cluster.node_names
    assert [t[:4] for t in tasks] == [
        ["0", "0", "0", first],
        ["1", "1", "0", first],
        ["2", "0", "1", second],
        ["3", "1", "1", second],
    ]


def test_srun_n3_on_2_nodes_is_not_balanced_without_ntasks_per_node(
    slurm_cluster: SlurmCluster,
) -> None:
    # Slurm fills the first node's CPUs first (2 or more a node), so the first node gets 2 tasks
    # and the second 1: a launcher that wants an even layout must say --ntasks-per-node.
    tasks = task_lines(slurm_cluster, "-N2", "-n3")
    assert [t[2] for t in tasks] == ["0", "0", "1"]
    assert [t[0] for t in tasks] == ["0", "1", "2"]


def test_batch_job_completes_and_accounting_shows_it(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    job_id, out = sbatch_wait(slurm_cluster, tmp_path, "echo hello from $SLURM_JOB_ID")
    assert out.strip() == f"hello from {job_id}"
    assert wait_job(job_id, timeout=30) == "COMPLETED"


def test_failing_batch_job_is_failed(slurm_cluster: SlurmCluster) -> None:
    done = slurm_cluster.run(
        "sbatch", "--wait", "--parsable", "-o", "/dev/null", "--wrap", "exit 3"
    )
    assert done.returncode == 3
    assert wait_job(done.stdout.strip(), timeout=30) == "FAILED"


def test_gres_gpu4_sees_four_devices(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    _, out = sbatch_wait(slurm_cluster, tmp_path, "env", "--gres=gpu:4")
    env = parse_env(out)
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    assert env["SLURM_GPUS_ON_NODE"] == "4"
    assert env["SLURM_JOB_GPUS"] == "0,1,2,3"


def test_no_gpu_request_sets_no_cuda_visible_devices(slurm_cluster: SlurmCluster) -> None:
    # Without a GPU request Slurm does not set CUDA_VISIBLE_DEVICES (srun runs without one).
    done = slurm_cluster.run(
        "env", "-u", "CUDA_VISIBLE_DEVICES", "srun", "-n1", "bash", "-c", TASK_LINE
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[4] == "unset"


def test_gpus_per_task_gives_each_task_its_own_gpu(slurm_cluster: SlurmCluster) -> None:
    tasks = task_lines(slurm_cluster, "-n4", "--gpus-per-task=1")
    devices = [(t[3], t[4]) for t in tasks]
    assert all("," not in d for _, d in devices), devices
    if slurm_cluster.binding == "cgroup":  # each its own, seen as 0 (test_binding opens them)
        assert {d for _, d in devices} == {"0"}, devices
    else:
        assert len(set(devices)) == 4, devices


def test_gpus_per_task_on_two_nodes_restart_at_0(slurm_cluster: SlurmCluster) -> None:
    tasks = task_lines(slurm_cluster, "-N2", "--ntasks-per-node=2", "--gpus-per-task=1")
    first, second = slurm_cluster.node_names
    # Bound (ConstrainDevices), each task sees its one GPU as 0, as on a real node; unbound,
    # each sees the node's GPUs and is told its own by index.
    bound = slurm_cluster.binding == "cgroup"
    assert [(t[3], t[4]) for t in tasks] == [
        (first, "0"),
        (first, "0" if bound else "1"),
        (second, "0"),
        (second, "0" if bound else "1"),
    ]


def test_five_gpus_on_one_node_is_rejected_at_submission(slurm_cluster: SlurmCluster) -> None:
    done = slurm_cluster.run("sbatch", "--gres=gpu:5", "--wrap", "true")
    assert done.returncode != 0
    assert "Requested node configuration is not available" in done.stderr


def test_cancelled_job_is_cancelled_in_accounting(slurm_cluster: SlurmCluster) -> None:
    done = slurm_cluster.run("sbatch", "--parsable", "-o", "/dev/null", "--wrap", "sleep 300")
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.strip()
    deadline = time.monotonic() + 30
    while job_state(job_id) != "RUNNING":
        assert time.monotonic() < deadline, f"job {job_id} never started"
        time.sleep(0.1)
    assert slurm_cluster.run("scancel", job_id).returncode == 0
    assert wait_job(job_id, timeout=30) == "CANCELLED"


def test_batch_and_step_environment(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    # What a launcher sees in a 2-node x 2-task allocation: in the batch script itself (no
    # step id, but PROCID/LOCALID/NODEID 0) and inside an srun step.
    _, out = sbatch_wait(
        slurm_cluster,
        tmp_path,
        'env; echo "--- step"; srun -n1 -N1 env',
        "-N2",
        "--ntasks-per-node=2",
    )
    batch_text, step_text = out.split("--- step\n")
    batch, step = parse_env(batch_text), parse_env(step_text)

    first, _ = slurm_cluster.node_names
    nodelist = first.rsplit(".", 1)[0] + ".[11-12]"  # 127.A.B.[11-12]
    assert batch["SLURM_JOB_NODELIST"] == nodelist
    assert batch["SLURM_NODELIST"] == nodelist
    assert batch["SLURM_JOB_NUM_NODES"] == "2"
    assert batch["SLURM_NTASKS"] == "4"
    assert batch["SLURM_TASKS_PER_NODE"] == "2(x2)"
    assert batch["SLURM_NTASKS_PER_NODE"] == "2"
    assert batch["SLURMD_NODENAME"] == first
    assert (batch["SLURM_PROCID"], batch["SLURM_LOCALID"], batch["SLURM_NODEID"]) == ("0", "0", "0")
    assert "SLURM_STEP_ID" not in batch
    assert "SLURM_STEPID" not in batch

    assert step["SLURM_STEP_ID"] == "0"
    assert step["SLURM_STEP_NUM_TASKS"] == "1"
    assert step["SLURM_STEP_NODELIST"] == first
    assert step["SLURM_JOB_NODELIST"] == nodelist


def test_trivial_job_turnaround_is_quick(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    # sbatch --wait polls every 2 s, so about 2 s is the floor.
    start = time.monotonic()
    sbatch_wait(slurm_cluster, tmp_path, "true")
    elapsed = time.monotonic() - start
    assert elapsed < 5, f"trivial sbatch --wait took {elapsed:.1f} s"


def test_a_requeued_job_is_held_briefly_then_starts_by_itself(slurm_cluster: SlurmCluster) -> None:
    """Slurm holds a requeued job (reason BeginTime) for requeue_delay or the credential lifetime
    + 1 s: 121 s by default, then waits for its main scheduling loop (every 60 s). The test
    cluster sets 10 s (TESTCLUSTER_REQUEUE_DELAY) and a 2-s loop: about 14 s in all here."""
    done = slurm_cluster.run(
        "sbatch", "--parsable", "--requeue", "--output=/dev/null", "--wrap", "sleep 300"
    )
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.strip()

    def queued() -> str:
        return slurm_cluster.run("squeue", "-h", "-j", job_id, "-o", "%T|%r").stdout.strip()

    deadline = time.monotonic() + 60
    while queued() != "RUNNING|None":
        assert time.monotonic() < deadline, f"job {job_id} never started"
        time.sleep(0.1)
    requeued = time.monotonic()
    assert slurm_cluster.run("scontrol", "requeue", job_id).returncode == 0
    seen = set()
    while (state := queued()) != "RUNNING|None":
        seen.add(state)
        assert time.monotonic() - requeued < 40, f"job {job_id} not running again: {seen}"
        time.sleep(0.2)
    assert "PENDING|BeginTime" in seen, seen
    held = time.monotonic() - requeued
    assert held > 5, f"job {job_id} started again {held:.1f} s after its requeue: no hold?"
    slurm_cluster.run("scancel", job_id)
