"""Ctrl-C at `launch submit --wait`, and a local job's id (its controller's PID) reused by another
process: what a user sees, with real processes."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest
from kit import REPO, alive, kit, run_folder, wait_for
from paced import LASTING
from slurm_cluster import SlurmCluster

from slurm_ddp_kit.core import processes, runfolder
from slurm_ddp_kit.core.settings.loading import load_config
from slurm_ddp_kit.launch.follow import continue_words

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

LONG = [*LASTING, "train.epochs=200", "cluster.timeout_min=10"]  # followed, then interrupted


def _status(run_dir: Path) -> tuple[str, list[str]]:
    """(the STATE column, every line) of `launch status RUN`."""
    done = kit("launch", "status", str(run_dir))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    header, row = lines[0].split(), lines[1].split()
    return row[header.index("STATE")], lines


def _meta(run_dir: Path) -> dict[str, object]:
    return dict(json.loads((run_dir / "run.json").read_text()))


def _edit_meta(run_dir: Path, **fields: object) -> None:
    """Set fields of run.json (None removes one), replaced at once as the kit replaces it."""
    meta = {**_meta(run_dir), **fields}
    scratch = run_dir / "run.json.edit"
    scratch.write_text(json.dumps({k: v for k, v in meta.items() if v is not None}))
    scratch.replace(run_dir / "run.json")


def _as_a_terminal_starts_it() -> None:
    """A shell's foreground command starts with SIGINT at its default, whatever this test
    process inherited (the kit keeps an ignored SIGINT ignored, as a background job's)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _submitted(root: Path) -> bool:
    """Whether a job's submission file is in a run folder under root (a folder being staged
    is renamed into place meanwhile: a glob that meets it mid-rename finds nothing yet)."""
    try:
        return any(root.glob("*/logs/*_submitted.pkl"))
    except FileNotFoundError:
        return False


class Following:
    """`launch submit … --wait` started as a terminal starts a foreground command: in a process
    group of its own, which the job's controller and ranks join (the terminal's Ctrl-C goes to
    the whole group)."""

    def __init__(self, tmp: Path, *args: str) -> None:
        self.out, self.err = tmp / "stdout", tmp / "stderr"
        with self.out.open("w") as out, self.err.open("w") as err:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "launch", "submit", *args, "--wait"],
                cwd=REPO,
                env={**os.environ, "PYTHONPATH": str(REPO)},
                stdout=out,
                stderr=err,
                start_new_session=True,
                preexec_fn=_as_a_terminal_starts_it,
            )
        assert wait_for(lambda: "run folder: " in self.out.read_text(), 120), self.output()
        self.run_dir = run_folder(self.out.read_text())
        self.job_id = str(_meta(self.run_dir)["job_id"])
        self.local = _meta(self.run_dir)["backend"] == "local"

    def output(self) -> str:
        return self.out.read_text() + self.err.read_text()

    def pids(self) -> list[int]:
        """The launcher, and for a local job its controller and ranks."""
        if not self.local:
            return [self.process.pid]
        views = [
            runfolder.read_rank(self.run_dir, rank) for rank in runfolder.rank_files(self.run_dir)
        ]
        ranks = [int(r["pid"]) for view in views for r in runfolder.of_kind(view, "start")]
        return [self.process.pid, int(self.job_id), *ranks]

    def stop(self) -> None:
        """Leave nothing of the test's job running, whatever the test found."""
        for pid in self.pids():
            if alive(pid):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)


# How the launcher was ended: the line it starts its word with, and its exit status.
ENDED = {"terminal": ("interrupted", 130), "launcher": ("interrupted", 130), "sigterm": ("terminated", 143)}  # fmt: skip


@pytest.fixture(scope="module", params=list(ENDED))
def interrupted(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Following, int]]:
    """A local DDP run followed with --wait, interrupted after its first epoch: by the terminal's
    Ctrl-C (SIGINT to the whole process group), by SIGINT to the launcher alone, or by SIGTERM
    to it (`kill`, a session's end). Yields (how, the run, the launcher's exit status)."""
    tmp = tmp_path_factory.mktemp(f"interrupt-{request.param}")
    where = [f"output.root={tmp}/runs", f"data.root={tmp}/data"]
    run = Following(tmp, "--mode", "ddp", "cluster.backend=local", "cluster.gpus_per_node=2", *LONG, *where)  # fmt: skip
    try:
        saved = runfolder.state_path(run.run_dir)
        assert wait_for(lambda: "epoch 1/200" in run.out.read_text() and saved.is_file(), 180)
        assert _status(run.run_dir)[0] == "RUNNING"
        if request.param == "launcher":
            # A run recorded before the controller's identity was: known by its command line.
            identity = _meta(run.run_dir)["job_process"]
            _edit_meta(run.run_dir, job_process=None)
            assert _status(run.run_dir)[0] == "RUNNING"
            os.kill(run.process.pid, signal.SIGINT)
        elif request.param == "sigterm":
            os.kill(run.process.pid, signal.SIGTERM)
        else:
            os.killpg(run.process.pid, signal.SIGINT)
        returncode = run.process.wait(60)
        if request.param == "launcher":
            _edit_meta(run.run_dir, job_process=identity)
        yield request.param, run, returncode
    finally:
        run.stop()


def test_ctrl_c_at_wait_cancels_the_local_job_in_one_line(
    interrupted: tuple[str, Following, int],
) -> None:
    how, run, returncode = interrupted
    word, status = ENDED[how]
    assert returncode == status, run.output()
    assert "Traceback" not in run.output()
    assert run.err.read_text().splitlines() == [
        f"{word}: cancelled local job {run.job_id}; continue it from its last checkpoint "
        f"with `python -m launch resume {run.run_dir}`"
    ]
    # Cancelled as `launch cancel` would, and over when the command returns: no process left
    # (also where the terminal's Ctrl-C and the launcher's cancel both reached the controller).
    assert [pid for pid in run.pids() if alive(pid)] == [], how
    state, lines = _status(run.run_dir)
    assert state == "CANCELLED", lines
    assert len(lines) == 2, lines  # the table alone: no "rank R failed first: KeyboardInterrupt"
    assert runfolder.state_path(run.run_dir).is_file()  # what `launch resume` goes on from


@pytest.mark.parametrize("recorded", ["identity", "before-identity"])
def test_a_reused_pid_is_not_the_job(
    interrupted: tuple[str, Following, int], tmp_path: Path, recorded: str
) -> None:
    """The local job id is its controller's PID; once the controller has ended another process
    may get it: `status` must not call the job RUNNING, `cancel` must not signal that process."""
    _, run, _ = interrupted
    run_dir = tmp_path / run.run_dir.name
    shutil.copytree(run.run_dir, run_dir)
    stranger = subprocess.Popen(["sleep", "60"])
    try:
        _edit_meta(run_dir, job_id=str(stranger.pid), cancel_requested=None)
        if recorded == "before-identity":  # a run recorded before this kit kept the identity
            _edit_meta(run_dir, job_process=None)
        else:
            assert _meta(run_dir)["job_process"]
        state, lines = _status(run_dir)
        # Ended, as its records say: FAILED where a rank recorded the terminal's Ctrl-C (a
        # KeyboardInterrupt) before the launcher marked the cancel, which the copy drops.
        assert state in ("ENDED-WITHOUT-SUMMARY", "FAILED"), lines
        cancelled = kit("launch", "cancel", str(run_dir))
        assert cancelled.returncode == 0, cancelled.stderr
        assert (
            cancelled.stdout.strip()
            == f"{run_dir.name}: local job {stranger.pid} had already ended"
        )
        time.sleep(0.5)
        assert stranger.poll() is None  # the sleep lives on
    finally:
        stranger.kill()
        stranger.wait()


def test_a_local_jobs_tasks_are_known_by_their_job_id_and_run_folder() -> None:
    """What `status`, `cancel` and `resume` look for once a local job's controller is gone: the
    processes its controller started, named by their environment; a later job given the same
    id (the controller's PID, reused) runs in another run folder."""
    logs = "/x/runs/20261206-000000-ddp-1n2g-abcd/logs"
    env = {"SUBMITIT_LOCAL_JOB_ID": "424242", "SUBMITIT_LOCAL_GLOBALID": "1"}
    env["SUBMITIT_LOCAL_COMMAND"] = f"python -u -m submitit.core._submit {logs}"
    task = subprocess.Popen(["sleep", "30"], env={**os.environ, **env})
    try:
        assert wait_for(lambda: processes.local_tasks("424242") != {}, 10)
        assert processes.local_tasks("424242", Path(logs)) == {1: [task.pid]}
        assert processes.local_tasks("424242", Path(logs.replace("abcd", "efgh"))) == {}
        assert processes.local_tasks("42424") == {}
        table = processes.task_table()  # read once for many runs
        assert processes.local_tasks("424242", None, table) == {1: [task.pid]}
    finally:
        task.kill()
        task.wait()
    assert processes.local_tasks("424242") == {}


def test_a_local_job_that_ends_before_its_tasks_start_is_said_at_once(tmp_path: Path) -> None:
    """Its controller killed before it started a task (here by its own setup line): no wait for
    a result, no word of a log file that was never made."""
    where = [f"output.root={tmp_path}/runs", f"data.root={tmp_path}/data"]
    done = kit(
        "launch", "submit", "--mode", "ddp", "cluster.backend=local", "cluster.gpus_per_node=2",
        *LASTING, *where, 'cluster.setup=["kill -KILL $$"]', "--wait", timeout=60,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    run_dir = run_folder(done.stdout)
    job_id = _meta(run_dir)["job_id"]
    assert done.stdout.splitlines()[-1] == (
        f"job {job_id} ended before it started its tasks (its controller was killed, or a "
        f"cluster.setup line ended it); it had saved no checkpoint yet: `python -m launch resume "
        f"{run_dir}` starts it over"
    )
    assert done.stderr == ""


def _following_a_local_run(tmp: Path) -> Following:
    """A local DDP run followed with --wait, once it has finished its first epoch and saved."""
    where = [f"output.root={tmp}/runs", f"data.root={tmp}/data"]
    run = Following(tmp, "--mode", "ddp", "cluster.backend=local", "cluster.gpus_per_node=2", *LONG, *where)  # fmt: skip
    saved = runfolder.state_path(run.run_dir)
    assert wait_for(lambda: "epoch 1/200" in run.out.read_text() and saved.is_file(), 180)
    return run


def test_a_cancel_from_another_shell_ends_the_wait_at_once_in_one_line(tmp_path: Path) -> None:
    run = _following_a_local_run(tmp_path)
    try:
        done = kit("launch", "cancel", str(run.run_dir))
        assert done.returncode == 0, done.stderr
        # At once: not after submitit's wait for a result file the cancelled ranks never write.
        assert run.process.wait(10) == 130, run.output()
        assert run.out.read_text().splitlines()[-1] == (
            f"job {run.job_id} was cancelled; continue it from its last checkpoint with "
            f"`python -m launch resume {run.run_dir}`"
        )
        assert run.err.read_text() == ""  # no failure, no traceback of an interrupted rank
        assert [pid for pid in run.pids() if alive(pid)] == []
        assert _status(run.run_dir)[0] == "CANCELLED"
    finally:
        run.stop()


def test_a_killed_controller_takes_its_ranks_with_it_and_they_save(tmp_path: Path) -> None:
    """SIGKILL to a local job's controller (a `kill -9`, the OOM killer) leaves it no time to end
    its ranks: they stop themselves at an agreed step and save, as on a SIGTERM, rather than
    train on where neither `status` nor `cancel` would see them; `--wait` says so."""
    run = _following_a_local_run(tmp_path)
    try:
        os.kill(int(run.job_id), signal.SIGKILL)
        assert run.process.wait(60) == 1, run.output()
        last = run.out.read_text().splitlines()[-1]
        assert last.startswith(
            f"job {run.job_id} stopped (SIGTERM (its local controller ended, or a kill)), saved"
        ), last
        assert last.endswith(
            f"continue it from its last checkpoint with `python -m launch resume {run.run_dir}`"
        )
        assert [pid for pid in run.pids() if alive(pid)] == []
        assert _status(run.run_dir)[0] == "STOPPED"
    finally:
        run.stop()


@pytest.mark.parametrize(
    ("sent", "said", "status"),
    [(signal.SIGINT, "interrupted", 130), (signal.SIGTERM, "terminated", 143)],
    ids=["ctrl-c", "sigterm"],
)
def test_a_signal_while_the_job_is_submitted_is_taken_once_it_is_recorded(
    tmp_path: Path, sent: int, said: str, status: int
) -> None:
    """A signal in the instant after the controller has started and before the run folder
    records it would leave a job no record knows, which `cancel` could not reach: it is held
    until the job is named, then the job is cancelled as at any later instant."""
    where = [f"output.root={tmp_path}/runs", f"data.root={tmp_path}/data"]
    process = subprocess.Popen(
        [sys.executable, "-m", "launch", "submit", "--mode", "ddp", "cluster.backend=local",
         "cluster.gpus_per_node=2", *LONG, *where, "--wait"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
        preexec_fn=_as_a_terminal_starts_it,
    )  # fmt: skip
    started = tmp_path / "runs"
    assert wait_for(partial(_submitted, started), 120, every=0.002)
    os.kill(process.pid, sent)
    out, err = process.communicate(timeout=60)
    assert process.returncode == status, out + err
    run_dir = run_folder(out)
    job_id = str(_meta(run_dir)["job_id"])
    assert out.splitlines()[0] == f"submitted job {job_id}"
    assert err.splitlines() == [
        f"{said}: cancelled local job {job_id}; it had saved no checkpoint yet: "
        f"`python -m launch resume {run_dir}` starts it over"
    ]
    assert (
        not alive(int(job_id)) and processes.local_tasks(job_id, runfolder.logs_dir(run_dir)) == {}
    )
    assert _status(run_dir)[0] == "CANCELLED"


@pytest.mark.parametrize("instant", ["training", "submitting"])
def test_ctrl_c_in_a_local_sweep_cancels_its_running_run_and_submits_no_more(
    tmp_path: Path, instant: str
) -> None:
    """The terminal's Ctrl-C while a run of the sweep trains, or at the instant its job is
    submitted (its controller, in the terminal's process group, ends before the launcher can
    cancel it): the run is named and CANCELLED either way, and the next is not submitted."""
    where = [f"output.root={tmp_path}/runs", f"data.root={tmp_path}/data"]
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with out.open("w") as stdout, err.open("w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "launch", "sweep", "--modes", "ddp", "--grid", "train.seed=1,2",
             "cluster.backend=local", "cluster.gpus_per_node=2", *LONG, *where],
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=stdout, stderr=stderr,
            start_new_session=True, preexec_fn=_as_a_terminal_starts_it,
        )  # fmt: skip
    if instant == "submitting":
        started = tmp_path / "runs"
        assert wait_for(partial(_submitted, started), 120, every=0.002)
        os.killpg(process.pid, signal.SIGINT)  # the terminal's Ctrl-C
    assert wait_for(lambda: "run folder: " in out.read_text(), 120), err.read_text()
    run_dir = Path(out.read_text().split("run folder: ")[1].split()[0])
    job_id = str(_meta(run_dir)["job_id"])
    if instant == "training":
        assert wait_for(runfolder.state_path(run_dir).is_file, 180)  # its first epoch saved
        os.killpg(process.pid, signal.SIGINT)
    assert process.wait(60) == 130, out.read_text() + err.read_text()
    assert err.read_text().splitlines() == [
        f"interrupted: cancelled local job {job_id}; {continue_words(run_dir)}",
        "interrupted: 1 of the sweep's 2 runs were not submitted",
    ]
    assert (
        not alive(int(job_id)) and processes.local_tasks(job_id, runfolder.logs_dir(run_dir)) == {}
    )
    assert len(runfolder.find_runs(tmp_path / "runs")) == 1
    assert _status(run_dir)[0] == "CANCELLED"


@pytest.mark.slurm
def test_ctrl_c_at_wait_leaves_a_slurm_job_running(tmp_path: Path) -> None:
    """A Slurm job is not in the terminal's process group: Ctrl-C stops following, and says so."""
    where = [f"output.root={tmp_path}/runs", f"data.root={tmp_path}/data"]
    shape = ["cluster.backend=slurm", "cluster.gpus_per_node=2", "cluster.cpus_per_task=1"]
    run = Following(tmp_path, "--mode", "ddp", *shape, *LONG, "train.checkpoint=false", *where)
    try:
        assert wait_for(lambda: _status(run.run_dir)[0] == "RUNNING", 120), run.output()
        os.killpg(run.process.pid, signal.SIGINT)
        assert run.process.wait(60) == 130, run.output()
        assert "Traceback" not in run.output()
        assert run.err.read_text().splitlines() == [
            f"interrupted: stopped following; job {run.job_id} goes on: `python -m launch status "
            f"{run.run_dir}`, `python -m launch cancel {run.run_dir}`"
        ]
        time.sleep(2)
        assert _status(run.run_dir)[0] == "RUNNING"
    finally:
        kit("launch", "cancel", str(run.run_dir))
        with contextlib.suppress(subprocess.TimeoutExpired):
            run.process.wait(10)
    assert wait_for(lambda: _status(run.run_dir)[0] == "CANCELLED", 120)


def test_a_run_stopped_before_its_first_save_is_not_said_to_have_a_checkpoint(
    tmp_path: Path,
) -> None:
    """Ctrl-C in the middle of the first save (in os.fsync, say) leaves no checkpoint: the line
    must not send the user to one."""
    cfg = load_config(overrides=[f"output.root={tmp_path}", "cluster.backend=local"])
    run_dir = runfolder.create(cfg, launcher="launch", backend="local", command=[])
    words = continue_words(run_dir)
    assert "saved no checkpoint yet" in words and "starts it over" in words
    runfolder.state_path(run_dir).parent.mkdir()
    runfolder.state_path(run_dir).write_bytes(b"saved")
    assert continue_words(run_dir).startswith("continue it from its last checkpoint")


@pytest.mark.slurm
def test_ctrl_c_while_a_slurm_sweep_is_submitted_stops_at_the_next_array(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """120 points, 20 arrays of the test cluster's 6 (each held until an hour from now): a
    Ctrl-C once the second array's folders are made ends the submission there. The arrays in
    the queue go on, each run recorded; no folder is left for a point not submitted; the hint
    names the sweep's own arrays, and `scancel` of those empties the queue."""
    seeds = ",".join(map(str, range(120)))
    where = [f"output.root={tmp_path}/runs", f"data.root={tmp_path}/data"]
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with out.open("w") as stdout, err.open("w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "launch", "sweep", "--modes", "ddp", "--grid",
             f"train.seed={seeds}", "cluster.backend=slurm", "cluster.gpus_per_node=1",
             "cluster.cpus_per_task=1", "cluster.sbatch_extra.begin=now+3600", *where],
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=stdout, stderr=stderr,
            start_new_session=True, preexec_fn=_as_a_terminal_starts_it,
        )  # fmt: skip
    made = lambda: len(runfolder.find_runs(tmp_path / "runs"))  # noqa: E731
    assert wait_for(lambda: made() > 6, 120, every=0.005), err.read_text()
    os.killpg(process.pid, signal.SIGINT)
    assert process.wait(60) == 130, out.read_text() + err.read_text()
    runs = runfolder.find_runs(tmp_path / "runs")
    assert len(runs) % 6 == 0 and 6 <= len(runs) < 120, len(runs)
    jobs = {str(_meta(run)["job_id"]) for run in runs}  # every folder names its array element
    arrays = sorted({job.split("_")[0] for job in jobs})
    assert len(jobs) == len(runs) and len(arrays) == len(runs) // 6
    hint, rest = err.read_text().splitlines()
    assert hint.startswith(f"interrupted: the sweep's {len(runs)} submitted Slurm job(s) go on")
    assert rest == f"interrupted: {120 - len(runs)} of the sweep's 120 runs were not submitted"
    queued = lambda: slurm_cluster.run(  # noqa: E731
        "squeue", "-h", "-r", "-t", "PENDING", "-j", ",".join(arrays), "-o", "%i"
    ).stdout.split()
    assert sorted(queued()) == sorted(jobs)
    cancel = shlex.split(re.findall(r"`([^`]+)`", hint)[-1])  # the hint's cancel, as given
    done = kit(*cancel[2:]) if cancel[0] == "python" else slurm_cluster.run(*cancel)
    assert done.returncode == 0, done.stderr
    assert wait_for(lambda: not queued(), 30), queued()
