"""DP and DDP end to end through submitit's LocalExecutor: real processes, gloo, real files."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from pathlib import Path

import pytest
import torch
from kit import SMALL, alive, kit, load_split, records, run_folder, submit_without_pipes, wait_for
from paced import LASTING

from slurm_ddp_kit.core import strategies
from slurm_ddp_kit.train.model import ConvNet

LOCAL = ["cluster.backend=local", "cluster.gpus_per_node=2"]


def _state(run_dir: Path) -> str:
    done = kit("launch", "status", str(run_dir))
    assert done.returncode == 0, done.stderr
    header, row = (line.split() for line in done.stdout.splitlines()[:2])
    return row[header.index("STATE")]


def _children(pid: int) -> list[int]:
    with contextlib.suppress(OSError):
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return []


def _stop(pids: list[int]) -> None:
    """Leave no process of the test's job behind, whatever the test found."""
    for sig in (signal.SIGINT, signal.SIGKILL):
        for pid in pids:
            if alive(pid):
                with contextlib.suppress(OSError):
                    os.kill(pid, sig)
        if wait_for(lambda: not any(alive(p) for p in pids), 10):
            return


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_local_cancel_ends_a_running_job(tmp_path: Path) -> None:
    done = submit_without_pipes(
        tmp_path,
        "--mode",
        "ddp",
        *LOCAL,
        *LASTING,
        "train.epochs=50",
        f"output.root={tmp_path}/runs",
        f"data.root={tmp_path}/data",
    )
    assert done.returncode == 0, done.stdout
    run_dir = run_folder(done.stdout)
    pid = int(json.loads((run_dir / "run.json").read_text())["job_id"])
    tasks: list[int] = []
    try:
        assert _state(run_dir) == "RUNNING"
        started = [run_dir / "metrics" / f"rank-{rank:05d}.jsonl" for rank in (0, 1)]
        assert wait_for(lambda: all(p.is_file() for p in started), 60), "the tasks never started"
        tasks = _children(pid)
        assert len(tasks) == 2  # one per rank

        cancelled = kit("launch", "cancel", str(run_dir))
        assert cancelled.returncode == 0, cancelled.stderr
        assert cancelled.stdout.strip() == f"{run_dir.name}: cancelled local job {pid}"

        assert wait_for(lambda: _state(run_dir) == "CANCELLED", 60)  # seconds when quiet
        # The controller ends its tasks (SIGINT, then SIGKILL) before it ends itself; on a busy
        # machine the last of them may take a moment more to go.
        assert wait_for(lambda: not alive(pid) and not any(alive(t) for t in tasks), 15)
        assert "summary" not in [r["kind"] for r in records(run_dir)]
    finally:
        _stop([pid, *tasks])


def _submit(tmp: Path, *args: str, env: dict[str, str] | None = None) -> tuple[Path, str]:
    done = kit(
        "launch",
        "submit",
        *args,
        *SMALL,
        "cluster.backend=local",
        f"output.root={tmp}/runs",
        f"data.root={tmp}/data",
        "--wait",
        env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return run_folder(done.stdout), done.stdout


@pytest.fixture(scope="module")
def runs(
    tmp_path_factory: pytest.TempPathFactory, small_runs_said: dict[str, tuple[Path, str]]
) -> dict[str, tuple[Path, str]]:
    """The shared DP and DDP runs (conftest: the DDP one made with torchrun's variables left in
    its environment, STRAY), and one with gradient accumulation and bf16 of this file's own."""
    tmp = tmp_path_factory.mktemp("local")
    return {
        "dp": small_runs_said["dp"],
        "ddp": small_runs_said["ddp"],
        "ddp-accum": _submit(
            tmp,
            "--mode",
            "ddp",
            "cluster.gpus_per_node=2",
            "train.grad_accum_steps=2",
            "train.precision=bf16",
        ),
    }


def test_wait_prints_one_line_per_epoch_and_the_result(runs: dict[str, tuple[Path, str]]) -> None:
    _, out = runs["ddp"]
    assert out.startswith("submitted job ")
    assert "epoch 1/2:" in out and "epoch 2/2:" in out and "samples/s" in out
    assert "done: test accuracy" in out.splitlines()[-1]


def test_run_folder_holds_config_meta_and_one_file_per_rank(
    runs: dict[str, tuple[Path, str]],
) -> None:
    run_dir, _ = runs["ddp"]
    assert "gpus_per_node: 2" in (run_dir / "config.yaml").read_text()
    meta = json.loads((run_dir / "run.json").read_text())
    assert (meta["mode"], meta["backend"], meta["launcher"]) == ("ddp", "local", "launch")
    assert meta["job_id"]
    assert sorted(p.name for p in (run_dir / "metrics").iterdir()) == [
        "rank-00000.jsonl",
        "rank-00001.jsonl",
    ]


@pytest.mark.parametrize("name", ["ddp", "ddp-accum"])
def test_ddp_ranks_train_in_step(runs: dict[str, tuple[Path, str]], name: str) -> None:
    run_dir, _ = runs[name]
    # Rank 0's progress records come every output.progress_s: on a slow machine, within epochs.
    per_rank = [[r for r in records(run_dir, rank) if r["kind"] != "progress"] for rank in (0, 1)]
    for rank, recs in enumerate(per_rank):
        assert [r["kind"] for r in recs] == ["start", "epoch", "epoch", "summary"]
        start = recs[0]
        assert (start["rank"], start["world_size"], start["backend"], start["per_rank_batch"]) == (
            rank,
            2,
            "gloo",
            256 // (2 if name == "ddp-accum" else 1),
        )
        assert recs[1]["samples"] == 512  # DistributedSampler: each rank half of 1024
    summaries = [recs[-1] for recs in per_rank]
    assert summaries[0]["parameters_sha256"] == summaries[1]["parameters_sha256"]
    assert summaries[0]["final_test_accuracy"] == summaries[1]["final_test_accuracy"]


def test_dp_is_one_process_holding_the_whole_batch(runs: dict[str, tuple[Path, str]]) -> None:
    run_dir, _ = runs["dp"]
    start, *_, summary = records(run_dir)
    assert (start["mode"], start["world_size"], start["backend"], start["per_rank_batch"]) == (
        "dp",
        1,
        "none",
        512,
    )
    assert summary["checkpoint"] == "checkpoints/model.pt"
    assert not (run_dir / "metrics" / "rank-00001.jsonl").exists()


@pytest.mark.parametrize("name", [c.key for c in strategies.columns() if c.always_shown])
def test_checkpoint_loads_into_a_bare_model(runs: dict[str, tuple[Path, str]], name: str) -> None:
    run_dir, _ = runs[name]
    model = ConvNet()
    model.load_state_dict(
        torch.load(run_dir / "checkpoints" / "model.pt")
    )  # strict: no `module.` keys
    test = load_split(next((run_dir.parent.parent / "data").iterdir()), train=False)
    model.eval()
    with torch.no_grad():
        accuracy = (model(test.tensors[0]).argmax(1) == test.tensors[1]).float().mean().item()
    assert accuracy == pytest.approx(records(run_dir)[-1]["final_test_accuracy"], abs=1e-6)


def test_failed_job_reports_its_error_and_keeps_the_run_folder(tmp_path: Path) -> None:
    data = tmp_path / "data" / "synthetic-v2-seed0-1024-256" / "MNIST" / "raw"
    data.mkdir(parents=True)
    (data / "train-images-idx3-ubyte").write_bytes(b"\x00\x00\x08\x03garbage")
    done = kit(
        "launch",
        "submit",
        "--mode",
        "ddp",
        *SMALL,
        "cluster.gpus_per_node=2",
        "cluster.backend=local",
        f"output.root={tmp_path}/runs",
        f"data.root={tmp_path}/data",
        "--wait",
    )
    assert done.returncode == 1
    assert "failed" in done.stdout and "is damaged" in done.stdout and "Delete" in done.stdout
    assert (run_folder(done.stdout) / "config.yaml").is_file()


def test_bad_submission_creates_nothing(tmp_path: Path) -> None:
    for args in (
        ["--mode", "dp", "--nodes", "2"],
        ["train.epoch=2"],
        ["--mode", "ddp", "cluster.backend=local", "--nodes", "2"],
    ):
        done = kit("launch", "submit", *args, f"output.root={tmp_path}/runs")
        assert done.returncode == 2, args
        assert done.stderr.startswith("error: ")
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_the_convnet_learns_the_embedded_digits(tmp_path: Path) -> None:
    """The embedded default is learnable: far above chance (10 %) after 188 steps of 32 (84.6 %
    on the 2-core build machine; the full 10 epochs over 60k reach about 99 %, as real MNIST
    does)."""
    sizes = [
        "data.train_size=3000",
        "data.test_size=1000",
        "train.epochs=2",
        "train.global_batch_size=32",
    ]
    done = kit(
        "launch",
        "submit",
        "--mode",
        "dp",
        *sizes,
        "cluster.backend=local",
        f"output.root={tmp_path}/runs",
        f"data.root={tmp_path}/data",
        "--wait",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    start, *_, summary = records(run_folder(done.stdout))
    assert summary["final_test_accuracy"] >= 0.8
    # Where start-up went, phase by phase, adds up to the whole.
    parts = start["startup_parts"]
    assert list(parts) == ["python_and_imports", "process_group", "model_and_state", "data"]
    assert start["bytecode_cached"] is True  # the venv's torch, from its bytecode cache
    assert abs(sum(parts.values()) - start["startup_s"]) < 0.05


def test_a_run_whose_loss_becomes_nan_ends_diverged(tmp_path: Path) -> None:
    """train.lr=1e12 blows the weights up in the first steps: the run stops at the end of that
    epoch, says so at --wait (exit 1, no `done`), status reads DIVERGED with the advice, and
    summarize leaves it out of the comparison, saying why."""
    where = ["cluster.backend=local", f"output.root={tmp_path}/runs", f"data.root={tmp_path}/data"]
    done = kit(
        "launch", "submit", "--mode", "ddp", *SMALL, "cluster.gpus_per_node=2", "train.lr=1e12",
        "data.train_size=256", "train.global_batch_size=128", *where, "--wait", "-v",
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    run_dir = run_folder(done.stdout)
    # -v: the launcher's decisions, and each rank's environment and rendezvous in its log.
    assert f"backend local, run folder {run_dir}" in done.stderr, done.stderr
    rank_log = kit("launch", "logs", str(run_dir), "--rank", "1").stdout
    assert "rank 1: DistEnv(rank=1" in rank_log and "rank 1: rendezvous at 127.0.0.1:" in rank_log
    assert "diverged: its test loss became nan in epoch 1" in done.stdout, done.stdout
    assert "lower train.lr" in done.stdout and " done: " not in done.stdout
    assert [r["epoch"] for r in records(run_dir) if r["kind"] == "epoch"] == [1]  # then it stopped
    status = kit("launch", "status", str(run_dir)).stdout
    assert " DIVERGED " in status and f"{run_dir.name}: diverged: " in status, status
    summarized = kit("analysis", "summarize", str(run_dir))
    assert f"skipped {run_dir.name}: diverged (test loss nan in epoch 1)" in summarized.stderr
