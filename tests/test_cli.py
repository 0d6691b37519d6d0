"""`python -m launch` refusing what it cannot do as asked: one line, exit 2, nothing made."""

from __future__ import annotations

from pathlib import Path

import pytest
from kit import SMALL, kit, kit_here


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
