"""Jobs that survive, on the local backend: stopped by the time-limit signal, saved, cancelled and
resumed, ending with exactly the parameters of the same run uninterrupted (CPU, gloo). The same
on Slurm, requeued: tests/test_requeue.py."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
from conftest import SharedRuns
from kit import kit, kit_started, run_folder
from paced import PACED

from slurm_ddp_kit.core import runfolder

# One thread per rank everywhere: the same arithmetic in every run, so the same parameters.
# 72 steps; the runs that are stopped pace each step (tests/paced.py: about 4 s an epoch, 50 s
# in all, their CPU mostly idle) so that a 1-minute limit whose warning comes 30 s ahead always
# interrupts the first attempt. The reference they end like trains the same unpaced.
WORK = [
    "data.train_size=384", "data.test_size=128", "train.global_batch_size=64", "train.epochs=12",
    "cluster.cpus_per_task=1",
]  # fmt: skip
DDP = ["--mode", "ddp", "cluster.gpus_per_node=2", *WORK]


def _final_hashes(run_dir: Path) -> set[str]:
    view = [runfolder.read_rank(run_dir, rank) for rank in (0, 1)]
    return {runfolder.of_kind(records, "summary")[-1]["parameters_sha256"] for records in view}


def _attempts(run_dir: Path) -> int:
    return runfolder.attempts(runfolder.read_records(runfolder.metrics_path(run_dir, 0))[0])


@pytest.fixture(scope="module")
def uninterrupted(shared_runs: SharedRuns) -> str:
    """The parameters the run ends with when nothing stops it (one run for every test file)."""
    return str(shared_runs.get("uninterrupted", _uninterrupted))


def _uninterrupted(tmp: Path) -> str:
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
    # Rank 0 says where an epoch is every second (the default is 30): --wait shows it.
    where += ["output.progress_s=1"]
    following = kit_started("launch", "submit", *DDP, PACED, "cluster.backend=local", *where, "--wait")  # fmt: skip
    assert following.stdout is not None
    said = [""]
    while not said[-1].startswith("run folder: "):
        said.append(following.stdout.readline())
        assert said[-1], said  # ended before it named the run folder
    run_dir = run_folder("".join(said))
    epochs = lambda: runfolder.of_kind(runfolder.read_rank(run_dir, 0), "epoch")  # noqa: E731
    _wait_for(lambda: len(epochs()) >= 1, 180, "the first epoch")
    time.sleep(1.5)  # somewhere inside the second epoch
    starts = [runfolder.of_kind(runfolder.read_rank(run_dir, r), "start")[0] for r in (0, 1)]
    for start in starts:  # what Slurm sends before the time limit
        os.kill(start["pid"], signal.SIGUSR2)
    _wait_for(lambda: " STOPPED " in kit("launch", "status", str(run_dir)).stdout, 120, "STOPPED")
    stop = runfolder.of_kind(runfolder.read_rank(run_dir, 0), "stop")[-1]
    assert stop["reason"].startswith("time limit") and runfolder.state_path(run_dir).is_file()
    out, err = following.communicate(timeout=60)  # --wait says it in one line, no traceback
    assert following.returncode == 1 and "Traceback" not in out + err, out + err
    assert f"stopped (time limit (SIGUSR2)), saved in epoch {stop['epoch']} after batch" in out
    assert "continue it from its last checkpoint with `python -m launch resume" in out

    # Resumed twice at once: one launcher submits, the other waits for it, then refuses, naming
    # the job that holds the folder. Then cancelled in the middle of an epoch, resumed again.
    raw = lambda: runfolder.read_records(runfolder.metrics_path(run_dir, 0))[0]  # noqa: E731
    launchers = [kit_started("launch", "resume", str(run_dir)) for _ in range(2)]
    ends = sorted((p.wait(120), p.stderr.read() if p.stderr else "") for p in launchers)
    jobs = runfolder.read_meta(run_dir)["jobs"]
    assert [code for code, _ in ends] == [0, 2] and len(jobs) == 2, ends
    assert f"is RUNNING as job {jobs[-1]}: one job at a time writes a run folder" in ends[1][1]
    _wait_for(lambda: [r["kind"] for r in raw()][-1] == "epoch" and _attempts(run_dir) == 2, 180,
              "an epoch of the second attempt")  # fmt: skip
    assert kit("launch", "cancel", str(run_dir)).returncode == 0
    _wait_for(lambda: " CANCELLED " in kit("launch", "status", str(run_dir)).stdout, 120, "CANCEL")
    done_before = len(epochs())
    resumed = kit("launch", "resume", str(run_dir), "--wait")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    start = runfolder.of_kind(runfolder.read_rank(run_dir, 0), "start")[0]  # the third attempt's
    said = f"resumed at epoch {start['first_epoch']}, batch {start['resumed_at_batch']}"
    assert said in resumed.stdout.splitlines(), resumed.stdout  # where it went on from, once
    before = resumed.stdout.splitlines()[: resumed.stdout.splitlines().index(said)]
    assert not [line for line in before if line.startswith("  batch ")], resumed.stdout  # the
    # cancelled attempt's last progress record is not said as if it were the new attempt's
    shown = [
        line.split("/")[0] for line in resumed.stdout.splitlines() if line.startswith("epoch ")
    ]
    # The epochs done before are not shown again; the new attempt's, each once.
    assert shown == [f"epoch {n}" for n in range(done_before + 1, 13)], resumed.stdout
    assert _final_hashes(run_dir) == {uninterrupted}
    assert _attempts(run_dir) == 3  # the raw records keep every attempt
    split = [e for e in epochs() if e.get("resumed_at_batch")]
    assert all(e["seconds"] is None for e in split)  # no made-up time for a split epoch
    # Its training time is said as what it is; and inside each epoch, where it is.
    over = f"(its epochs over 3 attempts, each epoch once; {len(split)} epoch(s) split across"
    assert over in resumed.stdout.splitlines()[-1], resumed.stdout
    inside = [line for line in resumed.stdout.splitlines() if line.startswith("  batch ")]
    assert inside and all(re.fullmatch(r"  batch [1-5]/6 of epoch \d+/12 \(\d+%\), \d+ s in", line)
                          for line in inside), resumed.stdout  # fmt: skip
    again = kit("launch", "resume", str(run_dir))
    assert again.returncode == 2 and "nothing to resume" in again.stderr
