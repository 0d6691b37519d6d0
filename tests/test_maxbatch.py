"""The largest-batch search's trials with every collective of a real step, on CPU with gloo: two
job processes, each with its worker; rank 1's model fails past a size (the factories below), as a
GPU out of memory would, while rank 0 goes on into the step's collectives and would wait there for
ever. The search must end rank 0's stuck worker, agree, carry on, and report what rank 1 saw.

The faults are injected by the model (a CPU has no device memory to run out of); the real
out-of-memory path runs on GPUs in tests/test_gpu.py."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from kit import spawned_ranks
from torch import nn

from slurm_ddp_kit.core import strategies
from slurm_ddp_kit.core.errors import KitError
from slurm_ddp_kit.core.settings.loading import load_config
from slurm_ddp_kit.train import largest_batch

LIMIT = 700  # samples per rank past which rank 1's model fails
SHAPE, CLASSES = (1, 4, 4), 3
# The search starts at 512: one doubling to the limit and its bisection, in few trials.
SETTINGS = ["train.global_batch_size=512", "dist.timeout_s=60"]


class Fragile(nn.Module):
    """Two layers (FSDP shards each); `fail` runs in rank 1's forward past LIMIT samples."""

    def __init__(self, fail: Any) -> None:
        super().__init__()
        self.fail = fail
        self.first = nn.Sequential(nn.Flatten(), nn.Linear(16, 32), nn.ReLU())
        self.last = nn.Linear(32, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rank = dist.get_rank() if dist.is_initialized() else 1
        if rank == 1 and len(x) > LIMIT:
            self.fail()
        return self.last(self.first(x))


def _oom() -> None:
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")


def _bug() -> None:
    raise ValueError("a bug in the user's model (injected)")


def _killed() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _hang() -> None:
    Path(os.environ["KIT_TEST_WORKER_PID"]).write_text(str(os.getpid()))
    time.sleep(600)


def hangs_on_rank1(shape: tuple[int, ...], classes: int) -> nn.Module:
    return Fragile(_hang)


def oom_on_rank1(shape: tuple[int, ...], classes: int) -> nn.Module:
    return Fragile(_oom)


def bug_on_rank1(shape: tuple[int, ...], classes: int) -> nn.Module:
    return Fragile(_bug)


def killed_on_rank1(shape: tuple[int, ...], classes: int) -> nn.Module:
    return Fragile(_killed)


def _job_process(rank: int, world: int, port: int, cases: list[list[str]], out: Any) -> None:
    """One rank of a largest-batch job, as train.job runs it: a gloo group, then a search for
    each case in turn (one job process serves several, as starting one costs seconds)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    if world > 1:
        dist.init_process_group("gloo", init_method="env://")
    try:
        for case, settings in enumerate(cases):
            cfg = load_config((), [*SETTINGS, *settings])
            store = ("127.0.0.1", port) if world > 1 else None
            spec = largest_batch.Spec(cfg, rank, world, "cpu", 0, SHAPE, CLASSES, 1, store, "gloo")
            try:
                found, trials = largest_batch.search(
                    largest_batch.Trials(spec), cfg.train.global_batch_size, world
                )
                out.put((case, rank, found, trials))
            except KitError as err:
                out.put((case, rank, None, str(err)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _search(*cases: list[str], world: int = 2) -> list[dict[int, tuple[Any, Any]]]:
    """For each case (its settings), each rank's (largest batch, trials or error), from real
    job processes."""
    results: list[dict[int, tuple[Any, Any]]] = [{} for _ in cases]
    answers = world * len(cases)  # each search ends in time
    for case, rank, found, trials in spawned_ranks(
        _job_process, world, list(cases), answers=answers
    ):
        results[case][rank] = (found, trials)
    return results


# Every strategy with a process per GPU (from the registry), and one with a communication hook.
STRATEGIES = {
    **{s.name: [f"mode={s.name}"] for s in strategies.STRATEGIES.values() if s.per_gpu},
    "ddp+bf16": ["mode=ddp", "dist.comm_hook=bf16"],
}
FAILURES = {
    "bug_on_rank1": "rank 1: ValueError: a bug in the user's model (injected)",
    "killed_on_rank1": "rank 1: the worker process was ended by SIGKILL",
}


@pytest.fixture(scope="module")
def searched() -> dict[str, dict[int, tuple[Any, Any]]]:
    """Every two-rank case's search, one after another in one pair of job processes: each
    strategy's with rank 1 out of memory past LIMIT, then each other failure's under DDP."""
    cases = {
        **{name: ["model.name=test_maxbatch:oom_on_rank1", *s] for name, s in STRATEGIES.items()},
        **{name: [f"model.name=test_maxbatch:{name}", "mode=ddp"] for name in FAILURES},
    }
    return dict(zip(cases, _search(*cases.values()), strict=True))


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_rank_out_of_memory_ends_the_trial_on_every_rank(
    searched: dict[str, dict[int, tuple[Any, Any]]], strategy: str
) -> None:
    results = searched[strategy]
    (found, trials), other = results[0], results[1]
    assert other == results[0]  # both ranks agree on every trial and the answer
    limit = 2 * LIMIT  # global: two ranks
    assert found is not None and limit * (1 - largest_batch.TOLERANCE) <= found <= limit
    assert [t["fits"] for t in trials] == [t["global_batch"] <= limit for t in trials]
    assert sum(not t["fits"] for t in trials) >= 2  # the search went on past failures


def test_one_process_dp_search_recovers_from_out_of_memory() -> None:
    (found, trials) = _search(["model.name=test_maxbatch:oom_on_rank1", "mode=dp"], world=1)[0][0]
    assert found is not None and LIMIT * (1 - largest_batch.TOLERANCE) <= found <= LIMIT
    assert sum(not t["fits"] for t in trials) >= 2


@pytest.mark.parametrize("factory", list(FAILURES))
def test_a_failure_other_than_memory_stops_every_rank_with_its_reason(
    searched: dict[str, dict[int, tuple[Any, Any]]], factory: str
) -> None:
    for rank in (0, 1):
        found, error = searched[factory][rank]
        assert found is None
        assert "the largest-batch search stopped at a global batch of 2048" in error, error
        assert FAILURES[factory] in error


def _ended(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_a_job_process_killed_mid_trial_takes_its_worker_with_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGKILL, as Slurm's or a cancel's last word: no handler runs, yet the worker (which may
    hold a GPU) must not outlive the job process."""
    marker = tmp_path / "worker.pid"
    monkeypatch.setenv("KIT_TEST_WORKER_PID", str(marker))  # the job process inherits it
    context = multiprocessing.get_context("spawn")
    settings = ["model.name=test_maxbatch:hangs_on_rank1", "mode=dp"]
    out = context.Queue()
    job = context.Process(target=_job_process, args=(0, 1, 0, [settings], out))
    job.start()
    deadline = time.monotonic() + 120
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    worker = int(marker.read_text())  # the trial past LIMIT samples, hanging in its forward
    assert not _ended(worker)
    job.kill()
    job.join()
    deadline = time.monotonic() + 30
    while not _ended(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _ended(worker), f"worker {worker} outlived its job process"
