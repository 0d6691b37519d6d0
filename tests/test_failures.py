"""A rank that fails is named: the first rank that failed, its host and its error, in `--wait`,
in `status` and by default in `logs`, not the peer that lost its connection to it."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import sys
import time
from functools import partial
from pathlib import Path

import pytest
from kit import REPO, SMALL, kit, kit_started, run_folder, wait_for
from paced import LASTING
from slurm_cluster import SlurmCluster

from slurm_ddp_kit.core import runfolder

PACED_WORK = [*LASTING, "train.epochs=50"]

# Loaded by every Python process started with it on PYTHONPATH: rank 1 of a job raises in its
# first epoch, as a bug in one rank's code would.
HOOK = """
import os
if os.environ.get("SUBMITIT_LOCAL_GLOBALID") == os.environ.get("KIT_TEST_FAILING_RANK"):
    import slurm_ddp_kit.train.loop as loop

    def _fail(*args, **kwargs):
        raise RuntimeError("injected failure in this rank")

    loop._train_epoch = _fail
"""


def test_the_rank_that_raised_is_named_and_the_run_resumes(tmp_path: Path) -> None:
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HOOK)
    env = {"PYTHONPATH": f"{hook}:{REPO}", "KIT_TEST_FAILING_RANK": "1"}
    args = ["--mode", "ddp", "cluster.backend=local", "cluster.gpus_per_node=2", *SMALL]
    where = [f"output.root={tmp_path}/runs", f"data.root={tmp_path}/data", "dist.timeout_s=30"]
    done = kit("launch", "submit", *args, *where, "--wait", env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    run_dir = run_folder(done.stdout)
    assert "failed: rank 1 on " in done.stdout and "injected failure in this rank" in done.stdout
    status = kit("launch", "status", str(run_dir)).stdout
    assert " FAILED " in status
    assert f"{run_dir.name}: rank 1 on " in status and "injected failure" in status
    logs = kit("launch", "logs", str(run_dir))
    assert logs.returncode == 0 and "_1_log.err <==" in logs.stdout
    assert "injected failure in this rank" in logs.stdout
    beyond = kit("launch", "logs", str(run_dir), "--rank", "7")
    assert beyond.returncode == 2 and f"{run_dir.name} has rank(s) 0–1: pick one" in beyond.stderr
    cancelled = kit("launch", "cancel", str(run_dir))
    assert cancelled.returncode == 0 and "had already ended" in cancelled.stdout
    assert " FAILED " in kit("launch", "status", str(run_dir)).stdout  # not CANCELLED

    resumed = kit("launch", "resume", str(run_dir), "--wait")  # the bug fixed: no hook now
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert " COMPLETED " in kit("launch", "status", str(run_dir)).stdout


@pytest.mark.parametrize("killed", [1, 0])
def test_a_rank_killed_while_it_starts_is_named_at_once(tmp_path: Path, killed: int) -> None:
    """A rank dies by SIGKILL in its interpreter's start, before it could write a word: the rank
    that waits for it (rank 0 for its peers, the others for rank 0's store) names it at once
    (locally; under Slurm, srun names such a task), not after dist.timeout_s (300 s here, the
    default) in words that blame the rank that waited."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os, signal\n"
        f"if os.environ.get('SUBMITIT_LOCAL_GLOBALID') == '{killed}':\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    env = {"PYTHONPATH": f"{hook}:{REPO}"}
    args = ["--mode", "ddp", "cluster.backend=local", "cluster.gpus_per_node=2", *SMALL]
    where = [f"output.root={tmp_path}/runs", f"data.root={tmp_path}/data", "dist.timeout_s=300"]
    began = time.monotonic()
    done = kit("launch", "submit", *args, *where, "--wait", env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert time.monotonic() - began < 150  # not the 300 s of the rendezvous timeout
    run_dir = run_folder(done.stdout)
    said = f"failed: rank {killed} on {socket.gethostname()} failed first: ended while starting"
    assert said in done.stdout, done.stdout
    status = kit("launch", "status", str(run_dir)).stdout
    assert " FAILED " in status and f"{run_dir.name}: rank {killed} on " in status, status
    assert list(runfolder.logs_dir(run_dir).glob("store-*")) == []  # its port is forgotten


@pytest.mark.parametrize("backend", ["local", pytest.param("slurm", marks=pytest.mark.slurm)])
def test_a_stalled_rank_ends_the_job_in_time_and_is_named(tmp_path: Path, backend: str) -> None:
    """A rank stopped dead (SIGSTOP): the others give up after dist.timeout_s, the job ends
    FAILED soon after (on Slurm through `srun --kill-on-bad-exit`), and status names the rank
    that stopped answering."""
    # One CPU a rank: a test node has only the machine's CPUs (2 here) to bind ranks to.
    args = ["--mode", "ddp", f"cluster.backend={backend}", "cluster.gpus_per_node=2",
            "cluster.cpus_per_task=1"]  # fmt: skip
    work = [*PACED_WORK, "dist.timeout_s=10"]
    where = [f"output.root={tmp_path}/runs", f"data.root={tmp_path}/data"]
    done = kit("launch", "submit", *args, *work, *where)
    assert done.returncode == 0, done.stderr
    run_dir = run_folder(done.stdout)
    deadline = time.monotonic() + 180
    while not runfolder.of_kind(runfolder.read_rank(run_dir, 0), "epoch"):
        assert time.monotonic() < deadline, "no epoch within 180 s"
        time.sleep(0.3)
    stalled = runfolder.of_kind(runfolder.read_rank(run_dir, 1), "start")[-1]["pid"]
    os.kill(stalled, signal.SIGSTOP)  # the test cluster's nodes run on this machine
    stopped_at = time.monotonic()
    try:
        while re.search(r" (RUNNING|COMPLETING) ", kit("launch", "status", str(run_dir)).stdout):
            assert time.monotonic() - stopped_at < 60, "still running a minute after the stall"
            time.sleep(1)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(stalled, signal.SIGKILL)
    status = kit("launch", "status", str(run_dir)).stdout
    assert " FAILED " in status and f"{run_dir.name}: rank 1 on " in status, status
    assert "stopped answering" in status


def test_a_taken_port_fails_a_local_job_at_once_and_names_the_fix(tmp_path: Path) -> None:
    """Another program listens on the job's port: rank 0 cannot serve the store there and says
    so; rank 1, connected to a listener that never answers, is ended with it (as `srun
    --kill-on-bad-exit` ends a Slurm job's), not left to wait out dist.timeout_s."""
    with socket.create_server(("", 0)) as taken:
        port = taken.getsockname()[1]
        args = ["--mode", "ddp", "cluster.backend=local", "cluster.gpus_per_node=2", *SMALL]
        where = [f"output.root={tmp_path}/runs", f"data.root={tmp_path}/data"]
        done = kit(
            "launch", "submit", *args, *where, f"dist.port={port}", "dist.timeout_s=3600",
            "--wait", timeout=240,
        )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert (
        f"rank 0 on {socket.gethostname()} failed first: DistEnvError: port {port}" in done.stdout
    )
    assert "set dist.port to a free port" in done.stdout
    assert "Traceback" not in done.stdout


@pytest.mark.slurm
def test_a_rank_of_the_second_node_ended_by_a_signal_is_the_one_named(
    slurm_cluster: SlurmCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1, alone on the second node, aborted, killed, segfaulted or stopped dead, one job
    each (at once): the job ends FAILED in time and status names rank 1 on that node, not rank
    0, which srun ends for the job's sake. SIGABRT on the sbatch script's path, the others on
    `launch submit`'s."""
    monkeypatch.setenv("KIT_PYTHON", sys.executable)
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    work = [*PACED_WORK, "dist.timeout_s=10"]
    runs: dict[signal.Signals, Path] = {}
    for signum in (signal.SIGKILL, signal.SIGSEGV, signal.SIGSTOP):
        where = [f"output.root={tmp_path}/{signum.name}", f"data.root={tmp_path}/data"]
        done = kit(
            "launch", "submit", "--mode", "ddp", "--nodes", "2", "cluster.backend=slurm",
            "cluster.gpus_per_node=1", "cluster.cpus_per_task=1", *work, *where,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        runs[signum] = run_folder(done.stdout)
    sbatch = slurm_cluster.run(
        "sbatch", "--parsable", "--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=1",
        "--cpus-per-task=1", f"--output={tmp_path}/slurm-%j.out", str(REPO / "slurm/ddp.sbatch"),
        *work, f"output.root={tmp_path}/SIGABRT", f"data.root={tmp_path}/data",
    )  # fmt: skip
    assert sbatch.returncode == 0, sbatch.stderr
    assert wait_for(lambda: bool(runfolder.find_runs(tmp_path / "SIGABRT")), 120), "no run folder"
    runs[signal.SIGABRT] = runfolder.find_runs(tmp_path / "SIGABRT")[0]
    for signum, run_dir in runs.items():
        assert wait_for(partial(_trained, run_dir), 300), f"{signum.name}: no first epoch"
        start = runfolder.of_kind(runfolder.read_rank(run_dir, 1), "start")[-1]
        assert start["node"] == slurm_cluster.node_names[1]  # the second node
        os.kill(start["pid"], signum)
    no_sacct = _without_accounting(tmp_path / "bin")
    words = {
        signal.SIGABRT: "aborted",
        signal.SIGKILL: "killed",
        signal.SIGSEGV: "segmentation fault",
        signal.SIGSTOP: "stopped answering",
    }
    try:
        for signum, run_dir in runs.items():
            # `launch status` is a Python of its own: asked each second, not five times a second
            failed = wait_for(partial(_failed, run_dir), 120, every=1)
            assert failed, f"{signum.name}: not FAILED in 120 s"
            named = f"{run_dir.name}: rank 1 on {slurm_cluster.node_names[1]} failed first: "
            for path in (os.environ["PATH"], no_sacct):  # a cluster without accounting too
                status = kit("launch", "status", str(run_dir), env={"PATH": path}).stdout
                assert " FAILED " in status, (signum, path, status)
                assert named in status and words[signum] in status, (signum, path, status)
    finally:
        for run_dir in runs.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(runfolder.of_kind(runfolder.read_rank(run_dir, 1), "start")[-1]["pid"], 9)


@pytest.mark.slurm
def test_wait_without_accounting_ends_with_a_job_that_leaves_no_results(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """Where sacct cannot answer (no accounting, slurmdbd down), submitit never sees the end of a
    job whose tasks wrote no result: `--wait` reads it from the queue and the run folder. One job
    ended by `launch cancel` (130, cancelled), one by scancel (its ranks saved: stopped)."""
    no_sacct = {"PATH": _accounting_down(tmp_path / "bin")}  # the job's own processes too
    followers, runs = {}, {}
    for how in ("cancel", "scancel"):
        followers[how] = kit_started(
            "launch", "submit", "--mode", "ddp", "cluster.backend=slurm", "cluster.gpus_per_node=2",
            "cluster.cpus_per_task=1", *PACED_WORK, f"output.root={tmp_path}/{how}",
            f"data.root={tmp_path}/data", "--wait", env=no_sacct,
        )  # fmt: skip
        assert wait_for(lambda how=how: bool(runfolder.find_runs(tmp_path / how)), 60), how
        runs[how] = runfolder.find_runs(tmp_path / how)[0]
    for how, run_dir in runs.items():
        assert wait_for(partial(_trained, run_dir), 300), f"{how}: no first epoch"
    assert kit("launch", "cancel", str(runs["cancel"])).returncode == 0
    job = runfolder.read_meta(runs["scancel"])["job_id"]
    assert slurm_cluster.run("scancel", job).returncode == 0
    said = {how: follower.communicate(timeout=90) for how, follower in followers.items()}
    assert followers["cancel"].returncode == 130, said["cancel"]
    assert "was cancelled; continue it" in said["cancel"][0], said["cancel"]
    assert followers["scancel"].returncode == 1, said["scancel"]
    assert f"job {job} stopped (SIGTERM (preemption, scancel" in said["scancel"][0], said


def _accounting_down(folder: Path) -> str:
    """A PATH whose `sacct` fails as it does while slurmdbd is down; the rest of PATH as is."""
    folder.mkdir()
    sacct = folder / "sacct"
    sacct.write_text(
        "#!/bin/sh\necho 'sacct: error: Problem talking to the database: Connection refused' >&2\n"
        "exit 1\n"
    )
    sacct.chmod(0o755)
    return f"{folder}{os.pathsep}{os.environ['PATH']}"


def _without_accounting(folder: Path) -> str:
    """A PATH whose Slurm has no accounting: every client command but `sacct`."""
    folder.mkdir()
    for command in ("squeue", "scontrol", "scancel", "sbatch", "sinfo"):
        if found := shutil.which(command):
            (folder / command).symlink_to(found)
    return str(folder)


def _trained(run_dir: Path) -> bool:
    return bool(runfolder.of_kind(runfolder.read_rank(run_dir, 0), "epoch"))


def _failed(run_dir: Path) -> bool:
    return " FAILED " in kit("launch", "status", str(run_dir)).stdout
