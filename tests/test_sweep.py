"""`launch sweep`'s grid, and local sweeps: one run after another (or N at once), the failed
run named."""

from __future__ import annotations

import json
import math
import os
from datetime import datetime
from pathlib import Path

import pytest
import torch
from kit import REPO, SMALL, kit, records

from slurm_ddp_kit.core.settings.schema import ConfigError
from slurm_ddp_kit.launch.sweep import grid


def test_grid_is_the_product_in_order() -> None:
    assert grid(["a=1,2", "b=x,y,z"]) == [
        ("a=1", "b=x"),
        ("a=1", "b=y"),
        ("a=1", "b=z"),
        ("a=2", "b=x"),
        ("a=2", "b=y"),
        ("a=2", "b=z"),
    ]
    assert grid(["train.epochs=3"]) == [("train.epochs=3",)]
    assert grid([]) == [()]  # no --grid: one run with the plain config


@pytest.mark.parametrize("item", ["a", "a=", "=1,2", "a=1,,2", "a=1,", "a=,1"])
def test_grid_refuses_a_bad_item(item: str) -> None:
    with pytest.raises(ConfigError, match=r"is not of the form key=v1,v2, e\.g\. "):
        grid(["b=1", item])


SMALL_NO_EPOCHS = [s for s in SMALL if not s.startswith("train.epochs=")]


def _sweep(tmp: Path, *args: str) -> list[Path]:
    """A local DDP sweep's run folders, one rank a run (the order of runs is what these tests
    read)."""
    done = kit(
        "launch",
        "sweep",
        "--modes",
        "ddp",
        *args,
        "cluster.backend=local",
        "cluster.gpus_per_node=1",
        *SMALL_NO_EPOCHS,
        f"output.root={tmp}/runs",
        f"data.root={tmp}/data",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("submitted job ")]
    return [Path(line.split("run folder: ", 1)[1]) for line in lines]


def _times(run_dir: Path) -> tuple[float, float]:
    """(first start, summary) of rank 0, from its records."""
    recs = records(run_dir)
    start = next(r["time"] for r in recs if r["kind"] == "start")
    summary = next(r["time"] for r in recs if r["kind"] == "summary")
    return start, summary


def test_local_sweep_parallel_lets_runs_overlap(tmp_path: Path) -> None:
    first, second = _sweep(tmp_path, "--grid", "train.epochs=4,1", "--parallel", "2")
    (first_start, first_done), (second_start, second_done) = _times(first), _times(second)
    # Loose on purpose: the second run was submitted before the first finished (run.json's
    # creation time has whole seconds), and both completed.
    created = json.loads((second / "run.json").read_text())["created"]
    assert datetime.fromisoformat(created).timestamp() < first_done
    assert first_start < first_done and second_start < second_done


class _BrokenInTraining(torch.nn.Linear):
    """Passes the launcher's trial (one forward in eval mode), fails once it trains."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            raise ValueError("a bug in this model (injected)")
        return super().forward(x.flatten(1))


def broken_model(shape: tuple[int, ...], classes: int) -> torch.nn.Module:
    return _BrokenInTraining(math.prod(shape), classes)


def test_a_local_sweep_runs_one_after_another_and_says_which_failed(tmp_path: Path) -> None:
    """In the grid's order, the second run started once the first had ended (so neither spoils
    the other's timings); the failed one is named, the tally says it, exit 1."""
    tests = Path(__file__).parent
    done = kit(
        "launch", "sweep", "--modes", "ddp", "--grid", "model.name=convnet,test_sweep:broken_model",
        "cluster.backend=local", "cluster.gpus_per_node=1", *SMALL_NO_EPOCHS, "train.epochs=1",
        f"output.root={tmp_path}/runs", f"data.root={tmp_path}/data", env={"PYTHONPATH": os.pathsep.join([str(tests), str(REPO)])},
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    submitted = [line for line in done.stdout.splitlines() if line.startswith("submitted job ")]
    assert len(submitted) == 2  # each with its grid point
    assert "  mode=ddp model.name=convnet  run folder: " in submitted[0]
    assert "  mode=ddp model.name=test_sweep:broken_model  run folder: " in submitted[1]
    lines = done.stdout.splitlines()  # then each completed run's result, and the tally
    first, second = (Path(line.split("run folder: ")[1]) for line in submitted)
    assert "name: convnet" in (first / "config.yaml").read_text()  # the grid's order
    # Each run.json keeps its own point's command, not the whole grid's.
    command = json.loads((first / "run.json").read_text())["command"]
    assert command[:4] == ["python", "-m", "launch", "sweep"] and "--grid" not in command
    assert command[-3:] == ["--modes", "ddp", "--grid=model.name=convnet"], command
    second_start = next(r["time"] for r in records(second) if r["kind"] == "start")
    assert second_start > _times(first)[1]  # after the first's summary: one after another
    assert any(line.startswith(f"{first.name}: test accuracy ") for line in lines), done.stdout
    assert lines[-1] == "1 of the sweep's 2 runs completed"
    failed = done.stderr.splitlines()
    assert "failed first: ValueError: a bug in this model (injected)" in failed[0]
    assert failed[1] == "1 of the sweep's 2 runs failed: see `python -m launch logs RUN`"
