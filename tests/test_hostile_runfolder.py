"""A run folder is data (issue 42): one that another user crafted runs no code, names nothing to
signal, cancel or read outside itself, and leads no write out of itself. Each case is what a user
would see: exit code 2 and one line naming the fix, and nothing executed, signalled, printed or
written elsewhere."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from kit import SMALL, kit, kit_here, one_error_line

from slurm_ddp_kit.core import runfolder, slurm
from slurm_ddp_kit.core.settings.loading import load_config


class _Planted:
    """What a crafted pickle holds: unpickling it touches `marker` (it runs code)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def _run_dir(tmp_path: Path, backend: str = "local") -> Path:
    cfg = load_config(overrides=[f"output.root={tmp_path}/runs", f"cluster.backend={backend}"])
    return runfolder.create(cfg, launcher="launch", backend=backend, command=[])


def _edit_meta(run_dir: Path, **fields: object) -> None:
    """Set run.json's fields as a hand (or another user) would."""
    meta = json.loads((run_dir / "run.json").read_text()) | fields
    (run_dir / "run.json").write_text(json.dumps(meta))


# --- 1. a checkpoint runs no code ---------------------------------------------------------


@pytest.mark.timeout(300)
def test_resume_from_a_crafted_checkpoint_runs_nothing(tmp_path: Path) -> None:
    """`launch resume --wait` of a folder whose state.pt would run code when unpickled: the job
    refuses it in one line naming the file, and the code never ran, in any rank."""
    made = kit_here(
        "launch", "prepare", "--mode", "ddp", f"output.root={tmp_path}/runs",
        f"data.root={tmp_path}/data", "cluster.backend=local", *SMALL,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    run_dir = Path(made.stdout.strip().splitlines()[-1])
    marker = tmp_path / "ran"
    state = runfolder.state_path(run_dir)
    state.parent.mkdir()
    import torch

    torch.save({"ranks": [_Planted(marker)]}, state)
    done = kit("launch", "resume", str(run_dir), "--wait")
    assert done.returncode != 0, done.stdout
    assert f"{state} holds posix.system" in done.stdout + done.stderr, done.stdout + done.stderr
    assert "loading it could run code" in done.stdout + done.stderr
    assert not marker.exists()


def test_the_saved_rng_state_loads_without_any_allowed_class(tmp_path: Path) -> None:
    """What the kit saves loads with torch's weights_only unpickler and nothing allowed; a
    checkpoint of an earlier kit (NumPy's state as an array) still loads."""
    import random

    import numpy as np
    import torch

    from slurm_ddp_kit.train import checkpoint

    path = tmp_path / "state.pt"
    torch.save({"rng": checkpoint.rng_state()}, path)
    before = np.random.random()
    checkpoint.set_rng_state(torch.load(path, weights_only=True)["rng"])
    assert np.random.random() == before
    torch.save({"rng": {"python": random.getstate(), "numpy": np.random.get_state()}}, path)
    assert isinstance(checkpoint._load_data(path)["rng"]["numpy"][1], np.ndarray)


def test_crafted_shards_metadata_runs_nothing(tmp_path: Path) -> None:
    """FSDP's shards folder: its .metadata (a pickle) is read with the metadata's types alone."""
    from slurm_ddp_kit.core.strategies.fsdp import shards_reader

    marker = tmp_path / "ran"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Planted(marker)))
    with pytest.raises(runfolder.RunFolderError, match=r"names posix\.system, which a shards"):
        shards_reader(tmp_path).read_metadata()
    assert not marker.exists()


# --- 2. run.json names no Slurm command's argument ----------------------------------------


@pytest.fixture
def fake_slurm(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """scancel, squeue, sacct and scontrol that write their arguments to a file and answer
    nothing: what the kit would have run."""
    bin_dir, said = tmp_path / "bin", tmp_path / "slurm-args"
    bin_dir.mkdir()
    for name in ("scancel", "squeue", "sacct", "scontrol"):
        script = bin_dir / name
        script.write_text(f'#!/bin/sh\necho "{name} $*" >> {said}\n')
        script.chmod(0o755)
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=fake\n")
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_CONF": str(conf)}
    return env, said


@pytest.mark.parametrize("job_id", ["--user=root", "1 2", "12_x", "-5"])
def test_a_job_id_that_is_not_slurms_reaches_no_slurm_command(
    tmp_path: Path, fake_slurm: tuple[dict[str, str], Path], job_id: str
) -> None:
    env, said = fake_slurm
    run_dir = _run_dir(tmp_path, backend="slurm")
    _edit_meta(run_dir, job_id=job_id)
    for command in ("cancel", "status"):
        message = one_error_line(kit_here("launch", command, str(run_dir), env=env))
        assert f"its job id {job_id!r} is not a Slurm job id" in message, message
        assert "put the job's own id back" in message
    assert not said.exists(), said.read_text()


def test_slurm_commands_take_job_ids_after_their_options_end(
    fake_slurm: tuple[dict[str, str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the command takes `--`, ids follow it; squeue's and sacct's `-j` would read a
    following `--user=root` as an option, so their ids are attached: `--jobs=ID`."""
    env, said = fake_slurm
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    slurm.cancel("12")
    slurm.requeue("12_3")
    slurm.states(["12", "13_4"])
    lines = said.read_text().splitlines()
    assert lines[:2] == ["scancel -v -- 12", "scontrol requeue -- 12_3"]
    assert lines[2].startswith("squeue -h -r -t all --jobs=12,13_4 ")
    assert lines[3].startswith("sacct --jobs=12,13_4,13 ")
    with pytest.raises(slurm.JobIdError, match="'--user=root' is not a Slurm job id"):
        slurm.cancel("--user=root")


# --- 3. run.json names no process to signal -----------------------------------------------


def test_a_process_named_by_run_json_is_not_signalled_nor_running(tmp_path: Path) -> None:
    """Another process's PID and start time written into run.json: `status` does not call the
    run RUNNING and `cancel` does not signal it (it is not provably the kit's: its environment
    names no job of this run folder)."""
    from slurm_ddp_kit.core.processes import identity as process_identity

    run_dir = _run_dir(tmp_path)
    stranger = subprocess.Popen(["sleep", "60"])
    try:
        identity = process_identity(stranger.pid)
        assert identity
        _edit_meta(run_dir, job_id=str(stranger.pid), job_process=identity, jobs=[])
        status = kit_here("launch", "status", str(run_dir))
        assert status.returncode == 0, status.stderr
        assert "RUNNING" not in status.stdout, status.stdout
        cancelled = kit_here("launch", "cancel", str(run_dir))
        assert cancelled.returncode == 0, cancelled.stderr
        assert "had already ended" in cancelled.stdout, cancelled.stdout
        assert stranger.poll() is None  # never signalled
    finally:
        stranger.kill()
        stranger.wait()


# --- 4. run.json names no file to print ---------------------------------------------------


def test_logs_recorded_outside_the_run_folder_are_refused(tmp_path: Path) -> None:
    run_dir = _run_dir(tmp_path)
    _edit_meta(run_dir, job_id="4242", logs=[["/etc/passwd", "/etc/passwd"]])
    done = kit_here("launch", "logs", str(run_dir), "--rank", "0")
    message = one_error_line(done)
    assert "names the log /etc/passwd, outside the run's logs folder" in message, message
    assert "root:" not in done.stdout


def test_a_log_linked_out_of_the_run_folder_is_refused(tmp_path: Path) -> None:
    run_dir = _run_dir(tmp_path)
    log = runfolder.logs_dir(run_dir) / "4242_0_log.out"
    log.symlink_to("/etc/passwd")
    _edit_meta(run_dir, job_id="4242", logs=[[str(log), str(log.with_suffix(".err"))]])
    done = kit_here("launch", "logs", str(run_dir), "--rank", "0")
    message = one_error_line(done)
    assert f"{log} leads out of the run folder (to /etc/passwd)" in message, message
    assert "remove the link" in message and "root:" not in done.stdout


# --- 5. no write follows a link out of the run folder -------------------------------------


def test_records_are_not_appended_through_a_link(tmp_path: Path) -> None:
    run_dir = _run_dir(tmp_path)
    outside = tmp_path / "outside.jsonl"
    outside.write_text("theirs\n")
    path = runfolder.metrics_path(run_dir, 0)
    path.parent.mkdir()
    path.symlink_to(outside)
    with pytest.raises(runfolder.RunFolderError, match=f"{path} is a symbolic link: the kit"):
        runfolder.RecordWriter(run_dir, 0).write("notice", text="hello")
    assert outside.read_text() == "theirs\n"


@pytest.mark.parametrize("linked", [runfolder.CLAIM, runfolder.LOGS, runfolder.METRICS])
def test_resume_refuses_a_run_folder_with_a_link_where_it_writes(
    tmp_path: Path, linked: str
) -> None:
    """`launch resume` checks before it writes anything: the claim file, the logs the job
    writes, the records; the link's target is left as it was (not made, nothing in it)."""
    run_dir = _run_dir(tmp_path)
    target = tmp_path / "elsewhere"
    if linked != runfolder.CLAIM:
        target.mkdir()
    path = run_dir / linked
    if path.is_dir():
        path.rmdir()
    path.symlink_to(target)
    before = (run_dir / "run.json").read_bytes()
    message = one_error_line(kit_here("launch", "resume", str(run_dir)))
    assert f"{path} is a symbolic link" in message and "remove it" in message, message
    assert not target.exists() or list(target.iterdir()) == []
    assert (run_dir / "run.json").read_bytes() == before


# --- 6. caches read back only what this user wrote, and run no code -----------------------


def _planted(path: Path, marker: Path) -> None:
    """A pickle that runs code, where another user could have put it: a link to a group-writable
    file (a file of another user reads the same to the kit: not this user's alone)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    planted = path.parent.parent / "planted"
    planted.write_bytes(pickle.dumps(_Planted(marker)))
    planted.chmod(0o666)
    path.symlink_to(planted)


def test_a_planted_summary_cache_is_passed_over_and_rewritten(tmp_path: Path) -> None:
    from slurm_ddp_kit.analysis.cache import Kept

    marker, path = tmp_path / "ran", tmp_path / "cache" / "kit" / "summarize" / "k.pickle"
    _planted(path, marker)
    kept = Kept(path)
    assert kept.entries == {} and not marker.exists()
    kept.put(tmp_path, ("fingerprint",), ({"row": 1}, []))
    kept.save()
    assert not path.is_symlink() and path.stat().st_mode & 0o777 == 0o600
    assert Kept(path).entries == {str(tmp_path): (("fingerprint",), ({"row": 1}, []))}


def test_the_users_own_summary_cache_still_builds_no_object(tmp_path: Path) -> None:
    from slurm_ddp_kit.analysis.cache import Kept

    marker, path = tmp_path / "ran", tmp_path / "summarize" / "k.pickle"
    path.parent.mkdir(mode=0o700)
    path.write_bytes(pickle.dumps(_Planted(marker)))
    path.chmod(0o600)
    assert Kept(path).entries == {} and not marker.exists()


def test_a_planted_trial_mark_is_not_taken_for_a_passed_trial(tmp_path: Path) -> None:
    from slurm_ddp_kit.launch import checks

    mark = tmp_path / "tried" / "key"
    mark.parent.mkdir()
    mark.write_text(json.dumps({"train_samples": 5}))
    mark.chmod(0o666)  # anyone could have written it
    assert checks._remembered(mark) is None
    checks._remember(mark, 7)
    assert checks._remembered(mark) == ("", 7)


def test_a_planted_compile_cache_is_not_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Compiled artifacts are code: loaded only from a file of this user's alone."""
    import torch

    from slurm_ddp_kit.train import compile_cache

    loaded: list[bytes] = []
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", loaded.append)
    path = tmp_path / "compile-cache" / "key" / "cuda0.bin"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"artifacts")
    path.chmod(0o664)
    assert compile_cache.load(path) == "cold" and loaded == []
    assert "not a file of this user's alone" in caplog.text


def _pickled(path: Path, value: object, group_writable: bool = False) -> None:
    path.write_bytes(pickle.dumps(value))
    path.chmod(0o664 if group_writable else 0o644)


def test_a_task_result_is_read_as_plain_data_and_a_planted_one_runs_nothing(
    tmp_path: Path,
) -> None:
    """`--wait` reads each task's result from submitit's files without submitit's unpickler: a
    planted result builds no object; another's (here: group-writable) file is not read."""
    import submitit

    from slurm_ddp_kit.launch.backends import SubmitError
    from slurm_ddp_kit.launch.follow import _result

    logs, marker = tmp_path / "logs", tmp_path / "ran"
    logs.mkdir(mode=0o755)
    job = submitit.LocalJob(folder=logs, job_id="77", tasks=(0, 1))
    results = [job.task(rank).paths.result_pickle for rank in (0, 1)]
    _pickled(results[0], ("success", {"final_test_accuracy": 0.9}))
    _pickled(results[1], ("success", None))
    assert _result(job) == {"final_test_accuracy": 0.9}
    _pickled(results[1], ("error", "Traceback …\nValueError: rank 1 broke"))
    with pytest.raises(SubmitError, match="task 1 failed:\nTraceback …\nValueError: rank 1 broke"):
        _result(job)
    _pickled(results[1], ("success", _Planted(marker)))
    with pytest.raises(SubmitError, match=r"task 1 left no result to read .*only plain data"):
        _result(job)
    _pickled(results[1], ("success", None), group_writable=True)
    with pytest.raises(SubmitError, match=r"task 1 left no result to read .*writable by others"):
        _result(job)
    assert not marker.exists()


@pytest.mark.parametrize("where", ["file", "folder"])
def test_a_job_pickle_others_could_write_is_not_loaded(tmp_path: Path, where: str) -> None:
    """A task's start (`train.start`) loads submitit's job pickle only where no one but the user
    could have written it (the file and its folder): one line, and the pickle's code never runs."""
    logs, marker = tmp_path / "logs", tmp_path / "ran"
    logs.mkdir(mode=0o755)
    submitted = logs / "77_submitted.pkl"
    _pickled(submitted, _Planted(marker), group_writable=where == "file")
    if where == "folder":
        logs.chmod(0o775)
    env = {
        **os.environ, "SUBMITIT_EXECUTOR": "local", "SUBMITIT_LOCAL_JOB_ID": "77",
        "SUBMITIT_LOCAL_NTASKS": "1", "SUBMITIT_LOCAL_JOB_NUM_NODES": "1",
        "SUBMITIT_LOCAL_NODEID": "0", "SUBMITIT_LOCAL_GLOBALID": "0", "SUBMITIT_LOCAL_LOCALID": "0",
    }  # fmt: skip
    done = kit("slurm_ddp_kit.train.start", "-u", "-m", "submitit.core._submit", str(logs), env=env)
    assert done.returncode == 1 and not marker.exists(), done.stdout + done.stderr
    assert done.stderr.splitlines()[-1] == (
        f"error: {submitted} is not a file of this user's alone (a link, another user's, or "
        "writable by others, or in such a folder): the job will not load it (a pickle runs "
        "code); make the run's logs folder writable by you alone (chmod go-w) and resume the run"
    )


# --- 7. readers survive any run.json ------------------------------------------------------


def _oversized(run_dir: Path, how: str) -> str:
    """A run.json nested 100,000 deep, or of 100 MB (valid JSON both): what its error line says."""
    path = run_dir / "run.json"
    if how == "deep":
        path.write_text('{"schema": 1, "jobs": ' + "[" * 100_000 + "]" * 100_000 + "}")
        return f"{path} nests lists or objects over 16 levels deep"
    meta = json.loads(path.read_text()) | {"notes": "x" * 100_000_000}
    path.write_text(json.dumps(meta))
    return f"{path} is {path.stat().st_size:,} bytes (67,108,864 at most)"


@pytest.mark.parametrize("how", ["deep", "large"])
def test_a_run_json_too_deep_or_too_large_is_one_line_in_every_command(
    tmp_path: Path, how: str
) -> None:
    """No RecursionError, no 100 MB read: one line naming the file, what is wrong and the fix;
    nothing written into the folder."""
    run_dir = _run_dir(tmp_path)
    said = _oversized(run_dir, how)
    before = sorted(p.name for p in run_dir.iterdir()), (run_dir / "run.json").stat().st_mtime_ns
    for command in ("status", "logs", "cancel", "resume"):
        message = one_error_line(kit_here("launch", command, str(run_dir)))
        assert said in message, (command, message)
        assert "more than any run record of this kit" in message
        assert "put back a good copy of run.json, or start a new run" in message
    after = sorted(p.name for p in run_dir.iterdir()), (run_dir / "run.json").stat().st_mtime_ns
    assert after == before


def test_summarize_skips_a_run_json_too_deep_and_summarizes_the_others(
    small_runs: dict[str, Path], tmp_path: Path
) -> None:
    root = tmp_path / "runs"
    good = [Path(shutil.copytree(small_runs[m], root / small_runs[m].name)) for m in ("dp", "ddp")]
    bad = Path(shutil.copytree(small_runs["dp-256"], root / small_runs["dp-256"].name))
    said = _oversized(bad, "deep")
    done = kit_here("analysis", "summarize", str(root))
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert all(run.name in done.stdout for run in good) and bad.name not in done.stdout
    assert f"skipped {bad}: cannot read it: {said}" in done.stderr, done.stderr


def test_wait_says_n_m_for_an_epochs_null_figures(tmp_path: Path) -> None:
    """`--wait`'s epoch line (and its last line) for records whose figures are null, as the record
    checks allow (a hand edit, another writer of a group-writable folder): n/m, no traceback."""
    from slurm_ddp_kit.launch.follow import _show_epochs, _Shown, result_words

    run_dir = _run_dir(tmp_path)
    writer = runfolder.RecordWriter(run_dir, 0)
    writer.write("start", world_size=2, epochs=3, first_epoch=1)
    nulls = dict.fromkeys(("train_loss", "test_loss", "test_accuracy"), None)
    writer.write("epoch", epoch=1, seconds=2.0, samples=None, **nulls)
    writer.write("epoch", epoch=2, seconds=None, samples=512, train_loss=2.5, test_loss=None)
    said: list[str] = []
    _show_epochs(run_dir, _Shown(), said.append)
    assert said[1:] == [
        "epoch 1/3: 2.00 s, n/m samples/s, train loss n/m, test loss n/m, accuracy n/m",
        "epoch 2/3: time n/m (split across attempts), train loss 2.5000, test loss n/m, "
        "accuracy n/m",
    ]
    summary = {"final_test_accuracy": None, "final_test_loss": None, "train_seconds": None}
    assert result_words(summary) == "test accuracy n/m, test loss n/m, n/m s training"


# --- 8. a checkpoint of another layout is one line in the rank's error --------------------


def _kit_state(run_dir: Path, **changed: object) -> dict[str, Any]:
    """What `checkpoint.save` writes for a 1-rank run at the start of epoch 2, as a crafted file
    would pass for it (the config's hash is the folder's own), with `changed` fields."""
    from dataclasses import asdict

    from slurm_ddp_kit.train import checkpoint

    mine = {"progress": asdict(checkpoint.Progress(epoch=2)), "rng": checkpoint.rng_state()}
    state = {"schema": 1, "config_sha256": checkpoint.config_hash(run_dir), "ranks": [mine]}
    return state | {"model": {}, "optimizer": {}, "scaler": {}} | changed


STATE_LAYOUTS = {
    "a list": (lambda run_dir: [1, 2], "(a list, not the kit's saved state)"),
    "no ranks": (lambda run_dir: _kit_state(run_dir, ranks=None), "(it has a NoneType as 'ranks'"),
    "another model": (
        lambda run_dir: _kit_state(run_dir, model={"w": [0.0]}),
        '(RuntimeError: Error(s) in loading state_dict for ConvNet: Missing key(s) in state_dict: "conv1.weight"',
    ),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", list(STATE_LAYOUTS))
def test_a_state_of_another_layout_fails_the_rank_in_one_line(tmp_path: Path, layout: str) -> None:
    """A valid torch file that is not the kit's state (loaded safely, weights_only): the resumed
    rank fails with one line naming the file and the fix, which --wait and status show; no
    KeyError or TypeError traceback from deep in the loop."""
    import torch

    made = kit_here(
        "launch", "prepare", "--mode", "ddp", f"output.root={tmp_path}/runs",
        f"data.root={tmp_path}/data", "cluster.backend=local", "cluster.gpus_per_node=1", *SMALL,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    run_dir = Path(made.stdout.strip().splitlines()[-1])
    state = runfolder.state_path(run_dir)
    state.parent.mkdir()
    crafted, said = STATE_LAYOUTS[layout]
    torch.save(crafted(run_dir), state)
    line = f"{state} is no training state this run can resume from {said}"
    fix = "delete it to start the run over from epoch 1, or put back a good copy of it"
    done = kit("launch", "resume", str(run_dir), "--wait")
    assert done.returncode == 1, done.stdout + done.stderr
    failed = next(x for x in done.stdout.splitlines() if " failed: rank 0 " in x)
    assert line in failed and fix in failed, done.stdout
    assert "Traceback" not in done.stdout + done.stderr
    status = kit_here("launch", "status", str(run_dir))
    assert line in status.stdout and fix in status.stdout, status.stdout


@pytest.mark.parametrize(
    ("changed", "said"),
    [
        ({"shards": "../../elsewhere"}, "its shards folder '../../elsewhere' is no folder name"),
        ({"scaler": [1]}, "it has a list as 'scaler', not a dict"),
        ({"ranks": ["x"]}, "rank 0's entry is a str, not a dict"),
        ({"ranks": [{"progress": {}, "rng": {}}]}, "rank 0's entry's rng has no 'torch'"),
        (
            {"progress": {"epoch": 2, "batches": -1, "loss_sum": 0.0, "samples": 0}},
            "rank 0's entry's progress has -1 as 'batches', below 0",
        ),
        (
            {"progress": {"epoch": True, "batches": 0, "loss_sum": 0.0, "samples": 0}},
            "rank 0's entry's progress has True as 'epoch', not a number",
        ),
        ({"progress": {"epoch": 2}}, "rank 0's entry's progress names ['epoch'], not"),
    ],
)
def test_every_field_of_the_state_the_loop_reads_is_checked(
    tmp_path: Path, changed: dict[str, Any], said: str
) -> None:
    import torch

    from slurm_ddp_kit.train import checkpoint

    run_dir = _run_dir(tmp_path)
    state = _kit_state(run_dir)
    if "progress" in changed:
        state["ranks"][0]["progress"] = changed.pop("progress")
    runfolder.state_path(run_dir).parent.mkdir()
    torch.save(state | changed, runfolder.state_path(run_dir))
    cfg = runfolder.load_job_config(run_dir)
    with pytest.raises(runfolder.RunFolderError, match="delete it to start the run over") as err:
        checkpoint.load(run_dir, cfg, rank=0, world_size=1)
    assert said in str(err.value), err.value
    torch.save(_kit_state(run_dir), runfolder.state_path(run_dir))
    assert checkpoint.load(run_dir, cfg, rank=0, world_size=1) is not None  # the kit's own loads


@pytest.mark.parametrize("dropped", ["time", "host"])
def test_a_record_without_a_field_readers_index_is_skipped_with_a_warning(
    tmp_path: Path, dropped: str
) -> None:
    """A start record cut by hand (or another tool's) that lacks its time is skipped with one
    warning naming the field, as a record of a wrong type is; one without its host is read (the
    node shows as ?). Never a KeyError."""
    run_dir = _run_dir(tmp_path)
    start = {"schema": 1, "kind": "start", "time": 1.0, "rank": 0, "host": "n1", "world_size": 1}
    start.pop(dropped)
    metrics = run_dir / "metrics"
    metrics.mkdir(exist_ok=True)
    (metrics / "rank-00000.jsonl").write_text(json.dumps(start) + "\n")
    status = kit_here("launch", "status", str(run_dir))
    assert status.returncode == 0 and "Traceback" not in status.stderr, status.stderr
    skipped = f"record skipped: it has no {dropped}" in status.stderr
    assert skipped == (dropped == "time"), status.stderr
    logs = kit_here("launch", "logs", str(run_dir))  # the warning is said once a process
    assert "Traceback" not in logs.stderr and "KeyError" not in logs.stderr, logs.stderr
