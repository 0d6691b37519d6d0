"""The run folder module: made whole or not at all, never replacing a run, atomic writes."""

from __future__ import annotations

import hashlib
import json
import os
import resource
import socket
import stat
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
from kit import REPO, kit, kit_here

from slurm_ddp_kit.core import runfolder
from slurm_ddp_kit.core.runfolder import failures
from slurm_ddp_kit.core.settings.loading import load_config


def test_a_run_is_never_replaced_by_a_new_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two submissions that draw the same name in the same second: the second gets another."""
    cfg = load_config(overrides=[f"output.root={tmp_path}", "cluster.backend=local"])
    names = iter(["same-name", "same-name", "other-name"])
    monkeypatch.setattr(runfolder, "new_name", lambda cfg: next(names))
    first = runfolder.create(cfg, launcher="launch", backend="local", command=["a"])
    second = runfolder.create(cfg, launcher="launch", backend="local", command=["b"])
    assert (first.name, second.name) == ("same-name", "other-name")
    assert runfolder.read_meta(first)["command"] == ["a"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other-name", "same-name"]  # no staging


def test_a_failed_create_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_config(overrides=[f"output.root={tmp_path}"])

    def broken(*args: object) -> dict[str, object]:
        raise OSError("disk full")

    monkeypatch.setattr(runfolder, "_meta", broken)
    with pytest.raises(
        runfolder.RunFolderError, match=r"could not write .*: disk full; free space"
    ):
        runfolder.create(cfg, launcher="launch", backend="local", command=[])
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_at_submit_is_one_line_and_leaves_nothing(tmp_path: Path) -> None:
    """Files past 200 bytes fail to write (EFBIG, as ENOSPC would): the folders made for the run,
    down from output.root's first missing parent, go again."""

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (200, 200))

    root = tmp_path / "new" / "runs"
    done = subprocess.run(
        [sys.executable, "-m", "launch", "submit", "--mode", "ddp", f"output.root={root}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        preexec_fn=small_files,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: could not write a run")
    assert "point output.root at another folder" in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_line_cut_by_a_kill_stays_apart_from_the_next_attempt(tmp_path: Path) -> None:
    writer = runfolder.RecordWriter(tmp_path, rank=0)
    writer.write("start", attempt=1)
    with writer.path.open("a") as f:
        f.write('{"schema": 1, "kind": "ep')  # the job was killed mid-write
    runfolder.RecordWriter(tmp_path, rank=0).write("start", attempt=2)
    records, problems = runfolder.read_records(writer.path)
    assert [r["attempt"] for r in records] == [1, 2]
    assert len(problems) == 1 and f"{writer.path}:2:" in problems[0]


def test_a_start_record_of_a_gpu_rank_is_read(tmp_path: Path) -> None:
    """A rank that drove GPUs names them by UUID (`core.placement.Place.gpus`), as its start
    record keeps them: read, not skipped (the readers' type checks once took them for numbers,
    and every GPU run's start went unread)."""
    writer = runfolder.RecordWriter(tmp_path, rank=0)
    uuids = ["53139983-caff-0116-36c1-4ff0cfff560d", "6ad2ab1c-0d5e-8a3b-31c4-2f8f0f2f0b11"]
    writer.write("start", host="n1", world_size=2, gpu_ids=uuids, cpus="0-3", placement=None)
    records, problems = runfolder.read_records(writer.path)
    assert problems == [] and records[0]["gpu_ids"] == uuids


def test_bytes_that_are_not_text_spoil_their_line_only(tmp_path: Path) -> None:
    writer = runfolder.RecordWriter(tmp_path, rank=0)
    writer.write("start")
    with writer.path.open("ab") as f:
        f.write(b"\xff\xfe\x00garbage\n")
    writer.write("epoch", epoch=1)
    records, problems = runfolder.read_records(writer.path)
    assert [r["kind"] for r in records] == ["start", "epoch"]
    assert len(problems) == 1 and f"{writer.path}:2:" in problems[0]


def test_settings_read_back_fast_equal_the_validated_config(tmp_path: Path) -> None:
    cfg = load_config(overrides=[f"output.root={tmp_path}", "mode=dp", "train.precision=bf16"])
    run_dir = runfolder.create(cfg, launcher="launch", backend="local", command=[])
    assert runfolder.read_config(run_dir) == runfolder.load_job_config(run_dir) == cfg


def test_records_after_the_last_start_count(tmp_path: Path) -> None:
    writer = runfolder.RecordWriter(tmp_path, rank=0)
    for attempt in (1, 2):
        writer.write("start", attempt=attempt)
        writer.write("epoch", epoch=1)
    records, problems = runfolder.read_records(writer.path)
    assert problems == [] and runfolder.attempts(records) == 2
    assert runfolder.read_rank(tmp_path, 0) == records[2:]


def test_a_newer_schema_is_refused_with_the_fix(tmp_path: Path) -> None:
    (tmp_path / runfolder.META).write_text(json.dumps({"schema": 99, "run_id": "x"}))
    with pytest.raises(runfolder.RunFolderError, match="newer than this kit"):
        runfolder.read_meta(tmp_path)
    writer = runfolder.RecordWriter(tmp_path, rank=0)
    writer.write("start")
    with writer.path.open("a") as f:
        f.write(json.dumps({"schema": 99, "kind": "epoch"}) + "\n")
    records, problems = runfolder.read_records(writer.path)
    assert len(records) == 1 and "newer kit" in problems[0]


def test_atomic_file_keeps_the_old_file_when_writing_fails(tmp_path: Path) -> None:
    target = tmp_path / "model.pt"
    target.write_text("old")
    with pytest.raises(RuntimeError), runfolder.atomic_file(target) as partial:
        partial.write_text("half")
        raise RuntimeError("killed mid-write")
    assert target.read_text() == "old" and list(tmp_path.iterdir()) == [target]


@pytest.mark.parametrize(
    ("written", "expected"),
    [
        ([("summary", {"total_seconds": 5})], "COMPLETED"),
        ([("error", {"error": "RuntimeError: boom"})], "FAILED"),
        ([("stop", {"reason": "time limit (SIGUSR2)", "requeue": "7"})], "REQUEUED"),
        (
            [("stop", {"reason": "time limit (SIGUSR2)", "requeue": None, "requeues_used": 3})],
            "TIMEOUT",
        ),
        ([("stop", {"reason": "preemption (SIGTERM)", "requeue": None})], "STOPPED"),
        (  # the last attempt's stop record counts, not the first
            [
                ("stop", {"reason": "time limit (SIGUSR2)", "requeue": "7"}),
                ("stop", {"reason": "time limit (SIGUSR2)", "requeue": None, "requeues_used": 1}),
            ],
            "TIMEOUT",
        ),
        ([], "CANCELLED"),
    ],
)
def test_status_without_slurm_reads_the_state_from_the_run_folder(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    written: list[tuple[str, dict[str, object]]],
    expected: str,
) -> None:
    """A cluster without accounting (and a job gone from the queue): `sacct` and `squeue` are not
    found here at all, so only what the job wrote can tell the states apart."""
    from slurm_ddp_kit.launch.jobs import status

    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))
    cfg = load_config(overrides=[f"output.root={tmp_path}/runs"])
    run_dir = runfolder.create(cfg, launcher="test", backend="slurm", command=[])
    runfolder.update_meta(run_dir, job_id="4242", cancel_requested=not written or None)
    ranks = runfolder.RecordWriter(run_dir, 0)
    ranks.write("start", host="node1", epochs=10, first_epoch=1)
    for kind, fields in written:
        ranks.write(kind, **fields)
    assert status(run_dir).state == expected


def test_status_without_slurm_names_every_node_of_the_last_attempt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two nodes of two ranks each, requeued onto other nodes: the run folder's nodes are each
    node's first rank's, in its last start record (Slurm's node name, not the shared hostname)."""
    from slurm_ddp_kit.launch.jobs import status

    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))
    cfg = load_config(overrides=[f"output.root={tmp_path}/runs"])
    run_dir = runfolder.create(cfg, launcher="test", backend="slurm", command=[])
    runfolder.update_meta(run_dir, job_id="4242")
    for rank in range(4):
        ranks = runfolder.RecordWriter(run_dir, rank)
        for attempt in ("a", "b"):
            node = f"{attempt}{rank // 2 + 1}"
            ranks.write("start", host="vm", node=node, world_size=4, local_world_size=2)
    assert status(run_dir).nodes == "b1,b2"


def test_status_says_what_a_run_noticed_and_how_to_go_on_after_its_last_requeue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))
    cfg = load_config(overrides=[f"output.root={tmp_path}/runs", "cluster.max_requeues=2"])
    run_dir = runfolder.create(cfg, launcher="test", backend="slurm", command=[])
    runfolder.update_meta(run_dir, job_id="4242")
    ranks = runfolder.RecordWriter(run_dir, 0)
    ranks.write("start", host="node1", epochs=10, first_epoch=1, restarts=2)
    ranks.write("notice", text="the time-limit warning came with 58 s of the job's 60 s left")
    ranks.write("stop", reason="time limit (SIGUSR2)", requeue=None, requeues_used=2)
    out = kit_here("launch", "status", str(run_dir)).stdout
    assert " TIMEOUT " in out
    assert f"{run_dir.name}: the time-limit warning came with 58 s of the job's 60 s left\n" in out
    assert (
        f"{run_dir.name}: stopped at its time limit after 2 requeue(s) (cluster.max_requeues=2): "
        f"continue with `python -m launch resume {run_dir}`"
    ) in out


def test_status_says_why_a_run_that_saved_nothing_new_was_not_requeued(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))
    cfg = load_config(overrides=[f"output.root={tmp_path}/runs"])
    run_dir = runfolder.create(cfg, launcher="test", backend="slurm", command=[])
    runfolder.update_meta(run_dir, job_id="4242")
    ranks = runfolder.RecordWriter(run_dir, 0)
    why = "3 attempts in a row saved nothing new (cluster.requeues_without_progress=2)"
    ranks.write("start", host="node1", epochs=10, first_epoch=4, restarts=2)
    ranks.write("stop", reason="time limit (SIGUSR2)", requeue=None, requeues_used=2,
                not_requeued=why)  # fmt: skip
    out = kit_here("launch", "status", str(run_dir)).stdout
    assert " TIMEOUT " in out
    assert (
        f"{run_dir.name}: stopped at its time limit, not requeued: {why}: continue with "
        f"`python -m launch resume {run_dir}`"
    ) in out


@pytest.mark.parametrize(
    ("errors", "named", "words"),
    [
        ({1: "RuntimeError: bug", 0: "RuntimeError: Connection closed by peer"}, 1, "bug"),
        ({0: "RuntimeError: Timed out waiting 10000ms for recv"}, 1, "stopped answering"),
        (  # woken by Slurm to be ended, the stalled rank then loses its peers, but never waited
            {
                0: "RuntimeError: Timed out waiting 10000ms for recv",
                2: "RuntimeError: Timed out waiting 10000ms for recv",
                1: "RuntimeError: Connection reset by peer",
            },
            1,
            "stopped answering",
        ),
    ],
)
def test_the_rank_that_failed_first_is_named(
    tmp_path: Path, errors: dict[int, str], named: int, words: str
) -> None:
    cfg = load_config(overrides=[f"output.root={tmp_path}/runs"])
    run_dir = runfolder.create(cfg, launcher="test", backend="slurm", command=[])
    for rank in range(3):
        runfolder.RecordWriter(run_dir, rank).write("start", host=f"node{rank}", epochs=5)
    for rank, error in errors.items():  # in order of time
        runfolder.RecordWriter(run_dir, rank).write("error", host=f"node{rank}", error=error)
    first = failures.first_failure(run_dir)
    assert first is not None and first["rank"] == named and words in first["error"]


def test_a_rank_that_stood_still_is_named_though_it_timed_out_like_its_peers(
    tmp_path: Path,
) -> None:
    """Woken by Slurm after a SIGSTOP, the stalled rank's own collective times out at once."""
    cfg = load_config(overrides=[f"output.root={tmp_path}/runs"])
    run_dir = runfolder.create(cfg, launcher="test", backend="slurm", command=[])
    for rank, still in ((0, 0.2), (1, 31.0)):
        writer = runfolder.RecordWriter(run_dir, rank)
        writer.write("start", host="node1", epochs=5)
        writer.write(
            "error",
            host="node1",
            error="RuntimeError: Timed out waiting 10000ms",
            stood_still_s=still,
        )
    first = failures.first_failure(run_dir)
    assert first is not None and first["rank"] == 1 and "stood still for 31 s" in first["error"]


SRUN_ABORT = """srun: error: node2: task 2: Aborted (core dumped)
srun: launch/slurm: _step_signal: Terminating StepId=7.0
srun: error: node1: task 0: Killed
srun: error: node1: task 1: Exited with exit code 1
"""


@pytest.mark.parametrize(
    ("srun", "errors", "named", "words"),
    [
        (  # killed by srun for the job's sake, rank 0 is silent, and rank 1 echoes a lost peer
            SRUN_ABORT,
            {1: "RuntimeError: Connection closed by peer"},
            2,
            "aborted (core dumped) (as srun reports it): it recorded no error",
        ),
        (  # a peer's odd error does not outrank srun's word on a signal
            SRUN_ABORT,
            {1: "RuntimeError: gloo read error"},
            2,
            "aborted",
        ),
        (  # a requeued attempt appended: the last terminated step counts
            "srun: error: node1: task 0: Killed\nsrun: Job step aborted\n" + SRUN_ABORT,
            {},
            2,
            "aborted",
        ),
        (  # a stalled rank: its peers time out and exit first; their records decide
            "srun: error: node1: task 0: Exited with exit code 1\n"
            "srun: launch/slurm: _step_signal: Terminating StepId=7.0\n"
            "srun: error: node2: task 2: Killed\n",
            {0: "RuntimeError: Timed out waiting 10000ms", 1: "RuntimeError: Timed out waiting"},
            2,
            "stopped answering",
        ),
        (  # nobody wrote a word: srun's first bad exit
            "srun: error: node2: task 1: Exited with exit code 3\n"
            "srun: launch/slurm: _step_signal: Terminating StepId=7.0\n",
            {},
            1,
            "exited with exit code 3",
        ),
    ],
)
def test_srun_names_the_rank_a_signal_ended(
    tmp_path: Path, srun: str, errors: dict[int, str], named: int, words: str
) -> None:
    """srun's own messages, as the sbatch scripts keep them in logs/srun.err."""
    cfg = load_config(overrides=[f"output.root={tmp_path}/runs"])
    run_dir = runfolder.create(cfg, launcher="sbatch", backend="slurm", command=[])
    (runfolder.logs_dir(run_dir) / runfolder.SRUN_LOG).write_text(srun)
    for rank in range(3):
        runfolder.RecordWriter(run_dir, rank).write("start", host=f"node{rank}", epochs=5)
    for rank, error in errors.items():
        runfolder.RecordWriter(run_dir, rank).write("error", host=f"node{rank}", error=error)
    first = failures.first_failure(run_dir)
    assert first is not None and first["rank"] == named and words in first["error"], first


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_damaged_saved_state_is_one_line_naming_the_file(tmp_path: Path, damage: str) -> None:
    import torch

    from slurm_ddp_kit.train import checkpoint

    cfg = load_config(overrides=[f"output.root={tmp_path}"])
    path = runfolder.state_path(tmp_path)
    path.parent.mkdir(parents=True)
    torch.save({"config_sha256": "0" * 64, "ranks": [{}]}, path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\x00garbage" * 99)
    with pytest.raises(runfolder.RunFolderError, match=r"cannot be read .* start a new run"):
        checkpoint.load(tmp_path, cfg, rank=0, world_size=1)


def test_a_run_made_by_sbatch_then_resumed_shows_both_jobs_logs(tmp_path: Path) -> None:
    cfg = load_config(overrides=[f"output.root={tmp_path}"])
    run_dir = runfolder.create(cfg, launcher="sbatch", backend="slurm", command=[])
    first = Path(runfolder.sbatch_log_pattern(run_dir).replace("%t", "0"))
    resumed = [runfolder.logs_dir(run_dir) / f"7_0_log.{end}" for end in ("out", "err")]
    for path in (first, *resumed):
        path.write_text("a line\n")
    runfolder.update_meta(run_dir, job_id="7", logs=[[str(p) for p in resumed]])
    assert runfolder.log_files(run_dir, 0) == [first, *resumed]
    assert runfolder.log_files(run_dir, 1) == []


def test_a_run_that_failed_then_was_resumed_shows_both_attempts_logs(tmp_path: Path) -> None:
    """`launch logs` after a resume still shows why the attempt before it failed."""
    cfg = load_config(overrides=[f"output.root={tmp_path}"])
    run_dir = runfolder.create(cfg, launcher="launch", backend="local", command=[])
    files = {job: [runfolder.logs_dir(run_dir) / f"{job}_0_log.{end}" for end in ("out", "err")]
             for job in ("5", "7")}  # fmt: skip
    for path in [*files["5"], *files["7"]]:
        path.write_text("a line\n")
    runfolder.update_meta(run_dir, job_id="7", jobs=["5", "7"], logs=[[str(p) for p in files["7"]]])
    assert runfolder.log_files(run_dir, 0) == [*files["5"], *files["7"]]


def test_a_save_on_a_full_disk_says_so_and_keeps_the_state_saved_before(tmp_path: Path) -> None:
    """Files past 64 kB fail to write (EFBIG, as ENOSPC would) while a job saves its state."""
    path = tmp_path / "checkpoints" / "state.pt"
    path.parent.mkdir()
    path.write_bytes(b"the state saved before")
    script = f"""
import resource, torch
from slurm_ddp_kit.train import checkpoint
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))
try:
    checkpoint._write(__import__("pathlib").Path({str(path)!r}), torch.zeros(1 << 20))
except checkpoint.runfolder.RunFolderError as err:
    print(err)
"""
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert f"could not save {path} (" in done.stdout, done.stdout + done.stderr
    assert (
        "MB free there: free space" in done.stdout
        and "the state saved before is kept" in done.stdout
    )
    assert path.read_bytes() == b"the state saved before"
    assert [p.name for p in path.parent.iterdir()] == ["state.pt"]  # no partial file left


def test_a_save_removes_what_a_save_killed_outright_left_of_that_file(tmp_path: Path) -> None:
    """SIGKILL in the middle of a save runs no clean-up: the next save of the file removes the
    partial file (never another file's, which may be written right now)."""
    import torch

    from slurm_ddp_kit.train import checkpoint

    path = tmp_path / "checkpoints" / "state.pt"
    path.parent.mkdir()
    (path.parent / ".state.pt.b8v51u2q.partial").write_bytes(b"")
    (path.parent / ".model.pt.x1y2z3.partial").write_bytes(b"being written")
    checkpoint._write(path, {"epoch": torch.tensor(3)})
    assert sorted(p.name for p in path.parent.iterdir()) == [".model.pt.x1y2z3.partial", "state.pt"]
    assert torch.load(path)["epoch"] == 3


def test_a_launcher_killed_while_making_a_run_leaves_no_staging_behind(tmp_path: Path) -> None:
    """SIGKILL (or SIGTERM's default) runs no clean-up: the next launcher on the host removes a
    dead launcher's staging folder, and leaves a live one's and another host's alone."""
    host = socket.gethostname()
    killed = subprocess.Popen(["sleep", "60"])
    killed.kill()
    killed.wait()
    dead = tmp_path / f"{runfolder.STAGING}{host}-{killed.pid}-abc123"
    live = tmp_path / f"{runfolder.STAGING}{host}-{os.getpid()}-abc123"
    elsewhere = tmp_path / f"{runfolder.STAGING}other-host-{killed.pid}-abc123"
    for folder in (dead, live, elsewhere):
        (folder / "logs").mkdir(parents=True)
    cfg = load_config(overrides=[f"output.root={tmp_path}", "cluster.backend=local"])
    made = runfolder.create(cfg, launcher="launch", backend="local", command=[])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [made.name, live.name, elsewhere.name]
    )


def test_a_run_folder_is_readable_by_the_group(tmp_path: Path) -> None:
    """Made as mkdir and open make files under the user's umask (022 here): a teammate on a
    shared project space can read runs for `status` and `summarize`."""
    old = os.umask(0o022)
    try:
        cfg = load_config(overrides=[f"output.root={tmp_path}", "cluster.backend=local"])
        run_dir = runfolder.create(cfg, launcher="launch", backend="local", command=[])
        runfolder.update_meta(run_dir, job_id="1")
    finally:
        os.umask(old)
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o755
    assert stat.S_IMODE((run_dir / runfolder.META).stat().st_mode) == 0o644


def test_a_moved_run_folder_shows_its_own_logs_not_the_old_places(tmp_path: Path) -> None:
    """run.json keeps the logs' paths where the run was made; a copy (or a moved sweep) reads
    those in its own folder, even while the original is still there."""
    cfg = load_config(overrides=[f"output.root={tmp_path / 'a'}"])
    run_dir = runfolder.create(cfg, launcher="launch", backend="local", command=[])
    made = runfolder.logs_dir(run_dir) / "7_0_log.out"
    elsewhere = tmp_path / "a" / runfolder.SWEEPS / "first" / "8_0_log.err"
    elsewhere.parent.mkdir(parents=True)
    for path in (made, elsewhere):
        path.write_text("the original\n")
    runfolder.update_meta(run_dir, logs=[[str(made), str(elsewhere), 5], "not a list"])
    (tmp_path / "b").mkdir()
    copy = tmp_path / "b" / "renamed"
    subprocess.run(["cp", "-a", str(run_dir), str(copy)], check=True)
    subprocess.run(["cp", "-a", str(elsewhere.parents[1]), str(tmp_path / "b")], check=True)
    assert runfolder.log_files(copy, 0) == [
        copy / "logs" / "7_0_log.out",
        tmp_path / "b" / runfolder.SWEEPS / "first" / "8_0_log.err",
    ]
    assert runfolder.log_files(copy, 1) == []  # a damaged entry: no logs, no error


def test_a_named_pipe_in_a_run_folder_is_damage_not_a_wait(tmp_path: Path) -> None:
    """Readers open run files without blocking: a FIFO in place of run.json or of a rank's
    records is a damaged run (status, summarize), never a command that waits for a writer."""
    cfg = load_config(overrides=[f"output.root={tmp_path}"])
    run_dir = runfolder.create(cfg, launcher="launch", backend="local", command=[])
    runfolder.metrics_path(run_dir, 0).parent.mkdir(exist_ok=True)
    os.mkfifo(runfolder.metrics_path(run_dir, 0))
    assert runfolder.read_records(runfolder.metrics_path(run_dir, 0)) == (
        [],
        [f"{runfolder.metrics_path(run_dir, 0)}: cannot be read (not a regular file), skipped"],
    )
    (run_dir / runfolder.META).unlink()
    os.mkfifo(run_dir / runfolder.META)
    with pytest.raises(runfolder.RunFolderError, match=r"not a regular file.*damaged"):
        runfolder.read_meta(run_dir)
    for command in (["launch", "status"], ["analysis", "summarize"]):
        done = kit(*command, str(run_dir), timeout=60)  # a read that blocked would time out
        assert done.returncode in (1, 2) and "the run folder is damaged" in done.stderr


def test_a_refused_resume_leaves_nothing_in_the_folder_it_was_given(tmp_path: Path) -> None:
    (tmp_path / "runs").mkdir()
    for given in (tmp_path / "runs", tmp_path / "nothing"):
        done = kit_here("launch", "resume", str(given))
        assert done.returncode == 2
        assert done.stderr == (
            f"error: {given} is not a run folder (no run.json): pass a run folder (made under "
            "output.root, runs/ by default)\n"
        )
    assert list((tmp_path / "runs").iterdir()) == []
    cfg = load_config(overrides=[f"output.root={tmp_path}/sweep"])
    run_dir = runfolder.create(cfg, launcher="test", backend="local", command=[])
    for command in ("resume", "logs"):  # a sweep's root: one of its runs is meant
        done = kit_here("launch", command, str(tmp_path / "sweep"))
        assert done.returncode == 2, done.stderr
        assert f"is not a run folder but holds 1: pass one of them, e.g. {run_dir}" in done.stderr


def test_a_run_resumes_under_a_newer_kit_but_not_with_its_settings_edited(tmp_path: Path) -> None:
    """A saved state names its run's settings by the text of its config.yaml: the same text
    older kits hashed (the config written back as YAML), whatever settings a newer kit's schema
    adds; a hand edit of the file is refused."""
    from slurm_ddp_kit.core.settings.loading import to_yaml
    from slurm_ddp_kit.train import checkpoint

    cfg = load_config(overrides=[f"output.root={tmp_path}"])
    run_dir = runfolder.create(cfg, launcher="launch", backend="local", command=[])
    loaded = runfolder.load_job_config(run_dir)
    older = hashlib.sha256(to_yaml(loaded).encode()).hexdigest()
    assert checkpoint.config_hash(run_dir) == older
    path = runfolder.state_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    import torch

    mine = {"progress": asdict(checkpoint.Progress()), "rng": checkpoint.rng_state()}
    torch.save({"config_sha256": older, "ranks": [mine], "model": {}, "optimizer": {},
                "scaler": {}}, path)  # fmt: skip
    assert checkpoint.load(run_dir, loaded, rank=0, world_size=1) is not None
    config = run_dir / runfolder.CONFIG
    config.write_text(config.read_text().replace("epochs: 10", "epochs: 11"))
    with pytest.raises(runfolder.RunFolderError, match="saved with other settings"):
        checkpoint.load(run_dir, loaded, rank=0, world_size=1)
