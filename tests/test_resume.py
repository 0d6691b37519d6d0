"""Jobs that survive: stopped by the time-limit signal (or preempted), saved, requeued or resumed,
ending with exactly the parameters of the same run uninterrupted (CPU, gloo)."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
from kit import REPO, kit, run_folder
from slurm_cluster import SlurmCluster, release_hold, wait_job_releasing_holds

from train import runfolder

# Under `make test` (pytest -n 2) the whole module runs in the Slurm tests' worker: its tests
# share one uninterrupted reference run.
pytestmark = pytest.mark.xdist_group("slurm")

# One thread per rank everywhere: the same arithmetic in every run, so the same parameters.
# Long enough (about 35 s of training on a quiet 2-core machine) that a 1-minute limit whose
# warning comes 30 s ahead always interrupts the first attempt.
WORK = ["data.train_size=3072", "data.test_size=256", "train.epochs=12", "cluster.cpus_per_task=1"]
DDP = ["--mode", "ddp", "cluster.gpus_per_node=2", *WORK]


def _final_hashes(run_dir: Path) -> set[str]:
    view = [runfolder.read_rank(run_dir, rank) for rank in (0, 1)]
    return {runfolder.of_kind(records, "summary")[-1]["parameters_sha256"] for records in view}


def _attempts(run_dir: Path) -> int:
    return runfolder.attempts(runfolder.read_records(runfolder.metrics_path(run_dir, 0))[0])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The parameters the run ends with when nothing stops it."""
    tmp = tmp_path_factory.mktemp("reference")
    done = kit(
        "launch", "submit", *DDP, "cluster.backend=local", f"output.root={tmp}/runs",
        f"data.root={tmp}/data", "--wait",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    (sha,) = _final_hashes(run_folder(done.stdout))
    return sha


def _wait_for(condition: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"waited {timeout} s for {what}"
        time.sleep(0.3)


def test_local_stop_cancel_and_resumes_end_as_if_never_stopped(
    tmp_path: Path, uninterrupted: str
) -> None:
    where = [f"output.root={tmp_path}/runs", f"data.root={tmp_path}/data"]
    done = kit("launch", "submit", *DDP, "cluster.backend=local", *where)
    assert done.returncode == 0, done.stderr
    run_dir = run_folder(done.stdout)
    epochs = lambda: runfolder.of_kind(runfolder.read_rank(run_dir, 0), "epoch")  # noqa: E731
    _wait_for(lambda: len(epochs()) >= 1, 180, "the first epoch")
    time.sleep(1.5)  # somewhere inside the second epoch
    starts = [runfolder.of_kind(runfolder.read_rank(run_dir, r), "start")[0] for r in (0, 1)]
    for start in starts:  # what Slurm sends before the time limit
        os.kill(start["pid"], signal.SIGUSR2)
    _wait_for(lambda: " STOPPED " in kit("launch", "status", str(run_dir)).stdout, 120, "STOPPED")
    stop = runfolder.of_kind(runfolder.read_rank(run_dir, 0), "stop")[-1]
    assert stop["reason"].startswith("time limit") and runfolder.state_path(run_dir).is_file()

    # Resumed, then cancelled in the middle of an epoch, then resumed again.
    raw = lambda: runfolder.read_records(runfolder.metrics_path(run_dir, 0))[0]  # noqa: E731
    assert kit("launch", "resume", str(run_dir)).returncode == 0
    _wait_for(lambda: [r["kind"] for r in raw()][-1] == "epoch" and _attempts(run_dir) == 2, 180,
              "an epoch of the second attempt")  # fmt: skip
    assert kit("launch", "cancel", str(run_dir)).returncode == 0
    _wait_for(lambda: " CANCELLED " in kit("launch", "status", str(run_dir)).stdout, 120, "CANCEL")
    resumed = kit("launch", "resume", str(run_dir), "--wait")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    shown = [
        line.split("/")[0] for line in resumed.stdout.splitlines() if line.startswith("epoch ")
    ]
    assert shown == [f"epoch {n}" for n in range(1, 13)]  # each epoch once
    assert _final_hashes(run_dir) == {uninterrupted}
    assert _attempts(run_dir) == 3  # the raw records keep every attempt
    split = [e for e in epochs() if e.get("resumed_at_batch")]
    assert all(e["seconds"] is None for e in split)  # no made-up time for a split epoch
    again = kit("launch", "resume", str(run_dir))
    assert again.returncode == 2 and "nothing to resume" in again.stderr


def _requeued_run_checks(run_dir: Path, uninterrupted: str) -> None:
    assert _final_hashes(run_dir) == {uninterrupted}
    assert _attempts(run_dir) >= 2
    epochs = runfolder.of_kind(runfolder.read_rank(run_dir, 0), "epoch")
    assert [e["epoch"] for e in epochs] == list(range(1, 13))


@pytest.mark.slurm
def test_submit_path_requeues_at_the_time_limit_and_resumes(
    slurm_cluster: SlurmCluster, tmp_path: Path, uninterrupted: str, preempted: Preempted
) -> None:
    """(`preempted` runs beside this test.)"""
    done = kit(
        "launch", "submit", *DDP, "cluster.backend=slurm", "cluster.timeout_min=1",
        "cluster.signal_delay_s=30", "cluster.max_requeues=20", f"output.root={tmp_path}/runs",
        f"data.root={tmp_path}/data",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    run_dir, job_id = run_folder(done.stdout), done.stdout.split()[2]
    state, released = wait_job_releasing_holds(job_id, 600, slurm_cluster.env)
    assert state == "COMPLETED" and released >= 1, (state, released)
    _requeued_run_checks(run_dir, uninterrupted)
    assert " COMPLETED " in kit("launch", "status", str(run_dir)).stdout
    rank0 = "".join(p.read_text() for p in runfolder.log_files(run_dir, 0))
    assert "Requeued job" in rank0  # by submitit's own checkpoint-and-requeue handler


@pytest.mark.slurm
def test_sbatch_path_saves_and_requeues_on_the_warning_signal(
    slurm_cluster: SlurmCluster, tmp_path: Path, uninterrupted: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch script's job, sent the warning signal by Slurm mid-run (as `--signal` does before
    the limit, or a preemption would), requeues, finds its run folder and finishes it."""
    monkeypatch.setenv("KIT_PYTHON", sys.executable)  # sbatch passes the environment on
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    done = slurm_cluster.run(
        "sbatch", "--parsable", "--cpus-per-task=1", "--gpus-per-node=2", "--ntasks-per-node=2",
        f"--output={tmp_path}/slurm-%j.out", str(REPO / "slurm/ddp.sbatch"), *WORK,
        f"output.root={tmp_path}/runs", f"data.root={tmp_path}/data",
    )  # fmt: skip
    job_id = done.stdout.strip().split(";")[0]
    assert job_id, done.stderr
    runs = tmp_path / "runs"
    first_epoch = lambda: any(  # noqa: E731
        runfolder.of_kind(runfolder.read_rank(r, 0), "epoch") for r in runfolder.find_runs(runs)
    )
    _wait_for(lambda: runs.is_dir() and first_epoch(), 300, "the first epoch")
    slurm_cluster.run("scancel", "--signal=USR2", job_id)  # to the job's steps: every rank
    state, released = wait_job_releasing_holds(job_id, 600, slurm_cluster.env)
    out = (tmp_path / f"slurm-{job_id}.out").read_text()
    assert state == "COMPLETED" and released >= 1, out
    (run_dir,) = runfolder.find_runs(runs)  # the requeued script found its folder
    _requeued_run_checks(run_dir, uninterrupted)
    assert json.loads((run_dir / "run.json").read_text())["job_id"] == job_id


class Preempted:
    """A job preempted from outside (`scontrol requeue`, as Slurm's requeue-mode preemption does)
    and then warned of its time limit with no requeue left. Runs in a thread beside the other
    tests: most of it is the wait for the 1-minute limit, in which nothing computes."""

    def __init__(self, cluster: SlurmCluster, tmp: Path) -> None:
        self.cluster, self.tmp = cluster, tmp
        self.run_dir, self.state, self.released = Path(), "", 0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._scenario, daemon=True)
        self.thread.start()

    def _scenario(self) -> None:
        try:
            self._steps()
        except BaseException as err:  # re-raised in the test that reads the outcome
            self.error = err

    def _steps(self) -> None:
        done = kit(
            "launch", "submit", *DDP, "data.train_size=1024", "train.epochs=60",
            "cluster.backend=slurm", "cluster.timeout_min=1", "cluster.max_requeues=1",
            # Slurm's own warning only 5 s before the limit: attempt 1 has time for an epoch
            # even on a loaded machine; attempt 2 gets the warning from the test.
            "cluster.signal_delay_s=5",
            f"output.root={self.tmp}/runs", f"data.root={self.tmp}/data",
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        self.run_dir, job_id = run_folder(done.stdout), done.stdout.split()[2]
        _wait_for(lambda: self._attempt_trained(1), 300, "attempt 1's first epoch")
        self.cluster.run("scontrol", "requeue", job_id)
        deadline = time.monotonic() + 300
        while self._starts() < 2:
            assert time.monotonic() < deadline, "attempt 2 never started"
            self.released += release_hold(job_id, self.cluster.env)
            time.sleep(0.5)
        self.cluster.run("scancel", "--signal=USR2", job_id)  # the limit's warning, early
        self.state, more = wait_job_releasing_holds(job_id, 300, self.cluster.env)
        self.released += more

    def _raw(self) -> list[dict[str, object]]:
        path = runfolder.metrics_path(self.run_dir, 0)
        return runfolder.read_records(path)[0] if path.is_file() else []

    def _starts(self) -> int:
        return len(runfolder.of_kind(self._raw(), "start"))

    def _attempt_trained(self, attempt: int) -> bool:
        kinds = [r["kind"] for r in self._raw()]
        return kinds.count("start") == attempt and kinds[-1] == "epoch"

    def outcome(self) -> Preempted:
        self.thread.join(600)
        if self.error:
            raise self.error
        return self


@pytest.fixture(scope="module")
def preempted(slurm_cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> Preempted:
    return Preempted(slurm_cluster, tmp_path_factory.mktemp("preempted"))


@pytest.mark.slurm
def test_preempted_run_resumes_then_out_of_requeues_ends_as_timeout(preempted: Preempted) -> None:
    run = preempted.outcome()
    assert run.state == "TIMEOUT" and run.released >= 1, (run.state, run.released)
    raw = runfolder.read_records(runfolder.metrics_path(run.run_dir, 0))[0]
    _, second = runfolder.of_kind(raw, "start")
    assert second["first_epoch"] > 1 or second["resumed_at_batch"] > 0  # resumed, not restarted
    assert second["restarts"] == 1
    epochs = [e["epoch"] for e in runfolder.of_kind(runfolder.read_rank(run.run_dir, 0), "epoch")]
    assert epochs == list(range(1, len(epochs) + 1))  # each epoch once
    stop = runfolder.of_kind(runfolder.read_rank(run.run_dir, 0), "stop")[-1]
    assert stop["requeues_used"] == 1 and stop["reason"].startswith("time limit")
    rank0 = "".join(p.read_text() for p in runfolder.log_files(run.run_dir, 0))
    assert "not requeued" in rank0 and "cluster.max_requeues=1" in rank0
    assert " TIMEOUT " in kit("launch", "status", str(run.run_dir)).stdout
