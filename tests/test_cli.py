"""`python -m launch` refusing what it cannot do as asked: one line, exit 2, nothing made."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from kit import REPO, SMALL, kit, kit_here


@pytest.mark.parametrize(
    ("given", "named", "fix"),
    [
        (["--modes", "dp,ddp", "--mode", "zero"], "--mode zero", "--modes zero"),
        (["--modes", "dp,ddp", "mode=zero"], "mode=zero", "--modes zero"),
        (["--grid", "mode=dp,zero"], "mode=dp,zero", "--modes dp,zero"),
        (["--modes", "ddp,ddp"], "--modes ddp,ddp", "--modes ddp"),
    ],
)
def test_sweep_refuses_a_mode_besides_its_modes(
    tmp_path: Path, given: list[str], named: str, fix: str
) -> None:
    """Another mode would override each of --modes: identical runs, one per mode."""
    done = kit(
        "launch",
        "sweep",
        *given,
        "cluster.backend=local",
        *SMALL,
        f"output.root={tmp_path}/runs",
        f"data.root={tmp_path}/data",
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == ""
    [line] = done.stderr.splitlines()
    assert line.startswith("error: ") and named in line and line.endswith(f"e.g. {fix}")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("grid", "named"),
    [
        (["train.lr=0.1,0.2", "train.lr=0.3"], "--grid train.lr is given twice"),
        (["train.lr=0.1,0.1"], "--grid 'train.lr=0.1,0.1' names a value twice"),
    ],
)
def test_sweep_refuses_a_point_that_would_run_twice(
    tmp_path: Path, grid: list[str], named: str
) -> None:
    args = [arg for item in grid for arg in ("--grid", item)]
    where = [f"output.root={tmp_path}/runs", f"data.root={tmp_path}/data"]
    done = kit_here("launch", "sweep", *args, "cluster.backend=local", *SMALL, *where)
    assert done.returncode == 2 and done.stdout == "", done.stdout + done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith("error: ") and named in line
    assert not (tmp_path / "runs").exists()


COMMANDS = [
    *(("launch", name) for name in ("config", "submit", "sweep", "prepare", "status", "resume")),
    ("launch", "cancel"),
    ("launch", "logs"),
    ("analysis", "summarize"),
    ("train", "run"),
    ("train", "prepare-data"),
    ("train", "fetch-mnist"),
]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_command_takes_version_verbose_and_quiet(command: tuple[str, str]) -> None:
    module, name = command
    done = kit_here(module, name, "--version")
    assert done.returncode == 0 and done.stdout.startswith(f"python -m {module} {name} "), done
    helped = kit_here(module, name, "--help").stdout
    assert "-v, --verbose" in helped and "-q, --quiet" in helped, helped


def test_sweep_help_lists_only_what_sweep_takes() -> None:
    helped = kit_here("launch", "sweep", "--help").stdout
    assert "--modes" in helped and "--mode " not in helped and "--mode {" not in helped


@pytest.mark.parametrize("script", ["ddp", "dp"])
def test_a_batch_script_run_outside_slurm_says_how_to_submit_it(script: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    done = subprocess.run(
        ["bash", str(REPO / f"slurm/{script}.sbatch")], env=env, capture_output=True, text=True
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith(f"error: submit this script with sbatch (sbatch slurm/{script}")


def test_sweep_dry_run_prints_each_point_and_the_array_script(tmp_path: Path) -> None:
    done = kit_here(
        "launch", "sweep", "--dry-run", "--modes", "dp,ddp", "--grid", "train.lr=0.1,0.2",
        "cluster.backend=slurm", f"output.root={tmp_path}/runs",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[:4] == [
        "point 0: mode=dp train.lr=0.1",
        "point 1: mode=dp train.lr=0.2",
        "point 2: mode=ddp train.lr=0.1",
        "point 3: mode=ddp train.lr=0.2",
    ]
    assert sum(line.startswith("run folder (made on submit): ") for line in lines) == 4
    assert "#SBATCH --array=0-3%4" in lines
    # Every element's tasks start as a job's do: the stop signals held before Python loads.
    assert "-m train.start -u -m submitit.core._submit" in done.stdout
    assert not (tmp_path / "runs").exists()  # nothing made, nothing submitted
