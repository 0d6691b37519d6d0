"""Run the kit's own commands the way a user does: a real process, its output and exit code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

# Tiny but real: every figure and file of a full run, in seconds on a 2-core machine.
SMALL = ["data.train_size=1024", "data.test_size=256", "train.epochs=2", "cluster.timeout_min=10"]


def kit(
    *args: str, cwd: Path | None = None, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """`python -m <args>` in a fresh interpreter, output captured."""
    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=cwd or REPO,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            **(env or {}),
        },
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_folder(stdout: str) -> Path:
    """The run folder `launch submit` printed."""
    line = next(line for line in stdout.splitlines() if line.startswith("run folder: "))
    return Path(line.removeprefix("run folder: "))


def records(run_dir: Path, rank: int = 0) -> list[dict[str, Any]]:
    path = run_dir / "metrics" / f"rank-{rank:05d}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def wait_for(what: Callable[[], bool], seconds: float) -> bool:
    """Poll until `what()` holds or `seconds` pass; its last answer."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if what():
            return True
        time.sleep(0.2)
    return what()


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its parent to reap it is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
