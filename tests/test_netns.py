"""Nodes on networks of their own: a test cluster whose slurmd each run in a network namespace
with its own address and hostname on a bridge (slurm/testcluster, TESTCLUSTER_NETNS=1), so a
job's ranks talk across a real network stack and a test can cut a node's link."""

from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import namespaced_cluster
from kit import REPO, kit, run_folder, wait_for
from paced import LASTING
from slurm_cluster import SlurmCluster, release_hold, wait_job_releasing_holds

from slurm_ddp_kit.core import runfolder

pytestmark = pytest.mark.netns

WORK = ["data.train_size=2048", "data.test_size=256", "cluster.cpus_per_task=1"]


@pytest.fixture(scope="module")
def netns_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """Three nodes, node1–node3, each in its own namespace; Slurm marks a node that stops
    answering DOWN after 30 s (SlurmdTimeout) and requeues its jobs."""
    yield from namespaced_cluster(tmp_path_factory, "netns", nodes=3, ids_from=5_000_000)


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


def _namespaces(cluster: SlurmCluster) -> dict[str, str]:
    """node name -> its network namespace."""
    rows = (cluster.dir / "run" / "netns").read_text().split("\n")
    return {row.split()[2]: row.split()[0] for row in rows if row.strip()}


def _in_namespace(cluster: SlurmCluster, node: str, *command: str, input: str = "") -> str:
    """Run a command in the node's network namespace (nsenter, as the node's slurmd runs there;
    `ip netns exec` would remount /sys)."""
    ns = _namespaces(cluster)[node]
    done = subprocess.run(
        ["nsenter", f"--net=/run/netns/{ns}", *command], input=input, capture_output=True, text=True
    )
    assert done.returncode == 0, (command, done.stderr)
    return done.stdout


def _follow(tmp_path: Path, *settings: str) -> subprocess.Popen[str]:
    """`launch submit --wait` of a 2-node DDP job on the namespaced cluster, followed in the
    background."""
    return subprocess.Popen(
        [sys.executable, "-m", "launch", "submit", "--mode", "ddp", "--nodes", "2",
         "cluster.backend=slurm", "cluster.gpus_per_node=1", "cluster.cpus_per_task=1",
         *settings, f"output.root={tmp_path}/runs", f"data.root={tmp_path}/data", "--wait"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


@contextlib.contextmanager
def _releasing_holds(cluster: SlurmCluster) -> Iterator[None]:
    """Slurm holds a job it requeued for two minutes (BeginTime) before it may start again:
    while a test follows the job, release such a hold after HELD_S (long enough for `--wait`,
    which asks every 10 s, to see and say it) rather than sleep it out."""
    done, held = threading.Event(), dict[str, float]()

    def release() -> None:
        while not done.wait(1):
            queue = cluster.run("squeue", "-h", "-o", "%i %T|%r").stdout.split("\n")
            for job_id, queued in (row.split(" ", 1) for row in queue if row.strip()):
                if not queued.startswith("PENDING"):
                    held.pop(job_id, None)
                elif time.monotonic() - held.setdefault(job_id, time.monotonic()) > HELD_S:
                    release_hold(job_id, cluster.env, queued)

    thread = threading.Thread(target=release, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


HELD_S = 25


def _epochs(run_dir: Path, rank: int = 0) -> list[int]:
    return [e["epoch"] for e in runfolder.of_kind(runfolder.read_rank(run_dir, rank), "epoch")]


def _first_epoch(tmp_path: Path, following: subprocess.Popen[str]) -> Path:
    """The run folder, once rank 0 has recorded its first epoch and saved the state after it (the
    save follows the record and gathers from every rank: a link cut between the two leaves no
    state to resume from)."""
    deadline = time.monotonic() + 300
    while not (runs := runfolder.find_runs(tmp_path / "runs")) or not _saved_after_epoch(runs[0]):
        assert time.monotonic() < deadline and following.poll() is None, "no first epoch"
        time.sleep(0.5)
    return runs[0]


def _saved_after_epoch(run_dir: Path) -> bool:
    return bool(_epochs(run_dir)) and runfolder.state_path(run_dir).is_file()


def _attempts(run_dir: Path) -> list[dict[str, object]]:
    """Rank 0's start records over every attempt of the job (not only the last)."""
    return runfolder.of_kind(runfolder.read_records(runfolder.metrics_path(run_dir, 0))[0], "start")


def _nodes_of_ranks(run_dir: Path, ranks: int) -> list[str]:
    return [
        runfolder.of_kind(runfolder.read_rank(run_dir, r), "start")[-1]["node"]
        for r in range(ranks)
    ]


# Rank 0 on the allocation's second node: `srun -m arbitrary` places the tasks as SLURM_HOSTFILE
# lists them. The first node's first task (rank 1) serves the rendezvous at MASTER_ADDR.
ARBITRARY = """#!/bin/bash
set -euo pipefail
eval "$("$KIT_PYTHON" -m launch prepare --shell --mode ddp --nodes 2 cluster.gpus_per_node=1 \
    cluster.backend=slurm "$@")"
hosts=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))
printf '%s\n' "${hosts[1]}" "${hosts[0]}" > "$run_dir/hostfile"
SLURM_HOSTFILE=$run_dir/hostfile srun -m arbitrary -n 2 --kill-on-bad-exit=1 \
    --output="$rank_log" "$KIT_PYTHON" -m train run "$run_dir"
"""


def test_two_node_ddp_crosses_the_namespaces_on_both_launch_paths(
    on_netns: SlurmCluster, tmp_path: Path
) -> None:
    """Both launch paths, and a batch script that puts rank 0 on the second node."""
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
    (tmp_path / "arbitrary.sh").write_text(ARBITRARY)
    arbitrary = on_netns.run(
        "sbatch", "--parsable", "--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=1",
        "--cpus-per-task=1", f"--output={tmp_path}/slurm-%j.out", str(tmp_path / "arbitrary.sh"),
        *small, f"output.root={tmp_path}/arbitrary", f"data.root={tmp_path}/data",
    )  # fmt: skip
    jobs = (submitted.stdout.split()[2], sbatch.stdout.strip(), arbitrary.stdout.strip())
    for job_id in jobs:
        state, _ = wait_job_releasing_holds(job_id, 300, on_netns.env)
        assert state == "COMPLETED", (job_id, state, list(tmp_path.glob("slurm-*.out")))
    (placed,) = runfolder.find_runs(tmp_path / "arbitrary")
    starts = [runfolder.of_kind(runfolder.read_rank(placed, r), "start")[-1] for r in (0, 1)]
    second, first = (placed / "hostfile").read_text().split()
    assert [s["node"] for s in starts] == [second, first]  # rank 0 where the hostfile put it
    assert {s["master_addr"] for s in starts} == {first}  # served there by rank 1
    runs = (run_folder(submitted.stdout), *runfolder.find_runs(tmp_path / "sbatch"), placed)
    for run_dir in runs:
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
    following = _follow(tmp_path, *WORK, "train.epochs=6", "dist.timeout_s=20")
    run_dir = _first_epoch(tmp_path, following)
    lost = _nodes_of_ranks(run_dir, 2)[1]
    link = _links(on_netns)[lost]
    subprocess.run(["ip", "link", "set", link, "down"], check=True)
    try:
        with _releasing_holds(on_netns):
            out, _ = following.communicate(timeout=600)
    finally:
        following.kill()
        subprocess.run(["ip", "link", "set", link, "up"], check=False)
        _resume_node(on_netns, lost)
    assert following.returncode == 0, out
    assert "but Slurm says RUNNING" in out and "done:" in out, out
    assert f"node {lost} is not answering Slurm" in out, out  # the node named, not only a rank
    starts = _attempts(run_dir)
    assert len(starts) >= 2 and (starts[-1]["first_epoch"] > 1 or starts[-1]["resumed_at_batch"]), (
        starts
    )
    assert lost not in _nodes_of_ranks(run_dir, 2)  # the last attempt ran on healthy nodes
    assert _epochs(run_dir) == list(range(1, 7))


# Well below the test cluster's SlurmdTimeout (30 s): a cut of 20 s on a loaded machine was once
# taken by Slurm's controller for a lost node, and the job requeued (what the node tests check).
FLAP_S = 12


def test_a_link_down_for_a_while_then_slow_and_lossy_costs_time_not_the_run(
    on_netns: SlurmCluster, tmp_path: Path
) -> None:
    """Mid-epoch, rank 1's node loses its link for FLAP_S; once it is back, the node's link is
    throttled for the rest of the run (50 Mbit/s, up to 200 ms queued: tbf) and drops 5 % of
    what it sends (nftables; this kernel has no netem). Gloo's connections ride both out within
    dist.timeout_s: the job slows, and completes with every epoch once and its ranks in step."""
    epochs = 6
    following = _follow(tmp_path, *LASTING, f"train.epochs={epochs}", "dist.timeout_s=60")
    run_dir = _first_epoch(tmp_path, following)
    node = _nodes_of_ranks(run_dir, 2)[1]
    link = _links(on_netns)[node]
    try:
        subprocess.run(["ip", "link", "set", link, "down"], check=True)
        time.sleep(FLAP_S)
        subprocess.run(["ip", "link", "set", link, "up"], check=True)
        assert wait_for(lambda: len(_epochs(run_dir)) >= 3, 120), "no epoch after the flap"
        _in_namespace(on_netns, node, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf",
                      "rate", "50mbit", "burst", "64kb", "latency", "200ms")  # fmt: skip
        _in_namespace(on_netns, node, "nft", "-f", "-", input=LOSSY)
        out, _ = following.communicate(timeout=600)
        dropped = _in_namespace(on_netns, node, "nft", "list", "table", "inet", "kitloss")
    finally:
        following.kill()
        subprocess.run(["ip", "link", "set", link, "up"], check=False)
        _heal(on_netns, node)
    assert following.returncode == 0 and "done:" in out, out
    assert "failed" not in out and "Slurm says" not in out, out  # no rank gave up
    assert _epochs(run_dir) == list(range(1, epochs + 1)) == _epochs(run_dir, 1)
    ends = [e["time"] for e in runfolder.of_kind(runfolder.read_rank(run_dir, 0), "epoch")]
    # The flap was felt: it held up one epoch's steps or the scoring after it as long or more.
    assert max(b - a for a, b in itertools.pairwise(ends)) >= FLAP_S, ends
    assert int(dropped.split("counter packets ")[1].split()[0]) > 0, dropped  # loss was real
    summaries = [runfolder.of_kind(runfolder.read_rank(run_dir, r), "summary")[-1] for r in (0, 1)]
    assert summaries[0]["parameters_sha256"] == summaries[1]["parameters_sha256"]


def test_a_node_whose_slurmd_dies_is_requeued_onto_healthy_nodes(
    on_netns: SlurmCluster, tmp_path: Path
) -> None:
    """Mid-epoch, the slurmd of rank 1's node is killed (SIGKILL; its job's processes run on).
    Slurm marks the node DOWN once it misses its pings (SlurmdTimeout) and requeues the job: the
    ranks it reaches stop at an agreed step and save; the next attempt runs on the healthy nodes,
    resumes there and completes. `--wait` says in one line that the job was requeued and names
    the node, follows it, and exits 0."""
    epochs = 20  # paced, about 4 s an epoch: still training when Slurm gives the node up
    following = _follow(tmp_path, *LASTING, f"train.epochs={epochs}", "dist.timeout_s=20")
    run_dir = _first_epoch(tmp_path, following)
    node = _nodes_of_ranks(run_dir, 2)[1]
    pid = int((on_netns.dir / "run" / f"slurmd-{node}.pid").read_text())
    os.kill(pid, 9)
    try:
        with _releasing_holds(on_netns):
            out, _ = following.communicate(timeout=600)
    finally:
        following.kill()
        subprocess.run(["bash", str(REPO / "slurm/testcluster/slurmd.sh"), str(on_netns.dir), node],
                       check=False)  # fmt: skip
        _resume_node(on_netns, node)
    assert following.returncode == 0 and "done:" in out, out
    assert f"requeued (node {node} is not answering Slurm (down" in out, out  # one line says why
    assert len(_attempts(run_dir)) >= 2, _attempts(run_dir)
    assert node not in _nodes_of_ranks(run_dir, 2)
    assert _epochs(run_dir) == list(range(1, epochs + 1))


LOSSY = """table inet kitloss {
    chain out {
        type filter hook output priority 0; policy accept;
        oifname "eth0" numgen random mod 100 < 5 counter drop
    }
}
"""


def _heal(cluster: SlurmCluster, node: str) -> None:
    """Take the throttle and the loss off the node's link again."""
    ns = _namespaces(cluster)[node]
    for command in (["tc", "qdisc", "del", "dev", "eth0", "root"],
                    ["nft", "delete", "table", "inet", "kitloss"]):  # fmt: skip
        subprocess.run(["nsenter", f"--net=/run/netns/{ns}", *command], capture_output=True)
    _resume_node(cluster, node)


def _resume_node(cluster: SlurmCluster, node: str) -> None:
    """Put a node that Slurm marked DOWN back into service for the next test."""
    cluster.run("scontrol", "update", f"nodename={node}", "state=resume")
