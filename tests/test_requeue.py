"""Jobs that survive Slurm: requeued at the time limit (submitit's path and the sbatch script's),
attempt after attempt for as long as each saves progress, preempted and then out of requeues, each
ending with exactly the parameters of the same run uninterrupted (CPU, gloo); a run whose attempts
save nothing new ends at its time limit, saying why."""

from __future__ import annotations

import json
import sys
import threading
import time
import typing
from pathlib import Path

import pytest
from kit import REPO, kit, kit_started, run_folder
from paced import PACED, SLOW_PACED
from slurm_cluster import (
    FINAL_STATES,
    SlurmCluster,
    job_state,
    release_hold,
    wait_job_releasing_holds,
)
from test_resume import DDP, WORK, _attempts, _final_hashes, _wait_for, uninterrupted

from slurm_ddp_kit.core import runfolder

__all__ = ["uninterrupted"]  # the shared reference run, as a fixture of this file too


def _requeued_run_checks(run_dir: Path, uninterrupted: str) -> None:
    assert _final_hashes(run_dir) == {uninterrupted}
    assert _attempts(run_dir) >= 2
    epochs = runfolder.of_kind(runfolder.read_rank(run_dir, 0), "epoch")
    assert [e["epoch"] for e in epochs] == list(range(1, 13))


@pytest.mark.slurm
@pytest.mark.timeout(1800)
def test_submit_path_requeues_at_the_time_limit_and_resumes(
    slurm_cluster: SlurmCluster,
    tmp_path: Path,
    uninterrupted: str,
    preempted: Preempted,
    slow_start: SlowStart,
) -> None:
    """Each attempt trains for 90 s less its start-up (which, on a loaded 2-core machine, takes
    30 s and more) against about 115 s of paced work: requeued once or twice, whatever the
    machine. (`preempted` and `slow_start` run beside this test.)"""
    done = kit(
        "launch", "submit", *DDP, SLOW_PACED, "cluster.backend=slurm", "cluster.timeout_min=2",
        "cluster.signal_delay_s=30", "cluster.max_requeues=20", f"output.root={tmp_path}/runs",
        f"data.root={tmp_path}/data",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    run_dir, job_id = run_folder(done.stdout), done.stdout.split()[2]
    state, released = wait_job_releasing_holds(job_id, 1200, slurm_cluster.env)
    assert state == "COMPLETED" and released >= 1, (state, released)
    _requeued_run_checks(run_dir, uninterrupted)
    assert " COMPLETED " in kit("launch", "status", str(run_dir)).stdout
    rank0 = "".join(p.read_text() for p in runfolder.log_files(run_dir, 0))
    assert "Requeued job" in rank0  # by submitit's own checkpoint-and-requeue handler


ATTEMPTS = 6  # a long run on a short partition, made short: each attempt warned after an epoch


@pytest.mark.slurm
@pytest.mark.timeout(1200)
def test_both_paths_requeue_a_run_attempt_after_attempt_until_it_is_done(
    slurm_cluster: SlurmCluster,
    tmp_path: Path,
    uninterrupted: str,
    monkeypatch: pytest.MonkeyPatch,
    stalled: Stalled,
) -> None:
    """The batch script's job and `launch submit`'s, with the default settings, each warned of
    its time limit once an attempt has trained an epoch, until six attempts have started (as a
    long run on a short partition is; the kit acts at once on a warning with far more time left
    than its lead). Every attempt saved progress, so each requeued itself, and the job completed
    on its own with exactly the uninterrupted run's parameters. The first warning goes to the
    whole job (`scancel --full`: the batch shell too, as `--signal=B:USR2` or a site's preemption
    warning would): the batch shell lives on. (`stalled` runs beside this test.)"""
    monkeypatch.setenv("KIT_PYTHON", sys.executable)  # sbatch passes the environment on
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    where = {path: [f"output.root={tmp_path}/{path}", f"data.root={tmp_path}/data"] for path in
             ("sbatch", "submit")}  # fmt: skip
    done = slurm_cluster.run(
        "sbatch", "--parsable", "--cpus-per-task=1", "--gpus-per-node=2", "--ntasks-per-node=2",
        f"--output={tmp_path}/slurm-%j.out", str(REPO / "slurm/ddp.sbatch"), *WORK, PACED,
        *where["sbatch"],
    )  # fmt: skip
    submitted = kit("launch", "submit", *DDP, PACED, "cluster.backend=slurm", *where["submit"])
    assert submitted.returncode == 0, submitted.stderr
    jobs = {"sbatch": done.stdout.strip().split(";")[0], "submit": submitted.stdout.split()[2]}
    assert jobs["sbatch"], done.stderr
    states = _warn_each_attempt(slurm_cluster, {tmp_path / p: j for p, j in jobs.items()}, 900)
    for path, job_id in jobs.items():
        out = (tmp_path / f"slurm-{job_id}.out").read_text() if path == "sbatch" else path
        assert states[job_id] == "COMPLETED", (states, out)
        (run_dir,) = runfolder.find_runs(tmp_path / path)  # each requeue found its folder
        assert _final_hashes(run_dir) == {uninterrupted}
        assert _attempts(run_dir) >= ATTEMPTS, out
        epochs = runfolder.of_kind(runfolder.read_rank(run_dir, 0), "epoch")
        assert [e["epoch"] for e in epochs] == list(range(1, 13))
        assert json.loads((run_dir / "run.json").read_text())["job_id"] == job_id


def _warn_each_attempt(
    cluster: SlurmCluster, jobs: dict[Path, str], timeout: float, attempts: int = ATTEMPTS
) -> dict[str, str]:
    """Follow jobs (by the output.root of each) to their end: warn each of their attempts once it
    has trained an epoch, until `attempts` have started; release Slurm's hold after each
    requeue. Returns each job's final state."""
    warned = dict.fromkeys(jobs.values(), 0)  # attempts warned so far
    ended: dict[str, str] = {}
    deadline = time.monotonic() + timeout
    while len(ended) < len(jobs):
        assert time.monotonic() < deadline, f"jobs still running after {timeout} s: {warned}"
        for root, job_id in jobs.items():
            if job_id in ended:
                continue
            queued = cluster.run("squeue", "-h", "-j", job_id, "-o", "%T|%r").stdout.strip()
            release_hold(job_id, cluster.env, queued)
            starts = _trained_attempts(root)
            if queued.startswith("RUNNING") and warned[job_id] < starts < attempts:
                full = ["--full"] if not warned[job_id] else []
                cluster.run("scancel", *full, "--signal=USR2", job_id)
                warned[job_id] = starts
            if not queued and (state := job_state(job_id, cluster.env)) in FINAL_STATES:
                ended[job_id] = state
        time.sleep(0.5)
    return ended


def _trained_attempts(root: Path) -> int:
    """Attempts started in the run under `root`, if its last one has trained an epoch; else 0."""
    runs = runfolder.find_runs(root) if root.is_dir() else []
    path = runfolder.metrics_path(runs[0], 0) if runs else None
    raw = runfolder.read_records(path)[0] if path and path.is_file() else []
    kinds = [r.get("kind") for r in raw]
    last = len(kinds) - kinds[::-1].index("start") if "start" in kinds else len(kinds)
    return kinds.count("start") if "epoch" in kinds[last:] else 0


SHORT = ["data.train_size=1024", "data.test_size=256", "train.epochs=3", "cluster.cpus_per_task=1"]


@pytest.mark.slurm
def test_sbatch_with_a_limit_within_the_scripts_lead_trains_on_instead_of_dying(
    slurm_cluster: SlurmCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`sbatch --time=2` against the script's `--signal=USR2@90`: Slurm warns 30-60 s in, during
    start-up. The job does not die of it: it says at its start that it trains on and saves with
    half its limit left (and requeues), or completes first. (`--time=1`, where Slurm warns at once,
    follows the same rule, but a loaded 2-core machine can take all of its minute to start.)"""
    monkeypatch.setenv("KIT_PYTHON", sys.executable)
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    done = slurm_cluster.run(
        "sbatch", "--parsable", "--time=2", "--cpus-per-task=1", "--gpus-per-node=2",
        "--ntasks-per-node=2", f"--output={tmp_path}/slurm-%j.out",
        str(REPO / "slurm/ddp.sbatch"), *SHORT, "cluster.max_requeues=20",
        f"output.root={tmp_path}/runs", f"data.root={tmp_path}/data",
    )  # fmt: skip
    job_id = done.stdout.strip().split(";")[0]
    assert job_id, done.stderr
    state, _ = wait_job_releasing_holds(job_id, 900, slurm_cluster.env)
    out = (tmp_path / f"slurm-{job_id}.out").read_text()
    (run_dir,) = runfolder.find_runs(tmp_path / "runs")
    assert state == "COMPLETED" and "User defined signal" not in out, (state, out)
    epochs = runfolder.of_kind(runfolder.read_rank(run_dir, 0), "epoch")
    assert [e["epoch"] for e in epochs] == [1, 2, 3]
    raw = runfolder.read_records(runfolder.metrics_path(run_dir, 0))[0]
    notices = [r["text"] for r in runfolder.of_kind(raw, "notice")]
    assert len(notices) == len(runfolder.of_kind(raw, "start")), notices  # one an attempt
    assert "is longer than half the limit (120 s)" in notices[0], notices
    assert "saves 60 s before the end, warned or not" in notices[0], notices


class Beside:
    """A Slurm scenario run in a thread beside the other tests: most of it waits for Slurm's
    clock, in which nothing computes. `outcome` joins it and raises what it raised."""

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
        raise NotImplementedError

    def outcome(self) -> typing.Self:
        self.thread.join(1200)
        if self.error:
            raise self.error
        return self


# An interpreter that takes three minutes to start on the job's first attempt (a container image,
# a cold file system): a 5-minute job's warning, 150 s ahead (Slurm sends it on its 30-s check,
# 150-180 s in), comes before Python holds it, and the job has about two minutes left to start,
# train a step, save and requeue, even on a loaded machine.
SLOW_START = """#!/bin/sh
case "$*" in *"train run"*) [ "${{SLURM_RESTART_COUNT:-0}}" = 0 ] && sleep 185;; esac
exec {python} "$@"
"""


class SlowStart(Beside):
    """`sbatch --time=5 --signal=USR2@150 slurm/ddp.sbatch` whose tasks take three minutes to start
    the first time."""

    out = ""

    def _steps(self) -> None:
        slow = self.tmp / "slow-python"
        slow.write_text(SLOW_START.format(python=sys.executable))
        slow.chmod(0o755)
        done = self.cluster.run(
            "sbatch", "--parsable", "--time=5", "--signal=USR2@150", "--cpus-per-task=1",
            "--gpus-per-node=2", "--ntasks-per-node=2", f"--output={self.tmp}/slurm-%j.out",
            f"--export=ALL,KIT_PYTHON={slow},PYTHONPATH={REPO}", str(REPO / "slurm/ddp.sbatch"),
            *SHORT, "cluster.signal_delay_s=150", "cluster.max_requeues=20",
            f"output.root={self.tmp}/runs",
            f"data.root={self.tmp}/data",
        )  # fmt: skip
        job_id = done.stdout.strip().split(";")[0]
        assert job_id, done.stderr
        self.state, self.released = wait_job_releasing_holds(job_id, 900, self.cluster.env)
        self.out = (self.tmp / f"slurm-{job_id}.out").read_text()
        (self.run_dir,) = runfolder.find_runs(self.tmp / "runs")


@pytest.fixture(scope="module")
def slow_start(slurm_cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> SlowStart:
    return SlowStart(slurm_cluster, tmp_path_factory.mktemp("slow-start"))


class Stalled(Beside):
    """`launch submit --wait` of a run whose attempts save nothing new (train.checkpoint=false:
    each starts over), allowed one requeue without progress: each attempt warned once it has
    started, the first requeues itself, the second does not and runs into the 1-minute limit."""

    said = ""

    def _steps(self) -> None:
        following = kit_started(
            "launch", "submit", *DDP, PACED, "train.checkpoint=false",
            "cluster.requeues_without_progress=1", "cluster.backend=slurm",
            "cluster.timeout_min=1", "cluster.signal_delay_s=5", "--wait",
            f"output.root={self.tmp}/runs", f"data.root={self.tmp}/data",
        )  # fmt: skip
        assert following.stdout is not None
        first = following.stdout.readline()  # "submitted job N"
        assert first.startswith("submitted job "), first + following.communicate()[1]
        job_id, warned = first.split()[2], 0
        while following.poll() is None:
            queued = self.cluster.run("squeue", "-h", "-j", job_id, "-o", "%T|%r").stdout
            self.released += release_hold(job_id, self.cluster.env, queued.strip())
            starts = self._starts()
            if queued.startswith("RUNNING") and starts > warned:
                self.cluster.run("scancel", "--signal=USR2", job_id)
                warned = starts
            time.sleep(0.5)
        self.said = first + following.communicate()[0]
        self.state = job_state(job_id, self.cluster.env) or ""

    def _starts(self) -> int:
        runs = runfolder.find_runs(self.tmp / "runs") if (self.tmp / "runs").is_dir() else []
        self.run_dir = runs[0] if runs else self.run_dir
        path = runfolder.metrics_path(self.run_dir, 0)
        return runfolder.attempts(runfolder.read_records(path)[0]) if path.is_file() else 0


@pytest.fixture(scope="module")
def stalled(slurm_cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> Stalled:
    return Stalled(slurm_cluster, tmp_path_factory.mktemp("stalled"))


@pytest.mark.slurm
@pytest.mark.timeout(1300)  # it waits for a scenario begun beside the tests before it
def test_a_run_whose_attempts_save_nothing_new_ends_at_its_time_limit_saying_why(
    stalled: Stalled,
) -> None:
    run = stalled.outcome()
    assert run.state == "TIMEOUT" and _attempts(run.run_dir) == 2, (run.state, run.said)
    why = (
        "not requeued: 2 attempts in a row saved nothing new (cluster.requeues_without_progress=1; "
        "train.checkpoint=false saves nothing)"
    )
    assert "stopped (time limit (SIGUSR2)), saved in epoch " in run.said, run.said
    assert why in run.said  # --wait's last word
    status = kit("launch", "status", str(run.run_dir)).stdout
    assert " TIMEOUT " in status and f"stopped at its time limit, {why}" in status, status
    rank0 = "".join(p.read_text() for p in runfolder.log_files(run.run_dir, 0))
    assert why in rank0
    stop = runfolder.of_kind(runfolder.read_rank(run.run_dir, 0), "stop")[-1]
    assert stop["requeue"] is None and stop["not_requeued"] in why


@pytest.mark.slurm
def test_an_expedited_requeue_is_refused_where_the_cluster_cannot_take_it(
    slurm_cluster: SlurmCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The test cluster takes no `--requeue=expedite` (Slurm 22.05; 25.11 without
    enable_expedited_requeue): `launch submit` refuses in one line before anything is made. The
    sbatch script given the setting refuses in its first step: its job was submitted without it."""
    where = [f"output.root={tmp_path}/runs", f"data.root={tmp_path}/data"]
    done = kit(
        "launch", "submit", *DDP, "cluster.backend=slurm", "cluster.requeue=expedite", *where
    )
    assert done.returncode == 2 and done.stdout == "", done.stdout + done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith("error: cluster.requeue=expedite, but this cluster "), line
    assert "drop it (cluster.requeue=normal)" in line and not (tmp_path / "runs").exists()
    monkeypatch.setenv("KIT_PYTHON", sys.executable)
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    done = slurm_cluster.run(
        "sbatch", "--parsable", "--cpus-per-task=1", "--gpus-per-node=2", "--ntasks-per-node=2",
        f"--output={tmp_path}/slurm-%j.out", str(REPO / "slurm/ddp.sbatch"), *WORK,
        "cluster.requeue=expedite", *where,
    )  # fmt: skip
    job_id = done.stdout.strip().split(";")[0]
    assert job_id, done.stderr
    assert slurm_cluster.wait_job(job_id) == "FAILED"
    out = (tmp_path / f"slurm-{job_id}.out").read_text()
    assert f"error: cluster.requeue=expedite, but job {job_id} was submitted without it" in out
    assert (
        "`sbatch --requeue=expedite slurm/ddp.sbatch …`" in out and not (tmp_path / "runs").exists()
    )


class Preempted(Beside):
    """A job preempted from outside (`scontrol requeue`, as Slurm's requeue-mode preemption does)
    and then warned of its time limit with no requeue left (most of it the wait for the
    1-minute limit)."""

    def _steps(self) -> None:
        done = kit(
            "launch", "submit", *DDP, PACED, "train.epochs=60",
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


@pytest.fixture(scope="module")
def preempted(slurm_cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> Preempted:
    return Preempted(slurm_cluster, tmp_path_factory.mktemp("preempted"))


@pytest.mark.slurm
@pytest.mark.timeout(1300)  # it waits for a scenario begun beside the tests before it
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


@pytest.mark.slurm
@pytest.mark.timeout(1300)  # it waits for a scenario begun beside the tests before it
def test_a_warning_lost_while_the_interpreter_starts_still_stops_the_job_at_its_lead(
    slow_start: SlowStart,
) -> None:
    """Slurm's warning came while each task's interpreter started (ignored there: it is lost,
    and ends nothing); the job read its time left at its start and saved at the lead anyway,
    requeued and completed."""
    run = slow_start.outcome()
    assert run.state == "COMPLETED" and "User defined signal" not in run.out, (run.state, run.out)
    records = runfolder.read_rank(run.run_dir, 0)
    assert [e["epoch"] for e in runfolder.of_kind(records, "epoch")] == [1, 2, 3]
    raw = runfolder.read_records(runfolder.metrics_path(run.run_dir, 0))[0]
    first_stop = runfolder.of_kind(raw, "stop")[0]  # the run view keeps only the last attempt's
    assert first_stop["reason"].startswith("time limit") and _attempts(run.run_dir) >= 2
    notices = [r["text"] for r in runfolder.of_kind(raw, "notice")]
    assert "Slurm's warning may have come before the job could hold it" in notices[0], notices
