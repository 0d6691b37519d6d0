"""The run folder module: made whole or not at all, never replacing a run, atomic writes."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from kit import REPO

from train import runfolder
from train.config import load_config


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
    from launch.jobs import status

    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))
    cfg = load_config(overrides=[f"output.root={tmp_path}/runs"])
    run_dir = runfolder.create(cfg, launcher="test", backend="slurm", command=[])
    runfolder.update_meta(run_dir, job_id="4242", cancel_requested=not written or None)
    ranks = runfolder.RecordWriter(run_dir, 0)
    ranks.write("start", host="node1", epochs=10, first_epoch=1)
    for kind, fields in written:
        ranks.write(kind, **fields)
    assert status(run_dir).state == expected


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
    first = runfolder.first_failure(run_dir)
    assert first is not None and first["rank"] == named and words in first["error"]


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_damaged_saved_state_is_one_line_naming_the_file(tmp_path: Path, damage: str) -> None:
    import torch

    from train import resume

    cfg = load_config(overrides=[f"output.root={tmp_path}"])
    path = runfolder.state_path(tmp_path)
    path.parent.mkdir(parents=True)
    torch.save({"config_sha256": resume.config_hash(cfg), "ranks": [{}]}, path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\x00garbage" * 99)
    with pytest.raises(runfolder.RunFolderError, match=r"cannot be read .* start a new run"):
        resume.load(tmp_path, cfg, rank=0, world_size=1)


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


def test_a_save_on_a_full_disk_says_so_and_keeps_the_state_saved_before(tmp_path: Path) -> None:
    """Files past 64 kB fail to write (EFBIG, as ENOSPC would) while a job saves its state."""
    path = tmp_path / "checkpoints" / "state.pt"
    path.parent.mkdir()
    path.write_bytes(b"the state saved before")
    script = f"""
import resource, torch
from train import resume
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))
try:
    resume._write(__import__("pathlib").Path({str(path)!r}), torch.zeros(1 << 20))
except resume.runfolder.RunFolderError as err:
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
