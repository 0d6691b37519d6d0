"""Nodes on networks of their own: a test cluster whose slurmd each run in a network namespace
with its own address and hostname on a bridge (slurm/testcluster, TESTCLUSTER_NETNS=1), so a
job's ranks talk across a real network stack and a test can cut a node's link."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import _first_job_id, _why_no_slurm
from kit import REPO, kit, run_folder
from slurm_cluster import SlurmCluster, wait_job_releasing_holds

from core import runfolder

WORK = ["data.train_size=2048", "data.test_size=256", "cluster.cpus_per_task=1"]


@pytest.fixture(scope="module")
def netns_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """Three nodes, node1–node3, each in its own namespace; Slurm marks a node that stops
    answering DOWN after 30 s (SlurmdTimeout) and requeues its jobs."""
    reason = _why_no_slurm()
    if reason is not None:
        pytest.skip(reason)
    folder = tmp_path_factory.mktemp("netns")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TESTCLUSTER_NETNS", "1")
        patch.setenv("TESTCLUSTER_FIRST_JOB_ID", str(_first_job_id() + 5_000_000))
        cluster = SlurmCluster.start(folder, nodes=3)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def on_netns(netns_cluster: SlurmCluster, monkeypatch: pytest.MonkeyPatch) -> SlurmCluster:
    """The kit's commands and the jobs' scripts talk to the namespaced cluster."""
    for name, value in netns_cluster.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("KIT_PYTHON", sys.executable)
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    return netns_cluster


def _links(cluster: SlurmCluster) -> dict[str, str]:
    """node name -> the host end of its veth pair."""
    rows = (cluster.dir / "run" / "netns").read_text().split("\n")
    return {row.split()[2]: row.split()[1] for row in rows if row.strip()}


def _nodes_of_ranks(run_dir: Path, ranks: int) -> list[str]:
    return [
        runfolder.of_kind(runfolder.read_rank(run_dir, r), "start")[-1]["node"]
        for r in range(ranks)
    ]


def test_two_node_ddp_crosses_the_namespaces_on_both_launch_paths(
    on_netns: SlurmCluster, tmp_path: Path
) -> None:
    small = [*WORK, "train.epochs=2"]
    submitted = kit(
        "launch", "submit", "--mode", "ddp", "--nodes", "2", "cluster.backend=slurm",
        "cluster.gpus_per_node=1", *small, f"output.root={tmp_path}/submit",
        f"data.root={tmp_path}/data",
    )  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    sbatch = on_netns.run(
        "sbatch", "--parsable", "--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=1",
        "--cpus-per-task=1", f"--output={tmp_path}/slurm-%j.out", str(REPO / "slurm/ddp.sbatch"),
        *small, f"output.root={tmp_path}/sbatch", f"data.root={tmp_path}/data",
    )  # fmt: skip
    for job_id in (submitted.stdout.split()[2], sbatch.stdout.strip()):
        state, _ = wait_job_releasing_holds(job_id, 300, on_netns.env)
        assert state == "COMPLETED", (job_id, state)
    for run_dir in (run_folder(submitted.stdout), *runfolder.find_runs(tmp_path / "sbatch")):
        nodes = _nodes_of_ranks(run_dir, 2)
        assert len(set(nodes)) == 2 and all(n.startswith("node") for n in nodes), nodes
        summaries = [
            runfolder.of_kind(runfolder.read_rank(run_dir, r), "summary")[-1] for r in (0, 1)
        ]
        assert len({s["parameters_sha256"] for s in summaries}) == 1  # in step across the bridge


def test_a_node_whose_link_goes_down_for_good_is_requeued_onto_healthy_nodes(
    on_netns: SlurmCluster, tmp_path: Path
) -> None:
    """Mid-epoch, rank 1's node loses its link for good. Rank 0 gives up after dist.timeout_s;
    Slurm marks the node DOWN and requeues the job onto the two healthy nodes, where it resumes
    from its checkpoint and completes; `--wait` follows it there and exits 0."""
    following = subprocess.Popen(
        [sys.executable, "-m", "launch", "submit", "--mode", "ddp", "--nodes", "2",
         "cluster.backend=slurm", "cluster.gpus_per_node=1", *WORK, "train.epochs=6",
         "dist.timeout_s=20", f"output.root={tmp_path}/runs", f"data.root={tmp_path}/data",
         "--wait"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 300
    while not (runs := runfolder.find_runs(tmp_path / "runs")) or not runfolder.of_kind(
        runfolder.read_rank(runs[0], 0), "epoch"
    ):
        assert time.monotonic() < deadline and following.poll() is None, "no first epoch"
        time.sleep(0.5)
    run_dir = runs[0]
    lost = _nodes_of_ranks(run_dir, 2)[1]
    link = _links(on_netns)[lost]
    subprocess.run(["ip", "link", "set", link, "down"], check=True)
    try:
        out, _ = following.communicate(timeout=600)
    finally:
        following.kill()
        subprocess.run(["ip", "link", "set", link, "up"], check=False)
        subprocess.run(
            ["scontrol", "update", f"nodename={lost}", "state=resume"],
            check=False,
            env={**os.environ},
        )
    assert following.returncode == 0, out
    assert "but Slurm says RUNNING" in out and "done:" in out, out
    assert f"node {lost} is not answering Slurm" in out, out  # the node named, not only a rank
    starts = runfolder.of_kind(
        runfolder.read_records(runfolder.metrics_path(run_dir, 0))[0], "start"
    )
    assert len(starts) >= 2 and (starts[-1]["first_epoch"] > 1 or starts[-1]["resumed_at_batch"]), (
        starts
    )
    assert lost not in _nodes_of_ranks(run_dir, 2)  # the last attempt ran on healthy nodes
    epochs = [e["epoch"] for e in runfolder.of_kind(runfolder.read_rank(run_dir, 0), "epoch")]
    assert epochs == list(range(1, 7))
