"""The sharded strategies stopped by the time-limit signal and resumed: ZeRO gathers its
optimizer state to save it and shards it again, FSDP saves and reads each rank's own shards; both
end with the parameters of the same run never stopped (CPU, gloo)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from kit import TINY_GPT, kit, records
from paced import PACED, PACED_GPT
from test_strategies import TWO_RANKS, _submit

from slurm_ddp_kit.core import runfolder, strategies


# From the registry: every strategy past the article's pair (those that shard their state).
@pytest.mark.parametrize(
    "mode", [s.name for s in strategies.STRATEGIES.values() if not s.always_shown]
)
def test_sharded_run_stopped_and_resumed_ends_as_if_never_stopped(
    tmp_path: Path, mode: str
) -> None:
    """Stopped by the time-limit signal inside its second epoch, saved (the shards gathered),
    resumed (the whole state re-sharded): the parameters of the run that was never stopped."""
    work = ["--mode", mode, *TWO_RANKS, "data.train_size=384", "data.test_size=128",
            "train.global_batch_size=64", "train.epochs=3", "cluster.cpus_per_task=1",
            "cluster.timeout_min=10"]  # fmt: skip
    reference = _submit(tmp_path / "reference", *work)
    run_dir = _submit(tmp_path / "stopped", *work, PACED, wait=False)  # 4 s an epoch: paced
    _stop_and_resume(run_dir)
    hashes = {records(d, r)[-1]["parameters_sha256"] for d in (reference, run_dir) for r in (0, 1)}
    assert len(hashes) == 1


def test_fsdp_gpt_stopped_and_resumed_ends_as_if_never_stopped(tmp_path: Path) -> None:
    """The GPT sharded block by block, with AdamW: its shards saved at the stop and read back
    give the parameters of the run never stopped (the paced factory builds the same GPT)."""
    tokens = [arg for arg in TINY_GPT if arg.startswith("data.")]
    model = [arg for arg in TINY_GPT if arg.startswith("model.")]  # what the paced factory builds
    work = ["--mode", "fsdp", *TWO_RANKS, *tokens, "data.train_size=192", "data.test_size=64",
            "train.global_batch_size=32", "train.epochs=3", "train.optimizer=adamw",
            "train.lr=0.003", "cluster.cpus_per_task=1", "cluster.timeout_min=10"]  # fmt: skip
    reference = _submit(tmp_path / "reference", *work, *model)
    run_dir = _submit(tmp_path / "stopped", *work, PACED_GPT, wait=False)  # 4 s an epoch
    _stop_and_resume(run_dir)
    starts = [records(d)[0] for d in (reference, run_dir)]
    assert starts[0]["parameters"] == starts[1]["parameters"]  # the same GPT
    hashes = {records(d, r)[-1]["parameters_sha256"] for d in (reference, run_dir) for r in (0, 1)}
    assert len(hashes) == 1


def _stop_and_resume(run_dir: Path) -> None:
    """The time-limit signal to both ranks once an epoch is done; then `launch resume`."""
    deadline = time.monotonic() + 180
    while not runfolder.of_kind(runfolder.read_rank(run_dir, 0), "epoch"):
        assert time.monotonic() < deadline, "no epoch within 180 s"
        time.sleep(0.2)
    for rank in (0, 1):
        os.kill(runfolder.of_kind(runfolder.read_rank(run_dir, rank), "start")[0]["pid"],
                signal.SIGUSR2)  # fmt: skip
    while " STOPPED " not in kit("launch", "status", str(run_dir)).stdout:
        assert time.monotonic() < deadline, "not STOPPED within 180 s"
        time.sleep(0.5)
    resumed = kit("launch", "resume", str(run_dir), "--wait")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
