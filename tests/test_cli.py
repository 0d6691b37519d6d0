"""`python -m launch` refusing what it cannot do as asked: one line, exit 2, nothing made."""

from __future__ import annotations

from pathlib import Path

import pytest
from kit import SMALL, kit


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
