"""The kit on a real Slurm cluster: sbatch scripts, submitit jobs, sweeps, status/cancel/logs.

The session's test cluster has two nodes of 4 fake GPUs each (no CUDA: DDP runs over gloo).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from kit import REPO, SMALL, TINY_GPT, kit, later_wins, records, run_folder
from paced import LASTING
from slurm_cluster import SlurmCluster, wait_job
from test_distenv import random_hostlists

from slurm_ddp_kit.core import runfolder
from slurm_ddp_kit.train.distenv import port_for_job

pytestmark = pytest.mark.slurm

# One CPU per task: a test node has the machine's CPUs (2 here) to bind tasks to. What these jobs
# check is Slurm's side (scripts, tasks, GPUs, arrays), so half of kit.SMALL's samples: one
# step of the default global batch an epoch.
# SMALL at half its training split (a setting is given once: the kit refuses a repeat).
SBATCH_SMALL = [*later_wins([*SMALL, "data.train_size=512"]), "train.checkpoint=false"]
SUBMIT_DDP = [
    "launch",
    "submit",
    "--mode",
    "ddp",
    "cluster.backend=slurm",
    "cluster.gpus_per_node=2",
    "cluster.cpus_per_task=1",
]


def _sbatch(cluster: SlurmCluster, tmp: Path, *args: str) -> tuple[str, str, str]:
    """Submit and wait; returns (job id, its final state in accounting, the job's output)."""
    done = cluster.run(
        "sbatch",
        "--parsable",
        "--wait",
        "--cpus-per-task=1",
        f"--output={tmp}/slurm-%j.out",
        *args,
        timeout=300,
    )
    job_id = done.stdout.strip().split(";")[0]
    assert job_id, done.stderr
    return job_id, cluster.wait_job(job_id), (tmp / f"slurm-{job_id}.out").read_text()


def _wait_for_empty_queue(cluster: SlurmCluster) -> None:
    """Jobs of earlier tests may still be ending (their processes exit after the result is
    written, holding their GPUs until then)."""
    deadline = time.monotonic() + 120
    while cluster.run("squeue", "-h").stdout.strip():
        assert time.monotonic() < deadline, "earlier tests' jobs still queued after 120 s"
        time.sleep(0.5)


# Submitted from inside another job (salloc, an interactive step): its variables are in the
# launcher's environment, and sbatch would pass them on to the new job.
INSIDE_AN_ALLOCATION = {
    "SLURM_JOB_ID": "999999",
    "SLURM_MEM_PER_CPU": "100",
    "SLURM_CPUS_PER_TASK": "1",
    "SLURM_NTASKS": "7",
    "RANK": "5",
    "MASTER_ADDR": "elsewhere",
}


def _kit_env(tmp: Path) -> list[str]:
    return [f"output.root={tmp}/runs", f"data.root={tmp}/data"]


@pytest.fixture(autouse=True)
def _python_for_scripts(monkeypatch: pytest.MonkeyPatch) -> None:
    """sbatch passes the environment on: the scripts run this interpreter, which has the kit."""
    monkeypatch.setenv("KIT_PYTHON", sys.executable)
    monkeypatch.setenv("PYTHONPATH", str(REPO))


def test_ddp_sbatch_script_writes_a_run_folder(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    job_id, state, out = _sbatch(
        slurm_cluster,
        tmp_path,
        "--gpus-per-node=a100:2",  # the cluster's GPUs are typed: asked for by type
        "--ntasks-per-node=2",
        str(REPO / "slurm/ddp.sbatch"),
        *SBATCH_SMALL,
        *_kit_env(tmp_path),
    )
    assert state == "COMPLETED", out
    assert "gres/gpu:a100=2" in _allocated(slurm_cluster, job_id)
    run_dir = Path(out.split("run folder: ")[1].split()[0])
    meta = json.loads((run_dir / "run.json").read_text())
    assert (meta["launcher"], meta["backend"], meta["job_id"]) == ("sbatch", "slurm", job_id)
    starts = [records(run_dir, rank)[0] for rank in range(2)]
    assert [(s["source"], s["rank"], s["local_rank"], s["world_size"]) for s in starts] == [
        ("slurm", 0, 0, 2),
        ("slurm", 1, 1, 2),
    ]
    assert {s["master_port"] for s in starts} == {port_for_job(job_id)}
    _have_their_cpus(slurm_cluster, starts)
    assert (run_dir / "logs" / "rank-1.out").is_file()
    table = kit("analysis", "summarize", str(run_dir))
    assert table.returncode == 0 and "| runs | 0 | 1 |" in table.stdout


def _have_their_cpus(cluster: SlurmCluster, starts: list[dict[str, Any]]) -> None:
    """Each rank had the one CPU per task its job asked for (srun was told it), its own where
    the cluster binds tasks, and nothing was said of it."""
    assert [(s["cpus_asked"], s["cpus_usable"], s["placement"]) for s in starts] == [
        (1, 1, None)
    ] * len(starts)
    if cluster.binding == "cgroup":
        assert len({s["cpus"] for s in starts}) == len(starts), starts


def test_a_job_cancelled_after_its_run_finished_reads_completed(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """A batch script that goes on after the kit's run (a user's own post-processing) and is
    cancelled then: Slurm says CANCELLED, but every rank finished, so `status` says COMPLETED, as
    `resume` (nothing to resume) and `summarize` (it counts the run) do."""
    script = shlex.join(
        ["bash", str(REPO / "slurm/ddp.sbatch"), *SBATCH_SMALL, *_kit_env(tmp_path)]
    )
    done = slurm_cluster.run(
        "sbatch", "--parsable", "--cpus-per-task=1", "--ntasks-per-node=2", "--gpus-per-node=2",
        f"--output={tmp_path}/slurm-%j.out", "--wrap", f"{script}; sleep 600",
    )  # fmt: skip
    job_id = done.stdout.strip().split(";")[0]
    assert job_id, done.stderr
    finished = lambda: [  # noqa: E731
        r for r in runfolder.find_runs(tmp_path / "runs")
        if runfolder.of_kind(runfolder.read_rank(r, 0), "summary")
    ]  # fmt: skip
    deadline = time.monotonic() + 300
    while not finished():
        assert time.monotonic() < deadline, (tmp_path / f"slurm-{job_id}.out").read_text()
        time.sleep(0.5)
    assert slurm_cluster.run("scancel", job_id).returncode == 0
    assert slurm_cluster.wait_job(job_id) == "CANCELLED"
    (run_dir,) = finished()
    assert f" {job_id}  COMPLETED " in kit("launch", "status", str(run_dir)).stdout
    resumed = kit("launch", "resume", str(run_dir))
    assert resumed.returncode == 2 and "has finished: there is nothing to resume" in resumed.stderr


@pytest.mark.parametrize(
    "strategy",
    [
        pytest.param([], id="ddp"),
        pytest.param(["--mode", "zero", "dist.comm_hook=bf16", *TINY_GPT], id="zero-gpt"),
    ],
)
def test_two_node_ddp_trains_in_step(
    slurm_cluster: SlurmCluster, tmp_path: Path, strategy: list[str]
) -> None:
    """The one-process-per-GPU script runs DDP, or any strategy built on it (`--mode zero`, here
    with the token workload)."""
    _, state, out = _sbatch(
        slurm_cluster,
        tmp_path,
        "--nodes=2",
        "--ntasks-per-node=2",
        "--gpus-per-node=2",
        str(REPO / "slurm/ddp.sbatch"),
        *SBATCH_SMALL,
        *_kit_env(tmp_path),
        *strategy,
    )
    assert state == "COMPLETED", out
    run_dir = Path(out.split("run folder: ")[1].split()[0])
    per_rank = [records(run_dir, rank) for rank in range(4)]
    starts = [r[0] for r in per_rank]
    assert [(s["rank"], s["local_rank"], s["node_rank"]) for s in starts] == [
        (0, 0, 0),
        (1, 1, 0),
        (2, 0, 1),
        (3, 1, 1),
    ]
    first, second = slurm_cluster.node_names
    assert [s["node"] for s in starts] == [first, first, second, second]
    assert {s["master_addr"] for s in starts} == {first}
    assert len({r[-1]["parameters_sha256"] for r in per_rank}) == 1  # all four replicas identical
    assert "nodes: 2" in (run_dir / "config.yaml").read_text()
    assert {s["mode"] for s in starts} == {"zero" if strategy else "ddp"}


def test_dp_sbatch_script_and_its_refusal_of_two_nodes(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    _, state, out = _sbatch(
        slurm_cluster, tmp_path, str(REPO / "slurm/dp.sbatch"), *SBATCH_SMALL, *_kit_env(tmp_path)
    )
    assert state == "COMPLETED", out
    start = records(Path(out.split("run folder: ")[1].split()[0]))[0]
    assert (start["mode"], start["world_size"], start["cuda_visible_devices"]) == (
        "dp",
        1,
        "0,1,2,3",
    )
    _, state, out = _sbatch(
        slurm_cluster, tmp_path, "--nodes=2", str(REPO / "slurm/dp.sbatch"), *_kit_env(tmp_path)
    )
    assert state == "FAILED", out
    assert "DataParallel runs in one process on one node" in out and "slurm/ddp.sbatch" in out


def test_batch_script_without_srun_is_caught(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    prepared = kit(
        "launch", "prepare", "--mode", "ddp", "cluster.gpus_per_node=2", *SMALL, *_kit_env(tmp_path)
    )
    assert prepared.returncode == 0, prepared.stderr
    _, state, out = _sbatch(
        slurm_cluster,
        tmp_path,
        "--ntasks=2",
        "--wrap",
        f"{sys.executable} -m train run {prepared.stdout.strip()}",
    )
    assert state == "FAILED", out
    assert "without srun" in out and "srun python -m train run RUN_DIR" in out


@pytest.mark.parametrize(
    "strategy",
    [
        pytest.param(["zero", "dist.comm_hook=powersgd"], id="zero"),
        pytest.param(["fsdp", *TINY_GPT], id="fsdp-gpt"),
    ],
)
def test_submitit_runs_sharded_strategies_on_two_nodes(
    slurm_cluster: SlurmCluster, tmp_path: Path, strategy: list[str]
) -> None:
    """The submit path takes every strategy: ZeRO with PowerSGD, FSDP (on the token workload,
    sharded block by block), over 2 nodes × 2 tasks."""
    args = [a for a in SUBMIT_DDP if a != "ddp"]
    done = kit(
        *args[:3], *strategy, *args[3:], "--nodes", "2", *SBATCH_SMALL, *_kit_env(tmp_path),
        "--wait",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    run_dir = run_folder(done.stdout)
    per_rank = [records(run_dir, rank) for rank in range(4)]
    assert {(r[0]["mode"], r[0]["world_size"]) for r in per_rank} == {(strategy[0], 4)}
    assert len({r[-1]["parameters_sha256"] for r in per_rank}) == 1
    job_id = json.loads((run_dir / "run.json").read_text())["job_id"]
    assert wait_job(job_id, env=slurm_cluster.env) == "COMPLETED"


def _allocated(cluster: SlurmCluster, job_id: str) -> str:
    """What accounting says the job was given (TRES: cpu, mem, gres/gpu, gres/gpu:TYPE, …)."""
    return cluster.run("sacct", "-X", "-n", "-j", job_id, "-o", "AllocTRES%200").stdout


@pytest.mark.parametrize(
    ("binding", "typed", "seen"),
    [
        ("node", [], {"cgroup": ["0,1", "0,1"], "none": ["0,1", "0,1"]}),
        ("task", ["cluster.gpu_type=a100"], {"cgroup": ["0", "0"], "none": ["0", "1"]}),
    ],
)
def test_submitit_ddp_binds_gpus(
    slurm_cluster: SlurmCluster,
    tmp_path: Path,
    binding: str,
    typed: list[str],
    seen: dict[str, list[str]],
) -> None:
    """Each binding, on a cluster whose GPUs are typed (a100): asked for without a type, and
    with one (--gpus-per-task=a100:1). Bound to its GPU by a device cgroup (ConstrainDevices, as
    on production clusters) a task sees it as 0; where nothing binds, by its index."""
    _wait_for_empty_queue(slurm_cluster)  # which GPUs a job gets depends on the free ones
    done = kit(
        *SUBMIT_DDP,
        f"cluster.gpu_binding={binding}",
        *typed,
        "cluster.mem_gb=1",
        *SBATCH_SMALL,
        *_kit_env(tmp_path),
        "--wait",
        env=INSIDE_AN_ALLOCATION,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    run_dir = run_folder(done.stdout)
    starts = [records(run_dir, rank)[0] for rank in range(2)]
    assert [s["cuda_visible_devices"] for s in starts] == seen[slurm_cluster.binding]
    assert {s["source"] for s in starts} == {"submitit"}
    _have_their_cpus(slurm_cluster, starts)
    job_id = json.loads((run_dir / "run.json").read_text())["job_id"]
    assert wait_job(job_id, env=slurm_cluster.env) == "COMPLETED"  # sacct lags a little
    status = kit("launch", "status", str(run_dir))
    assert " COMPLETED " in status.stdout and " 2/2" in status.stdout
    assert "gres/gpu:a100=2" in _allocated(slurm_cluster, job_id)


def test_status_cancel_and_logs(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """A 2-node job cancelled mid-epoch: every rank gone within seconds, nothing written after."""
    done = kit(
        *SUBMIT_DDP,
        "--nodes",
        "2",
        *LASTING,
        "train.epochs=500",
        *_kit_env(tmp_path),
    )
    assert done.returncode == 0, done.stderr
    run_dir = run_folder(done.stdout)
    deadline = time.monotonic() + 180
    while not _epochs_done(run_dir) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _epochs_done(run_dir), "no epoch within 180 s"
    status = kit("launch", "status", "--root", f"{tmp_path}/runs")
    assert status.stdout.splitlines()[0].split() == [
        "RUN",
        "MODE",
        "BACKEND",
        "JOB",
        "STATE",
        "NODES",
        "ELAPSED",
        "EPOCH",
    ]
    running = next(line for line in status.stdout.splitlines() if " RUNNING " in line)
    assert re.search(r" \d\d:\d\d:\d\d ", running), running  # squeue's 0:35 as sacct's 00:00:35
    logs = kit("launch", "logs", str(run_dir), "--rank", "1")
    assert (
        logs.returncode == 0 and "_1_log.out <==" in logs.stdout and "global_rank=1" in logs.stdout
    )
    job_id = json.loads((run_dir / "run.json").read_text())["job_id"]
    _held_jobs_are_not_resumed(slurm_cluster, run_dir, job_id)
    cancelled = kit("launch", "cancel", str(run_dir))
    assert cancelled.returncode == 0 and "cancelled Slurm job" in cancelled.stdout
    assert wait_job(job_id, env=slurm_cluster.env) == "CANCELLED"
    written = _kit_files(run_dir)
    status = kit("launch", "status", str(run_dir)).stdout
    assert " CANCELLED " in status, status
    assert len(status.splitlines()) == 2, status  # the user's cancel is no rank's failure
    deadline = time.monotonic() + 15
    while _tasks_of(run_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _tasks_of(run_dir), "ranks still running after the cancel"
    assert _kit_files(run_dir) == written  # nothing written after CANCELLED
    again = kit("launch", "cancel", str(run_dir))
    assert f"Slurm job {job_id} had already ended" in again.stdout, again.stdout + again.stderr
    assert " CANCELLED " in kit("launch", "status", str(run_dir)).stdout


def _held_jobs_are_not_resumed(cluster: SlurmCluster, run_dir: Path, job_id: str) -> None:
    """A job suspended (gang scheduling, an admin) or SIGSTOPped in place still holds its nodes
    and goes on when Slurm resumes it: `resume` must not start a second job into its folder.
    Slurm's own STOPPED reads SIGSTOPPED, not the kit's STOPPED (saved, for `launch resume`)."""
    for hold, word, release in (
        (["scontrol", "suspend", job_id], "SUSPENDED", ["scontrol", "resume", job_id]),
        (["scancel", "--signal=STOP", job_id], "SIGSTOPPED", ["scancel", "--signal=CONT", job_id]),
    ):
        assert cluster.run(*hold).returncode == 0
        deadline = time.monotonic() + 30
        while f" {word} " not in (status := kit("launch", "status", str(run_dir)).stdout):
            assert time.monotonic() < deadline, status
            time.sleep(0.5)
        resumed = kit("launch", "resume", str(run_dir))
        assert resumed.returncode == 2, resumed.stdout + resumed.stderr
        assert f"is {word} as job {job_id}: one job at a time writes a run folder" in resumed.stderr
        assert runfolder.read_meta(run_dir)["jobs"] == [job_id]
        assert cluster.run(*release).returncode == 0


def _epochs_done(run_dir: Path) -> bool:
    path = run_dir / "metrics" / "rank-00000.jsonl"
    return path.is_file() and '"kind": "epoch"' in path.read_text()


def _kit_files(run_dir: Path) -> dict[str, tuple[int, int]]:
    """Size and change time of every file the kit writes (Slurm's own log lines left out)."""
    files = [p for p in run_dir.rglob("*") if p.is_file() and "logs" not in p.parts]
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in files}


def _tasks_of(run_dir: Path) -> list[str]:
    """Processes whose command line names this run's folder: its ranks."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(run_dir) in cmdline.read_bytes().decode(errors="replace"):
                found.append(cmdline.parent.name)
        except OSError:
            continue
    return found


def test_two_ddp_jobs_share_a_node(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    args = [
        *SUBMIT_DDP,
        f"cluster.sbatch_extra.nodelist={slurm_cluster.node_names[1]}",
        *SBATCH_SMALL,
        *_kit_env(tmp_path),
        "--wait",
    ]
    jobs = [
        subprocess.Popen(
            [sys.executable, "-m", *args],
            cwd=REPO,
            stdout=subprocess.PIPE,
            text=True,
            env=os.environ,
        )
        for _ in range(2)
    ]
    outs = [job.communicate(timeout=300)[0] for job in jobs]
    assert [job.returncode for job in jobs] == [0, 0], outs
    starts = [records(run_folder(out))[0] for out in outs]
    assert {s["node"] for s in starts} == {slurm_cluster.node_names[1]}
    assert starts[0]["master_port"] != starts[1]["master_port"]
    first, second = (records(run_folder(out))[-1] for out in outs)
    assert (
        first["time"] - first["total_seconds"] < second["time"]
        and second["time"] - second["total_seconds"] < first["time"]
    )


def test_sweep_is_one_array_that_analysis_compares(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    done = kit(
        "launch",
        "sweep",
        "--modes",
        "dp,ddp",
        "--grid",
        "train.global_batch_size=256,512",
        "cluster.backend=slurm",
        "cluster.gpus_per_node=1",
        "cluster.cpus_per_task=1",
        *SBATCH_SMALL,
        *_kit_env(tmp_path),
    )
    assert done.returncode == 0, done.stderr
    job_ids = [line.split()[2] for line in done.stdout.splitlines()]
    assert len(job_ids) == 4 and len({j.split("_")[0] for j in job_ids}) == 1  # one array
    assert [wait_job(j, timeout=300, env=slurm_cluster.env) for j in job_ids] == ["COMPLETED"] * 4
    status = kit("launch", "status", "--root", f"{tmp_path}/runs").stdout.splitlines()[1:]
    assert sorted(line.split()[3] for line in status) == sorted(job_ids)  # array element ids
    assert all(line.split()[4] == "COMPLETED" for line in status), status
    table = kit("analysis", "summarize", "--root", f"{tmp_path}/runs")
    assert table.returncode == 0, table.stderr
    assert (
        table.stdout.count("| runs | 1 | 1 |") == 2
    )  # two groups (batch 256 and 512), DP beside DDP
    assert "global batch 256" in table.stdout and "global batch 512" in table.stdout


def test_a_sweep_past_max_array_size_is_split_and_reads_cancelled_from_one_query(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """Eight points against the test cluster's MaxArraySize=6: two arrays (6 and 2), every
    element's own index below the limit. Not started yet (--begin in an hour), cancelled with a
    plain scancel of each array: once the queue has forgotten them (MinJobAge), accounting holds
    one record per array (`J_[0-5]`), no row per element; each run still reads CANCELLED.
    `status` asks once for all runs: one squeue and one sacct call (`-v` lists them)."""
    values = ",".join(f"0.0{n}" for n in range(1, 9))
    done = kit(
        "launch", "sweep", "--modes", "ddp", "--grid", f"train.lr={values}",
        "cluster.backend=slurm", "cluster.gpus_per_node=1", "cluster.cpus_per_task=1",
        "cluster.sbatch_extra.begin=now+3600", *SBATCH_SMALL, *_kit_env(tmp_path),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    jobs = [line.split()[2] for line in done.stdout.splitlines()]
    arrays = list(dict.fromkeys(job.split("_")[0] for job in jobs))
    assert [job.split("_")[1] for job in jobs] == [*map(str, range(6)), "0", "1"], jobs
    assert len(arrays) == 2
    assert slurm_cluster.run("scancel", *arrays).returncode == 0
    deadline = time.monotonic() + 60
    while slurm_cluster.run("squeue", "-h", "-j", ",".join(arrays)).stdout.strip():
        assert time.monotonic() < deadline, "the cancelled arrays stayed in the queue"
        time.sleep(1)
    status = kit("launch", "status", "--root", f"{tmp_path}/runs", "-v")
    rows = status.stdout.splitlines()[1:]
    assert [row.split()[4] for row in rows] == ["CANCELLED"] * 8, status.stdout
    calls = re.findall(r"slurm: (squeue|sacct) -", status.stderr)
    assert sorted(calls) == ["sacct", "squeue"], status.stderr


def test_a_sweep_slurm_refuses_leaves_nothing(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """sbatch refuses the array (a partition the cluster has not): one line with Slurm's words,
    exit 2, and no run folder, pickle or script left behind."""
    done = kit(
        "launch", "sweep", "--modes", "ddp", "--grid", "train.lr=0.01,0.02",
        "cluster.backend=slurm", "cluster.gpus_per_node=1", "cluster.partition=nosuch",
        *SBATCH_SMALL, *_kit_env(tmp_path),
    )  # fmt: skip
    assert done.returncode == 2 and done.stdout == "", done.stdout + done.stderr
    (line,) = done.stderr.splitlines()
    assert (
        line.startswith("error: Slurm refused the sweep's array of 2 runs: ")
        and "partition" in line
    )
    left = [p for p in (tmp_path / "runs").rglob("*") if p.is_file() or p.name[:1].isdigit()]
    assert left == [], left  # no file, no run folder


def test_dry_run_prints_the_script_and_submits_nothing(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    _wait_for_empty_queue(slurm_cluster)  # so an empty queue after the dry run means something
    done = kit(
        "launch",
        "submit",
        "--dry-run",
        "--mode",
        "ddp",
        "--nodes",
        "2",
        "cluster.backend=slurm",
        "cluster.partition=debug",
        "cluster.account=proj",
        "cluster.mem_gb=16",
        "cluster.exclusive=true",
        'cluster.setup=["module load cuda"]',
        *_kit_env(tmp_path),
    )
    assert done.returncode == 0, done.stderr
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=4",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --partition=debug",
        "#SBATCH --account=proj",
        "#SBATCH --mem=16GB",
        "#SBATCH --exclusive",
        "module load cuda",
        "--kill-on-bad-exit=1",
    ):
        assert line in done.stdout, line
    assert not (tmp_path / "runs").exists()
    assert slurm_cluster.run("squeue", "-h").stdout.strip() == ""


# Asking for 5 GPUs a node (each node has 4) is refused at submission as a type it has not is
# (test_testcluster: test_five_gpus_on_one_node_is_rejected_at_submission), but not through the
# kit here: its 5 ranks need 5 CPUs a node, more than the whole partition has when nodes have the
# machine's 2 (bound), and Slurm holds such a job (PartitionConfig) rather than refuse it.
@pytest.mark.parametrize(
    ("asked", "slurm_says"),
    [
        (
            ["cluster.gpu_type=h100", "cluster.gpus_per_node=2", "cluster.cpus_per_task=1"],
            "Requested node configuration is not available",
        ),
    ],
    ids=["a type it has not"],
)
def test_more_gpus_than_a_node_has_is_refused(
    slurm_cluster: SlurmCluster, tmp_path: Path, asked: list[str], slurm_says: str
) -> None:
    done = kit(
        "launch",
        "submit",
        "--mode",
        "ddp",
        "cluster.backend=slurm",
        *asked,
        "train.global_batch_size=500",
        *_kit_env(tmp_path),
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert (
        "Slurm refused the job" in done.stderr
        and slurm_says in done.stderr
        and "gpus_per_node" in done.stderr
        and "sinfo" in done.stderr
    ), done.stderr
    assert not (tmp_path / "runs").exists()  # the run folder and the root made for it are gone


def test_dry_run_shows_the_script_that_submit_submits(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """Byte for byte, once the run folder's name (chosen at submission) is the same."""
    args = [*SUBMIT_DDP, *SBATCH_SMALL, *_kit_env(tmp_path), "output.name=diff"]
    dry = kit(*args, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    planned = dry.stdout.splitlines()[0].rsplit(" ", 1)[1]  # "run folder (…): PATH"
    script = dry.stdout[dry.stdout.index("#!/bin/bash") :]
    done = kit(*args)
    assert done.returncode == 0, done.stderr
    run_dir = run_folder(done.stdout)
    job_id = done.stdout.split()[2]
    submitted = (run_dir / "logs" / f"{job_id}_submission.sh").read_text()
    assert script.replace(Path(planned).name, run_dir.name) == submitted
    assert slurm_cluster.wait_job(job_id) == "COMPLETED"


def test_wait_says_why_a_job_that_cannot_start_waits(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """Three nodes on a two-node cluster: Slurm queues the job for ever. --wait says so (and
    Ctrl-C leaves it queued); status shows no nodes; cancel ends it."""
    # 3 ranks of one CPU: a job of more CPUs than the whole partition has (2 nodes of 2 bound
    # CPUs here) waits for PartitionConfig before the node count is looked at.
    batch = "train.global_batch_size=510"
    args = [*SUBMIT_DDP, "cluster.gpus_per_node=1", "--nodes", "3", batch, *_kit_env(tmp_path),
            "--wait"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    with subprocess.Popen(
        [sys.executable, "-m", *later_wins(args)],
        cwd=REPO,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as a terminal would
    ) as waiting:
        assert waiting.stdout is not None
        silent = threading.Timer(60, waiting.send_signal, [signal.SIGINT])  # no fourth line
        silent.start()
        lines = [waiting.stdout.readline() for _ in range(4)]  # job, run folder, code, pending
        silent.cancel()
        waiting.send_signal(signal.SIGINT)
        assert waiting.wait(timeout=30) == 130
    run_dir = run_folder("".join(lines))
    assert lines[2].startswith(f"code: the copy made at submission ({run_dir}/code: "), lines
    pending = lines[3]
    assert "pending: PartitionNodeLimit: it will not start as asked" in pending, lines
    assert f"python -m launch cancel {run_dir}" in pending
    status = kit("launch", "status", str(run_dir)).stdout.splitlines()[1].split()
    assert status[4:6] == ["PENDING", "-"], status
    assert kit("launch", "cancel", str(run_dir)).returncode == 0


HOSTLISTS = [
    "node[003-004,010],gpu1", "rack[1-2]-node[01-04]", "10.0.[1-2].[5-6]", "n[1-2][3-4]",
    "nid[00098-00101]", "gpu-a100-[001-003,010]", "c1001a-s[11-12],c1002a-s[01-02]",
    "node[8-10]", "a b,c", "single",
]  # fmt: skip


def test_the_hostlist_reader_expands_as_slurm_does(slurm_cluster: SlurmCluster) -> None:
    """Slurm's whole grammar (several brackets per name, zero padding, commas and spaces),
    checked against `scontrol show hostnames`, on lists written by hand and made at random; the first host is the one MASTER_ADDR names."""
    from slurm_ddp_kit.core.slurmtext import first_host, hostnames

    for nodelist in HOSTLISTS + random_hostlists(20, slurm_accepts=True):
        shown = slurm_cluster.run("scontrol", "show", "hostnames", nodelist)
        assert shown.returncode == 0, shown.stderr
        assert hostnames(nodelist) == shown.stdout.split(), nodelist
        assert first_host(nodelist) == shown.stdout.split()[0]
